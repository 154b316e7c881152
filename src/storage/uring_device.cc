#include "storage/uring_device.h"

#include <fmt/format.h>
#include <liburing.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <deque>
#include <utility>

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
  int fd() const { return ring_.ring_fd; }
  // The version of the device's registered memory this ring holds as fixed buffers (0: none).
  uint64_t registered_version = 0;
  // The set registered as this ring's fixed buffers (null: none).
  std::shared_ptr<const UringBufferSet> fixed;

 private:
  UringRing() = default;
  io_uring ring_{};
  bool initialized_ = false;
};

// Registered memory: the chunks (sorted by address; chunk i is fixed buffer i) and a ring kept only
// to hold their registration, which the rings that run requests clone. Immutable once built.
class UringBufferSet {
 public:
  std::vector<UringDevice::Chunk> chunks;
  std::unique_ptr<UringRing> source;
};

namespace {

// Registrations by every device of this process: the devices of one store register the same pool,
// and pinning it once serves them all. Weak: a set lives as long as a device or ring uses it.
Mutex g_sets_mu;
std::vector<std::weak_ptr<const UringBufferSet>> g_sets GUARDED_BY(g_sets_mu);
// Relaxed: a statistic.
std::atomic<uint64_t> g_memory_registrations{0};

Status CompletionStatus(const IoRequest& request, int res) {
  const bool write = request.op == IoRequest::Op::kWrite;
  if (res < 0) return ErrnoStatus(write ? "io_uring write" : "io_uring read", -res);
  if (static_cast<size_t>(res) != request.buffer.size()) {
    return Status::DataLoss(fmt::format("short {} at offset {}: {} of {} bytes", write ? "write" : "read",
                                        request.offset, res, request.buffer.size()));
  }
  return Status::Ok();
}

// IORING_REGISTER_CLONE_BUFFERS (Linux 6.12; liburing 2.8 wraps it, Debian 12 ships 2.3): gives a
// ring the fixed buffers of another ring by reference, without pinning the pages again. All zero
// after src_fd clones every buffer.
constexpr unsigned kRegisterCloneBuffers = 30;
struct CloneBuffersArg {
  uint32_t src_fd = 0;
  uint32_t flags = 0;
  uint32_t src_off = 0;
  uint32_t dst_off = 0;
  uint32_t nr = 0;
  uint32_t pad[3] = {};
};

int CloneBuffers(UringRing& destination, const UringRing& source) {
  CloneBuffersArg arg;
  arg.src_fd = static_cast<uint32_t>(source.fd());
  const long rc = syscall(__NR_io_uring_register, destination.fd(), kRegisterCloneBuffers, &arg, 1);
  return rc < 0 ? -errno : 0;
}

bool SameChunks(const std::vector<UringDevice::Chunk>& a, const std::vector<UringDevice::Chunk>& b) {
  return std::equal(
      a.begin(), a.end(), b.begin(), b.end(),
      [](const UringDevice::Chunk& x, const UringDevice::Chunk& y) { return x.begin == y.begin && x.end == y.end; });
}

// The fixed-buffer index of the registered chunk holding [data, data + bytes), or -1.
int FixedIndex(const std::vector<UringDevice::Chunk>& chunks, const uint8_t* data, size_t bytes) {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data);
  auto it = std::upper_bound(chunks.begin(), chunks.end(), begin,
                             [](uintptr_t address, const UringDevice::Chunk& chunk) { return address < chunk.begin; });
  if (it == chunks.begin()) return -1;
  --it;
  if (begin < it->begin || begin + bytes > it->end) return -1;
  return static_cast<int>(it - chunks.begin());
}

