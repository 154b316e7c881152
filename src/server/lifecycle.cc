// Lifecycle frames: instance and group registration over the session socket.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>

#include <cstring>
#include <span>
#include <string_view>

#include "base/logging.h"
#include "server/manager.h"

namespace orbitkv::server {
namespace {

constexpr uint64_t kPage = 4096;

const char* BufferKindName(channel::BufferKind kind) {
  switch (kind) {
    case channel::BufferKind::kSharedMemory:
      return "shared-memory";
    case channel::BufferKind::kProcessMemory:
      return "process-memory";
    case channel::BufferKind::kCudaIpc:
      return "CUDA IPC";
  }
  return "unknown";
}

// page_bytes + (num_pages - 1) * stride + base_offset <= buffer_bytes, without overflow.
bool PagesFit(const channel::BufferDescriptor& b, uint32_t num_pages) {
  if (b.page_bytes == 0 || b.page_bytes > b.buffer_bytes) return false;
  const uint64_t last = num_pages - 1;
  if (last != 0 && b.page_stride > (UINT64_MAX - b.page_bytes) / last) return false;
  const uint64_t span = last * b.page_stride + b.page_bytes;
  if (b.base_offset > UINT64_MAX - span) return false;
  return b.base_offset + span <= b.buffer_bytes;
}

// What follows a RegisterGroup's descriptors per buffer: nothing (shared memory), one address or
// one CudaIpcBuffer.
size_t TrailerBytes(channel::BufferKind kind) {
  if (kind == channel::BufferKind::kProcessMemory) return sizeof(uint64_t);
  if (kind == channel::BufferKind::kCudaIpc) return sizeof(channel::CudaIpcBuffer);
  return 0;
}

// The header of a RegisterGroup frame, checked against the frame's size and fds.
Result<channel::RegisterGroupHeader> GroupHeader(channel::Frame& frame) {
  ORBITKV_ASSIGN_OR_RETURN(channel::RegisterGroupHeader header,
                           channel::BodyAs<channel::RegisterGroupHeader>(frame, /*allow_trailing=*/true));
  if (header.buffer_count == 0 || header.buffer_count > channel::kMaxFrameFds) {
    return Status::InvalidArgument(
        fmt::format("a group needs 1-{} buffers, not {}", channel::kMaxFrameFds, header.buffer_count));
  }
  if (header.buffer_kind > channel::kMaxBufferKind) {
    return Status::InvalidArgument(fmt::format("unknown buffer kind {}", header.buffer_kind));
  }
  const auto kind = static_cast<channel::BufferKind>(header.buffer_kind);
  const size_t descriptors_end = sizeof(header) + header.buffer_count * sizeof(channel::BufferDescriptor);
  if (frame.body.size() != descriptors_end + header.buffer_count * TrailerBytes(kind)) {
    return Status::InvalidArgument("RegisterGroup body size does not match its buffer count");
  }
  const size_t expected_fds = kind == channel::BufferKind::kSharedMemory ? header.buffer_count : 0;
  if (frame.fds.size() != expected_fds) {
    return Status::InvalidArgument(
        fmt::format("RegisterGroup names {} buffers but passed {} fds", header.buffer_count, frame.fds.size()));
  }
  if (header.num_pages == 0) return Status::InvalidArgument("a group needs at least one page");
  return header;
}

}  // namespace

Status Manager::HandleFrame(Session& session, channel::Frame& frame) {
  const uint64_t request_id = frame.header.request_id;
  switch (frame.type()) {
    case channel::FrameType::kRegisterInstance: {
      Status status = RegisterInstance(session, frame);
      return session.channel->SendLifecycleReply(request_id, status);
    }
    case channel::FrameType::kRegisterGroup: {
      Result<uint64_t> padded = RegisterGroup(session, frame);
      return session.channel->SendLifecycleReply(request_id, padded.ok() ? Status::Ok() : padded.status(),
                                                 padded.ok() ? *padded : 0);
    }
    case channel::FrameType::kUnregisterInstance: {
      ORBITKV_ASSIGN_OR_RETURN(channel::UnregisterInstanceBody body,
                               channel::BodyAs<channel::UnregisterInstanceBody>(frame));
      return session.channel->SendLifecycleReply(request_id, UnregisterInstance(session, body.instance_id));
    }
    default:
      // Engines never send Welcome, Reject or replies: a protocol violation.
      return Status::InvalidArgument(fmt::format("unexpected frame type {} from an engine", frame.header.type));
  }
}

Status Manager::RegisterInstance(Session& session, const channel::Frame& frame) {
  if (session.channel->role() != channel::SessionRole::kControl) {
    return Status::FailedPrecondition("instances are registered on the control session");
  }
  ORBITKV_ASSIGN_OR_RETURN(channel::RegisterInstanceBody body,
                           channel::BodyAs<channel::RegisterInstanceBody>(frame, /*allow_trailing=*/true));
  ORBITKV_ASSIGN_OR_RETURN(std::string label, channel::InstanceLabel(frame.body));
  state::Digest256 digest;
  std::memcpy(digest.bytes.data(), body.namespace_digest, 32);
  ORBITKV_ASSIGN_OR_RETURN(
      bool added, service_->instances().Register(session.id, body.instance_id, state::StateNamespace(digest), label));
  if (added) {
    instances_active_->Add(1);
    ORBITKV_LOG_INFO("manager: session {} registered instance {}{}{}", session.id, body.instance_id,
                     label.empty() ? "" : ": ", label);
  }
  return Status::Ok();
}

Result<uint64_t> Manager::RegisterGroup(Session& session, channel::Frame& frame) {
  ORBITKV_ASSIGN_OR_RETURN(channel::RegisterGroupHeader header, GroupHeader(frame));
  const auto kind = static_cast<channel::BufferKind>(header.buffer_kind);
  const pid_t engine_pid = session.channel->peer().pid;
  if (kind == channel::BufferKind::kProcessMemory && engine_pid <= 0) {
    return Status::FailedPrecondition("the engine's process id is unknown: use shared memory");
  }
  if (kind == channel::BufferKind::kCudaIpc && !engines_.gpu_enabled()) {
    return engines_.GpuUnavailable();
  }
  ORBITKV_ASSIGN_OR_RETURN(std::shared_ptr<EngineInstance> instance,
                           service_->instances().Find(session.owner_id, header.instance_id));

  auto group = std::make_shared<KvGroup>();
  group->group = header.group;
  group->num_pages = header.num_pages;
  group->kind = kind;
  group->engine = engines_.Engine(kind);
  // On any failure, buffers already registered with the copy engine are unregistered (the group
  // unmaps them).
  auto abandon = [&](Status status) {
    UnregisterBuffers(*group);
    return status;
  };
  const size_t descriptors_end = sizeof(header) + header.buffer_count * sizeof(channel::BufferDescriptor);
  for (uint32_t i = 0; i < header.buffer_count; ++i) {
    channel::BufferDescriptor layout;
    std::memcpy(&layout, frame.body.data() + sizeof(header) + i * sizeof(layout), sizeof(layout));
    if (!PagesFit(layout, header.num_pages)) {
      return abandon(Status::InvalidArgument(fmt::format(
          "buffer {}: {} pages of {} bytes with stride {} from offset {} do not fit its {} bytes", i, header.num_pages,
          layout.page_bytes, layout.page_stride, layout.base_offset, layout.buffer_bytes)));
    }
    Status added = AddBuffer(group.get(), i, layout, frame, descriptors_end + i * TrailerBytes(kind), engine_pid);
    if (!added.ok()) return abandon(added);
    group->block_bytes += layout.page_bytes;
  }
  group->padded_bytes = (group->block_bytes + kPage - 1) / kPage * kPage;
  if (group->block_bytes > cache_->pool().slab_bytes()) {
    return abandon(
        Status::InvalidArgument(fmt::format("a block of {} bytes exceeds the pool's {}-byte slabs; start "
                                            "the Manager with a larger --slab",
                                            group->block_bytes, cache_->pool().slab_bytes())));
  }
  const uint64_t padded = group->padded_bytes;
  const size_t buffers = group->buffers.size();
  Status added = instance->AddGroup(group);
  if (!added.ok()) return abandon(added);
  ORBITKV_LOG_INFO("manager: instance {} group {}: {} pages of {} bytes in {} {} buffer(s)", header.instance_id,
                   header.group, header.num_pages, group->block_bytes, buffers, BufferKindName(kind));
  return padded;
}

Status Manager::AddBuffer(KvGroup* group, uint32_t index, const channel::BufferDescriptor& layout,
                          const channel::Frame& frame, size_t trailer_offset, pid_t engine_pid) {
  const uint8_t* trailer = frame.body.data() + trailer_offset;
  switch (group->kind) {
    case channel::BufferKind::kSharedMemory:
      return AddSharedMemoryBuffer(group, index, layout, frame.fds[index].get());
    case channel::BufferKind::kProcessMemory: {
      uint64_t address;
      std::memcpy(&address, trailer, sizeof(address));
      return AddProcessBuffer(group, index, layout, engine_pid, address);
    }
    case channel::BufferKind::kCudaIpc: {
      channel::CudaIpcBuffer cuda;
      std::memcpy(&cuda, trailer, sizeof(cuda));
      Result<core::BufferId> id = engines_.RegisterCudaIpc(cuda, layout.buffer_bytes);
      if (!id.ok()) return id.status().WithContext(fmt::format("buffer {}", index));
      group->buffers.push_back(KvGroup::Buffer{nullptr, layout.buffer_bytes, layout, *id});
      return Status::Ok();
    }
  }
  return Status::InvalidArgument("unknown buffer kind");
}

Status Manager::AddSharedMemoryBuffer(KvGroup* group, uint32_t index, const channel::BufferDescriptor& layout, int fd) {
  // An engine that shrank a buffer the Manager copies from would make the Manager fault (SIGBUS)
  // and take every engine's cache down with it: only memfds sealed against resizing are mapped.
  const int seals = fcntl(fd, F_GET_SEALS);
  constexpr int kNeeded = F_SEAL_SHRINK | F_SEAL_GROW;
  if (seals < 0 || (seals & kNeeded) != kNeeded) {
    return Status::FailedPrecondition(
        fmt::format("buffer {} is {}: the engine could resize it while the Manager copies; allocate KV with "
                    "orbitkv.shm (Python) or orbitkv::client::CreateKvMemory (C++), or create the memfd with "
                    "MFD_ALLOW_SEALING and seal it with fcntl(F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW)",
                    index, seals < 0 ? "not a sealable memfd" : "a memfd not sealed against shrinking and growing"));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0) return ErrnoStatus("fstat engine buffer", errno);
  if (static_cast<uint64_t>(st.st_size) < layout.buffer_bytes) {
    return Status::InvalidArgument(
        fmt::format("buffer {} is {} bytes, smaller than the {} it claims", index, st.st_size, layout.buffer_bytes));
  }
  void* mapped = mmap(nullptr, layout.buffer_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (mapped == MAP_FAILED) return ErrnoStatus(fmt::format("mmap engine buffer {}", index), errno);
  KvGroup::Buffer buffer;
  buffer.base = static_cast<uint8_t*>(mapped);
  buffer.bytes = layout.buffer_bytes;
  buffer.layout = layout;
  group->buffers.push_back(buffer);  // the group unmaps it, whatever happens next
  ORBITKV_ASSIGN_OR_RETURN(group->buffers.back().id, engines_.RegisterSharedMemory(buffer.base, buffer.bytes));
  return Status::Ok();
}

Status Manager::AddProcessBuffer(KvGroup* group, uint32_t index, const channel::BufferDescriptor& layout,
                                 pid_t engine_pid, uint64_t address) {
  ORBITKV_ASSIGN_OR_RETURN(core::BufferId id, engines_.RegisterProcessMemory(engine_pid, address, layout.buffer_bytes));
  group->buffers.push_back(KvGroup::Buffer{nullptr, layout.buffer_bytes, layout, id});
  // Probe the first byte now, so a buffer the Manager may not access fails here with its reason
  // rather than at the first restore.
  uint8_t probe;
  iovec local{&probe, 1};
  iovec remote{reinterpret_cast<void*>(address + layout.base_offset), 1};
  if (process_vm_readv(engine_pid, &local, 1, &remote, 1, 0) != 1) {
    return Status::PermissionDenied(
        fmt::format("buffer {}: cannot read engine process {} at {:#x}: {} (process memory needs the same "
                    "uid or CAP_SYS_PTRACE; allocate KV in shared memory with orbitkv.shm otherwise)",
                    index, engine_pid, address + layout.base_offset, std::strerror(errno)));
  }
  return Status::Ok();
}

void Manager::UnregisterBuffers(KvGroup& group) {
  for (KvGroup::Buffer& buffer : group.buffers) {
    if (buffer.id.generation == 0) continue;  // never registered
    Status unregistered = engines_.Unregister(group.kind, buffer.id);
    if (!unregistered.ok()) ORBITKV_LOG_WARN("manager: unregister buffer: {}", unregistered.ToString());
  }
}

Status Manager::UnregisterInstance(Session& session, uint64_t instance_id) {
  ORBITKV_ASSIGN_OR_RETURN(std::shared_ptr<EngineInstance> instance,
                           service_->instances().Remove(session.owner_id, instance_id));
  RetireInstance(instance);
  return Status::Ok();
}

}  // namespace orbitkv::server
