#include "channel/session.h"

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "base/check.h"
#include "channel/messages.h"

namespace orbitkv::channel {
namespace {

template <typename T>
std::span<const uint8_t> BytesOf(const T& value) {
  return {reinterpret_cast<const uint8_t*>(&value), sizeof(T)};
}

// RejectBody or LifecycleReplyBody followed by a message.
std::vector<uint8_t> WithMessage(std::span<const uint8_t> head, std::string_view message) {
  std::vector<uint8_t> body(head.begin(), head.end());
  body.insert(body.end(), message.begin(), message.end());
  return body;
}

Status StatusFromWire(uint32_t code, std::string_view message) {
  if (code == 0 || code > static_cast<uint32_t>(StatusCode::kUnauthenticated)) {
    return Status::Internal(fmt::format("the Manager sent an unknown status code {}: {}", code, message));
  }
  return Status(static_cast<StatusCode>(code), message);
}

std::string_view TrailingMessage(const Frame& frame, size_t head_bytes) {
  if (frame.body.size() <= head_bytes) return {};
  return {reinterpret_cast<const char*>(frame.body.data()) + head_bytes, frame.body.size() - head_bytes};
}

void SendReject(int fd, uint64_t request_id, const Status& status) {
  const RejectBody head{static_cast<uint32_t>(status.code()), 0};
  // Best effort: the peer may already be gone.
  (void)SendFrame(fd, FrameType::kReject, request_id, WithMessage(BytesOf(head), status.message()));
}

}  // namespace

// ---- ServerSession ----

ServerSession::ServerSession(ScopedFd socket, PeerCredentials peer, std::unique_ptr<DescriptorArena> arena,
                             Doorbell to_manager, Doorbell to_engine, uint64_t session_id, SessionRole role,
                             uint64_t control_session)
    : socket_(std::move(socket)),
      peer_(peer),
      arena_(std::move(arena)),
      to_manager_(std::move(to_manager)),
      to_engine_(std::move(to_engine)),
      requests_(arena_->request_control(), arena_->request_entries(), arena_->layout().ring_entries),
      replies_(arena_->reply_control(), arena_->reply_entries(), arena_->layout().ring_entries),
      session_id_(session_id),
      role_(role),
      control_session_(control_session),
      last_generation_(arena_->layout().payload_slots, 0) {}

Result<std::unique_ptr<ServerSession>> ServerSession::Accept(ScopedFd connection, const AcceptOptions& options) {
  ORBITKV_ASSIGN_OR_RETURN(PeerCredentials peer, GetPeerCredentials(connection.get()));
  auto reject = [&](uint64_t request_id, Status status) {
    SendReject(connection.get(), request_id, status);
    return status;
  };
  // Read the Hello before answering even a refusal: closing a socket with unread data makes the
  // peer's read fail with ECONNRESET, and the engine would never see why it was refused.
  ORBITKV_ASSIGN_OR_RETURN(Frame frame, RecvFrame(connection.get(), options.deadline));
  const bool uid_allowed = peer.uid == geteuid() || std::find(options.allowed_uids.begin(), options.allowed_uids.end(),
                                                              peer.uid) != options.allowed_uids.end();
  if (!uid_allowed) {
    return reject(frame.header.request_id,
                  Status::PermissionDenied(fmt::format("uid {} may not use this Manager (it runs as uid "
                                                       "{}); start the Manager with --allow-uid {} "
                                                       "to admit it",
                                                       peer.uid, geteuid(), peer.uid)));
  }
  if (frame.type() != FrameType::kHello) {
    return reject(frame.header.request_id, Status::InvalidArgument("a session must start with Hello"));
  }
  Result<HelloBody> hello = BodyAs<HelloBody>(frame);
  if (!hello.ok()) return reject(frame.header.request_id, hello.status());
  if (hello->role != static_cast<uint32_t>(SessionRole::kControl) &&
      hello->role != static_cast<uint32_t>(SessionRole::kPublish)) {
    return reject(frame.header.request_id,
                  Status::InvalidArgument(fmt::format("unknown session role {}", hello->role)));
  }
  const auto role = static_cast<SessionRole>(hello->role);
  if ((role == SessionRole::kPublish) != (hello->control_session != 0) || hello->reserved != 0) {
    return reject(frame.header.request_id,
                  Status::InvalidArgument("a publish session names its control session; a control session does not"));
  }
  Result<ArenaLayout> layout =
      ArenaLayout::Compute(hello->ring_entries != 0 ? hello->ring_entries : options.default_layout.ring_entries,
                           hello->payload_slots != 0 ? hello->payload_slots : options.default_layout.payload_slots,
                           hello->slot_bytes != 0 ? hello->slot_bytes : options.default_layout.slot_bytes);
  if (!layout.ok()) return reject(frame.header.request_id, layout.status());
  Result<std::unique_ptr<DescriptorArena>> arena = DescriptorArena::Create(*layout, options.session_epoch);
  if (!arena.ok()) return reject(frame.header.request_id, arena.status());
  ORBITKV_ASSIGN_OR_RETURN(Doorbell to_manager, Doorbell::Create());
  ORBITKV_ASSIGN_OR_RETURN(Doorbell to_engine, Doorbell::Create());
  WelcomeBody welcome{};
  welcome.session_id = options.session_id;
  welcome.session_epoch = options.session_epoch;
  welcome.manager_incarnation = options.manager_incarnation;
  welcome.arena_bytes = layout->arena_bytes;
  welcome.ring_entries = layout->ring_entries;
  welcome.payload_slots = layout->payload_slots;
  welcome.slot_bytes = layout->slot_bytes;
  const int fds[] = {(*arena)->fd().get(), to_manager.fd().get(), to_engine.fd().get()};
  ORBITKV_RETURN_IF_ERROR(
      SendFrame(connection.get(), FrameType::kWelcome, frame.header.request_id, BytesOf(welcome), fds));
  return std::unique_ptr<ServerSession>(new ServerSession(std::move(connection), peer, std::move(*arena),
                                                          std::move(to_manager), std::move(to_engine),
                                                          options.session_id, role, hello->control_session));
}

Result<std::optional<InboundRequest>> ServerSession::NextRequest() {
  if (poisoned_) return Status::FailedPrecondition("session is poisoned");
  InboundRequest request;
  ORBITKV_ASSIGN_OR_RETURN(bool got, requests_.TryPop(&request.descriptor));
  if (!got) return std::optional<InboundRequest>();
  const Descriptor& d = request.descriptor;
  const ArenaLayout& layout = arena_->layout();
  ORBITKV_RETURN_IF_ERROR(ValidateRequestDescriptor(d, layout.payload_slots, layout.slot_bytes));
  if (d.session_epoch != arena_->session_epoch()) {
    return Status::Aborted(fmt::format("request {} carries session epoch {}, not this session's {}", d.request_id,
                                       d.session_epoch, arena_->session_epoch()));
  }
  // Generations only move forward per slot (modulo 2^32): an older or repeated one is stale or
  // replayed.
  uint32_t& last = last_generation_[d.payload_slot];
  if (last != 0 && static_cast<int32_t>(d.payload_generation - last) <= 0) {
    return Status::Aborted(fmt::format("request {} reuses slot {} generation {} (last {}): stale or replayed",
                                       d.request_id, d.payload_slot, d.payload_generation, last));
  }
  last = d.payload_generation;
  // Copy out before anything interprets it: the engine could change shared memory afterwards.
  std::span<const uint8_t> slot = arena_->slot(d.payload_slot);
  request.payload.assign(slot.begin(), slot.begin() + d.payload_bytes);
  return std::optional<InboundRequest>(std::move(request));
}

Status ServerSession::Reply(const Descriptor& request, StatusCode code, uint64_t arg0, uint64_t arg1,
                            std::span<const uint8_t> payload) {
  std::span<uint8_t> slot = arena_->slot(request.payload_slot);
  if (payload.size() > slot.size()) payload = payload.first(slot.size());
  Descriptor reply = request;
  reply.flags = static_cast<uint16_t>(DescriptorFlags::kReply);
  reply.status = static_cast<uint32_t>(code);
  reply.payload_generation = request.payload_generation + 1;
  reply.payload_bytes = static_cast<uint32_t>(payload.size());
  reply.arg0 = arg0;
  reply.arg1 = arg1;
  Status pushed;
  bool wake = false;
  {
    MutexLock lock(&reply_mu_);
    if (!payload.empty()) std::memcpy(slot.data(), payload.data(), payload.size());
    pushed = replies_.TryPush(reply);
    wake = pushed.ok() && replies_.ConsumerWaiting();
  }
  if (!pushed.ok()) {
    broken_.store(true, std::memory_order_release);
    return pushed.WithContext("reply ring");
  }
  return wake ? to_engine_.Ring() : Status::Ok();
}

Status ServerSession::ReplyError(const Descriptor& request, const Status& status) {
  const std::string_view message = status.message();
  return Reply(request, status.code(), 0, 0,
               std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(message.data()), message.size()));
}

