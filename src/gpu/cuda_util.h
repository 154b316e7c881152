// Small pieces every file of the GPU module uses: CUDA errors as Status, a guard that makes a
// device current for one scope, and move-only owners of CUDA resources (device memory, pinned host
// memory, streams, events).
//
// Every owner remembers the device it was created on and makes that device current again to release
// the resource, so it may be destroyed on any thread. A default-constructed owner holds nothing.
//
// Thread safety: the functions are safe from any thread. An owner is not synchronized: one thread
// uses it at a time.
#ifndef ORBITKV_GPU_CUDA_UTIL_H_
#define ORBITKV_GPU_CUDA_UTIL_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "base/result.h"
#include "base/status.h"

namespace orbitkv::gpu {

// OK for cudaSuccess; otherwise a Status whose message names `what` and CUDA's error name and text.
// Unavailable when there is no usable device or driver (cudaErrorNoDevice,
// cudaErrorInsufficientDriver, a missing driver library) so that callers can tell "no GPU here"
// from a failing GPU, Internal otherwise.
Status CudaStatus(cudaError_t error, std::string_view what);

// How many CUDA devices this process can use: 0 (not an error) when there is no device or no
// driver (CudaStatus would say Unavailable); another CUDA error as its Status.
Result<int> UsableDeviceCount();

// This process's ordinal of the device at PCI bus id `pci_bus_id` ("0000:00:06.0" or
// "00000000:00:06.0", as cudaDeviceGetPCIBusId and nvidia-smi write it). The ordinal can differ
// from the one another process uses for the same GPU (CUDA_VISIBLE_DEVICES), the bus id cannot.
// InvalidArgument for empty or over-long text; NotFound when no device visible here has that id.
Result<int> DeviceByPciBusId(std::string_view pci_bus_id);

// The PCI bus id of `device` ("0000:00:06.0").
Result<std::string> PciBusIdOf(int device);

// Makes `device` current for the scope and restores the previous device after it. Check status()
// before using the device.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device);
  ~ScopedDevice();
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

  const Status& status() const { return status_; }

 private:
  int previous_ = -1;
  Status status_;
};

// cudaMalloc'd device memory.
class DeviceMemory {
 public:
  DeviceMemory() = default;
  static Result<DeviceMemory> Allocate(int device, uint64_t bytes);
  DeviceMemory(DeviceMemory&& other) noexcept;
  DeviceMemory& operator=(DeviceMemory&& other) noexcept;
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  ~DeviceMemory();

  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  void Release();

  int device_ = -1;
  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

// cudaHostAlloc'd pinned host memory, portable (every device may copy from it) and mapped (kernels
// read and write it in place at device_data()).
class PinnedHostMemory {
 public:
  PinnedHostMemory() = default;
  static Result<PinnedHostMemory> Allocate(int device, uint64_t bytes);
  PinnedHostMemory(PinnedHostMemory&& other) noexcept;
  PinnedHostMemory& operator=(PinnedHostMemory&& other) noexcept;
  PinnedHostMemory(const PinnedHostMemory&) = delete;
  PinnedHostMemory& operator=(const PinnedHostMemory&) = delete;
  ~PinnedHostMemory();

  uint8_t* data() const { return data_; }
  uint8_t* device_data() const { return device_data_; }
  uint64_t size() const { return size_; }

 private:
  void Release();

  int device_ = -1;
  uint8_t* data_ = nullptr;
  uint8_t* device_data_ = nullptr;
  uint64_t size_ = 0;
};

// A non-blocking stream (it does not synchronize with the legacy default stream).
class CudaStream {
 public:
  CudaStream() = default;
  static Result<CudaStream> Create(int device);
  CudaStream(CudaStream&& other) noexcept;
  CudaStream& operator=(CudaStream&& other) noexcept;
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  ~CudaStream();

  cudaStream_t get() const { return stream_; }

 private:
  void Release();

  int device_ = -1;
  cudaStream_t stream_ = nullptr;
};

// An event without timing; with `blocking_sync`, cudaEventSynchronize sleeps instead of spinning.
class CudaEvent {
 public:
  CudaEvent() = default;
  // `timing`: the event keeps a timestamp (cudaEventElapsedTime); off for the copy path's events.
  static Result<CudaEvent> Create(int device, bool blocking_sync, bool timing = false);
  CudaEvent(CudaEvent&& other) noexcept;
  CudaEvent& operator=(CudaEvent&& other) noexcept;
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  ~CudaEvent();

  cudaEvent_t get() const { return event_; }

 private:
  void Release();

  int device_ = -1;
  cudaEvent_t event_ = nullptr;
};

// The base and size of the device allocation that contains `address` (cuMemGetAddressRange, reached
// through the runtime's driver entry point so the module links no driver library). `device` must be
// current. InvalidArgument when `address` is not inside a device allocation of the current context.
struct AllocationRange {
  uint64_t base = 0;
  uint64_t bytes = 0;
};
Result<AllocationRange> DeviceAllocationRange(const void* address);

}  // namespace orbitkv::gpu

#endif  // ORBITKV_GPU_CUDA_UTIL_H_
