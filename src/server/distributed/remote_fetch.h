// RemoteFetcher: the remote stage of a Loading operation in a distributed Manager (seed 000, "Query path", steps
// 1-5). Given the keys of a chain from where local DRAM and SSD stop, it
//   1. pins what is already resident at the front (nothing to fetch there),
//   2. learns who holds the rest (Discovery: warm keys cost no RPC; concurrent misses of a prefix share a lookup),
//   3. plans the longest span on one source and authorizes it there (AuthorizeBest: a rejection removes only the
//      refused versions, at most two alternatives, no new directory RPC),
//   4. reads the granted blocks with ReadBatch straight into new DRAM blocks (Prepare -> read -> checksum and byte
//      count verified -> Seal as kRestore, so they are advertised like any resident), in batches of at most
//      16 MiB with two in flight, the prepared bytes charged to the staging budget until sealed or aborted,
//   5. reports the pins of the prefix now resident, then releases the grant (bounded retries).
// After each sealed batch it reports progress (the stage's leading blocks resident), so an engine waiting with a
// partial query restores what arrived while the next batch moves.
// Two stages missing the same prefix (two engines, or two requests) share one fetch: the later one waits for the
// fetch in flight from the same first key (within its deadline), pins what it brought and goes on from there.
// Any failure stops the prefix there (the engine recomputes the rest); the stage's deadline bounds the whole fetch,
// and a fetch owns its writers and its grant until the transport completed, whatever the engine does meanwhile.
//
// Thread safety: Stage may be called from any thread; fetches run on the fetcher's own threads.
#ifndef ORBITKV_SERVER_DISTRIBUTED_REMOTE_FETCH_H_
#define ORBITKV_SERVER_DISTRIBUTED_REMOTE_FETCH_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "base/flights.h"
#include "base/metrics.h"
#include "base/mutex.h"
#include "base/stats_visitor.h"
#include "catalog/candidate_index.h"
#include "catalog/discovery.h"
#include "catalog/remote_plan.h"
#include "core/block_cache.h"
#include "server/loading_registry.h"
#include "transfer/transfer_engine.h"

namespace orbitkv::server {

class RemoteFetcher {
 public:
  struct Options {
    std::string self_node;
    size_t threads = 4;
    std::chrono::milliseconds deadline{10000};  // the remote stage's, from its start
    uint64_t staging_budget_bytes = 0;          // 0: a quarter of the pool
    uint64_t max_batch_bytes = 16ull << 20;
    uint64_t max_fragment_bytes = 1ull << 20;
    size_t batches_in_flight = 2;
    size_t max_queued = 1024;  // fetches waiting for a thread; more complete at once with what is local
    // A source whose transfer failed (unreachable UCX port, lost mid-batch) is not planned for this long: later
    // queries go elsewhere or answer locally at once instead of each waiting out a transfer deadline.
    std::chrono::milliseconds source_breaker{5000};
    // Whether remote work is allowed now (registered, complete member view).
    std::function<bool()> can_work;
  };
  struct Stats {
    uint64_t fetches = 0;         // remote stages run
    uint64_t fetched_blocks = 0;  // blocks read from peers and sealed
    uint64_t fetched_bytes = 0;
    uint64_t no_source = 0;        // stages that found no source granting anything
    uint64_t failed = 0;           // stages whose transfer failed part-way (the prefix stopped there)
    uint64_t authorizations = 0;   // Authorize RPCs
    uint64_t rejections = 0;       // stale / not-in-DRAM answers
    uint64_t staging_bytes = 0;    // now
    uint64_t discovery_rpcs = 0;   // Lookup RPCs sent by discovery
    uint64_t shared = 0;           // stages that waited for another stage fetching the same prefix
    uint64_t sources_skipped = 0;  // sources left out of a plan because a transfer from them failed just before
    double fetch_seconds = 0;      // wall time of the transfers that brought blocks (authorized to sealed)
    // Blocks fetched that the source held on SSD (read into its DRAM first), Authorize RPCs repeated
    // while sources prepared, and sources that answered backpressure or missing.
    uint64_t fetched_ssd_blocks = 0;
    uint64_t authorize_polls = 0;
    uint64_t source_backpressure = 0;
    uint64_t source_missing = 0;
  };

