#include "client/cache_client.h"

#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "channel/messages.h"
#include "channel/uds.h"

namespace orbitkv::client {
namespace {

using channel::Descriptor;

template <typename T>
std::span<const uint8_t> BytesOf(const T& value) {
  return {reinterpret_cast<const uint8_t*>(&value), sizeof(T)};
}

}  // namespace

Result<std::unique_ptr<CacheClient>> CacheClient::Connect(const ClientOptions& options) {
  std::string path = options.socket_path.empty() ? channel::DefaultManagerSocketPath() : options.socket_path;
  channel::ConnectOptions connect;
  connect.role = channel::SessionRole::kControl;
  connect.deadline = orbitkv::Deadline::After(options.timeout);
  ORBITKV_ASSIGN_OR_RETURN(std::unique_ptr<channel::ClientSession> control,
                           channel::ClientSession::Connect(path, connect));
  return std::unique_ptr<CacheClient>(new CacheClient(options, std::move(path), std::move(control)));
}

CacheClient::~CacheClient() {
  std::thread guards;
  {
    MutexLock lock(&guard_mu_);
    guards_stop_ = true;
    guards = std::move(guard_thread_);
  }
  guard_cv_.notify_all();
  if (guards.joinable()) guards.join();
}

Status CacheClient::GuardRestore(uint64_t handle, std::chrono::milliseconds after) {
  Guard guard;
  {
    MutexLock lock(&control_mu_);
    auto it = restores_.find(handle);
    if (it == restores_.end()) return Status::NotFound(fmt::format("no pending restore {}", handle));
    guard.word = reinterpret_cast<uint64_t*>(control_->claim_region().data()) + it->second.slot;
    guard.generation = it->second.generation;
  }
  guard.at = std::chrono::steady_clock::now() + after;
  bool earliest = false;
  {
    MutexLock lock(&guard_mu_);
    earliest = guards_.empty() || guard.at < guards_.top().at;
    guards_.push(guard);
    if (!guard_thread_.joinable()) guard_thread_ = std::thread([this] { RunGuards(); });
  }
  // Deadlines mostly come in order: the thread is woken only when this one is due before all others.
  if (earliest) guard_cv_.notify_all();
  return Status::Ok();
}

pid_t CacheClient::PeerPid(int socket_fd) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  return getsockopt(socket_fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0 ? cred.pid : 0;
}

void CacheClient::RunGuards() {
  MutexLock lock(&guard_mu_);
  while (!guards_stop_) {
    const auto now = std::chrono::steady_clock::now();
    while (!guards_.empty() && guards_.top().at <= now) {
      Guard guard = guards_.top();
      guards_.pop();
      // A word still pending of this generation is taken back; a settled or later one (the restore
      // completed, the slot moved on) needs nothing.
      if (channel::Abandon(guard.word, guard.generation) == channel::ClaimState::kAbandoned ||
          !channel::HeldClaim(guard.word, guard.generation)) {
        continue;
      }
      // The Manager holds the claim: its copies finish the word, unless its process is gone.
      if (manager_pid_ > 0 && kill(manager_pid_, 0) != 0 && errno == ESRCH) {
        channel::Settle(guard.word, guard.generation);
        continue;
      }
      guard.at = now + std::chrono::milliseconds(20);
      guards_.push(guard);
    }
    if (guards_.empty()) {
      guard_cv_.wait(guard_mu_);
    } else {
      guard_cv_.wait_until(guard_mu_, guards_.top().at);
    }
  }
}

orbitkv::Deadline CacheClient::CallDeadline() const { return orbitkv::Deadline::After(options_.timeout); }

Status CacheClient::ErrorFromReply(channel::ClientSession& session, const channel::InboundReply& reply, uint32_t slot) {
  const auto bytes = session.slot(slot).first(reply.descriptor.payload_bytes);
  return Status(reply.code(), std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
}

Result<bool> CacheClient::DrainControlReplies(uint64_t wanted, std::optional<channel::InboundReply>* mine) {
  bool others = false;
  for (;;) {
    ORBITKV_ASSIGN_OR_RETURN(std::optional<channel::InboundReply> reply, control_->PollReply());
    if (!reply.has_value()) break;
    if (mine != nullptr && reply->descriptor.request_id == wanted) {
      *mine = reply;  // the caller's own: no detour through arrived_
      continue;
    }
    arrived_.emplace(reply->descriptor.request_id, *reply);
    others = true;
  }
  if (others) reply_cv_.notify_all();
  return others;
}

Result<channel::InboundReply> CacheClient::AwaitControl(uint64_t request_id, orbitkv::Deadline deadline,
                                                        int spin_iterations) {
  for (int spin = 0;; ++spin) {
    if (auto it = arrived_.find(request_id); it != arrived_.end()) {
      channel::InboundReply reply = it->second;
      arrived_.erase(it);
      return reply;
    }
    std::optional<channel::InboundReply> mine;
    ORBITKV_RETURN_IF_ERROR(DrainControlReplies(request_id, &mine).status());
    if (mine.has_value()) return *mine;
    if (spin < spin_iterations) {
      // Spin without the session: another thread's request goes out meanwhile.
      control_mu_.Unlock();
      SpinPause(spin);
      control_mu_.Lock();
      continue;
    }
    const auto expired = [&] {
      return Status::DeadlineExceeded(fmt::format("no reply to request {} before the deadline", request_id));
    };
    if (sleeper_) {
      // Another waiter sleeps on the doorbell and hands over what it reads.
      if (deadline.Expired()) return expired();
      reply_cv_.wait_until(control_mu_, deadline.IsInfinite() ? MonoNow() + std::chrono::hours(1) : deadline.when());
      continue;
    }
    ORBITKV_ASSIGN_OR_RETURN(bool arrived, control_->ArmReplyDoorbell());
    if (arrived) continue;
    // Sleep on the doorbell and the socket (even with the deadline passed: a poll of zero ms still
    // tells whether the Manager closed the session).
    sleeper_ = true;
    pollfd fds[2] = {{control_->reply_doorbell_fd(), POLLIN, 0}, {control_->socket_fd(), POLLIN, 0}};
    control_mu_.Unlock();
    const int rc = poll(fds, 2, deadline.RemainingPollMs());
    const int poll_errno = errno;
    control_mu_.Lock();
    sleeper_ = false;
    reply_cv_.notify_all();  // a waiter still waiting takes over the doorbell
    if (rc < 0 && poll_errno != EINTR) return ErrnoStatus("poll reply doorbell", poll_errno);
    ORBITKV_RETURN_IF_ERROR(control_->DisarmReplyDoorbell(rc > 0 ? fds[0].revents : 0, rc > 0 ? fds[1].revents : 0));
    std::optional<channel::InboundReply> woken;
    ORBITKV_RETURN_IF_ERROR(DrainControlReplies(request_id, &woken).status());
    if (woken.has_value()) return *woken;
    if (arrived_.count(request_id) == 0 && deadline.Expired()) return expired();
  }
}

void CacheClient::OnAbandonedReply(const channel::InboundReply& reply) {
  // Runs inside PollReply, which the control session's reader calls with control_mu_ held.
  auto it = abandoned_queries_.find(reply.descriptor.request_id);
  if (it == abandoned_queries_.end()) return;
  const uint64_t instance = it->second;
  abandoned_queries_.erase(it);
  if (reply.code() != StatusCode::kOk) return;
  Result<channel::QueryReply> answer = channel::DecodeQueryReply(reply.descriptor);
  if (answer.ok() && answer->leased() && answer->lease != 0) {
    late_leases_.emplace_back(instance, answer->lease);
  }
}

void CacheClient::FlushLateReleases() {
  while (!late_leases_.empty()) {
    Result<uint32_t> slot = control_->AcquireSlot();
    if (!slot.ok()) return;  // all in flight: the next request tries again
    const auto [instance, lease] = late_leases_.back();
    Descriptor d{};
    channel::EncodeRelease(channel::ReleaseRequest{instance, lease}, &d);
    Result<uint64_t> id = control_->Submit(d, *slot, 0);
    if (!id.ok()) {
      control_->ReleaseSlot(*slot);
      return;
    }
    control_->AbandonSlot(*slot);  // nobody waits for its reply
    late_leases_.pop_back();
  }
}

Result<channel::InboundReply> CacheClient::RoundTrip(const Encoder& encode, orbitkv::Deadline deadline,
                                                     std::string* reply_payload, uint64_t query_instance) {
  FlushLateReleases();
  ORBITKV_ASSIGN_OR_RETURN(uint32_t slot, control_->AcquireSlot());
  Descriptor d{};
  Result<uint32_t> bytes = encode(&d, control_->slot(slot));
  Result<uint64_t> id = bytes.ok() ? control_->Submit(d, slot, *bytes) : Result<uint64_t>(bytes.status());
  if (!id.ok()) {
    control_->ReleaseSlot(slot);
    return id.status();
  }
  Result<channel::InboundReply> reply = AwaitControl(*id, deadline, options_.spin_iterations);
  if (!reply.ok()) {
    if (query_instance != 0) abandoned_queries_[*id] = query_instance;
    control_->AbandonSlot(slot);  // the slot is free again once its reply arrived
    return reply.status();
  }
  Status error = reply->code() == StatusCode::kOk ? Status::Ok() : ErrorFromReply(*control_, *reply, slot);
  if (reply_payload != nullptr && error.ok()) {
    const auto out = control_->slot(slot).first(reply->descriptor.payload_bytes);
    reply_payload->assign(reinterpret_cast<const char*>(out.data()), out.size());
  }
  control_->ReleaseSlot(slot);
  if (!error.ok()) return error;
  return reply;
}

Result<channel::InboundReply> CacheClient::Call(Descriptor d, std::span<const uint8_t> payload,
                                                std::string* reply_payload) {
  return RoundTrip(
      [&](Descriptor* out, std::span<uint8_t> slot) -> Result<uint32_t> {
        if (payload.size() > slot.size()) return Status::InvalidArgument("request payload exceeds its slot");
        *out = d;
        if (!payload.empty()) std::memcpy(slot.data(), payload.data(), payload.size());
        return static_cast<uint32_t>(payload.size());
      },
      CallDeadline(), reply_payload);
}

Status CacheClient::RegisterInstance(uint64_t instance, const state::StateNamespace& ns, std::string_view label) {
  channel::RegisterInstanceBody body{};
  body.instance_id = instance;
  std::memcpy(body.namespace_digest, ns.digest().bytes.data(), 32);
  if (label.size() > channel::kMaxInstanceLabel) label = label.substr(0, channel::kMaxInstanceLabel);
  const std::vector<uint8_t> frame = channel::EncodeRegisterInstance(body, label);
  MutexLock lock(&control_mu_);
  return control_->Lifecycle(channel::FrameType::kRegisterInstance, frame, {}, CallDeadline()).status();
}

Result<uint64_t> CacheClient::RegisterGroup(uint64_t instance, uint32_t group, uint32_t num_pages,
                                            std::span<const BufferSpec> buffers) {
  if (buffers.empty() || buffers.size() > channel::kMaxFrameFds) {
    return Status::InvalidArgument(fmt::format("a group needs 1-{} buffers", channel::kMaxFrameFds));
  }
  auto kind_of = [](const BufferSpec& spec) {
    if (spec.cuda_ipc.has_value()) return channel::BufferKind::kCudaIpc;
    return spec.fd < 0 ? channel::BufferKind::kProcessMemory : channel::BufferKind::kSharedMemory;
  };
  const channel::BufferKind kind = kind_of(buffers.front());
  for (const BufferSpec& spec : buffers) {
    if (kind_of(spec) != kind) {
      return Status::InvalidArgument(
          "the buffers of a group are all shared memory (fds), all process memory or all CUDA "
          "IPC");
    }
    if (kind == channel::BufferKind::kProcessMemory && spec.address == 0) {
      return Status::InvalidArgument("a process-memory buffer needs its address");
    }
    if (kind == channel::BufferKind::kCudaIpc) {
      if (spec.fd >= 0 || spec.address != 0) {
        return Status::InvalidArgument("a CUDA IPC buffer has no fd (-1) and no address (0)");
      }
      const std::string& bus_id = spec.cuda_ipc->pci_bus_id;
      if (bus_id.empty() || bus_id.size() >= channel::kPciBusIdBytes || bus_id.find('\0') != std::string::npos) {
        return Status::InvalidArgument(
            fmt::format("'{}' is not a PCI bus id (like 0000:00:06.0, at most {} characters)", bus_id,
                        channel::kPciBusIdBytes - 1));
      }
    }
  }
  channel::RegisterGroupHeader header{instance, group, static_cast<uint32_t>(buffers.size()), num_pages,
                                      static_cast<uint32_t>(kind)};
  std::vector<uint8_t> body(BytesOf(header).begin(), BytesOf(header).end());
  std::vector<int> fds;
  for (const BufferSpec& spec : buffers) {
    const channel::BufferDescriptor layout{spec.buffer_bytes, spec.base_offset, spec.page_stride, spec.page_bytes};
    body.insert(body.end(), BytesOf(layout).begin(), BytesOf(layout).end());
    if (kind == channel::BufferKind::kSharedMemory) fds.push_back(spec.fd);
  }
  if (kind == channel::BufferKind::kProcessMemory) {
    for (const BufferSpec& spec : buffers) {
      body.insert(body.end(), BytesOf(spec.address).begin(), BytesOf(spec.address).end());
    }
#ifdef PR_SET_PTRACER
    // Where Yama restricts ptrace to descendants, let the Manager read and write this process's
    // buffers (no effect, and EINVAL, without Yama).
    (void)prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
#endif
  }
  if (kind == channel::BufferKind::kCudaIpc) {
    for (const BufferSpec& spec : buffers) {
      channel::CudaIpcBuffer cuda{};
      std::memcpy(cuda.ipc_handle, spec.cuda_ipc->handle.data(), sizeof(cuda.ipc_handle));
      cuda.offset = spec.cuda_ipc->offset;
      std::memcpy(cuda.pci_bus_id, spec.cuda_ipc->pci_bus_id.data(), spec.cuda_ipc->pci_bus_id.size());
      body.insert(body.end(), BytesOf(cuda).begin(), BytesOf(cuda).end());
    }
  }
  if (body.size() > channel::kMaxFrameBytes - sizeof(channel::FrameHeader)) {
    return Status::InvalidArgument(fmt::format("{} buffers do not fit one RegisterGroup frame", buffers.size()));
  }
  MutexLock lock(&control_mu_);
  return control_->Lifecycle(channel::FrameType::kRegisterGroup, body, fds, CallDeadline());
}

Status CacheClient::UnregisterInstance(uint64_t instance) {
  const channel::UnregisterInstanceBody body{instance};
  MutexLock lock(&control_mu_);
  return control_->Lifecycle(channel::FrameType::kUnregisterInstance, BytesOf(body), {}, CallDeadline()).status();
}

size_t CacheClient::MaxQueryKeys(size_t native_bytes) const {
  return channel::MaxQueryKeys(control_slot_bytes_, native_bytes);
}

Result<channel::QueryRequest> CacheClient::ChainRequest(uint64_t instance, uint32_t group,
                                                        std::span<const state::StateKey> keys) const {
  const size_t count = std::min(keys.size(), MaxQueryKeys(keys.front().native_key().size()));
  ORBITKV_ASSIGN_OR_RETURN(channel::QueryRequest request, channel::QueryRequest::FromKeys(instance, keys.first(count)));
  if (request.group != group) {
    return Status::InvalidArgument(fmt::format("query keys belong to group {}, not {}", request.group, group));
  }
  return request;
}

Result<QueryResult> CacheClient::Query(uint64_t instance, uint32_t group, std::span<const state::StateKey> keys) {
  if (keys.empty()) return QueryResult{};
  ORBITKV_ASSIGN_OR_RETURN(channel::QueryRequest request, ChainRequest(instance, group, keys));
  return QueryNative(instance, group, request.first_token, request.page_tokens, request.native_bytes, request.natives,
                     request.key_version);
}

Result<QueryResult> CacheClient::QueryNative(uint64_t instance, uint32_t group, uint64_t first_token,
                                             uint32_t page_tokens, uint8_t native_bytes,
                                             std::span<const uint8_t> natives, uint16_t key_version, uint8_t flags) {
  if (native_bytes == 0 || natives.size() % native_bytes != 0) {
    return Status::InvalidArgument("native keys must all have native_bytes bytes");
  }
  if (natives.empty()) return QueryResult{};
  const size_t count = std::min(natives.size() / native_bytes, MaxQueryKeys(native_bytes));
  MutexLock lock(&control_mu_);
  // Encoded straight into the request slot: no intermediate copy on the hot path.
  ORBITKV_ASSIGN_OR_RETURN(channel::InboundReply reply, RoundTrip(
                                                            [&](Descriptor* d, std::span<uint8_t> slot) {
                                                              return channel::EncodeQueryChain(
                                                                  instance, group, first_token, page_tokens,
                                                                  key_version, native_bytes,
                                                                  natives.first(count * native_bytes), d, slot, flags);
                                                            },
                                                            CallDeadline(), nullptr, instance));
  Result<channel::QueryReply> decoded = channel::DecodeQueryReply(reply.descriptor);
  if (!decoded.ok()) return decoded.status().WithContext("the Manager's query reply is malformed");
  QueryResult result;
  result.hits = decoded->hits;
  result.lease = decoded->lease;
  result.loading_op = decoded->loading_op;
  result.partial = decoded->outcome == channel::QueryOutcome::kPartial;
  return result;
}

Result<QueryResult> CacheClient::QueryWait(uint64_t instance, uint32_t group, std::span<const state::StateKey> keys,
                                           std::chrono::milliseconds timeout) {
  if (keys.empty()) return QueryResult{};
  ORBITKV_ASSIGN_OR_RETURN(channel::QueryRequest request, ChainRequest(instance, group, keys));
  return QueryNativeWait(instance, group, request.first_token, request.page_tokens, request.native_bytes,
                         request.natives, timeout, request.key_version);
}

Result<QueryResult> CacheClient::QueryNativeWait(uint64_t instance, uint32_t group, uint64_t first_token,
                                                 uint32_t page_tokens, uint8_t native_bytes,
                                                 std::span<const uint8_t> natives, std::chrono::milliseconds timeout,
                                                 uint16_t key_version, uint8_t flags) {
  const orbitkv::Deadline deadline = orbitkv::Deadline::After(timeout);
  for (;;) {
    ORBITKV_ASSIGN_OR_RETURN(QueryResult result, QueryNative(instance, group, first_token, page_tokens, native_bytes,
                                                             natives, key_version, flags));
    if (result.loading_op == 0) return result;
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline.Remaining());
    if (left.count() <= 0) return result;
    Result<uint64_t> waited = WaitLoading(instance, result.loading_op, left);
    if (!waited.ok()) {
      // Still running at the deadline: the caller hears Loading. Taken by another query, cancelled
      // or expired: the query, asked again, says what is there now.
      if (waited.status().code() == StatusCode::kDeadlineExceeded) return result;
      if (waited.status().code() != StatusCode::kNotFound && waited.status().code() != StatusCode::kAborted) {
        return waited.status();
      }
    }
  }
}

Result<uint64_t> CacheClient::WaitLoading(uint64_t instance, uint64_t op, std::chrono::milliseconds timeout) {
  ORBITKV_ASSIGN_OR_RETURN(LoadingProgress done, WaitLoadingProgress(instance, op, 0, timeout));
  return done.resident;
}

Result<LoadingProgress> CacheClient::WaitLoadingProgress(uint64_t instance, uint64_t op, uint32_t min_resident,
                                                         std::chrono::milliseconds timeout) {
  const auto clamped = std::clamp<int64_t>(timeout.count(), 1, channel::kMaxWaitLoadingMs);
  const channel::WaitLoadingRequest request{instance, op, static_cast<uint32_t>(clamped), min_resident};
  // The Manager answers by the timeout itself; the client waits a little longer for that answer
  // (then the request is abandoned, its slot freed when the answer comes).
  const orbitkv::Deadline deadline = orbitkv::Deadline::After(std::chrono::milliseconds(clamped) + options_.timeout);
  MutexLock lock(&control_mu_);
  ORBITKV_ASSIGN_OR_RETURN(
      channel::InboundReply reply,
      RoundTrip([&](Descriptor* d, std::span<uint8_t> slot) { return channel::EncodeWaitLoading(request, d, slot); },
                deadline));
  ORBITKV_ASSIGN_OR_RETURN(channel::WaitLoadingReply done, channel::DecodeWaitLoadingReply(reply.descriptor));
  return LoadingProgress{done.resident, done.completed};
}

Result<uint32_t> CacheClient::QueryRestore(uint64_t instance, uint32_t group, std::span<const state::StateKey> keys,
                                           std::span<const uint32_t> pages, std::chrono::milliseconds timeout) {
  if (keys.empty() || pages.empty()) return 0u;
  ORBITKV_ASSIGN_OR_RETURN(channel::QueryRequest request, ChainRequest(instance, group, keys));
  return QueryRestoreNative(instance, group, request.first_token, request.page_tokens, request.native_bytes,
                            request.natives, pages, timeout, request.key_version);
}

Result<uint32_t> CacheClient::QueryRestoreNative(uint64_t instance, uint32_t group, uint64_t first_token,
                                                 uint32_t page_tokens, uint8_t native_bytes,
                                                 std::span<const uint8_t> natives, std::span<const uint32_t> pages,
                                                 std::chrono::milliseconds timeout, uint16_t key_version,
                                                 uint8_t flags) {
  if (native_bytes == 0 || natives.size() % native_bytes != 0) {
    return Status::InvalidArgument("native keys must all have native_bytes bytes");
  }
  const size_t wanted = std::min(natives.size() / native_bytes, pages.size());
  if (wanted == 0) return 0u;
  natives = natives.first(wanted * native_bytes);
  const orbitkv::Deadline deadline = orbitkv::Deadline::After(timeout);
  // Restores started, in chain order: (first block, handle).
  std::vector<std::pair<uint32_t, uint64_t>> parts;
  uint32_t restored = 0;  // blocks [0, restored) have a restore started
  Status failure = Status::Ok();
  // Restores the part of a leased answer not restored yet (the rest of the lease is left out).
  const auto restore_new = [&](const QueryResult& answer) -> bool {
    const uint32_t upto = std::min<uint32_t>(answer.hits, static_cast<uint32_t>(wanted));
    if (upto <= restored) {
      (void)Release(instance, answer.lease);
      return true;
    }
    std::vector<uint32_t> part(upto, channel::kSkipPage);
    for (uint32_t i = restored; i < upto; ++i) part[i] = pages[i];
    Result<uint64_t> handle = StartRestore(instance, group, answer.lease, part);
    if (!handle.ok()) {
      failure = handle.status();
      return false;
    }
    parts.emplace_back(restored, *handle);
    restored = upto;
    return true;
  };
  Result<QueryResult> answer =
      QueryNative(instance, group, first_token, page_tokens, native_bytes, natives, key_version, flags);
  uint32_t want = 1;  // the next wait's min_resident: past what the last partial answer leased
  uint64_t op = 0;    // the chain's Loading operation
  while (answer.ok() && failure.ok()) {
    if (answer->hits > 0 && !restore_new(*answer)) break;
    if (answer->loading_op == 0 && !answer->partial) break;  // the chain's final answer
    if (answer->loading_op != 0) op = answer->loading_op;
    if (op == 0) break;  // a partial answer comes only after a Loading one
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline.Remaining());
    if (left.count() <= 0) break;  // what arrived in time is restored; the op runs on
    want = std::max(want, restored + 1);
    Result<LoadingProgress> waited = WaitLoadingProgress(instance, op, want, left);
    if (!waited.ok()) {
      if (waited.status().code() == StatusCode::kDeadlineExceeded) break;
      if (waited.status().code() != StatusCode::kNotFound && waited.status().code() != StatusCode::kAborted) {
        failure = waited.status();
        break;
      }
      // Taken by another query, cancelled or expired: the plain query says what is there now.
      answer = QueryNative(instance, group, first_token, page_tokens, native_bytes, natives, key_version, flags);
      continue;
    }
    want = static_cast<uint32_t>(std::max<uint64_t>(want, waited->resident + 1));
    answer = QueryNative(instance, group, first_token, page_tokens, native_bytes, natives, key_version,
                         static_cast<uint8_t>(flags | (waited->completed ? 0 : channel::kQueryPartial)));
  }
  if (!answer.ok() && failure.ok()) failure = answer.status();
  // Every started copy drains before the pages are reported; the restored prefix ends at the first
  // part that failed.
  uint32_t intact = restored;
  for (const auto& [first, handle] : parts) {
    Status done = WaitRestore(handle);
    if (!done.ok() && first < intact) {
      intact = first;
      if (failure.ok()) failure = done;
    }
  }
  if (intact == 0 && !failure.ok()) return failure;
  return intact;
}

