#include "core/read_coalescer.h"

#include <utility>

#include "base/check.h"

namespace orbitkv::core {

ReadCoalescer::ReadCoalescer(MetricsRegistry* metrics) {
  ORBITKV_CHECK(metrics != nullptr);
  shared_total_ = &metrics->GetCounter("orbitkv_cache_coalesced_reads_total",
                                       "Requests served by joining a backing read already in flight");
}

ReadCoalescer::~ReadCoalescer() {
  MutexLock lock(&mu_);
  ORBITKV_CHECK_MSG(reads_.empty(), "{} coalesced reads never completed", reads_.size());
}

bool ReadCoalescer::Join(const state::StateKey& key, Waiter waiter) {
  MutexLock lock(&mu_);
  auto [it, inserted] = reads_.try_emplace(key);
  it->second.push_back(std::move(waiter));
  if (!inserted) shared_total_->Increment();
  return inserted;
}

void ReadCoalescer::Complete(const state::StateKey& key, const Status& status) {
  std::vector<Waiter> waiters;
  {
    MutexLock lock(&mu_);
    auto it = reads_.find(key);
    ORBITKV_CHECK_MSG(it != reads_.end(), "Complete of {} with no read in flight", key.ToString());
    waiters = std::move(it->second);
    reads_.erase(it);
  }
  for (Waiter& waiter : waiters) waiter(status);
}

size_t ReadCoalescer::in_flight() const {
  MutexLock lock(&mu_);
  return reads_.size();
}

}  // namespace orbitkv::core
