#include "transfer/descriptor.h"

#include <gtest/gtest.h>

#include "transfer/wire.h"

namespace orbitkv::transfer {
namespace {

RegionDescriptor Sample() {
  RegionDescriptor d;
  d.engine_id = 0x1122334455667788ull;
  d.region_index = 7;
  d.generation = 3;
  d.base_address = 0x7f0000001000ull;
  d.length = 1 << 20;
  d.rkey = {1, 2, 3, 4, 5};
  return d;
}

TEST(DescriptorTest, RoundTripsEveryField) {
  RegionDescriptor d = Sample();
  std::vector<uint8_t> bytes = EncodeDescriptor(d);
  EXPECT_EQ(bytes.size(), kDescriptorHeaderBytes + d.rkey.size());
  Result<RegionDescriptor> back = DecodeDescriptor(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, d);
}

TEST(DescriptorTest, RejectsTruncatedAndPaddedInput) {
  std::vector<uint8_t> bytes = EncodeDescriptor(Sample());
  for (size_t cut = 0; cut < bytes.size(); ++cut) {
    EXPECT_EQ(DecodeDescriptor(std::span(bytes.data(), cut)).status().code(), StatusCode::kInvalidArgument) << cut;
  }
  bytes.push_back(0);
  EXPECT_EQ(DecodeDescriptor(bytes).status().code(), StatusCode::kInvalidArgument);
}

TEST(DescriptorTest, RejectsBadMagicVersionRkeyLengthAndBounds) {
  std::vector<uint8_t> good = EncodeDescriptor(Sample());
  auto corrupt = [&](size_t at, uint8_t value) {
    std::vector<uint8_t> b = good;
    b[at] = value;
    return DecodeDescriptor(b).status();
  };
  EXPECT_NE(corrupt(0, 'X').message().find("magic"), std::string_view::npos);
  EXPECT_NE(corrupt(4, 9).message().find("version"), std::string_view::npos);
  EXPECT_EQ(corrupt(6, 200).code(),
            StatusCode::kInvalidArgument);  // rkey length disagrees with the size.

  RegionDescriptor empty = Sample();
  empty.length = 0;
  EXPECT_EQ(DecodeDescriptor(EncodeDescriptor(empty)).status().code(), StatusCode::kInvalidArgument);
  RegionDescriptor wraps = Sample();
  wraps.base_address = UINT64_MAX - 10;
  EXPECT_NE(DecodeDescriptor(EncodeDescriptor(wraps)).status().message().find("wraps"), std::string_view::npos);
}

TEST(DescriptorTest, HexRoundTripAndErrors) {
  std::vector<uint8_t> bytes = EncodeDescriptor(Sample());
  Result<std::vector<uint8_t>> back = FromHex(ToHex(bytes));
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, bytes);
  EXPECT_FALSE(FromHex("abc").ok());
  EXPECT_FALSE(FromHex("zz").ok());
  EXPECT_EQ(ToHex(std::vector<uint8_t>{0x0f, 0xa0}), "0fa0");
}

TEST(WireTest, LayoutsAreFixed) {
  EXPECT_EQ(sizeof(wire::ReadRequest), 56u);
  EXPECT_EQ(sizeof(wire::WireFragment), 24u);
  EXPECT_EQ(sizeof(wire::DataHeader), 16u);
  EXPECT_EQ(sizeof(wire::DoneHeader), 24u);
  EXPECT_EQ(offsetof(wire::DoneHeader, checksum), 16u);
}

}  // namespace
}  // namespace orbitkv::transfer
