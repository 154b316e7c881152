#include "core/cpu_copy_engine.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <utility>

#include "base/check.h"
#include "base/fault_guard.h"

namespace orbitkv::core {

namespace {

// Whether `pidfd`'s process has not been reaped: while it has not, its pid cannot name another
// process.
bool StillThere(int pidfd) { return syscall(SYS_pidfd_send_signal, pidfd, 0, nullptr, 0) == 0; }

Status ProcessError(pid_t pid, int err, bool save, const uint8_t* at) {
  if (err == ESRCH || err == EIO || err == 0) {
    return Status::Unavailable(fmt::format("engine process {} is gone", pid));
  }
  if (err == EPERM || err == EACCES) {
    return Status::PermissionDenied(
        fmt::format("may not access the memory of engine process {} (another uid, or ptrace restricted)", pid));
  }
  return Status::InvalidArgument(fmt::format("{} of engine process {} at {} failed: {}", save ? "reading" : "writing",
                                             pid, static_cast<const void*>(at), std::strerror(err)));
}

// Moves `bytes` between this process's `pool` and address `remote` of the engine `process`,
// looping over partial transfers. Reads use process_vm_readv (one copy) and then check that the
// process is still the one registered: if it was not reaped by then, the pid named it throughout,
// so the bytes are its. Writes go through its /proc/PID/mem, bound to its memory: they can never
// land in a process that reused the pid.
template <typename Process>
Status CopyProcessMemory(const Process& process, uint8_t* remote, uint8_t* pool, uint64_t bytes, bool save) {
  uint64_t done = 0;
  while (done < bytes) {
    ssize_t n;
    if (save) {
      iovec local{pool + done, bytes - done};
      iovec far{remote + done, bytes - done};
      n = process_vm_readv(process.pid, &local, 1, &far, 1, 0);
    } else {
      n = pwrite(process.mem.get(), pool + done, bytes - done,
                 static_cast<off_t>(reinterpret_cast<uintptr_t>(remote + done)));
    }
    if (n <= 0) {
      const int err = n < 0 ? errno : 0;
      if (err == EINTR) continue;
      return ProcessError(process.pid, err, save, remote + done);
    }
    done += static_cast<uint64_t>(n);
  }
  if (save && !StillThere(process.pidfd.get())) return ProcessError(process.pid, ESRCH, save, remote);
  return Status::Ok();
}

// The engine whose worker runs on this thread, if any: UnregisterBuffer() and Shutdown() CHECK
// against being called from their own engine's CopyDone, which would wait for itself.
thread_local const CpuCopyEngine* t_worker_of = nullptr;

// Bounds the fragments in one claim, and so the time a worker holds queue_mu_ to take it, when a
// batch has many tiny fragments.
constexpr uint32_t kMaxFragmentsPerClaim = 1024;

constexpr int DirectionIndex(CopyDirection direction) { return static_cast<int>(direction); }

MetricsRegistry& PickRegistry(MetricsRegistry* given, const std::unique_ptr<MetricsRegistry>& owned) {
  return given != nullptr ? *given : *owned;
}

Counter& BytesCounter(MetricsRegistry& registry, CopyDirection direction) {
  return registry.GetCounter(
      "orbitkv_copy_bytes_total", "Bytes copied by completed copy batches.",
      {{"engine", "cpu"}, {"direction", std::string(CopyDirectionName(direction))}, {"device", "host"}});
}

Counter& BatchesCounter(MetricsRegistry& registry, CopyDirection direction) {
  return registry.GetCounter(
      "orbitkv_copy_batches_total", "Copy batches completed.",
      {{"engine", "cpu"}, {"direction", std::string(CopyDirectionName(direction))}, {"device", "host"}});
}

// The checks that need no registry, with InvalidArgument naming the first bad fragment; on OK,
// `*total_bytes` is the sum of the fragment lengths.
Status CheckShape(const CopyBatch& batch, const CopyDone& done, uint64_t* total_bytes) {
  if (!done) return Status::InvalidArgument("copy batch has no done callback");
  if (batch.direction != CopyDirection::kSave && batch.direction != CopyDirection::kRestore) {
    return Status::InvalidArgument(
        fmt::format("copy direction {} is not save or restore", static_cast<int>(batch.direction)));
  }
  if (batch.fragments.empty()) return Status::InvalidArgument("copy batch has no fragments");
  if (batch.fragments.size() > std::numeric_limits<uint32_t>::max()) {
    return Status::InvalidArgument(fmt::format("copy batch has {} fragments", batch.fragments.size()));
  }
  uint64_t total = 0;
  for (size_t i = 0; i < batch.fragments.size(); ++i) {
    const CopyFragment& f = batch.fragments[i];
    if (f.pool == nullptr) {
      return Status::InvalidArgument(fmt::format("fragment {}: null pool address", i));
    }
    if (f.length == 0) return Status::InvalidArgument(fmt::format("fragment {}: zero length", i));
    if (reinterpret_cast<uintptr_t>(f.pool) > std::numeric_limits<uintptr_t>::max() - f.length) {
      return Status::InvalidArgument(fmt::format("fragment {}: pool range wraps the address space", i));
    }
    if (f.length > std::numeric_limits<uint64_t>::max() - total) {
      return Status::InvalidArgument("copy batch length overflows 64 bits");
    }
    total += f.length;
  }
  *total_bytes = total;
  return Status::Ok();
}

// A save's bytes land in pool blocks that are next read by a restore or an SSD write, long after:
// streamed past the caches (base/stream_copy.h), which nearly doubles the copy of 16 KiB fragments.
// A restore's bytes are the engine's to read next; a batch larger than the caches could keep
// streams too, a smaller one stays cached for the engine.
constexpr uint64_t kCachedRestoreMaxBytes = uint64_t{8} << 20;

CopyStores StoresFor(CopyDirection direction, uint64_t total_bytes) {
  if (direction == CopyDirection::kSave) return CopyStores::kStreaming;
  return total_bytes > kCachedRestoreMaxBytes ? CopyStores::kStreaming : CopyStores::kCached;
}

}  // namespace

// An accepted batch. Created by Submit(), deleted by Finish() on the worker that drained it.
struct CpuCopyEngine::Batch {
  Batch(CopyBatch b, CopyDone d, uint64_t total)
      : copy(std::move(b)), done(std::move(d)), total_bytes(total), remaining_bytes(total) {}

