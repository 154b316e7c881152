// SsdTier: the second tier under the DRAM pool. It writes blocks evicted from DRAM (or, with
// write-through, every sealed block) to an SsdStore, publishes their SSD residence once the write
// completed, and loads SSD-only blocks back into DRAM for queries.
//
//   write-back  BlockTable's eviction listener hands over (key, pin) of each evicted block; the
//               admission filter drops blocks the sketch saw fewer than `min_frequency` times
//               (one-hit wonders), and a bounded queue (bytes) feeds writer threads that spend a
//               bytes-per-second budget. Each writer keeps its share of writes_in_flight records at
//               the disk (an SsdStore::Writer) and prepares the next meanwhile. The pin keeps the
//               evicted bytes alive until the write is done; a full queue drops the write (counted)
//               rather than holding DRAM hostage.
//   residence   PublishSsd only after the record is on the device; the tier owns the map from key
//               to extent and is the only one to free an extent (after DropSsd of that generation).
//               A full store evicts its oldest records first (FIFO).
//   load        Load(keys) reads SSD-only blocks (one shared read per key through the cache's
//               ReadCoalescer), verifies each record, copies it into a DRAM block and seals it with
//               cause kRestore; the callback reports how many leading keys are now in DRAM. A
//               record that fails verification is a miss: its residence is dropped and counted,
//               its bytes are never served.
//   faults      A device write error (EIO, ENOSPC from a file system that ran out despite the
//               preallocation) disables new admissions (log line, gauge
//               orbitkv_ssd_admissions_enabled = 0); reads and DRAM service continue.
//   restart     PersistDram() writes the DRAM-only blocks before a graceful stop; Create()
//               rebuilds the SSD residences from the store's scan (newest write epoch wins for a
//               key found twice).
//
// Thread safety: all methods are safe from any thread. Threads (writers, readers) are created in
// Create() and joined in Shutdown(); callbacks run on reader threads and must not call Shutdown().
#ifndef ORBITKV_CORE_SSD_TIER_H_
#define ORBITKV_CORE_SSD_TIER_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <vector>

#include "base/metrics.h"
#include "base/mutex.h"
#include "base/result.h"
#include "base/thread_annotations.h"
#include "core/block_cache.h"
#include "storage/ssd_store.h"

namespace orbitkv::core {

enum class SsdWritePolicy : uint8_t { kWriteBack, kWriteThrough };

struct SsdTierOptions {
  storage::SsdStoreOptions store;
  SsdWritePolicy policy = SsdWritePolicy::kWriteBack;
  // Evicted blocks the sketch estimates below this are not written (1: write every block).
  uint32_t min_frequency = 2;
  uint64_t write_bytes_per_second = 0;  // 0: unlimited
  uint64_t queue_bytes = 256ull << 20;  // evicted bytes waiting for a writer, at most
  // Writer threads, each keeping writes_in_flight / writer_threads records at the disk and the next
  // one assembled (copied, checksummed) meanwhile, so the disk never waits for the CPU.
  // writes_in_flight is the tier's write queue depth.
  uint32_t writer_threads = 2;
  uint32_t writes_in_flight = 4;
  uint32_t reader_threads = 4;
};

struct SsdTierStats {
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;
  uint64_t records = 0;
  uint64_t recovered_records = 0;
  uint64_t writes = 0;
  uint64_t written_bytes = 0;
  uint64_t reads = 0;
  uint64_t read_bytes = 0;
  uint64_t verify_failures = 0;
  uint64_t queue_drops = 0;
  uint64_t filtered = 0;
  uint64_t write_errors = 0;
  bool admissions_enabled = true;
  uint64_t registered_io = 0;  // device requests on registered (fixed) pool memory
};

class SsdTier {
 public:
  // `pins`: one pin on each block of the leading keys of the Load that are in DRAM now (its size is
  // that prefix's length). They keep the blocks resident (a later load, or any save, would
  // otherwise evict what was just read) until the caller lets them go.
  using LoadDone = std::function<void(std::vector<BlockPin> pins)>;

  // Opens the store (scanning it unless options.store.recover is false), republishes what it found,
  // installs the eviction listener on `cache`'s table and starts the threads. `cache` and `metrics`
  // must outlive the tier; the tier must be shut down before the cache is destroyed.
  static Result<std::unique_ptr<SsdTier>> Create(const SsdTierOptions& options, BlockCache* cache,
                                                 MetricsRegistry* metrics);
  ~SsdTier();  // Shutdown()
  SsdTier(const SsdTier&) = delete;
  SsdTier& operator=(const SsdTier&) = delete;

  // Write-through: queues a copy of the sealed DRAM block of `key` (no-op under write-back).
  void OnSealed(const state::StateKey& key);

  // Loads the SSD-only blocks among `keys` (in order; keys already in DRAM are skipped) into DRAM
  // and calls `done` once, on a reader thread (or this one, when nothing is to be read), with pins
  // on the prefix now DRAM-resident. Each block is pinned as soon as it is in DRAM, so the blocks
  // of one load never evict each other. Unavailable after Shutdown began (done is not called).
  Status Load(std::vector<state::StateKey> keys, LoadDone done);

  // Stops accepting work, drops queued write-backs (their DRAM pins go), finishes writes and reads
  // in flight and every queued load (their callbacks run), then joins the threads. Idempotent.
  void Shutdown();