Result<uint64_t> CacheClient::StartRestore(uint64_t instance, uint32_t group, uint64_t lease,
                                           std::span<const uint32_t> pages) {
  channel::RestoreRequest request;
  request.instance = instance;
  request.lease = lease;
  request.group = group;
  request.pages.assign(pages.begin(), pages.end());
  return SubmitRestore(request);
}

Result<uint64_t> CacheClient::StartRestoreLayers(uint64_t instance, uint32_t group, uint64_t lease,
                                                 std::span<const uint32_t> pages, uint32_t first_buffer,
                                                 uint32_t buffer_count, bool last) {
  if (buffer_count == 0) return Status::InvalidArgument("a layer restore needs buffers");
  channel::RestoreRequest request;
  request.instance = instance;
  request.lease = lease;
  request.group = group;
  request.pages.assign(pages.begin(), pages.end());
  request.layers = true;
  request.first_buffer = first_buffer;
  request.buffer_count = buffer_count;
  request.consume_lease = last;
  return SubmitRestore(request);
}

Result<uint64_t> CacheClient::SubmitRestore(const channel::RestoreRequest& request) {
  MutexLock lock(&control_mu_);
  ORBITKV_ASSIGN_OR_RETURN(uint32_t slot, control_->AcquireSlot());
  Descriptor d{};
  Result<uint32_t> bytes = channel::EncodeRestore(request, &d, control_->slot(slot));
  if (!bytes.ok()) {
    control_->ReleaseSlot(slot);
    return bytes.status();
  }
  const uint32_t generation = control_->ArmClaim(slot);
  Result<uint64_t> id = control_->Submit(d, slot, *bytes);
  if (!id.ok()) {
    control_->ReleaseSlot(slot);
    return id.status();
  }
  const uint64_t handle = next_handle_++;
  restores_.emplace(handle, PendingRestore{*id, slot, generation});
  return handle;
}

