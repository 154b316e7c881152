// StateNamespace: the digest that binds a block to everything that determines its bytes.
//
// The namespace is SHA-256 over a canonical, length-prefixed encoding of the model identity, weights revision,
// tokenizer, engine kind, cache scope and StateFormat (which includes the rank shard). Changing any one input
// changes the namespace, so reuse across an incompatible change is a miss, never a wrong read. The encoding is
// documented in docs/formats/state_key.md; it never changes without bumping kNamespaceEncodingVersion.
#ifndef ORBITKV_STATE_NAMESPACE_H_
#define ORBITKV_STATE_NAMESPACE_H_

#include <compare>
#include <string>

#include "base/result.h"
#include "state/digest.h"
#include "state/format.h"

namespace orbitkv::state {

inline constexpr uint8_t kNamespaceEncodingVersion = 1;

class StateNamespace {
 public:
  StateNamespace() = default;
  explicit StateNamespace(const Digest256& digest) : digest_(digest) {}

  const Digest256& digest() const { return digest_; }
  std::string ToHex() const { return digest_.ToHex(); }
  // First 12 hex digits: enough to tell namespaces apart in logs and errors.
  std::string ShortHex() const { return digest_.ToHex().substr(0, 12); }

  friend auto operator<=>(const StateNamespace&, const StateNamespace&) = default;

 private:
  Digest256 digest_;
};

// Everything an engine adapter knows at startup that determines the bytes of its KV blocks.
struct NamespaceIdentity {
  std::string model_id;          // e.g. "Qwen/Qwen3-8B".
  std::string weights_revision;  // Commit or checksum of the weights actually loaded.
  std::string tokenizer;         // Tokenizer identity (name + revision or digest).
  std::string engine_kind;       // "vllm", "sglang", "refengine", ...
  std::string cache_scope;       // Optional isolation scope (tenant, LoRA adapter); empty for none.
  StateFormat format;

  // The canonical byte encoding hashed into the namespace (exposed for tests and docs).
  std::string CanonicalEncoding() const;
};

// Validates the identity (non-empty model, weights, tokenizer and engine; a valid format) and derives the
// namespace. InvalidArgument names the missing or bad field.
Result<StateNamespace> DeriveNamespace(const NamespaceIdentity& identity);

}  // namespace orbitkv::state

#endif  // ORBITKV_STATE_NAMESPACE_H_
