#include "state/digest.h"

#include <gtest/gtest.h>

namespace orbitkv::state {
namespace {

TEST(DigestTest, KnownSha256Vectors) {
  EXPECT_EQ(Sha256::Of(std::string_view("")).ToHex(),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(Sha256::Of(std::string_view("abc")).ToHex(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(DigestTest, IncrementalEqualsOneShot) {
  Sha256 h;
  h.Update(std::string_view("a")).Update(std::string_view("bc"));
  EXPECT_EQ(h.Finish(), Sha256::Of(std::string_view("abc")));
}

TEST(DigestTest, HexRoundTrip) {
  Digest256 d = Sha256::Of(std::string_view("orbitkv"));
  auto back = Digest256::FromHex(d.ToHex());
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, d);
  std::string upper = d.ToHex();
  for (char& c : upper) c = static_cast<char>(std::toupper(c));
  EXPECT_EQ(*Digest256::FromHex(upper), d);
}

TEST(DigestTest, FromHexRejectsBadInput) {
  EXPECT_EQ(Digest256::FromHex("abc").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Digest256::FromHex(std::string(63, 'a') + "g").status().code(), StatusCode::kInvalidArgument);
}

TEST(DigestTest, IsZero) {
  EXPECT_TRUE(Digest256{}.IsZero());
  EXPECT_FALSE(Sha256::Of(std::string_view("x")).IsZero());
}

}  // namespace
}  // namespace orbitkv::state
