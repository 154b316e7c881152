#include "storage/device.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cerrno>
#include <deque>
#include <filesystem>

#include "base/logging.h"
#include "storage/device_file.h"
#include "storage/psync_device.h"
#ifdef ORBITKV_HAVE_IO_URING
#include "storage/uring_device.h"
#endif

namespace orbitkv::storage {

std::vector<Status> Device::Submit(std::span<const IoRequest> requests) {
  std::vector<Status> statuses(requests.size());
  std::vector<size_t> valid;
  valid.reserve(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    statuses[i] = Validate(requests[i]);
    if (statuses[i].ok()) valid.push_back(i);
  }
  if (!valid.empty()) DoSubmit(requests, valid, statuses);
  return statuses;
}

Status Device::Read(uint64_t offset, std::span<uint8_t> out) {
  const IoRequest request{.op = IoRequest::Op::kRead, .offset = offset, .buffer = out};
  return std::move(Submit({&request, 1})[0]);
}

Status Device::Write(uint64_t offset, std::span<const uint8_t> data) {
  // A write request only reads its buffer (IoRequest's contract), so shedding const here is sound.
  const IoRequest request{
      .op = IoRequest::Op::kWrite, .offset = offset, .buffer = {const_cast<uint8_t*>(data.data()), data.size()}};
  return std::move(Submit({&request, 1})[0]);
}

Status IoQueue::Start(size_t device, std::span<const IoRequest> requests, uint64_t tag) {
  if (device >= devices_.size()) {
    return Status::InvalidArgument(fmt::format("no device {} in this queue", device));
  }
  if (requests.empty() || requests.size() > max_group_requests_) {
    return Status::InvalidArgument(
        fmt::format("a group of {} requests (1 to {})", requests.size(), max_group_requests_));
  }
  for (const IoRequest& request : requests) {
    ORBITKV_RETURN_IF_ERROR(devices_[device]->Validate(request));
  }
  if (in_flight_ >= depth_) {
    return Status::FailedPrecondition(fmt::format("{} groups are in flight already", in_flight_));
  }
  DoStart(device, requests, tag);
  ++in_flight_;
  return Status::Ok();
}

Result<IoQueue::Completion> IoQueue::Wait() {
  if (in_flight_ == 0) return Status::FailedPrecondition("no group is in flight");
  Completion completion = DoWait();
  --in_flight_;
  return completion;
}

namespace {

// Runs each group in Start() through Device::Submit (the psync backend, or devices of mixed
// backends) and hands the outcomes back in order.
class SyncIoQueue final : public IoQueue {
 public:
  SyncIoQueue(std::vector<Device*> devices, uint32_t depth, uint32_t max_group_requests)
      : IoQueue(std::move(devices), depth, max_group_requests) {}

 private:
  void DoStart(size_t device, std::span<const IoRequest> requests, uint64_t tag) override {
    Completion completion{.tag = tag, .status = Status::Ok()};
    for (Status& status : devices_[device]->Submit(requests)) {
      if (!status.ok() && completion.status.ok()) completion.status = std::move(status);
    }
    done_.push_back(std::move(completion));
  }
  Completion DoWait() override {
    Completion completion = std::move(done_.front());
    done_.pop_front();
    return completion;
  }

