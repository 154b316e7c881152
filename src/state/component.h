// StateComponent: the kinds of model state a block can hold. Hybrid models mix them; each recovery group
// declares which components it carries, and the recovery contract decides which groups a boundary needs.
#ifndef ORBITKV_STATE_COMPONENT_H_
#define ORBITKV_STATE_COMPONENT_H_

#include <cstdint>
#include <optional>
#include <string_view>

namespace orbitkv::state {

// Values are stable: they appear in namespaces, wire descriptors and SSD records.
enum class StateComponent : uint8_t {
  kAttentionKv = 1,    // Full-attention K and V per layer.
  kMla = 2,            // Multi-head latent attention: one compressed latent per layer.
  kRecurrent = 3,      // SSM / linear-attention recurrent state (Mamba, GDN).
  kConvolution = 4,    // Short convolution state that accompanies recurrent layers.
  kSlidingWindow = 5,  // Sliding-window attention KV.
  kDraft = 6,          // Speculative-decoding draft model KV.
  kIndexer = 7,        // Sparse-attention indexer keys (DSA).
};

std::string_view ComponentName(StateComponent component);  // "attention_kv", "mla", ...
std::optional<StateComponent> ParseComponent(std::string_view name);
bool IsValidComponent(uint8_t value);

}  // namespace orbitkv::state

#endif  // ORBITKV_STATE_COMPONENT_H_