Result<bool> CacheClient::AbandonRestore(uint64_t handle) {
  MutexLock lock(&control_mu_);
  auto it = restores_.find(handle);
  if (it == restores_.end()) return Status::NotFound(fmt::format("no pending restore {}", handle));
  if (control_->AbandonClaim(it->second.slot, it->second.generation) == channel::ClaimState::kClaimed) {
    return false;  // the Manager owns it: its pages stay reserved until it completes
  }
  control_->AbandonSlot(it->second.slot);
  restores_.erase(it);
  return true;
}

std::span<uint8_t> CacheClient::claim_region() const {
  MutexLock lock(&control_mu_);
  return control_->claim_region();
}

Result<CacheClient::RestoreSignal> CacheClient::RestoreSignalOf(uint64_t handle) {
  MutexLock lock(&control_mu_);
  auto it = restores_.find(handle);
  if (it == restores_.end()) return Status::NotFound(fmt::format("no pending restore {}", handle));
  return RestoreSignal{uint64_t{it->second.slot} * sizeof(uint64_t), channel::SettledWord(it->second.generation)};
}

Status CacheClient::RecordDrain(uint64_t handle, const channel::Descriptor& reply) {
  Result<channel::RestoreReply> decoded = channel::DecodeRestoreReply(reply);
  if (!decoded.ok()) return decoded.status();
  if (decoded->drained_ns != 0) {
    drained_ns_[handle] = static_cast<int64_t>(decoded->drained_ns);
    if (drained_ns_.size() > 1024) drained_ns_.erase(drained_ns_.begin());  // never taken
  }
  return Status::Ok();
}