  // Everything passed must outlive the fetcher. `arenas[i]` is the transfer region of pool arena i.
  RemoteFetcher(Options options, core::BlockCache* cache, catalog::CandidateIndex* index, catalog::Discovery* discovery,
                catalog::SourceTransport* sources, transfer::TransferEngine* engine,
                std::vector<transfer::RegionHandle> arenas, MetricsRegistry* metrics);
  // Stops the threads: fetches running finish (their deadlines bound them), queued ones report what is local.
  ~RemoteFetcher();
  void Stop();

  // The stage that brings `keys` (a chain's keys from where local tiers stop) in from peers; none while remote
  // work is off.
  std::optional<LoadingStage> Stage(std::vector<state::StateKey> keys);
  Stats GetStats() const;
  // Its figures, each under its stats JSON key and, where exported, its orbitkv_* metric.
  void VisitStats(StatsVisitor& v) const;

 private:
  struct Job {
    std::vector<state::StateKey> keys;
    Deadline deadline = Deadline::Infinite();
    LoadingStage::Done done;
    LoadingStage::Progress progress;  // after each sealed batch
  };
  // A fetch whose grant is still to be released.
  struct Fetched {
    catalog::Authorized authorized;
    uint64_t request_id = 0;
  };
  void Work();
  // The whole fetch of one stage but the source's release (`fetched`); returns the pins of the resident prefix.
  std::vector<core::BlockPin> Fetch(const Job& job, std::optional<Fetched>* fetched);
  // Reads the granted blocks into new DRAM blocks, sealing the prefix that arrived intact and reporting
  // `progress` (the stage's leading blocks resident) after each batch; false when a transfer failed.
  bool ReadGranted(const catalog::Authorized& authorized, Deadline deadline, std::vector<core::BlockPin>* pins,
                   const LoadingStage::Progress& progress);
  // One ReadGranted's state: the grant, its batches in flight and where the prefix stands.
  struct GrantedRead;
  // Prepares and starts the read's next batch; false when there is nothing more to start.
  bool StartBatch(GrantedRead& read);
  // Adds the sources whose breaker is open (a transfer from them failed lately) to `authorize`'s exclusions.
  void ExcludeOpenSources(catalog::AuthorizeOptions* authorize);
  void ReleaseGrant(const catalog::Authorized& authorized, uint64_t request_id);
  // The arena and offset of pool memory at `data`.
  std::pair<uint32_t, uint64_t> Locate(const uint8_t* data) const;

  const Options options_;
  core::BlockCache* const cache_;
  catalog::CandidateIndex* const index_;
  catalog::Discovery* const discovery_;
  catalog::SourceTransport* const sources_;
  transfer::TransferEngine* const engine_;
  const std::vector<transfer::RegionHandle> arenas_;
  // Fetches in flight, by the first key they fetch: a stage missing the same prefix waits for it.
  Flights<state::StateKey, state::StateKeyHash> flights_;
  std::unique_ptr<core::Budget> staging_;
  std::atomic<uint64_t> next_request_;

  // Each figure counted once, here (relaxed: they order nothing); GetStats and VisitStats read them.
  struct Counts {
    std::atomic<uint64_t> fetches{0}, fetched_blocks{0}, fetched_bytes{0}, no_source{0}, failed{0};
    std::atomic<uint64_t> authorizations{0}, rejections{0}, discovery_rpcs{0}, shared{0}, sources_skipped{0};
    std::atomic<uint64_t> fetch_ns{0}, fetched_ssd_blocks{0}, authorize_polls{0}, source_backpressure{0};
    std::atomic<uint64_t> source_missing{0};
  };
  Counts counts_;

  mutable Mutex mu_;
  std::condition_variable_any wake_;
  std::deque<Job> queue_ GUARDED_BY(mu_);
  std::map<std::pair<std::string, std::string>, MonoTime> source_open_until_ GUARDED_BY(mu_);
  bool stop_ GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace orbitkv::server

#endif  // ORBITKV_SERVER_DISTRIBUTED_REMOTE_FETCH_H_
