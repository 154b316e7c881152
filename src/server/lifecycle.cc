// Lifecycle frames: instance and group registration over the session socket.
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>

#include <cstring>
#include <span>
#include <string_view>

#include "base/logging.h"
#include "server/manager.h"
#include "server/manager_internal.h"

#if ORBITKV_SERVER_HAS_GPU
#include "gpu/cuda_copy_engine.h"
#include "gpu/cuda_util.h"
#endif

namespace orbitkv::server {
namespace {

constexpr uint64_t kPage = 4096;

// page_bytes + (num_pages - 1) * stride + base_offset <= buffer_bytes, without overflow.
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

bool PagesFit(const channel::BufferDescriptor& b, uint32_t num_pages) {
  if (b.page_bytes == 0 || b.page_bytes > b.buffer_bytes) return false;
  const uint64_t last = num_pages - 1;
  if (last != 0 && b.page_stride > (UINT64_MAX - b.page_bytes) / last) return false;
  const uint64_t span = last * b.page_stride + b.page_bytes;
  if (b.base_offset > UINT64_MAX - span) return false;
  return b.base_offset + span <= b.buffer_bytes;
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
      return session.channel->SendLifecycleReply(
          request_id, padded.ok() ? Status::Ok() : padded.status(), padded.ok() ? *padded : 0);
    }
    case channel::FrameType::kUnregisterInstance: {
      ORBITKV_ASSIGN_OR_RETURN(channel::UnregisterInstanceBody body,
                               channel::BodyAs<channel::UnregisterInstanceBody>(frame));
      return session.channel->SendLifecycleReply(request_id,
                                                 UnregisterInstance(session, body.instance_id));
    }
    default:
      // Engines never send Welcome, Reject or replies: a protocol violation.
      return Status::InvalidArgument(
          fmt::format("unexpected frame type {} from an engine", frame.header.type));
  }
}

Status Manager::RegisterInstance(Session& session, const channel::Frame& frame) {
  if (session.channel->role() != channel::SessionRole::kControl) {
    return Status::FailedPrecondition("instances are registered on the control session");
  }
  ORBITKV_ASSIGN_OR_RETURN(channel::RegisterInstanceBody body,
                           channel::BodyAs<channel::RegisterInstanceBody>(frame));
  MutexLock lock(&instances_mu_);
  auto it = instances_.find(body.instance_id);
  if (it != instances_.end()) {
    if (it->second->owner_session != session.id) {
      return Status::AlreadyExists(
          fmt::format("instance {} is registered by another live session; pick another instance id "
                      "or stop that "
                      "engine first",
                      body.instance_id));
    }
    if (std::memcmp(it->second->namespace_digest.data(), body.namespace_digest, 32) != 0) {
      return Status::AlreadyExists(fmt::format(
          "instance {} is already registered with another namespace", body.instance_id));
    }
    return Status::Ok();  // idempotent
  }
  auto instance = std::make_shared<Instance>();
  instance->id = body.instance_id;
  std::memcpy(instance->namespace_digest.data(), body.namespace_digest, 32);
  instance->owner_session = session.id;
  instances_.emplace(body.instance_id, std::move(instance));
  instances_active_->Add(1);
  ORBITKV_LOG_INFO("manager: session {} registered instance {}", session.id, body.instance_id);
  return Status::Ok();
}

