// Fuzzes the SSD record decoder: DecodeRecordHeader and VerifyRecord must never crash on arbitrary
// bytes, and an accepted record must re-encode to the same header bytes and verify again (the
// header encoding is canonical).
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>

#include "storage/record.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace orbitkv::storage;
  const std::span<const uint8_t> input(data, size);
  auto header = DecodeRecordHeader(input);
  auto verified = VerifyRecord(input);
  if (!header.ok()) {
    if (verified.ok() || verified.status().code() != header.status().code()) std::abort();
    return 0;
  }
  if (header->payload_bytes > kMaxRecordPayloadBytes) std::abort();
  if (!verified.ok()) return 0;
  // Accepted: re-encoding the decoded header over the same payload reproduces the header bytes
  // exactly.
  std::array<uint8_t, kRecordHeaderBytes> again{};
  const auto payload = input.subspan(kRecordHeaderBytes, verified->payload_bytes);
  if (!EncodeRecordHeader(*verified, payload, again).ok()) std::abort();
  if (std::memcmp(again.data(), data, kRecordHeaderBytes) != 0) std::abort();
  if (!(verified->key == header->key) || verified->checksum != header->checksum) std::abort();
  return 0;
}
