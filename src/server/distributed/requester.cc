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
      releases_(catalog::ReleaseQueue::Options{}, &transport_),
      fetch_workers_(config.remote_fetch_workers) {
  catalog::Discovery::Options discovery;
  discovery.max_hosts = config.discovery_max_hosts;
  discovery.hedge_after = std::chrono::milliseconds(config.discovery_hedge_ms);
  // A shard's copies are tried one after another, the rotation spreading requesters over them; while the placement
  // changes, a moving shard's new copies come after its committed ones.
  discovery.committed_copies_of = [live = parts.live](const state::StateKey& key) {
    return live->Get()->committed.CopiesOf(state::ShardOf(key, cluster::kNumShards)).size();
  };
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
}

Requester::~Requester() {
  fetcher_->Stop();
  releases_.Stop();  // after the fetches: their last releases are queued
}

void Requester::OnRegistered(const catalog::PeerIdentity& self) {
  transport_.SetSelf(self);
  index_.Clear();
  discovery_->ResetBreakers();
}

void Requester::VisitStats(StatsVisitor& v) const {
  fetcher_->VisitStats(v);
  const catalog::CandidateIndex::Stats i = index_.GetStats();
  v.Gauge("candidate_index_entries", static_cast<int64_t>(i.entries),
          {"orbitkv_candidate_index_entries", "Blocks the candidate index knows holders of"});
  v.Gauge("candidate_index_bytes", static_cast<int64_t>(i.bytes),
          {"orbitkv_candidate_index_bytes", "Logical bytes of the candidate index (of its 16 MiB budget)"});
  v.Gauge("candidate_index_hits", static_cast<int64_t>(i.hits),
          {"orbitkv_candidate_index_hits", "Candidate index reads that found a fresh holder (since start)"});
  v.Gauge(
      "candidate_index_misses", static_cast<int64_t>(i.misses),
      {"orbitkv_candidate_index_misses", "Candidate index reads that found none, or only expired ones (since start)"});
  releases_.VisitStats(v);
  const catalog::Discovery::Stats d = discovery_->GetStats();
  v.Counter("discovery_skipped_hosts", d.skipped_hosts);
  v.Counter("discovery_failed_hosts", d.failed_hosts);
  v.Counter("discovery_coalesced", d.coalesced);
  v.Gauge("discovery_max_hosts_in_flight", static_cast<int64_t>(d.max_hosts_in_flight));
  v.Counter("discovery_refused_hosts", d.refused_hosts);
  v.Counter("discovery_failovers", d.failovers);
  v.Counter("discovery_hedges", d.hedges);
  v.Gauge("remote_fetch_workers", static_cast<int64_t>(fetch_workers_));
}

}  // namespace orbitkv::server
