// FaultInjectingDevice (test-only): a storage::Device decorator that fails reads on demand, which a real
// disk cannot do: after `after` more successful read requests, the next `count` reads fail with `status` (EIO's
// DataLoss by default); writes pass through. Installed through SsdStoreOptions::wrap_device, it makes a source's
// SSD read fail in the middle of preparing a peer's span.
//
// Thread safety: every method may be called from any thread (the schedule is atomic).
#ifndef ORBITKV_STORAGE_TESTING_FAULT_INJECTING_DEVICE_H_
#define ORBITKV_STORAGE_TESTING_FAULT_INJECTING_DEVICE_H_

#include <atomic>
#include <memory>

#include "base/mutex.h"
#include "storage/device.h"

namespace orbitkv::storage::testing {

class FaultInjectingDevice final : public Device {
 public:
  explicit FaultInjectingDevice(std::unique_ptr<Device> inner);

  // The next `count` read requests after `after` more successful ones fail with `status`.
  void FailReads(uint64_t after, uint64_t count, Status status = Status::DataLoss("injected read error (EIO)"))
      EXCLUDES(mu_);
  uint64_t failed_reads() const { return failed_.load(std::memory_order_relaxed); }

  std::string_view backend_name() const override { return inner_->backend_name(); }
  bool direct_io() const override { return inner_->direct_io(); }
  Status RegisterMemory(std::span<const std::span<uint8_t>> regions) override {
    return inner_->RegisterMemory(regions);
  }

 protected:
  void DoSubmit(std::span<const IoRequest> requests, std::span<const size_t> valid, std::span<Status> statuses) override
      EXCLUDES(mu_);

 private:
  const std::unique_ptr<Device> inner_;
  mutable Mutex mu_;
  uint64_t pass_ GUARDED_BY(mu_) = 0;  // reads still to pass before failing
  uint64_t fail_ GUARDED_BY(mu_) = 0;  // reads to fail after them
  Status status_ GUARDED_BY(mu_);
  std::atomic<uint64_t> failed_{0};
};

}  // namespace orbitkv::storage::testing

#endif  // ORBITKV_STORAGE_TESTING_FAULT_INJECTING_DEVICE_H_
