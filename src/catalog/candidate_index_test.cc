// CandidateIndex: the TTL that reads do not extend, the LRU byte budget, uncached misses, four candidates per
// key, rejected versions removed alone, and the known prefix of a query.
#include "catalog/candidate_index.h"

#include <gtest/gtest.h>

#include "core/test_util.h"

namespace orbitkv::catalog {
namespace {

using std::chrono::milliseconds;

struct FakeClock {
  MonoTime now = MonoNow();
  std::function<MonoTime()> Fn() {
    return [this] { return now; };
  }
};

Candidate At(const std::string& node, uint64_t generation, uint64_t sequence = 1, uint8_t tier = 1) {
  return Candidate{node, "uuid-" + node, tier, generation, sequence, 65536};
}

state::StateKey Key(uint64_t i) { return core::testing::ChainKey(3, i); }

TEST(CandidateIndexTest, FreshForItsTtlFromInsertionEvenWhileRead) {
  FakeClock clock;
  CandidateIndex index({16ull << 20, milliseconds(5000), clock.Fn()});
  index.Insert(Key(0), {At("node-a", 1)});
  for (int i = 0; i < 4; ++i) {  // reads every second do not keep it alive
    EXPECT_EQ(index.Find(Key(0)).size(), 1u) << i;
    clock.now += milliseconds(1000);
  }
  clock.now += milliseconds(1001);  // 5.001 s after the insert
  EXPECT_TRUE(index.Find(Key(0)).empty());
  EXPECT_EQ(index.GetStats().entries, 0u);  // the expired key is gone
  // Learning it again starts a new TTL.
  index.Insert(Key(0), {At("node-a", 2)});
  clock.now += milliseconds(4999);
  ASSERT_EQ(index.Find(Key(0)).size(), 1u);
  EXPECT_EQ(index.Find(Key(0))[0].generation, 2u);
}

TEST(CandidateIndexTest, MissesAreNotCachedAndEmptyRowsChangeNothing) {
  CandidateIndex index({});
  EXPECT_TRUE(index.Find(Key(1)).empty());
  index.Insert(Key(1), {});
  EXPECT_EQ(index.GetStats().entries, 0u);
  EXPECT_EQ(index.GetStats().bytes, 0u);
  EXPECT_EQ(index.GetStats().misses, 1u);
  index.Insert(Key(1), {At("node-a", 1)});
  index.Insert(Key(1), {});  // a later empty row does not prove absence: the candidate stays
  EXPECT_EQ(index.Find(Key(1)).size(), 1u);
}

TEST(CandidateIndexTest, AtMostFourCandidatesTheNewestOfEachOwnerStart) {
  CandidateIndex index({});
  index.Insert(Key(2), {At("a", 1), At("b", 1), At("c", 1)});
  index.Insert(Key(2), {At("a", 7)});  // a's newer generation replaces its older one
  auto found = index.Find(Key(2));
  ASSERT_EQ(found.size(), 3u);
  EXPECT_EQ(std::count_if(found.begin(), found.end(), [](const Candidate& c) { return c.owner_node == "a"; }), 1);
  EXPECT_NE(std::find(found.begin(), found.end(), At("a", 7)), found.end());
  index.Insert(Key(2), {At("d", 1), At("e", 1)});
  found = index.Find(Key(2));
  ASSERT_EQ(found.size(), CandidateIndex::kMaxCandidatesPerKey);
  EXPECT_EQ(std::find(found.begin(), found.end(), At("b", 1)), found.end());  // the oldest learnt went
  // The same owner in another tier is another candidate.
  index.Insert(Key(3), {At("a", 1, 1, 1), At("a", 1, 1, 2)});
  EXPECT_EQ(index.Find(Key(3)).size(), 2u);
}

TEST(CandidateIndexTest, ASlowerAnswerWithOlderEvidenceNeverReplacesNewerEvidence) {
  // Two lookups of one key answered out of order: the owner's greater insertion sequence wins, not the answer
  // that arrived last.
  CandidateIndex index({});
  index.Insert(Key(4), {At("a", 3, 9)});
  index.Insert(Key(4), {At("a", 2, 5)});  // the older lookup's answer, arriving late
  auto found = index.Find(Key(4));
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].sequence, 9u);
  EXPECT_EQ(found[0].generation, 3u);
  index.Insert(Key(4), {At("a", 4, 12)});  // newer evidence does replace it
  found = index.Find(Key(4));
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].sequence, 12u);
}

TEST(CandidateIndexTest, TheByteBudgetEvictsTheLeastRecentlyUsed) {
  const uint64_t one = CandidateIndex::Charge({At("node-a", 1)});
  CandidateIndex index({3 * one, milliseconds(5000)});
  index.Insert(Key(10), {At("node-a", 1)});
  index.Insert(Key(11), {At("node-a", 1)});
  index.Insert(Key(12), {At("node-a", 1)});
  EXPECT_FALSE(index.Find(Key(10)).empty());  // 10 is now the most recently used; 11 the least
  index.Insert(Key(13), {At("node-a", 1)});
  EXPECT_TRUE(index.Find(Key(11)).empty());
  EXPECT_FALSE(index.Find(Key(10)).empty());
  EXPECT_FALSE(index.Find(Key(12)).empty());
  EXPECT_FALSE(index.Find(Key(13)).empty());
  EXPECT_LE(index.GetStats().bytes, 3 * one);
  EXPECT_EQ(index.GetStats().evictions, 1u);
}

TEST(CandidateIndexTest, ARejectionRemovesOnlyThatVersionAndThePrefixStopsAtTheFirstUnknownKey) {
  CandidateIndex index({});
  for (uint64_t i = 0; i < 6; ++i) index.Insert(Key(20 + i), {At("a", 1, 10 + i), At("b", 4, 30 + i)});
  index.Remove(Key(22), "a", "uuid-a", 1, 12);
  auto found = index.Find(Key(22));
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].owner_node, "b");
  index.Remove(Key(22), "b", "uuid-b", 4, 99);  // another version: nothing happens
  EXPECT_EQ(index.Find(Key(22)).size(), 1u);
  index.Remove(Key(23), "a", "uuid-a", 1, 13);
  index.Remove(Key(23), "b", "uuid-b", 4, 33);  // its last candidate: the key goes
  const std::vector<state::StateKey> query = {Key(20), Key(21), Key(22), Key(23), Key(24)};
  EXPECT_EQ(index.KnownPrefix(query), 3u);
  EXPECT_EQ(index.GetStats().entries, 5u);
}

}  // namespace
}  // namespace orbitkv::catalog
