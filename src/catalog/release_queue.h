// ReleaseQueue: the requester's grant releases on their own bounded workers, so a release never blocks a fetch. It is
// the SourceTransport the fetch path uses: Authorize goes straight to the transport it wraps, and Release is queued and
// answered at once, so a fetch worker never waits for a source that does not answer (a gRPC-only partition after a
// grant, a source stopped with SIGSTOP). Two worker threads send the releases, each RPC bounded by `rpc_timeout`, at
// most one at a time to any one node (so an unreachable source holds one worker at most and releases to other sources
// keep going), and retry a failed one with jittered backoff until `give_up_after` (the longest grant lifetime a source
// allows: by then it revoked the grant itself). A release that finds nothing held, or a source that restarted
// (NotFound), ends there. At most `max_queued` releases wait; past that Release answers ResourceExhausted and the grant
// expires at its source (counted as dropped).
//
// Thread safety: every method is safe from any thread.
#ifndef ORBITKV_CATALOG_RELEASE_QUEUE_H_
#define ORBITKV_CATALOG_RELEASE_QUEUE_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "base/clock.h"
#include "base/mutex.h"
#include "base/stats_visitor.h"
#include "base/thread_annotations.h"
#include "catalog/remote_plan.h"

namespace orbitkv::catalog {

class ReleaseQueue final : public SourceTransport {
 public:
  struct Options {
    size_t workers = 2;
    size_t max_queued = 4096;
    std::chrono::milliseconds rpc_timeout{1000};
    std::chrono::milliseconds backoff_min{50};
    std::chrono::milliseconds backoff_max{1000};
    std::chrono::milliseconds give_up_after{30000};
  };
  struct Stats {
    uint64_t queued = 0;     // releases accepted
    uint64_t released = 0;   // answered: the source held the grant and ended it
    uint64_t not_held = 0;   // answered: nothing held (released before, expired, or the source restarted)
    uint64_t retries = 0;    // attempts after a failed one
    uint64_t abandoned = 0;  // still failing after give_up_after (the source revoked it at its deadline)
    uint64_t dropped = 0;    // refused because max_queued were waiting
    size_t pending = 0;      // waiting or being sent now
  };

  // `inner` must outlive the queue. Starts the workers.
  ReleaseQueue(Options options, SourceTransport* inner);
  // Stop().
  ~ReleaseQueue() override;
  // Ends the workers after the RPCs in flight; releases still queued are not sent (their grants expire at the
  // sources). Idempotent.
  void Stop() EXCLUDES(mu_);

  Result<SourceReply> Authorize(const std::string& node, const std::string& runtime, uint64_t request_id,
                                std::span<const SourceBlockVersion> blocks, uint64_t byte_limit,
                                std::chrono::milliseconds lifetime, Deadline deadline) override;
  // Queues the release and answers true at once (ResourceExhausted when full; `deadline` is not used: the
  // workers bound each attempt themselves).
  Result<bool> Release(const std::string& node, const std::string& runtime, uint64_t request_id, uint64_t grant_id,
                       const std::string& grant_secret, Deadline deadline) override EXCLUDES(mu_);

  Stats GetStats() const EXCLUDES(mu_);
  // The remote_releases_* stats keys, orbitkv_remote_releases_total by outcome and orbitkv_remote_releases_pending.
  void VisitStats(StatsVisitor& v) const EXCLUDES(mu_);

 private:
  struct Item {
    std::string node;
    std::string runtime;
    uint64_t request_id = 0;
    uint64_t grant_id = 0;
    std::string grant_secret;
    MonoTime give_up{};
    std::chrono::milliseconds backoff{0};
  };
  void Work() EXCLUDES(mu_);

  const Options options_;
  SourceTransport* const inner_;

  mutable Mutex mu_;
  std::condition_variable_any wake_;
  std::multimap<MonoTime, Item> due_ GUARDED_BY(mu_);  // by when the next attempt may go
  size_t sending_ GUARDED_BY(mu_) = 0;
  std::set<std::string> busy_nodes_ GUARDED_BY(mu_);  // nodes a worker is sending a release to now
  bool stop_ GUARDED_BY(mu_) = false;
  Stats stats_ GUARDED_BY(mu_);
  std::minstd_rand jitter_ GUARDED_BY(mu_){std::random_device{}()};
  std::vector<std::thread> workers_;
};

}  // namespace orbitkv::catalog

#endif  // ORBITKV_CATALOG_RELEASE_QUEUE_H_
