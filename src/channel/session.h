// Channel sessions: the Manager's and the engine's ends of one connection.
//
// A session is one SOCK_SEQPACKET connection plus its descriptor arena and two doorbells. The
// engine connects and sends Hello; the Manager checks SO_PEERCRED, creates the arena and answers
// Welcome with three fds (arena, doorbell to the Manager, doorbell to the engine), or Reject with a
// reason. Hot requests then flow through the rings; lifecycle frames (and a final Reject when the
// Manager poisons the session) through the socket. The session ends when either side closes the
// socket: the Manager sees the hangup and cleans up everything the session owned, without any
// further message from the engine.
//
// Thread safety: a ClientSession is used by one thread at a time. A ServerSession is driven by one
// dispatcher thread, except Reply/ReplyError, which copy-completion threads may call concurrently
// (they serialize on the reply ring's mutex).
#ifndef ORBITKV_CHANNEL_SESSION_H_
#define ORBITKV_CHANNEL_SESSION_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "base/clock.h"
#include "base/mutex.h"
#include "base/result.h"
#include "base/scoped_fd.h"
#include "channel/arena.h"
#include "channel/claims.h"
#include "channel/uds.h"
#include "channel/wire.h"

namespace orbitkv::channel {

struct AcceptOptions {
  // Same uid as the Manager always passes; these uids also may connect.
  std::vector<uid_t> allowed_uids;
  uint64_t session_id = 0;
  uint64_t session_epoch = 0;
  uint64_t manager_incarnation = 0;
  ArenaLayout default_layout;                // used for fields the Hello leaves 0
  Deadline deadline = Deadline::Infinite();  // for reading the Hello
};

// A request copied out of shared memory and checked against the session (epoch, slot generation).
struct InboundRequest {
  Descriptor descriptor{};
  std::vector<uint8_t> payload;
  Opcode opcode() const { return static_cast<Opcode>(descriptor.opcode); }
};

class ServerSession {
 public:
  // Authenticates the connected peer, reads its Hello and answers Welcome (or Reject, returning the
  // reason): PermissionDenied for a uid not allowed, InvalidArgument/FailedPrecondition for a bad
  // Hello.
  static Result<std::unique_ptr<ServerSession>> Accept(ScopedFd connection, const AcceptOptions& options);

  uint64_t session_id() const { return session_id_; }
  SessionRole role() const { return role_; }
  uint64_t control_session() const { return control_session_; }
  const PeerCredentials& peer() const { return peer_; }
  int socket_fd() const { return socket_.get(); }
  int request_doorbell_fd() const { return to_manager_.fd().get(); }
  const DescriptorArena& arena() const { return *arena_; }

  // The next request, or nullopt when the ring is empty. Any violation (corrupt ring, bad
  // descriptor, wrong epoch, stale or replayed generation) is an error: the caller must Poison the
  // session.
  Result<std::optional<InboundRequest>> NextRequest();
  // Before sleeping on request_doorbell_fd: true when a request arrived meanwhile (then do not
  // sleep).
  Result<bool> PrepareToWait() { return requests_.PrepareToWait(); }
  void ClearWaiting() { requests_.ClearWaiting(); }
  void DrainDoorbell() { to_manager_.Drain(); }

  // Answers `request` with `code`, args and an optional payload (written into the request's slot,
  // at most slot_bytes). Errors: ResourceExhausted if the reply ring is full (the engine exceeded
  // its outstanding limit), DataLoss if the engine corrupted the ring: poison in both cases.
  Status Reply(const Descriptor& request, StatusCode code, uint64_t arg0, uint64_t arg1,
               std::span<const uint8_t> payload = {}) EXCLUDES(reply_mu_);
  // Replies with an error status and its message as the payload.
  Status ReplyError(const Descriptor& request, const Status& status) EXCLUDES(reply_mu_);
  // An OK reply with `args` (channel/messages.h's Encode*Reply), or the error reply of `reply`.
  Status Answer(const Descriptor& request, const Result<ReplyArgs>& reply, std::span<const uint8_t> payload = {})
      EXCLUDES(reply_mu_) {
    if (!reply.ok()) return ReplyError(request, reply.status());
    return Reply(request, StatusCode::kOk, reply->arg0, reply->arg1, payload);
  }
  // True once a Reply failed: the dispatcher must poison the session.
  bool broken() const { return broken_.load(std::memory_order_acquire); }

