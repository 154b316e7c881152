// The route header of every orbitkv.peer.v1 request (proto/peer.proto, docs/formats/peer.md): who sends it, to
// which Manager start, for which cluster and placement. CheckRoute is the receiver's gate, run before any handler
// does work: a request that is not for this start, or not from a registered member's current start, is refused
// with a status that says which and why.
#ifndef ORBITKV_CATALOG_ROUTE_H_
#define ORBITKV_CATALOG_ROUTE_H_

#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>

#include "base/status.h"
#include "catalog/proto/peer.pb.h"
#include "cluster/member_view.h"

namespace orbitkv::catalog {

// 2: catalog shards have several copies (placement record version 2); a Manager of version 1 keeps one.
inline constexpr uint32_t kPeerProtocolVersion = 2;
// The largest message either side sends or accepts (gRPC's limits are set to it).
inline constexpr int kMaxPeerMessageBytes = 4 << 20;
// HTTP/2 keepalive on peer channels while calls are outstanding: a ping after this long without data, and the
// connection closed when its answer takes longer than the timeout.
inline constexpr int kPeerKeepaliveTimeMs = 10'000;
inline constexpr int kPeerKeepaliveTimeoutMs = 5'000;
// A Lookup names at most this many keys and this many key bytes.
inline constexpr int kMaxLookupKeys = 128;
inline constexpr size_t kMaxLookupKeyBytes = 64 << 10;

// This Manager as its peers address it.
struct PeerIdentity {
  std::string cluster;
  std::string node_id;
  std::string runtime_uuid;
  int64_t epoch = 0;
  std::string placement_fingerprint;
  // The placement changes online. When set, the fingerprint requests currently carry (in place of
  // placement_fingerprint), and the placements whose requests this Manager serves (its committed one, the next one
  // while a change is in progress, the previous one until the change's record goes: live_placement.h).
  std::function<std::string()> current_placement;
  std::function<bool(std::string_view fingerprint)> accepts_placement;
};

// This Manager's current identity as its peer parts use it: each registration made again brings a new runtime UUID
// and epoch. Thread safety: Get/Set from any thread.
class SelfIdentity {
 public:
  explicit SelfIdentity(PeerIdentity identity) : identity_(std::move(identity)) {}
  PeerIdentity Get() const {
    std::lock_guard<std::mutex> lock(mu_);
    return identity_;
  }
  void Set(PeerIdentity identity) {
    std::lock_guard<std::mutex> lock(mu_);
    identity_ = std::move(identity);
  }

 private:
  mutable std::mutex mu_;
  PeerIdentity identity_;
};

// The header a request from `self` to `destination` carries.
peer::v1::RouteHeader MakeRoute(const PeerIdentity& self, const cluster::MemberRecord& destination);

// OK, or why the request must be refused:
//   FAILED_PRECONDITION  another protocol version (the sender turns remote work with this peer off), another
//                        placement, or a destination that is not this node or not this start (a stale
//                        incarnation: the Manager restarted since the sender looked);
//   PERMISSION_DENIED    another cluster, or a source that is not a registered member with that runtime UUID and
//                        epoch (unregistered, or an older start of it);
//   UNAVAILABLE          the member view is incomplete (etcd unreachable): retry later.
// The protocol-version refusal carries StatusReason::kPeerProtocolVersion, the incomplete view kViewIncomplete.
Status CheckRoute(const peer::v1::RouteHeader& route, const PeerIdentity& self, const cluster::MemberView& members);

// The gate of a Release by grant id: protocol, cluster, destination node and placement as above, but neither the
// member view (a grant must be releasable while either side's view is incomplete) nor the destination's start
// (grants of an earlier start of this Manager were revoked when it ended: such a release finds nothing).
Status CheckReleaseRoute(const peer::v1::RouteHeader& route, const PeerIdentity& self);

}  // namespace orbitkv::catalog

#endif  // ORBITKV_CATALOG_ROUTE_H_
