// GpuSupport in a build without the gpu module: no GPU, and the reason names the build option.
#include "server/gpu_support.h"

namespace orbitkv::server {

Result<std::unique_ptr<GpuSupport>> GpuSupport::Detect(core::BlockCacheOptions* /*options*/,
                                                       const std::optional<std::vector<int>>& gpus) {
  if (gpus.has_value() && !gpus->empty()) {
    return Status::FailedPrecondition(
        "--gpus names GPUs but this Manager was built without CUDA (orbitkv::gpu); use a build "
        "configured with -DORBITKV_WITH_CUDA=ON, or --gpus none");
  }
  return std::unique_ptr<GpuSupport>();
}

Status GpuSupport::Unavailable() {
  return Status::FailedPrecondition(
      "this Manager was built without CUDA (orbitkv::gpu), so it cannot import CUDA IPC buffers; "
      "use a build configured with -DORBITKV_WITH_CUDA=ON, or register host memory instead");
}

}  // namespace orbitkv::server