std::optional<int64_t> CacheClient::TakeRestoreDrainedNanos(uint64_t handle) {
  MutexLock lock(&control_mu_);
  auto it = drained_ns_.find(handle);
  if (it == drained_ns_.end()) return std::nullopt;
  const int64_t ns = it->second;
  drained_ns_.erase(it);
  return ns;
}

Result<std::optional<Status>> CacheClient::PollRestore(uint64_t handle) {
  MutexLock lock(&control_mu_);
  auto it = restores_.find(handle);
  if (it == restores_.end()) return Status::NotFound(fmt::format("no pending restore {}", handle));
  Result<channel::InboundReply> reply =
      AwaitControl(it->second.request_id, orbitkv::Deadline::At(MonoNow()), /*spin_iterations=*/0);
  if (!reply.ok()) {
    if (reply.status().code() == StatusCode::kDeadlineExceeded) return std::optional<Status>();
    // The session is gone: a restore the Manager never claimed is taken back so it never starts; one
    // it claimed stays pending (its pages reserved) until the Manager marks it done or is gone.
    if (control_->AbandonClaim(it->second.slot, it->second.generation) == channel::ClaimState::kClaimed &&
        control_->ClaimStillRunning(it->second.slot, it->second.generation)) {
      return std::optional<Status>();
    }
    control_->SettleClaim(it->second.slot, it->second.generation);
    return std::optional<Status>(reply.status());
  }
  Status status = reply->code() == StatusCode::kOk ? RecordDrain(handle, reply->descriptor)
                                                   : ErrorFromReply(*control_, *reply, it->second.slot);
  control_->SettleClaim(it->second.slot, it->second.generation);
  control_->ReleaseSlot(it->second.slot);
  restores_.erase(it);
  return std::optional<Status>(status);
}

