// Membership on a 3-member etcd cluster whose raft leader is killed: registrations survive (the
// lease outlives the election), views are repaired through the surviving endpoints, and new
// Managers can still join.
#include <gtest/gtest.h>

#include "cluster/membership.h"
#include "cluster/testing/cluster_fixture.h"
#include "cluster/testing/etcd_process.h"

namespace orbitkv::cluster {
namespace {

using testing::CounterValue;
using testing::kWaitLimit;
using testing::WaitUntil;

MembershipOptions OptionsFor(const std::vector<std::string>& endpoints, const std::string& node) {
  MembershipOptions o;
  o.etcd_endpoints = endpoints;
  o.cluster_name = "ha";
  o.node_id = node;
  o.membership_ttl_secs = 30;
  o.catalog_nodes = {"node-a", "node-b", "node-c"};
  o.peer_endpoint = "127.0.0.1:7300";
  o.etcd_call_timeout = std::chrono::milliseconds(2000);
  return o;
}

TEST(EtcdClusterTest, LeaderKilledMembershipContinues) {
  if (testing::EtcdBinary().empty()) GTEST_SKIP() << "no etcd binary was found at configure time";
  Result<std::unique_ptr<testing::EtcdCluster>> cluster = testing::EtcdCluster::Start(3, Deadline::After(kWaitLimit));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  Result<size_t> leader = (*cluster)->LeaderIndex(Deadline::After(kWaitLimit));
  ASSERT_TRUE(leader.ok()) << leader.status();

  // Each Manager lists the endpoints starting with the leader, so its streams sit on the member we
  // kill.
  std::vector<std::string> endpoints = (*cluster)->endpoints();
  std::rotate(endpoints.begin(), endpoints.begin() + static_cast<long>(*leader), endpoints.end());
  MetricsRegistry ma, mb;
  Result<std::unique_ptr<Membership>> a = Membership::Create(OptionsFor(endpoints, "node-a"), &ma);
  Result<std::unique_ptr<Membership>> b = Membership::Create(OptionsFor(endpoints, "node-b"), &mb);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE((*a)->Join(Deadline::After(kWaitLimit)).ok());
  ASSERT_TRUE((*b)->Join(Deadline::After(kWaitLimit)).ok());
  ASSERT_TRUE(WaitUntil([&] { return (*a)->view().Find("node-b").ok() && (*b)->view().Find("node-a").ok(); }));

  (*cluster)->member(*leader).Kill();

  // Both views notice the broken stream and come back complete through another endpoint.
  ASSERT_TRUE(WaitUntil([&] {
    return CounterValue(ma, "orbitkv_membership_view_invalidations_total", {{"reason", "reconnect"}}) >= 1 &&
           (*a)->CanDoRemoteWork() && (*a)->view().Find("node-b").ok();
  }));
  ASSERT_TRUE(WaitUntil([&] { return (*b)->CanDoRemoteWork() && (*b)->view().Find("node-a").ok(); }));
  EXPECT_EQ((*a)->state(), MembershipState::kRegistered);
  EXPECT_EQ((*b)->state(), MembershipState::kRegistered);
  EXPECT_GE(CounterValue(ma, "orbitkv_etcd_failovers_total"), 1u);

  // Keepalives continue on a surviving member.
  const uint64_t acks = CounterValue(ma, "orbitkv_membership_keepalive_acks_total");
  ASSERT_TRUE(WaitUntil([&] { return CounterValue(ma, "orbitkv_membership_keepalive_acks_total") > acks; }));

  // A new Manager joins through the dead endpoint first, failing over to the quorum, and everyone
  // sees it.
  MetricsRegistry mc;
  Result<std::unique_ptr<Membership>> c = Membership::Create(OptionsFor(endpoints, "node-c"), &mc);
  ASSERT_TRUE(c.ok());
  const Status joined = (*c)->Join(Deadline::After(kWaitLimit));
  ASSERT_TRUE(joined.ok()) << joined;
  ASSERT_TRUE(WaitUntil([&] { return (*a)->view().Find("node-c").ok() && (*c)->view().Find("node-a").ok(); }));
  for (uint32_t shard = 0; shard < kNumShards; ++shard) EXPECT_TRUE((*c)->ResolveShardOwner(shard).ok()) << shard;
}

}  // namespace
}  // namespace orbitkv::cluster
