#include "base/runtime_id.h"

#include <gtest/gtest.h>

#include <set>

namespace orbitkv {
namespace {

TEST(RuntimeIdTest, NewIdsAreVersion4AndRoundTripThroughText) {
  std::set<std::string> seen;
  for (int i = 0; i < 100; ++i) {
    const RuntimeId id = RuntimeId::New();
    const std::string text = id.ToString();
    ASSERT_EQ(text.size(), 36u);
    EXPECT_EQ(text[14], '4');
    Result<RuntimeId> parsed = RuntimeId::Parse(text);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, id);
    EXPECT_NE(id.incarnation(), 0u);
    EXPECT_TRUE(seen.insert(text).second);
  }
}

TEST(RuntimeIdTest, IncarnationIsTheFirst64BitsBigEndian) {
  Result<RuntimeId> id = RuntimeId::Parse("0123abcd-4567-4def-8123-456789abcdef");
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(id->incarnation(), 0x0123abcd45674defull);
}

TEST(RuntimeIdTest, MalformedTextIsRefused) {
  for (const char* bad : {"", "0123abcd-4567-4def-8123-456789abcde",
                          "0123ABCD-4567-4def-8123-456789abcdef",  // upper case
                          "0123abcd-4567-1def-8123-456789abcdef",  // version 1
                          "0123abcd-4567-4def-c123-456789abcdef",  // wrong variant
                          "0123abcd+4567-4def-8123-456789abcdef", "0123abcd-4567-4def-8123-456789abcdeg"}) {
    EXPECT_EQ(RuntimeId::Parse(bad).status().code(), StatusCode::kInvalidArgument) << bad;
  }
}

}  // namespace
}  // namespace orbitkv
