#include "state/format.h"

#include <gtest/gtest.h>

#include "state/component.h"

namespace orbitkv::state {
namespace {

TEST(FormatTest, NamesRoundTrip) {
  for (DType d : {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat8E4M3, DType::kFloat8E5M2,
                  DType::kInt8, DType::kUInt8}) {
    EXPECT_EQ(ParseDType(DTypeName(d)), d);
    EXPECT_GT(DTypeBytes(d), 0u);
  }
  for (KvLayout l : {KvLayout::kLayerFirst, KvLayout::kLayerFirstSplitKv, KvLayout::kPageFirst,
                     KvLayout::kPageFirstDirect, KvLayout::kMla}) {
    EXPECT_EQ(ParseLayout(LayoutName(l)), l);
  }
  for (uint8_t v = 1; v <= 7; ++v) {
    auto c = static_cast<StateComponent>(v);
    EXPECT_TRUE(IsValidComponent(v));
    EXPECT_EQ(ParseComponent(ComponentName(c)), c);
  }
  EXPECT_FALSE(IsValidComponent(0));
  EXPECT_FALSE(IsValidComponent(8));
  EXPECT_FALSE(ParseDType("bfloat17").has_value());
  EXPECT_EQ(DTypeBytes(DType::kBFloat16), 2u);
}

TEST(FormatTest, ValidateAcceptsDefaults) { EXPECT_TRUE(StateFormat{}.Validate().ok()); }

TEST(FormatTest, ValidateRejectsBadFields) {
  StateFormat f;
  f.page_size_tokens = 0;
  EXPECT_NE(f.Validate().message().find("page_size_tokens"), std::string_view::npos);

  f = StateFormat{};
  f.dtype = static_cast<DType>(99);
  EXPECT_NE(f.Validate().message().find("dtype"), std::string_view::npos);

  f = StateFormat{};
  f.layout = static_cast<KvLayout>(0);
  EXPECT_NE(f.Validate().message().find("layout"), std::string_view::npos);

  f = StateFormat{};
  f.parallel = {.tp_size = 2, .tp_rank = 2};
  EXPECT_NE(f.Validate().message().find("tp_rank 2 >= tp_size 2"), std::string_view::npos);

  f = StateFormat{};
  f.parallel = {.tp_size = 1, .tp_rank = 0, .pp_size = 0};
  EXPECT_EQ(f.Validate().code(), StatusCode::kInvalidArgument);
}

TEST(FormatTest, EqualityCoversEveryField) {
  StateFormat a, b;
  EXPECT_EQ(a, b);
  b.layout_detail = "HND";
  EXPECT_NE(a, b);
  b = a;
  b.parallel.pp_rank = 1;
  b.parallel.pp_size = 2;
  EXPECT_NE(a, b);
}

}  // namespace
}  // namespace orbitkv::state
