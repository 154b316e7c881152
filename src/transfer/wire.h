// The transfer engine's active-message protocol between a requester and a serving engine, and the
// byte helpers its encoders use (docs/formats/transfer_descriptor.md, "Active messages").
//
// Every header is a fixed little-endian layout copied in and out with memcpy (never cast from
// received bytes), checked with static_assert. A received header shorter than its layout, an
// unknown batch, a fragment index out of range or a length that differs from the request is a
// protocol error: the receiver drops the message and counts it; it never crashes or writes outside
// the destination it validated.
#ifndef ORBITKV_TRANSFER_WIRE_H_
#define ORBITKV_TRANSFER_WIRE_H_

#include <bit>
#include <cstdint>
#include <cstring>

namespace orbitkv::transfer::wire {

static_assert(std::endian::native == std::endian::little, "wire layouts are little-endian; add byte swaps");

inline void Store16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }
inline void Store32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }
inline void Store64(uint8_t* p, uint64_t v) { std::memcpy(p, &v, 8); }
inline uint16_t Load16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
inline uint32_t Load32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline uint64_t Load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// Active-message ids registered on every worker.
enum AmId : unsigned {
  kAmReadRequest = 1,  // requester -> source: header ReadRequest, data = fragment_count x WireFragment.
  kAmData = 2,         // source -> requester: header DataHeader, data = the fragment's bytes.
  kAmDone = 3,         // source -> requester: header DoneHeader, data = UTF-8 error text (may be empty).
  kAmCancel = 4,       // requester -> source: header CancelHeader, no data.
};

// 2: ReadRequest carries a grant id. 3: and the grant's secret (a grant works only for its holder).
inline constexpr uint16_t kProtocolVersion = 3;

// ReadRequest flags.
inline constexpr uint16_t kFlagChecksum = 1 << 0;
// RMA mode: the requester fetched the bytes itself; the source only validates and sends the
// checksum.
inline constexpr uint16_t kFlagChecksumOnly = 1 << 1;

struct ReadRequest {
  uint16_t version;
  uint16_t flags;
  uint32_t fragment_count;
  uint64_t batch_id;
  // The incarnation the requester's descriptors name; a mismatch is refused (NotFound).
  uint64_t engine_id;
  // Time left to the requester's deadline when sent; the source gives up on its sends after it
  // (plus slack).
  uint32_t deadline_ms;
  uint32_t reserved;
  // The source's grant these fragments are read under (0: none).
  uint64_t grant_id;
  // The secret the source returned with that grant to its requester only (over mutually authenticated gRPC); the
  // source serves nothing unless it matches (compared in constant time).
  uint8_t grant_secret[16];
};
static_assert(sizeof(ReadRequest) == 56 && alignof(ReadRequest) == 8);

struct WireFragment {
  uint32_t region_index;
  uint32_t generation;
  uint64_t offset;
  uint64_t length;
};
static_assert(sizeof(WireFragment) == 24);

struct DataHeader {
  uint64_t batch_id;
  uint32_t fragment_index;
  uint32_t reserved;
};
static_assert(sizeof(DataHeader) == 16);

struct DoneHeader {
  uint64_t batch_id;
  // How many kAmData messages the source sent before this one; the requester waits for all of them.
  uint32_t fragments_sent;
  uint8_t status_code;  // orbitkv::StatusCode.
  uint8_t has_checksum;
  uint16_t reserved;
  uint64_t checksum;
};
static_assert(sizeof(DoneHeader) == 24);

struct CancelHeader {
  uint64_t batch_id;
};
static_assert(sizeof(CancelHeader) == 8);

// Bounds that keep one request's control message small and a malicious one harmless.
inline constexpr uint32_t kMaxFragmentsPerBatch = 16384;
inline constexpr size_t kMaxErrorTextBytes = 512;

}  // namespace orbitkv::transfer::wire

#endif  // ORBITKV_TRANSFER_WIRE_H_