// Fills `sqe` with `request` on `fd`, from fixed buffer `fixed` when it is not -1.
void PrepareSqe(io_uring_sqe* sqe, int fd, const IoRequest& request, int fixed) {
  const auto bytes = static_cast<unsigned>(request.buffer.size());
  if (request.op == IoRequest::Op::kWrite) {
    if (fixed >= 0) {
      io_uring_prep_write_fixed(sqe, fd, request.buffer.data(), bytes, request.offset, fixed);
    } else {
      io_uring_prep_write(sqe, fd, request.buffer.data(), bytes, request.offset);
    }
  } else if (fixed >= 0) {
    io_uring_prep_read_fixed(sqe, fd, request.buffer.data(), bytes, request.offset, fixed);
  } else {
    io_uring_prep_read(sqe, fd, request.buffer.data(), bytes, request.offset);
  }
}

std::vector<iovec> ChunkIovecs(const std::vector<UringDevice::Chunk>& chunks) {
  std::vector<iovec> iovecs;
  iovecs.reserve(chunks.size());
  for (const UringDevice::Chunk& chunk : chunks) {
    iovecs.push_back(iovec{reinterpret_cast<void*>(chunk.begin), chunk.end - chunk.begin});
  }
  return iovecs;
}

}  // namespace

Result<std::unique_ptr<UringDevice>> UringDevice::Create(const std::string& path, uint64_t bytes,
                                                         uint32_t queue_depth) {
  if (queue_depth == 0 || queue_depth > kMaxQueueDepth) {
    return Status::InvalidArgument(
        fmt::format("io_uring queue depth {} is not in [1, {}]", queue_depth, kMaxQueueDepth));
  }
  ORBITKV_ASSIGN_OR_RETURN(DeviceFile file, OpenDeviceFile(path, bytes));
  auto device = std::unique_ptr<UringDevice>(new UringDevice(std::move(file.fd), bytes, file.direct_io, queue_depth));
  // Probe: one read through a real ring proves io_uring works here (seccomp filters often allow
  // setup only).
  ORBITKV_ASSIGN_OR_RETURN(AlignedBuffer probe, AlignedBuffer::Create(kDeviceIoAlignment, kDeviceIoAlignment));
  ORBITKV_RETURN_IF_ERROR(device->Read(0, probe.span()).WithContext("io_uring probe read"));
  return device;
}

UringDevice::UringDevice(ScopedFd fd, uint64_t size, bool direct_io, uint32_t queue_depth)
    : Device(size, kDeviceIoAlignment), fd_(std::move(fd)), direct_io_(direct_io), queue_depth_(queue_depth) {}

UringDevice::~UringDevice() = default;

Result<std::unique_ptr<UringRing>> UringDevice::AcquireRing() {
  std::unique_ptr<UringRing> ring;
  std::shared_ptr<const UringBufferSet> set;
  uint64_t version = 0;
  {
    MutexLock lock(&mu_);
    if (!idle_rings_.empty()) {
      ring = std::move(idle_rings_.back());
      idle_rings_.pop_back();
    }
    set = buffers_;
    version = buffers_version_;
  }
  if (ring == nullptr) {
    ORBITKV_ASSIGN_OR_RETURN(ring, UringRing::Create(queue_depth_));
  }
  if (ring->registered_version != version) {
    if (ring->fixed != nullptr) {
      io_uring_unregister_buffers(ring->get());
      ring->fixed = nullptr;
    }
    AttachBuffers(ring.get(), set);
    ring->registered_version = version;
  }
  return ring;
}

void UringDevice::AttachBuffers(UringRing* ring, const std::shared_ptr<const UringBufferSet>& set) {
  if (set == nullptr) return;
  // Cloning from the source ring costs microseconds; registering pins every page again (about 50 ms
  // per GiB), which would stall the first request of every new ring.
  int rc = -EINVAL;
  if (clone_supported_.load(std::memory_order_relaxed)) {
    rc = CloneBuffers(*ring, *set->source);
    if (rc == -EINVAL || rc == -EOPNOTSUPP) {
      clone_supported_.store(false, std::memory_order_relaxed);
      ORBITKV_LOG_INFO(
          "io_uring: this kernel cannot clone fixed buffers between rings; each ring registers "
          "them itself");
    }
  }
  if (rc != 0) {
    const std::vector<iovec> iovecs = ChunkIovecs(set->chunks);
    rc = io_uring_register_buffers(ring->get(), iovecs.data(), static_cast<unsigned>(iovecs.size()));
  }
  if (rc == 0) {
    ring->fixed = set;
  } else {
    LogRegistrationRefused(set->chunks.size(), rc);
  }
}

