// MemberView: a Manager's cached view of the live members of its cluster, read without any etcd
// call.
//
// The view is filled by ViewSync (view_sync.h) on its own thread: a snapshot installs a whole new
// member set at one etcd revision, Watch events then update it, and anything that makes the cache
// doubtful (a broken stream, compaction, a malformed record) invalidates it until the next snapshot is
// installed. Readers on the cache-operation path ask complete() before starting remote work and Find() to
// resolve a Node ID to its endpoint and runtime UUID; both take only an in-process lock.
//
// The member limit (seed 000: 4,096) holds for everyone, and deterministically: the `limit` oldest
// registrations (the lowest etcd create revisions of member records, ties by Node ID) count; every Manager reads
// the same records at the same revisions, so every Manager counts the same ones. A registration beyond them waits
// in line: Find() does not resolve it, PlaceOf() says how far back it stands, and the oldest waiting one is
// counted as soon as a counted one leaves. The line itself is bounded: at most `limit` waiting records are held
// (the oldest); a younger one is dropped and remembered as dropped, and should a counted member leave when no
// held one waits, Apply() asks for a fresh snapshot. So the view holds at most 2 x limit records (2 x 4,096 x at
// most 1 KiB), and one member too many never makes the view incomplete (it used to overflow it, for everyone).
//
// Invariant: complete() implies the contents equal the member records in etcd at revision() (plus
// Watch events up to it), split as above: size() <= limit, waiting non-empty only when size() == limit.
//
// Thread safety: all methods are safe from any thread. Writers (Install, Invalidate, Apply) are
// called by one ViewSync thread.
#ifndef ORBITKV_CLUSTER_MEMBER_VIEW_H_
#define ORBITKV_CLUSTER_MEMBER_VIEW_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/mutex.h"
#include "base/result.h"
#include "base/thread_annotations.h"
#include "cluster/member_record.h"

namespace orbitkv::cluster {

class MemberView {
 public:
  struct Snapshot {
    bool complete = false;
    int64_t revision = 0;
    // Bumped by every install, invalidation and applied change.
    uint64_t generation = 0;
    std::vector<Member> members;   // The counted ones, sorted by Node ID.
    size_t waiting = 0;            // Registrations beyond the limit held in line (not counting dropped ones).
    bool waiting_dropped = false;  // Some younger ones beyond even that were dropped.
    size_t limit = 0;
  };
  // One Watch-driven change: a member record put (value) or deleted (nullopt).
  using Change = std::pair<std::string, std::optional<Member>>;
  // Where a registration stands: counted, waiting beyond the limit (position 1 is the next to be counted), or
  // not in the view (absent, or dropped from a full line).
  enum class Standing { kAbsent, kCounted, kWaiting };
  struct Place {
    Standing standing = Standing::kAbsent;
    size_t position = 0;  // 1-based, among the waiting
  };

  // `limit`: the member limit (kMaxMembers; tests lower it). `self`: the Node ID of the Manager whose view this is
  // ("" for an observer), so that SelfCounted() answers without a lock.
  explicit MemberView(size_t limit = kMaxMembers, std::string self = "");
  MemberView(const MemberView&) = delete;
  MemberView& operator=(const MemberView&) = delete;

  // Acquire: pairs with the release store in Install/Invalidate, so a reader that sees true also
  // sees the members installed with it (through the lock in Find).
  bool complete() const { return complete_.load(std::memory_order_acquire); }
  int64_t revision() const;
  // Counted members.
  size_t size() const;
  size_t limit() const { return limit_; }
  // The counted member registered under `node_id`: NotFound when absent or beyond the limit (the message says
  // which), Unavailable when the view is incomplete.
  Result<Member> Find(std::string_view node_id) const;
  Place PlaceOf(std::string_view node_id) const;
  // Whether `self` is among the counted (PlaceOf(self) is kCounted), lock-free for the cache-operation path.
  bool SelfCounted() const { return self_counted_.load(std::memory_order_acquire); }
  Snapshot Read() const;
  // Snapshot::generation without the copy: a reader that caches what it derived from a Read asks this first.
  uint64_t generation() const;
  // Every record held (counted and waiting), by Node ID; nullopt when some were dropped from a full line (the view
  // does not hold every record).
  std::optional<std::map<std::string, Member>> Held() const;

  // --- Writer side (ViewSync)
  // --------------------------------------------------------------------------------
  // Installs every valid record of a snapshot (at most 2 x limit of them: ViewSync drops the youngest beyond that
  // while paging, and `dropped_min` is the oldest it dropped), split into counted and waiting.
  void Install(std::map<std::string, Member> members, int64_t revision,
               std::optional<std::pair<int64_t, std::string>> dropped_min = std::nullopt);
  // Marks the view incomplete; contents stay for status display but Find() refuses them.
  void Invalidate();
  // Applies one Watch response's changes atomically. False when a counted member left and the one next in line
  // is not known (it was dropped from a full line): the view is then incomplete, and the caller takes a fresh
  // snapshot.
  bool Apply(const std::vector<Change>& changes, int64_t revision);

 private:
  using Order = std::pair<int64_t, std::string>;  // (create revision, Node ID): older first
  static Order OrderOf(const Member& m) { return {m.create_revision, m.record.node_id}; }
  // Whether `m` (held) is among the counted: at or before the limit-th oldest held record.
  bool CountedLocked(const Member& m) const REQUIRES(mu_);
  // Recomputes cutoff_ after a change, dropping the youngest beyond 2 x limit. False when a dropped record might
  // now be among the counted (the caller then marks the view incomplete).
  bool Settle() REQUIRES(mu_);

  const size_t limit_;
  const std::string self_;
  mutable Mutex mu_;
  // Every held record (counted and waiting), by Node ID, and their order.
  std::map<std::string, Member, std::less<>> all_ GUARDED_BY(mu_);
  std::set<Order> order_ GUARDED_BY(mu_);
  // The limit-th oldest held record (the youngest counted one); meaningless while all_ is empty.
  Order cutoff_ GUARDED_BY(mu_);
  // The oldest record dropped from a full line since the last snapshot, if any.
  std::optional<Order> dropped_min_ GUARDED_BY(mu_);
  int64_t revision_ GUARDED_BY(mu_) = 0;
  uint64_t generation_ GUARDED_BY(mu_) = 0;
  // Written under mu_; read without it on the fast path (see complete()).
  std::atomic<bool> complete_{false};
  std::atomic<bool> self_counted_{false};  // likewise (SelfCounted())
};

}  // namespace orbitkv::cluster

#endif  // ORBITKV_CLUSTER_MEMBER_VIEW_H_
