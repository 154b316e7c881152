#include "catalog/release_queue.h"

#include <fmt/format.h>

#include <algorithm>

#include "base/logging.h"

namespace orbitkv::catalog {

ReleaseQueue::ReleaseQueue(Options options, SourceTransport* inner) : options_(std::move(options)), inner_(inner) {
  for (size_t i = 0; i < std::max<size_t>(options_.workers, 1); ++i) {
    workers_.emplace_back([this] { Work(); });
  }
}

ReleaseQueue::~ReleaseQueue() { Stop(); }

void ReleaseQueue::Stop() {
  {
    MutexLock lock(&mu_);
    if (stop_) return;
    stop_ = true;
    wake_.notify_all();
  }
  for (std::thread& t : workers_) {
    if (t.joinable()) t.join();
  }
  MutexLock lock(&mu_);
  if (!due_.empty()) {
    ORBITKV_LOG_INFO("remote: {} grant releases not sent at shutdown (the grants expire at their sources)",
                     due_.size());
  }
}

Result<SourceReply> ReleaseQueue::Authorize(const std::string& node, const std::string& runtime, uint64_t request_id,
                                            std::span<const SourceBlockVersion> blocks, uint64_t byte_limit,
                                            std::chrono::milliseconds lifetime, Deadline deadline) {
  return inner_->Authorize(node, runtime, request_id, blocks, byte_limit, lifetime, deadline);
}

Result<bool> ReleaseQueue::Release(const std::string& node, const std::string& runtime, uint64_t request_id,
                                   uint64_t grant_id, const std::string& grant_secret, Deadline /*deadline*/) {
  MutexLock lock(&mu_);
  if (stop_ || due_.size() + sending_ >= options_.max_queued) {
    ++stats_.dropped;
    return Status::ResourceExhausted(
        fmt::format("{} grant releases are waiting already: grant {:x} at '{}' expires there instead",
                    due_.size() + sending_, grant_id, node));
  }
  const MonoTime now = MonoNow();
  due_.emplace(
      now, Item{node, runtime, request_id, grant_id, grant_secret, now + options_.give_up_after, options_.backoff_min});
  ++stats_.queued;
  wake_.notify_one();
  return true;
}

void ReleaseQueue::Work() {
  for (;;) {
    Item item;
    {
      MutexLock lock(&mu_);
      // The earliest due release of a node no other worker is sending to: one unreachable source holds at most
      // one worker (for one RPC timeout at a time), never both.
      for (;;) {
        if (stop_) return;
        const MonoTime now = MonoNow();
        auto next = due_.end();
        MonoTime wait_until = MonoTime::max();
        for (auto it = due_.begin(); it != due_.end(); ++it) {
          if (busy_nodes_.count(it->second.node) != 0) continue;
          if (it->first <= now) {
            next = it;
          } else {
            wait_until = it->first;
          }
          break;
        }
        if (next != due_.end()) {
          item = std::move(next->second);
          due_.erase(next);
          break;
        }
        if (wait_until == MonoTime::max()) {
          wake_.wait(mu_);
        } else {
          wake_.wait_until(mu_, wait_until);  // a copy: another worker may take that item meanwhile
        }
      }
      busy_nodes_.insert(item.node);
      ++sending_;
    }
    Result<bool> answer = inner_->Release(item.node, item.runtime, item.request_id, item.grant_id, item.grant_secret,
                                          Deadline::After(options_.rpc_timeout));
    MutexLock lock(&mu_);
    --sending_;
    busy_nodes_.erase(item.node);
    wake_.notify_all();  // that node's other releases may go now
    const MonoTime now = MonoNow();
    if (answer.ok() || answer.status().code() == StatusCode::kNotFound) {
      const bool held = answer.ok() && *answer;
      ++(held ? stats_.released : stats_.not_held);
    } else if (now + item.backoff >= item.give_up) {
      ++stats_.abandoned;
      ORBITKV_LOG_WARN(
          "remote: releasing grant {:x} at '{}' failed until its lifetime ended ({}); the source "
          "revoked it at its deadline",
          item.grant_id, item.node, answer.status().ToString());
    } else {
      // Jittered to 50-100 % of the backoff, which doubles up to backoff_max.
      std::uniform_int_distribution<int64_t> spread(item.backoff.count() / 2, item.backoff.count());
      const MonoTime next = now + std::chrono::milliseconds(spread(jitter_));
      item.backoff = std::min(item.backoff * 2, options_.backoff_max);
      ++stats_.retries;
      due_.emplace(next, std::move(item));
      wake_.notify_one();
    }
  }
}

ReleaseQueue::Stats ReleaseQueue::GetStats() const {
  MutexLock lock(&mu_);
  Stats stats = stats_;
  stats.pending = due_.size() + sending_;
  return stats;
}

void ReleaseQueue::VisitStats(StatsVisitor& v) const {
  const Stats s = GetStats();
  constexpr std::string_view kName = "orbitkv_remote_releases_total";
  constexpr std::string_view kHelp = "Grant releases this requester sent to sources, by outcome";
  v.Counter("remote_releases_queued", s.queued);
  v.Counter("remote_releases_released", s.released, {kName, kHelp, "outcome", "released"});
  v.Counter("remote_releases_not_held", s.not_held, {kName, kHelp, "outcome", "not_held"});
  v.Counter("remote_releases_retries", s.retries);
  v.Counter("remote_releases_abandoned", s.abandoned, {kName, kHelp, "outcome", "abandoned"});
  v.Counter("", s.dropped, {kName, kHelp, "outcome", "dropped"});
  v.Gauge("remote_releases_pending", static_cast<int64_t>(s.pending),
          {"orbitkv_remote_releases_pending", "Grant releases waiting for their source (queued or being sent)"});
}

}  // namespace orbitkv::catalog
