// RegionDescriptor: the compact, self-checking description of one registered region that a peer
// needs to read it (docs/formats/transfer_descriptor.md). It names the serving engine's
// incarnation, the region's {index, generation} and bounds, and carries the UCX rkey packed at
// registration.
//
// A descriptor is untrusted input when it arrives from the network: Decode checks magic, version,
// sizes and bounds and returns InvalidArgument with the reason; it never reads past the given
// bytes. The serving engine re-validates incarnation, index, generation and bounds on every
// request, so a stale descriptor fails with NotFound instead of reading reused memory.
//
// Thread safety: a value type.
#ifndef ORBITKV_TRANSFER_DESCRIPTOR_H_
#define ORBITKV_TRANSFER_DESCRIPTOR_H_

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/result.h"

namespace orbitkv::transfer {

inline constexpr uint32_t kDescriptorMagic = 0x44544B4F;  // "OKTD" little-endian.
inline constexpr uint16_t kDescriptorVersion = 1;
inline constexpr size_t kDescriptorHeaderBytes = 40;
// UCX 1.13 rkeys are tens of bytes per memory domain; 1 KiB leaves room for many domains.
inline constexpr size_t kMaxRkeyBytes = 1024;

struct RegionDescriptor {
  // Random per engine instance; a restarted peer never honours its predecessor's descriptors.
  uint64_t engine_id = 0;
  uint32_t region_index = 0;
  uint32_t generation = 0;
  // The region's base address in the serving process (RMA targets base + offset).
  uint64_t base_address = 0;
  uint64_t length = 0;
  std::vector<uint8_t> rkey;

  friend bool operator==(const RegionDescriptor&, const RegionDescriptor&) = default;
};

// Appends the wire form to `out`. The descriptor must satisfy rkey.size() <= kMaxRkeyBytes
// (CHECKed: the engine builds descriptors itself).
void EncodeDescriptor(const RegionDescriptor& descriptor, std::vector<uint8_t>& out);
std::vector<uint8_t> EncodeDescriptor(const RegionDescriptor& descriptor);

// InvalidArgument (with the field at fault) unless `bytes` is exactly one well-formed descriptor.
Result<RegionDescriptor> DecodeDescriptor(std::span<const uint8_t> bytes);

// Lower-case hex, for passing descriptors through text (tests, CLI).
std::string ToHex(std::span<const uint8_t> bytes);
Result<std::vector<uint8_t>> FromHex(std::string_view hex);

}  // namespace orbitkv::transfer

#endif  // ORBITKV_TRANSFER_DESCRIPTOR_H_
