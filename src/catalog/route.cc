#include "catalog/route.h"

#include <fmt/format.h>

namespace orbitkv::catalog {

peer::v1::RouteHeader MakeRoute(const PeerIdentity& self, const cluster::MemberRecord& destination) {
  peer::v1::RouteHeader route;
  route.set_protocol_version(kPeerProtocolVersion);
  route.set_cluster(self.cluster);
  route.set_placement_fingerprint(self.current_placement ? self.current_placement() : self.placement_fingerprint);
  route.set_destination_node_id(destination.node_id);
  route.set_destination_runtime_uuid(destination.runtime_uuid);
  route.set_source_node_id(self.node_id);
  route.set_source_runtime_uuid(self.runtime_uuid);
  route.set_source_epoch(self.epoch);
  return route;
}

namespace {

// The checks both gates share: protocol version, cluster, destination node, placement.
Status CheckAddress(const peer::v1::RouteHeader& route, const PeerIdentity& self) {
  if (route.protocol_version() != kPeerProtocolVersion) {
    return Status::FailedPrecondition(
               fmt::format("peer protocol version {} from node '{}', this Manager speaks {}: remote "
                           "work between them is off until both run one version",
                           route.protocol_version(), route.source_node_id(), kPeerProtocolVersion))
        .WithReason(StatusReason::kPeerProtocolVersion);
  }
  if (route.cluster() != self.cluster) {
    return Status::PermissionDenied(
        fmt::format("request for cluster '{}', this Manager is in cluster '{}'", route.cluster(), self.cluster));
  }
  if (route.destination_node_id() != self.node_id) {
    return Status::FailedPrecondition(
        fmt::format("request addressed to node '{}', this is node '{}'", route.destination_node_id(), self.node_id));
  }
  const bool accepted = self.accepts_placement ? self.accepts_placement(route.placement_fingerprint())
                                               : route.placement_fingerprint() == self.placement_fingerprint;
  if (!accepted) {
    return Status::FailedPrecondition(fmt::format(
        "placement mismatch: the sender routes by placement {}, this Manager by {}", route.placement_fingerprint(),
        self.current_placement ? self.current_placement() : self.placement_fingerprint));
  }
  return Status::Ok();
}

}  // namespace

Status CheckReleaseRoute(const peer::v1::RouteHeader& route, const PeerIdentity& self) {
  return CheckAddress(route, self);
}

Status CheckRoute(const peer::v1::RouteHeader& route, const PeerIdentity& self, const cluster::MemberView& members) {
  ORBITKV_RETURN_IF_ERROR(CheckAddress(route, self));
  if (route.destination_runtime_uuid() != self.runtime_uuid) {
    return Status::FailedPrecondition(fmt::format(
        "stale incarnation: request addressed to runtime {} of node '{}', which is now runtime {} (it restarted "
        "or registered again)",
        route.destination_runtime_uuid(), self.node_id, self.runtime_uuid));
  }
  Result<cluster::Member> source = members.Find(route.source_node_id());
  if (!source.ok()) {
    if (source.status().code() == StatusCode::kUnavailable) {
      return Status::Unavailable(
                 "the member view is incomplete (etcd unreachable, or this Manager is registering again): cannot "
                 "check the sender")
          .WithReason(StatusReason::kViewIncomplete);
    }
    return Status::PermissionDenied(
        fmt::format("node '{}' is not a registered member of cluster '{}'", route.source_node_id(), self.cluster));
  }
  const cluster::MemberRecord& record = source->record;
  if (record.runtime_uuid != route.source_runtime_uuid() || record.epoch != route.source_epoch()) {
    return Status::PermissionDenied(fmt::format(
        "node '{}' sent as runtime {} epoch {}, but its registered start is runtime {} epoch {}",
        route.source_node_id(), route.source_runtime_uuid(), route.source_epoch(), record.runtime_uuid, record.epoch));
  }
  return Status::Ok();
}

}  // namespace orbitkv::catalog
