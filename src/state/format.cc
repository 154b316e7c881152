#include "state/format.h"

#include "state/component.h"

#include <array>
#include <string>
#include <utility>

namespace orbitkv::state {
namespace {

constexpr std::array<std::pair<StateComponent, std::string_view>, 7> kComponents = {{
    {StateComponent::kAttentionKv, "attention_kv"},
    {StateComponent::kMla, "mla"},
    {StateComponent::kRecurrent, "recurrent"},
    {StateComponent::kConvolution, "convolution"},
    {StateComponent::kSlidingWindow, "sliding_window"},
    {StateComponent::kDraft, "draft"},
    {StateComponent::kIndexer, "indexer"},
}};

struct DTypeInfo {
  DType dtype;
  std::string_view name;
  size_t bytes;
};
constexpr std::array<DTypeInfo, 7> kDTypes = {{
    {DType::kFloat32, "fp32", 4},
    {DType::kFloat16, "fp16", 2},
    {DType::kBFloat16, "bf16", 2},
    {DType::kFloat8E4M3, "fp8_e4m3", 1},
    {DType::kFloat8E5M2, "fp8_e5m2", 1},
    {DType::kInt8, "int8", 1},
    {DType::kUInt8, "uint8", 1},
}};

constexpr std::array<std::pair<KvLayout, std::string_view>, 5> kLayouts = {{
    {KvLayout::kLayerFirst, "layer_first"},
    {KvLayout::kLayerFirstSplitKv, "layer_first_split_kv"},
    {KvLayout::kPageFirst, "page_first"},
    {KvLayout::kPageFirstDirect, "page_first_direct"},
    {KvLayout::kMla, "mla"},
}};

template <typename Table, typename Key>
std::string_view NameIn(const Table& table, Key key) {
  for (const auto& entry : table) {
    if (entry.first == key) return entry.second;
  }
  return "unknown";
}

template <typename Table>
auto ParseIn(const Table& table, std::string_view name) -> std::optional<decltype(table[0].first)> {
  for (const auto& entry : table) {
    if (entry.second == name) return entry.first;
  }
  return std::nullopt;
}

}  // namespace

std::string_view ComponentName(StateComponent component) { return NameIn(kComponents, component); }
std::optional<StateComponent> ParseComponent(std::string_view name) { return ParseIn(kComponents, name); }
bool IsValidComponent(uint8_t value) { return value >= 1 && value <= kComponents.size(); }

std::string_view DTypeName(DType dtype) {
  for (const auto& d : kDTypes) {
    if (d.dtype == dtype) return d.name;
  }
  return "unknown";
}

std::optional<DType> ParseDType(std::string_view name) {
  for (const auto& d : kDTypes) {
    if (d.name == name) return d.dtype;
  }
  return std::nullopt;
}

size_t DTypeBytes(DType dtype) {
  for (const auto& d : kDTypes) {
    if (d.dtype == dtype) return d.bytes;
  }
  return 0;
}

std::string_view LayoutName(KvLayout layout) { return NameIn(kLayouts, layout); }
std::optional<KvLayout> ParseLayout(std::string_view name) { return ParseIn(kLayouts, name); }

Status ParallelShape::Validate() const {
  if (tp_size == 0 || pp_size == 0) return Status::InvalidArgument("parallel shape: tp_size and pp_size must be >= 1");
  if (tp_rank >= tp_size) {
    return Status::InvalidArgument("parallel shape: tp_rank " + std::to_string(tp_rank) + " >= tp_size " +
                                   std::to_string(tp_size));
  }
  if (pp_rank >= pp_size) {
    return Status::InvalidArgument("parallel shape: pp_rank " + std::to_string(pp_rank) + " >= pp_size " +
                                   std::to_string(pp_size));
  }
  return Status::Ok();
}

Status StateFormat::Validate() const {
  if (DTypeName(dtype) == "unknown") {
    return Status::InvalidArgument("state format: unknown dtype " + std::to_string(static_cast<int>(dtype)));
  }
  if (LayoutName(layout) == "unknown") {
    return Status::InvalidArgument("state format: unknown layout " + std::to_string(static_cast<int>(layout)));
  }
  if (page_size_tokens == 0) return Status::InvalidArgument("state format: page_size_tokens must be >= 1");
  return parallel.Validate().WithContext("state format");
}

}  // namespace orbitkv::state
