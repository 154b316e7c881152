#include "base/runtime_id.h"

#include <sys/random.h>

#include <cerrno>

#include <fmt/format.h>

#include "base/check.h"

namespace orbitkv {
namespace {

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

}  // namespace

RuntimeId RuntimeId::New() {
  RuntimeId id;
  size_t filled = 0;
  while (filled < id.bytes_.size()) {
    const ssize_t n = getrandom(id.bytes_.data() + filled, id.bytes_.size() - filled, 0);
    if (n < 0 && errno == EINTR) continue;
    ORBITKV_CHECK_MSG(n > 0, "getrandom failed: errno {}", errno);
    filled += static_cast<size_t>(n);
  }
  id.bytes_[6] = static_cast<uint8_t>((id.bytes_[6] & 0x0f) | 0x40);  // version 4
  id.bytes_[8] = static_cast<uint8_t>((id.bytes_[8] & 0x3f) | 0x80);  // RFC 4122 variant
  return id;
}

Result<RuntimeId> RuntimeId::Parse(std::string_view text) {
  const auto invalid = [&] {
    return Status::InvalidArgument(
        fmt::format("'{}' is not a lower-case version-4 UUID (8-4-4-4-12 hex digits)", text));
  };
  if (text.size() != 36) return invalid();
  RuntimeId id;
  size_t byte = 0;
  for (size_t i = 0; i < text.size();) {
    if (i == 8 || i == 13 || i == 18 || i == 23) {
      if (text[i] != '-') return invalid();
      ++i;
      continue;
    }
    const int high = HexValue(text[i]);
    const int low = i + 1 < text.size() ? HexValue(text[i + 1]) : -1;
    if (high < 0 || low < 0 || i + 1 == 8 || i + 1 == 13 || i + 1 == 18 || i + 1 == 23) {
      return invalid();
    }
    id.bytes_[byte++] = static_cast<uint8_t>(high << 4 | low);
    i += 2;
  }
  if ((id.bytes_[6] >> 4) != 4 || (id.bytes_[8] & 0xc0) != 0x80) return invalid();
  return id;
}

std::string RuntimeId::ToString() const {
  const auto& b = bytes_;
  return fmt::format(
      "{:02x}{:02x}{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}{:02x}{:02x}"
      "{:02x}{:02x}",
      b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

uint64_t RuntimeId::incarnation() const {
  uint64_t value = 0;
  for (int i = 0; i < 8; ++i) value = value << 8 | bytes_[i];
  return value;  // bit 14 (the version nibble's 0x4) is always set
}

}  // namespace orbitkv
