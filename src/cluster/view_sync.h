// ViewSync: keeps a MemberView equal to the member records in etcd, on a thread its owner provides.
//
// Run() loops: take a snapshot of the view range (cluster_keys.h) in pages of 128 at one revision
// R, install it, then Watch from R+1 and apply events until something makes the cache doubtful;
// then it invalidates the view and starts over. A broken stream (reconnect) is no reason to read the
// whole view again (about 1 MB at 4,096 members, from every Manager at once after an etcd failover):
// the view catches up from the records changed since its revision (CatchUp: a count and the changed
// keys, at one revision), and a snapshot is taken only when that cannot tell (a member deleted
// meanwhile). Doubtful means: the stream broke (reconnect), the
// Watch was cancelled for compaction, an event carried a malformed or oversized member record, or a
// counted member left while the next in line is unknown (line_unknown: member_view.h). A snapshot
// skips malformed and oversized records (counting them); more valid records than the member limit are
// no failure: the view counts the oldest (member_view.h). Failed snapshots are retried with a capped,
// jittered exponential backoff (100 ms to 2 s).
//
// When it guards a registration (Options::self), ViewSync also fences: the registration's own
// record missing or deleted (final = false: the lease lapsed, the registration can be made
// again), or rewritten with another epoch, lease or UUID, the placement record regressed or removed
// (on_placement says so; a newer generation is adopted), or the etcd cluster ID changed
// (final = true: another runtime or another cluster) all call on_fence once and end Run().
//
// Thread safety: Run() on one thread; Stop() from any thread, and it makes Run() return promptly.
#ifndef ORBITKV_CLUSTER_VIEW_SYNC_H_
#define ORBITKV_CLUSTER_VIEW_SYNC_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>

#include "base/metrics.h"
#include "base/mutex.h"
#include "base/result.h"
#include "base/thread_annotations.h"
#include "cluster/member_record.h"
#include "cluster/member_view.h"

namespace etcdserverpb {
class ResponseHeader;
class WatchResponse;
}  // namespace etcdserverpb

namespace orbitkv::cluster {

class EtcdClient;

inline constexpr int64_t kSnapshotPageSize = 128;

class ViewSync {
 public:
  struct Options {
    std::string cluster;
    // The registration this view guards, or nullopt for an observer that only watches.
    std::optional<Member> self;
    // Called on the ViewSync thread with the placement records in the range (the committed placement, the
    // transition, the request and the reconciler's leader key, by their names under the cluster prefix:
    // live_placement.h) after every snapshot and every watch response that changed one of them. Returns "" or the
    // reason to fence (final: a regression of the placement). Empty: the placement keys are ignored.
    std::function<std::string(const std::map<std::string, std::string>& records)> on_placement;
    // etcd cluster ID seen at registration; 0 adopts the first one seen.
    uint64_t etcd_cluster_id = 0;
    // Called once, on the ViewSync thread, when the guarded registration must be fenced. Must not
    // block on ViewSync.
    std::function<void(const std::string& reason, bool final)> on_fence;
    // Called on the ViewSync thread after each snapshot is installed, before the Watch opens: while
    // it runs the view does not advance. May be empty.
    std::function<void(int64_t revision)> on_installed;
    // Called on the ViewSync thread after a watch broke, before each attempt to catch up (tests change etcd in that
    // gap). May be empty.
    std::function<void()> on_reconnect;
    // Required.
    MetricsRegistry* metrics = nullptr;
  };

  ViewSync(EtcdClient* client, MemberView* view, Options options);
  ViewSync(const ViewSync&) = delete;
  ViewSync& operator=(const ViewSync&) = delete;

  void Run();
  void Stop();
  // Ends the current Watch stream as a broken connection would (tests of the catch-up).
  void BreakWatchForTesting();

  uint64_t snapshots_installed() const { return snapshots_->Value(); }

 private:
  // kBroken: the stream ended (a reconnect: the view catches up from its revision); kInvalidated: the view must be
  // rebuilt from a snapshot (compaction, a malformed record, the line beyond the member limit unknown).
  enum class WatchEnd { kStopped, kFenced, kInvalidated, kBroken };

  // Installs a snapshot and returns its revision. ResourceExhausted on overflow, Aborted when
  // fenced, the etcd error otherwise.
  Result<int64_t> TakeSnapshot();
  WatchEnd WatchFrom(int64_t start_revision);
  // Makes the view complete again after a broken watch without a snapshot, from the records changed since
  // `known` (the revision it was complete at); its revision. FailedPrecondition when that cannot tell (a deletion
  // meanwhile, a record the view did not hold): take a snapshot. Aborted when fenced, the etcd error otherwise.
  Result<int64_t> CatchUp(int64_t known);
  // The own-record checks of a registration's view at `revision` (missing: a lapse; replaced: a fence); false when
  // it fenced.
  bool CheckOwnRecord(const std::optional<Member>& own, int64_t revision);
  // Applies one response; false when the view had to be invalidated or the runtime was fenced.
  bool ApplyResponse(const etcdserverpb::WatchResponse& response);
  // Validates a member key-value; counts and logs a rejected one.
  Result<Member> DecodeMember(std::string_view node_id, const std::string& key, const std::string& value, int64_t lease,
                              int64_t create_revision, int64_t mod_revision);
  bool CheckClusterId(const etcdserverpb::ResponseHeader& header);
  void Invalidate(const char* reason);
  void SetMemberGauges();
  // After a snapshot or a catch-up installed the view at `revision`: sets the gauges.
  void Installed(int64_t revision);
  void Fence(const std::string& reason, bool final);
  // Waits for `delay` or Stop(); false when stopping.
  bool WaitFor(std::chrono::milliseconds delay);
  bool stopping() const;

  // Immutable after construction.
  EtcdClient* const client_;
  MemberView* const view_;
  const Options options_;
  const std::string range_begin_;
  const std::string range_end_;
  const std::string members_prefix_;
  const std::string cluster_prefix_;
  Counter* snapshots_;
  Counter* catch_ups_;
  Counter* rejected_malformed_;
  Counter* rejected_oversized_;
  Gauge* complete_gauge_;
  Gauge* revision_gauge_;
  Gauge* members_gauge_;
  Gauge* waiting_gauge_;
  MetricsRegistry* metrics_;

  // Whether `key` is one of the placement records (and its name under the cluster prefix).
  std::optional<std::string> PlacementRecordName(const std::string& key) const;
  // Hands the placement records to on_placement; false when it fenced.
  bool DeliverPlacement();

  // Owned by the Run() thread.
  std::map<std::string, std::string> placement_records_;
  uint64_t cluster_id_ = 0;
  bool fenced_ = false;

  mutable Mutex mu_;
  std::condition_variable_any wake_;
  // Guarded by mu_.
  bool stopping_ GUARDED_BY(mu_) = false;
  // The stream Run() is reading, so that Stop() can cancel it.
  std::function<void()> cancel_active_ GUARDED_BY(mu_);
  bool break_next_watch_ GUARDED_BY(mu_) = false;  // BreakWatchForTesting between two watches
};

}  // namespace orbitkv::cluster

#endif  // ORBITKV_CLUSTER_VIEW_SYNC_H_
