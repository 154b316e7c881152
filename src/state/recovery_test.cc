#include "state/recovery.h"

#include <gtest/gtest.h>

#include "state/test_util.h"

namespace orbitkv::state {
namespace {

using testing::SampleNamespace;

constexpr uint32_t kPage = 16;
constexpr uint32_t kFull = 0, kSwa = 1, kMamba = 2;

// Full attention + 40-token sliding window + recurrent/conv checkpoint: a Qwen3.5/Jamba-like hybrid.
RecoveryContract Hybrid() {
  auto c = RecoveryContract::Compile(
      SampleNamespace(), kPage,
      {{.group = kMamba,
        .kind = RecoveryRuleKind::kCheckpoint,
        .components = {StateComponent::kRecurrent, StateComponent::kConvolution}},
       {.group = kFull, .kind = RecoveryRuleKind::kPrefix, .components = {StateComponent::kAttentionKv}},
       {.group = kSwa,
        .kind = RecoveryRuleKind::kWindow,
        .components = {StateComponent::kSlidingWindow},
        .window_tokens = 40}});
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

TEST(RecoveryContractTest, CompileSortsGroups) {
  RecoveryContract c = Hybrid();
  ASSERT_EQ(c.rules().size(), 3u);
  EXPECT_EQ(c.rules()[0].group, kFull);
  EXPECT_EQ(c.rules()[1].group, kSwa);
  EXPECT_EQ(c.rules()[2].group, kMamba);
  EXPECT_EQ(c.page_tokens(), kPage);
}

TEST(RecoveryContractTest, CompileNormalizesComponents) {
  auto c = RecoveryContract::Compile(
      SampleNamespace(), kPage,
      {{.group = 0,
        .kind = RecoveryRuleKind::kCheckpoint,
        .components = {StateComponent::kConvolution, StateComponent::kRecurrent, StateComponent::kConvolution}}});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->rules()[0].components,
            (std::vector<StateComponent>{StateComponent::kRecurrent, StateComponent::kConvolution}));
}

TEST(RecoveryContractTest, CompileRejectsBadRules) {
  StateNamespace ns = SampleNamespace();
  auto code = [&](uint32_t page, std::vector<RecoveryRule> rules) {
    return RecoveryContract::Compile(ns, page, std::move(rules)).status().code();
  };
  EXPECT_EQ(code(0, {{.group = 0}}), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(16, {}), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(16, {{.group = 1}, {.group = 1}}), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(16, {{.group = 0, .kind = RecoveryRuleKind::kWindow}}), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(16, {{.group = 0, .kind = RecoveryRuleKind::kPrefix, .window_tokens = 8}}),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(code(16, {{.group = 0, .kind = static_cast<RecoveryRuleKind>(9)}}), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(16, {{.group = 0, .components = {static_cast<StateComponent>(42)}}}), StatusCode::kInvalidArgument);
  auto dup = RecoveryContract::Compile(ns, 16, {{.group = 5}, {.group = 5}});
  EXPECT_NE(dup.status().message().find("group 5 declared twice"), std::string_view::npos);
}

TEST(RecoveryContractTest, PrefixCoversTheWholeTail) {
  auto d = Hybrid().RequiredRanges(SampleNamespace(), 32, 160);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->origin, 32u);
  EXPECT_EQ(d->end, 160u);
  EXPECT_EQ(d->ranges[0], (GroupRange{kFull, 32, 160}));
}

TEST(RecoveryContractTest, WindowRoundsUpToPagesBeforeEnd) {
  // 40-token window needs 39 past tokens -> 3 pages (48 tokens) before end.
  auto d = Hybrid().RequiredRanges(SampleNamespace(), 0, 160);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->ranges[1], (GroupRange{kSwa, 112, 160}));
}

TEST(RecoveryContractTest, WindowIsCappedByTheTail) {
  // Only 32 tokens past the origin: the window cannot reach into the engine's valid prefix.
  auto d = Hybrid().RequiredRanges(SampleNamespace(), 128, 160);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->ranges[1], (GroupRange{kSwa, 128, 160}));
  // And never before token 0.
  d = Hybrid().RequiredRanges(SampleNamespace(), 0, 16);
  EXPECT_EQ(d->ranges[1], (GroupRange{kSwa, 0, 16}));
}

TEST(RecoveryContractTest, WindowOfOneTokenNeedsNothing) {
  auto c = RecoveryContract::Compile(SampleNamespace(), kPage,
                                     {{.group = 0, .kind = RecoveryRuleKind::kWindow, .window_tokens = 1}});
  ASSERT_TRUE(c.ok());
  auto d = c->RequiredRanges(SampleNamespace(), 0, 64);
  EXPECT_TRUE(d->ranges[0].empty());
  EXPECT_EQ(d->ranges[0].begin, 64u);
}

