// PlacementDriver: the elected placement reconciler in a distributed Manager (the logic is
// cluster/placement_reconciler.h, the state every Manager follows cluster/live_placement.h).
//
// Every Manager runs one. It reads only the live placement its member view's watch keeps (no etcd call in steady
// state): while no request and no change are in etcd it does nothing at all. When a request or a change appears and
// nobody leads, it campaigns (the leader key is created only if absent, on its member lease); the leader then steps
// the reconciler every `step_interval` until the change retired, asking the catalog copies through the CatalogStatus
// peer RPC. A lapsed registration gives leadership up at once (before it registers again); a registration made again
// campaigns with its new lease and runtime.
//
// Request() is what `orbitkv catalog placement --add/--remove NODE` asks (through the Manager's socket): it writes the
// operator's request (the whole next set) if none waits and no change moves.
//
// Thread safety: every method is safe from any thread.
#ifndef ORBITKV_SERVER_DISTRIBUTED_PLACEMENT_DRIVER_H_
#define ORBITKV_SERVER_DISTRIBUTED_PLACEMENT_DRIVER_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "base/mutex.h"
#include "base/result.h"
#include "base/stats_visitor.h"
#include "base/thread_annotations.h"
#include "cluster/membership.h"
#include "cluster/placement_reconciler.h"

namespace orbitkv::server {

class PlacementDriver {
 public:
  struct Options {
    std::string cluster;
    std::string node_id;
    std::chrono::milliseconds step_interval{200};
    size_t max_moving = 2;
    std::chrono::milliseconds shard_bound{60'000};   // --placement-shard-bound-ms
    std::chrono::milliseconds retire_grace{10'000};  // --placement-retire-grace-ms
  };

  // `membership` and `progress` must outlive the driver.
  PlacementDriver(Options options, cluster::Membership* membership, cluster::CatalogProgress* progress);
  ~PlacementDriver();

  void Start() EXCLUDES(mu_);
  void Stop() EXCLUDES(mu_);
  // The registration lapsed: leadership goes here at once (its key goes with the lease).
  void OnLapsed() EXCLUDES(mu_);
  // A registration made again: campaigns as that start.
  void OnRegistered(const cluster::MemberRecord& self) EXCLUDES(mu_);

  // Asks for a change of the catalog set: `verb` "add" or "remove" and a Node ID, or "abort" (the change moving now
  // ends at the reconciler's next step). Returns what was asked, in a few lines. FailedPrecondition naming why it
  // cannot be asked now (a change moves, a request waits, the node is not a live member, not in the set or already in
  // it, the last node, nothing to abort, or this Manager's placement is behind etcd's: a request names the generation
  // it was built on and is written only while that generation is committed); etcd errors as the client returns them.
  Result<std::vector<std::string>> Request(std::string_view verb, std::string_view node, Deadline deadline)
      EXCLUDES(mu_);

  // `orbitkv catalog placement`: the placement, the reconciler and any change, shard by shard.
  std::vector<std::string> Lines() const EXCLUDES(mu_);
  // The reconciler's figures (its counts as of its last step, the live placement's state now).
  void VisitStats(StatsVisitor& v) const EXCLUDES(mu_);

 private:
  void Run() EXCLUDES(mu_);
  // One round: campaigns and steps when there is work; returns how long to wait before the next one.
  std::chrono::milliseconds Round() EXCLUDES(mu_);
  // The placement record's revision while it is still at `base`'s generation (FailedPrecondition naming the
  // committed placement otherwise).
  Result<int64_t> CheckBase(const cluster::Placement& base, Deadline deadline);
  Result<std::vector<std::string>> RequestAbort(const cluster::LivePlacement::State& live, Deadline deadline)
      EXCLUDES(mu_);

  const Options options_;
  cluster::Membership* const membership_;
  cluster::PlacementReconciler reconciler_;  // driven by the Run thread only

  mutable Mutex mu_;
  std::condition_variable_any wake_;
  std::shared_ptr<cluster::ReconcilerLeadership> leadership_ GUARDED_BY(mu_);
  std::string last_outcome_ GUARDED_BY(mu_);
  cluster::PlacementReconciler::Stats reconciler_stats_ GUARDED_BY(mu_);  // as of the last step
  bool stop_ GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace orbitkv::server

#endif  // ORBITKV_SERVER_DISTRIBUTED_PLACEMENT_DRIVER_H_
