#include "gpu/cuda_util.h"

#include <cuda.h>
#include <fmt/format.h>

#include <utility>

namespace orbitkv::gpu {

Status CudaStatus(cudaError_t error, std::string_view what) {
  if (error == cudaSuccess) return Status::Ok();
  const std::string message = fmt::format("{}: {} ({})", what, cudaGetErrorName(error), cudaGetErrorString(error));
  switch (error) {
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInitializationError:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
    case cudaErrorDevicesUnavailable:
      return Status::Unavailable(message);
    default:
      return Status::Internal(message);
  }
}

Result<int> UsableDeviceCount() {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error == cudaSuccess) return count;
  Status status = CudaStatus(error, "cudaGetDeviceCount");
  cudaGetLastError();  // not sticky: clear it so that later calls do not report it again
  if (status.code() == StatusCode::kUnavailable) return 0;
  return status;
}

Result<int> DeviceByPciBusId(std::string_view pci_bus_id) {
  if (pci_bus_id.empty() || pci_bus_id.size() >= 64) {
    return Status::InvalidArgument(fmt::format("'{}' is not a PCI bus id (like 0000:00:06.0)", pci_bus_id));
  }
  const std::string text(pci_bus_id);
  int device = -1;
  const cudaError_t error = cudaDeviceGetByPCIBusId(&device, text.c_str());
  if (error == cudaSuccess) return device;
  cudaGetLastError();
  if (error == cudaErrorInvalidDevice || error == cudaErrorInvalidValue) {
    return Status::NotFound(
        fmt::format("no GPU visible to this process has PCI bus id {} ({}); is CUDA_VISIBLE_DEVICES hiding it?", text,
                    cudaGetErrorName(error)));
  }
  return CudaStatus(error, fmt::format("cudaDeviceGetByPCIBusId({})", text));
}

Result<std::string> PciBusIdOf(int device) {
  char text[64] = {};
  ORBITKV_RETURN_IF_ERROR(
      CudaStatus(cudaDeviceGetPCIBusId(text, sizeof(text), device), fmt::format("cudaDeviceGetPCIBusId({})", device)));
  return std::string(text);
}

ScopedDevice::ScopedDevice(int device) {
  if (cudaError_t error = cudaGetDevice(&previous_); error != cudaSuccess) {
    previous_ = -1;
    status_ = CudaStatus(error, "cudaGetDevice");
    return;
  }
  if (previous_ != device) status_ = CudaStatus(cudaSetDevice(device), "cudaSetDevice");
}

ScopedDevice::~ScopedDevice() {
  int current = -1;
  if (previous_ >= 0 && cudaGetDevice(&current) == cudaSuccess && current != previous_) {
    cudaSetDevice(previous_);
  }
}

// --- DeviceMemory ---

Result<DeviceMemory> DeviceMemory::Allocate(int device, uint64_t bytes) {
  if (bytes == 0) return Status::InvalidArgument("device allocation of zero bytes");
  ScopedDevice scope(device);
  ORBITKV_RETURN_IF_ERROR(scope.status());
  void* data = nullptr;
  ORBITKV_RETURN_IF_ERROR(CudaStatus(cudaMalloc(&data, bytes), fmt::format("cudaMalloc({} bytes)", bytes)));
  DeviceMemory memory;
  memory.device_ = device;
  memory.data_ = static_cast<uint8_t*>(data);
  memory.size_ = bytes;
  return memory;
}

DeviceMemory::DeviceMemory(DeviceMemory&& other) noexcept
    : device_(other.device_), data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

