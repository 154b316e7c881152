// CacheClient: the engine side of OrbitKV. It owns the engine's sessions with its host's Manager
// and the state of every request it sends, and exposes the placement-neutral cache API (DESIGN.md
// §4).
//
//   RegisterInstance / RegisterGroup   bind the engine's namespace and its KV buffers (shared-memory
//                                      fds, process memory or CUDA IPC handles) once;
//   Query                              the longest resident prefix, leased (hits, lease), Loading
//                                      (the rest is being brought into DRAM: ask again, or
//                                      QueryWait / WaitLoading for its completion), or a miss;
//   StartRestore / WaitRestore         copy leased blocks into the engine's pages, one completion
//                                      per restore;
//   Save                               copy pages out and seal them, replying once resident;
//   Release / Cancel                   give back a lease the engine will not restore from, or a
//                                      Loading operation it no longer wants.
//
// Saves travel on a second session opened on first use, so a long save never queues queries or
// restores behind it. Timeouts never free memory the Manager may still use: a restore that timed
// out stays pending (poll it again) and its request slot is not reused until its reply arrives. If
// the Manager dies, every call fails with Unavailable within its timeout; a poisoned session
// reports the Manager's reason. Every request and reply goes through channel/messages' codecs.
//
// Links only base, state and channel (no gRPC, UCX, CUDA). Thread safety: all methods are safe from
// any thread. Control calls share one session: a thread waiting for its reply (a restore, a Loading
// wait, a query) does not hold the session while it sleeps, so other threads' queries and restores
// proceed meanwhile; saves serialize on their own session.
#ifndef ORBITKV_CLIENT_CACHE_CLIENT_H_
#define ORBITKV_CLIENT_CACHE_CLIENT_H_

#include <sys/types.h>

#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <queue>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "base/mutex.h"
#include "base/result.h"
#include "base/thread_annotations.h"
#include "channel/messages.h"
#include "channel/session.h"
#include "channel/wire.h"
#include "state/namespace.h"
#include "state/state_key.h"

namespace orbitkv::client {

struct ClientOptions {
  std::string socket_path;  // empty: the Manager's default (see orbitkv-manager --help)
  std::chrono::milliseconds timeout{5000};
  int spin_iterations = 4096;  // reply polls (~10 ns each) before sleeping on the doorbell
};

// A GPU buffer exported with CUDA IPC: the engine calls cudaIpcGetMemHandle (torch:
// untyped_storage()._share_cuda_()) and passes the handle's bytes; this library never calls CUDA.
struct CudaIpcSpec {
  std::array<uint8_t, channel::kCudaIpcHandleBytes> handle{};  // a cudaIpcMemHandle_t's bytes
  uint64_t offset = 0;                                         // where the buffer starts inside the exported allocation
  // The GPU's PCI bus id ("0000:00:06.0", cudaDeviceGetPCIBusId's form): the Manager's CUDA
  // ordinal for the same GPU may differ from the engine's.
  std::string pci_bus_id;
};

// One KV buffer of a group: a memfd sealed against resizing (client/kv_memory.h) the Manager maps, or
// (fd = -1) ordinary memory of this process at `address`, which the Manager (same uid) copies with
// process_vm_readv/writev, or (cuda_ipc set, fd = -1) GPU memory the Manager imports and copies
// with its GPU copy engine (a Manager without a usable GPU refuses it). All buffers of a group are
// of one kind.
struct BufferSpec {
  int fd = -1;                // not consumed: the caller keeps its fd
  uint64_t buffer_bytes = 0;  // size of the object (or of the memory at `address` or `cuda_ipc`)
  uint64_t base_offset = 0;
  uint64_t page_stride = 0;
  uint64_t page_bytes = 0;
  uint64_t address = 0;  // process memory only: where the buffer starts in this process
  std::optional<CudaIpcSpec> cuda_ipc;
};

// A query's answer: Hit (hits > 0, lease), Loading (loading_op != 0: the prefix continues on SSD
// and the Manager is reading it into DRAM; ask again with the same keys, which returns the same op
// until the blocks are in DRAM and then the Hit) or Miss (neither).
struct QueryResult {
  uint32_t hits = 0;        // blocks of the asked prefix resident and leased
  uint64_t lease = 0;       // valid when hits > 0
  uint64_t loading_op = 0;  // non-zero: Loading
  bool partial = false;     // a partial hit (asked with kQueryPartial): the chain's Loading runs on
};

// What a Loading wait heard: the chain's leading blocks in DRAM, and whether the op completed.
struct LoadingProgress {
  uint64_t resident = 0;
  bool completed = true;
};

struct SaveItem {
  state::StateKey key;
  uint32_t page;
};

struct SaveResult {
  uint64_t written = 0;  // blocks copied and sealed
  uint64_t skipped = 0;  // already resident, being written elsewhere, or no room
  // Blocks of requests the Manager claimed (their copy is over, the pages are free again) but did
  // not confirm within the timeout: sealed unless the Manager fails before it seals them.
  uint64_t unconfirmed = 0;
  // Requests abandoned at the timeout before the Manager claimed them (never sealed).
  uint64_t abandoned_requests = 0;
};

class CacheClient {
 public:
  static Result<std::unique_ptr<CacheClient>> Connect(const ClientOptions& options);
  ~CacheClient();
  CacheClient(const CacheClient&) = delete;
  CacheClient& operator=(const CacheClient&) = delete;