  // Reads one lifecycle frame if the socket is readable (non-blocking): nullopt when none is
  // pending; Unavailable when the engine closed the session.
  Result<std::optional<Frame>> ReadFrame();
  Status SendLifecycleReply(uint64_t request_id, const Status& status, uint64_t value = 0);

  // Sends Reject with `reason` (best effort) and shuts the socket down; later calls fail.
  void Poison(const Status& reason);
  bool poisoned() const { return poisoned_; }

 private:
  ServerSession(ScopedFd socket, PeerCredentials peer, std::unique_ptr<DescriptorArena> arena, Doorbell to_manager,
                Doorbell to_engine, uint64_t session_id, SessionRole role, uint64_t control_session);

  ScopedFd socket_;
  PeerCredentials peer_;
  std::unique_ptr<DescriptorArena> arena_;
  Doorbell to_manager_;
  Doorbell to_engine_;
  RingConsumer requests_;
  Mutex reply_mu_;
  RingProducer replies_ GUARDED_BY(reply_mu_);
  // Release/acquire: a completion thread's failed Reply happens before the dispatcher's poisoning.
  std::atomic<bool> broken_{false};
  uint64_t session_id_;
  SessionRole role_;
  uint64_t control_session_;
  std::vector<uint32_t> last_generation_;  // per payload slot, the newest request generation seen
  bool poisoned_ = false;
};

struct ConnectOptions {
  SessionRole role = SessionRole::kControl;
  uint64_t control_session = 0;
  uint32_t ring_entries = 0;  // 0: the Manager's defaults
  uint32_t payload_slots = 0;
  uint32_t slot_bytes = 0;
  Deadline deadline = Deadline::After(std::chrono::seconds(5));
};

// A reply as the engine sees it.
struct InboundReply {
  Descriptor descriptor{};
  StatusCode code() const { return static_cast<StatusCode>(descriptor.status); }
};

class ClientSession {
 public:
  // Connects to the Manager at `socket_path` and opens a session. Unavailable when no Manager
  // listens there, PermissionDenied (with the Manager's reason) when refused.
  static Result<std::unique_ptr<ClientSession>> Connect(const std::string& socket_path, const ConnectOptions& options);

  const WelcomeBody& welcome() const { return welcome_; }
  uint64_t session_id() const { return welcome_.session_id; }
  uint32_t payload_slots() const { return welcome_.payload_slots; }
  uint32_t slot_bytes() const { return welcome_.slot_bytes; }
  int reply_doorbell_fd() const { return to_engine_.fd().get(); }
  int request_doorbell_fd() const { return to_manager_.fd().get(); }
  // Makes the Manager ring reply_doorbell_fd for every reply (not only while this side sleeps), so
  // a caller can poll/epoll that fd for completions. Costs one eventfd write per reply.
  Status EnableCompletionFd();
  int socket_fd() const { return socket_.get(); }

  // Slot bookkeeping: the caller owns a slot from AcquireSlot until its reply arrived. The slot of a
  // request still outstanding stays retired on ReleaseSlot (its late reply can still be waited for,
  // and released then); AbandonSlot gives it up for good: the late reply is dropped when it comes,
  // and only then is the slot free again (the Manager may write it until then).
  Result<uint32_t> AcquireSlot();
  void ReleaseSlot(uint32_t slot);
  void AbandonSlot(uint32_t slot);
  // Called (from PollReply, on the thread reading replies) with each late reply of an abandoned
  // slot before it is dropped: a query answered after its caller gave up may carry a lease.
  void SetAbandonedReplyHandler(std::function<void(const InboundReply&)> handler) {
    abandoned_reply_handler_ = std::move(handler);
  }
  std::span<uint8_t> slot(uint32_t index) const { return arena_->slot(index); }