// One ring over several devices' files, kept by one thread with up to depth groups in flight. A
// request's completion names its group's slot and its index in the group.
class UringIoQueue final : public IoQueue {
 public:
  UringIoQueue(std::vector<Device*> devices, std::vector<UringDevice*> rings, uint32_t depth,
               uint32_t max_group_requests, std::unique_ptr<UringRing> ring)
      : IoQueue(std::move(devices), depth, max_group_requests),
        rings_(std::move(rings)),
        ring_(std::move(ring)),
        groups_(depth) {}
  ~UringIoQueue() override {
    while (in_flight() > 0) (void)Wait();
  }

 private:
  struct Group {
    bool busy = false;
    uint64_t tag = 0;
    uint32_t remaining = 0;
    Status status;
    std::vector<IoRequest> requests;
  };

  void DoStart(size_t device, std::span<const IoRequest> requests, uint64_t tag) override;
  Completion DoWait() override;
  // Accounts one completed request; a group whose last request completed is done.
  void Reap(const io_uring_cqe& cqe);
  // Waits for at least one completion and reaps every one available.
  void ReapSome();

  const std::vector<UringDevice*> rings_;
  const std::unique_ptr<UringRing> ring_;
  std::vector<Group> groups_;  // one slot per group in flight
  std::deque<Completion> done_;
};

void UringIoQueue::DoStart(size_t device, std::span<const IoRequest> requests, uint64_t tag) {
  const auto slot = static_cast<size_t>(
      std::find_if(groups_.begin(), groups_.end(), [](const Group& g) { return !g.busy; }) - groups_.begin());
  ORBITKV_CHECK_MSG(slot < groups_.size(), "no free group slot with {} in flight", in_flight());
  Group& group = groups_[slot];
  group.busy = true;
  group.tag = tag;
  group.remaining = static_cast<uint32_t>(requests.size());
  group.status = Status::Ok();
  group.requests.assign(requests.begin(), requests.end());
  io_uring* r = ring_->get();
  const std::vector<UringDevice::Chunk>* chunks = ring_->fixed != nullptr ? &ring_->fixed->chunks : nullptr;
  UringDevice& target = *rings_[device];
  for (size_t i = 0; i < requests.size(); ++i) {
    // The ring holds depth * max_group_requests entries and every earlier one was submitted.
    io_uring_sqe* sqe = io_uring_get_sqe(r);
    ORBITKV_CHECK_MSG(sqe != nullptr, "io_uring submission queue full");
    const IoRequest& request = requests[i];
    const int fixed = chunks != nullptr ? FixedIndex(*chunks, request.buffer.data(), request.buffer.size()) : -1;
    if (fixed >= 0) target.registered_requests_.fetch_add(1, std::memory_order_relaxed);
    PrepareSqe(sqe, target.fd_.get(), request, fixed);
    io_uring_sqe_set_data64(sqe, slot << 16 | i);
  }
  for (;;) {
    const int rc = io_uring_submit(r);
    // The kernel may take fewer entries than were prepared (short of memory): submit the rest, as
    // nothing else would, and a Wait() would then wait for requests never started.
    if (rc >= 0 && io_uring_sq_ready(r) == 0) break;
    if (rc >= 0 || rc == -EINTR) continue;
    // Short of memory or of room for completions: reap some (this group's own count too, when the
    // kernel took part of it), or wait a moment when nothing is in flight at all.
    if (rc == -EAGAIN || rc == -EBUSY) {
      if (in_flight() > 0 || io_uring_sq_ready(r) < requests.size()) {
        ReapSome();
      } else {
        usleep(100);
      }
      continue;
    }
    // The kernel may already own some of the buffers; returning would let the caller reuse them.
    ORBITKV_CHECK_MSG(false, "io_uring_enter failed with {} groups in flight: {}", in_flight(),
                      ErrnoStatus("io_uring_enter", -rc).ToString());
  }
}

