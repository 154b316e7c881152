#include "server/distributed/node_identity.h"

#include "fmt/format.h"

namespace orbitkv::server {

catalog::PeerIdentity PeerIdentityOf(const cluster::MemberRecord& self, const cluster::LivePlacement& live) {
  catalog::PeerIdentity identity{self.cluster, self.node_id, self.runtime_uuid, self.epoch,
                                 live.Get()->committed.fingerprint()};
  identity.current_placement = [&live] { return live.Get()->committed.fingerprint(); };
  identity.accepts_placement = [&live](std::string_view fingerprint) { return live.Get()->Accepts(fingerprint); };
  return identity;
}

std::string RemoteOffReason(const cluster::Membership& membership) {
  if (membership.CanDoRemoteWork()) return std::string();
  const cluster::MembershipStatus s = membership.GetStatus();
  const double since = static_cast<double>(s.since.count()) / 1000;
  switch (s.state) {
    case cluster::MembershipState::kRegistered:
      if (!s.registration_valid) return "the registration is not acknowledged by etcd";
      if (!s.view.complete) return "the member view is incomplete (etcd unreachable?)";
      if (s.place.standing == cluster::MemberView::Standing::kWaiting) {
        return fmt::format(
            "the cluster is at its member limit of {}: this registration waits in line (number {}) "
            "and is counted when an older one leaves",
            s.view.limit, s.place.position);
      }
      return fmt::format("this registration is not in the member view at revision {} (member limit {})",
                         s.view.revision, s.view.limit);
    case cluster::MembershipState::kExpired:
      return fmt::format("the registration lapsed {:.1f} s ago ({}); registering again, attempt {}", since, s.reason,
                         s.attempts);
    case cluster::MembershipState::kFenced:
      return fmt::format("fenced {:.1f} s ago ({}): restart the Manager", since, s.reason);
    default:
      return fmt::format("membership is {}", cluster::MembershipStateName(s.state));
  }
}

}  // namespace orbitkv::server
