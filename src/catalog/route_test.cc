#include "catalog/peer_service.h"  // first: it brings gRPC in

#include "catalog/route.h"

#include <gtest/gtest.h>

#include <map>

namespace orbitkv::catalog {
namespace {

cluster::Member MemberOf(const std::string& node, const std::string& uuid, int64_t epoch) {
  cluster::Member m;
  m.record = cluster::MemberRecord{"c1", node, epoch, node + ":7100", uuid};
  m.lease_id = 1;
  return m;
}

class RouteTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::map<std::string, cluster::Member> members;
    members.emplace("a", MemberOf("a", "uuid-a", 3));
    members.emplace("b", MemberOf("b", "uuid-b", 1));
    view_.Install(std::move(members), 10);
  }
  PeerIdentity Self(const std::string& node, const std::string& uuid, int64_t epoch) const {
    return PeerIdentity{"c1", node, uuid, epoch, "fp-1"};
  }
  // a (runtime uuid-a, epoch 3) to b (uuid-b).
  peer::v1::RouteHeader FromAToB() const {
    return MakeRoute(Self("a", "uuid-a", 3), MemberOf("b", "uuid-b", 1).record);
  }
  cluster::MemberView view_;
};

TEST_F(RouteTest, AHeaderFromAMemberToThisStartPasses) {
  EXPECT_TRUE(CheckRoute(FromAToB(), Self("b", "uuid-b", 1), view_).ok());
}

TEST_F(RouteTest, EachWrongFieldIsRefusedWithItsReason) {
  const PeerIdentity b = Self("b", "uuid-b", 1);
  struct Case {
    void (*mutate)(peer::v1::RouteHeader*);
    StatusCode code;
    const char* says;
  };
  const Case cases[] = {
      {[](peer::v1::RouteHeader* r) { r->set_protocol_version(kPeerProtocolVersion + 1); },
       StatusCode::kFailedPrecondition, "peer protocol version 3"},
      {[](peer::v1::RouteHeader* r) { r->set_protocol_version(1); }, StatusCode::kFailedPrecondition,
       "peer protocol version 1"},
      {[](peer::v1::RouteHeader* r) { r->set_cluster("c2"); }, StatusCode::kPermissionDenied, "cluster 'c2'"},
      {[](peer::v1::RouteHeader* r) { r->set_destination_node_id("c"); }, StatusCode::kFailedPrecondition,
       "addressed to node 'c'"},
      {[](peer::v1::RouteHeader* r) { r->set_destination_runtime_uuid("uuid-b-old"); }, StatusCode::kFailedPrecondition,
       "stale incarnation"},
      {[](peer::v1::RouteHeader* r) { r->set_placement_fingerprint("fp-0"); }, StatusCode::kFailedPrecondition,
       "placement mismatch"},
      {[](peer::v1::RouteHeader* r) { r->set_source_node_id("z"); }, StatusCode::kPermissionDenied,
       "not a registered member"},
      {[](peer::v1::RouteHeader* r) { r->set_source_runtime_uuid("uuid-a-old"); }, StatusCode::kPermissionDenied,
       "registered start"},
      {[](peer::v1::RouteHeader* r) { r->set_source_epoch(2); }, StatusCode::kPermissionDenied, "registered start"},
  };
  for (const Case& c : cases) {
    peer::v1::RouteHeader route = FromAToB();
    c.mutate(&route);
    Status status = CheckRoute(route, b, view_);
    EXPECT_EQ(status.code(), c.code) << status;
    EXPECT_NE(status.message().find(c.says), std::string::npos) << status;
    // Only the protocol-version refusal carries the reason that turns remote work off.
    EXPECT_EQ(status.reason() == StatusReason::kPeerProtocolVersion, route.protocol_version() != kPeerProtocolVersion)
        << status;
  }
}

TEST_F(RouteTest, ARefusalsReasonCrossesGrpcAndAMessageAloneCarriesNone) {
  peer::v1::RouteHeader route = FromAToB();
  route.set_protocol_version(kPeerProtocolVersion + 1);
  const Status refused = CheckRoute(route, Self("b", "uuid-b", 1), view_);
  const Status received = FromGrpc(ToGrpc(refused));
  EXPECT_EQ(received, refused);  // code and message
  EXPECT_EQ(received.reason(), StatusReason::kPeerProtocolVersion);
  const Status text_only = FromGrpc(grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "peer protocol version 9"));
  EXPECT_EQ(text_only.reason(), StatusReason::kNone);
  const Status garbage = FromGrpc(grpc::Status(grpc::StatusCode::UNAVAILABLE, "x", "\xff\xff not a proto"));
  EXPECT_EQ(garbage.code(), StatusCode::kUnavailable);
  EXPECT_EQ(garbage.reason(), StatusReason::kNone);
}

TEST_F(RouteTest, AnIncompleteMemberViewIsUnavailableNotARefusal) {
  view_.Invalidate();
  const Status status = CheckRoute(FromAToB(), Self("b", "uuid-b", 1), view_);
  EXPECT_EQ(status.code(), StatusCode::kUnavailable);
  EXPECT_EQ(status.reason(), StatusReason::kViewIncomplete);
  EXPECT_EQ(FromGrpc(ToGrpc(status)).reason(), StatusReason::kViewIncomplete);
}

}  // namespace
}  // namespace orbitkv::catalog