  // Immutable once queued (published to workers by queue_mu_).
  CopyBatch copy;
  CopyDone done;
  uint64_t total_bytes;
  // Engine-buffer address of each fragment's first byte, resolved under registry_mu_ at Submit,
  // and the process it lives in (0: mapped here).
  std::vector<uint8_t*> engine_addr;
  std::vector<pid_t> engine_pid;
  std::vector<std::shared_ptr<const Process>> engine_process;  // with engine_pid

  // The first failed process-memory transfer; read by the worker that finishes the batch.
  Mutex error_mu;
  Status error GUARDED_BY(error_mu);

  // Bytes not yet copied. Each worker subtracts what it copied with acq_rel: the release publishes
  // its copies, and the worker that reaches zero acquires every other worker's copies before it
  // calls `done`.
  std::atomic<uint64_t> remaining_bytes;

  // Guarded by CpuCopyEngine::queue_mu_: the claim cursor and the FIFO link.
  uint32_t next_fragment = 0;
  uint64_t next_offset = 0;
  Batch* next = nullptr;
};

Result<std::unique_ptr<CpuCopyEngine>> CpuCopyEngine::Create(Options options, MetricsRegistry* metrics) {
  if (options.threads < 1 || options.threads > kMaxThreads) {
    return Status::InvalidArgument(fmt::format("threads must be in [1, {}], not {}", kMaxThreads, options.threads));
  }
  FaultGuard::Install();  // a copy that faults on engine memory fails its batch, not the process
  if (options.max_inflight_batches == 0) {
    return Status::InvalidArgument("max_inflight_batches must be at least 1");
  }
  if (options.chunk_bytes == 0) return Status::InvalidArgument("chunk_bytes must be at least 1");
  std::unique_ptr<CpuCopyEngine> engine(new CpuCopyEngine(options, metrics));
  {
    MutexLock lock(&engine->shutdown_mu_);
    engine->workers_.reserve(static_cast<size_t>(options.threads));
    for (int i = 0; i < options.threads; ++i) {
      engine->workers_.emplace_back([e = engine.get()] { e->WorkerLoop(); });
    }
  }
  return engine;
}

CpuCopyEngine::CpuCopyEngine(const Options& options, MetricsRegistry* metrics)
    : options_(options),
      owned_metrics_(metrics == nullptr ? std::make_unique<MetricsRegistry>() : nullptr),
      bytes_total_{&BytesCounter(PickRegistry(metrics, owned_metrics_), CopyDirection::kSave),
                   &BytesCounter(PickRegistry(metrics, owned_metrics_), CopyDirection::kRestore)},
      batches_total_{&BatchesCounter(PickRegistry(metrics, owned_metrics_), CopyDirection::kSave),
                     &BatchesCounter(PickRegistry(metrics, owned_metrics_), CopyDirection::kRestore)},
      inflight_gauge_(&PickRegistry(metrics, owned_metrics_)
                           .GetGauge("orbitkv_copy_inflight_batches", "Copy batches accepted and not yet completed.",
                                     {{"engine", "cpu"}})) {}

CpuCopyEngine::~CpuCopyEngine() {
  Shutdown();
  MutexLock lock(&registry_mu_);
  for (const Slot& slot : slots_) ORBITKV_CHECK(slot.pins == 0);
}

Result<BufferId> CpuCopyEngine::RegisterBuffer(uint8_t* base, uint64_t bytes) {
  if (base == nullptr) return Status::InvalidArgument("buffer base is null");
  if (bytes == 0) return Status::InvalidArgument("buffer has zero bytes");
  if (reinterpret_cast<uintptr_t>(base) > std::numeric_limits<uintptr_t>::max() - bytes) {
    return Status::InvalidArgument("buffer range wraps the address space");
  }
  MutexLock lock(&registry_mu_);
  uint32_t index;
  if (!free_slots_.empty()) {
    index = free_slots_.back();
    free_slots_.pop_back();
  } else {
    if (slots_.size() > std::numeric_limits<uint32_t>::max()) {
      return Status::ResourceExhausted("every buffer slot is in use");
    }
    index = static_cast<uint32_t>(slots_.size());
    slots_.emplace_back();
  }
  Slot& slot = slots_[index];
  ORBITKV_CHECK(!slot.live && slot.pins == 0);
  slot.base = base;
  slot.pid = 0;
  slot.bytes = bytes;
  slot.live = true;
  return BufferId{index, slot.generation};
}

Result<BufferId> CpuCopyEngine::RegisterProcessBuffer(pid_t pid, uint64_t base, uint64_t bytes) {
  if (pid <= 0) return Status::InvalidArgument("a process buffer needs a process id");
  auto process = std::make_shared<Process>();
  process->pid = pid;
  process->pidfd = ScopedFd(static_cast<int>(syscall(SYS_pidfd_open, pid, 0)));
  if (!process->pidfd.valid()) {
    return ErrnoStatus(fmt::format("pidfd_open of engine process {}", pid), errno);
  }
  process->mem = ScopedFd(open(fmt::format("/proc/{}/mem", pid).c_str(), O_RDWR | O_CLOEXEC));
  if (!process->mem.valid()) {
    const int err = errno;
    return Status::PermissionDenied(
        fmt::format("cannot open the memory of engine process {}: {} (process memory needs the same uid or "
                    "CAP_SYS_PTRACE; allocate KV in shared memory with orbitkv.shm otherwise)",
                    pid, std::strerror(err)));
  }
  // The pidfd was taken after the pid was looked up: make sure both name the process that was
  // asked for (it may have been replaced in between).
  if (!StillThere(process->pidfd.get())) {
    return Status::Unavailable(fmt::format("engine process {} is gone", pid));
  }
  ORBITKV_ASSIGN_OR_RETURN(BufferId id, RegisterBuffer(reinterpret_cast<uint8_t*>(base), bytes));
  MutexLock lock(&registry_mu_);
  slots_[id.index].pid = pid;
  slots_[id.index].process = std::move(process);
  return id;
}

Status CpuCopyEngine::UnregisterBuffer(BufferId id) {
  ORBITKV_CHECK_MSG(t_worker_of != this, "UnregisterBuffer() from a CopyDone of the same engine");
  MutexLock lock(&registry_mu_);
  if (FindLiveSlot(id) == nullptr) {
    return Status::NotFound(fmt::format("buffer {}/{} is not registered", id.index, id.generation));
  }
  slots_[id.index].live = false;
  // Index, not a reference: RegisterBuffer() may grow slots_ while this waits.
  while (slots_[id.index].pins > 0) unpinned_cv_.wait(registry_mu_);
  Slot& slot = slots_[id.index];
  slot.base = nullptr;
  slot.bytes = 0;
  slot.pid = 0;
  slot.process.reset();
  // A slot whose generation would wrap is never reused, so no id is ever issued twice.
  if (slot.generation < std::numeric_limits<uint32_t>::max()) {
    ++slot.generation;
    free_slots_.push_back(id.index);
  }
  return Status::Ok();
}

CpuCopyEngine::Slot* CpuCopyEngine::FindLiveSlot(BufferId id) {
  if (id.index >= slots_.size()) return nullptr;
  Slot& slot = slots_[id.index];
  return slot.live && slot.generation == id.generation ? &slot : nullptr;
}

Status CpuCopyEngine::Submit(CopyBatch batch, CopyDone done) {
  uint64_t total_bytes = 0;
  ORBITKV_RETURN_IF_ERROR(CheckShape(batch, done, &total_bytes));
  auto accepted = std::make_unique<Batch>(std::move(batch), std::move(done), total_bytes);
  // Validation before backpressure, so that an invalid batch is never answered "retry later".
  ORBITKV_RETURN_IF_ERROR(ResolveAndPin(accepted.get()));
  if (Status status = ReserveInflight(); !status.ok()) {
    Unpin(accepted->copy);
    return status;
  }
  inflight_gauge_->Add(1);
  // Wake every worker only when the batch has work for more than one.
  const bool spread = total_bytes > options_.chunk_bytes;
  {
    MutexLock lock(&queue_mu_);
    Batch* raw = accepted.release();
    if (tail_ == nullptr) {
      head_ = raw;
    } else {
      tail_->next = raw;
    }
    tail_ = raw;
  }
  if (spread) {
    work_cv_.notify_all();
  } else {
    work_cv_.notify_one();
  }
  return Status::Ok();
}

Status CpuCopyEngine::ReserveInflight() {
  MutexLock lock(&queue_mu_);
  if (!accepting_) return Status::Unavailable("copy engine is shut down");
  if (inflight_ >= options_.max_inflight_batches) {
    return Status::ResourceExhausted(
        fmt::format("{} copy batches in flight; retry later", options_.max_inflight_batches));
  }
  ++inflight_;
  return Status::Ok();
}

void CpuCopyEngine::ReleaseInflight() {
  bool drained;
  {
    MutexLock lock(&queue_mu_);
    ORBITKV_CHECK(inflight_ > 0);
    drained = --inflight_ == 0;
  }
  if (drained) drained_cv_.notify_all();
}

Status CpuCopyEngine::ResolveAndPin(Batch* batch) {
  const std::vector<CopyFragment>& fragments = batch->copy.fragments;
  batch->engine_addr.resize(fragments.size());
  batch->engine_pid.resize(fragments.size());
  batch->engine_process.resize(fragments.size());
  MutexLock lock(&registry_mu_);
  for (size_t i = 0; i < fragments.size(); ++i) {
    const CopyFragment& f = fragments[i];
    const Slot* slot = FindLiveSlot(f.buffer);
    if (slot == nullptr) {
      return Status::NotFound(
          fmt::format("fragment {}: buffer {}/{} is not registered", i, f.buffer.index, f.buffer.generation));
    }
    // Two comparisons instead of offset + length, which could overflow.
    if (f.buffer_offset > slot->bytes || f.length > slot->bytes - f.buffer_offset) {
      return Status::InvalidArgument(fmt::format("fragment {}: offset {} length {} exceeds buffer {}/{} of {} bytes", i,
                                                 f.buffer_offset, f.length, f.buffer.index, f.buffer.generation,
                                                 slot->bytes));
    }
    batch->engine_addr[i] = slot->base + f.buffer_offset;
    batch->engine_pid[i] = slot->pid;
    batch->engine_process[i] = slot->process;
  }
  for (const CopyFragment& f : fragments) ++slots_[f.buffer.index].pins;
  return Status::Ok();
}

void CpuCopyEngine::Unpin(const CopyBatch& batch) {
  bool retired_slot_unpinned = false;
  {
    MutexLock lock(&registry_mu_);
    for (const CopyFragment& f : batch.fragments) {
      Slot& slot = slots_[f.buffer.index];
      ORBITKV_CHECK(slot.pins > 0);
      if (--slot.pins == 0 && !slot.live) retired_slot_unpinned = true;
    }
  }
  if (retired_slot_unpinned) unpinned_cv_.notify_all();
}

void CpuCopyEngine::WorkerLoop() {
  t_worker_of = this;
  for (;;) {
    Claim claim;
    {
      MutexLock lock(&queue_mu_);
      while (head_ == nullptr && !stop_) work_cv_.wait(queue_mu_);
      if (head_ == nullptr) break;  // stop_ is set only once nothing is in flight.
      claim = ClaimFromHead();
    }
    Copy(claim);
    const uint64_t before = claim.batch->remaining_bytes.fetch_sub(claim.bytes, std::memory_order_acq_rel);
    ORBITKV_CHECK(before >= claim.bytes);
    if (before == claim.bytes) Finish(claim.batch);
  }
  t_worker_of = nullptr;
}

CpuCopyEngine::Claim CpuCopyEngine::ClaimFromHead() {
  Batch* batch = head_;
  const std::vector<CopyFragment>& fragments = batch->copy.fragments;
  const uint64_t chunk = options_.chunk_bytes;
  Claim claim{batch, batch->next_fragment, batch->next_offset, 0};
  uint32_t whole_fragments = 0;
  while (batch->next_fragment < fragments.size()) {
    const uint64_t left = fragments[batch->next_fragment].length - batch->next_offset;
    if (claim.bytes == 0 && left > chunk) {
      // A large fragment: take one chunk of it.
      claim.bytes = chunk;
      batch->next_offset += chunk;
      break;
    }
    // Otherwise take the rest of the fragment whole, as long as the claim stays within a chunk.
    const bool full = left > chunk - claim.bytes || whole_fragments == kMaxFragmentsPerClaim;
    if (claim.bytes > 0 && full) break;
    claim.bytes += left;
    ++batch->next_fragment;
    batch->next_offset = 0;
    ++whole_fragments;
  }
  if (batch->next_fragment == fragments.size()) {
    head_ = batch->next;
    if (head_ == nullptr) tail_ = nullptr;
  }
  return claim;
}

void CpuCopyEngine::Copy(const Claim& claim) {
  const Batch& batch = *claim.batch;
  const bool save = batch.copy.direction == CopyDirection::kSave;
  const CopyStores stores = StoresFor(batch.copy.direction, batch.total_bytes);
  uint32_t i = claim.fragment;
  uint64_t offset = claim.offset;
  uint64_t left = claim.bytes;
  while (left > 0) {
    const CopyFragment& f = batch.copy.fragments[i];
    const uint64_t n = std::min(f.length - offset, left);
    uint8_t* engine = batch.engine_addr[i] + offset;
    uint8_t* pool = f.pool + offset;
    if (batch.engine_pid[i] != 0) {
      Status moved = CopyProcessMemory(*batch.engine_process[i], engine, pool, n, save);
      if (!moved.ok()) {
        MutexLock lock(&claim.batch->error_mu);
        if (claim.batch->error.ok()) claim.batch->error = moved;
      }
    } else {
      // Engine memory may vanish under the copy (base/fault_guard.h): that fails this batch only.
      const bool copied = save ? FaultGuard::GuardedCopy(pool, engine, n, engine, n, stores)
                               : FaultGuard::GuardedCopy(engine, pool, n, engine, n, stores);
      if (!copied) {
        MutexLock lock(&claim.batch->error_mu);
        if (claim.batch->error.ok()) {
          claim.batch->error = Status::DataLoss(
              fmt::format("the engine's memory at {} vanished during a {} (SIGBUS): it was shrunk, punched or "
                          "unmapped while the Manager copied; the operation failed and nothing it copied is "
                          "used",
                          static_cast<const void*>(engine), save ? "save" : "restore"));
        }
      }
    }
    left -= n;
    offset = 0;
    ++i;
  }
}

void CpuCopyEngine::Finish(Batch* raw) {
  // Every claim on the batch has been copied, so the worker that drained it is its only user.
  std::unique_ptr<Batch> batch(raw);
  const int direction = DirectionIndex(batch->copy.direction);
  bytes_total_[direction]->Increment(batch->total_bytes);
  batches_total_[direction]->Increment();
  Status status;
  {
    MutexLock lock(&batch->error_mu);
    status = batch->error;
  }
  batch->done(status);
  // Only now is the batch no longer in flight: UnregisterBuffer() and Shutdown() wait for CopyDone
  // to return.
  Unpin(batch->copy);
  batch.reset();
  inflight_gauge_->Add(-1);
  ReleaseInflight();
}

void CpuCopyEngine::Shutdown() {
  ORBITKV_CHECK_MSG(t_worker_of != this, "Shutdown() from a CopyDone of the same engine");
  MutexLock shutdown_lock(&shutdown_mu_);
  if (workers_.empty()) return;
  {
    MutexLock lock(&queue_mu_);
    accepting_ = false;
    while (inflight_ > 0) drained_cv_.wait(queue_mu_);
    ORBITKV_CHECK(head_ == nullptr);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& worker : workers_) worker.join();
  workers_.clear();
}

}  // namespace orbitkv::core