Status CacheClient::WaitRestore(uint64_t handle, std::optional<std::chrono::milliseconds> timeout) {
  MutexLock lock(&control_mu_);
  auto it = restores_.find(handle);
  if (it == restores_.end()) return Status::NotFound(fmt::format("no pending restore {}", handle));
  const PendingRestore pending = it->second;
  const orbitkv::Deadline deadline = orbitkv::Deadline::After(timeout.value_or(options_.timeout));
  // control_mu_ is let go while this waits: other threads' queries and restores go on meanwhile.
  Result<channel::InboundReply> reply = AwaitControl(pending.request_id, deadline, options_.spin_iterations);
  if (!reply.ok()) {
    if (reply.status().code() == StatusCode::kDeadlineExceeded) {
      return Status::DeadlineExceeded(
          "the restore is still running; its destination pages stay owned by it (wait or poll "
          "again)");
    }
    // The session is dead: a restore the Manager never claimed is taken back so it never starts; one it
    // claimed may still write its pages until the Manager marks it done or is gone.
    if (control_->AbandonClaim(pending.slot, pending.generation) == channel::ClaimState::kClaimed &&
        control_->ClaimStillRunning(pending.slot, pending.generation)) {
      return Status::DeadlineExceeded(
          "the session is gone but the Manager claimed this restore and may still be writing its pages; "
          "they stay owned by it (wait or poll again)");
    }
    control_->SettleClaim(pending.slot, pending.generation);
    return reply.status();
  }
  Status status = reply->code() == StatusCode::kOk ? RecordDrain(handle, reply->descriptor)
                                                   : ErrorFromReply(*control_, *reply, pending.slot);
  control_->SettleClaim(pending.slot, pending.generation);
  control_->ReleaseSlot(pending.slot);
  restores_.erase(handle);
  return status;
}

