#include "storage/uring_device.h"

#include <fmt/format.h>
#include <liburing.h>

#include <algorithm>
#include <cerrno>

#include "base/check.h"
#include "base/logging.h"
#include "storage/aligned_buffer.h"
#include "storage/device_file.h"

namespace orbitkv::storage {

// Move-free RAII owner of one io_uring instance.
class UringRing {
 public:
  static Result<std::unique_ptr<UringRing>> Create(uint32_t entries) {
    auto ring = std::unique_ptr<UringRing>(new UringRing());
    const int rc = io_uring_queue_init(entries, &ring->ring_, 0);
    if (rc < 0) return ErrnoStatus("io_uring_queue_init", -rc);
    ring->initialized_ = true;
    return ring;
  }
  UringRing(const UringRing&) = delete;
  UringRing& operator=(const UringRing&) = delete;
  ~UringRing() {
    if (initialized_) io_uring_queue_exit(&ring_);
  }
  io_uring* get() { return &ring_; }
  // The version of the device's registered memory this ring holds as fixed buffers (0: none).
  uint64_t registered_version = 0;
  bool has_fixed_buffers = false;

 private:
  UringRing() = default;
  io_uring ring_{};
  bool initialized_ = false;
};

namespace {

Status CompletionStatus(const IoRequest& request, int res) {
  const bool write = request.op == IoRequest::Op::kWrite;
  if (res < 0) return ErrnoStatus(write ? "io_uring write" : "io_uring read", -res);
  if (static_cast<size_t>(res) != request.buffer.size()) {
    return Status::DataLoss(fmt::format("short {} at offset {}: {} of {} bytes",
                                        write ? "write" : "read", request.offset, res,
                                        request.buffer.size()));
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<UringDevice>> UringDevice::Create(const std::string& path, uint64_t bytes,
                                                         uint32_t queue_depth) {
  if (queue_depth == 0 || queue_depth > kMaxQueueDepth) {
    return Status::InvalidArgument(
        fmt::format("io_uring queue depth {} is not in [1, {}]", queue_depth, kMaxQueueDepth));
  }
  ORBITKV_ASSIGN_OR_RETURN(DeviceFile file, OpenDeviceFile(path, bytes));
  auto device = std::unique_ptr<UringDevice>(
      new UringDevice(std::move(file.fd), bytes, file.direct_io, queue_depth));
  // Probe: one read through a real ring proves io_uring works here (seccomp filters often allow
  // setup only).
  ORBITKV_ASSIGN_OR_RETURN(AlignedBuffer probe,
                           AlignedBuffer::Create(kDeviceIoAlignment, kDeviceIoAlignment));
  ORBITKV_RETURN_IF_ERROR(device->Read(0, probe.span()).WithContext("io_uring probe read"));
  return device;
}

UringDevice::UringDevice(ScopedFd fd, uint64_t size, bool direct_io, uint32_t queue_depth)
    : Device(size, kDeviceIoAlignment),
      fd_(std::move(fd)),
      direct_io_(direct_io),
      queue_depth_(queue_depth) {}

UringDevice::~UringDevice() = default;

Result<std::unique_ptr<UringRing>> UringDevice::AcquireRing() {
  std::unique_ptr<UringRing> ring;
  std::shared_ptr<const std::vector<Chunk>> chunks;
  uint64_t version = 0;
  {
    MutexLock lock(&mu_);
    if (!idle_rings_.empty()) {
      ring = std::move(idle_rings_.back());
      idle_rings_.pop_back();
    }
    chunks = chunks_;
    version = chunks_version_;
  }
  if (ring == nullptr) {
    ORBITKV_ASSIGN_OR_RETURN(ring, UringRing::Create(queue_depth_));
  }
  if (ring->registered_version != version) {
    if (ring->has_fixed_buffers) {
      io_uring_unregister_buffers(ring->get());
      ring->has_fixed_buffers = false;
    }
    if (chunks != nullptr && !chunks->empty()) {
      std::vector<iovec> iovecs;
      for (const Chunk& chunk : *chunks) {
        iovecs.push_back(iovec{reinterpret_cast<void*>(chunk.begin), chunk.end - chunk.begin});
      }
      const int rc = io_uring_register_buffers(ring->get(), iovecs.data(),
                                               static_cast<unsigned>(iovecs.size()));
      if (rc == 0) {
        ring->has_fixed_buffers = true;
      } else {
        MutexLock lock(&mu_);
        if (!registration_refused_) {
          registration_refused_ = true;
          ORBITKV_LOG_WARN(
              "io_uring: registering {} buffer(s) failed ({}); requests run "
              "unregistered",
              iovecs.size(), ErrnoStatus("io_uring_register_buffers", -rc).ToString());
        }
      }
    }
    ring->registered_version = version;
  }
  return ring;
}

Status UringDevice::RegisterMemory(std::span<const std::span<uint8_t>> regions) {
  constexpr uintptr_t kMaxChunk = uintptr_t{1} << 30;
  auto chunks = std::make_shared<std::vector<Chunk>>();
  for (std::span<uint8_t> region : regions) {
    uintptr_t begin = reinterpret_cast<uintptr_t>(region.data());
    const uintptr_t end = begin + region.size();
    while (begin < end) {
      const uintptr_t chunk_end = std::min(end, begin + kMaxChunk);
      chunks->push_back(Chunk{begin, chunk_end});
      begin = chunk_end;
    }
  }
  std::sort(chunks->begin(), chunks->end(),
            [](const Chunk& a, const Chunk& b) { return a.begin < b.begin; });
  if (chunks->size() > 16384) {
    return Status::InvalidArgument(
        fmt::format("{} fixed buffers exceed io_uring's 16384", chunks->size()));
  }
  MutexLock lock(&mu_);
  chunks_ = std::move(chunks);
  ++chunks_version_;
  return Status::Ok();
}

int UringDevice::FixedIndex(const std::vector<Chunk>& chunks, const uint8_t* data,
                            size_t bytes) const {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data);
  auto it =
      std::upper_bound(chunks.begin(), chunks.end(), begin,
                       [](uintptr_t address, const Chunk& chunk) { return address < chunk.begin; });
  if (it == chunks.begin()) return -1;
  --it;
  if (begin < it->begin || begin + bytes > it->end) return -1;
  return static_cast<int>(it - chunks.begin());
}

void UringDevice::ReleaseRing(std::unique_ptr<UringRing> ring) {
  {
    MutexLock lock(&mu_);
    if (idle_rings_.size() < kMaxIdleRings) {
      idle_rings_.push_back(std::move(ring));
      return;
    }
  }
  // Destroyed outside the lock: io_uring_queue_exit unmaps the rings.
}

void UringDevice::DoSubmit(std::span<const IoRequest> requests, std::span<const size_t> valid,
                           std::span<Status> statuses) {
  auto acquired = AcquireRing();
  if (!acquired.ok()) {
    for (size_t index : valid) statuses[index] = acquired.status();
    return;
  }
  std::unique_ptr<UringRing> ring = std::move(acquired).value();
  io_uring* r = ring->get();
  std::shared_ptr<const std::vector<Chunk>> chunks;
  if (ring->has_fixed_buffers) {
    MutexLock lock(&mu_);
    chunks =
        chunks_;  // the set this ring registered (a newer one re-registers on the next acquire)
  }
  size_t next = 0;  // Next entry of `valid` to prepare.
  size_t outstanding =
      0;  // Prepared and not yet completed (queued in the SQ ring or in the kernel).
  while (next < valid.size() || outstanding > 0) {
    while (next < valid.size() && outstanding < queue_depth_) {
      io_uring_sqe* sqe = io_uring_get_sqe(r);
      if (sqe == nullptr) break;  // SQ ring full of entries the kernel has not consumed yet.
      const size_t index = valid[next];
      const IoRequest& request = requests[index];
      const int fixed = chunks != nullptr
                            ? FixedIndex(*chunks, request.buffer.data(), request.buffer.size())
                            : -1;
      if (fixed >= 0) registered_requests_.fetch_add(1, std::memory_order_relaxed);
      if (request.op == IoRequest::Op::kWrite) {
        if (fixed >= 0) {
          io_uring_prep_write_fixed(sqe, fd_.get(), request.buffer.data(),
                                    static_cast<unsigned>(request.buffer.size()), request.offset,
                                    fixed);
        } else {
          io_uring_prep_write(sqe, fd_.get(), request.buffer.data(),
                              static_cast<unsigned>(request.buffer.size()), request.offset);
        }
      } else if (fixed >= 0) {
        io_uring_prep_read_fixed(sqe, fd_.get(), request.buffer.data(),
                                 static_cast<unsigned>(request.buffer.size()), request.offset,
                                 fixed);
      } else {
        io_uring_prep_read(sqe, fd_.get(), request.buffer.data(),
                           static_cast<unsigned>(request.buffer.size()), request.offset);
      }
      io_uring_sqe_set_data64(sqe, index);
      ++next;
      ++outstanding;
    }
    // Hands every prepared entry to the kernel and waits for at least one completion.
    const int rc = io_uring_submit_and_wait(r, 1);
    if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
      // The kernel may still own some of the caller's buffers; returning would let the caller free
      // them.
      ORBITKV_CHECK_MSG(false, "io_uring_enter failed with {} outstanding requests: {}",
                        outstanding, ErrnoStatus("io_uring_enter", -rc).ToString());
    }
    io_uring_cqe* cqe = nullptr;
    while (outstanding > 0 && io_uring_peek_cqe(r, &cqe) == 0 && cqe != nullptr) {
      const size_t index = static_cast<size_t>(io_uring_cqe_get_data64(cqe));
      ORBITKV_CHECK_MSG(index < requests.size(), "completion for unknown request {}", index);
      statuses[index] = CompletionStatus(requests[index], cqe->res);
      io_uring_cqe_seen(r, cqe);
      --outstanding;
    }
  }
  ReleaseRing(std::move(ring));
}

}  // namespace orbitkv::storage
