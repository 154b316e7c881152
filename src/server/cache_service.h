// CacheService: the cache operations engines ask the Manager for, with typed requests and results.
//
// Query (with Loading), restore and layer-wise restore, save, release, cancel, wait-for-Loading and
// stats, over the cache core (core::BlockCache), the SSD tier (optional) and the copy engines each
// registered KV group names. It knows nothing about sessions, sockets or rings: a caller is an
// opaque owner id (the Manager passes its control session's id) and only the owner of an instance
// may use it. The Manager decodes a request (channel/messages), calls the service, and encodes its
// result as the reply; tests call it directly.
//
//   Query        the longest DRAM-resident prefix of a chain built in the instance's namespace,
//                leased; when the prefix continues below DRAM (SSD), a Loading operation
//                (LoadingRegistry) with one stage per tier brings it up and the answer is Loading;
//                once that op completed, the chain's next query is answered from DRAM, whatever
//                the op brought (loading again would stop at the same place).
//   Restore      consumes the lease (or, for an earlier part of a layer-wise restore, borrows its
//                pins) and copies the blocks into the engine's pages; the pins and the reservation
//                end before the engine hears of the completion.
//   Save         prepares a DRAM block per key (skipping keys already resident or being written,
//                and blocks the pool has no room for: the save-skip rule), copies the pages in and
//                seals them; replies after they are resident.
//   Release, Cancel, WaitLoading, Stats  as named.
// Restores and saves in flight are bounded by max_operations over all owners (ResourceExhausted
// beyond; a whole restore's lease is released then, as on any failure: query again).
//
// Thread safety: every method is safe from any thread. Done callbacks run exactly once: inline for
// an error found before any copy (or for a long restore's second batch refused after its first
// drained), otherwise on a copy engine's thread.
#ifndef ORBITKV_SERVER_CACHE_SERVICE_H_
#define ORBITKV_SERVER_CACHE_SERVICE_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "base/metrics.h"
#include "base/result.h"
#include "channel/messages.h"
#include "core/block_cache.h"
#include "core/ssd_tier.h"
#include "server/engine_state.h"
#include "server/loading_registry.h"

namespace orbitkv::server {

struct CacheServiceOptions {
  uint32_t max_operations = 1024;  // restores and saves in flight over all owners
  uint32_t max_loading = 256;      // outstanding Loading operations per owner
  std::chrono::milliseconds loading_hold{10000};
  std::chrono::milliseconds ssd_load_deadline{30000};
  bool ssd_write_through = false;  // queue every sealed block for SSD
  // A whole restore of more than 4x this many pages goes to the copy engine as two batches: these
  // first pages at once, the rest once their fragments are built, so the copy starts while most of
  // them are still being built (at 8K tokens of a 36-layer model, 18396 fragments took about 0.3 ms
  // on an H100 host before anything moved). 0: always one batch.
  uint32_t restore_lead_pages = 16;
  // Wakes the thread that calls Sweep (LoadingRegistry::Options::wake_sweeper).
  std::function<void()> wake_sweeper;
  // Called (on a copy worker) when an owner's engine memory faulted under a copy (DATA_LOSS: it
  // vanished): the operation has failed; the Manager poisons that owner's sessions.
  std::function<void(uint64_t owner, const Status& why)> on_engine_fault;
};

// What `orbitkv stats` shows of the cache.
struct CacheServiceStats {
  uint64_t incarnation = 0;
  core::BlockCache::Stats cache;
  uint32_t operations_active = 0;
  uint64_t hits = 0;
  uint64_t misses = 0;
  uint64_t evictions = 0;
  uint64_t partial_answers = 0;  // partial hits leased while a Loading op ran
  std::optional<core::SsdTierStats> ssd;
  storage::WriteStaging ssd_write_staging{};
  // The JSON object `orbitkv stats` prints; `extra` (", \"key\": value" pairs) is appended.
  std::string ToJson(std::string_view extra) const;
};

class CacheService {
 public:
  template <typename T>
  using Done = std::function<void(Result<T>)>;

  // `cache`, `ssd` (null: no SSD tier) and `metrics` must outlive the service; the SSD tier must be
  // shut down before the service is destroyed (its load callbacks reach the service).
  CacheService(const CacheServiceOptions& options, core::BlockCache* cache, core::SsdTier* ssd,
               MetricsRegistry* metrics);
  ~CacheService();
  CacheService(const CacheService&) = delete;
  CacheService& operator=(const CacheService&) = delete;

  InstanceTable& instances() { return instances_; }
  core::BlockCache& cache() { return *cache_; }

