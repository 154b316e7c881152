// CpuCopyEngine: the CopyEngine that copies with memcpy on a small pool of threads it owns (saves,
// and restores of more than 8 MiB, with non-temporal stores: base/stream_copy.h).
//
// Engine buffers are host memory the engine process shares with the manager (a shared-memory
// mapping of the engine's KV cache, mapped here); RegisterBuffer() records one and names it with a
// BufferId. Submit() resolves and validates every fragment against the registry, pins the buffers
// it names, and appends the batch to a FIFO of batches. Worker threads claim work from the oldest
// batch in units of about `chunk_bytes`: consecutive small fragments are grouped into one claim and
// a fragment larger than `chunk_bytes` is split into `chunk_bytes` pieces, so one large batch
// spreads over every thread while many small batches cost one claim each. The worker whose copy
// drains the batch's last byte calls its CopyDone, then unpins its buffers and releases its
// in-flight slot. The submitting thread never copies: Submit() stays short and CopyDone always runs
// on an engine thread.
//
// Invariants: a buffer is pinned once per fragment of every in-flight batch that names it; a pinned
// buffer stays registered (UnregisterBuffer waits), so workers use the addresses resolved at Submit
// without the registry lock. At most `max_inflight_batches` batches are in flight (accepted,
// CopyDone not yet returned), counting batches still inside Submit. Per batch, Submit allocates the
// batch record and one address per fragment; claims and copies allocate nothing.
//
// Thread safety: every public method may be called from any thread. Submit() may also be called
// from a CopyDone; UnregisterBuffer() and Shutdown() must not be (they wait for batches to
// complete; a CHECK catches the call from a worker thread). Threads are created in Create() and
// joined in Shutdown() or the destructor.
#ifndef ORBITKV_CORE_CPU_COPY_ENGINE_H_
#define ORBITKV_CORE_CPU_COPY_ENGINE_H_

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <string_view>
#include <thread>
#include <vector>

#include "base/metrics.h"
#include "base/mutex.h"
#include "base/result.h"
#include "base/scoped_fd.h"
#include "base/status.h"
#include "base/thread_annotations.h"
#include "core/copy_engine.h"

namespace orbitkv::core {

class CpuCopyEngine final : public CopyEngine {
 public:
  struct Options {
    // Worker threads, in [1, kMaxThreads].
    int threads = 2;
    // Batches in flight before Submit() returns ResourceExhausted; at least 1.
    uint32_t max_inflight_batches = 1024;
    // Bytes one worker copies per claim (see the header comment); at least 1.
    uint64_t chunk_bytes = uint64_t{1} << 20;
  };
  static constexpr int kMaxThreads = 256;

  // Starts `options.threads` workers. InvalidArgument for options out of range. Metrics are
  // registered in `metrics` (which must outlive the engine) or, when it is null, in a registry the
  // engine owns:
  //   orbitkv_copy_bytes_total{engine="cpu",direction="save|restore"}: bytes of completed batches
  //   orbitkv_copy_batches_total{engine="cpu",direction="save|restore"}: completed batches
  //   orbitkv_copy_inflight_batches{engine="cpu"}: batches accepted and not yet completed
  static Result<std::unique_ptr<CpuCopyEngine>> Create(Options options, MetricsRegistry* metrics);

  CpuCopyEngine(const CpuCopyEngine&) = delete;
  CpuCopyEngine& operator=(const CpuCopyEngine&) = delete;

  // Shutdown(); then every buffer may be unmapped.
  ~CpuCopyEngine() override;

  // Records `bytes` bytes at `base` (not owned; the caller keeps the mapping alive until
  // UnregisterBuffer() returns) and returns its id. The slot of an unregistered buffer is reused
  // with a new generation. InvalidArgument for a null base, zero bytes or a range that wraps the
  // address space; ResourceExhausted when 2^32 slots are in use.
  Result<BufferId> RegisterBuffer(uint8_t* base, uint64_t bytes);
  // Records `bytes` bytes at address `base` of process `pid` (an engine's ordinary memory, same uid
  // or CAP_SYS_PTRACE): its fragments are copied with process_vm_readv/writev. A batch touching it
  // completes with the error of a failed transfer (Unavailable when the process is gone,
  // InvalidArgument when the range is not mapped there), never with a partial copy reported OK.
  Result<BufferId> RegisterProcessBuffer(pid_t pid, uint64_t base, uint64_t bytes);

  // Makes `id` unknown to new batches at once (they get NotFound), waits until every in-flight
  // batch that names it has completed (its CopyDone returned), then retires the id: after OK the
  // memory is no longer touched and may be unmapped, and `id` stays NotFound forever. NotFound for
  // an unknown, stale or already unregistering id.
  Status UnregisterBuffer(BufferId id);