Status CacheClient::Restore(uint64_t instance, uint32_t group, uint64_t lease, std::span<const uint32_t> pages) {
  ORBITKV_ASSIGN_OR_RETURN(uint64_t handle, StartRestore(instance, group, lease, pages));
  return WaitRestore(handle);
}

Result<int> CacheClient::CompletionFd() {
  MutexLock lock(&control_mu_);
  ORBITKV_RETURN_IF_ERROR(control_->EnableCompletionFd());
  return control_->reply_doorbell_fd();
}

bool CacheClient::SessionAlive() const {
  pollfd p{control_fd_, POLLRDHUP, 0};
  if (poll(&p, 1, 0) < 0) return errno == EINTR;
  return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) == 0;
}

Result<channel::ClientSession*> CacheClient::PublishSession() {
  if (publish_ == nullptr) {
    // A publish session belongs to this client's control session. Once that is gone (the Manager stopped or
    // restarted) a new one would be refused, or, by a new start that gave its id to another session, taken for
    // someone else's: this client is over, and the caller connects a new one (control session first).
    if (!SessionAlive()) {
      return Status::Unavailable(
          "the OrbitKV Manager closed this client's session (it stopped, restarted or was "
          "killed): connect again");
    }
    channel::ConnectOptions connect;
    connect.role = channel::SessionRole::kPublish;
    connect.control_session = session_id_;
    connect.deadline = CallDeadline();
    Result<std::unique_ptr<channel::ClientSession>> opened = channel::ClientSession::Connect(socket_path_, connect);
    if (!opened.ok() && !SessionAlive()) {  // refused because the control session just went
      return Status::Unavailable(
          fmt::format("the OrbitKV Manager closed this client's session while a publish "
                      "session was opened ({}): connect again",
                      opened.status().ToString()));
    }
    ORBITKV_ASSIGN_OR_RETURN(std::unique_ptr<channel::ClientSession> session, std::move(opened));
    if (session->welcome().manager_incarnation != manager_incarnation_) {
      return Status::Unavailable(
          fmt::format("the OrbitKV Manager restarted (incarnation {:016x}, this client's session was opened with "
                      "{:016x}): connect again",
                      session->welcome().manager_incarnation, manager_incarnation_));
    }
    publish_ = std::move(session);
  }
  return publish_.get();
}