TEST(RecoveryContractTest, WindowExactlyOnPageBoundary) {
  // Window 17 -> 16 past tokens -> exactly one page.
  auto c = RecoveryContract::Compile(SampleNamespace(), kPage,
                                     {{.group = 0, .kind = RecoveryRuleKind::kWindow, .window_tokens = 17}});
  auto d = c->RequiredRanges(SampleNamespace(), 0, 64);
  EXPECT_EQ(d->ranges[0], (GroupRange{0, 48, 64}));
}

TEST(RecoveryContractTest, HugeWindowNeverShrinksTheDemand) {
  // A window of UINT64_MAX tokens ("unbounded") must demand the whole tail, not wrap around to nothing.
  auto c = RecoveryContract::Compile(SampleNamespace(), kPage,
                                     {{.group = 0, .kind = RecoveryRuleKind::kWindow, .window_tokens = UINT64_MAX}});
  ASSERT_TRUE(c.ok());
  auto d = c->RequiredRanges(SampleNamespace(), 32, 160);
  EXPECT_EQ(d->ranges[0], (GroupRange{0, 32, 160}));
  auto no_swa = c->RestorableBoundaries(SampleNamespace(), 0, 64, std::vector<GroupCoverage>{});
  EXPECT_TRUE(no_swa->empty());
}

TEST(RecoveryContractTest, SpansAtTheTopOfTheRangeDoNotWrap) {
  RecoveryContract c = Hybrid();
  const uint64_t top = UINT64_MAX / kPage * kPage;  // Highest aligned position.
  auto b = c.RestorableBoundaries(SampleNamespace(), top, top, std::vector<GroupCoverage>{});
  ASSERT_TRUE(b.ok());
  EXPECT_TRUE(b->empty());
  std::vector<GroupCoverage> cov = {{kFull, {top / kPage - 1}}, {kSwa, {top / kPage - 1}}, {kMamba, {top / kPage - 1}}};
  b = c.RestorableBoundaries(SampleNamespace(), top - kPage, top, cov);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(*b, (std::vector<uint64_t>{top}));
  auto d = c.RequiredRanges(SampleNamespace(), top - 4 * kPage, top);
  EXPECT_EQ(d->ranges[1], (GroupRange{kSwa, top - 3 * kPage, top}));
}

TEST(RecoveryContractTest, TooManyGroupsOrCellsAreRejected) {
  std::vector<RecoveryRule> many;
  for (uint32_t g = 0; g <= RecoveryContract::kMaxGroups; ++g) many.push_back({.group = g});
  EXPECT_EQ(RecoveryContract::Compile(SampleNamespace(), kPage, many).status().code(), StatusCode::kInvalidArgument);
  many.pop_back();
  auto c = RecoveryContract::Compile(SampleNamespace(), kPage, many);
  ASSERT_TRUE(c.ok());
  // 64 groups x 2^20 pages exceeds the cell budget even though the page count alone is allowed.
  EXPECT_EQ(c->RestorableBoundaries(SampleNamespace(), 0, (uint64_t{1} << 20) * kPage, {}).status().code(),
            StatusCode::kOutOfRange);
}

TEST(RecoveryContractTest, CheckpointSelectsTheFinalPage) {
  auto d = Hybrid().RequiredRanges(SampleNamespace(), 0, 160);
  EXPECT_EQ(d->ranges[2], (GroupRange{kMamba, 144, 160}));
}

TEST(RecoveryContractTest, EmptySpanNeedsNothing) {
  auto d = Hybrid().RequiredRanges(SampleNamespace(), 64, 64);
  ASSERT_TRUE(d.ok());
  for (const auto& r : d->ranges) EXPECT_TRUE(r.empty());
}