  // Claims (channel/claims.h) of saves and restores: ArmClaim before Submit (it names the
  // generation Submit will give the slot's next request, returned), AbandonClaim when the wait ran
  // out.
  uint32_t ArmClaim(uint32_t slot);
  ClaimState AbandonClaim(uint32_t slot, uint32_t generation);
  // After the session died: whether a claimed operation may still be running (the Manager process
  // lives and has not marked it done), so its pages must stay reserved.
  bool ClaimStillRunning(uint32_t slot, uint32_t generation);
  // The operation is over for the engine (channel::Settle): a GPU stream waiting on its word goes on.
  void SettleClaim(uint32_t slot, uint32_t generation);
  // The claim words, one u64 per payload slot from the span's start (slot i at byte 8 * i), in the
  // arena's last page(s): page-aligned and a whole number of pages, so an engine can register them
  // with CUDA and let its streams wait on a word (channel::SettledWord).
  std::span<uint8_t> claim_region() const { return arena_->claim_region(); }

  // Sends a request: fills magic, version, epoch, id and a fresh generation for `slot` into `d` and
  // pushes it. Returns the request id. ResourceExhausted when the ring is full (nothing sent).
  // A request pushed is sent even when the doorbell then fails: that kills the session (the wait
  // fails), never returns an error that would make the request look unsent.
  Result<uint64_t> Submit(Descriptor d, uint32_t slot, uint32_t payload_bytes);
  // Next reply if any (non-blocking). Replies with a stale generation are dropped. DataLoss on a
  // corrupt ring.
  Result<std::optional<InboundReply>> PollReply();
  // For callers that wait on several threads (CacheClient): before sleeping on reply_doorbell_fd
  // and socket_fd without holding the session, ArmReplyDoorbell (true: a reply is already there,
  // poll instead); after waking, DisarmReplyDoorbell with what poll() returned for the two fds
  // (drains the doorbell; reads the Manager's reason if the socket closed).
  Result<bool> ArmReplyDoorbell();
  Status DisarmReplyDoorbell(short doorbell_revents, short socket_revents);
  // Waits for the reply to `request_id`: spins `spin_iterations` polls, then sleeps on the
  // doorbell. Replies to other requests that arrive meanwhile are kept for later WaitReply calls.
  // DeadlineExceeded leaves the request outstanding (its slot stays owned); Unavailable/Aborted
  // when the Manager closed or poisoned the session.
  Result<InboundReply> WaitReply(uint64_t request_id, Deadline deadline, int spin_iterations = 4096);

  // Sends a lifecycle frame (with fds) and waits for its LifecycleReply; returns the reply's value.
  Result<uint64_t> Lifecycle(FrameType type, std::span<const uint8_t> body, std::span<const int> fds,
                             Deadline deadline);

 private:
  ClientSession(ScopedFd socket, const WelcomeBody& welcome, std::unique_ptr<DescriptorArena> arena,
                Doorbell to_manager, Doorbell to_engine);
  // Why the session died, if the Manager said so on the socket (non-blocking).
  Status SocketStatus();

  ScopedFd socket_;
  WelcomeBody welcome_;
  std::unique_ptr<DescriptorArena> arena_;
  Doorbell to_manager_;
  Doorbell to_engine_;
  RingProducer requests_;
  RingConsumer replies_;
  uint64_t next_request_id_ = 1;
  std::vector<uint32_t> generation_;    // per slot, the generation of its current request
  std::vector<uint64_t> slot_request_;  // per slot, the request id in flight (0: none)
  std::function<void(const InboundReply&)> abandoned_reply_handler_;
  std::vector<bool> abandoned_;  // per slot: released while in flight, free on its reply
  std::vector<uint32_t> free_slots_;
  std::vector<InboundReply> parked_;  // replies that arrived while waiting for another request
  Status dead_;                       // set once the session is known dead
  bool always_wake_ = false;          // EnableCompletionFd: consumer_waiting stays set
};

}  // namespace orbitkv::channel

#endif  // ORBITKV_CHANNEL_SESSION_H_