Result<std::optional<Frame>> ServerSession::ReadFrame() {
  Result<Frame> frame = RecvFrame(socket_.get(), Deadline::At(MonoNow()));
  if (!frame.ok()) {
    if (frame.status().code() == StatusCode::kDeadlineExceeded) return std::optional<Frame>();
    return frame.status();
  }
  return std::optional<Frame>(std::move(*frame));
}

Status ServerSession::SendLifecycleReply(uint64_t request_id, const Status& status, uint64_t value) {
  const LifecycleReplyBody head{static_cast<uint32_t>(status.code()), 0, value};
  return SendFrame(socket_.get(), FrameType::kLifecycleReply, request_id,
                   WithMessage(BytesOf(head), status.ok() ? std::string_view() : status.message()));
}

void ServerSession::Poison(const Status& reason) {
  if (poisoned_) return;
  poisoned_ = true;
  // Drop whatever the engine already sent: a socket closed with unread data resets the peer's
  // reads, and the engine must be able to read the Reject below.
  while (RecvFrame(socket_.get(), Deadline::At(MonoNow())).ok()) {
  }
  SendReject(socket_.get(), 0, reason);
  shutdown(socket_.get(), SHUT_RDWR);
}

// ---- ClientSession ----

ClientSession::ClientSession(ScopedFd socket, const WelcomeBody& welcome, std::unique_ptr<DescriptorArena> arena,
                             Doorbell to_manager, Doorbell to_engine)
    : socket_(std::move(socket)),
      welcome_(welcome),
      arena_(std::move(arena)),
      to_manager_(std::move(to_manager)),
      to_engine_(std::move(to_engine)),
      requests_(arena_->request_control(), arena_->request_entries(), welcome.ring_entries),
      replies_(arena_->reply_control(), arena_->reply_entries(), welcome.ring_entries),
      // The first request of a slot gets generation 1 (0xffffffff + 2).
      generation_(welcome.payload_slots, 0xffffffffu),
      slot_request_(welcome.payload_slots, 0),
      abandoned_(welcome.payload_slots, false) {
  // Outstanding requests are bounded by both the slots and the ring.
  const uint32_t usable = std::min(welcome.payload_slots, welcome.ring_entries);
  for (uint32_t i = usable; i > 0; --i) free_slots_.push_back(i - 1);
}

