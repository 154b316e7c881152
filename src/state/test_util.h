// Test-only helpers for state tests (never included by library code).
#ifndef ORBITKV_STATE_TEST_UTIL_H_
#define ORBITKV_STATE_TEST_UTIL_H_

#include <gtest/gtest.h>

#include "state/namespace.h"
#include "state/state_key.h"

namespace orbitkv::state::testing {

inline NamespaceIdentity SampleIdentity() {
  NamespaceIdentity id;
  id.model_id = "Qwen/Qwen3-8B";
  id.weights_revision = "b968826d9c46dd6066d109eabc6255188de91218";
  id.tokenizer = "Qwen/Qwen3-8B@b968826d";
  id.engine_kind = "vllm";
  id.format.model_digest = Sha256::Of(std::string_view("qwen3 36L 8kv x128 rope1e6"));
  id.format.implementation_digest = Sha256::Of(std::string_view("flash-attn 2.7 bf16"));
  id.format.dtype = DType::kBFloat16;
  id.format.layout = KvLayout::kLayerFirst;
  id.format.layout_detail = "NHD";
  id.format.page_size_tokens = 16;
  id.format.parallel = {.tp_size = 2, .tp_rank = 0, .pp_size = 1, .pp_rank = 0};
  return id;
}

inline StateNamespace SampleNamespace() {
  auto ns = DeriveNamespace(SampleIdentity());
  EXPECT_TRUE(ns.ok()) << ns.status();
  return *ns;
}

inline StateKey MakeKey(const StateNamespace& ns, uint32_t group, TokenRange span, std::string_view native) {
  auto key = StateKey::Create(ns, group, span, native);
  EXPECT_TRUE(key.ok()) << key.status();
  return *key;
}

}  // namespace orbitkv::state::testing

#endif  // ORBITKV_STATE_TEST_UTIL_H_
