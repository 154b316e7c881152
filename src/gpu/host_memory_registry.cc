#include "gpu/host_memory_registry.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <limits>

#include "base/check.h"
#include "gpu/cuda_util.h"

namespace orbitkv::gpu {

HostMemoryRegistry::~HostMemoryRegistry() {
  MutexLock lock(&mu_);
  ScopedDevice scope(device_);
  for (const Range& range : ranges_) cudaHostUnregister(range.host);
  ranges_.clear();
}

Status HostMemoryRegistry::Register(uint8_t* base, uint64_t bytes, int numa_node) {
  if (base == nullptr) return Status::InvalidArgument("host range base is null");
  if (bytes == 0) return Status::InvalidArgument("host range has zero bytes");
  if (reinterpret_cast<uintptr_t>(base) > std::numeric_limits<uintptr_t>::max() - bytes) {
    return Status::InvalidArgument("host range wraps the address space");
  }
  MutexLock lock(&mu_);
  for (const Range& range : ranges_) {
    if (base < range.host + range.bytes && range.host < base + bytes) {
      return Status::InvalidArgument(fmt::format("host range [{}, +{}) overlaps the registered range [{}, +{})",
                                                 static_cast<const void*>(base), bytes,
                                                 static_cast<const void*>(range.host), range.bytes));
    }
  }
  ScopedDevice scope(device_);
  ORBITKV_RETURN_IF_ERROR(scope.status());
  ORBITKV_RETURN_IF_ERROR(CudaStatus(cudaHostRegister(base, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable),
                                     fmt::format("cudaHostRegister of {} bytes (NUMA node {})", bytes, numa_node)));
  void* device = nullptr;
  if (Status status = CudaStatus(cudaHostGetDevicePointer(&device, base, 0), "cudaHostGetDevicePointer");
      !status.ok()) {
    cudaHostUnregister(base);
    return status;
  }
  ranges_.push_back(Range{base, static_cast<uint8_t*>(device), bytes});
  return Status::Ok();
}

void HostMemoryRegistry::Unregister(uint8_t* base) {
  MutexLock lock(&mu_);
  auto it = std::find_if(ranges_.begin(), ranges_.end(), [base](const Range& range) { return range.host == base; });
  ORBITKV_CHECK_MSG(it != ranges_.end(), "Unregister of host range {} that is not registered",
                    static_cast<const void*>(base));
  ScopedDevice scope(device_);
  cudaHostUnregister(base);
  ranges_.erase(it);
}

uint8_t* HostMemoryRegistry::Translate(const uint8_t* host, uint64_t length) const {
  MutexLock lock(&mu_);
  return TranslateIn(ranges_, host, length);
}

std::vector<HostMemoryRegistry::Range> HostMemoryRegistry::Snapshot() const {
  MutexLock lock(&mu_);
  return ranges_;
}

uint8_t* HostMemoryRegistry::TranslateIn(const std::vector<Range>& ranges, const uint8_t* host, uint64_t length) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(host);
  for (const Range& range : ranges) {
    const uintptr_t start = reinterpret_cast<uintptr_t>(range.host);
    if (address < start) continue;
    const uint64_t offset = address - start;
    // Two comparisons instead of offset + length, which could overflow.
    if (offset < range.bytes && length <= range.bytes - offset) return range.device + offset;
  }
  return nullptr;
}

}  // namespace orbitkv::gpu
