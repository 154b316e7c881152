#include "transfer/descriptor.h"

#include <cstring>
#include <string>

#include "base/check.h"
#include "transfer/wire.h"

namespace orbitkv::transfer {

void EncodeDescriptor(const RegionDescriptor& d, std::vector<uint8_t>& out) {
  ORBITKV_CHECK_MSG(d.rkey.size() <= kMaxRkeyBytes, "rkey of {} bytes", d.rkey.size());
  size_t at = out.size();
  out.resize(at + kDescriptorHeaderBytes + d.rkey.size());
  uint8_t* p = out.data() + at;
  wire::Store32(p + 0, kDescriptorMagic);
  wire::Store16(p + 4, kDescriptorVersion);
  wire::Store16(p + 6, static_cast<uint16_t>(d.rkey.size()));
  wire::Store64(p + 8, d.engine_id);
  wire::Store32(p + 16, d.region_index);
  wire::Store32(p + 20, d.generation);
  wire::Store64(p + 24, d.base_address);
  wire::Store64(p + 32, d.length);
  if (!d.rkey.empty()) std::memcpy(p + kDescriptorHeaderBytes, d.rkey.data(), d.rkey.size());
}

std::vector<uint8_t> EncodeDescriptor(const RegionDescriptor& descriptor) {
  std::vector<uint8_t> out;
  EncodeDescriptor(descriptor, out);
  return out;
}

Result<RegionDescriptor> DecodeDescriptor(std::span<const uint8_t> bytes) {
  if (bytes.size() < kDescriptorHeaderBytes) {
    return Status::InvalidArgument(fmt::format("transfer descriptor: {} bytes, shorter than its {}-byte header",
                                               bytes.size(), kDescriptorHeaderBytes));
  }
  const uint8_t* p = bytes.data();
  if (wire::Load32(p) != kDescriptorMagic) {
    return Status::InvalidArgument(fmt::format("transfer descriptor: bad magic {:#x}", wire::Load32(p)));
  }
  if (uint16_t version = wire::Load16(p + 4); version != kDescriptorVersion) {
    return Status::InvalidArgument(
        fmt::format("transfer descriptor: version {} (this build reads {})", version, kDescriptorVersion));
  }
  size_t rkey_bytes = wire::Load16(p + 6);
  if (rkey_bytes > kMaxRkeyBytes) {
    return Status::InvalidArgument(
        fmt::format("transfer descriptor: rkey of {} bytes (max {})", rkey_bytes, kMaxRkeyBytes));
  }
  if (bytes.size() != kDescriptorHeaderBytes + rkey_bytes) {
    return Status::InvalidArgument(fmt::format("transfer descriptor: {} bytes, expected {} for a {}-byte rkey",
                                               bytes.size(), kDescriptorHeaderBytes + rkey_bytes, rkey_bytes));
  }
  RegionDescriptor d;
  d.engine_id = wire::Load64(p + 8);
  d.region_index = wire::Load32(p + 16);
  d.generation = wire::Load32(p + 20);
  d.base_address = wire::Load64(p + 24);
  d.length = wire::Load64(p + 32);
  if (d.length == 0) return Status::InvalidArgument("transfer descriptor: empty region");
  if (d.base_address + d.length < d.base_address) {
    return Status::InvalidArgument("transfer descriptor: region wraps the address space");
  }
  d.rkey.assign(p + kDescriptorHeaderBytes, p + kDescriptorHeaderBytes + rkey_bytes);
  return d;
}

std::string ToHex(std::span<const uint8_t> bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (uint8_t b : bytes) {
    out.push_back(kDigits[b >> 4]);
    out.push_back(kDigits[b & 15]);
  }
  return out;
}

Result<std::vector<uint8_t>> FromHex(std::string_view hex) {
  if (hex.size() % 2 != 0) return Status::InvalidArgument("hex: odd number of digits");
  auto digit = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  std::vector<uint8_t> out(hex.size() / 2);
  for (size_t i = 0; i < out.size(); ++i) {
    int hi = digit(hex[2 * i]);
    int lo = digit(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return Status::InvalidArgument(fmt::format("hex: bad digit at {}", 2 * i));
    out[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return out;
}

}  // namespace orbitkv::transfer
