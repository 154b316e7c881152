// The "no false hit" gate: a change of weights, tokenizer, dtype, layout, rank, page size or span (or any other
// identity input) never yields an equal StateKey, so stale or foreign bytes can never be served as a hit.
#include <gtest/gtest.h>

#include <functional>
#include <set>
#include <string>
#include <vector>

#include "state/state_key.h"
#include "state/test_util.h"

namespace orbitkv::state {
namespace {

using testing::SampleIdentity;

constexpr TokenRange kSpan{64, 80};
constexpr std::string_view kNative = "vllm-block-hash-0123456789abcdef";

StateKey KeyFor(const NamespaceIdentity& id, uint32_t group = 0, TokenRange span = kSpan,
                std::string_view native = kNative) {
  auto ns = DeriveNamespace(id);
  EXPECT_TRUE(ns.ok()) << ns.status();
  return testing::MakeKey(*ns, group, span, native);
}

struct Mutation {
  std::string name;
  std::function<void(NamespaceIdentity&)> apply;
};

std::vector<Mutation> IdentityMutations() {
  return {
      {"weights", [](auto& id) { id.weights_revision = "0000000000000000000000000000000000000000"; }},
      {"weights (one char)", [](auto& id) { id.weights_revision.back() ^= 1; }},
      {"tokenizer", [](auto& id) { id.tokenizer = "Qwen/Qwen3-8B@ffffffff"; }},
      {"model id", [](auto& id) { id.model_id = "Qwen/Qwen3-8B-Instruct"; }},
      {"engine kind", [](auto& id) { id.engine_kind = "sglang"; }},
      {"cache scope", [](auto& id) { id.cache_scope = "tenant-a"; }},
      {"dtype fp16", [](auto& id) { id.format.dtype = DType::kFloat16; }},
      {"dtype fp8", [](auto& id) { id.format.dtype = DType::kFloat8E4M3; }},
      {"layout split kv", [](auto& id) { id.format.layout = KvLayout::kLayerFirstSplitKv; }},
      {"layout page first", [](auto& id) { id.format.layout = KvLayout::kPageFirst; }},
      {"layout detail", [](auto& id) { id.format.layout_detail = "HND"; }},
      {"tp rank", [](auto& id) { id.format.parallel.tp_rank = 1; }},
      {"tp size", [](auto& id) { id.format.parallel = {.tp_size = 4, .tp_rank = 0}; }},
      {"pp shape", [](auto& id) { id.format.parallel.pp_size = 2; }},
      {"pp rank", [](auto& id) { id.format.parallel = {.tp_size = 2, .tp_rank = 0, .pp_size = 2, .pp_rank = 1}; }},
      {"page size", [](auto& id) { id.format.page_size_tokens = 32; }},
      {"model digest", [](auto& id) { id.format.model_digest.bytes[31] ^= 1; }},
      {"implementation digest", [](auto& id) { id.format.implementation_digest.bytes[0] ^= 0x80; }},
  };
}

TEST(NoFalseHitTest, EveryIdentityChangeChangesTheKey) {
  const StateKey base = KeyFor(SampleIdentity());
  for (const Mutation& m : IdentityMutations()) {
    NamespaceIdentity id = SampleIdentity();
    m.apply(id);
    StateKey changed = KeyFor(id);
    EXPECT_NE(changed, base) << "changing " << m.name << " kept the key";
    EXPECT_NE(changed.ns(), base.ns()) << m.name;
    EXPECT_NE(changed.Encode(), base.Encode()) << m.name;
  }
}

TEST(NoFalseHitTest, AllMutationsArePairwiseDistinct) {
  std::set<StateKey> keys = {KeyFor(SampleIdentity())};
  for (const Mutation& m : IdentityMutations()) {
    NamespaceIdentity id = SampleIdentity();
    m.apply(id);
    EXPECT_TRUE(keys.insert(KeyFor(id)).second) << m.name << " collided with another mutation";
  }
}

TEST(NoFalseHitTest, SpanGroupNativeKeyAndVersionChangeTheKey) {
  NamespaceIdentity id = SampleIdentity();
  const StateKey base = KeyFor(id);
  EXPECT_NE(KeyFor(id, 0, {80, 96}), base);  // Next page, same native bytes (an engine with a weak hash).
  EXPECT_NE(KeyFor(id, 0, {64, 96}), base);  // Longer span.
  EXPECT_NE(KeyFor(id, 0, {48, 80}), base);  // Earlier begin.
  EXPECT_NE(KeyFor(id, 1), base);            // Another recovery group (e.g. SWA) with the same page hash.
  EXPECT_NE(KeyFor(id, 0, kSpan, "vllm-block-hash-0123456789abcdeF"), base);
  EXPECT_NE(KeyFor(id, 0, kSpan, std::string(kNative) + '\0'), base);  // Trailing zero is not padding.
  auto ns = *DeriveNamespace(id);
  EXPECT_NE(*StateKey::Create(ns, 0, kSpan, kNative, 2), base);
}

TEST(NoFalseHitTest, ChangedKeysNeverDecodeToTheOriginal) {
  // Wire/disk round trips preserve the distinction as well.
  const StateKey base = KeyFor(SampleIdentity());
  for (const Mutation& m : IdentityMutations()) {
    NamespaceIdentity id = SampleIdentity();
    m.apply(id);
    auto decoded = StateKey::Decode(KeyFor(id).Encode());
    ASSERT_TRUE(decoded.ok());
    EXPECT_NE(*decoded, base) << m.name;
  }
}

}  // namespace
}  // namespace orbitkv::state