DeviceMemory& DeviceMemory::operator=(DeviceMemory&& other) noexcept {
  if (this != &other) {
    Release();
    device_ = other.device_;
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

DeviceMemory::~DeviceMemory() { Release(); }

void DeviceMemory::Release() {
  if (data_ == nullptr) return;
  ScopedDevice scope(device_);
  cudaFree(data_);
  data_ = nullptr;
  size_ = 0;
}

// --- PinnedHostMemory ---

Result<PinnedHostMemory> PinnedHostMemory::Allocate(int device, uint64_t bytes) {
  if (bytes == 0) return Status::InvalidArgument("pinned host allocation of zero bytes");
  ScopedDevice scope(device);
  ORBITKV_RETURN_IF_ERROR(scope.status());
  void* data = nullptr;
  ORBITKV_RETURN_IF_ERROR(CudaStatus(cudaHostAlloc(&data, bytes, cudaHostAllocPortable | cudaHostAllocMapped),
                                     fmt::format("cudaHostAlloc({} bytes)", bytes)));
  PinnedHostMemory memory;
  memory.device_ = device;
  memory.data_ = static_cast<uint8_t*>(data);
  memory.size_ = bytes;
  void* device_data = nullptr;
  ORBITKV_RETURN_IF_ERROR(CudaStatus(cudaHostGetDevicePointer(&device_data, data, 0), "cudaHostGetDevicePointer"));
  memory.device_data_ = static_cast<uint8_t*>(device_data);
  return memory;
}

PinnedHostMemory::PinnedHostMemory(PinnedHostMemory&& other) noexcept
    : device_(other.device_),
      data_(std::exchange(other.data_, nullptr)),
      device_data_(std::exchange(other.device_data_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}

PinnedHostMemory& PinnedHostMemory::operator=(PinnedHostMemory&& other) noexcept {
  if (this != &other) {
    Release();
    device_ = other.device_;
    data_ = std::exchange(other.data_, nullptr);
    device_data_ = std::exchange(other.device_data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

PinnedHostMemory::~PinnedHostMemory() { Release(); }

void PinnedHostMemory::Release() {
  if (data_ == nullptr) return;
  ScopedDevice scope(device_);
  cudaFreeHost(data_);
  data_ = nullptr;
  device_data_ = nullptr;
  size_ = 0;
}

// --- CudaStream ---

Result<CudaStream> CudaStream::Create(int device) {
  ScopedDevice scope(device);
  ORBITKV_RETURN_IF_ERROR(scope.status());
  cudaStream_t stream = nullptr;
  ORBITKV_RETURN_IF_ERROR(
      CudaStatus(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags"));
  CudaStream owned;
  owned.device_ = device;
  owned.stream_ = stream;
  return owned;
}

CudaStream::CudaStream(CudaStream&& other) noexcept
    : device_(other.device_), stream_(std::exchange(other.stream_, nullptr)) {}

CudaStream& CudaStream::operator=(CudaStream&& other) noexcept {
  if (this != &other) {
    Release();
    device_ = other.device_;
    stream_ = std::exchange(other.stream_, nullptr);
  }
  return *this;
}

CudaStream::~CudaStream() { Release(); }

void CudaStream::Release() {
  if (stream_ == nullptr) return;
  ScopedDevice scope(device_);
  cudaStreamDestroy(stream_);
  stream_ = nullptr;
}

// --- CudaEvent ---

Result<CudaEvent> CudaEvent::Create(int device, bool blocking_sync, bool timing) {
  ScopedDevice scope(device);
  ORBITKV_RETURN_IF_ERROR(scope.status());
  cudaEvent_t event = nullptr;
  const unsigned flags = (timing ? 0u : cudaEventDisableTiming) | (blocking_sync ? cudaEventBlockingSync : 0u);
  ORBITKV_RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&event, flags), "cudaEventCreateWithFlags"));
  CudaEvent owned;
  owned.device_ = device;
  owned.event_ = event;
  return owned;
}

CudaEvent::CudaEvent(CudaEvent&& other) noexcept
    : device_(other.device_), event_(std::exchange(other.event_, nullptr)) {}

CudaEvent& CudaEvent::operator=(CudaEvent&& other) noexcept {
  if (this != &other) {
    Release();
    device_ = other.device_;
    event_ = std::exchange(other.event_, nullptr);
  }
  return *this;
}

CudaEvent::~CudaEvent() { Release(); }

void CudaEvent::Release() {
  if (event_ == nullptr) return;
  ScopedDevice scope(device_);
  cudaEventDestroy(event_);
  event_ = nullptr;
}

// --- DeviceAllocationRange ---

Result<AllocationRange> DeviceAllocationRange(const void* address) {
  using GetAddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  void* entry = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  ORBITKV_RETURN_IF_ERROR(
      CudaStatus(cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &entry, 12000, cudaEnableDefault, &found),
                 "cudaGetDriverEntryPointByVersion(cuMemGetAddressRange)"));
  if (found != cudaDriverEntryPointSuccess || entry == nullptr) {
    return Status::Unavailable("the CUDA driver has no cuMemGetAddressRange");
  }
  CUdeviceptr base = 0;
  size_t bytes = 0;
  const CUresult result =
      reinterpret_cast<GetAddressRangeFn>(entry)(&base, &bytes, reinterpret_cast<CUdeviceptr>(address));
  if (result != CUDA_SUCCESS) {
    return Status::InvalidArgument(
        fmt::format("address {} is not inside a device allocation of the current device (CUresult {})", address,
                    static_cast<int>(result)));
  }
  return AllocationRange{static_cast<uint64_t>(base), static_cast<uint64_t>(bytes)};
}

}  // namespace orbitkv::gpu
