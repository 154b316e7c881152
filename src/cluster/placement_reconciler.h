// The elected placement reconciler (seed 000 "Membership and shard placement"): one Manager at a time
// leads, and only the leader changes the catalog placement, through etcd transactions that a deposed leader cannot
// win. It performs no block lookup or allocation.
//
// Leadership (ReconcilerLeadership). The leader key /orbitkv/v1/<cluster>/reconciler/leader is created only if
// absent and attached to the candidate's member lease, so it goes with a lapsed registration; its create revision
// is the leader's term. Every write the reconciler makes carries the compares "the leader key was created at my
// term" and "holds my name" (Guard), and the placement and transition records' revisions it read: a deposed
// leader's write fails and changes nothing. A leader whose registration lapses gives up at once (Lapsed), before
// it registers again; it campaigns anew with its new lease.
//
// The change (PlacementReconciler::Step, one idempotent pass over what etcd holds, so a new leader continues where
// a killed one stopped):
//   request -> transition: the operator's request (placement-request, the next set of catalog nodes) becomes a
//     transition record (placement_transition.h) in the transaction that deletes the request;
//   moving: at most `max_moving` shards at once get their new copies; each records, when it starts, the sequence
//     every live owner start had published to the shard's current copies (its watermark, from CatalogProgress: per
//     owner start, the inventory incarnation, since sequences restart with each start); it is ready once every new
//     copy reports a baseline of each of those owners past its watermark, or, for an owner that started again since,
//     a baseline of its new start (a slice of a start that is no longer live never counts). The watermarks stay in
//     the leader's memory, so the transition record is bounded whatever the member count (at most
//     `max_record_bytes`, checked before every write); a new leader takes them again from the current copies (later
//     sequences: only stricter). A shard that does not
//     get there within `shard_bound` aborts the change (phase aborted, with the reason, counted). The bound counts
//     only time this reconciler could act: between two passes that read etcd, at most `max_step_credit` (an etcd
//     outage does not use it up), afresh with a new leader. Each CatalogStatus call has its own deadline of at most
//     `status_call`, and each etcd call its own of `etcd_call`, so a copy that never answers cannot eat the write
//     that aborts the change;
//   abort: an operator's abort request (`orbitkv catalog placement --abort`) ends a moving change at the next pass
//     (phase aborted, "aborted by the operator"); with no change moving it is dropped;
//   stale requests: a request names the generation it was built from (base_generation); one built from another
//     generation than the committed one is dropped with a warning naming the placement now (the Manager that takes
//     a request checks the same before it writes: placement_driver.h);
//   commit: when every shard is ready, one transaction writes the placement of generation G+1 and the transition's
//     committed phase;
//   retire: `retire_grace` after the commit (or the abort) the transition record goes; the old copies retire with it.
//
// CatalogProgress is the transport seam: in a Manager the CatalogStatus peer RPC to each catalog copy.
//
// Thread safety: ReconcilerLeadership's methods are; a PlacementReconciler is driven by one thread.
#ifndef ORBITKV_CLUSTER_PLACEMENT_RECONCILER_H_
#define ORBITKV_CLUSTER_PLACEMENT_RECONCILER_H_

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "base/clock.h"
#include "base/mutex.h"
#include "base/result.h"
#include "cluster/etcd_client.h"
#include "cluster/placement.h"
#include "cluster/placement_transition.h"

namespace orbitkv::cluster {

class ReconcilerLeadership {
 public:
  // `self` is this Manager's Node ID, `runtime` its runtime UUID (the key's value names both).
  ReconcilerLeadership(EtcdClient* etcd, std::string cluster, std::string self, std::string runtime);

  // Leads if nobody does (the key created, attached to `lease`) or if this start already does. Returns whether it
  // leads now. etcd errors as the client returns them.
  Result<bool> Campaign(int64_t lease, Deadline deadline) EXCLUDES(mu_);
  bool leading() const EXCLUDES(mu_);
  int64_t term() const EXCLUDES(mu_);
  // The leader key's value now ("" when nobody leads).
  Result<std::string> Leader(Deadline deadline) const;
  // The registration lapsed: stops leading here, without etcd (the key goes with the lease).
  void Lapsed() EXCLUDES(mu_);
  // A transaction of this term: compares that fail once another leader's key replaced this one's. False (nothing
  // added) when not leading.
  bool Guard(etcdserverpb::TxnRequest* txn) const EXCLUDES(mu_);
  // A guarded transaction did not succeed: whether this leadership is gone (then it stops leading here).
  bool CheckDeposed(Deadline deadline) EXCLUDES(mu_);

  const std::string& value() const { return value_; }