void UringIoQueue::Reap(const io_uring_cqe& cqe) {
  const uint64_t data = io_uring_cqe_get_data64(&cqe);
  const size_t slot = data >> 16;
  const size_t index = data & 0xffff;
  ORBITKV_CHECK_MSG(slot < groups_.size() && groups_[slot].busy && index < groups_[slot].requests.size(),
                    "completion for unknown request {:#x}", data);
  Group& group = groups_[slot];
  Status status = CompletionStatus(group.requests[index], cqe.res);
  if (!status.ok() && group.status.ok()) group.status = std::move(status);
  if (--group.remaining == 0) {
    done_.push_back(Completion{.tag = group.tag, .status = std::move(group.status)});
    group.busy = false;
  }
}

void UringIoQueue::ReapSome() {
  io_uring* r = ring_->get();
  io_uring_cqe* cqe = nullptr;
  int rc;
  do {
    rc = io_uring_wait_cqe(r, &cqe);
  } while (rc == -EINTR);
  ORBITKV_CHECK_MSG(rc == 0, "io_uring wait: {}", ErrnoStatus("io_uring_enter", -rc).ToString());
  do {
    Reap(*cqe);
    io_uring_cqe_seen(r, cqe);
  } while (io_uring_peek_cqe(r, &cqe) == 0 && cqe != nullptr);
}

IoQueue::Completion UringIoQueue::DoWait() {
  while (done_.empty()) ReapSome();
  Completion completion = std::move(done_.front());
  done_.pop_front();
  return completion;
}

Result<std::unique_ptr<IoQueue>> UringDevice::CreateQueue(std::vector<Device*> devices, std::vector<UringDevice*> rings,
                                                          uint32_t depth, uint32_t max_group_requests) {
  if (static_cast<uint64_t>(depth) * max_group_requests > kMaxQueueDepth || depth > 0xffff ||
      max_group_requests > 0xffff) {
    return Status::InvalidArgument(fmt::format("{} groups of {} requests exceed io_uring's queue depth of {}", depth,
                                               max_group_requests, kMaxQueueDepth));
  }
  ORBITKV_ASSIGN_OR_RETURN(std::unique_ptr<UringRing> ring, UringRing::Create(depth * max_group_requests));
  // The files of one store share one registration (the same pool): the first one's serves all.
  std::shared_ptr<const UringBufferSet> set;
  {
    MutexLock lock(&rings.front()->mu_);
    set = rings.front()->buffers_;
  }
  rings.front()->AttachBuffers(ring.get(), set);
  return std::unique_ptr<IoQueue>(
      new UringIoQueue(std::move(devices), std::move(rings), depth, max_group_requests, std::move(ring)));
}

uint64_t UringDevice::memory_registrations() { return g_memory_registrations.load(std::memory_order_relaxed); }

void UringDevice::LogRegistrationRefused(size_t buffers, int rc) {
  MutexLock lock(&mu_);
  if (registration_refused_) return;
  registration_refused_ = true;
  ORBITKV_LOG_WARN("io_uring: registering {} buffer(s) failed ({}); requests run unregistered", buffers,
                   ErrnoStatus("io_uring_register_buffers", -rc).ToString());
}

