#include "storage/record.h"

// For a stack-allocated XXH3_state_t (its layout is stable for the libxxhash this links).
#define XXH_STATIC_LINKING_ONLY
#include <fmt/format.h>

#include <array>
#include <bit>
#include <cstring>

#include "base/xxh3.h"

namespace orbitkv::storage {
namespace {

// Byte offsets of the header fields (docs/formats/ssd_record.md). Integers are little-endian.
constexpr size_t kMagicOffset = 0;                                               // u32
constexpr size_t kVersionOffset = 4;                                             // u16
constexpr size_t kHeaderSizeOffset = 6;                                          // u16, always kRecordHeaderBytes
constexpr size_t kPayloadOffset = 8;                                             // u64 payload bytes
constexpr size_t kGenerationOffset = 16;                                         // u64 residence generation
constexpr size_t kEpochOffset = 24;                                              // u64 write epoch
constexpr size_t kChecksumOffset = 32;                                           // u64 xxh3-64
constexpr size_t kReserved1Offset = 40;                                          // 24 zero bytes
constexpr size_t kKeyOffset = 64;                                                // 128-byte StateKey encoding
constexpr size_t kReserved2Offset = kKeyOffset + state::StateKey::kEncodedSize;  // zero to the end

static_assert(std::endian::native == std::endian::little, "records are written in host (little-endian) order");
static_assert(kReserved1Offset == kChecksumOffset + 8);
static_assert(kKeyOffset == kReserved1Offset + 24);
static_assert(kReserved2Offset == 192);
static_assert(kRecordHeaderBytes == kReserved2Offset + 64, "the header is 256 bytes");
static_assert(kRecordAlignment % kRecordHeaderBytes == 0);
static_assert(kRecordHeaderBytes <= UINT16_MAX);

template <typename T>
void Put(std::span<uint8_t> out, size_t offset, T value) {
  std::memcpy(out.data() + offset, &value, sizeof(T));
}

template <typename T>
T Get(std::span<const uint8_t> in, size_t offset) {
  T value;
  std::memcpy(&value, in.data() + offset, sizeof(T));
  return value;
}

bool AllZero(std::span<const uint8_t> bytes) {
  for (uint8_t b : bytes) {
    if (b != 0) return false;
  }
  return true;
}

// xxh3-64 over the header with its checksum field zeroed, then the payload.
uint64_t ComputeChecksum(std::span<const uint8_t> header, std::span<const uint8_t> payload) {
  std::array<uint8_t, kRecordHeaderBytes> copy;
  std::memcpy(copy.data(), header.data(), kRecordHeaderBytes);
  std::memset(copy.data() + kChecksumOffset, 0, sizeof(uint64_t));
  XXH3_state_t state;
  XXH3_INITSTATE(&state);
  XXH3_64bits_reset(&state);
  Xxh3Update(&state, copy.data(), copy.size());
  Xxh3Update(&state, payload.data(), payload.size());
  return XXH3_64bits_digest(&state);
}

}  // namespace

uint64_t PaddedPayloadBytes(uint64_t payload_bytes) {
  ORBITKV_CHECK_MSG(payload_bytes <= kMaxRecordPayloadBytes, "payload of {} bytes", payload_bytes);
  return (payload_bytes + kRecordAlignment - 1) / kRecordAlignment * kRecordAlignment;
}

uint64_t RecordBytes(uint64_t payload_bytes) { return kRecordPayloadOffset + PaddedPayloadBytes(payload_bytes); }

Status EncodeRecordHeader(const RecordHeader& header, std::span<const uint8_t> payload,
                          std::span<uint8_t, kRecordHeaderBytes> out) {
  if (payload.size() != header.payload_bytes) {
    return Status::InvalidArgument(
        fmt::format("record payload is {} bytes but the header says {}", payload.size(), header.payload_bytes));
  }
  if (header.payload_bytes > kMaxRecordPayloadBytes) {
    return Status::InvalidArgument(
        fmt::format("record payload of {} bytes exceeds {}", header.payload_bytes, kMaxRecordPayloadBytes));
  }
  std::memset(out.data(), 0, out.size());
  Put<uint32_t>(out, kMagicOffset, kRecordMagic);
  Put<uint16_t>(out, kVersionOffset, kRecordFormatVersion);
  Put<uint16_t>(out, kHeaderSizeOffset, static_cast<uint16_t>(kRecordHeaderBytes));
  Put<uint64_t>(out, kPayloadOffset, header.payload_bytes);
  Put<uint64_t>(out, kGenerationOffset, header.residence_generation);
  Put<uint64_t>(out, kEpochOffset, header.write_epoch);
  header.key.EncodeTo(out.subspan<kKeyOffset, state::StateKey::kEncodedSize>());
  Put<uint64_t>(out, kChecksumOffset, ComputeChecksum(out, payload));
  return Status::Ok();
}

Status EncodeRecord(const RecordHeader& header, std::span<const uint8_t> payload, std::span<uint8_t> out) {
  if (header.payload_bytes > kMaxRecordPayloadBytes) {
    return Status::InvalidArgument(
        fmt::format("record payload of {} bytes exceeds {}", header.payload_bytes, kMaxRecordPayloadBytes));
  }
  const uint64_t total = RecordBytes(header.payload_bytes);
  if (out.size() < total) {
    return Status::InvalidArgument(fmt::format("record needs {} bytes, buffer has {}", total, out.size()));
  }
  if (payload.size() != header.payload_bytes) {
    return Status::InvalidArgument(
        fmt::format("record payload is {} bytes but the header says {}", payload.size(), header.payload_bytes));
  }
  // Copied first and checksummed from the copy (still in cache), so the checksum covers exactly
  // the bytes written even if the source changed meanwhile.
  if (!payload.empty()) {
    std::memcpy(out.data() + kRecordPayloadOffset, payload.data(), payload.size());
  }
  const size_t used = kRecordPayloadOffset + payload.size();
  std::memset(out.data() + used, 0, total - used);
  std::memset(out.data() + kRecordHeaderBytes, 0, kRecordPayloadOffset - kRecordHeaderBytes);
  return EncodeRecordHeader(header, out.subspan(kRecordPayloadOffset, payload.size()), out.first<kRecordHeaderBytes>());
}

Result<RecordHeader> DecodeRecordHeader(std::span<const uint8_t> bytes) {
  if (bytes.size() < kRecordHeaderBytes) {
    return Status::InvalidArgument(
        fmt::format("record header needs {} bytes, got {}", kRecordHeaderBytes, bytes.size()));
  }
  const uint32_t magic = Get<uint32_t>(bytes, kMagicOffset);
  if (magic != kRecordMagic) return Status::DataLoss(fmt::format("bad record magic {:#010x}", magic));
  const uint16_t version = Get<uint16_t>(bytes, kVersionOffset);
  if (version != kRecordFormatVersion) {
    return Status::FailedPrecondition(
        fmt::format("record format version {} is not supported (this build reads {})", version, kRecordFormatVersion));
  }
  const uint16_t header_bytes = Get<uint16_t>(bytes, kHeaderSizeOffset);
  if (header_bytes != kRecordHeaderBytes) {
    return Status::DataLoss(fmt::format("record header size {} is not {}", header_bytes, kRecordHeaderBytes));
  }
  const uint64_t payload_bytes = Get<uint64_t>(bytes, kPayloadOffset);
  if (payload_bytes > kMaxRecordPayloadBytes) {
    return Status::DataLoss(fmt::format("record payload size {} exceeds {}", payload_bytes, kMaxRecordPayloadBytes));
  }
  if (!AllZero(bytes.subspan(kReserved1Offset, kKeyOffset - kReserved1Offset)) ||
      !AllZero(bytes.subspan(kReserved2Offset, kRecordHeaderBytes - kReserved2Offset))) {
    return Status::DataLoss("record header has non-zero reserved bytes");
  }
  auto key = state::StateKey::Decode(bytes.subspan(kKeyOffset, state::StateKey::kEncodedSize));
  if (!key.ok()) return Status::DataLoss(fmt::format("record key: {}", key.status().ToString()));
  return RecordHeader{.key = std::move(key).value(),
                      .payload_bytes = payload_bytes,
                      .residence_generation = Get<uint64_t>(bytes, kGenerationOffset),
                      .write_epoch = Get<uint64_t>(bytes, kEpochOffset),
                      .checksum = Get<uint64_t>(bytes, kChecksumOffset)};
}

Result<RecordHeader> VerifyRecord(std::span<const uint8_t> record) {
  if (record.size() < kRecordPayloadOffset) {
    ORBITKV_RETURN_IF_ERROR(DecodeRecordHeader(record).status());
    return Status::DataLoss(fmt::format("record of {} bytes is shorter than its header page", record.size()));
  }
  return VerifyRecordParts(record.first(kRecordPayloadOffset), record.subspan(kRecordPayloadOffset));
}

Result<RecordHeader> VerifyRecordParts(std::span<const uint8_t> header_page, std::span<const uint8_t> payload) {
  ORBITKV_ASSIGN_OR_RETURN(RecordHeader header, DecodeRecordHeader(header_page));
  if (payload.size() < header.payload_bytes) {
    return Status::DataLoss(
        fmt::format("record of {} payload bytes is truncated to {}", header.payload_bytes, payload.size()));
  }
  const uint64_t actual = ComputeChecksum(header_page.first(kRecordHeaderBytes), payload.first(header.payload_bytes));
  if (actual != header.checksum) {
    return Status::DataLoss(fmt::format("record checksum mismatch for {}: stored {:#018x}, computed {:#018x}",
                                        header.key.ToString(), header.checksum, actual));
  }
  return header;
}

}  // namespace orbitkv::storage