  const std::string& socket_path() const { return socket_path_; }
  uint64_t session_id() const { return session_id_; }
  uint64_t manager_incarnation() const { return manager_incarnation_; }

  // `label` says what the engine is (model, weights, rank) for `orbitkv status`: printable UTF-8,
  // cut at channel::kMaxInstanceLabel bytes.
  Status RegisterInstance(uint64_t instance, const state::StateNamespace& ns, std::string_view label = {});
  // Returns the padded bytes of one block (what a query charges per block).
  Result<uint64_t> RegisterGroup(uint64_t instance, uint32_t group, uint32_t num_pages,
                                 std::span<const BufferSpec> buffers);
  Status UnregisterInstance(uint64_t instance);

  // The longest resident prefix of a chain of pages. Keys must form a chain (same namespace, group,
  // version and native-key length, consecutive equal token spans): the request carries only their
  // native keys. At most MaxQueryKeys(native bytes) keys are looked up; a longer chain is answered
  // for its first ones.
  Result<QueryResult> Query(uint64_t instance, uint32_t group, std::span<const state::StateKey> keys);
  // The same with the chain given directly: `natives` holds count x native_bytes bytes; page i
  // covers tokens [first_token + i * page_tokens, + page_tokens).
  // `flags`: channel::QueryFlags (kQueryPartial: a partial hit while the chain's Loading runs).
  Result<QueryResult> QueryNative(uint64_t instance, uint32_t group, uint64_t first_token, uint32_t page_tokens,
                                  uint8_t native_bytes, std::span<const uint8_t> natives, uint16_t key_version = 1,
                                  uint8_t flags = 0);
  size_t MaxQueryKeys(size_t native_bytes = 32) const;
  // Like Query / QueryNative, but a Loading answer is waited for (on its operation's completion,
  // with no polling) and asked again, until `timeout` passed: then the Loading result is returned
  // (ask again later, or Cancel). For callers on threads of their own (SGLang's prefetch thread);
  // a scheduler that must never block uses Query.
  Result<QueryResult> QueryWait(uint64_t instance, uint32_t group, std::span<const state::StateKey> keys,
                                std::chrono::milliseconds timeout);
  Result<QueryResult> QueryNativeWait(uint64_t instance, uint32_t group, uint64_t first_token, uint32_t page_tokens,
                                      uint8_t native_bytes, std::span<const uint8_t> natives,
                                      std::chrono::milliseconds timeout, uint16_t key_version = 1, uint8_t flags = 0);
  Result<uint32_t> QueryRestore(uint64_t instance, uint32_t group, std::span<const state::StateKey> keys,
                                std::span<const uint32_t> pages, std::chrono::milliseconds timeout);
  // Waits until Loading operation `op` completed: returns how many blocks of its chain are now in
  // DRAM (the next query leases them). DeadlineExceeded when it still runs after `timeout`;
  // NotFound when there is no such operation (a query took it: ask the query again); Aborted when
  // it was cancelled or expired.
  Result<uint64_t> WaitLoading(uint64_t instance, uint64_t op, std::chrono::milliseconds timeout);
  // The same, also answered (completed = false) as soon as `min_resident` > 0 leading blocks of the
  // chain are in DRAM while the op runs (a remote stage sealed a batch).
  Result<LoadingProgress> WaitLoadingProgress(uint64_t instance, uint64_t op, uint32_t min_resident,
                                              std::chrono::milliseconds timeout);
  // Query and restore in one, for callers on threads of their own that hold destination pages for
  // the whole chain (SGLang's prefetch into its host pool): the chain's resident prefix is restored
  // into `pages` (pages[i] for block i; at most pages.size() blocks) and, while a Loading operation
  // brings the rest, each part is restored as it arrives (partial queries on the op's progress), so
  // the copies overlap the remote fetch. Returns how many leading blocks are now in `pages` once
  // every copy drained; `timeout` bounds the wait for Loading (what arrived by then is restored).
  Result<uint32_t> QueryRestoreNative(uint64_t instance, uint32_t group, uint64_t first_token, uint32_t page_tokens,
                                      uint8_t native_bytes, std::span<const uint8_t> natives,
                                      std::span<const uint32_t> pages, std::chrono::milliseconds timeout,
                                      uint16_t key_version = 1, uint8_t flags = 0);

