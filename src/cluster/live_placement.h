// LivePlacement: the catalog placement a Manager routes by now, and the change in progress if any.
//
// The etcd records it follows (the member view's range, view_sync.h): the committed placement (generation G), the
// transition record of a change to G+1 (placement_transition.h), the operator's request and the reconciler's
// leader key. Each record is adopted as it arrives:
//   - a committed placement of a higher generation is adopted (the previous one is remembered while its old copies
//     retire); the same generation with other content, a lower generation or a removed record is a regression and
//     fences the Manager (Apply returns the reason);
//   - the transition record decides where owners publish and where queries go.
// What follows from the state (State):
//   PublishCopies(shard)  the copies an owner streams its inventory of `shard` to: the committed copies, plus,
//                         while the change is moving, the new copies of a shard that moves or is ready (owners publish
//                         to both generations); after an abort or a commit only the committed copies.
//   QueryCopies(shard)    the copies a lookup asks, committed first, then the new copies of a moving or ready shard
//                         (both generations within one discovery budget).
//   Hosts(shard, node)    whether `node` keeps a copy of `shard` now: published or queried copies, and the previous
//                         generation's copies until the transition record goes (managers still routing by G may ask
//                         them in the meantime).
//   Accepts(fingerprint)  the placements whose routes this Manager serves: the committed one, the next one while a
//                         change is in progress, the previous one until the transition record goes.
//
// Thread safety: every method is safe from any thread; Get() returns an immutable snapshot.
#ifndef ORBITKV_CLUSTER_LIVE_PLACEMENT_H_
#define ORBITKV_CLUSTER_LIVE_PLACEMENT_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/mutex.h"
#include "base/result.h"
#include "base/thread_annotations.h"
#include "cluster/placement.h"
#include "cluster/placement_transition.h"

namespace orbitkv::cluster {

class LivePlacement {
 public:
  struct State {
    Placement committed;
    // The transition record as etcd holds it (any phase), and its next placement.
    std::optional<PlacementTransition> transition;
    std::optional<Placement> next;
    // The committed placement before the last adopted change, while the transition record is still there.
    std::optional<Placement> previous;
    // The operator's request waiting for the reconciler, and the reconciler leader's key value ("" none).
    std::optional<PlacementRequest> request;
    std::string leader;

    bool moving() const { return transition && transition->phase == PlacementTransition::Phase::kMoving; }
    std::vector<std::string> PublishCopies(uint32_t shard) const;
    std::vector<std::string> QueryCopies(uint32_t shard) const;
    bool Hosts(uint32_t shard, std::string_view node) const;
    bool Accepts(std::string_view fingerprint) const;
    // Generations whose copies this state serves (CatalogStatus): the committed one and the next one.
    bool Serves(int64_t generation) const;
  };

  explicit LivePlacement(Placement committed);

  std::shared_ptr<const State> Get() const EXCLUDES(mu_);
  // Grows by one with every change of the state.
  uint64_t version() const { return version_.load(std::memory_order_acquire); }

  // The records of the cluster's placement keys as etcd holds them now (absent keys absent), by their name under
  // the cluster prefix: "placement", "placement-transition", "placement-request", "reconciler/leader". Returns
  // "" or, for a regression of the committed placement, the reason to fence. A malformed transition or request
  // record is ignored (logged once); a malformed placement record is a regression.
  std::string Apply(const std::map<std::string, std::string>& records) EXCLUDES(mu_);

  // Adopts what a join (`initial`: replaces what the Manager was configured with) or a registration made again read:
  // the committed placement and the transition record. FailedPrecondition for a regression against what this
  // Manager already routes by (not `initial`).
  Status Adopt(const Placement& committed, const std::optional<PlacementTransition>& transition, bool initial)
      EXCLUDES(mu_);

 private:
  // Replaces the state (version bumped) when it differs.
  void Publish(std::shared_ptr<State> next) REQUIRES(mu_);
  // Logs a malformed record once (until another one is ignored).
  void LogIgnored(std::string_view what, const Status& status) REQUIRES(mu_);
  // "" or why `incoming` may not replace `current`.
  static std::string Regression(const Placement& current, const Placement& incoming);

  mutable Mutex mu_;
  std::shared_ptr<const State> state_ GUARDED_BY(mu_);
  std::string last_ignored_ GUARDED_BY(mu_);  // the last malformed record logged
  std::atomic<uint64_t> version_{1};
};

class EtcdClient;

// The placement a Manager joins with (and registers again with): installs `configured` (--catalog-nodes,
// --catalog-replicas) as generation 1 when the cluster has none; otherwise adopts the installed placement and any
// transition into `live`. A cluster still at generation 1 must have been installed with the configured set (or be
// changing to it): FailedPrecondition naming both sets otherwise. Once the placement was changed online (generation 2
// or more) the installed one is the truth and the flags only seed new clusters. Returns the placement record's
// mod_revision (registration's fencing token). DataLoss for an unreadable placement record; FailedPrecondition for a
// regression against what `live` already routes by (not `initial`); etcd errors as the client returns them.
Result<int64_t> JoinPlacement(EtcdClient& client, std::string_view cluster, const Placement& configured,
                              LivePlacement* live, bool initial, Deadline deadline);

// The record names LivePlacement::Apply takes, under the cluster prefix.
inline constexpr std::string_view kPlacementRecordName = "placement";
inline constexpr std::string_view kTransitionRecordName = "placement-transition";
inline constexpr std::string_view kRequestRecordName = "placement-request";
inline constexpr std::string_view kLeaderRecordName = "reconciler/leader";

}  // namespace orbitkv::cluster

#endif  // ORBITKV_CLUSTER_LIVE_PLACEMENT_H_