Result<std::unique_ptr<ClientSession>> ClientSession::Connect(const std::string& socket_path,
                                                              const ConnectOptions& options) {
  ORBITKV_ASSIGN_OR_RETURN(ScopedFd socket, ConnectUnix(socket_path));
  HelloBody hello{};
  hello.role = static_cast<uint32_t>(options.role);
  hello.client_pid = static_cast<uint32_t>(getpid());
  hello.control_session = options.control_session;
  hello.ring_entries = options.ring_entries;
  hello.payload_slots = options.payload_slots;
  hello.slot_bytes = options.slot_bytes;
  // A Manager that refuses the peer outright (SO_PEERCRED) answers Reject before reading Hello and
  // closes, so a failed send still reads what the Manager said.
  const Status sent = SendFrame(socket.get(), FrameType::kHello, 1, BytesOf(hello));
  Result<Frame> frame = RecvFrame(socket.get(), sent.ok() ? options.deadline : Deadline::At(MonoNow()));
  if (!sent.ok() && (!frame.ok() || frame->type() != FrameType::kReject)) return sent;
  if (!frame.ok()) return frame.status().WithContext("waiting for the Manager's Welcome");
  if (frame->type() == FrameType::kReject) {
    ORBITKV_ASSIGN_OR_RETURN(RejectBody reject, BodyAs<RejectBody>(*frame, /*allow_trailing=*/true));
    return StatusFromWire(reject.code, TrailingMessage(*frame, sizeof(RejectBody)))
        .WithContext("the Manager refused the session");
  }
  if (frame->type() != FrameType::kWelcome) {
    return Status::InvalidArgument(fmt::format("the Manager answered Hello with frame type {}", frame->header.type));
  }
  ORBITKV_ASSIGN_OR_RETURN(WelcomeBody welcome, BodyAs<WelcomeBody>(*frame));
  if (frame->fds.size() != 3) {
    return Status::InvalidArgument(fmt::format("Welcome carried {} fds, expected 3", frame->fds.size()));
  }
  ORBITKV_ASSIGN_OR_RETURN(std::unique_ptr<DescriptorArena> arena,
                           DescriptorArena::Attach(std::move(frame->fds[0]), welcome));
  return std::unique_ptr<ClientSession>(new ClientSession(std::move(socket), welcome, std::move(arena),
                                                          Doorbell(std::move(frame->fds[1])),
                                                          Doorbell(std::move(frame->fds[2]))));
}

