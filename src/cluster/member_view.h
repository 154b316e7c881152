// MemberView: a Manager's cached view of the live members of its cluster, read without any etcd
// call.
//
// The view is filled by ViewSync (view_sync.h) on its own thread: a snapshot installs a whole new
// member set at one etcd revision, Watch events then update it, and anything that makes the cache
// doubtful (a broken stream, compaction, a malformed record, overflow) invalidates it until the
// next snapshot is installed. Readers on the cache-operation path ask complete() before starting
// remote work and Find() to resolve a Node ID to its endpoint and runtime UUID; both take only an
// in-process lock.
//
// Invariant: complete() implies the contents equal the member records in etcd at revision() (plus
// Watch events up to it), and size() <= kMaxMembers.
//
// Thread safety: all methods are safe from any thread. Writers (Install, Invalidate, Apply) are
// called by one ViewSync thread.
#ifndef ORBITKV_CLUSTER_MEMBER_VIEW_H_
#define ORBITKV_CLUSTER_MEMBER_VIEW_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <optional>
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
    std::vector<Member> members;  // Sorted by Node ID.
  };
  // One Watch-driven change: a member record put (value) or deleted (nullopt).
  using Change = std::pair<std::string, std::optional<Member>>;

  MemberView() = default;
  MemberView(const MemberView&) = delete;
  MemberView& operator=(const MemberView&) = delete;

  // Acquire: pairs with the release store in Install/Invalidate, so a reader that sees true also
  // sees the members installed with it (through the lock in Find).
  bool complete() const { return complete_.load(std::memory_order_acquire); }
  int64_t revision() const;
  size_t size() const;
  // The member registered under `node_id`: NotFound when absent, Unavailable when the view is
  // incomplete.
  Result<Member> Find(std::string_view node_id) const;
  Snapshot Read() const;

  // --- Writer side (ViewSync)
  // --------------------------------------------------------------------------------
  void Install(std::map<std::string, Member> members, int64_t revision);
  // Marks the view incomplete; contents stay for status display but Find() refuses them.
  void Invalidate();
  // Applies one Watch response's changes atomically. False (and nothing applied) when the result
  // would exceed kMaxMembers; the caller then invalidates.
  bool Apply(const std::vector<Change>& changes, int64_t revision);

 private:
  mutable Mutex mu_;
  // Guarded by mu_.
  std::map<std::string, Member, std::less<>> members_ GUARDED_BY(mu_);
  int64_t revision_ GUARDED_BY(mu_) = 0;
  uint64_t generation_ GUARDED_BY(mu_) = 0;
  // Written under mu_; read without it on the fast path (see complete()).
  std::atomic<bool> complete_{false};
};

}  // namespace orbitkv::cluster

#endif  // ORBITKV_CLUSTER_MEMBER_VIEW_H_
