// HostMemoryRegistry: page-locks host memory for the GPUs (cudaHostRegister, mapped and portable)
// and translates host addresses inside it into the device addresses that kernels use.
//
// It is the pool's ArenaRegistrar (core/pinned_arena.h): pass it in PoolOptions::registrar and
// every arena of the pool becomes readable and writable by every device's kernels in place, so a
// restore or save moves each byte across the link once, with no staging copy. The CUDA copy engine
// resolves the pool side of every fragment through Translate(); a fragment whose pool range is not
// inside one registered range is rejected.
//
// Invariant: ranges never overlap; each was registered with cudaHostRegisterMapped |
// cudaHostRegisterPortable and is unregistered exactly once (Unregister, or the destructor for
// ranges still registered).
//
// Lifetime: the registry must outlive the pool registered through it and every copy engine that
// translates through it; a range must not be unregistered while copies into it are in flight (the
// pool unregisters its arenas only in its destructor, after the engines were shut down).
//
// Thread safety: every method may be called from any thread.
#ifndef ORBITKV_GPU_HOST_MEMORY_REGISTRY_H_
#define ORBITKV_GPU_HOST_MEMORY_REGISTRY_H_

#include <cstdint>
#include <vector>

#include "base/mutex.h"
#include "base/status.h"
#include "base/thread_annotations.h"
#include "core/pinned_arena.h"

namespace orbitkv::gpu {

class HostMemoryRegistry final : public core::ArenaRegistrar {
 public:
  // One registered range: [host, host + bytes) is seen by kernels at [device, device + bytes).
  struct Range {
    uint8_t* host = nullptr;
    uint8_t* device = nullptr;
    uint64_t bytes = 0;
  };

  // `device` is the device current while registering (with UVA, which every 64-bit Linux
  // configuration has, the mapped address is the same on every device).
  explicit HostMemoryRegistry(int device = 0) : device_(device) {}
  HostMemoryRegistry(const HostMemoryRegistry&) = delete;
  HostMemoryRegistry& operator=(const HostMemoryRegistry&) = delete;
  // Unregisters every range still registered.
  ~HostMemoryRegistry() override;

  // ArenaRegistrar. Register page-locks [base, base + bytes): InvalidArgument for a null base, zero
  // bytes, a range that wraps or overlaps a registered one; the CUDA error (Unavailable without a
  // device or driver) when cudaHostRegister or cudaHostGetDevicePointer fails. `numa_node` is only
  // recorded in error messages (placement is the arena's business). Unregister of a base that is
  // not registered is a CHECK failure.
  Status Register(uint8_t* base, uint64_t bytes, int numa_node) override;
  void Unregister(uint8_t* base) override;

  // The device address of [host, host + length), or null when that range is not inside one
  // registered range.
  uint8_t* Translate(const uint8_t* host, uint64_t length) const EXCLUDES(mu_);

  // A copy of the registered ranges, for a caller translating many addresses without taking the
  // lock each time (see TranslateIn).
  std::vector<Range> Snapshot() const EXCLUDES(mu_);
  static uint8_t* TranslateIn(const std::vector<Range>& ranges, const uint8_t* host, uint64_t length);

 private:
  const int device_;
  mutable Mutex mu_;
  std::vector<Range> ranges_ GUARDED_BY(mu_);
};

}  // namespace orbitkv::gpu

#endif  // ORBITKV_GPU_HOST_MEMORY_REGISTRY_H_
