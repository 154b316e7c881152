// Fuzzes what a Manager does with a peer request's bytes: orbitkv.peer.v1 messages parsed from anything, and the
// route check on whatever parses. Neither may crash, and the check may accept only a header that names exactly
// this Manager's start, its cluster and placement, and a registered member's current start as the source.
#include <cstdint>
#include <cstdlib>
#include <map>

#include "catalog/route.h"

namespace {

using namespace orbitkv;

void Check(bool ok) {
  if (!ok) std::abort();
}

const catalog::PeerIdentity& Self() {
  static const catalog::PeerIdentity self{"c1", "b", "uuid-b", 1, "fp"};
  return self;
}

const cluster::MemberView& View() {
  static cluster::MemberView* view = [] {
    auto* v = new cluster::MemberView();
    std::map<std::string, cluster::Member> members;
    cluster::Member a;
    a.record = cluster::MemberRecord{"c1", "a", 3, "a:7100", "uuid-a"};
    members.emplace("a", a);
    v->Install(std::move(members), 1);
    return v;
  }();
  return *view;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  peer::v1::HealthRequest request;
  if (request.ParseFromArray(data, static_cast<int>(size))) {
    const peer::v1::RouteHeader& r = request.route();
    if (catalog::CheckRoute(r, Self(), View()).ok()) {
      Check(r.protocol_version() == catalog::kPeerProtocolVersion && r.cluster() == "c1" &&
            r.destination_node_id() == "b" && r.destination_runtime_uuid() == "uuid-b" &&
            r.placement_fingerprint() == "fp" && r.source_node_id() == "a" && r.source_runtime_uuid() == "uuid-a" &&
            r.source_epoch() == 3);
    }
  }
  peer::v1::HealthResponse response;
  (void)response.ParseFromArray(data, static_cast<int>(size));
  return 0;
}
