// GpuSupport: what the Manager needs of the optional gpu module, behind one interface.
//
// With the gpu module built and a GPU usable at start, Detect() returns the CUDA side: it makes the
// CUDA host registry the pool's registrar (so the copy kernels read and write the pool in place),
// and later runs the CUDA copy engine that imports engines' GPU buffers (CUDA IPC). Otherwise it
// returns null and Unavailable() says why, naming the fix. gpu_support_cuda.cc implements it when
// the module is built, gpu_support_none.cc when it is not: no source holds an `#if` on it.
//
// Lifetime: Detect before the pool is created; Start; Shutdown (drains); CloseEngine (IPC mappings
// closed) before the pool goes; the object itself (the host registry) after the pool.
#ifndef ORBITKV_SERVER_GPU_SUPPORT_H_
#define ORBITKV_SERVER_GPU_SUPPORT_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "base/metrics.h"
#include "base/result.h"
#include "channel/wire.h"
#include "core/block_cache.h"
#include "core/copy_engine.h"

namespace orbitkv::server {

class GpuSupport {
 public:
  // `gpus`: nullopt for every visible GPU, empty for none (null: CPU engines only), or CUDA
  // ordinals. Null when no GPU is usable; an error when `gpus` names one this host or build lacks.
  static Result<std::unique_ptr<GpuSupport>> Detect(core::BlockCacheOptions* options,
                                                    const std::optional<std::vector<int>>& gpus);
  // Why CUDA IPC buffers cannot be registered without it (FailedPrecondition naming the fix).
  static Status Unavailable();
  virtual ~GpuSupport() = default;

  // `restore_staging_bytes`: the CUDA engine's staging ring per GPU (0: none; see docs/gpu.md).
  virtual Status Start(uint32_t max_inflight, uint64_t restore_staging_bytes, MetricsRegistry* metrics) = 0;
  virtual core::CopyEngine* engine() = 0;
  // Imports `bytes` at `cuda.offset` of the CUDA IPC allocation on the GPU `cuda.pci_bus_id` names.
  virtual Result<core::BufferId> RegisterCudaIpc(const channel::CudaIpcBuffer& cuda, uint64_t bytes) = 0;
  virtual Status Unregister(core::BufferId id) = 0;
  virtual void Shutdown() = 0;
  virtual void CloseEngine() = 0;
  // The GPUs served, for `orbitkv status`: "0 (0000:00:06.0, NUMA node 0), 1 (...)".
  virtual std::string Describe() const = 0;
};

}  // namespace orbitkv::server

#endif  // ORBITKV_SERVER_GPU_SUPPORT_H_
