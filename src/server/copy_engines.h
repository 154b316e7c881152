// CopyEngines: the Manager's copy engines, the one seam for the optional GPU module.
//
// The CPU engine (shared-memory and process-memory buffers) always exists; the CUDA engine (GPU
// buffers imported with CUDA IPC) exists when the build has the gpu module and a GPU was usable at
// start. Only then is the pool registered with CUDA (mapped, so the copy kernels read and write it
// in place): PreparePool must run before the pool is created. A Manager without a GPU refuses CUDA
// groups with an error naming why and otherwise serves as usual. The gpu module is reached only
// through GpuSupport (gpu_support.h).
//
// Lifetime: PreparePool, then (once the pool exists) Start, Shutdown (drains), Close (destroys the
// engines, closing IPC mappings) before the pool goes; the object itself (the CUDA host registry)
// after the pool.
//
// Thread safety: Engine, Register*, Unregister are safe from any thread once started.
#ifndef ORBITKV_SERVER_COPY_ENGINES_H_
#define ORBITKV_SERVER_COPY_ENGINES_H_

#include <sys/types.h>

#include <memory>
#include <string>

#include "base/metrics.h"
#include "base/result.h"
#include "channel/wire.h"
#include "core/block_cache.h"
#include "core/copy_engine.h"
#include "core/cpu_copy_engine.h"
#include "server/gpu_support.h"

namespace orbitkv::server {

class CopyEngines {
 public:
  CopyEngines();
  ~CopyEngines();
  CopyEngines(const CopyEngines&) = delete;
  CopyEngines& operator=(const CopyEngines&) = delete;

  // When the build has the gpu module and a GPU is usable, makes the CUDA host registry the pool's
  // registrar; otherwise leaves the Manager CPU-only (and says so in the log). `gpus` (--gpus):
  // nullopt every visible GPU, empty none, else those ordinals (an error when one is missing).
  Status PreparePool(core::BlockCacheOptions* options, const std::optional<std::vector<int>>& gpus);
  // Creates the CPU engine (`copy_threads` workers) and, when PreparePool found a GPU, the CUDA
  // one; each admits `max_inflight` batches.
  Status Start(uint32_t copy_threads, uint32_t max_inflight, uint64_t gpu_restore_staging_bytes,
               MetricsRegistry* metrics);
  void Shutdown();
  void Close();

  // Whether engines may register GPU buffers (CUDA IPC).
  bool gpu_enabled() const;
  // The GPUs served ("none" without).
  std::string DescribeGpus() const;
  // Why not (FailedPrecondition naming the fix); OK when they may.
  Status GpuUnavailable() const;
  // The engine that copies buffers of `kind` (null for CUDA IPC without a GPU).
  core::CopyEngine* Engine(channel::BufferKind kind) const;
  core::CpuCopyEngine& cpu() const { return *cpu_; }

  Result<core::BufferId> RegisterSharedMemory(uint8_t* base, uint64_t bytes);
  Result<core::BufferId> RegisterProcessMemory(pid_t pid, uint64_t address, uint64_t bytes);
  // Imports `bytes` at `cuda.offset` of the CUDA IPC allocation on the GPU `cuda.pci_bus_id` names.
  // FailedPrecondition naming the fix when this Manager has no GPU.
  Result<core::BufferId> RegisterCudaIpc(const channel::CudaIpcBuffer& cuda, uint64_t bytes);
  // Waits for the buffer's in-flight copies, then forgets it.
  Status Unregister(channel::BufferKind kind, core::BufferId id);

 private:
  // Declared first: destroyed after the CPU engine; its host registry goes with the Manager's
  // CopyEngines, after the pool.
  std::unique_ptr<GpuSupport> gpu_;
  std::unique_ptr<core::CpuCopyEngine> cpu_;
};

}  // namespace orbitkv::server

#endif  // ORBITKV_SERVER_COPY_ENGINES_H_
