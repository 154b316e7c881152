// Block keys for the benches that fill inventories and catalogs without an engine: key `i` of chain `chain` (one
// engine page of 16 tokens), in a namespace of the bench's own (its model id names the bench).
#ifndef ORBITKV_BENCHES_BENCH_KEYS_H_
#define ORBITKV_BENCHES_BENCH_KEYS_H_

#include <cstdint>
#include <span>
#include <string>

#include "state/namespace.h"
#include "state/state_key.h"

namespace orbitkv::bench {

inline state::StateNamespace BenchNamespace(const std::string& model_id) {
  state::NamespaceIdentity id;
  id.model_id = model_id;
  id.weights_revision = "r1";
  id.tokenizer = "bench/tok";
  id.engine_kind = "vllm";
  return *state::DeriveNamespace(id);
}

inline state::StateKey BenchKey(const state::StateNamespace& ns, uint64_t chain, uint64_t i) {
  const uint64_t native[2] = {chain, i};
  return *state::StateKey::Create(ns, 0, {i * 16, i * 16 + 16},
                                  std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(native), 16));
}

}  // namespace orbitkv::bench

#endif  // ORBITKV_BENCHES_BENCH_KEYS_H_