Result<uint64_t> Manager::RegisterGroup(Session& session, channel::Frame& frame) {
  ORBITKV_ASSIGN_OR_RETURN(
      channel::RegisterGroupHeader header,
      channel::BodyAs<channel::RegisterGroupHeader>(frame, /*allow_trailing=*/true));
  if (header.buffer_count == 0 || header.buffer_count > channel::kMaxFrameFds) {
    return Status::InvalidArgument(fmt::format("a group needs 1-{} buffers, not {}",
                                               channel::kMaxFrameFds, header.buffer_count));
  }
  if (header.buffer_kind > channel::kMaxBufferKind) {
    return Status::InvalidArgument(fmt::format("unknown buffer kind {}", header.buffer_kind));
  }
  const auto kind = static_cast<channel::BufferKind>(header.buffer_kind);
  // What follows the descriptors: nothing (shared memory), one address or one CudaIpcBuffer each.
  size_t trailer_bytes = 0;
  if (kind == channel::BufferKind::kProcessMemory) trailer_bytes = sizeof(uint64_t);
  if (kind == channel::BufferKind::kCudaIpc) trailer_bytes = sizeof(channel::CudaIpcBuffer);
  const size_t descriptors_end =
      sizeof(header) + header.buffer_count * sizeof(channel::BufferDescriptor);
  if (frame.body.size() != descriptors_end + header.buffer_count * trailer_bytes) {
    return Status::InvalidArgument("RegisterGroup body size does not match its buffer count");
  }
  const size_t expected_fds = kind == channel::BufferKind::kSharedMemory ? header.buffer_count : 0;
  if (frame.fds.size() != expected_fds) {
    return Status::InvalidArgument(fmt::format("RegisterGroup names {} buffers but passed {} fds",
                                               header.buffer_count, frame.fds.size()));
  }
  const pid_t engine_pid = session.channel->peer().pid;
  if (kind == channel::BufferKind::kProcessMemory && engine_pid <= 0) {
    return Status::FailedPrecondition("the engine's process id is unknown: use shared memory");
  }
  if (kind == channel::BufferKind::kCudaIpc && !gpu_enabled()) {
    return Status::FailedPrecondition(
        ORBITKV_SERVER_HAS_GPU
            ? "this Manager found no usable GPU when it started, so it cannot import CUDA IPC "
              "buffers; start it where the engine's GPU is visible (check CUDA_VISIBLE_DEVICES and "
              "the NVIDIA driver), or register host memory instead"
            : "this Manager was built without CUDA (orbitkv::gpu), so it cannot import CUDA IPC "
              "buffers; use a build configured with -DORBITKV_WITH_CUDA=ON, or register host "
              "memory instead");
  }
  if (header.num_pages == 0) return Status::InvalidArgument("a group needs at least one page");
  ORBITKV_ASSIGN_OR_RETURN(std::shared_ptr<Instance> instance,
                           InstanceFor(session, header.instance_id));

  auto group = std::make_shared<Group>();
  group->group = header.group;
  group->num_pages = header.num_pages;
  group->kind = kind;
  group->engine = copy_engine_.get();
#if ORBITKV_SERVER_HAS_GPU
  if (kind == channel::BufferKind::kCudaIpc) group->engine = cuda_engine_.get();
#endif
  // On any failure, buffers already registered with the copy engine are unregistered (the Group
  // unmaps them).
  auto abandon = [&](Status status) {
    for (Group::Buffer& b : group->buffers) {
      if (b.id.generation != 0) (void)UnregisterGroupBuffer(*group, b.id);
    }
    return status;
  };
  for (uint32_t i = 0; i < header.buffer_count; ++i) {
    channel::BufferDescriptor layout;
    std::memcpy(&layout, frame.body.data() + sizeof(header) + i * sizeof(layout), sizeof(layout));
    if (!PagesFit(layout, header.num_pages)) {
      return abandon(Status::InvalidArgument(fmt::format(
          "buffer {}: {} pages of {} bytes with stride {} from offset {} do not fit its {} bytes",
          i, header.num_pages, layout.page_bytes, layout.page_stride, layout.base_offset,
          layout.buffer_bytes)));
    }
    const uint8_t* trailer = frame.body.data() + descriptors_end + i * trailer_bytes;
    Status added;
    switch (kind) {
      case channel::BufferKind::kSharedMemory:
        added = AddSharedMemoryBuffer(group.get(), i, layout, frame.fds[i].get());
        break;
      case channel::BufferKind::kProcessMemory: {
        uint64_t address;
        std::memcpy(&address, trailer, sizeof(address));
        added = AddProcessBuffer(group.get(), i, layout, engine_pid, address);
        break;
      }
      case channel::BufferKind::kCudaIpc: {
        channel::CudaIpcBuffer cuda;
        std::memcpy(&cuda, trailer, sizeof(cuda));
        added = AddCudaIpcBuffer(group.get(), i, layout, cuda);
        break;
      }
    }
    if (!added.ok()) return abandon(added);
    group->block_bytes += layout.page_bytes;
  }
  group->padded_bytes = (group->block_bytes + kPage - 1) / kPage * kPage;
  if (group->block_bytes > cache_->pool().slab_bytes()) {
    return abandon(Status::InvalidArgument(
        fmt::format("a block of {} bytes exceeds the pool's {}-byte slabs; start "
                    "the Manager with a larger --slab",
                    group->block_bytes, cache_->pool().slab_bytes())));
  }
  MutexLock lock(&instance->mu);
  if (instance->groups.count(header.group) != 0) {
    return abandon(Status::AlreadyExists(fmt::format(
        "group {} of instance {} is already registered", header.group, header.instance_id)));
  }
  instance->groups.emplace(header.group, group);
  ORBITKV_LOG_INFO("manager: instance {} group {}: {} pages of {} bytes in {} {} buffer(s)",
                   header.instance_id, header.group, header.num_pages, group->block_bytes,
                   group->buffers.size(), BufferKindName(kind));
  return group->padded_bytes;
}

