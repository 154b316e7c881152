#include "cluster/placement.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>

#include "cluster/membership.h"
#include "state/namespace.h"

namespace orbitkv::cluster {
namespace {

TEST(PlacementTest, RejectsBadSets) {
  EXPECT_EQ(Placement::Create({}).status().code(), StatusCode::kInvalidArgument);
  std::vector<std::string> seventeen;
  for (int i = 0; i < 17; ++i) seventeen.push_back("n" + std::to_string(i));
  EXPECT_EQ(Placement::Create(seventeen).status().code(), StatusCode::kInvalidArgument);
  seventeen.pop_back();
  EXPECT_TRUE(Placement::Create(seventeen).ok());
  Result<Placement> dup = Placement::Create({"a", "b", "a"});
  ASSERT_FALSE(dup.ok());
  EXPECT_NE(dup.status().message().find("'a' twice"), std::string_view::npos) << dup.status();
  EXPECT_FALSE(Placement::Create({"a", "b c"}).ok());
}

TEST(PlacementTest, OrderDoesNotMatter) {
  Result<Placement> p1 = Placement::Create({"c", "a", "b"});
  Result<Placement> p2 = Placement::Create({"b", "c", "a"});
  ASSERT_TRUE(p1.ok() && p2.ok());
  EXPECT_EQ(*p1, *p2);
  EXPECT_EQ(p1->Encode(), p2->Encode());
  EXPECT_EQ(p1->fingerprint(), p2->fingerprint());
  EXPECT_EQ(p1->fingerprint().size(), 16u);
  for (uint32_t s = 0; s < kNumShards; ++s) EXPECT_EQ(p1->OwnerOf(s), p2->OwnerOf(s));
  EXPECT_EQ(p1->Encode(), R"({"v":2,"generation":1,"shards":16,"replicas":3,"catalog_nodes":["a","b","c"]})");
  EXPECT_NE(p1->fingerprint(), Placement::Create({"a", "b"})->fingerprint());
}

// The assignment is part of the cluster protocol: every Manager, of every release, must compute the
// same one.
TEST(PlacementTest, AssignmentIsStable) {
  Result<Placement> p = Placement::Create({"node-a", "node-b", "node-c", "node-d"});
  ASSERT_TRUE(p.ok());
  std::string owners;
  for (uint32_t s = 0; s < kNumShards; ++s) owners += p->OwnerOf(s).back();
  EXPECT_EQ(owners, "acbbaddcdbccacab");  // Also computed independently with Python hashlib.
}

TEST(PlacementTest, RendezvousMovesOnlyTheShardsOfARemovedNode) {
  std::vector<std::string> nodes;
  for (int i = 0; i < 16; ++i) nodes.push_back("catalog-" + std::to_string(i));
  Result<Placement> full = Placement::Create(nodes);
  ASSERT_TRUE(full.ok());
  std::map<std::string, int> load;
  for (uint32_t s = 0; s < kNumShards; ++s) ++load[full->OwnerOf(s)];
  EXPECT_GE(load.size(), 6u) << "16 shards over 16 equal-weight nodes should spread";
  for (size_t removed = 0; removed < nodes.size(); ++removed) {
    std::vector<std::string> rest = nodes;
    rest.erase(rest.begin() + static_cast<long>(removed));
    Result<Placement> smaller = Placement::Create(rest);
    ASSERT_TRUE(smaller.ok());
    for (uint32_t s = 0; s < kNumShards; ++s) {
      if (full->OwnerOf(s) != nodes[removed]) {
        EXPECT_EQ(smaller->OwnerOf(s), full->OwnerOf(s)) << s;
      }
    }
  }
}

TEST(PlacementTest, DecodeRoundTripsAndRejectsOtherShardCounts) {
  Result<Placement> p = Placement::Create({"x", "y"});
  ASSERT_TRUE(p.ok());
  Result<Placement> back = Placement::Decode(p->Encode());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, *p);
  EXPECT_FALSE(Placement::Decode(R"({"v":2,"generation":1,"shards":32,"replicas":3,"catalog_nodes":["x"]})").ok());
  EXPECT_FALSE(Placement::Decode(R"({"v":3,"generation":1,"shards":16,"replicas":3,"catalog_nodes":["x"]})").ok());
  EXPECT_FALSE(Placement::Decode(R"({"v":2,"generation":1,"shards":16,"replicas":3,"catalog_nodes":[]})").ok());
  EXPECT_FALSE(Placement::Decode(R"({"v":2,"generation":1,"shards":16,"replicas":0,"catalog_nodes":["x"]})").ok());
  // Generations grow with each committed placement change (issue 55); 0 and negative ones are malformed.
  Result<Placement> second =
      Placement::Decode(R"({"v":2,"generation":2,"shards":16,"replicas":3,"catalog_nodes":["x"]})");
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->generation(), 2);
  EXPECT_FALSE(Placement::Decode(R"({"v":2,"generation":0,"shards":16,"replicas":3,"catalog_nodes":["x"]})").ok());
  // A version-1 record (one copy a shard) names the upgrade.
  Result<Placement> old = Placement::Decode(R"({"v":1,"shards":16,"catalog_nodes":["x"]})");
  ASSERT_FALSE(old.ok());
  EXPECT_NE(old.status().message().find("upgrade every Manager"), std::string_view::npos) << old.status();
  // The replicas asked for are part of the placement.
  EXPECT_NE(*Placement::Create({"x", "y"}, 1), *p);
  EXPECT_NE(Placement::Create({"x", "y"}, 1)->fingerprint(), p->fingerprint());
}

