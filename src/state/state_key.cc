#include "state/state_key.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstring>

#include "base/check.h"

namespace orbitkv::state {
namespace {

// Encoded layout (all integers little-endian); see docs/formats/state_key.md.
constexpr size_t kOffVersion = 0;     // u8 encoding version
constexpr size_t kOffNativeLen = 1;   // u8 native key length (1..64)
constexpr size_t kOffKeyVersion = 2;  // u16 engine key scheme version
constexpr size_t kOffGroup = 4;       // u32 recovery group
constexpr size_t kOffSpanBegin = 8;   // u64
constexpr size_t kOffSpanEnd = 16;    // u64
constexpr size_t kOffNamespace = 24;  // 32 bytes
constexpr size_t kOffNative = 56;     // 64 bytes, zero padded
constexpr size_t kOffReserved = 120;  // 8 bytes, zero
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

// An 8-byte little-endian load (one instruction on the little-endian hosts we build for).
uint64_t Load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  if constexpr (std::endian::native == std::endian::big) v = __builtin_bswap64(v);
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
    return Status::InvalidArgument(
        fmt::format("state key: native key has {} bytes, at most {} allowed", native_key.size(), kMaxNativeKeyBytes));
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

Status StateKey::AppendChain(const StateNamespace& ns, uint32_t group, uint64_t first_token, uint32_t page_tokens,
                             std::span<const uint8_t> natives, size_t native_bytes, uint16_t key_version,
                             std::vector<StateKey>* out, bool fixed_span) {
  if (native_bytes == 0 || native_bytes > kMaxNativeKeyBytes || natives.size() % native_bytes != 0) {
    return Status::InvalidArgument(
        fmt::format("state key chain: native keys of {} bytes (1-{} allowed) do not divide {} bytes", native_bytes,
                    kMaxNativeKeyBytes, natives.size()));
  }
  if (page_tokens == 0) return Status::InvalidArgument("state key chain: pages of 0 tokens");
  const uint64_t count = natives.size() / native_bytes;
  const uint64_t stride = fixed_span ? 0 : page_tokens;
  if (count != 0 && first_token > UINT64_MAX - std::max<uint64_t>(count * stride, page_tokens)) {
    return Status::InvalidArgument("state key chain: token spans overflow");
  }
  StateKey proto;
  proto.ns_ = ns;
  proto.group_ = group;
  proto.key_version_ = key_version;
  proto.native_len_ = static_cast<uint8_t>(native_bytes);
  out->reserve(out->size() + count);
  for (uint64_t i = 0; i < count; ++i) {
    out->push_back(proto);
    StateKey& key = out->back();
    key.span_ = TokenRange{first_token + i * stride, first_token + i * stride + page_tokens};
    std::memcpy(key.native_.data(), natives.data() + i * native_bytes, native_bytes);
  }
  return Status::Ok();
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
  // Lookups hash every key of a 128-page query, so this is on the hot path. Two independent
  // multiply-xor lanes keep the dependency chains short; one SplitMix64 finalizer at the end gives
  // full avalanche. The namespace is already a uniform digest, so two of its words suffice.
  constexpr uint64_t kA = 0x9e3779b97f4a7c15ULL;
  constexpr uint64_t kB = 0xc2b2ae3d27d4eb4fULL;
  const uint8_t* digest = ns_.digest().bytes.data();
  uint64_t a = Load64(digest) ^ kA;
  uint64_t b = Load64(digest + 8) ^ kB;
  a = (a ^ (static_cast<uint64_t>(group_) << 32 | static_cast<uint64_t>(key_version_) << 16 | native_len_)) * kB;
  b = (b ^ span_.begin) * kA;
  a = (a ^ span_.end) * kA;
  size_t i = 0;
  for (; i + 16 <= native_len_; i += 16) {
    a = (a ^ Load64(native_.data() + i)) * kB;
    b = (b ^ Load64(native_.data() + i + 8)) * kA;
    a ^= a >> 29;
    b ^= b >> 31;
  }
  // native_ is zero beyond native_len_, so whole words past the end are well defined.
  for (; i < native_len_; i += 8) a = (a ^ Load64(native_.data() + i)) * kB;
  return Mix64(a ^ (b * kA) ^ (b >> 32));
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
