#include "state/namespace.h"

#include "state/encoding.h"

namespace orbitkv::state {

namespace {
// Field tags of the canonical encoding. Never reuse or renumber; add new tags at the end.
enum Field : uint8_t {
  kModelId = 1,
  kWeightsRevision = 2,
  kTokenizer = 3,
  kEngineKind = 4,
  kCacheScope = 5,
  kModelDigest = 6,
  kImplementationDigest = 7,
  kDType = 8,
  kLayout = 9,
  kLayoutDetail = 10,
  kPageSizeTokens = 11,
  kTpSize = 12,
  kTpRank = 13,
  kPpSize = 14,
  kPpRank = 15,
};
}  // namespace

std::string NamespaceIdentity::CanonicalEncoding() const {
  CanonicalWriter w("orbitkv.namespace", kNamespaceEncodingVersion);
  w.Bytes(kModelId, model_id);
  w.Bytes(kWeightsRevision, weights_revision);
  w.Bytes(kTokenizer, tokenizer);
  w.Bytes(kEngineKind, engine_kind);
  w.Bytes(kCacheScope, cache_scope);
  w.Bytes(kModelDigest, format.model_digest.bytes);
  w.Bytes(kImplementationDigest, format.implementation_digest.bytes);
  w.U64(kDType, static_cast<uint64_t>(format.dtype));
  w.U64(kLayout, static_cast<uint64_t>(format.layout));
  w.Bytes(kLayoutDetail, format.layout_detail);
  w.U64(kPageSizeTokens, format.page_size_tokens);
  w.U64(kTpSize, format.parallel.tp_size);
  w.U64(kTpRank, format.parallel.tp_rank);
  w.U64(kPpSize, format.parallel.pp_size);
  w.U64(kPpRank, format.parallel.pp_rank);
  return w.Take();
}

Result<StateNamespace> DeriveNamespace(const NamespaceIdentity& identity) {
  if (identity.model_id.empty()) return Status::InvalidArgument("namespace identity: model_id is empty");
  if (identity.weights_revision.empty()) {
    return Status::InvalidArgument("namespace identity: weights_revision is empty (pass a commit or checksum)");
  }
  if (identity.tokenizer.empty()) return Status::InvalidArgument("namespace identity: tokenizer is empty");
  if (identity.engine_kind.empty()) return Status::InvalidArgument("namespace identity: engine_kind is empty");
  ORBITKV_RETURN_IF_ERROR(identity.format.Validate().WithContext("namespace identity"));
  return StateNamespace(Sha256::Of(identity.CanonicalEncoding()));
}

}  // namespace orbitkv::state
