// StateKey: the identity of one stored block, the same in DRAM, on SSD and in the distributed
// catalog.
//
// A key is the namespace (model, weights, tokenizer, engine, format, rank shard), the recovery
// group inside that namespace, the absolute token span the block covers, the engine's native page
// key bytes (a vLLM block hash, an SGLang page hash) and the version of the engine's key scheme.
// Two blocks are interchangeable only when their keys are equal, so identity is never weakened to a
// token hash or a model name.
//
// A key has a fixed 128-byte encoding (docs/formats/state_key.md) used on the wire and on disk;
// Decode() validates every field and rejects anything it would not have produced.
//
// Thread safety: a value type; immutable after creation.
#ifndef ORBITKV_STATE_STATE_KEY_H_
#define ORBITKV_STATE_STATE_KEY_H_

#include <array>
#include <compare>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "base/result.h"
#include "state/namespace.h"

namespace orbitkv::state {

inline constexpr size_t kMaxNativeKeyBytes = 64;
inline constexpr uint8_t kStateKeyEncodingVersion = 1;

// Half-open token interval [begin, end) in absolute positions from the start of the sequence.
struct TokenRange {
  uint64_t begin = 0;
  uint64_t end = 0;

  uint64_t size() const { return end - begin; }
  bool empty() const { return end <= begin; }
  friend auto operator<=>(const TokenRange&, const TokenRange&) = default;
};

class StateKey {
 public:
  static constexpr size_t kEncodedSize = 128;

  // InvalidArgument for an empty or over-long native key, or an empty span.
  static Result<StateKey> Create(const StateNamespace& ns, uint32_t group, TokenRange span,
                                 std::span<const uint8_t> native_key, uint16_t key_version = 1);
  static Result<StateKey> Create(const StateNamespace& ns, uint32_t group, TokenRange span, std::string_view native_key,
                                 uint16_t key_version = 1);

  // Appends the keys of a chain of pages to `out`: page i covers tokens [first_token + i *
  // page_tokens, + page_tokens) (with `fixed_span`, every page covers [first_token, first_token +
  // page_tokens): native keys that name their whole prefix) and has native key natives[i *
  // native_bytes, + native_bytes). Validates once (the errors of Create, plus overflow), then builds
  // every key in place: the fast path for 128-page queries.
  static Status AppendChain(const StateNamespace& ns, uint32_t group, uint64_t first_token, uint32_t page_tokens,
                            std::span<const uint8_t> natives, size_t native_bytes, uint16_t key_version,
                            std::vector<StateKey>* out, bool fixed_span = false);

  const StateNamespace& ns() const { return ns_; }
  uint32_t group() const { return group_; }
  TokenRange span() const { return span_; }
  uint16_t key_version() const { return key_version_; }
  std::span<const uint8_t> native_key() const { return {native_.data(), native_len_}; }

  // Writes exactly kEncodedSize bytes.
  void EncodeTo(std::span<uint8_t, kEncodedSize> out) const;
  std::array<uint8_t, kEncodedSize> Encode() const;
  // InvalidArgument (wrong size), FailedPrecondition (unknown encoding version) or DataLoss (a
  // field or padding that Encode never writes).
  static Result<StateKey> Decode(std::span<const uint8_t> bytes);

  // Fast, well-mixed 64-bit hash for in-process hash tables (not a security property; use ShardOf
  // for placement).
  uint64_t Hash64() const;

  // "ns=3fa9c1d2e4b5 g=0 t=[0,16) k=9c1e..(32B) v=1" for logs and errors.
  std::string ToString() const;

  friend bool operator==(const StateKey& a, const StateKey& b);
  friend std::strong_ordering operator<=>(const StateKey& a, const StateKey& b);

 private:
  StateKey() = default;

  StateNamespace ns_;
  uint32_t group_ = 0;
  TokenRange span_;
  uint16_t key_version_ = 1;
  uint8_t native_len_ = 0;
  std::array<uint8_t, kMaxNativeKeyBytes> native_{};  // Zero beyond native_len_.
};

// Maps a key to one of `num_shards` shards with domain-separated SHA-256 over the key's canonical
// encoding. Stable across processes, hosts and releases of the same encoding version. num_shards
// must be >= 1.
uint32_t ShardOf(const StateKey& key, uint32_t num_shards);

struct StateKeyHash {
  size_t operator()(const StateKey& key) const { return key.Hash64(); }
};

}  // namespace orbitkv::state

#endif  // ORBITKV_STATE_STATE_KEY_H_
