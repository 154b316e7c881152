// Internal: opens and preallocates the file behind a Device.
#ifndef ORBITKV_STORAGE_DEVICE_FILE_H_
#define ORBITKV_STORAGE_DEVICE_FILE_H_

#include <cstdint>
#include <string>

#include "base/result.h"
#include "base/scoped_fd.h"

namespace orbitkv::storage {

inline constexpr uint32_t kDeviceIoAlignment = 4096;

struct DeviceFile {
  ScopedFd fd;
  bool direct_io = false;
};

// Opens `path` read-write (creating it with mode 0600), with O_DIRECT when the file system accepts
// it (a log line otherwise), and preallocates `bytes` bytes with fallocate (ftruncate, with a log
// line, where fallocate is unsupported). An existing file keeps its contents. InvalidArgument
// unless `bytes` is a non-zero multiple of kDeviceIoAlignment.
Result<DeviceFile> OpenDeviceFile(const std::string& path, uint64_t bytes);

}  // namespace orbitkv::storage

#endif  // ORBITKV_STORAGE_DEVICE_FILE_H_