Status Manager::AddSharedMemoryBuffer(Group* group, uint32_t index,
                                      const channel::BufferDescriptor& layout, int fd) {
  struct stat st {};
  if (fstat(fd, &st) != 0) return ErrnoStatus("fstat engine buffer", errno);
  if (static_cast<uint64_t>(st.st_size) < layout.buffer_bytes) {
    return Status::InvalidArgument(
        fmt::format("buffer {} is {} bytes, smaller than the {} it claims", index, st.st_size,
                    layout.buffer_bytes));
  }
  void* mapped = mmap(nullptr, layout.buffer_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (mapped == MAP_FAILED) return ErrnoStatus(fmt::format("mmap engine buffer {}", index), errno);
  Group::Buffer buffer;
  buffer.base = static_cast<uint8_t*>(mapped);
  buffer.bytes = layout.buffer_bytes;
  buffer.layout = layout;
  group->buffers.push_back(buffer);  // the Group unmaps it, whatever happens next
  ORBITKV_ASSIGN_OR_RETURN(group->buffers.back().id,
                           copy_engine_->RegisterBuffer(buffer.base, buffer.bytes));
  return Status::Ok();
}

Status Manager::AddProcessBuffer(Group* group, uint32_t index,
                                 const channel::BufferDescriptor& layout, pid_t engine_pid,
                                 uint64_t address) {
  ORBITKV_ASSIGN_OR_RETURN(core::BufferId id, copy_engine_->RegisterProcessBuffer(
                                                  engine_pid, address, layout.buffer_bytes));
  Group::Buffer buffer;
  buffer.bytes = layout.buffer_bytes;
  buffer.layout = layout;
  buffer.id = id;
  group->buffers.push_back(buffer);
  // Probe the first byte now, so a buffer the Manager may not access fails here with its reason
  // rather than at the first restore.
  uint8_t probe;
  iovec local{&probe, 1};
  iovec remote{reinterpret_cast<void*>(address + layout.base_offset), 1};
  if (process_vm_readv(engine_pid, &local, 1, &remote, 1, 0) != 1) {
    return Status::PermissionDenied(fmt::format(
        "buffer {}: cannot read engine process {} at {:#x}: {} (process memory needs the same "
        "uid or CAP_SYS_PTRACE; allocate KV in shared memory with orbitkv.shm otherwise)",
        index, engine_pid, address + layout.base_offset, std::strerror(errno)));
  }
  return Status::Ok();
}

Status Manager::AddCudaIpcBuffer(Group* group, uint32_t index,
                                 const channel::BufferDescriptor& layout,
                                 const channel::CudaIpcBuffer& cuda) {
#if ORBITKV_SERVER_HAS_GPU
  const size_t bus_id_length = strnlen(cuda.pci_bus_id, sizeof(cuda.pci_bus_id));
  if (bus_id_length == sizeof(cuda.pci_bus_id)) {
    return Status::InvalidArgument(
        fmt::format("buffer {}: its PCI bus id is not terminated", index));
  }
  const std::string_view bus_id(cuda.pci_bus_id, bus_id_length);
  Result<int> device = gpu::DeviceByPciBusId(bus_id);
  if (!device.ok()) return device.status().WithContext(fmt::format("buffer {}", index));
  Result<core::BufferId> id = cuda_engine_->RegisterIpcBuffer(
      std::span<const uint8_t>(cuda.ipc_handle, sizeof(cuda.ipc_handle)), *device,
      layout.buffer_bytes, cuda.offset);
  if (!id.ok()) {
    return id.status().WithContext(
        fmt::format("buffer {}: importing {} bytes at offset {} of a CUDA IPC allocation on GPU {}",
                    index, layout.buffer_bytes, cuda.offset, bus_id));
  }
  Group::Buffer buffer;
  buffer.bytes = layout.buffer_bytes;
  buffer.layout = layout;
  buffer.id = *id;
  group->buffers.push_back(buffer);
  return Status::Ok();
#else
  (void)group;
  (void)index;
  (void)layout;
  (void)cuda;
  return Status::FailedPrecondition("this Manager was built without CUDA");
#endif
}

Status Manager::UnregisterInstance(Session& session, uint64_t instance_id) {
  ORBITKV_ASSIGN_OR_RETURN(std::shared_ptr<Instance> instance, InstanceFor(session, instance_id));
  {
    MutexLock lock(&instances_mu_);
    instances_.erase(instance_id);
  }
  RetireInstance(instance);
  return Status::Ok();
}

}  // namespace orbitkv::server