  // Waits until the write-back queue is empty and no write is in flight (tests, benchmarks).
  void Flush();

  // What PersistDram did.
  struct PersistReport {
    uint64_t candidates = 0;  // DRAM-only blocks the admission filter admits
    uint64_t queued = 0;
    uint64_t written = 0;  // new SSD records while it ran
    uint64_t written_bytes = 0;
    double seconds = 0;
    bool timed_out = false;  // the deadline came first: the rest stays DRAM-only
  };
  // Writes the DRAM blocks that are not on SSD yet (the ones the admission filter admits, most
  // frequent first) and waits for the writes, so a restarted Manager finds them: for a graceful
  // stop, after the engines are gone and before Shutdown(). Stops queueing at `deadline`; writes
  // in flight then finish. `progress` runs on the calling thread about every two seconds.
  PersistReport PersistDram(MonoTime deadline, const std::function<void(const PersistReport&)>& progress = {});

  SsdTierStats Stats() const;
  const storage::ScanReport& scan_report() const { return scan_report_; }
  std::string_view backend_name() const { return store_->backend_name(); }
  bool direct_io() const { return store_->direct_io(); }
  storage::WriteStaging write_staging() const { return store_->write_staging(); }
  uint64_t capacity_bytes() const { return store_->capacity_bytes(); }

 private:
  struct WriteJob {
    state::StateKey key;
    BlockPin pin;
  };
  struct Live {
    uint64_t generation = 0;
    uint64_t locator = 0;
    uint64_t bytes = 0;
  };
  struct FifoEntry {
    state::StateKey key;
    uint64_t generation = 0;
  };
  static constexpr size_t kReadBatch = 4;  // records a reader thread reads at once
  struct LoadJob;
  struct ReadTask {
    state::StateKey key;
  };

  SsdTier(const SsdTierOptions& options, BlockCache* cache, MetricsRegistry* metrics,
          std::unique_ptr<storage::SsdStore> store);
  void Recover(std::vector<storage::RecoveredRecord> records);
  void Enqueue(const state::StateKey& key, BlockPin pin);
  void WriterLoop(uint32_t depth);
  void ReaderLoop();
  // The next job from the write queue (waiting for one when `wait`), counted in flight; none when
  // the queue is empty (and, waiting, the tier is stopping).
  std::optional<WriteJob> TakeJob(bool wait);
  // Prepares `job`'s record in `writer` under `tag`; false when it is not to be written (admissions
  // off, already on SSD, a failure).
  bool PrepareJob(storage::SsdStore::Writer& writer, WriteJob& job, uint64_t tag);
  // Publishes a finished write of `job` (or counts its failure).
  void FinishJob(WriteJob& job, const Result<uint64_t>& locator);
  // A job taken by TakeJob() is over: its pin goes, and Flush() may return.
  void EndJob(std::optional<WriteJob>& job);
  // Loads the tasks' blocks into DRAM (one batch of reads) and completes each in the coalescer.
  void ReadMany(std::vector<ReadTask>& tasks, storage::AlignedBuffer* staging);
  // Frees the oldest records until about `bytes` were released; false when nothing is left.
  bool EvictOldest(uint64_t bytes);
  // Forgets the record of `key` with `generation`: drops the residence and frees the extent.
  void Forget(const state::StateKey& key, uint64_t generation, TransitionCause cause);
  void DisableAdmissions(const Status& why);
  void SpendWriteBudget(uint64_t bytes);

  // Immutable after construction.
  const SsdTierOptions options_;
  BlockCache* const cache_;
  const std::unique_ptr<storage::SsdStore> store_;
  storage::ScanReport scan_report_;
  Counter* writes_;
  Counter* written_bytes_;
  Counter* reads_;
  Counter* read_bytes_;
  Counter* verify_failures_;
  Counter* queue_drops_;
  Counter* filtered_;
  Counter* write_errors_;
  Counter* evictions_;
  Gauge* used_bytes_;
  Gauge* records_gauge_;
  Gauge* admissions_enabled_gauge_;
  uint64_t recovered_records_ = 0;

  // Release/acquire: set once by DisableAdmissions, read by every eviction.
  std::atomic<bool> admissions_enabled_{true};

  mutable Mutex mu_;
  std::condition_variable_any write_cv_;  // writers (and the write budget) wait on it (with mu_)
  std::condition_variable_any read_cv_;   // readers wait on it (with mu_)
  std::condition_variable_any idle_cv_;   // Flush waits on it
  bool stopping_ GUARDED_BY(mu_) = false;
  std::deque<WriteJob> write_queue_ GUARDED_BY(mu_);
  uint64_t queued_bytes_ GUARDED_BY(mu_) = 0;
  uint32_t writes_in_flight_ GUARDED_BY(mu_) = 0;
  std::deque<ReadTask> read_queue_ GUARDED_BY(mu_);
  std::unordered_map<state::StateKey, Live, state::StateKeyHash> live_ GUARDED_BY(mu_);
  std::deque<FifoEntry> fifo_ GUARDED_BY(mu_);
  // Token bucket for the write budget.
  double tokens_ GUARDED_BY(mu_) = 0;
  MonoTime refilled_ GUARDED_BY(mu_);

  std::vector<std::thread> threads_;
  std::once_flag shutdown_once_;
};

}  // namespace orbitkv::core

#endif  // ORBITKV_CORE_SSD_TIER_H_
