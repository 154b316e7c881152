#include "base/result.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>

namespace orbitkv {
namespace {

Result<int> Parse(std::string_view s) {
  if (s.empty()) return Status::InvalidArgument("empty");
  return static_cast<int>(s.size());
}

Result<int> Doubled(std::string_view s) {
  ORBITKV_ASSIGN_OR_RETURN(int n, Parse(s));
  return n * 2;
}

Status UseTwice(std::string_view a, std::string_view b, int* out) {
  ORBITKV_ASSIGN_OR_RETURN(int x, Parse(a));
  ORBITKV_ASSIGN_OR_RETURN(int y, Parse(b));
  *out = x + y;
  return Status::Ok();
}

TEST(ResultTest, HoldsValue) {
  Result<int> r = Parse("abc");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, 3);
  EXPECT_TRUE(r.status().ok());
}

TEST(ResultTest, HoldsError) {
  Result<int> r = Parse("");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.value_or(-1), -1);
}

TEST(ResultTest, AssignOrReturnPropagates) {
  EXPECT_EQ(*Doubled("ab"), 4);
  EXPECT_EQ(Doubled("").status().message(), "empty");
  int out = 0;
  EXPECT_TRUE(UseTwice("a", "bc", &out).ok());
  EXPECT_EQ(out, 3);
  EXPECT_FALSE(UseTwice("a", "", &out).ok());
}

TEST(ResultTest, MoveOnlyValues) {
  Result<std::unique_ptr<int>> r = std::make_unique<int>(7);
  ASSERT_TRUE(r.ok());
  std::unique_ptr<int> p = std::move(r).value();
  EXPECT_EQ(*p, 7);
}

TEST(ResultTest, ConvertingConstruction) {
  Result<std::string> r = "literal";
  EXPECT_EQ(*r, "literal");
  EXPECT_EQ(r->size(), 7u);
}

TEST(ResultDeathTest, ValueOfErrorCrashesWithStatus) {
  Result<int> r = Status::NotFound("gone");
  EXPECT_DEATH((void)r.value(), "NOT_FOUND: gone");
}

TEST(ResultDeathTest, OkStatusWithoutValueCrashes) {
  EXPECT_DEATH(
      {
        Result<int> r = Status::Ok();
        (void)r;
      },
      "OK Status without a value");
}

}  // namespace
}  // namespace orbitkv
