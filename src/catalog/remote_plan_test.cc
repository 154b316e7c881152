// Planning and authorization against sources played by the test (their rejections on demand).
#include "catalog/remote_plan.h"

#include <gtest/gtest.h>

#include <map>

#include "core/test_util.h"

namespace orbitkv::catalog {
namespace {

// Sources by node: each grants what it holds in the versions it holds (the test says which).
class FakeSources final : public SourceTransport {
 public:
  std::map<std::string, size_t> stale_from;  // node -> first block it no longer holds as announced
  std::set<std::string> down, busy;
  std::vector<std::string> asked;
  std::map<std::string, int> released;

  Result<SourceReply> Authorize(const std::string& node, const std::string&, uint64_t request_id,
                                std::span<const SourceBlockVersion> blocks, uint64_t, std::chrono::milliseconds,
                                Deadline) override {
    asked.push_back(node);
    if (down.count(node) != 0) return Status::Unavailable(node + " is gone");
    if (busy.count(node) != 0) return Status::ResourceExhausted(node + " is full");
    SourceReply reply;
    const size_t held = stale_from.count(node) != 0 ? std::min(stale_from[node], blocks.size()) : blocks.size();
    reply.grant.granted = held;
    reply.grant.outcome = held == 0 ? SourceOutcome::kStale : SourceOutcome::kGranted;
    reply.grant.stop = held < blocks.size() ? SourceOutcome::kStale : SourceOutcome::kGranted;
    reply.grant.grant_id = held == 0 ? 0 : request_id;
    return reply;
  }
  Result<bool> Release(const std::string& node, const std::string&, uint64_t, uint64_t, const std::string&,
                       Deadline) override {
    ++released[node];
    return true;
  }
};

Candidate On(const std::string& node, uint8_t tier = 1, uint64_t generation = 1) {
  return Candidate{node, "rt-" + node, tier, generation, generation + 100, 4096};
}

class RemotePlanTest : public ::testing::Test {
 protected:
  CandidateIndex index_{{}};
  FakeSources sources_;
  std::vector<state::StateKey> keys_ = core::testing::Chain(5, 10);
  AuthorizeOptions Options() {
    AuthorizeOptions options;
    options.self_node = "self";
    options.request_id = 7;
    return options;
  }
};

TEST_F(RemotePlanTest, TheLongestContiguousSpanWinsAndTiesGoToTheSmallerNode) {
  // b holds 0..5, c holds 0..5, a holds 0..3 and 5..9 (a gap at 4), self holds everything, d only on SSD.
  for (size_t i = 0; i < keys_.size(); ++i) {
    std::vector<Candidate> row = {On("self"), On("d", 2)};
    if (i < 6) row.push_back(On("c"));
    if (i != 4) row.push_back(On("a"));
    index_.Insert(keys_[i], row);
    if (i < 6) index_.Insert(keys_[i], {On("b")});
  }
  auto span = PlanSpan(keys_, index_, "self", {});
  ASSERT_TRUE(span.has_value());
  EXPECT_EQ(span->node, "b");  // b and c cover 6 keys; a 4; b sorts first
  EXPECT_EQ(span->versions.size(), 6u);
  EXPECT_EQ(span->versions[0].sequence, 101u);
  auto without_b = PlanSpan(keys_, index_, "self", {{"b", "rt-b"}});
  ASSERT_TRUE(without_b.has_value());
  EXPECT_EQ(without_b->node, "c");
  // Only self or SSD: nothing to plan.
  CandidateIndex local({});
  local.Insert(keys_[0], {On("self"), On("d", 2)});
  EXPECT_FALSE(PlanSpan(keys_, local, "self", {}).has_value());
}

TEST_F(RemotePlanTest, ARejectionRemovesOnlyTheRefusedVersionAndAtMostTwoAlternativesAreTried) {
  for (const auto& key : keys_) index_.Insert(key, {On("a"), On("b"), On("c"), On("e")});
  for (const std::string node : {"a", "b", "c", "e"}) sources_.stale_from[node] = 0;
  AuthorizeOutcome outcome = AuthorizeBest(keys_, index_, sources_, Options());
  EXPECT_FALSE(outcome.authorized.has_value());
  EXPECT_EQ(outcome.attempts, 3u);  // the first and two alternatives, never the fourth
  EXPECT_EQ(outcome.rejections, 3u);
  EXPECT_EQ((std::vector<std::string>{"a", "b", "c"}), sources_.asked);
  // Key 0 lost exactly the three refused versions; later keys kept theirs.
  ASSERT_EQ(index_.Find(keys_[0]).size(), 1u);
  EXPECT_EQ(index_.Find(keys_[0])[0].owner_node, "e");
  EXPECT_EQ(index_.Find(keys_[1]).size(), 4u);
}

TEST_F(RemotePlanTest, AGoneSourceFallsBackToTheNextAndAPartialGrantForgetsTheBlockAfterIt) {
  for (const auto& key : keys_) index_.Insert(key, {On("a"), On("b")});
  sources_.down.insert("a");
  sources_.stale_from["b"] = 7;
  AuthorizeOutcome outcome = AuthorizeBest(keys_, index_, sources_, Options());
  ASSERT_TRUE(outcome.authorized.has_value());
  EXPECT_EQ(outcome.authorized->span.node, "b");
  EXPECT_EQ(outcome.authorized->reply.grant.granted, 7u);
  EXPECT_EQ(outcome.failures, 1u);
  // a's versions in the span are forgotten (it is gone); b's block 7 too (another version there now).
  EXPECT_EQ(index_.Find(keys_[0]).size(), 1u);
  ASSERT_EQ(index_.Find(keys_[7]).size(), 0u);
  EXPECT_EQ(index_.Find(keys_[8]).size(), 1u);
  // A busy source keeps its candidates.
  CandidateIndex busy_index({});
  for (const auto& key : keys_) busy_index.Insert(key, {On("c")});
  sources_.busy.insert("c");
  AuthorizeOutcome busy = AuthorizeBest(keys_, busy_index, sources_, Options());
  EXPECT_FALSE(busy.authorized.has_value());
  EXPECT_EQ(busy.last_error.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(busy_index.Find(keys_[0]).size(), 1u);
}

}  // namespace
}  // namespace orbitkv::catalog