Result<uint32_t> ClientSession::AcquireSlot() {
  if (free_slots_.empty()) {
    return Status::ResourceExhausted(fmt::format("all {} request slots of this session are in flight",
                                                 std::min(welcome_.payload_slots, welcome_.ring_entries)));
  }
  const uint32_t slot = free_slots_.back();
  free_slots_.pop_back();
  return slot;
}

void ClientSession::ReleaseSlot(uint32_t slot) {
  ORBITKV_CHECK(slot < welcome_.payload_slots);
  // A slot whose request is still outstanding (its reply never came) stays retired: the Manager may
  // still write it.
  if (slot_request_[slot] == 0) free_slots_.push_back(slot);
}

void ClientSession::AbandonSlot(uint32_t slot) {
  ORBITKV_CHECK(slot < welcome_.payload_slots);
  if (slot_request_[slot] == 0) {
    free_slots_.push_back(slot);
  } else {
    abandoned_[slot] = true;  // freed by PollReply when the reply comes
  }
}

uint32_t ClientSession::ArmClaim(uint32_t slot) {
  ORBITKV_CHECK(slot < welcome_.payload_slots && slot_request_[slot] == 0);
  const uint32_t generation = generation_[slot] + 2;  // what Submit gives the slot's next request
  channel::ArmClaim(arena_->claim_word(slot), generation);
  return generation;
}

ClaimState ClientSession::AbandonClaim(uint32_t slot, uint32_t generation) {
  ORBITKV_CHECK(slot < welcome_.payload_slots);
  return channel::Abandon(arena_->claim_word(slot), generation);
}

void ClientSession::SettleClaim(uint32_t slot, uint32_t generation) {
  ORBITKV_CHECK(slot < welcome_.payload_slots);
  channel::Settle(arena_->claim_word(slot), generation);
}

bool ClientSession::ClaimStillRunning(uint32_t slot, uint32_t generation) {
  ORBITKV_CHECK(slot < welcome_.payload_slots);
  if (channel::Finished(arena_->claim_word(slot), generation)) return false;
  // The Manager's process, from the socket's peer credentials: once it is gone its copies are.
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(socket_.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || cred.pid <= 0) return false;
  return kill(cred.pid, 0) == 0 || errno == EPERM;
}

