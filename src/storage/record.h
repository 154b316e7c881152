// SSD record: the self-describing, 4 KiB-aligned unit the SSD tier stores one block in.
//
// A record is a fixed 256-byte header followed directly by the payload, zero-padded to a multiple
// of 4 KiB (docs/formats/ssd_record.md). The header names the block (its 128-byte StateKey
// encoding), its payload size, the residence generation and write epoch it was written under, and
// an xxh3-64 checksum over the header (with the checksum field zeroed) and the payload. A restart
// can therefore rebuild the SSD index from the records alone, and a torn or corrupted record fails
// VerifyRecord() instead of being served.
//
// The padding after the payload is not covered by the checksum and is never interpreted.
//
// Thread safety: free functions over caller-owned buffers; safe from any thread.
#ifndef ORBITKV_STORAGE_RECORD_H_
#define ORBITKV_STORAGE_RECORD_H_

#include <cstddef>
#include <cstdint>
#include <span>

#include "base/result.h"
#include "base/status.h"
#include "state/state_key.h"

namespace orbitkv::storage {

inline constexpr uint32_t kRecordMagic = 0x52534B4F;  // "OKSR" in little-endian byte order.
inline constexpr uint16_t kRecordFormatVersion = 2;
inline constexpr size_t kRecordHeaderBytes = 256;
inline constexpr size_t kRecordAlignment = 4096;
// The payload starts on the record's second page, so it is read and written straight from and into
// 4 KiB-aligned memory (the DRAM pool's blocks) with O_DIRECT, without a staging copy.
inline constexpr size_t kRecordPayloadOffset = kRecordAlignment;
// Larger payloads are rejected on encode and treated as corruption on decode (records are 256 KiB -
// 4 MiB).
inline constexpr uint64_t kMaxRecordPayloadBytes = uint64_t{1} << 30;

struct RecordHeader {
  state::StateKey key;
  uint64_t payload_bytes = 0;
  // Residence generation of the slot the record was written to; tells a reused slot's records
  // apart.
  uint64_t residence_generation = 0;
  // Manager write epoch; orders two records of the same key found on restart.
  uint64_t write_epoch = 0;
  // Filled by DecodeRecordHeader(); ignored (recomputed) by EncodeRecordHeader().
  uint64_t checksum = 0;
};

// The header page plus the payload rounded up to kRecordAlignment. `payload_bytes` must be <=
// kMaxRecordPayloadBytes.
uint64_t RecordBytes(uint64_t payload_bytes);
// The payload rounded up to kRecordAlignment (the bytes written or read at kRecordPayloadOffset).
uint64_t PaddedPayloadBytes(uint64_t payload_bytes);

// Writes the header for `header` and `payload` into `out`, computing the checksum. InvalidArgument
// when payload.size() != header.payload_bytes or the payload exceeds kMaxRecordPayloadBytes; `out`
// is then untouched.
Status EncodeRecordHeader(const RecordHeader& header, std::span<const uint8_t> payload,
                          std::span<uint8_t, kRecordHeaderBytes> out);

// Writes a whole record (header page, payload at kRecordPayloadOffset, zero padding) into the first
// RecordBytes(payload.size()) bytes of `out`. InvalidArgument for the errors of
// EncodeRecordHeader() or when `out` is too small.
Status EncodeRecord(const RecordHeader& header, std::span<const uint8_t> payload, std::span<uint8_t> out);

// Parses the first kRecordHeaderBytes of `bytes` without looking at the payload. InvalidArgument
// when fewer bytes are given; FailedPrecondition for a well-formed header of another format version
// (the caller drops it and logs); DataLoss for a bad magic, header size, payload size, key or
// non-zero reserved field.
Result<RecordHeader> DecodeRecordHeader(std::span<const uint8_t> bytes);

// Decodes the header at the start of `record` and checks the checksum over it and the payload that
// follows. The errors of DecodeRecordHeader(); DataLoss when `record` holds fewer than header +
// payload bytes (a truncated read) or the checksum does not match (a torn or corrupted record).
// Returns the header on success.
Result<RecordHeader> VerifyRecord(std::span<const uint8_t> record);

// The same for a record read in two parts: its header page (at least kRecordHeaderBytes) and its
// payload (at least the header's payload bytes; extra bytes are padding and ignored).
Result<RecordHeader> VerifyRecordParts(std::span<const uint8_t> header, std::span<const uint8_t> payload);

}  // namespace orbitkv::storage

#endif  // ORBITKV_STORAGE_RECORD_H_
