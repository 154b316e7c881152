#include "transfer/checksum.h"

#include <gtest/gtest.h>

#include <vector>

namespace orbitkv::transfer {
namespace {

TEST(ChecksumTest, DetectsAnySingleByteFlip) {
  std::vector<uint8_t> a(4096), b(1000);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<uint8_t>(i * 7);
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<uint8_t>(i * 13);
  BatchChecksum ref(2);
  ref.Set(0, FragmentHash(a.data(), a.size()));
  ref.Set(1, FragmentHash(b.data(), b.size()));
  const uint64_t expected = ref.Finish();
  for (size_t at : {size_t{0}, size_t{1}, size_t{2047}, size_t{4095}}) {
    std::vector<uint8_t> c = a;
    c[at] ^= 1;
    BatchChecksum check(2);
    check.Set(0, FragmentHash(c.data(), c.size()));
    check.Set(1, FragmentHash(b.data(), b.size()));
    EXPECT_NE(check.Finish(), expected) << at;
  }
}

TEST(ChecksumTest, OrderOfLandingDoesNotMatterButFragmentOrderDoes) {
  uint64_t h0 = FragmentHash("first", 5);
  uint64_t h1 = FragmentHash("second", 6);
  BatchChecksum in_order(2), landed_reversed(2), swapped(2);
  in_order.Set(0, h0);
  in_order.Set(1, h1);
  landed_reversed.Set(1, h1);
  landed_reversed.Set(0, h0);
  swapped.Set(0, h1);
  swapped.Set(1, h0);
  EXPECT_EQ(in_order.Finish(), landed_reversed.Finish());
  EXPECT_NE(in_order.Finish(), swapped.Finish());
}

}  // namespace
}  // namespace orbitkv::transfer
