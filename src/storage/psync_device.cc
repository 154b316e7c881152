#include "storage/psync_device.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>

#include "storage/device_file.h"

namespace orbitkv::storage {

Result<std::unique_ptr<PsyncDevice>> PsyncDevice::Create(const std::string& path, uint64_t bytes) {
  ORBITKV_ASSIGN_OR_RETURN(DeviceFile file, OpenDeviceFile(path, bytes));
  return std::unique_ptr<PsyncDevice>(new PsyncDevice(std::move(file.fd), bytes, file.direct_io));
}

PsyncDevice::PsyncDevice(ScopedFd fd, uint64_t size, bool direct_io)
    : Device(size, kDeviceIoAlignment), fd_(std::move(fd)), direct_io_(direct_io) {}

void PsyncDevice::DoSubmit(std::span<const IoRequest> requests, std::span<const size_t> valid,
                           std::span<Status> statuses) {
  for (size_t index : valid) statuses[index] = RunOne(requests[index]);
}

Status PsyncDevice::RunOne(const IoRequest& request) const {
  const bool write = request.op == IoRequest::Op::kWrite;
  size_t done = 0;
  while (done < request.buffer.size()) {
    uint8_t* at = request.buffer.data() + done;
    const size_t left = request.buffer.size() - done;
    const off_t offset = static_cast<off_t>(request.offset + done);
    const ssize_t n = write ? ::pwrite(fd_.get(), at, left, offset) : ::pread(fd_.get(), at, left, offset);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(write ? "pwrite" : "pread", errno);
    }
    if (n == 0) {
      return Status::DataLoss(fmt::format("short {} at offset {}: {} of {} bytes", write ? "write" : "read",
                                          request.offset, done, request.buffer.size()));
    }
    // A partial transfer continues from where it stopped; with O_DIRECT the remainder stays aligned
    // because the kernel transfers whole blocks.
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

}  // namespace orbitkv::storage
