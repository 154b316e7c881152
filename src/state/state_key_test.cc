#include "state/state_key.h"

#include <gtest/gtest.h>

#include <array>
#include <set>
#include <unordered_set>

#include "state/test_util.h"

namespace orbitkv::state {
namespace {

using testing::MakeKey;
using testing::SampleNamespace;

TEST(StateKeyTest, CreateValidatesInputs) {
  StateNamespace ns = SampleNamespace();
  EXPECT_EQ(StateKey::Create(ns, 0, {0, 16}, std::string_view("")).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(StateKey::Create(ns, 0, {0, 16}, std::string(65, 'x')).status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(StateKey::Create(ns, 0, {0, 16}, std::string(64, 'x')).ok());
  EXPECT_EQ(StateKey::Create(ns, 0, {16, 16}, std::string_view("k")).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(StateKey::Create(ns, 0, {32, 16}, std::string_view("k")).status().code(), StatusCode::kInvalidArgument);
}

TEST(StateKeyTest, AccessorsReturnWhatWasGiven) {
  StateNamespace ns = SampleNamespace();
  auto key = StateKey::Create(ns, 3, {32, 48}, std::string_view("\x01\x02\x03", 3), 7);
  ASSERT_TRUE(key.ok());
  EXPECT_EQ(key->ns(), ns);
  EXPECT_EQ(key->group(), 3u);
  EXPECT_EQ(key->span(), (TokenRange{32, 48}));
  EXPECT_EQ(key->key_version(), 7);
  ASSERT_EQ(key->native_key().size(), 3u);
  EXPECT_EQ(key->native_key()[2], 3);
  EXPECT_NE(key->ToString().find("g=3 t=[32,48) k=010203..(3B) v=7"), std::string::npos);
}

TEST(StateKeyTest, EncodeDecodeRoundTrip) {
  StateNamespace ns = SampleNamespace();
  for (size_t len : {1, 8, 32, 63, 64}) {
    std::string native(len, '\0');
    for (size_t i = 0; i < len; ++i) native[i] = static_cast<char>(0xA0 + i);
    StateKey key = MakeKey(ns, 9, {1u << 20, (1u << 20) + 16}, native);
    auto encoded = key.Encode();
    auto decoded = StateKey::Decode(encoded);
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    EXPECT_EQ(*decoded, key);
    EXPECT_EQ(decoded->Hash64(), key.Hash64());
  }
}

TEST(StateKeyTest, EncodingLayoutIsFixed) {
  StateKey key = MakeKey(SampleNamespace(), 0x01020304, {0x10, 0x20}, "ab");
  auto e = key.Encode();
  EXPECT_EQ(e[0], kStateKeyEncodingVersion);
  EXPECT_EQ(e[1], 2);     // native length
  EXPECT_EQ(e[2], 1);     // key version, LE
  EXPECT_EQ(e[4], 0x04);  // group, LE
  EXPECT_EQ(e[7], 0x01);
  EXPECT_EQ(e[8], 0x10);   // span begin
  EXPECT_EQ(e[16], 0x20);  // span end
  EXPECT_EQ(e[24], SampleNamespace().digest().bytes[0]);
  EXPECT_EQ(e[56], 'a');
  EXPECT_EQ(e[57], 'b');
  EXPECT_EQ(e[58], 0);
}

TEST(StateKeyTest, DecodeRejectsMalformedBytes) {
  StateKey key = MakeKey(SampleNamespace(), 1, {0, 16}, "abcd");
  auto good = key.Encode();

  EXPECT_EQ(StateKey::Decode(std::span(good).first(127)).status().code(), StatusCode::kInvalidArgument);

  auto bad = good;
  bad[0] = 2;
  EXPECT_EQ(StateKey::Decode(bad).status().code(), StatusCode::kFailedPrecondition);

  bad = good;
  bad[1] = 0;
  EXPECT_EQ(StateKey::Decode(bad).status().code(), StatusCode::kDataLoss);
  bad[1] = 65;
  EXPECT_EQ(StateKey::Decode(bad).status().code(), StatusCode::kDataLoss);

  bad = good;
  bad[56 + 4] = 1;  // Padding after the native key.
  EXPECT_EQ(StateKey::Decode(bad).status().code(), StatusCode::kDataLoss);

  bad = good;
  bad[127] = 1;  // Reserved tail.
  EXPECT_EQ(StateKey::Decode(bad).status().code(), StatusCode::kDataLoss);

  bad = good;
  bad[16] = 0;  // Span end 0 <= begin 0.
  EXPECT_EQ(StateKey::Decode(bad).status().code(), StatusCode::kDataLoss);
}

TEST(StateKeyTest, OrderingAndEqualityAreConsistent) {
  StateNamespace ns = SampleNamespace();
  std::vector<StateKey> keys = {MakeKey(ns, 0, {0, 16}, "a"), MakeKey(ns, 0, {0, 16}, "b"),
                                MakeKey(ns, 1, {0, 16}, "a"), MakeKey(ns, 0, {16, 32}, "a"),
                                MakeKey(ns, 0, {0, 16}, "ab")};
  std::set<StateKey> ordered(keys.begin(), keys.end());
  std::unordered_set<StateKey, StateKeyHash> hashed(keys.begin(), keys.end());
  EXPECT_EQ(ordered.size(), keys.size());
  EXPECT_EQ(hashed.size(), keys.size());
  EXPECT_EQ(keys[0], MakeKey(ns, 0, {0, 16}, "a"));
}

TEST(StateKeyTest, ShardOfIsDeterministicAndInRange) {
  StateNamespace ns = SampleNamespace();
  StateKey key = MakeKey(ns, 0, {0, 16}, "page-0");
  EXPECT_EQ(ShardOf(key, 16), ShardOf(key, 16));
  EXPECT_EQ(ShardOf(key, 1), 0u);
  for (uint32_t n : {2u, 3u, 16u, 1000u}) EXPECT_LT(ShardOf(key, n), n);
}

TEST(StateKeyTest, ShardOfSpreadsKeysOverAllShards) {
  StateNamespace ns = SampleNamespace();
  std::array<int, 16> counts{};
  constexpr int kKeys = 16000;
  for (int i = 0; i < kKeys; ++i) {
    ++counts[ShardOf(MakeKey(ns, 0, {uint64_t(i) * 16, uint64_t(i) * 16 + 16}, "p" + std::to_string(i)), 16)];
  }
  // SHA-256 is deterministic, so this is a fixed outcome, not a flaky statistic: every shard gets a fair share.
  for (int c : counts) {
    EXPECT_GT(c, kKeys / 16 * 8 / 10);
    EXPECT_LT(c, kKeys / 16 * 12 / 10);
  }
}

TEST(StateKeyTest, ShardOfIsDomainSeparatedFromTheKeyDigest) {
  // The shard must not be derivable from a plain SHA-256 of the key bytes: a different domain gives a different
  // digest, so shard placement cannot collide with any other use of the same bytes.
  StateKey key = MakeKey(SampleNamespace(), 0, {0, 16}, "x");
  auto enc = key.Encode();
  Digest256 plain = Sha256::Of(enc);
  uint64_t prefix = 0;
  for (int i = 0; i < 8; ++i) prefix = prefix << 8 | plain.bytes[i];
  int equal = 0;
  for (uint32_t n = 2; n < 200; ++n) equal += (prefix % n) == ShardOf(key, n);
  EXPECT_LT(equal, 100);
}

TEST(StateKeyDeathTest, ShardOfZeroShardsIsABug) {
  StateKey key = MakeKey(SampleNamespace(), 0, {0, 16}, "x");
  EXPECT_DEATH((void)ShardOf(key, 0), "zero shards");
}

}  // namespace
}  // namespace orbitkv::state