Status UringDevice::RegisterMemory(std::span<const std::span<uint8_t>> regions) {
  constexpr uintptr_t kMaxChunk = uintptr_t{1} << 30;
  std::vector<Chunk> chunks;
  for (std::span<uint8_t> region : regions) {
    uintptr_t begin = reinterpret_cast<uintptr_t>(region.data());
    const uintptr_t end = begin + region.size();
    while (begin < end) {
      const uintptr_t chunk_end = std::min(end, begin + kMaxChunk);
      chunks.push_back(Chunk{begin, chunk_end});
      begin = chunk_end;
    }
  }
  std::sort(chunks.begin(), chunks.end(), [](const Chunk& a, const Chunk& b) { return a.begin < b.begin; });
  if (chunks.size() > 16384) {
    return Status::InvalidArgument(fmt::format("{} fixed buffers exceed io_uring's 16384", chunks.size()));
  }
  std::shared_ptr<const UringBufferSet> set;
  if (!chunks.empty()) {
    ORBITKV_ASSIGN_OR_RETURN(set, RegisterBufferSet(std::move(chunks)));
  }
  std::shared_ptr<const UringBufferSet> replaced;
  {
    MutexLock lock(&mu_);
    replaced = std::exchange(buffers_, std::move(set));
    ++buffers_version_;
  }
  return Status::Ok();  // the set `replaced` held is unpinned here (if unused), outside the lock
}

Result<std::shared_ptr<const UringBufferSet>> UringDevice::RegisterBufferSet(std::vector<Chunk> chunks) {
  // Held while registering, so devices registering the same memory at once pin it once.
  MutexLock lock(&g_sets_mu);
  std::erase_if(g_sets, [](const auto& weak) { return weak.expired(); });
  for (const auto& weak : g_sets) {
    std::shared_ptr<const UringBufferSet> live = weak.lock();
    if (live != nullptr && SameChunks(live->chunks, chunks)) return live;
  }
  // The pages are pinned here, once, on a ring kept for that; the rings that run requests clone
  // its buffers. A refusal (RLIMIT_MEMLOCK, a sandbox) leaves requests unregistered.
  ORBITKV_ASSIGN_OR_RETURN(std::unique_ptr<UringRing> ring, UringRing::Create(1));
  const std::vector<iovec> iovecs = ChunkIovecs(chunks);
  const int rc = io_uring_register_buffers(ring->get(), iovecs.data(), static_cast<unsigned>(iovecs.size()));
  if (rc != 0) {
    LogRegistrationRefused(chunks.size(), rc);
    return std::shared_ptr<const UringBufferSet>();
  }
  g_memory_registrations.fetch_add(1, std::memory_order_relaxed);
  auto set = std::make_shared<UringBufferSet>();
  set->chunks = std::move(chunks);
  set->source = std::move(ring);
  g_sets.push_back(set);
  return std::shared_ptr<const UringBufferSet>(std::move(set));
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
  // The set this ring registered: a registration that replaced it meanwhile reaches this ring on
  // its next acquire.
  const std::vector<Chunk>* chunks = ring->fixed != nullptr ? &ring->fixed->chunks : nullptr;
  size_t next = 0;         // Next entry of `valid` to prepare.
  size_t outstanding = 0;  // Prepared and not yet completed (queued in the SQ ring or in the kernel).
  while (next < valid.size() || outstanding > 0) {
    while (next < valid.size() && outstanding < queue_depth_) {
      io_uring_sqe* sqe = io_uring_get_sqe(r);
      if (sqe == nullptr) break;  // SQ ring full of entries the kernel has not consumed yet.
      const size_t index = valid[next];
      const IoRequest& request = requests[index];
      const int fixed = chunks != nullptr ? FixedIndex(*chunks, request.buffer.data(), request.buffer.size()) : -1;
      if (fixed >= 0) registered_requests_.fetch_add(1, std::memory_order_relaxed);
      PrepareSqe(sqe, fd_.get(), request, fixed);
      io_uring_sqe_set_data64(sqe, index);
      ++next;
      ++outstanding;
    }
    // Hands every prepared entry to the kernel and waits for at least one completion.
    const int rc = io_uring_submit_and_wait(r, 1);
    if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
      // The kernel may still own some of the caller's buffers; returning would let the caller free
      // them.
      ORBITKV_CHECK_MSG(false, "io_uring_enter failed with {} outstanding requests: {}", outstanding,
                        ErrnoStatus("io_uring_enter", -rc).ToString());
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