  // Copies the leased blocks into `pages` (one destination page per leased block, in order;
  // kSkipPage leaves one out). The lease is consumed. StartRestore returns a handle; WaitRestore
  // blocks until the copy drained (or the timeout: DeadlineExceeded, and the restore stays
  // pending), PollRestore does not block (nullopt: pending).
  Result<uint64_t> StartRestore(uint64_t instance, uint32_t group, uint64_t lease, std::span<const uint32_t> pages);
  // Layer-wise restore: copies only buffers [first_buffer, first_buffer + buffer_count) of the
  // group (a layer, or K and V of some layers) of each leased block, with its own completion, so
  // the engine can start computing layer 0 while later layers still copy. The lease stays valid for
  // the next part until `last`, which consumes it (or Release it to stop early). Parts may be in
  // flight together.
  Result<uint64_t> StartRestoreLayers(uint64_t instance, uint32_t group, uint64_t lease,
                                      std::span<const uint32_t> pages, uint32_t first_buffer, uint32_t buffer_count,
                                      bool last);
  Status WaitRestore(uint64_t handle, std::optional<std::chrono::milliseconds> timeout = std::nullopt);
  Result<std::optional<Status>> PollRestore(uint64_t handle);
  // When the copies of a restore that WaitRestore/PollRestore reported complete drained, in the
  // Manager's CLOCK_MONOTONIC nanoseconds (one clock for the host), once per handle; nullopt when
  // unknown (a failed restore, an older Manager, or already taken). The last 1024 are kept.
  std::optional<int64_t> TakeRestoreDrainedNanos(uint64_t handle);
  // Gives up on a pending restore (channel/claims.h). True: the Manager had not claimed it, so it
  // never writes its pages, which are the engine's again (the handle is gone; the Manager releases
  // the lease when it reaches the request, or with the session). False: the Manager claimed it, its
  // copies may be writing the pages, which stay reserved until WaitRestore/PollRestore report it
  // done (or the Manager is gone).
  Result<bool> AbandonRestore(uint64_t handle);
  // Where a GPU stream can wait for a pending restore instead of for its reply: the restore's claim
  // word, `offset` bytes into claim_region(), reaches at least `value` (cuStreamWaitValue64 with
  // CU_STREAM_WAIT_VALUE_GEQ) once the Manager is through with the engine's pages: its copies
  // drained, or it refused the restore without writing. Also when the engine settles it: a reply
  // that WaitRestore/PollRestore reports, an abandon, or a dead Manager lift the word, so a stream
  // never waits past what the engine itself waits for. NotFound once the handle completed (its
  // word has passed `value` by then).
  struct RestoreSignal {
    uint64_t offset = 0;
    uint64_t value = 0;
  };
  Result<RestoreSignal> RestoreSignalOf(uint64_t handle);
  // Abandons the pending restore `after` from now on a thread of the client's own, if the Manager has
  // not claimed it by then (channel/claims.h: it then never writes the pages, and the word passes
  // RestoreSignalOf's value), so a GPU stream waiting on the word goes on even while every engine
  // thread is blocked on that stream (a host sync inside the forward pass). Nothing else changes:
  // the handle stays pending, AbandonRestore then returns true, PollRestore reports what the Manager
  // answered. A restore the Manager claimed is left to finish, but watched: if the Manager's
  // process dies holding the claim, the word is settled (its copies died with it). NotFound once it
  // completed. Destroy a client only once no stream waits on its words any more.
  Status GuardRestore(uint64_t handle, std::chrono::milliseconds after);
  // The control session's claim words (ClientSession::claim_region), mapped for this client's
  // lifetime: whole pages, page-aligned.
  std::span<uint8_t> claim_region() const;
  Status Restore(uint64_t instance, uint32_t group, uint64_t lease, std::span<const uint32_t> pages);
  // An fd that becomes readable when a reply (e.g. a restore completion) arrives: poll it, then
  // PollRestore. The first call switches the session to ringing it for every reply.
  Result<int> CompletionFd();

