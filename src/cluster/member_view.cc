#include "cluster/member_view.h"

#include <fmt/format.h>

#include <algorithm>

namespace orbitkv::cluster {

int64_t MemberView::revision() const {
  MutexLock lock(&mu_);
  return revision_;
}

size_t MemberView::size() const {
  MutexLock lock(&mu_);
  return members_.size();
}

Result<Member> MemberView::Find(std::string_view node_id) const {
  MutexLock lock(&mu_);
  if (!complete_.load(std::memory_order_relaxed)) {
    return Status::Unavailable("member view is incomplete (etcd snapshot pending)")
        .WithReason(StatusReason::kViewIncomplete);
  }
  auto it = members_.find(node_id);
  if (it == members_.end()) {
    return Status::NotFound(fmt::format("node '{}' is not a live member at revision {}", node_id, revision_));
  }
  return it->second;
}

MemberView::Snapshot MemberView::Read() const {
  MutexLock lock(&mu_);
  Snapshot snapshot;
  snapshot.complete = complete_.load(std::memory_order_relaxed);
  snapshot.revision = revision_;
  snapshot.generation = generation_;
  snapshot.members.reserve(members_.size());
  for (const auto& [id, member] : members_) snapshot.members.push_back(member);
  return snapshot;
}

void MemberView::Install(std::map<std::string, Member> members, int64_t revision) {
  std::map<std::string, Member, std::less<>> sorted(std::make_move_iterator(members.begin()),
                                                    std::make_move_iterator(members.end()));
  MutexLock lock(&mu_);
  members_.swap(sorted);
  revision_ = revision;
  ++generation_;
  complete_.store(true, std::memory_order_release);
}

void MemberView::Invalidate() {
  MutexLock lock(&mu_);
  ++generation_;
  complete_.store(false, std::memory_order_release);
}

bool MemberView::Apply(const std::vector<Change>& changes, int64_t revision) {
  // One response may carry several revisions of one key; only the last state of each key counts.
  std::map<std::string_view, const std::optional<Member>*> last;
  for (const auto& [id, member] : changes) last[id] = &member;
  MutexLock lock(&mu_);
  size_t added = 0;
  size_t removed = 0;
  for (const auto& [id, member] : last) {
    const bool present = members_.find(id) != members_.end();
    if (member->has_value() && !present) ++added;
    if (!member->has_value() && present) ++removed;
  }
  if (members_.size() + added - removed > kMaxMembers) return false;
  for (const auto& [id, member] : last) {
    if (member->has_value()) {
      members_.insert_or_assign(std::string(id), **member);
    } else if (auto it = members_.find(id); it != members_.end()) {
      members_.erase(it);
    }
  }
  revision_ = std::max(revision_, revision);
  ++generation_;
  return true;
}

}  // namespace orbitkv::cluster
