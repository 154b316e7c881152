// PsyncDevice: a Device over one file with pread(2)/pwrite(2), run on the calling thread.
//
// The fallback when io_uring is refused (seccomp, old kernel) and the simplest correct backend. A
// batch runs its requests one after another; concurrent callers run in parallel (pread/pwrite need
// no lock).
//
// Thread safety: as Device.
#ifndef ORBITKV_STORAGE_PSYNC_DEVICE_H_
#define ORBITKV_STORAGE_PSYNC_DEVICE_H_

#include <memory>
#include <string>

#include "base/scoped_fd.h"
#include "storage/device.h"

namespace orbitkv::storage {

class PsyncDevice final : public Device {
 public:
  // Opens and preallocates the file (see OpenDeviceFile): O_DIRECT where the file system allows it.
  static Result<std::unique_ptr<PsyncDevice>> Create(const std::string& path, uint64_t bytes);

  std::string_view backend_name() const override { return "psync"; }
  bool direct_io() const override { return direct_io_; }

 private:
  PsyncDevice(ScopedFd fd, uint64_t size, bool direct_io);
  void DoSubmit(std::span<const IoRequest> requests, std::span<const size_t> valid,
                std::span<Status> statuses) override;
  Status RunOne(const IoRequest& request) const;

  // Immutable after construction.
  const ScopedFd fd_;
  const bool direct_io_;
};

}  // namespace orbitkv::storage

#endif  // ORBITKV_STORAGE_PSYNC_DEVICE_H_
