// The distributed fields of `orbitkv stats --json`, from the parts' own stats.
#include "server/distributed/node_parts.h"

#include "base/json_text.h"
#include "cluster/etcd_client.h"
#include "fmt/format.h"
#include "server/distributed/node_identity.h"

namespace orbitkv::server {
namespace {

// How etcd is reached: "etcd_tls" (0: plaintext, 1: TLS verifying etcd, 2: and a client certificate), "etcd_user"
// (empty: no user auth) and the tokens obtained so far.
std::string EtcdSecurityJson(cluster::EtcdClient& etcd) {
  return fmt::format(", \"etcd_tls\": {}, \"etcd_user\": \"{}\", \"etcd_auth_tokens\": {}",
                     etcd.tls() ? (etcd.client_certificate() ? 2 : 1) : 0, JsonText(etcd.options().user),
                     etcd.tokens_obtained());
}

std::string CatalogJson(const CatalogHost& catalog) {
  const CatalogHost::Summary s = catalog.Summarize();
  return fmt::format(", \"catalog_shards_hosted\": {}, \"catalog_records\": {}, \"catalog_bytes\": {}, "
                     "\"catalog_incomplete_shards\": {}, \"catalog_incomplete_shard_ms\": {}, \"catalog_streams\": {}, "
                     "\"catalog_streams_streaming\": {}, \"catalog_streams_converged\": {}, "
                     "\"catalog_stream_snapshots\": {}, \"inventory_records\": {}, \"catalog_stream_bytes_sent\": {}",
                     s.hosted, s.records, s.bytes, s.incomplete, s.incomplete_shard_ms, s.streams, s.streaming,
                     s.converged, s.snapshots, s.inventory_records, s.stream_bytes);
}

std::string RemoteJson(const Requester& requester, const Source& source) {
  const Requester::Stats r = requester.GetStats();
  const RemoteFetcher::Stats& f = r.fetch;
  const catalog::CandidateIndex::Stats& i = r.index;
  const catalog::Discovery::Stats& d = r.discovery;
  const catalog::ReleaseQueue::Stats& q = r.releases;
  const catalog::SourceHolds::Stats h = source.GetStats();
  return fmt::format(", \"remote_fetches\": {}, \"remote_fetched_blocks\": {}, \"remote_fetched_bytes\": {}, "
                     "\"remote_no_source\": {}, \"remote_fetch_failures\": {}, \"remote_staging_bytes\": {}, "
                     "\"discovery_rpcs\": {}, \"source_authorizations\": {}, \"candidate_rejections\": {}, "
                     "\"candidate_index_entries\": {}, \"candidate_index_bytes\": {}, \"candidate_index_hits\": {}, "
                     "\"candidate_index_misses\": {}, \"source_sessions\": {}, \"source_pinned_bytes\": {}, "
                     "\"source_quarantined_bytes\": {}, \"source_grants\": {}, \"source_rejections\": {}",
                     f.fetches, f.fetched_blocks, f.fetched_bytes, f.no_source, f.failed, f.staging_bytes,
                     f.discovery_rpcs, f.authorizations, f.rejections, i.entries, i.bytes, i.hits, i.misses,
                     h.sessions, h.pinned_bytes, h.quarantined_bytes, h.granted, h.rejected) +
         fmt::format(", \"source_release_secret_refusals\": {}", h.release_secret_refusals) +
         fmt::format(", \"source_ssd_preparations\": {}, \"source_ssd_preparing\": {}, \"source_ssd_granted\": {}, "
                     "\"source_ssd_backpressure\": {}, \"source_ssd_missing\": {}, \"source_ssd_prepared_blocks\": {}, "
                     "\"source_ssd_prepared_bytes\": {}, \"source_ssd_staging_bytes\": {}, "
                     "\"remote_ssd_fetched_blocks\": {}, \"remote_authorize_polls\": {}, "
                     "\"remote_ssd_backpressure\": {}, \"remote_ssd_missing\": {}",
                     h.ssd_preparations, h.ssd_preparing, h.ssd_granted, h.ssd_backpressure, h.ssd_missing,
                     h.ssd_prepared_blocks, h.ssd_prepared_bytes, h.ssd_staging_bytes, f.fetched_ssd_blocks,
                     f.authorize_polls, f.source_backpressure, f.source_missing) +
         fmt::format(", \"remote_releases_queued\": {}, \"remote_releases_released\": {}, "
                     "\"remote_releases_not_held\": {}, \"remote_releases_retries\": {}, "
                     "\"remote_releases_abandoned\": {}, \"remote_releases_pending\": {}",
                     q.queued, q.released, q.not_held, q.retries, q.abandoned, q.pending) +
         fmt::format(", \"discovery_skipped_hosts\": {}, \"discovery_failed_hosts\": {}, "
                     "\"discovery_coalesced\": {}, \"discovery_max_hosts_in_flight\": {}, "
                     "\"discovery_refused_hosts\": {}, \"discovery_failovers\": {}, \"discovery_hedges\": {}, "
                     "\"remote_fetches_shared\": {}, \"remote_fetch_seconds\": {:.6f}, "
                     "\"remote_sources_skipped\": {}, \"remote_fetch_workers\": {}",
                     d.skipped_hosts, d.failed_hosts, d.coalesced, d.max_hosts_in_flight, d.refused_hosts,
                     d.failovers, d.hedges, f.shared, f.fetch_seconds, f.sources_skipped, r.fetch_workers);
}

}  // namespace

bool NodeParts::CanDoRemoteWork() const {
  return membership != nullptr && membership->CanDoRemoteWork() &&
         (peers == nullptr || peers->directory().incompatibility().empty());
}

std::string NodeStatusJson(const NodeParts& parts) {
  const cluster::Membership& membership = *parts.membership;
  const cluster::MembershipStatus status = membership.GetStatus();
  const PeerListener* peers = parts.peers.get();
  const cluster::Placement placement = membership.placement();
  return fmt::format(", \"membership\": \"{}\", \"membership_epoch\": {}, \"remote_work\": {}, "
                     "\"view_revision\": {}, \"members\": {}",
                     cluster::MembershipStateName(status.state), status.self.epoch, parts.CanDoRemoteWork() ? 1 : 0,
                     status.view.revision, status.view.members.size()) +
         fmt::format(", \"membership_for_s\": {:.1f}, \"membership_reason\": \"{}\", "
                     "\"membership_last_cause\": \"{}\", \"membership_registrations\": {}, "
                     "\"membership_attempts\": {}, \"membership_last_error\": \"{}\", "
                     "\"cluster_runtime_uuid\": \"{}\", \"membership_off_reason\": \"{}\"",
                     static_cast<double>(status.since.count()) / 1000, JsonText(status.reason),
                     JsonText(status.last_cause), status.registrations, status.attempts, JsonText(status.last_error),
                     status.self.runtime_uuid, JsonText(RemoteOffReason(membership))) +
         fmt::format(", \"placement_fingerprint\": \"{}\", \"catalog_replicas\": {}, "
                     "\"catalog_reduced_coverage\": {}, \"peer_listen\": \"{}\", \"peer_refused\": {}",
                     placement.fingerprint(), placement.replicas(), placement.reduced_coverage() ? 1 : 0,
                     peers ? peers->address() : "", peers ? peers->service().refused() : 0) +
         fmt::format(", \"peer_tls\": {}", peers != nullptr && peers->tls() ? 1 : 0) +
         fmt::format(", \"peer_refused_certificate_without_node\": {}, "
                     "\"peer_refused_certificate_of_another_node\": {}",
                     peers ? peers->service().refused_certificate_without_node() : 0,
                     peers ? peers->service().refused_certificate_of_another_node() : 0) +
         (peers ? peers->directory().StatusJson() : std::string()) +
         (parts.placement ? parts.placement->StatusJson()
                          : fmt::format(", \"placement_generation\": {}", placement.generation())) +
         (parts.catalog ? CatalogJson(*parts.catalog) : std::string()) +
         (parts.requester && parts.source ? RemoteJson(*parts.requester, *parts.source) : std::string()) +
         (parts.transfer ? fmt::format(", \"transfer_listen\": \"{}\", \"transfer_grants\": {}, "
                                       "\"transfer_grant_secret_refusals\": {}",
                                       parts.transfer->ListenAddress(), parts.transfer->Stats().live_grants,
                                       parts.transfer->Stats().grant_secret_refusals)
                         : std::string(", \"transfer_listen\": \"\"")) +
         EtcdSecurityJson(parts.membership->etcd());
}

}  // namespace orbitkv::server
