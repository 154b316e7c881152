#include "state/bundle.h"

#include <gtest/gtest.h>

#include "state/test_util.h"

namespace orbitkv::state {
namespace {

using testing::MakeKey;
using testing::SampleNamespace;

RecoveryContract FullPlusCheckpoint() {
  return *RecoveryContract::Compile(SampleNamespace(), 16,
                                    {{.group = 0}, {.group = 2, .kind = RecoveryRuleKind::kCheckpoint}});
}

StateDescriptor Part(uint32_t group, uint64_t begin, uint64_t end,
                     StateComponent component = StateComponent::kAttentionKv) {
  return {SampleNamespace(), group, component, {begin, end}};
}

TEST(StateBundleTest, CompleteBundleIsAccepted) {
  auto demand = FullPlusCheckpoint().RequiredRanges(SampleNamespace(), 0, 48);
  StateBundle b{SampleNamespace(),
                {Part(0, 0, 16), Part(0, 16, 32), Part(0, 32, 48), Part(2, 32, 48, StateComponent::kRecurrent)}};
  EXPECT_TRUE(b.CheckCovers(*demand).ok());
}

TEST(StateBundleTest, OverlappingAndUnorderedPartsStillCover) {
  auto demand = FullPlusCheckpoint().RequiredRanges(SampleNamespace(), 0, 48);
  StateBundle b{SampleNamespace(), {Part(2, 32, 48), Part(0, 16, 48), Part(0, 0, 32)}};
  EXPECT_TRUE(b.CheckCovers(*demand).ok());
}

TEST(StateBundleTest, HoleIsReportedWithItsRange) {
  auto demand = FullPlusCheckpoint().RequiredRanges(SampleNamespace(), 0, 48);
  StateBundle b{SampleNamespace(), {Part(0, 0, 16), Part(0, 32, 48), Part(2, 32, 48)}};
  Status s = b.CheckCovers(*demand);
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_NE(s.message().find("group 0 tokens [16, 48)"), std::string_view::npos);
}

TEST(StateBundleTest, PartsOfAnotherGroupDoNotCount) {
  auto demand = FullPlusCheckpoint().RequiredRanges(SampleNamespace(), 0, 48);
  StateBundle b{SampleNamespace(), {Part(0, 0, 48), Part(1, 32, 48)}};
  EXPECT_EQ(b.CheckCovers(*demand).code(), StatusCode::kNotFound);
}

TEST(StateBundleTest, ForeignNamespaceIsRejected) {
  auto demand = FullPlusCheckpoint().RequiredRanges(SampleNamespace(), 0, 16);
  auto other_id = testing::SampleIdentity();
  other_id.format.dtype = DType::kFloat16;
  StateNamespace other = *DeriveNamespace(other_id);
  StateBundle foreign_bundle{other, {}};
  EXPECT_EQ(foreign_bundle.CheckCovers(*demand).code(), StatusCode::kInvalidArgument);
  StateBundle foreign_part{SampleNamespace(), {Part(0, 0, 16), {other, 2, StateComponent::kRecurrent, {0, 16}}}};
  EXPECT_EQ(foreign_part.CheckCovers(*demand).code(), StatusCode::kInvalidArgument);
}

TEST(StateBundleTest, DescriptorFromKey) {
  StateKey key = MakeKey(SampleNamespace(), 2, {32, 48}, "h");
  StateDescriptor d = StateDescriptor::ForKey(key, StateComponent::kRecurrent);
  EXPECT_EQ(d.ns, key.ns());
  EXPECT_EQ(d.group, 2u);
  EXPECT_EQ(d.span, (TokenRange{32, 48}));
  EXPECT_EQ(d.component, StateComponent::kRecurrent);
}

TEST(StateBundleTest, EmptyDemandNeedsNoParts) {
  auto demand = FullPlusCheckpoint().RequiredRanges(SampleNamespace(), 32, 32);
  EXPECT_TRUE((StateBundle{SampleNamespace(), {}}).CheckCovers(*demand).ok());
}

}  // namespace
}  // namespace orbitkv::state