Result<SaveResult> CacheClient::Save(uint64_t instance, uint32_t group, std::span<const SaveItem> items) {
  MutexLock lock(&publish_mu_);
  ORBITKV_ASSIGN_OR_RETURN(channel::ClientSession * session, PublishSession());
  const size_t per_request = channel::MaxSaveItems(session->slot_bytes());
  // Up to kPipeline requests in flight, so the Manager prepares one chunk while it copies another.
  constexpr size_t kPipeline = 4;
  struct InFlight {
    uint64_t id;
    uint32_t slot;
    uint32_t generation;  // of its claim word
    size_t items;
  };
  std::vector<InFlight> inflight;
  SaveResult total;
  Status failed;
  // A save's reply comes after its copy, never within a spin's time: spinning long would only take
  // a core from the Manager's copy workers (on a small host that costs throughput).
  const int spins = std::min(options_.spin_iterations, 256);
  auto wait_oldest = [&]() {
    const InFlight oldest = inflight.front();
    inflight.erase(inflight.begin());
    // After one request timed out the Manager is not answering: the rest are decided at once.
    const orbitkv::Deadline deadline =
        total.abandoned_requests + total.unconfirmed > 0 ? orbitkv::Deadline::At(MonoNow()) : CallDeadline();
    Result<channel::InboundReply> reply = session->WaitReply(oldest.id, deadline, spins);
    // Until its reply the Manager may still be reading the source pages. At the timeout one
    // compare-and-swap decides: abandoned first, the Manager will never seal what it read (the pages
    // are free); claimed first, its copy is over (the pages are free too).
    if (!reply.ok() && reply.status().code() == StatusCode::kDeadlineExceeded) {
      const channel::ClaimState state = session->AbandonClaim(oldest.slot, oldest.generation);
      session->AbandonSlot(oldest.slot);  // its late reply is dropped when it comes
      if (state == channel::ClaimState::kClaimed) {
        total.unconfirmed += oldest.items;
      } else {
        ++total.abandoned_requests;
        if (failed.ok()) {
          failed = Status::DeadlineExceeded(
              fmt::format("the Manager did not take a save of {} blocks within {} ms (stopped or overloaded); "
                          "it was abandoned and none of it will be sealed",
                          oldest.items, options_.timeout.count()));
        }
      }
      return;
    }
    if (!reply.ok()) {
      // The session is gone or poisoned: make sure the Manager, if it still runs this save, never
      // seals it (either way its copy no longer reads the pages once this returns).
      (void)session->AbandonClaim(oldest.slot, oldest.generation);
    }
    Status status =
        reply.ok() ? (reply->code() == StatusCode::kOk ? Status::Ok() : ErrorFromReply(*session, *reply, oldest.slot))
                   : reply.status();
    session->ReleaseSlot(oldest.slot);  // kept retired by the session while the request is outstanding
    Result<channel::SaveReply> counts =
        status.ok() ? channel::DecodeSaveReply(reply->descriptor) : Result<channel::SaveReply>(status);
    if (counts.ok()) {
      total.written += counts->written;
      total.skipped += counts->skipped;
    } else if (failed.ok()) {
      failed = counts.status();
    }
  };
  channel::SaveRequest request;  // reused for every chunk: no allocation per request
  request.instance = instance;
  request.group = group;
  request.items.reserve(std::min(items.size(), per_request));
  for (size_t start = 0; start < items.size() && failed.ok(); start += per_request) {
    if (inflight.size() == kPipeline) wait_oldest();
    const size_t end = std::min(items.size(), start + per_request);
    request.items.clear();
    for (size_t i = start; i < end; ++i) request.items.push_back(channel::SaveItem{items[i].key, items[i].page});
    Result<uint32_t> slot = session->AcquireSlot();
    if (!slot.ok()) {
      failed = slot.status();
      break;
    }
    Descriptor d{};
    Result<uint32_t> bytes = channel::EncodeSave(request, &d, session->slot(*slot));
    const uint32_t generation = session->ArmClaim(*slot);
    Result<uint64_t> id = bytes.ok() ? session->Submit(d, *slot, *bytes) : Result<uint64_t>(bytes.status());
    if (!id.ok()) {
      session->ReleaseSlot(*slot);
      failed = id.status();
      break;
    }
    inflight.push_back(InFlight{*id, *slot, generation, end - start});
  }
  // Every submitted chunk is waited for, even after a failure: its source pages stay in use until
  // then.
  while (!inflight.empty()) wait_oldest();
  if (!failed.ok()) return failed;
  return total;
}

