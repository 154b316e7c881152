#include "server/copy_engines.h"

#include <algorithm>
#include <cstring>
#include <span>
#include <string_view>

#include "base/logging.h"

#if ORBITKV_SERVER_HAS_GPU
#include "gpu/cuda_copy_engine.h"
#include "gpu/cuda_util.h"
#include "gpu/host_memory_registry.h"
#endif

namespace orbitkv::server {

#if ORBITKV_SERVER_HAS_GPU
struct CopyEngines::Gpu {
  // Declared first: destroyed after the engine, and (with this object) after the pool.
  std::unique_ptr<gpu::HostMemoryRegistry> host_memory;
  std::unique_ptr<gpu::CudaCopyEngine> engine;
};
#else
struct CopyEngines::Gpu {};
#endif

CopyEngines::CopyEngines() = default;
CopyEngines::~CopyEngines() { Close(); }

void CopyEngines::PreparePool(core::BlockCacheOptions* options) {
#if ORBITKV_SERVER_HAS_GPU
  Result<int> devices = gpu::UsableDeviceCount();
  if (!devices.ok()) {
    ORBITKV_LOG_WARN("manager: CUDA is not usable ({}); serving CPU engines only",
                     devices.status().ToString());
    return;
  }
  if (*devices == 0) {
    ORBITKV_LOG_INFO("manager: no GPU found; serving CPU engines only");
    return;
  }
  gpu_ = std::make_unique<Gpu>();
  gpu_->host_memory = std::make_unique<gpu::HostMemoryRegistry>();
  options->pool.registrar = gpu_->host_memory.get();
  ORBITKV_LOG_INFO("manager: {} GPU(s) usable: the pool is registered with CUDA", *devices);
#else
  (void)options;
#endif
}

Status CopyEngines::Start(uint32_t copy_threads, uint32_t max_inflight, MetricsRegistry* metrics) {
  core::CpuCopyEngine::Options options;
  options.threads = static_cast<int>(copy_threads);
  options.max_inflight_batches = max_inflight;
  ORBITKV_ASSIGN_OR_RETURN(cpu_, core::CpuCopyEngine::Create(options, metrics));
#if ORBITKV_SERVER_HAS_GPU
  if (gpu_) {
    gpu::CudaCopyEngine::Options gpu_options;
    gpu_options.max_inflight_batches = std::max<uint32_t>(max_inflight, 1);
    Result<std::unique_ptr<gpu::CudaCopyEngine>> cuda =
        gpu::CudaCopyEngine::Create(gpu_options, gpu_->host_memory.get(), metrics);
    if (!cuda.ok()) return cuda.status().WithContext("starting the CUDA copy engine");
    gpu_->engine = std::move(*cuda);
  }
#endif
  return Status::Ok();
}

void CopyEngines::Shutdown() {
  if (cpu_) cpu_->Shutdown();
#if ORBITKV_SERVER_HAS_GPU
  if (gpu_ && gpu_->engine) gpu_->engine->Shutdown();
#endif
}

void CopyEngines::Close() {
  cpu_.reset();
#if ORBITKV_SERVER_HAS_GPU
  // Closes the IPC mappings still open; the host registry, which unregisters nothing the pool did
  // not, goes with this object, after the pool.
  if (gpu_) gpu_->engine.reset();
#endif
}

bool CopyEngines::gpu_enabled() const { return gpu_ != nullptr; }

Status CopyEngines::GpuUnavailable() const {
  if (gpu_enabled()) return Status::Ok();
  return Status::FailedPrecondition(
      ORBITKV_SERVER_HAS_GPU
          ? "this Manager found no usable GPU when it started, so it cannot import CUDA IPC "
            "buffers; start it where the engine's GPU is visible (check CUDA_VISIBLE_DEVICES and "
            "the NVIDIA driver), or register host memory instead"
          : "this Manager was built without CUDA (orbitkv::gpu), so it cannot import CUDA IPC "
            "buffers; use a build configured with -DORBITKV_WITH_CUDA=ON, or register host "
            "memory instead");
}

core::CopyEngine* CopyEngines::Engine(channel::BufferKind kind) const {
#if ORBITKV_SERVER_HAS_GPU
  if (kind == channel::BufferKind::kCudaIpc) return gpu_ ? gpu_->engine.get() : nullptr;
#else
  if (kind == channel::BufferKind::kCudaIpc) return nullptr;
#endif
  return cpu_.get();
}

Result<core::BufferId> CopyEngines::RegisterSharedMemory(uint8_t* base, uint64_t bytes) {
  return cpu_->RegisterBuffer(base, bytes);
}

Result<core::BufferId> CopyEngines::RegisterProcessMemory(pid_t pid, uint64_t address,
                                                          uint64_t bytes) {
  return cpu_->RegisterProcessBuffer(pid, address, bytes);
}

Result<core::BufferId> CopyEngines::RegisterCudaIpc(const channel::CudaIpcBuffer& cuda,
                                                    uint64_t bytes) {
#if ORBITKV_SERVER_HAS_GPU
  if (!gpu_ || !gpu_->engine) return GpuUnavailable();
  const size_t bus_id_length = strnlen(cuda.pci_bus_id, sizeof(cuda.pci_bus_id));
  if (bus_id_length == sizeof(cuda.pci_bus_id)) {
    return Status::InvalidArgument("its PCI bus id is not terminated");
  }
  const std::string_view bus_id(cuda.pci_bus_id, bus_id_length);
  ORBITKV_ASSIGN_OR_RETURN(int device, gpu::DeviceByPciBusId(bus_id));
  Result<core::BufferId> id = gpu_->engine->RegisterIpcBuffer(
      std::span<const uint8_t>(cuda.ipc_handle, sizeof(cuda.ipc_handle)), device, bytes,
      cuda.offset);
  if (!id.ok()) {
    return id.status().WithContext(
        fmt::format("importing {} bytes at offset {} of a CUDA IPC allocation on GPU {}", bytes,
                    cuda.offset, bus_id));
  }
  return id;
#else
  (void)cuda;
  (void)bytes;
  return GpuUnavailable();
#endif
}

Status CopyEngines::Unregister(channel::BufferKind kind, core::BufferId id) {
#if ORBITKV_SERVER_HAS_GPU
  if (kind == channel::BufferKind::kCudaIpc) {
    if (!gpu_ || !gpu_->engine) return Status::NotFound("no CUDA copy engine");
    return gpu_->engine->UnregisterBuffer(id);
  }
#else
  (void)kind;
#endif
  return cpu_->UnregisterBuffer(id);
}

}  // namespace orbitkv::server
