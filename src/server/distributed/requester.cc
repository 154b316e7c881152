#include "server/distributed/requester.h"

#include <chrono>
#include <string>
#include <utility>

#include "cluster/placement.h"
#include "state/state_key.h"

namespace orbitkv::server {

Requester::Requester(const ManagerConfig& config, Parts parts, MetricsRegistry* metrics)
    : index_(catalog::CandidateIndex::Options{.budget_bytes = 16ull << 20,
                                              .ttl = std::chrono::milliseconds(config.candidate_ttl_ms)}),
      transport_(std::move(parts.self), parts.view, std::move(parts.credentials)),
      releases_(catalog::ReleaseQueue::Options{}, &transport_, metrics),
      fetch_workers_(config.remote_fetch_workers) {
  catalog::Discovery::Options discovery;
  discovery.max_hosts = config.discovery_max_hosts;
  discovery.hedge_after = std::chrono::milliseconds(config.discovery_hedge_ms);
  // A shard's copies are tried one after another, the rotation spreading requesters over them; while the placement
  // changes, a moving shard's new copies come after its committed ones.
  discovery.copies_of = [live = parts.live](const state::StateKey& key) {
    return live->Get()->QueryCopies(state::ShardOf(key, cluster::kNumShards));
  };
  discovery.rotation = std::hash<std::string>{}(config.node_id);
  discovery.shard_of = [](const state::StateKey& key) { return state::ShardOf(key, cluster::kNumShards); };
  discovery_ = std::make_unique<catalog::Discovery>(std::move(discovery), &index_, &transport_);
  RemoteFetcher::Options fetch;
  fetch.self_node = config.node_id;
  fetch.deadline = std::chrono::milliseconds(config.remote_fetch_deadline_ms);
  fetch.threads = config.remote_fetch_workers;
  fetch.staging_budget_bytes = config.remote_staging_budget_bytes;
  fetch.can_work = std::move(parts.can_work);
  // Authorizations go straight to the peers; releases through the release queue's own workers.
  fetcher_ = std::make_unique<RemoteFetcher>(std::move(fetch), parts.cache, &index_, discovery_.get(), &releases_,
                                             parts.engine, std::move(parts.arenas), metrics);
  index_entries_ = &metrics->GetGauge("orbitkv_candidate_index_entries", "Blocks the candidate index knows holders of");
  index_bytes_ = &metrics->GetGauge("orbitkv_candidate_index_bytes",
                                    "Logical bytes of the candidate index (of its 16 MiB budget)");
  index_hits_ = &metrics->GetGauge("orbitkv_candidate_index_hits",
                                   "Candidate index reads that found a fresh holder (since start)");
  index_misses_ = &metrics->GetGauge("orbitkv_candidate_index_misses",
                                     "Candidate index reads that found none, or only expired ones (since start)");
  staging_bytes_ = &metrics->GetGauge("orbitkv_remote_staging_bytes",
                                      "Pool bytes of blocks being fetched from peers, not sealed yet");
  gauges_ = std::thread([this] {
    while (!stop_.load(std::memory_order_acquire)) {
      RefreshGauges();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  });
}

Requester::~Requester() {
  fetcher_->Stop();
  releases_.Stop();  // after the fetches: their last releases are queued
  stop_.store(true, std::memory_order_release);
  if (gauges_.joinable()) gauges_.join();
}

void Requester::OnRegistered(const catalog::PeerIdentity& self) {
  transport_.SetSelf(self);
  index_.Clear();
  discovery_->ResetBreakers();
}

Requester::Stats Requester::GetStats() const {
  return Stats{fetcher_->GetStats(), index_.GetStats(), discovery_->GetStats(), releases_.GetStats(), fetch_workers_};
}

void Requester::RefreshGauges() {
  const catalog::CandidateIndex::Stats i = index_.GetStats();
  index_entries_->Set(static_cast<int64_t>(i.entries));
  index_bytes_->Set(static_cast<int64_t>(i.bytes));
  index_hits_->Set(static_cast<int64_t>(i.hits));
  index_misses_->Set(static_cast<int64_t>(i.misses));
  staging_bytes_->Set(static_cast<int64_t>(fetcher_->GetStats().staging_bytes));
}

}  // namespace orbitkv::server
