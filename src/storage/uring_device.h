// UringDevice: a Device over one O_DIRECT file driven by io_uring.
//
// Submit() prepares up to queue_depth requests at a time on a ring, submits them in one
// io_uring_enter, and keeps the ring full as completions arrive; it returns only after every
// request it handed to the kernel has completed and its completion was consumed, so the caller's
// buffers are never touched after Submit() returns. A completion shorter than its request is a
// DataLoss for that request (O_DIRECT transfers are whole blocks, so a short one means the file is
// shorter than the device or the disk misbehaved).
//
// Rings are single-issuer objects, so each concurrent Submit() takes its own ring from a small pool
// (created on demand, at most kMaxIdleRings kept); the pool's lock is held only to take or return a
// ring, never across I/O.
//
// Thread safety: as Device.
#ifndef ORBITKV_STORAGE_URING_DEVICE_H_
#define ORBITKV_STORAGE_URING_DEVICE_H_

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "base/mutex.h"
#include "base/scoped_fd.h"
#include "base/thread_annotations.h"
#include "storage/device.h"

namespace orbitkv::storage {

class UringRing;
class UringBufferSet;

class UringDevice final : public Device {
  friend class UringIoQueue;

 public:
  // A registered memory range: one fixed buffer.
  struct Chunk {
    uintptr_t begin = 0;
    uintptr_t end = 0;
  };

  static constexpr uint32_t kDefaultQueueDepth = 64;
  static constexpr uint32_t kMaxQueueDepth = 4096;
  static constexpr size_t kMaxIdleRings = 8;

  // Opens and preallocates the file (see OpenDeviceFile), sets up a ring and completes a probe read
  // through it, so a kernel or sandbox that refuses io_uring fails here rather than on the first
  // block. InvalidArgument for a queue depth of 0 or above kMaxQueueDepth; the io_uring_queue_init
  // error otherwise.
  static Result<std::unique_ptr<UringDevice>> Create(const std::string& path, uint64_t bytes, uint32_t queue_depth);
  ~UringDevice() override;

  std::string_view backend_name() const override { return "io_uring"; }
  bool direct_io() const override { return direct_io_; }
  uint32_t queue_depth() const { return queue_depth_; }

  // Fixed buffers: the regions are split into chunks of at most 1 GiB (io_uring's limit per
  // buffer) and registered here, on a ring kept for that (pinning the pages takes about 50 ms per
  // GiB); devices of this process that register the same regions share that registration. Every
  // ring that runs requests clones its buffers when it is created or next used (microseconds; on a
  // kernel before 6.12, which cannot clone, each ring registers them itself).
  Status RegisterMemory(std::span<const std::span<uint8_t>> regions) override;
  // An IoQueue over `devices` (all io_uring: `rings` are the same devices), for CreateIoQueue().
  static Result<std::unique_ptr<IoQueue>> CreateQueue(std::vector<Device*> devices, std::vector<UringDevice*> rings,
                                                      uint32_t depth, uint32_t max_group_requests);

  uint64_t registered_requests() const override { return registered_requests_.load(std::memory_order_relaxed); }
  // Registrations that pinned memory, over every device of this process (tests: a registration
  // shared between devices counts once).
  static uint64_t memory_registrations();

 private:
  UringDevice(ScopedFd fd, uint64_t size, bool direct_io, uint32_t queue_depth);
  // The registration of `chunks` (sorted), shared with any live one of the same chunks; null when
  // the kernel refused it (logged).
  Result<std::shared_ptr<const UringBufferSet>> RegisterBufferSet(std::vector<Chunk> chunks);
  // Gives `ring` the buffers of `set` (null: none): cloned, or registered where cloning is refused.
  void AttachBuffers(UringRing* ring, const std::shared_ptr<const UringBufferSet>& set);
  // Logs the first refused registration (RLIMIT_MEMLOCK, a sandbox); requests then run unregistered.
  void LogRegistrationRefused(size_t buffers, int rc);
  void DoSubmit(std::span<const IoRequest> requests, std::span<const size_t> valid,
                std::span<Status> statuses) override;
  Result<std::unique_ptr<UringRing>> AcquireRing();
  void ReleaseRing(std::unique_ptr<UringRing> ring);

  // Immutable after construction.
  const ScopedFd fd_;
  const bool direct_io_;
  const uint32_t queue_depth_;

  Mutex mu_;
  std::vector<std::unique_ptr<UringRing>> idle_rings_ GUARDED_BY(mu_);
  // The registered memory (null: none) and its version; a ring holding an older version takes the
  // current one when acquired.
  std::shared_ptr<const UringBufferSet> buffers_ GUARDED_BY(mu_);
  uint64_t buffers_version_ GUARDED_BY(mu_) = 0;
  // Relaxed: once false (the kernel refused a clone), rings register the buffers themselves.
  std::atomic<bool> clone_supported_{true};
  bool registration_refused_ GUARDED_BY(mu_) = false;
  // Relaxed: a statistic.
  std::atomic<uint64_t> registered_requests_{0};
};

}  // namespace orbitkv::storage

#endif  // ORBITKV_STORAGE_URING_DEVICE_H_