Result<uint64_t> ClientSession::Submit(Descriptor d, uint32_t slot, uint32_t payload_bytes) {
  ORBITKV_RETURN_IF_ERROR(dead_);
  ORBITKV_CHECK(slot < welcome_.payload_slots && slot_request_[slot] == 0);
  const uint32_t generation = generation_[slot] + 2;
  d.magic = kMagic;
  d.version = kWireVersion;
  d.flags = 0;
  d.status = 0;
  d.request_id = next_request_id_;
  d.session_epoch = welcome_.session_epoch;
  d.payload_slot = slot;
  d.payload_generation = generation;
  d.payload_bytes = payload_bytes;
  Status pushed = requests_.TryPush(d);
  if (!pushed.ok()) {
    if (pushed.code() == StatusCode::kDataLoss) dead_ = pushed;
    return pushed;
  }
  generation_[slot] = generation;
  slot_request_[slot] = next_request_id_;
  const uint64_t id = next_request_id_++;
  // Once pushed the request is sent: the Manager may read it whether or not the doorbell rings, so
  // a doorbell that fails must not make it look unsent (its slot freed, a claimed restore's pages
  // reused). The session is dead instead: the caller's wait fails, and treats it as the sent
  // request it is (an unclaimed save or restore is abandoned, a claimed one waited for).
  if (requests_.ConsumerWaiting()) {
    Status rang = to_manager_.Ring();
    if (!rang.ok()) {
      dead_ = Status::Unavailable(
          fmt::format("cannot wake the Manager for request {} ({}); reconnect", id, rang.message()));
    }
  }
  return id;
}

Result<std::optional<InboundReply>> ClientSession::PollReply() {
  ORBITKV_RETURN_IF_ERROR(dead_);
  // With a completion fd, consume its pending rings first: a reply arriving after this re-arms it.
  if (always_wake_) to_engine_.Drain();
  for (;;) {
    InboundReply reply;
    Result<bool> got = replies_.TryPop(&reply.descriptor);
    if (!got.ok()) {
      dead_ = got.status();
      return dead_;
    }
    if (!*got) return std::optional<InboundReply>();
    const Descriptor& d = reply.descriptor;
    const bool current = d.magic == kMagic && d.flags == static_cast<uint16_t>(DescriptorFlags::kReply) &&
                         d.payload_slot < welcome_.payload_slots && slot_request_[d.payload_slot] == d.request_id &&
                         d.payload_generation == generation_[d.payload_slot] + 1 &&
                         d.payload_bytes <= welcome_.slot_bytes;
    if (!current) continue;  // stale: a reply for a request this session no longer waits for
    slot_request_[d.payload_slot] = 0;
    if (abandoned_[d.payload_slot]) {  // nobody waits for it: the slot is free now
      abandoned_[d.payload_slot] = false;
      free_slots_.push_back(d.payload_slot);
      if (abandoned_reply_handler_) abandoned_reply_handler_(reply);
      continue;
    }
    return std::optional<InboundReply>(reply);
  }
}

Status ClientSession::SocketStatus() {
  Result<Frame> frame = RecvFrame(socket_.get(), Deadline::At(MonoNow()));
  if (frame.ok()) {
    if (frame->type() == FrameType::kReject) {
      Result<RejectBody> reject = BodyAs<RejectBody>(*frame, /*allow_trailing=*/true);
      dead_ = reject.ok() ? StatusFromWire(reject->code, TrailingMessage(*frame, sizeof(RejectBody)))
                                .WithContext("the Manager closed this session")
                          : reject.status();
    }
    return dead_;
  }
  if (frame.status().code() == StatusCode::kDeadlineExceeded) return dead_;
  if (frame.status().code() == StatusCode::kUnavailable) {
    dead_ = Status::Unavailable("the OrbitKV Manager closed the session (it stopped, restarted or was killed)");
  } else {
    dead_ = frame.status();
  }
  return dead_;
}