// Issue 54: each shard has R copies on distinct catalog nodes, the R best rendezvous scores; copy 0 is the one
// owner of before; capped by the set's size (two nodes: two copies, reduced failure coverage); removing a node
// moves only the copies it kept.
TEST(PlacementTest, EachShardHasItsReplicasOnDistinctNodesBestScoreFirst) {
  Result<Placement> one = Placement::Create({"node-a", "node-b", "node-c", "node-d"}, 1);
  Result<Placement> three = Placement::Create({"node-a", "node-b", "node-c", "node-d"});
  ASSERT_TRUE(one.ok() && three.ok());
  EXPECT_EQ(three->replicas(), 3u);
  EXPECT_FALSE(three->reduced_coverage());
  EXPECT_TRUE(one->reduced_coverage());
  std::map<std::string, int> kept;
  for (uint32_t s = 0; s < kNumShards; ++s) {
    const std::vector<std::string>& copies = three->CopiesOf(s);
    ASSERT_EQ(copies.size(), 3u);
    EXPECT_EQ(std::set<std::string>(copies.begin(), copies.end()).size(), 3u) << s;
    EXPECT_EQ(copies[0], one->OwnerOf(s)) << s;  // copy 0 is the single-copy owner
    EXPECT_EQ(three->OwnerOf(s), copies[0]);
    for (const std::string& node : copies) {
      EXPECT_TRUE(three->Keeps(s, node));
      ++kept[node];
    }
  }
  EXPECT_EQ(kept.size(), 4u);  // every node keeps some copies
  Result<Placement> two = Placement::Create({"node-a", "node-b"});
  ASSERT_TRUE(two.ok());
  EXPECT_EQ(two->replicas(), 2u);
  EXPECT_EQ(two->requested_replicas(), 3u);
  EXPECT_TRUE(two->reduced_coverage());
  for (uint32_t s = 0; s < kNumShards; ++s) EXPECT_EQ(two->CopiesOf(s).size(), 2u);
  // Without node-c, a shard's copies are its old ones minus node-c, plus the next best.
  Result<Placement> without_c = Placement::Create({"node-a", "node-b", "node-d"});
  ASSERT_TRUE(without_c.ok());
  for (uint32_t s = 0; s < kNumShards; ++s) {
    for (const std::string& node : three->CopiesOf(s)) {
      if (node != "node-c") {
        EXPECT_TRUE(without_c->Keeps(s, node)) << s << " " << node;
      }
    }
  }
  EXPECT_FALSE(Placement::Create({"x"}, 0).ok());
  EXPECT_FALSE(Placement::Create({"x"}, kMaxCatalogReplicas + 1).ok());
}

