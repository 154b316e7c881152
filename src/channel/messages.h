// Typed hot-path messages and their encodings into descriptors + payload slots (wire.h).
//
// Encoders are used by the engine-side client; decoders by the Manager, on bytes it already copied
// out of shared memory. Decoders validate everything (counts against payload size and limits,
// StateKey encodings, reserved fields) and return InvalidArgument naming the problem; they never
// trust a length field.
#ifndef ORBITKV_CHANNEL_MESSAGES_H_
#define ORBITKV_CHANNEL_MESSAGES_H_

#include <cstdint>
#include <span>
#include <vector>

#include "base/result.h"
#include "channel/wire.h"
#include "state/state_key.h"

namespace orbitkv::channel {

// A chain of pages named by native keys (see QueryKeysHeader).
struct QueryRequest {
  uint64_t instance = 0;
  uint32_t group = 0;
  uint64_t first_token = 0;
  uint32_t page_tokens = 0;
  uint16_t key_version = 1;
  uint8_t native_bytes = 0;
  std::vector<uint8_t> natives;  // count x native_bytes

  size_t count() const { return native_bytes == 0 ? 0 : natives.size() / native_bytes; }
  std::span<const uint8_t> native(size_t i) const {
    return {natives.data() + i * native_bytes, native_bytes};
  }
  // The compact form of `keys` when they form a chain (same group, version and native length,
  // consecutive equal-sized token spans); InvalidArgument otherwise.
  static Result<QueryRequest> FromKeys(uint64_t instance, std::span<const state::StateKey> keys);
};

struct RestoreRequest {
  uint64_t instance = 0;
  uint64_t lease = 0;  // core::LeaseId packed
  uint32_t group = 0;
  std::vector<uint32_t> pages;  // destination page per leased block, kSkipPage to leave one out
  // Layer-wise (kRestoreLayers) when set: only these buffers of each block; the lease stays unless
  // consume_lease.
  bool layers = false;
  uint32_t first_buffer = 0;
  uint32_t buffer_count = 0;
  bool consume_lease = true;
};

struct SaveItem {
  state::StateKey key;
  uint32_t page;
};

struct SaveRequest {
  uint64_t instance = 0;
  uint32_t group = 0;
  std::vector<SaveItem> items;
};

struct ReleaseRequest {
  uint64_t instance = 0;
  uint64_t lease = 0;
};

// The most keys (or pages) one request can carry in a slot of `slot_bytes`.
size_t MaxQueryKeys(uint32_t slot_bytes, size_t native_bytes);
size_t MaxSaveItems(uint32_t slot_bytes);
size_t MaxRestorePages(uint32_t slot_bytes);

// Encoders fill `d`'s opcode and args and write the payload into `slot`, returning the payload
// bytes used; InvalidArgument when the message does not fit the slot (callers split requests by the
// Max* limits).
Result<uint32_t> EncodeQuery(const QueryRequest& request, Descriptor* d, std::span<uint8_t> slot);
Result<uint32_t> EncodeRestore(const RestoreRequest& request, Descriptor* d,
                               std::span<uint8_t> slot);
Result<uint32_t> EncodeSave(const SaveRequest& request, Descriptor* d, std::span<uint8_t> slot);
void EncodeRelease(const ReleaseRequest& request, Descriptor* d);

// Decoders take the validated descriptor and the payload bytes it names (already copied to private
// memory).
Result<QueryRequest> DecodeQuery(const Descriptor& d, std::span<const uint8_t> payload);
Result<RestoreRequest> DecodeRestore(const Descriptor& d, std::span<const uint8_t> payload);
Result<SaveRequest> DecodeSave(const Descriptor& d, std::span<const uint8_t> payload);
Result<ReleaseRequest> DecodeRelease(const Descriptor& d, std::span<const uint8_t> payload);

// Checks the fields every request descriptor must satisfy, independent of session state: magic,
// version, a known opcode, request flags, zero reserved fields, an odd generation, payload within
// `slot_bytes`.
Status ValidateRequestDescriptor(const Descriptor& d, uint32_t payload_slots, uint32_t slot_bytes);

}  // namespace orbitkv::channel

#endif  // ORBITKV_CHANNEL_MESSAGES_H_