  std::deque<Completion> done_;
};

}  // namespace

Result<std::unique_ptr<IoQueue>> CreateIoQueue(std::vector<Device*> devices, uint32_t depth,
                                               uint32_t max_group_requests) {
  if (devices.empty() || depth == 0 || max_group_requests == 0) {
    return Status::InvalidArgument("an I/O queue needs a device, a depth and a group size");
  }
#ifdef ORBITKV_HAVE_IO_URING
  std::vector<UringDevice*> rings;
  for (Device* device : devices) {
    if (auto* uring = dynamic_cast<UringDevice*>(device)) rings.push_back(uring);
  }
  if (rings.size() == devices.size()) {
    return UringDevice::CreateQueue(std::move(devices), std::move(rings), depth, max_group_requests);
  }
#endif
  return std::unique_ptr<IoQueue>(new SyncIoQueue(std::move(devices), depth, max_group_requests));
}

Status Device::Validate(const IoRequest& request) const {
  const uint64_t length = request.buffer.size();
  const auto address = reinterpret_cast<uintptr_t>(request.buffer.data());
  if (length == 0 || length % io_alignment_ != 0 || request.offset % io_alignment_ != 0 ||
      address % io_alignment_ != 0) {
    return Status::InvalidArgument(fmt::format("I/O of {} bytes at offset {} (buffer {:#x}) is not {}-byte aligned",
                                               length, request.offset, address, io_alignment_));
  }
  if (request.offset > size_ || length > size_ - request.offset) {
    return Status::OutOfRange(
        fmt::format("I/O of {} bytes at offset {} exceeds the device's {} bytes", length, request.offset, size_));
  }
  return Status::Ok();
}

std::string_view DeviceBackendName(DeviceBackend backend) {
  switch (backend) {
    case DeviceBackend::kAuto:
      return "auto";
    case DeviceBackend::kIoUring:
      return "io_uring";
    case DeviceBackend::kPsync:
      return "psync";
  }
  return "unknown";
}

std::optional<DeviceBackend> ParseDeviceBackend(std::string_view text) {
  for (DeviceBackend b : {DeviceBackend::kAuto, DeviceBackend::kIoUring, DeviceBackend::kPsync}) {
    if (text == DeviceBackendName(b)) return b;
  }
  return std::nullopt;
}

bool IoUringCompiledIn() {
#ifdef ORBITKV_HAVE_IO_URING
  return true;
#else
  return false;
#endif
}

Result<DeviceFile> OpenDeviceFile(const std::string& path, uint64_t bytes) {
  if (bytes == 0 || bytes % kDeviceIoAlignment != 0) {
    return Status::InvalidArgument(
        fmt::format("device size {} is not a non-zero multiple of {}", bytes, kDeviceIoAlignment));
  }
  constexpr int kFlags = O_RDWR | O_CREAT | O_CLOEXEC;
  DeviceFile file;
  file.fd.Reset(::open(path.c_str(), kFlags | O_DIRECT, 0600));
  file.direct_io = file.fd.valid();
  if (!file.fd.valid()) {
    if (errno != EINVAL) return ErrnoStatus("open " + path, errno);
    ORBITKV_LOG_WARN("{}: the file system refuses O_DIRECT; using buffered I/O (page cache)", path);
    file.fd.Reset(::open(path.c_str(), kFlags, 0600));
    if (!file.fd.valid()) return ErrnoStatus("open " + path, errno);
  }
  if (::fallocate(file.fd.get(), 0, 0, static_cast<off_t>(bytes)) != 0) {
    const int err = errno;
    if (err != EOPNOTSUPP) return ErrnoStatus(fmt::format("fallocate {} bytes for {}", bytes, path), err);
    ORBITKV_LOG_WARN("{}: fallocate is unsupported; sizing the file with ftruncate (space is not reserved)", path);
    struct stat st {};
    if (::fstat(file.fd.get(), &st) != 0) return ErrnoStatus("fstat " + path, errno);
    if (static_cast<uint64_t>(st.st_size) < bytes && ::ftruncate(file.fd.get(), static_cast<off_t>(bytes)) != 0) {
      return ErrnoStatus("ftruncate " + path, errno);
    }
  }
  return file;
}

std::string BlockDeviceDriver(const std::string& path) {
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) return "";
  std::error_code error;
  std::filesystem::path device =
      std::filesystem::canonical(fmt::format("/sys/dev/block/{}:{}", major(st.st_dev), minor(st.st_dev)), error);
  if (error) return "";
  if (std::filesystem::exists(device / "partition", error)) device = device.parent_path();
  const std::filesystem::path driver = std::filesystem::read_symlink(device / "device" / "driver", error);
  return error ? "" : driver.filename().string();
}

Result<std::unique_ptr<Device>> CreateDevice(const std::string& path, uint64_t bytes, DeviceBackend backend) {
  if (backend != DeviceBackend::kPsync) {
#ifdef ORBITKV_HAVE_IO_URING
    auto uring = UringDevice::Create(path, bytes, UringDevice::kDefaultQueueDepth);
    if (uring.ok()) return std::unique_ptr<Device>(std::move(uring).value());
    if (backend == DeviceBackend::kIoUring) return uring.status();
    ORBITKV_LOG_WARN("{}: io_uring is unavailable ({}); using the psync backend", path, uring.status().ToString());
#else
    if (backend == DeviceBackend::kIoUring) {
      return Status::Unimplemented("this build has no io_uring backend (liburing was not found at configure time)");
    }
    ORBITKV_LOG_INFO("{}: this build has no io_uring backend; using psync", path);
#endif
  }
  ORBITKV_ASSIGN_OR_RETURN(auto psync, PsyncDevice::Create(path, bytes));
  return std::unique_ptr<Device>(std::move(psync));
}

}  // namespace orbitkv::storage
