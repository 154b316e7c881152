// StateFormat: how a block's bytes were produced and laid out. Two blocks may share bytes only when their
// formats are equal; the format is one input of the StateKey namespace, so a difference in any field yields a
// different key rather than a wrong read.
#ifndef ORBITKV_STATE_FORMAT_H_
#define ORBITKV_STATE_FORMAT_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "base/status.h"
#include "state/digest.h"

namespace orbitkv::state {

// Element type of the stored KV. Values are stable (they are hashed into namespaces).
enum class DType : uint8_t {
  kFloat32 = 1,
  kFloat16 = 2,
  kBFloat16 = 3,
  kFloat8E4M3 = 4,
  kFloat8E5M2 = 5,
  kInt8 = 6,
  kUInt8 = 7,
};
std::string_view DTypeName(DType dtype);  // "bf16", "fp8_e4m3", ...
std::optional<DType> ParseDType(std::string_view name);
size_t DTypeBytes(DType dtype);

// Physical arrangement of one page in engine memory. Values are stable.
enum class KvLayout : uint8_t {
  kLayerFirst = 1,         // vLLM: one tensor per layer, K and V halves inside each page.
  kLayerFirstSplitKv = 2,  // One tensor per layer for K and one for V (two fragments per layer).
  kPageFirst = 3,          // SGLang page_first: all layers of a page contiguous.
  kPageFirstDirect = 4,    // SGLang page_first_direct.
  kMla = 5,                // One latent fragment per layer (no K/V split).
};
std::string_view LayoutName(KvLayout layout);
std::optional<KvLayout> ParseLayout(std::string_view name);

// Tensor/pipeline parallel shard of the engine that produced the bytes.
struct ParallelShape {
  uint32_t tp_size = 1;
  uint32_t tp_rank = 0;
  uint32_t pp_size = 1;
  uint32_t pp_rank = 0;

  Status Validate() const;
  friend bool operator==(const ParallelShape&, const ParallelShape&) = default;
};

struct StateFormat {
  // Digest of the model architecture and config (layers, heads, head size, rope, ...).
  Digest256 model_digest;
  // Digest of the code path that produced the bytes (attention backend, kernel version, quantization scales).
  Digest256 implementation_digest;
  DType dtype = DType::kBFloat16;
  KvLayout layout = KvLayout::kLayerFirst;
  // Free-form layout refinement the enum does not capture, e.g. "NHD" vs "HND"; part of identity.
  std::string layout_detail;
  uint32_t page_size_tokens = 16;
  ParallelShape parallel;

  // InvalidArgument naming the bad field: unknown dtype or layout, zero page size, rank out of range.
  Status Validate() const;
  // Bytes may be shared across engines only when every field matches.
  friend bool operator==(const StateFormat&, const StateFormat&) = default;
};

}  // namespace orbitkv::state

#endif  // ORBITKV_STATE_FORMAT_H_
