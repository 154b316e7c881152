#include "server/copy_engines.h"

namespace orbitkv::server {

CopyEngines::CopyEngines() = default;
CopyEngines::~CopyEngines() { Close(); }

Status CopyEngines::PreparePool(core::BlockCacheOptions* options, const std::optional<std::vector<int>>& gpus) {
  ORBITKV_ASSIGN_OR_RETURN(gpu_, GpuSupport::Detect(options, gpus));
  return Status::Ok();
}

Status CopyEngines::Start(uint32_t copy_threads, uint32_t max_inflight, uint64_t gpu_restore_staging_bytes,
                          MetricsRegistry* metrics) {
  core::CpuCopyEngine::Options options;
  options.threads = static_cast<int>(copy_threads);
  options.max_inflight_batches = max_inflight;
  ORBITKV_ASSIGN_OR_RETURN(cpu_, core::CpuCopyEngine::Create(options, metrics));
  if (gpu_) ORBITKV_RETURN_IF_ERROR(gpu_->Start(max_inflight, gpu_restore_staging_bytes, metrics));
  return Status::Ok();
}

void CopyEngines::Shutdown() {
  if (cpu_) cpu_->Shutdown();
  if (gpu_) gpu_->Shutdown();
}

void CopyEngines::Close() {
  cpu_.reset();
  if (gpu_) gpu_->CloseEngine();
}

bool CopyEngines::gpu_enabled() const { return gpu_ != nullptr; }

std::string CopyEngines::DescribeGpus() const { return gpu_ ? gpu_->Describe() : std::string("none"); }

Status CopyEngines::GpuUnavailable() const { return gpu_enabled() ? Status::Ok() : GpuSupport::Unavailable(); }

core::CopyEngine* CopyEngines::Engine(channel::BufferKind kind) const {
  if (kind == channel::BufferKind::kCudaIpc) return gpu_ ? gpu_->engine() : nullptr;
  return cpu_.get();
}

Result<core::BufferId> CopyEngines::RegisterSharedMemory(uint8_t* base, uint64_t bytes) {
  return cpu_->RegisterBuffer(base, bytes);
}

Result<core::BufferId> CopyEngines::RegisterProcessMemory(pid_t pid, uint64_t address, uint64_t bytes) {
  return cpu_->RegisterProcessBuffer(pid, address, bytes);
}

Result<core::BufferId> CopyEngines::RegisterCudaIpc(const channel::CudaIpcBuffer& cuda, uint64_t bytes) {
  if (!gpu_) return GpuSupport::Unavailable();
  return gpu_->RegisterCudaIpc(cuda, bytes);
}

Status CopyEngines::Unregister(channel::BufferKind kind, core::BufferId id) {
  if (kind == channel::BufferKind::kCudaIpc) {
    if (!gpu_) return Status::NotFound("no CUDA copy engine");
    return gpu_->Unregister(id);
  }
  return cpu_->UnregisterBuffer(id);
}

}  // namespace orbitkv::server