  // Copies the named pages into the cache and returns once the copied blocks are sealed and
  // resident. Splits long lists into several requests. Bounded by the timeout: a request whose
  // reply has not come by then is abandoned if the Manager has not claimed it (channel/claims.h:
  // it is then never sealed) and DeadlineExceeded is returned; a request it claimed has finished
  // copying and counts as unconfirmed. Either way the pages may be reused when Save returns. A dead
  // Manager ends it with Unavailable.
  Result<SaveResult> Save(uint64_t instance, uint32_t group, std::span<const SaveItem> items);

  Status Release(uint64_t instance, uint64_t lease);
  // Forgets a Loading operation (the engine no longer wants it): its reads still drain and what
  // they bring into DRAM stays cached. NotFound when it already completed or was cancelled.
  Result<bool> Cancel(uint64_t instance, uint64_t op);
  // The Manager's counters as JSON.
  Result<std::string> Stats();
  // One page of a listing (channel::DumpKind): the lines from `first`, how many the listing holds, and
  // where the next page starts (0: this was the last).
  struct DumpPage {
    std::string text;
    uint64_t total = 0;
    uint64_t next = 0;
  };
  // `request` is the request payload (kPlacementChange: "add NODE" or "remove NODE"; empty otherwise).
  Result<DumpPage> Dump(channel::DumpKind kind, uint32_t shard, uint64_t first, std::string_view request = {});
  // Round trip with no work; returns the Manager's incarnation.
  Result<uint64_t> Ping();
  // Whether the control session is still open as far as this side can tell without asking the Manager
  // (non-blocking, no request): false once the Manager closed it or its process is gone (stopped,
  // restarted, killed: the kernel closes the socket), so an engine's link can connect to the next start
  // before its next call would fail. A Manager stopped with kill -STOP still counts as alive (its calls time
  // out instead).
  bool SessionAlive() const;

 private:
  // Decodes a successful restore reply and keeps its drain time for TakeRestoreDrainedNanos.
  Status RecordDrain(uint64_t handle, const channel::Descriptor& reply) REQUIRES(control_mu_);

  struct PendingRestore {
    uint64_t request_id;
    uint32_t slot;
    uint32_t generation;  // of its claim word
  };

  CacheClient(ClientOptions options, std::string socket_path, std::unique_ptr<channel::ClientSession> control)
      : options_(std::move(options)),
        socket_path_(std::move(socket_path)),
        session_id_(control->session_id()),
        manager_incarnation_(control->welcome().manager_incarnation),
        control_slot_bytes_(control->slot_bytes()),
        manager_pid_(PeerPid(control->socket_fd())),
        control_fd_(control->socket_fd()),
        control_(std::move(control)) {
    control_->SetAbandonedReplyHandler([this](const channel::InboundReply& reply) { OnAbandonedReply(reply); });
  }
  // A late reply to a query whose caller timed out: its lease (if any) is released with the next
  // control request, so a stopped Manager that wakes up leaks no pins.
  void OnAbandonedReply(const channel::InboundReply& reply) NO_THREAD_SAFETY_ANALYSIS;
  // Sends the releases of those leases (fire and forget: their replies are dropped).
  void FlushLateReleases() REQUIRES(control_mu_);

