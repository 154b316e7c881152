#include "state/state_key.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "base/check.h"

namespace orbitkv::state {
namespace {

// Encoded layout (all integers little-endian); see docs/formats/state_key.md.
constexpr size_t kOffVersion = 0;      // u8 encoding version
constexpr size_t kOffNativeLen = 1;    // u8 native key length (1..64)
constexpr size_t kOffKeyVersion = 2;   // u16 engine key scheme version
constexpr size_t kOffGroup = 4;        // u32 recovery group
constexpr size_t kOffSpanBegin = 8;    // u64
constexpr size_t kOffSpanEnd = 16;     // u64
constexpr size_t kOffNamespace = 24;   // 32 bytes
constexpr size_t kOffNative = 56;      // 64 bytes, zero padded
constexpr size_t kOffReserved = 120;   // 8 bytes, zero
static_assert(kOffNamespace + sizeof(Digest256::bytes) == kOffNative);
static_assert(kOffNative + kMaxNativeKeyBytes == kOffReserved);
static_assert(kOffReserved + 8 == StateKey::kEncodedSize, "StateKey encoding must stay 128 bytes");

void PutLe(uint8_t* p, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint64_t GetLe(const uint8_t* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

uint64_t Mix64(uint64_t x) {
  // The finalizer of SplitMix64: a bijection with full avalanche.
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

}  // namespace

Result<StateKey> StateKey::Create(const StateNamespace& ns, uint32_t group, TokenRange span,
                                  std::span<const uint8_t> native_key, uint16_t key_version) {
  if (native_key.empty()) return Status::InvalidArgument("state key: native key is empty");
  if (native_key.size() > kMaxNativeKeyBytes) {
    return Status::InvalidArgument(fmt::format("state key: native key has {} bytes, at most {} allowed",
                                               native_key.size(), kMaxNativeKeyBytes));
  }
  if (span.empty()) {
    return Status::InvalidArgument(fmt::format("state key: empty token span [{}, {})", span.begin, span.end));
  }
  StateKey key;
  key.ns_ = ns;
  key.group_ = group;
  key.span_ = span;
  key.key_version_ = key_version;
  key.native_len_ = static_cast<uint8_t>(native_key.size());
  std::copy(native_key.begin(), native_key.end(), key.native_.begin());
  return key;
}

Result<StateKey> StateKey::Create(const StateNamespace& ns, uint32_t group, TokenRange span,
                                  std::string_view native_key, uint16_t key_version) {
  return Create(ns, group, span,
                std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(native_key.data()), native_key.size()),
                key_version);
}

void StateKey::EncodeTo(std::span<uint8_t, kEncodedSize> out) const {
  uint8_t* p = out.data();
  std::memset(p, 0, kEncodedSize);
  p[kOffVersion] = kStateKeyEncodingVersion;
  p[kOffNativeLen] = native_len_;
  PutLe(p + kOffKeyVersion, key_version_, 2);
  PutLe(p + kOffGroup, group_, 4);
  PutLe(p + kOffSpanBegin, span_.begin, 8);
  PutLe(p + kOffSpanEnd, span_.end, 8);
  std::memcpy(p + kOffNamespace, ns_.digest().bytes.data(), 32);
  std::memcpy(p + kOffNative, native_.data(), native_len_);
}

std::array<uint8_t, StateKey::kEncodedSize> StateKey::Encode() const {
  std::array<uint8_t, kEncodedSize> out;
  EncodeTo(out);
  return out;
}

Result<StateKey> StateKey::Decode(std::span<const uint8_t> bytes) {
  if (bytes.size() != kEncodedSize) {
    return Status::InvalidArgument(
        fmt::format("state key: encoding has {} bytes, expected {}", bytes.size(), kEncodedSize));
  }
  const uint8_t* p = bytes.data();
  if (p[kOffVersion] != kStateKeyEncodingVersion) {
    return Status::FailedPrecondition(fmt::format("state key: encoding version {} is not supported (this build: {})",
                                                  p[kOffVersion], kStateKeyEncodingVersion));
  }
  const size_t native_len = p[kOffNativeLen];
  if (native_len == 0 || native_len > kMaxNativeKeyBytes) {
    return Status::DataLoss(fmt::format("state key: native key length {} out of range", native_len));
  }
  for (size_t i = kOffNative + native_len; i < kEncodedSize; ++i) {
    if (p[i] != 0) return Status::DataLoss(fmt::format("state key: nonzero padding at byte {}", i));
  }
  TokenRange span{GetLe(p + kOffSpanBegin, 8), GetLe(p + kOffSpanEnd, 8)};
  if (span.empty()) {
    return Status::DataLoss(fmt::format("state key: empty token span [{}, {})", span.begin, span.end));
  }
  Digest256 digest;
  std::memcpy(digest.bytes.data(), p + kOffNamespace, 32);
  return Create(StateNamespace(digest), static_cast<uint32_t>(GetLe(p + kOffGroup, 4)), span,
                bytes.subspan(kOffNative, native_len), static_cast<uint16_t>(GetLe(p + kOffKeyVersion, 2)));
}

uint64_t StateKey::Hash64() const {
  // The namespace is already a uniform digest; fold in the rest word by word.
  uint64_t h = GetLe(ns_.digest().bytes.data(), 8);
  auto fold = [&h](uint64_t word) { h = Mix64(h ^ word) + 0x9e3779b97f4a7c15ULL; };
  fold(GetLe(ns_.digest().bytes.data() + 8, 8));
  fold(static_cast<uint64_t>(group_) << 32 | static_cast<uint64_t>(key_version_) << 16 | native_len_);
  fold(span_.begin);
  fold(span_.end);
  for (size_t i = 0; i < native_len_; i += 8) fold(GetLe(native_.data() + i, 8));
  return Mix64(h);
}

std::string StateKey::ToString() const {
  std::string native_hex;
  for (size_t i = 0; i < std::min<size_t>(native_len_, 4); ++i) native_hex += fmt::format("{:02x}", native_[i]);
  return fmt::format("ns={} g={} t=[{},{}) k={}..({}B) v={}", ns_.ShortHex(), group_, span_.begin, span_.end,
                     native_hex, native_len_, key_version_);
}

bool operator==(const StateKey& a, const StateKey& b) {
  return a.ns_ == b.ns_ && a.group_ == b.group_ && a.span_ == b.span_ && a.key_version_ == b.key_version_ &&
         a.native_len_ == b.native_len_ && a.native_ == b.native_;
}

std::strong_ordering operator<=>(const StateKey& a, const StateKey& b) {
  if (auto c = a.ns_ <=> b.ns_; c != 0) return c;
  if (auto c = a.group_ <=> b.group_; c != 0) return c;
  if (auto c = a.span_ <=> b.span_; c != 0) return c;
  if (auto c = a.key_version_ <=> b.key_version_; c != 0) return c;
  if (auto c = a.native_len_ <=> b.native_len_; c != 0) return c;
  return a.native_ <=> b.native_;
}

uint32_t ShardOf(const StateKey& key, uint32_t num_shards) {
  ORBITKV_CHECK_MSG(num_shards >= 1, "ShardOf with zero shards");
  // SHA-256("orbitkv.shard.v1\0" || encoded key), hashed in one call from one stack buffer.
  static constexpr char kDomain[] = "orbitkv.shard.v1";
  std::array<uint8_t, sizeof(kDomain) + StateKey::kEncodedSize> buf;
  std::memcpy(buf.data(), kDomain, sizeof(kDomain));
  key.EncodeTo(std::span<uint8_t, StateKey::kEncodedSize>(buf.data() + sizeof(kDomain), StateKey::kEncodedSize));
  Digest256 d = Sha256::Of(buf);
  uint64_t prefix = 0;
  for (int i = 0; i < 8; ++i) prefix = prefix << 8 | d.bytes[i];  // Big-endian: the digest's leading bytes.
  return static_cast<uint32_t>(prefix % num_shards);
}

}  // namespace orbitkv::state
