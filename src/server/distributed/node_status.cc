// The distributed figures, each visited once from the part that keeps it: `orbitkv stats --json` writes them with a
// JsonStatsWriter, the metrics endpoint reads those that name a metric through the collector NodeParts registers.
#include "server/distributed/node_parts.h"

#include "cluster/etcd_client.h"
#include "server/distributed/node_identity.h"

namespace orbitkv::server {

bool NodeParts::CanDoRemoteWork() const {
  return membership != nullptr && membership->CanDoRemoteWork() &&
         (peers == nullptr || peers->directory().incompatibility().empty());
}

void NodeParts::VisitStats(StatsVisitor& v) const {
  const cluster::MembershipStatus status = membership->GetStatus();
  v.Text("membership", cluster::MembershipStateName(status.state));
  v.Gauge("membership_epoch", status.self.epoch);
  v.Gauge("remote_work", CanDoRemoteWork() ? 1 : 0);
  v.Gauge("view_revision", status.view.revision);
  v.Gauge("members", static_cast<int64_t>(status.view.members.size()));
  v.Real("membership_for_s", static_cast<double>(status.since.count()) / 1000, 1);
  v.Text("membership_reason", status.reason);
  v.Text("membership_last_cause", status.last_cause);
  v.Counter("membership_registrations", static_cast<uint64_t>(status.registrations));
  v.Counter("membership_attempts", static_cast<uint64_t>(status.attempts));
  v.Text("membership_last_error", status.last_error);
  v.Text("cluster_runtime_uuid", status.self.runtime_uuid);
  v.Text("membership_off_reason", RemoteOffReason(*membership));
  const cluster::Placement placement = membership->placement();
  v.Text("placement_fingerprint", placement.fingerprint());
  v.Gauge("catalog_replicas", placement.replicas());
  v.Gauge("catalog_reduced_coverage", placement.reduced_coverage() ? 1 : 0);
  v.Text("peer_listen", peers ? peers->address() : "");
  v.Counter("peer_refused", peers ? peers->service().refused() : 0);
  v.Gauge("peer_tls", peers != nullptr && peers->tls() ? 1 : 0);
  v.Counter("peer_refused_certificate_without_node", peers ? peers->service().refused_certificate_without_node() : 0);
  v.Counter("peer_refused_certificate_of_another_node",
            peers ? peers->service().refused_certificate_of_another_node() : 0);
  if (peers) peers->directory().VisitStats(v);
  if (!placement_driver) v.Gauge("placement_generation", placement.generation());
  VisitExported(v);
  if (transfer) {
    const auto stats = transfer->Stats();
    v.Text("transfer_listen", transfer->ListenAddress());
    v.Gauge("transfer_grants", static_cast<int64_t>(stats.live_grants));
    v.Counter("transfer_grant_secret_refusals", stats.grant_secret_refusals);
  } else {
    v.Text("transfer_listen", "");
  }
  // How etcd is reached: "etcd_tls" (0: plaintext, 1: TLS verifying etcd, 2: and a client certificate), "etcd_user"
  // (empty: no user auth) and the tokens obtained so far.
  cluster::EtcdClient& etcd = membership->etcd();
  v.Gauge("etcd_tls", etcd.tls() ? (etcd.client_certificate() ? 2 : 1) : 0);
  v.Text("etcd_user", etcd.options().user);
  v.Counter("etcd_auth_tokens", etcd.tokens_obtained());
}

void NodeParts::VisitExported(StatsVisitor& v) const {
  if (placement_driver) placement_driver->VisitStats(v);
  if (catalog) catalog->VisitStats(v);
  if (requester) requester->VisitStats(v);
  if (source) source->VisitStats(v);
}

std::string NodeStatusJson(const NodeParts& parts) {
  JsonStatsWriter json;
  parts.VisitStats(json);
  return json.json();
}

}  // namespace orbitkv::server
