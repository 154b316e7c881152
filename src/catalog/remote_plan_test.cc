// Planning and authorization against sources played by the test (their rejections on demand).
#include "catalog/remote_plan.h"

#include <gtest/gtest.h>

#include <map>
#include <set>

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
  // b holds 0..5, c holds 0..5, a holds 0..3 and 5..9 (a gap at 4), self holds everything, d 0..5 on SSD only (as
  // long a span as b's and c's: peer DRAM goes first).
  for (size_t i = 0; i < keys_.size(); ++i) {
    std::vector<Candidate> row = {On("self")};
    if (i < 6) row.push_back(On("d", 2));
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
  // Only self (on any tier): nothing to plan.
  CandidateIndex local({});
  local.Insert(keys_[0], {On("self"), On("self", 2)});
  EXPECT_FALSE(PlanSpan(keys_, local, "self", {}).has_value());
}

// Issue 56: SSD candidates are planned. A source's SSD replica counts where it has no DRAM one; more of the span wins
// (between two SSD sources too), and of equal spans the one with fewer SSD blocks; each block carries its tier.
TEST_F(RemotePlanTest, PeerSsdReplicasArePlannedAndPeerDramGoesFirstForEqualSpans) {
  for (size_t i = 0; i < keys_.size(); ++i) {
    std::vector<Candidate> row;
    if (i < 4) row.push_back(On("a"));        // DRAM, 4 blocks
    if (i < 8) row.push_back(On("b", 2, 3));  // SSD, 8 blocks
    row.push_back(On("c", 2, 4));             // SSD, all 10 ...
    if (i < 5) row.push_back(On("c", 1, 5));  // ... the first 5 also in DRAM
    index_.Insert(keys_[i], row);
  }
  auto span = PlanSpan(keys_, index_, "self", {});
  ASSERT_TRUE(span.has_value());
  EXPECT_EQ(span->node, "c");
  ASSERT_EQ(span->versions.size(), 10u);
  EXPECT_EQ(span->versions[0].tier, kSourceDram);  // its DRAM replica where it has one
  EXPECT_EQ(span->versions[0].generation, 5u);
  EXPECT_EQ(span->versions[9].tier, kSourceSsd);
  EXPECT_EQ(span->versions[9].generation, 4u);
  auto without_c = PlanSpan(keys_, index_, "self", {{"c", "rt-c"}});
  ASSERT_TRUE(without_c.has_value());
  EXPECT_EQ(without_c->node, "b");  // 8 SSD blocks before a's 4 DRAM ones
  // Equal spans: DRAM first.
  CandidateIndex equal({});
  for (size_t i = 0; i < 3; ++i) equal.Insert(keys_[i], {On("a", 2), On("z")});
  auto dram = PlanSpan(keys_, equal, "self", {});
  ASSERT_TRUE(dram.has_value());
  EXPECT_EQ(dram->node, "z");
}

// A source preparing SSD blocks answers pending; the requester asks again with the same request id until the grant.
// One out of staging room answers backpressure and the next source is asked, its candidates kept.
class PreparingSources final : public SourceTransport {
 public:
  int pending_answers = 3;
  std::set<std::string> backpressure;
  std::vector<std::pair<std::string, uint64_t>> asked;
  Result<SourceReply> Authorize(const std::string& node, const std::string&, uint64_t request_id,
                                std::span<const SourceBlockVersion> blocks, uint64_t, std::chrono::milliseconds,
                                Deadline) override {
    asked.emplace_back(node, request_id);
    SourceReply reply;
    if (backpressure.count(node) != 0) {
      reply.grant.outcome = SourceOutcome::kBackpressure;
      return reply;
    }
    if (pending_answers-- > 0) {
      reply.grant.outcome = SourceOutcome::kPending;
      reply.grant.retry_after = std::chrono::milliseconds(1);
      return reply;
    }
    reply.grant.outcome = SourceOutcome::kGranted;
    reply.grant.granted = blocks.size();
    reply.grant.grant_id = 1;
    return reply;
  }
  Result<bool> Release(const std::string&, const std::string&, uint64_t, uint64_t, const std::string&,
                       Deadline) override {
    ++released;
    return true;
  }
  int released = 0;
};

// A grant of a span's first piece whose rest is still being read at the source (stop kMore) keeps the candidates of
// the rest: the requester asks for them next.
TEST_F(RemotePlanTest, AGrantWithMoreToComeKeepsTheCandidatesOfTheRest) {
  class Piecewise final : public SourceTransport {
   public:
    Result<SourceReply> Authorize(const std::string&, const std::string&, uint64_t,
                                  std::span<const SourceBlockVersion> blocks, uint64_t, std::chrono::milliseconds,
                                  Deadline) override {
      SourceReply reply;
      reply.grant.outcome = SourceOutcome::kGranted;
      reply.grant.granted = std::min<size_t>(2, blocks.size());
      reply.grant.stop = blocks.size() > 2 ? SourceOutcome::kMore : SourceOutcome::kGranted;
      reply.grant.grant_id = 1;
      return reply;
    }
    Result<bool> Release(const std::string&, const std::string&, uint64_t, uint64_t, const std::string&,
                         Deadline) override {
      return true;
    }
  } source;
  for (size_t i = 0; i < 4; ++i) index_.Insert(keys_[i], {On("a", 2)});
  AuthorizeOutcome first = AuthorizeBest(std::span(keys_).first(4), index_, source, Options());
  ASSERT_TRUE(first.authorized.has_value());
  EXPECT_EQ(first.authorized->reply.grant.granted, 2u);
  EXPECT_EQ(index_.Find(keys_[2]).size(), 1u);
  AuthorizeOutcome rest = AuthorizeBest(std::span(keys_).subspan(2, 2), index_, source, Options());
  ASSERT_TRUE(rest.authorized.has_value());
  EXPECT_EQ(rest.authorized->reply.grant.granted, 2u);
}

TEST_F(RemotePlanTest, APendingSourceIsAskedAgainWithTheSameRequestIdAndBackpressureMovesOn) {
  for (size_t i = 0; i < 4; ++i) index_.Insert(keys_[i], {On("a", 2), On("b", 2)});
  PreparingSources sources;
  sources.backpressure = {"a"};
  AuthorizeOutcome outcome = AuthorizeBest(std::span(keys_).first(4), index_, sources, Options());
  ASSERT_TRUE(outcome.authorized.has_value());
  EXPECT_EQ(outcome.authorized->span.node, "b");
  EXPECT_EQ(outcome.backpressure, 1u);
  EXPECT_EQ(outcome.polls, 3u);
  ASSERT_EQ(sources.asked.size(), 5u);  // a once, b four times
  for (size_t i = 1; i < 5; ++i) EXPECT_EQ(sources.asked[i], std::make_pair(std::string("b"), uint64_t{7}));
  EXPECT_EQ(index_.Find(keys_[0]).size(), 2u);  // backpressure keeps a's candidates
  // Still pending at the deadline: no grant, and the source is told to drop the preparation.
  PreparingSources slow;
  slow.pending_answers = 1 << 30;
  AuthorizeOptions hurried = Options();
  hurried.deadline = Deadline::After(std::chrono::milliseconds(30));
  AuthorizeOutcome late = AuthorizeBest(std::span(keys_).first(4), index_, slow, hurried);
  EXPECT_FALSE(late.authorized.has_value());
  EXPECT_GE(slow.released, 1);
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