Status CacheClient::Release(uint64_t instance, uint64_t lease) {
  Descriptor d{};
  channel::EncodeRelease(channel::ReleaseRequest{instance, lease}, &d);
  MutexLock lock(&control_mu_);
  return Call(d, {}).status();
}

Result<bool> CacheClient::Cancel(uint64_t instance, uint64_t op) {
  Descriptor d{};
  channel::EncodeCancel(channel::CancelRequest{instance, op}, &d);
  MutexLock lock(&control_mu_);
  ORBITKV_ASSIGN_OR_RETURN(channel::InboundReply reply, Call(d, {}));
  return reply.descriptor.arg0 != 0;
}

Result<std::string> CacheClient::Stats() {
  Descriptor d{};
  channel::EncodeStats(&d);
  std::string json;
  MutexLock lock(&control_mu_);
  ORBITKV_RETURN_IF_ERROR(Call(d, {}, &json).status());
  return json;
}

Result<CacheClient::DumpPage> CacheClient::Dump(channel::DumpKind kind, uint32_t shard, uint64_t first,
                                                std::string_view request) {
  if (first > 0xffffffffu) return Status::InvalidArgument("a dump page starts below 2^32 records");
  Descriptor d{};
  d.opcode = static_cast<uint16_t>(channel::Opcode::kDump);
  d.arg0 = static_cast<uint64_t>(kind);
  d.arg1 = (static_cast<uint64_t>(shard) << 32) | first;
  DumpPage page;
  MutexLock lock(&control_mu_);
  ORBITKV_ASSIGN_OR_RETURN(
      channel::InboundReply reply,
      Call(d, std::span(reinterpret_cast<const uint8_t*>(request.data()), request.size()), &page.text));
  page.total = reply.descriptor.arg0;
  page.next = reply.descriptor.arg1;
  return page;
}

Result<uint64_t> CacheClient::Ping() {
  Descriptor d{};
  channel::EncodePing(&d);
  MutexLock lock(&control_mu_);
  ORBITKV_ASSIGN_OR_RETURN(channel::InboundReply reply, Call(d, {}));
  ORBITKV_ASSIGN_OR_RETURN(channel::PingReply ping, channel::DecodePingReply(reply.descriptor));
  return ping.incarnation;
}

}  // namespace orbitkv::client
