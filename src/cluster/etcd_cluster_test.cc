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

// Issue 69: with user auth, a leader election costs no Manager an Authenticate (tokens outlive elections; a broken
// stream no longer drops its token), and no registration lapses. Before, each broken keepalive and watch stream
// dropped the token, and every Manager of a fleet authenticated again at once (a bcrypt check and a raft proposal
// each, while the new leader settles).
TEST(EtcdClusterTest, LeaderKilledWithUserAuthCostsNoAuthenticate) {
  if (testing::EtcdBinary().empty()) GTEST_SKIP() << "no etcd binary was found at configure time";
  Result<std::unique_ptr<testing::EtcdCluster>> cluster = testing::EtcdCluster::Start(3, Deadline::After(kWaitLimit));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const Status auth = (*cluster)->member(0).EnableAuth("orbit", "pw-69");
  ASSERT_TRUE(auth.ok()) << auth;
  for (size_t i = 1; i < (*cluster)->size(); ++i) (*cluster)->member(i).SetClientAuth("orbit", "pw-69");
  Result<size_t> leader = (*cluster)->LeaderIndex(Deadline::After(kWaitLimit));
  ASSERT_TRUE(leader.ok()) << leader.status();
  std::vector<std::string> endpoints = (*cluster)->endpoints();
  std::rotate(endpoints.begin(), endpoints.begin() + static_cast<long>(*leader), endpoints.end());

  const std::vector<std::string> nodes = {"node-a", "node-b", "node-c"};
  std::vector<std::unique_ptr<MetricsRegistry>> metrics;
  std::vector<std::unique_ptr<Membership>> managers;
  for (const std::string& node : nodes) {
    MembershipOptions o = OptionsFor(endpoints, node);
    o.etcd_user = "orbit";
    o.etcd_password = "pw-69";
    metrics.push_back(std::make_unique<MetricsRegistry>());
    Result<std::unique_ptr<Membership>> m = Membership::Create(o, metrics.back().get());
    ASSERT_TRUE(m.ok()) << m.status();
    const Status joined = (*m)->Join(Deadline::After(kWaitLimit));
    ASSERT_TRUE(joined.ok()) << joined;
    managers.push_back(std::move(m).value());
  }
  ASSERT_TRUE(WaitUntil([&] {
    for (auto& m : managers) {
      if (!m->CanDoRemoteWork() || m->view().size() != nodes.size()) return false;
    }
    return true;
  }));
  std::vector<uint64_t> before;
  for (auto& m : managers) before.push_back(m->etcd().authenticate_calls());

  (*cluster)->member(*leader).Kill();

  // Every stream on the dead member broke and came back elsewhere, keepalives were acknowledged again.
  for (size_t i = 0; i < managers.size(); ++i) {
    const uint64_t acks = CounterValue(*metrics[i], "orbitkv_membership_keepalive_acks_total");
    ASSERT_TRUE(WaitUntil([&] {
      return CounterValue(*metrics[i], "orbitkv_membership_view_invalidations_total", {{"reason", "reconnect"}}) >= 1 &&
             CounterValue(*metrics[i], "orbitkv_membership_keepalive_acks_total") > acks &&
             managers[i]->CanDoRemoteWork();
    })) << nodes[i];
  }
  for (size_t i = 0; i < managers.size(); ++i) {
    SCOPED_TRACE(nodes[i]);
    EXPECT_EQ(managers[i]->etcd().authenticate_calls(), before[i])
        << "the election made this Manager authenticate again: tokens outlive elections";
    EXPECT_EQ(managers[i]->GetStatus().registrations, 1) << managers[i]->GetStatus().last_cause;
  }
  for (auto& m : managers) m->Shutdown();
}

}  // namespace
}  // namespace orbitkv::cluster
