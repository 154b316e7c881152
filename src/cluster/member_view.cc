#include "cluster/member_view.h"

#include <fmt/format.h>

#include <algorithm>
#include <iterator>

#include "base/check.h"

namespace orbitkv::cluster {

MemberView::MemberView(size_t limit, std::string self) : limit_(limit), self_(std::move(self)) {
  ORBITKV_CHECK(limit >= 1);
}

int64_t MemberView::revision() const {
  MutexLock lock(&mu_);
  return revision_;
}

uint64_t MemberView::generation() const {
  MutexLock lock(&mu_);
  return generation_;
}

size_t MemberView::size() const {
  MutexLock lock(&mu_);
  return std::min(all_.size(), limit_);
}

bool MemberView::CountedLocked(const Member& m) const { return !(cutoff_ < OrderOf(m)); }

Result<Member> MemberView::Find(std::string_view node_id) const {
  MutexLock lock(&mu_);
  if (!complete_.load(std::memory_order_relaxed)) {
    return Status::Unavailable("member view is incomplete (etcd snapshot pending)")
        .WithReason(StatusReason::kViewIncomplete);
  }
  auto it = all_.find(node_id);
  if (it == all_.end()) {
    return Status::NotFound(fmt::format("node '{}' is not a live member at revision {}", node_id, revision_));
  }
  if (!CountedLocked(it->second)) {
    return Status::NotFound(
        fmt::format("node '{}' is registered beyond the member limit of {} at revision {} (the {} "
                    "oldest registrations count; it waits for one of them to leave)",
                    node_id, limit_, revision_, limit_));
  }
  return it->second;
}

MemberView::Place MemberView::PlaceOf(std::string_view node_id) const {
  MutexLock lock(&mu_);
  auto it = all_.find(node_id);
  if (it == all_.end()) return Place{};
  if (CountedLocked(it->second)) return Place{Standing::kCounted, 0};
  const auto at = order_.find(OrderOf(it->second));
  return Place{Standing::kWaiting, static_cast<size_t>(std::distance(order_.begin(), at)) - limit_ + 1};
}

MemberView::Snapshot MemberView::Read() const {
  MutexLock lock(&mu_);
  Snapshot snapshot;
  snapshot.complete = complete_.load(std::memory_order_relaxed);
  snapshot.revision = revision_;
  snapshot.generation = generation_;
  snapshot.limit = limit_;
  snapshot.members.reserve(std::min(all_.size(), limit_));
  for (const auto& [id, member] : all_) {
    if (CountedLocked(member)) snapshot.members.push_back(member);
  }
  snapshot.waiting = all_.size() - snapshot.members.size();
  snapshot.waiting_dropped = dropped_min_.has_value();
  return snapshot;
}

std::optional<std::map<std::string, Member>> MemberView::Held() const {
  MutexLock lock(&mu_);
  if (dropped_min_.has_value()) return std::nullopt;
  return std::map<std::string, Member>(all_.begin(), all_.end());
}

bool MemberView::Settle() {
  while (all_.size() > 2 * limit_) {
    const Order youngest = *order_.rbegin();
    order_.erase(std::prev(order_.end()));
    all_.erase(youngest.second);
    if (!dropped_min_.has_value() || youngest < *dropped_min_) dropped_min_ = youngest;
  }
  if (order_.empty()) {
    cutoff_ = Order{};
  } else {
    cutoff_ = order_.size() <= limit_ ? *order_.rbegin() : *std::next(order_.begin(), static_cast<long>(limit_ - 1));
  }
  const auto self = self_.empty() ? all_.end() : all_.find(self_);
  self_counted_.store(self != all_.end() && CountedLocked(self->second), std::memory_order_release);
  // A dropped record older than the youngest counted one, or missing from a count below the limit, would be
  // counted: the view cannot say who is.
  if (!dropped_min_.has_value()) return true;
  return order_.size() >= limit_ && cutoff_ < *dropped_min_;
}

void MemberView::Install(std::map<std::string, Member> members, int64_t revision,
                         std::optional<std::pair<int64_t, std::string>> dropped_min) {
  MutexLock lock(&mu_);
  all_.clear();
  order_.clear();
  for (auto& [id, member] : members) {
    order_.insert(OrderOf(member));
    all_.emplace(id, std::move(member));
  }
  dropped_min_ = std::move(dropped_min);
  revision_ = revision;
  ++generation_;
  if (!Settle()) {
    // Only a snapshot of more than 2 x limit records whose oldest dropped one is counted can get here: ViewSync
    // drops the youngest, so it cannot.
    complete_.store(false, std::memory_order_release);
    return;
  }
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
  for (const auto& [id, member] : last) {
    if (auto it = all_.find(id); it != all_.end()) {
      order_.erase(OrderOf(it->second));
      all_.erase(it);
    }
    if (member->has_value()) {
      order_.insert(OrderOf(**member));
      all_.insert_or_assign(std::string(id), **member);
    }
  }
  revision_ = std::max(revision_, revision);
  ++generation_;
  if (!Settle()) {
    complete_.store(false, std::memory_order_release);
    return false;
  }
  return true;
}

}  // namespace orbitkv::cluster