TEST(PlacementTest, ShardOfIsStateShardOf) {
  state::NamespaceIdentity id;
  id.model_id = "m";
  id.weights_revision = "r";
  id.tokenizer = "t";
  id.engine_kind = "vllm";
  Result<state::StateNamespace> ns = state::DeriveNamespace(id);
  ASSERT_TRUE(ns.ok());
  std::set<uint32_t> shards;
  for (uint64_t i = 0; i < 256; ++i) {
    Result<state::StateKey> key = state::StateKey::Create(*ns, 0, {i * 16, i * 16 + 16}, "native-" + std::to_string(i));
    ASSERT_TRUE(key.ok());
    const uint32_t shard = Placement::ShardOf(*key);
    EXPECT_EQ(shard, state::ShardOf(*key, kNumShards));
    shards.insert(shard);
  }
  EXPECT_EQ(shards.size(), kNumShards);
}

MembershipOptions GoodOptions() {
  MembershipOptions o;
  o.etcd_endpoints = {"127.0.0.1:2379"};
  o.cluster_name = "c1";
  o.node_id = "n1";
  o.catalog_nodes = {"n1"};
  o.peer_endpoint = "127.0.0.1:7300";
  return o;
}

TEST(MembershipOptionsTest, ValidatesEveryFlagWithItsName) {
  EXPECT_TRUE(ValidateMembershipOptions(GoodOptions()).ok());
  struct Case {
    void (*mutate)(MembershipOptions&);
    const char* flag;
  };
  const Case cases[] = {
      {[](MembershipOptions& o) { o.etcd_endpoints.clear(); }, "--etcd-endpoints"},
      {[](MembershipOptions& o) { o.cluster_name = ""; }, "--cluster-name"},
      {[](MembershipOptions& o) { o.node_id = "a/b"; }, "--node-id"},
      {[](MembershipOptions& o) { o.membership_ttl_secs = 1; }, "--membership-ttl-secs"},
      {[](MembershipOptions& o) { o.membership_ttl_secs = 100000; }, "--membership-ttl-secs"},
      {[](MembershipOptions& o) { o.catalog_nodes.clear(); }, "--catalog-nodes"},
      {[](MembershipOptions& o) { o.peer_endpoint = "nohost"; }, "peer endpoint"},
  };
  for (const Case& c : cases) {
    MembershipOptions o = GoodOptions();
    c.mutate(o);
    const Status s = ValidateMembershipOptions(o);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << c.flag;
    EXPECT_NE(s.message().find(c.flag), std::string_view::npos) << s;
  }
  MetricsRegistry metrics;
  MembershipOptions bad_endpoint = GoodOptions();
  bad_endpoint.etcd_endpoints = {"https://etcd:2379"};
  Result<std::unique_ptr<Membership>> m = Membership::Create(bad_endpoint, &metrics);
  ASSERT_FALSE(m.ok());
  // https:// needs the CA that signed etcd's certificate (issue 53): the error names the flag.
  EXPECT_NE(m.status().message().find("--etcd-tls-ca"), std::string_view::npos) << m.status();
}

TEST(MembershipOptionsTest, SplitFlagList) {
  Result<std::vector<std::string>> items = SplitFlagList("--catalog-nodes", "a, b ,c");
  ASSERT_TRUE(items.ok());
  EXPECT_EQ(*items, (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_FALSE(SplitFlagList("--catalog-nodes", "a,,b").ok());
  EXPECT_FALSE(SplitFlagList("--catalog-nodes", "").ok());
}

}  // namespace
}  // namespace orbitkv::cluster
