// GpuSupport in a build without the gpu module: no GPU, and the reason names the build option.
#include "server/gpu_support.h"

namespace orbitkv::server {

std::unique_ptr<GpuSupport> GpuSupport::Detect(core::BlockCacheOptions* /*options*/) {
  return nullptr;
}

Status GpuSupport::Unavailable() {
  return Status::FailedPrecondition(
      "this Manager was built without CUDA (orbitkv::gpu), so it cannot import CUDA IPC buffers; "
      "use a build configured with -DORBITKV_WITH_CUDA=ON, or register host memory instead");
}

}  // namespace orbitkv::server