TEST(RecoveryContractTest, RequiredRangesRejectsBadInput) {
  RecoveryContract c = Hybrid();
  StateNamespace ns = SampleNamespace();
  EXPECT_EQ(c.RequiredRanges(ns, 0, 17).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c.RequiredRanges(ns, 8, 32).status().code(), StatusCode::kInvalidArgument);
  auto backwards = c.RequiredRanges(ns, 64, 32);
  EXPECT_EQ(backwards.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(backwards.status().message().find("end 32 < origin 64"), std::string_view::npos);
  auto other = testing::SampleIdentity();
  other.engine_kind = "sglang";
  auto mismatch = c.RequiredRanges(*DeriveNamespace(other), 0, 32);
  EXPECT_EQ(mismatch.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(mismatch.status().message().find("does not match"), std::string_view::npos);
}

std::vector<uint64_t> Pages(uint64_t begin, uint64_t end) {
  std::vector<uint64_t> out;
  for (uint64_t p = begin; p < end; ++p) out.push_back(p);
  return out;
}

TEST(RestorableBoundariesTest, FullAttentionOnlyIsTheContiguousPrefix) {
  auto c = RecoveryContract::Compile(SampleNamespace(), kPage, {{.group = 0}});
  std::vector<GroupCoverage> cov = {{0, {0, 1, 2, 4, 5}}};
  auto b = c->RestorableBoundaries(SampleNamespace(), 0, 96, cov);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(*b, (std::vector<uint64_t>{16, 32, 48}));
}

TEST(RestorableBoundariesTest, HybridBoundariesCanBeNonContiguous) {
  // Full attention has pages 0..9; SWA has pages 0..9; the recurrent checkpoint exists only at pages 3 and 7
  // (sealed every 4 pages), so only boundaries 64 and 128 are legal.
  std::vector<GroupCoverage> cov = {{kFull, Pages(0, 10)}, {kSwa, Pages(0, 10)}, {kMamba, {3, 7}}};
  auto b = Hybrid().RestorableBoundaries(SampleNamespace(), 0, 160, cov);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(*b, (std::vector<uint64_t>{64, 128}));
}

TEST(RestorableBoundariesTest, SwaHoleOnlyMattersInsideTheWindow) {
  // An SWA page evicted early (page 1) blocks boundaries whose window still needs it, not later ones.
  std::vector<uint64_t> swa = Pages(0, 10);
  swa.erase(swa.begin() + 1);
  std::vector<GroupCoverage> cov = {{kFull, Pages(0, 10)}, {kSwa, swa}, {kMamba, Pages(0, 10)}};
  auto b = Hybrid().RestorableBoundaries(SampleNamespace(), 0, 160, cov);
  ASSERT_TRUE(b.ok());
  // Window reach is 3 pages: boundaries 32..64 need page 1; 16 does not (it needs page 0 only); 80+ do not.
  EXPECT_EQ(*b, (std::vector<uint64_t>{16, 80, 96, 112, 128, 144, 160}));
}

TEST(RestorableBoundariesTest, MissingGroupMeansNoBoundary) {
  std::vector<GroupCoverage> cov = {{kFull, Pages(0, 10)}, {kSwa, Pages(0, 10)}};
  auto b = Hybrid().RestorableBoundaries(SampleNamespace(), 0, 160, cov);
  ASSERT_TRUE(b.ok());
  EXPECT_TRUE(b->empty());
}

TEST(RestorableBoundariesTest, OriginShiftsDemand) {
  // Pages before the origin are already valid in HBM: they are not required.
  auto c = RecoveryContract::Compile(SampleNamespace(), kPage, {{.group = 0}});
  std::vector<GroupCoverage> cov = {{0, {4, 5}}};
  auto b = c->RestorableBoundaries(SampleNamespace(), 64, 112, cov);
  EXPECT_EQ(*b, (std::vector<uint64_t>{80, 96}));
}

TEST(RestorableBoundariesTest, RejectsBadCoverage) {
  StateNamespace ns = SampleNamespace();
  std::vector<GroupCoverage> unknown = {{77, {0}}};
  EXPECT_EQ(Hybrid().RestorableBoundaries(ns, 0, 32, unknown).status().code(), StatusCode::kInvalidArgument);
  std::vector<GroupCoverage> twice = {{kFull, {0}}, {kFull, {1}}};
  EXPECT_EQ(Hybrid().RestorableBoundaries(ns, 0, 32, twice).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Hybrid().RestorableBoundaries(ns, 0, 33, {}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Hybrid().RestorableBoundaries(ns, 0, uint64_t{1} << 40, {}).status().code(), StatusCode::kOutOfRange);
}

TEST(IntersectBoundariesTest, IntersectsAcrossRanks) {
  std::vector<std::vector<uint64_t>> sets = {{16, 32, 64, 128}, {32, 64, 96, 128}, {64, 128, 160}};
  EXPECT_EQ(IntersectBoundaries(sets), (std::vector<uint64_t>{64, 128}));
  EXPECT_TRUE(IntersectBoundaries({}).empty());
  std::vector<std::vector<uint64_t>> one = {{16, 32}};
  EXPECT_EQ(IntersectBoundaries(one), (std::vector<uint64_t>{16, 32}));
  std::vector<std::vector<uint64_t>> disjoint = {{16}, {32}};
  EXPECT_TRUE(IntersectBoundaries(disjoint).empty());
}

TEST(IntersectBoundariesTest, NotTheMinimumOfMaxima) {
  // Rank 0 can stop at 48 or 80; rank 1 at 64 or 80. min(max) would be 80 — legal here — but min of the other
  // maxima (e.g. rank 0 = {48}, rank 1 = {64}) would give 48, which rank 1 cannot restore.
  std::vector<std::vector<uint64_t>> sets = {{48}, {64}};
  EXPECT_TRUE(IntersectBoundaries(sets).empty());
}

}  // namespace
}  // namespace orbitkv::state