Result<InboundReply> ClientSession::WaitReply(uint64_t request_id, Deadline deadline, int spin_iterations) {
  for (auto it = parked_.begin(); it != parked_.end(); ++it) {
    if (it->descriptor.request_id == request_id) {
      InboundReply reply = *it;
      parked_.erase(it);
      return reply;
    }
  }
  for (;;) {
    for (int spin = 0; spin <= spin_iterations; ++spin) {
      ORBITKV_ASSIGN_OR_RETURN(std::optional<InboundReply> reply, PollReply());
      if (!reply.has_value()) {
        SpinPause(spin);
        continue;
      }
      if (reply->descriptor.request_id == request_id) return *reply;
      parked_.push_back(*reply);
    }
    ORBITKV_ASSIGN_OR_RETURN(bool arrived, ArmReplyDoorbell());
    if (arrived) continue;
    pollfd fds[2] = {{to_engine_.fd().get(), POLLIN, 0}, {socket_.get(), POLLIN, 0}};
    const int rc = poll(fds, 2, deadline.RemainingPollMs());
    const int poll_errno = errno;
    const Status disarmed = DisarmReplyDoorbell(rc > 0 ? fds[0].revents : 0, rc > 0 ? fds[1].revents : 0);
    if (rc < 0 && poll_errno != EINTR) return ErrnoStatus("poll reply doorbell", poll_errno);
    ORBITKV_RETURN_IF_ERROR(disarmed);
    if (rc == 0 && deadline.Expired()) {
      return Status::DeadlineExceeded(fmt::format("no reply to request {} before the deadline", request_id));
    }
  }
}

Result<bool> ClientSession::ArmReplyDoorbell() {
  ORBITKV_RETURN_IF_ERROR(dead_);
  ORBITKV_ASSIGN_OR_RETURN(bool arrived, replies_.PrepareToWait());
  if (arrived && !always_wake_) replies_.ClearWaiting();
  return arrived;
}

Status ClientSession::DisarmReplyDoorbell(short doorbell_revents, short socket_revents) {
  if (!always_wake_) replies_.ClearWaiting();
  if ((socket_revents & (POLLIN | POLLHUP | POLLERR)) != 0) ORBITKV_RETURN_IF_ERROR(SocketStatus());
  if ((doorbell_revents & POLLIN) != 0) to_engine_.Drain();
  return dead_;
}

Status ClientSession::EnableCompletionFd() {
  always_wake_ = true;
  return replies_.PrepareToWait().status();
}

Result<uint64_t> ClientSession::Lifecycle(FrameType type, std::span<const uint8_t> body, std::span<const int> fds,
                                          Deadline deadline) {
  ORBITKV_RETURN_IF_ERROR(dead_);
  const uint64_t request_id = next_request_id_++;
  ORBITKV_RETURN_IF_ERROR(SendFrame(socket_.get(), type, request_id, body, fds));
  for (;;) {
    Result<Frame> frame = RecvFrame(socket_.get(), deadline);
    if (!frame.ok()) {
      if (frame.status().code() == StatusCode::kUnavailable) {
        dead_ = Status::Unavailable("the OrbitKV Manager closed the session (it stopped, restarted or was killed)");
        return dead_;
      }
      return frame.status();
    }
    if (frame->type() == FrameType::kReject) {
      ORBITKV_ASSIGN_OR_RETURN(RejectBody reject, BodyAs<RejectBody>(*frame, /*allow_trailing=*/true));
      dead_ = StatusFromWire(reject.code, TrailingMessage(*frame, sizeof(RejectBody)))
                  .WithContext("the Manager closed this session");
      return dead_;
    }
    if (frame->type() != FrameType::kLifecycleReply || frame->header.request_id != request_id) continue;
    ORBITKV_ASSIGN_OR_RETURN(LifecycleReplyBody reply, BodyAs<LifecycleReplyBody>(*frame, /*allow_trailing=*/true));
    if (reply.code != 0) return StatusFromWire(reply.code, TrailingMessage(*frame, sizeof(LifecycleReplyBody)));
    return reply.value;
  }
}

}  // namespace orbitkv::channel
