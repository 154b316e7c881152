#include "cluster/live_placement.h"

#include <gtest/gtest.h>

#include <algorithm>

namespace orbitkv::cluster {
namespace {

Placement Make(std::vector<std::string> nodes, int64_t generation) {
  return Placement::Create(std::move(nodes), kDefaultCatalogReplicas, generation).value();
}

std::map<std::string, std::string> Records(const Placement& committed,
                                           const std::optional<PlacementTransition>& transition = std::nullopt) {
  std::map<std::string, std::string> records{{std::string(kPlacementRecordName), committed.Encode()}};
  if (transition) records[std::string(kTransitionRecordName)] = transition->Encode();
  return records;
}

bool Has(const std::vector<std::string>& copies, const std::string& node) {
  return std::find(copies.begin(), copies.end(), node) != copies.end();
}

// A shard that gains node d when {a,b,c} -> {a,b,c,d}.
uint32_t GainingShard(const Placement& from, const Placement& to) {
  for (uint32_t shard = 0; shard < kNumShards; ++shard) {
    if (!PlacementTransition::NewCopies(from, to, shard).empty()) return shard;
  }
  ADD_FAILURE() << "no shard gains a copy";
  return 0;
}

// Owners publish to the new copies of a shard only while it moves or is ready, queries ask them after the committed
// ones, and a commit retires the old copies only when the transition record goes.
TEST(LivePlacementTest, FollowsATransitionThroughItsPhases) {
  const Placement g1 = Make({"a", "b", "c"}, 1);
  LivePlacement live(g1);
  const Placement next = Make({"a", "b", "c", "d"}, 2);
  const uint32_t shard = GainingShard(g1, next);
  const std::string lost = [&] {  // the copy of `shard` that d replaces
    for (const std::string& n : g1.CopiesOf(shard)) {
      if (!next.Keeps(shard, n)) return n;
    }
    return std::string();
  }();
  ASSERT_FALSE(lost.empty());

  PlacementTransition t = PlacementTransition::Start(g1, next, "a/uuid", 1000);
  const uint64_t v0 = live.version();
  ASSERT_EQ(live.Apply(Records(g1, t)), "");
  EXPECT_GT(live.version(), v0);
  auto s = live.Get();
  ASSERT_TRUE(s->moving());
  EXPECT_FALSE(Has(s->PublishCopies(shard), "d")) << "waiting shards do not stream to their new copies yet";
  EXPECT_TRUE(s->Hosts(shard, "d"));  // it accepts streams early
  EXPECT_TRUE(s->Accepts(next.fingerprint()));
  EXPECT_TRUE(s->Accepts(g1.fingerprint()));
  EXPECT_TRUE(s->Serves(1));
  EXPECT_TRUE(s->Serves(2));
  EXPECT_FALSE(s->Serves(3));

  t.shards[shard].state = ShardMove::State::kMoving;
  ASSERT_EQ(live.Apply(Records(g1, t)), "");
  s = live.Get();
  const std::vector<std::string> publish = s->PublishCopies(shard);
  ASSERT_EQ(publish.size(), 4u);   // both generations
  EXPECT_EQ(publish.back(), "d");  // committed copies first: queries ask the new one last
  EXPECT_EQ(s->QueryCopies(shard), publish);

  // The commit: generation 2, the old copy still hosts (and G's routes are accepted) until the record goes.
  t.shards[shard].state = ShardMove::State::kReady;
  t.phase = PlacementTransition::Phase::kCommitted;
  ASSERT_EQ(live.Apply(Records(next, t)), "");
  s = live.Get();
  EXPECT_EQ(s->committed.generation(), 2);
  EXPECT_EQ(s->PublishCopies(shard), next.CopiesOf(shard));
  EXPECT_TRUE(s->Hosts(shard, lost));
  EXPECT_TRUE(s->Accepts(g1.fingerprint()));
  EXPECT_TRUE(s->Serves(2));
  EXPECT_FALSE(s->Serves(1));

  ASSERT_EQ(live.Apply(Records(next)), "");
  s = live.Get();
  EXPECT_FALSE(s->Hosts(shard, lost));
  EXPECT_FALSE(s->Accepts(g1.fingerprint()));
  EXPECT_TRUE(s->Accepts(next.fingerprint()));
  // The same records again change nothing.
  const uint64_t v = live.version();
  ASSERT_EQ(live.Apply(Records(next)), "");
  EXPECT_EQ(live.version(), v);
}

TEST(LivePlacementTest, AnAbortedChangeDropsItsNewCopies) {
  const Placement g1 = Make({"a", "b", "c"}, 1);
  const Placement next = Make({"a", "b", "c", "d"}, 2);
  const uint32_t shard = GainingShard(g1, next);
  LivePlacement live(g1);
  PlacementTransition t = PlacementTransition::Start(g1, next, "a/uuid", 1000);
  t.shards[shard].state = ShardMove::State::kMoving;
  ASSERT_EQ(live.Apply(Records(g1, t)), "");
  EXPECT_TRUE(Has(live.Get()->PublishCopies(shard), "d"));
  t.phase = PlacementTransition::Phase::kAborted;
  t.reason = "shard did not converge";
  ASSERT_EQ(live.Apply(Records(g1, t)), "");
  const auto s = live.Get();
  EXPECT_EQ(s->PublishCopies(shard), g1.CopiesOf(shard));
  EXPECT_FALSE(s->Hosts(shard, "d"));
  EXPECT_FALSE(s->Accepts(next.fingerprint()));
  EXPECT_FALSE(s->Serves(2));
}

// A newer generation is adopted (even one that skipped a generation this Manager never saw); the same generation
// with other nodes, an older one, an unreadable or a removed record is a regression to fence on.
TEST(LivePlacementTest, RegressionsFenceAndNewerGenerationsAreAdopted) {
  LivePlacement live(Make({"a", "b", "c"}, 2));
  EXPECT_NE(live.Apply(Records(Make({"a", "b", "d"}, 2))).find("changed in place"), std::string::npos);
  EXPECT_NE(live.Apply(Records(Make({"a", "b", "c"}, 1))).find("went back"), std::string::npos);
  EXPECT_NE(live.Apply({}).find("removed"), std::string::npos);
  EXPECT_NE(live.Apply({{std::string(kPlacementRecordName), "{"}}).find("unreadable"), std::string::npos);
  EXPECT_EQ(live.Get()->committed.generation(), 2);  // none of them was taken
  ASSERT_EQ(live.Apply(Records(Make({"a", "b"}, 5))), "");
  EXPECT_EQ(live.Get()->committed.generation(), 5);
  EXPECT_FALSE(live.Get()->previous.has_value());
  // A malformed transition or request is ignored, not fenced on; the leader key is kept as it is.
  auto records = Records(Make({"a", "b"}, 5));
  records[std::string(kTransitionRecordName)] = "not json";
  records[std::string(kRequestRecordName)] = "{}";
  records[std::string(kLeaderRecordName)] = "a/uuid";
  ASSERT_EQ(live.Apply(records), "");
  EXPECT_FALSE(live.Get()->transition.has_value());
  EXPECT_FALSE(live.Get()->request.has_value());
  EXPECT_EQ(live.Get()->leader, "a/uuid");
  // Adopt: a join replaces what the Manager was configured with; a registration made again refuses a regression.
  EXPECT_EQ(live.Adopt(Make({"x"}, 1), std::nullopt, /*initial=*/false).code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(live.Adopt(Make({"x"}, 1), std::nullopt, /*initial=*/true).ok());
  EXPECT_EQ(live.Get()->committed.catalog_nodes(), std::vector<std::string>{"x"});
}

}  // namespace
}  // namespace orbitkv::cluster