  // CopyEngine. Submit() follows the contract in copy_engine.h; CopyDone gets OK unless a process
  // buffer's transfer failed.
  Status Submit(CopyBatch batch, CopyDone done) override;
  void Shutdown() override;
  std::string_view name() const override { return "cpu"; }

 private:
  struct Batch;  // An accepted batch: defined in the .cc.

  // The process a process-memory buffer lives in, bound at registration: a pidfd (to tell that it
  // is still the same process) and its /proc/PID/mem (writes go through it, so they reach that
  // process's memory or nothing, never a later process that was given the same pid).
  struct Process {
    pid_t pid = 0;
    ScopedFd pidfd;
    ScopedFd mem;
  };
  // A registered buffer. `pins` counts fragments of in-flight batches that name it.
  struct Slot {
    uint8_t* base = nullptr;
    pid_t pid = 0;                           // non-zero: `base` is an address in that process
    std::shared_ptr<const Process> process;  // with pid
    uint64_t bytes = 0;
    uint32_t generation = 1;
    bool live = false;
    uint64_t pins = 0;
  };

  // One worker's share of a batch: `bytes` bytes starting `offset` bytes into fragment `fragment`
  // and running on through the following fragments.
  struct Claim {
    Batch* batch = nullptr;
    uint32_t fragment = 0;
    uint64_t offset = 0;
    uint64_t bytes = 0;
  };

  CpuCopyEngine(const Options& options, MetricsRegistry* metrics);

  // Reserves an in-flight slot: Unavailable after Shutdown began, ResourceExhausted when full.
  Status ReserveInflight() EXCLUDES(queue_mu_);
  void ReleaseInflight() EXCLUDES(queue_mu_);
  // Resolves the engine address of every fragment into `batch` and pins the buffers, or pins
  // nothing and returns NotFound / InvalidArgument naming the first bad fragment.
  Status ResolveAndPin(Batch* batch) EXCLUDES(registry_mu_);
  void Unpin(const CopyBatch& batch) EXCLUDES(registry_mu_);
  // The live slot `id` names, or null.
  Slot* FindLiveSlot(BufferId id) REQUIRES(registry_mu_);

  void WorkerLoop() EXCLUDES(queue_mu_);
  // Takes the next claim from the head batch (which must exist); pops the batch once fully claimed.
  Claim ClaimFromHead() REQUIRES(queue_mu_);
  void Copy(const Claim& claim);
  // Runs on the worker that drained the batch: CopyDone, metrics, unpin, release; deletes `batch`.
  void Finish(Batch* batch) EXCLUDES(queue_mu_, registry_mu_);

  // Immutable after construction.
  const Options options_;
  const std::unique_ptr<MetricsRegistry> owned_metrics_;  // Set only when Create() got no registry.
  Counter* const bytes_total_[2];                         // Indexed by CopyDirection.
  Counter* const batches_total_[2];
  Gauge* const inflight_gauge_;

  // Serializes Shutdown() (a second caller waits until the first joined the workers).
  Mutex shutdown_mu_;
  std::vector<std::thread> workers_ GUARDED_BY(shutdown_mu_);

  // The buffer registry. Never held together with queue_mu_.
  Mutex registry_mu_;
  // Signalled when a slot that is no longer live drops its last pin.
  std::condition_variable_any unpinned_cv_;
  std::vector<Slot> slots_ GUARDED_BY(registry_mu_);
  std::vector<uint32_t> free_slots_ GUARDED_BY(registry_mu_);

  // The batch FIFO and the in-flight count.
  Mutex queue_mu_;
  std::condition_variable_any work_cv_;     // Workers wait here: a batch was queued, or stop_.
  std::condition_variable_any drained_cv_;  // Shutdown waits here: inflight_ reached 0.
  // Oldest batch with unclaimed bytes; the FIFO is linked by Batch::next.
  Batch* head_ GUARDED_BY(queue_mu_) = nullptr;
  Batch* tail_ GUARDED_BY(queue_mu_) = nullptr;
  uint32_t inflight_ GUARDED_BY(queue_mu_) = 0;
  bool accepting_ GUARDED_BY(queue_mu_) = true;  // False once Shutdown began.
  // Workers exit; set only once inflight_ is 0 after Shutdown began.
  bool stop_ GUARDED_BY(queue_mu_) = false;
};

}  // namespace orbitkv::core

#endif  // ORBITKV_CORE_CPU_COPY_ENGINE_H_