  // Errors: the instance's or group's (NotFound, PermissionDenied), a chain that cannot be built
  // (InvalidArgument), ResourceExhausted when the query budget or --max-loading is full (retry).
  Result<channel::QueryReply> Query(uint64_t owner, const channel::QueryRequest& request);
  // The claim/abandon decision of a save or restore (channel/claims.h): `claim` returns true when
  // the Manager now owns the operation, false when the engine abandoned it first (empty: always the
  // Manager's); `finish` says a claimed operation is over (its copies drained).
  struct ClaimFn {
    std::function<bool()> claim;
    std::function<void()> finish;
  };
  // A restore is claimed before its first write into the engine's pages; an abandoned one is never
  // started (Aborted, the lease's pins go back).
  void Restore(uint64_t owner, const channel::RestoreRequest& request, Done<channel::RestoreReply> done,
               ClaimFn claim = {});
  // A save is claimed after its copy finished and before it is sealed; an abandoned one is never
  // sealed (Aborted), whatever bytes the copy read.
  void Save(uint64_t owner, const channel::SaveRequest& request, Done<channel::SaveReply> done, ClaimFn claim = {});
  Status Release(uint64_t owner, const channel::ReleaseRequest& request);
  // NotFound when the op completed and was taken by a query, or was cancelled.
  // Whether the Loading operation was there to cancel (false: it completed and was taken, or was cancelled);
  // NotFound for an instance this session did not register.
  Result<bool> Cancel(uint64_t owner, const channel::CancelRequest& request);
  // Answered when the op completes (at once if it has): the blocks now resident. NotFound when
  // there is no such op (ask the query again), Aborted when it was cancelled or expired first.
  void WaitLoading(uint64_t owner, const channel::WaitLoadingRequest& request, Done<channel::WaitLoadingReply> done);
  CacheServiceStats Stats() const;

  // The instance went away (unregistered, or its owner's session closed): it refuses new work,
  // its Loading ops are forgotten and its leases released. Returns how many leases were.
  size_t RetireInstance(EngineInstance& instance);
  // Stage deadlines and held-block expiry (LoadingRegistry::Sweep); returns when to call it again.
  MonoTime Sweep() { return loading_.Sweep(); }
  LoadingRegistry& loading() { return loading_; }
  // Distributed mode: the stage that brings a chain's keys (from where the local tiers stop) in
  // from peers, or none while remote work is off. Set before the service is used (the Manager sets
  // it once its cluster link is up).
  using RemoteStageFn = std::function<std::optional<LoadingStage>(std::vector<state::StateKey> keys)>;
  void SetRemoteStage(RemoteStageFn remote) { remote_stage_ = std::move(remote); }
  uint32_t operations_active() const { return operations_.load(std::memory_order_relaxed); }

 private:
  // The instance and group an operation names, both owned by `owner`.
  struct Target {
    std::shared_ptr<EngineInstance> instance;
    std::shared_ptr<const KvGroup> group;
  };
  Result<Target> Resolve(uint64_t owner, uint64_t instance, uint32_t group) const;
  // One of max_operations; false (counted) when they are all in flight.
  bool TryBeginOperation();
  void EndOperation();
  // Counts an answered query's blocks by tier (`origin`: its chain's completed Loading op, if any).
  void CountAnswer(size_t blocks, size_t hits, const std::optional<LoadingRegistry::Origin>& origin);
  // The stages that bring `keys` (from hits on) into DRAM, or none when nothing below DRAM has the
  // next block.
  std::vector<LoadingStage> PlanLoading(const std::vector<state::StateKey>& keys, size_t hits);
  // Reports a copy that faulted on `owner`'s engine memory (on_engine_fault).
  void CheckFault(uint64_t owner, const Status& status) const;
  // InvalidArgument/FailedPrecondition when a restore's pages or blocks do not fit `group` (checked
  // whole, before anything is copied).
  static Status CheckRestore(const channel::RestoreRequest& request, const KvGroup& group, const core::LeaseUse& lease);
  // Appends the fragments of the restore's pages [begin, end) (checked) to `batch`; their bytes.
  static uint64_t RestoreFragments(const channel::RestoreRequest& request, const KvGroup& group,
                                   const core::LeaseUse& lease, size_t begin, size_t end, core::CopyBatch* batch);

  // Immutable after construction.
  const CacheServiceOptions options_;
  core::BlockCache* const cache_;
  core::SsdTier* const ssd_;

  RemoteStageFn remote_stage_;  // set once, before use

  InstanceTable instances_;
  LoadingRegistry loading_;
  // Relaxed: an admission counter, exactness under races is not needed beyond never going negative.
  std::atomic<uint32_t> operations_{0};

  Gauge* operations_active_;
  Counter* operation_rejections_;
  Counter* restored_bytes_;
  Counter* saved_bytes_;
  Counter* save_skipped_;
  Counter* saves_abandoned_;
  Counter* restores_abandoned_;
  Histogram* query_latency_;
  Histogram* restore_latency_;
  Histogram* restore_submit_latency_;
  Histogram* save_latency_;
  // Blocks of answered queries by the tier that served them (dram, ssd, remote), and those missed.
  Counter* hit_blocks_dram_;
  Counter* hit_blocks_ssd_;
  Counter* hit_blocks_remote_;
  Counter* partial_answers_;
  Counter* missed_blocks_;
  Counter* hits_;
  Counter* misses_;
  Counter* evictions_;
};

}  // namespace orbitkv::server

#endif  // ORBITKV_SERVER_CACHE_SERVICE_H_