  orbitkv::Deadline CallDeadline() const;
  // The compact request for a chain of keys (at most MaxQueryKeys of them) of `group`.
  Result<channel::QueryRequest> ChainRequest(uint64_t instance, uint32_t group,
                                             std::span<const state::StateKey> keys) const;
  Result<uint64_t> SubmitRestore(const channel::RestoreRequest& request);
  // Fills the descriptor and writes the payload into the request slot; returns the payload bytes.
  using Encoder = std::function<Result<uint32_t>(channel::Descriptor*, std::span<uint8_t>)>;
  // One request on the control session: encode, submit, wait for the reply until `deadline`; an
  // error reply becomes its Status. A reply payload is copied to *reply_payload.
  // `query_instance`: the instance of a query, whose late reply's lease is released if the wait is
  // abandoned (0: not a query).
  Result<channel::InboundReply> RoundTrip(const Encoder& encode, orbitkv::Deadline deadline,
                                          std::string* reply_payload = nullptr, uint64_t query_instance = 0)
      REQUIRES(control_mu_);
  // RoundTrip with a prepared descriptor and payload.
  Result<channel::InboundReply> Call(channel::Descriptor d, std::span<const uint8_t> payload,
                                     std::string* reply_payload = nullptr) REQUIRES(control_mu_);
  // Waits for the reply to control request `request_id`. control_mu_ is held on entry and exit but
  // released while spinning and sleeping: one waiter at a time sleeps on the reply doorbell, the
  // others on reply_cv_, and every reply read off the ring is kept in arrived_ for its waiter.
  // DeadlineExceeded leaves the request outstanding.
  Result<channel::InboundReply> AwaitControl(uint64_t request_id, orbitkv::Deadline deadline, int spin_iterations)
      REQUIRES(control_mu_);
  // Reads every reply on the ring: the one for `wanted` into *mine, the others into arrived_ (true
  // when there were any: their waiters are woken).
  Result<bool> DrainControlReplies(uint64_t wanted, std::optional<channel::InboundReply>* mine) REQUIRES(control_mu_);
  Status ErrorFromReply(channel::ClientSession& session, const channel::InboundReply& reply, uint32_t slot);
  Result<channel::ClientSession*> PublishSession() REQUIRES(publish_mu_);

  // Immutable after Connect.
  const ClientOptions options_;
  const std::string socket_path_;
  const uint64_t session_id_;
  const uint64_t manager_incarnation_;
  const uint32_t control_slot_bytes_;
  const pid_t manager_pid_;  // from the socket's peer credentials at connect, 0 if unknown (GuardRestore)
  const int control_fd_;     // the control session's socket, open for the client's lifetime (SessionAlive)

  mutable Mutex control_mu_;
  std::unique_ptr<channel::ClientSession> control_ PT_GUARDED_BY(control_mu_);
  std::map<uint64_t, PendingRestore> restores_ GUARDED_BY(control_mu_);
  std::map<uint64_t, int64_t> drained_ns_ GUARDED_BY(control_mu_);  // handle -> drain time
  uint64_t next_handle_ GUARDED_BY(control_mu_) = 1;
  std::map<uint64_t, channel::InboundReply> arrived_ GUARDED_BY(control_mu_);  // by request id
  // Queries given up on (request id -> instance), and the leases their late replies carried.
  std::map<uint64_t, uint64_t> abandoned_queries_ GUARDED_BY(control_mu_);
  std::vector<std::pair<uint64_t, uint64_t>> late_leases_ GUARDED_BY(control_mu_);
  bool sleeper_ GUARDED_BY(control_mu_) = false;  // a waiter sleeps on the reply doorbell
  std::condition_variable_any reply_cv_;          // arrived_ grew, or the sleeper woke

  Mutex publish_mu_;
  std::unique_ptr<channel::ClientSession> publish_ PT_GUARDED_BY(publish_mu_);
  // GuardRestore's deadlines, served by guard_thread_ (started by the first one, joined by the
  // destructor, before the arena the words live in goes away).
  struct Guard {
    std::chrono::steady_clock::time_point at;
    uint64_t* word;  // the claim word, in the control session's arena
    uint32_t generation;
    bool operator>(const Guard& other) const { return at > other.at; }
  };
  void RunGuards();
  static pid_t PeerPid(int socket_fd);
  Mutex guard_mu_;
  std::condition_variable_any guard_cv_;
  std::priority_queue<Guard, std::vector<Guard>, std::greater<Guard>> guards_  // earliest on top
      GUARDED_BY(guard_mu_);
  bool guards_stop_ GUARDED_BY(guard_mu_) = false;
  std::thread guard_thread_ GUARDED_BY(guard_mu_);
};

}  // namespace orbitkv::client

#endif  // ORBITKV_CLIENT_CACHE_CLIENT_H_