 private:
  EtcdClient* const etcd_;
  const std::string key_;
  const std::string value_;
  mutable Mutex mu_;
  bool leading_ GUARDED_BY(mu_) = false;
  int64_t term_ GUARDED_BY(mu_) = 0;
};

// What one catalog copy holds of a shard, per owner: a baseline (a complete snapshot was installed) and the last
// sequence applied.
struct OwnerProgress {
  bool baseline = false;
  uint64_t sequence = 0;
  uint64_t incarnation = 0;  // the owner start the slice holds evidence of (0: not said)
};

class CatalogProgress {
 public:
  virtual ~CatalogProgress() = default;
  // The copy of `shard` on `node` for `generation`, per owner Node ID (Unavailable when it cannot be asked).
  virtual Result<std::map<std::string, OwnerProgress>> ShardStatus(const std::string& node, uint32_t shard,
                                                                   int64_t generation, Deadline deadline) = 0;
};

class PlacementReconciler {
 public:
  struct Options {
    std::string cluster;
    size_t max_moving = 2;
    std::chrono::milliseconds shard_bound{60'000};
    std::chrono::milliseconds retire_grace{10'000};
    // Each CatalogStatus call's deadline, and each etcd call's (a fresh one per call: see the file comment).
    std::chrono::milliseconds status_call{1'000};
    std::chrono::milliseconds etcd_call{5'000};
    // The most one pass adds to a moving shard's time against its bound (the time since the previous pass that read
    // etcd, capped: a gap longer than this is time the reconciler could not act).
    std::chrono::milliseconds max_step_credit{2'000};
    // Wall clock in ms (the records carry it); tests step it.
    std::function<int64_t()> now_ms;
    // The owners whose watermarks count (the live members), each with its start (the inventory incarnation its
    // member record names; 0 when it does not say).
    std::function<std::map<std::string, uint64_t>()> live_owners;
    // The largest transition record written (etcd's default request limit is 1.5 MiB).
    size_t max_record_bytes = 64 * 1024;
    CatalogProgress* progress = nullptr;
  };
  enum class Did { kNothing, kNotLeader, kStarted, kAdvanced, kWaiting, kCommitted, kAborted, kRetired };
  struct Outcome {
    Did did = Did::kNothing;
    std::string detail;
  };
  struct Stats {
    uint64_t started = 0;
    uint64_t committed = 0;
    uint64_t aborted = 0;
    uint64_t shard_moves = 0;  // shards that became ready
    uint64_t refused = 0;      // requests dropped: built on another generation, or an abort with nothing moving
  };

  PlacementReconciler(Options options, EtcdClient* etcd);

  // One pass (see the file comment); `deadline` bounds its etcd read. etcd errors as the client returns them; a write
  // that lost its compares is kNotLeader (deposed) or kWaiting (the records moved under it: the next pass reads them
  // again). A commit or an abort whose write's outcome was unknown (an error) is counted when a later pass reads it.
  Result<Outcome> Step(ReconcilerLeadership& leadership, Deadline deadline);

  // The committed placement, the transition (if any) and the request (if any), as etcd holds them now.
  struct Snapshot {
    std::optional<Placement> placement;
    int64_t placement_revision = 0;
    std::optional<PlacementTransition> transition;
    int64_t transition_revision = 0;
    std::optional<PlacementRequest> request;
    int64_t request_revision = 0;
  };
  Result<Snapshot> Read(Deadline deadline) const;

  Stats stats() const { return stats_; }

 private:
  Result<Outcome> Advance(ReconcilerLeadership& leadership, const Snapshot& s);
  // Runs a guarded transaction with a fresh deadline: kNotLeader / kWaiting when it did not succeed.
  Result<bool> Commit(ReconcilerLeadership& leadership, etcdserverpb::TxnRequest txn, Outcome* lost);
  // Counts a commit or abort written earlier with an unknown outcome, once a pass reads it.
  void CountUnconfirmed(const Snapshot& s);
  // Adds this pass's credit to the moving shards' time against their bound, and forgets the bound and the watermarks
  // of an earlier change.
  void Credit(const PlacementTransition& t, int64_t now);
  // The sequence each live owner start had published to `shard`'s copies of `from` now (its watermark).
  void TakeWatermarks(const Placement& from, uint32_t shard, const std::map<std::string, uint64_t>& live);
  // "" when every new copy of `shard` holds each watermarked owner past its mark, else what is behind.
  std::string Behind(const Placement& from, const Placement& to, uint32_t shard,
                     const std::map<std::string, uint64_t>& live);

  const Options options_;
  EtcdClient* const etcd_;
  Stats stats_;
  // The bound's clock: the last pass that read etcd, and each moving shard's time so far, for one change (its
  // from-generation and start).
  int64_t last_read_ms_ = 0;
  std::pair<int64_t, int64_t> credited_change_{-1, -1};
  std::array<int64_t, kNumShards> waited_ms_{};
  // The watermarks of the change's moving shards (owner node -> the start and the sequence), and whether taken.
  struct Watermark {
    uint64_t incarnation = 0;
    uint64_t sequence = 0;
  };
  std::array<std::map<std::string, Watermark>, kNumShards> marks_;
  std::array<bool, kNumShards> marked_{};
  // A commit or abort whose write answered an error: the change (from-generation, start) and the phase it wrote.
  struct Unconfirmed {
    int64_t from_generation = 0;
    int64_t started_ms = 0;
    PlacementTransition::Phase phase = PlacementTransition::Phase::kMoving;
  };
  std::optional<Unconfirmed> unconfirmed_;
};

std::string_view ReconcilerDidName(PlacementReconciler::Did did);

// The placement, the request and the transition records at one revision: one range over [placement,
// placement-transition\0) ("placement" < "placement-request" < "placement-transition"). etcd errors as the client
// returns them.
Result<etcdserverpb::RangeResponse> RangePlacementRecords(EtcdClient& etcd, std::string_view cluster,
                                                          Deadline deadline);

// Writes the operator's request unless one waits already (one transaction, create-only), and, with a
// `placement_revision`, only while the placement record is still at that revision: false when either compare fails.
// etcd errors as the client returns them.
Result<bool> SubmitPlacementRequest(EtcdClient& etcd, std::string_view cluster, const PlacementRequest& request,
                                    Deadline deadline, int64_t placement_revision = 0);

}  // namespace orbitkv::cluster

#endif  // ORBITKV_CLUSTER_PLACEMENT_RECONCILER_H_
