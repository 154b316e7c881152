#include "storage/record.h"

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "state/digest.h"
#include "state/state_key.h"

namespace orbitkv::storage {
namespace {

state::StateKey SampleKey(uint64_t first_token = 32) {
  state::StateNamespace ns(state::Sha256::Of(std::string_view("storage test namespace")));
  auto key = state::StateKey::Create(ns, 1, {first_token, first_token + 16}, std::string_view("native-key-bytes"));
  EXPECT_TRUE(key.ok()) << key.status();
  return *key;
}

std::vector<uint8_t> Payload(size_t n, uint8_t seed) {
  std::vector<uint8_t> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(seed + i * 31 + (i >> 8));
  return out;
}

// Encodes a whole record for `payload` (generation 7, epoch 9).
std::vector<uint8_t> MakeRecord(const std::vector<uint8_t>& payload) {
  RecordHeader header{.key = SampleKey(), .payload_bytes = payload.size(), .residence_generation = 7, .write_epoch = 9};
  std::vector<uint8_t> record(RecordBytes(payload.size()), 0xEE);
  EXPECT_TRUE(EncodeRecord(header, payload, record).ok());
  return record;
}

void Put16(std::vector<uint8_t>& b, size_t off, uint16_t v) { std::memcpy(b.data() + off, &v, sizeof(v)); }
void Put64(std::vector<uint8_t>& b, size_t off, uint64_t v) { std::memcpy(b.data() + off, &v, sizeof(v)); }

TEST(RecordTest, RecordBytesIsTheHeaderPagePlusThePayloadRoundedToFourKiB) {
  EXPECT_EQ(RecordBytes(0), 4096u);
  EXPECT_EQ(RecordBytes(1), 8192u);
  EXPECT_EQ(RecordBytes(4096), 8192u);
  EXPECT_EQ(RecordBytes(4097), 12288u);
  EXPECT_EQ(RecordBytes(1 << 20), (1u << 20) + 4096u);
  EXPECT_EQ(PaddedPayloadBytes(100), 4096u);
  EXPECT_EQ(kRecordPayloadOffset, 4096u);
}

TEST(RecordTest, RoundTripsEveryField) {
  const auto payload = Payload(10000, 3);
  const auto record = MakeRecord(payload);
  ASSERT_EQ(record.size(), 4096u + 12288u);
  auto verified = VerifyRecord(record);
  ASSERT_TRUE(verified.ok()) << verified.status();
  EXPECT_EQ(verified->key, SampleKey());
  EXPECT_EQ(verified->payload_bytes, payload.size());
  EXPECT_EQ(verified->residence_generation, 7u);
  EXPECT_EQ(verified->write_epoch, 9u);
  EXPECT_NE(verified->checksum, 0u);
  EXPECT_EQ(std::memcmp(record.data() + kRecordPayloadOffset, payload.data(), payload.size()), 0);
  // Padding (the header page's rest and after the payload) is zeroed, whatever the buffer held.
  for (size_t i = kRecordHeaderBytes; i < kRecordPayloadOffset; ++i) ASSERT_EQ(record[i], 0) << i;
  for (size_t i = kRecordPayloadOffset + payload.size(); i < record.size(); ++i) ASSERT_EQ(record[i], 0) << i;
  // Verified in two parts (header page and payload read into different memory), the same.
  auto parts =
      VerifyRecordParts(std::span(record).first(kRecordPayloadOffset), std::span(record).subspan(kRecordPayloadOffset));
  ASSERT_TRUE(parts.ok()) << parts.status();
  EXPECT_EQ(parts->checksum, verified->checksum);
  EXPECT_EQ(VerifyRecordParts(std::span(record).first(kRecordPayloadOffset),
                              std::span(record).subspan(kRecordPayloadOffset, payload.size() - 1))
                .status()
                .code(),
            StatusCode::kDataLoss);
  auto header = DecodeRecordHeader(record);
  ASSERT_TRUE(header.ok());
  EXPECT_EQ(header->checksum, verified->checksum);
}

TEST(RecordTest, EmptyPayloadRoundTrips) {
  const auto record = MakeRecord({});
  auto verified = VerifyRecord(record);
  ASSERT_TRUE(verified.ok()) << verified.status();
  EXPECT_EQ(verified->payload_bytes, 0u);
}

TEST(RecordTest, ChecksumCoversHeaderFields) {
  const auto payload = Payload(100, 1);
  RecordHeader a{.key = SampleKey(), .payload_bytes = 100, .residence_generation = 1, .write_epoch = 1};
  RecordHeader b = a;
  b.write_epoch = 2;
  std::array<uint8_t, kRecordHeaderBytes> ha{}, hb{};
  ASSERT_TRUE(EncodeRecordHeader(a, payload, ha).ok());
  ASSERT_TRUE(EncodeRecordHeader(b, payload, hb).ok());
  EXPECT_NE(DecodeRecordHeader(ha)->checksum, DecodeRecordHeader(hb)->checksum);
}

TEST(RecordTest, EncodeRejectsBadArguments) {
  const auto payload = Payload(100, 1);
  std::array<uint8_t, kRecordHeaderBytes> header_bytes{};
  RecordHeader header{.key = SampleKey(), .payload_bytes = 99};
  EXPECT_EQ(EncodeRecordHeader(header, payload, header_bytes).code(), StatusCode::kInvalidArgument);
  header.payload_bytes = 100;
  std::vector<uint8_t> small(100);
  EXPECT_EQ(EncodeRecord(header, payload, small).code(), StatusCode::kInvalidArgument);
  header.payload_bytes = kMaxRecordPayloadBytes + 1;
  std::vector<uint8_t> big(8192);
  EXPECT_EQ(EncodeRecord(header, payload, big).code(), StatusCode::kInvalidArgument);
}

TEST(RecordTest, RejectsShortHeader) {
  const auto record = MakeRecord(Payload(10, 1));
  EXPECT_EQ(DecodeRecordHeader(std::span(record).first(kRecordHeaderBytes - 1)).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(RecordTest, RejectsBadMagic) {
  auto record = MakeRecord(Payload(10, 1));
  record[0] ^= 0x01;
  EXPECT_EQ(DecodeRecordHeader(record).status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(VerifyRecord(record).status().code(), StatusCode::kDataLoss);
  // A zeroed (never written) slot is not a record either.
  std::vector<uint8_t> zeros(4096, 0);
  EXPECT_EQ(DecodeRecordHeader(zeros).status().code(), StatusCode::kDataLoss);
}

TEST(RecordTest, OtherVersionIsFailedPrecondition) {
  for (uint16_t version : {uint16_t{0}, uint16_t{1}, uint16_t{3}, uint16_t{0xffff}}) {
    auto record = MakeRecord(Payload(10, 1));
    Put16(record, 4, version);
    auto decoded = DecodeRecordHeader(record);
    EXPECT_EQ(decoded.status().code(), StatusCode::kFailedPrecondition) << version;
    EXPECT_NE(decoded.status().message().find("version"), std::string_view::npos);
  }
}

TEST(RecordTest, RejectsBadSizes) {
  auto record = MakeRecord(Payload(10, 1));
  Put16(record, 6, 512);  // Header size.
  EXPECT_EQ(DecodeRecordHeader(record).status().code(), StatusCode::kDataLoss);
  record = MakeRecord(Payload(10, 1));
  Put64(record, 8, kMaxRecordPayloadBytes + 1);  // Payload size.
  EXPECT_EQ(DecodeRecordHeader(record).status().code(), StatusCode::kDataLoss);
  record = MakeRecord(Payload(10, 1));
  Put64(record, 8, 11);  // Plausible but wrong payload size: the checksum catches it.
  EXPECT_TRUE(DecodeRecordHeader(record).ok());
  EXPECT_EQ(VerifyRecord(record).status().code(), StatusCode::kDataLoss);
}

TEST(RecordTest, RejectsNonZeroReservedBytes) {
  for (size_t offset : {size_t{40}, size_t{63}, size_t{192}, size_t{255}}) {
    auto record = MakeRecord(Payload(10, 1));
    record[offset] = 1;
    EXPECT_EQ(DecodeRecordHeader(record).status().code(), StatusCode::kDataLoss) << offset;
  }
}

TEST(RecordTest, RejectsBadKey) {
  auto record = MakeRecord(Payload(10, 1));
  record[64] ^= 0xff;        // The key's encoding version byte region.
  record[64 + 127] ^= 0xff;  // And its padding.
  EXPECT_FALSE(DecodeRecordHeader(record).ok());
  EXPECT_EQ(DecodeRecordHeader(record).status().code(), StatusCode::kDataLoss);
}

TEST(RecordTest, AnyCorruptedPayloadByteIsDataLoss) {
  const auto payload = Payload(5000, 9);
  const auto clean = MakeRecord(payload);
  for (size_t i = kRecordPayloadOffset; i < kRecordPayloadOffset + payload.size(); i += 97) {
    auto record = clean;
    record[i] ^= 0x40;
    EXPECT_EQ(VerifyRecord(record).status().code(), StatusCode::kDataLoss) << i;
  }
  // Padding is outside the checksum.
  auto record = clean;
  record.back() ^= 0xff;
  EXPECT_TRUE(VerifyRecord(record).ok());
}

TEST(RecordTest, CorruptedHeaderFieldIsDataLoss) {
  auto record = MakeRecord(Payload(100, 2));
  Put64(record, 16, 8);  // Residence generation.
  EXPECT_EQ(VerifyRecord(record).status().code(), StatusCode::kDataLoss);
  record = MakeRecord(Payload(100, 2));
  record[32] ^= 1;  // The checksum itself.
  EXPECT_EQ(VerifyRecord(record).status().code(), StatusCode::kDataLoss);
}

TEST(RecordTest, TornRecordsFailVerification) {
  const auto old_payload = Payload(3 * 4096, 1);
  const auto new_payload = Payload(3 * 4096, 2);
  const auto old_record = MakeRecord(old_payload);
  const auto new_record = MakeRecord(new_payload);
  ASSERT_EQ(old_record.size(), new_record.size());
  // New header over a never-written slot.
  std::vector<uint8_t> torn(new_record.size(), 0);
  std::memcpy(torn.data(), new_record.data(), 4096);
  EXPECT_EQ(VerifyRecord(torn).status().code(), StatusCode::kDataLoss);
  // New header over an older record's payload, and every prefix of 4 KiB pages of the new record
  // over it.
  for (size_t pages = 1; pages < new_record.size() / 4096; ++pages) {
    torn = old_record;
    std::memcpy(torn.data(), new_record.data(), pages * 4096);
    EXPECT_EQ(VerifyRecord(torn).status().code(), StatusCode::kDataLoss) << pages;
  }
  // Old header with new trailing pages (pages written out of order).
  torn = old_record;
  std::memcpy(torn.data() + 4096, new_record.data() + 4096, new_record.size() - 4096);
  EXPECT_EQ(VerifyRecord(torn).status().code(), StatusCode::kDataLoss);
  // Truncated read: fewer bytes than header + payload.
  EXPECT_EQ(VerifyRecord(std::span(new_record).first(kRecordPayloadOffset + new_payload.size() - 1)).status().code(),
            StatusCode::kDataLoss);
  EXPECT_TRUE(VerifyRecord(new_record).ok());
}

}  // namespace
}  // namespace orbitkv::storage
