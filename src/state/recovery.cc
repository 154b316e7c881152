#include "state/recovery.h"

#include <fmt/format.h>

#include <algorithm>
#include <set>

namespace orbitkv::state {

std::string_view RuleKindName(RecoveryRuleKind kind) {
  switch (kind) {
    case RecoveryRuleKind::kPrefix:
      return "prefix";
    case RecoveryRuleKind::kWindow:
      return "window";
    case RecoveryRuleKind::kCheckpoint:
      return "checkpoint";
  }
  return "unknown";
}

Result<RecoveryContract> RecoveryContract::Compile(const StateNamespace& ns, uint32_t page_tokens,
                                                   std::vector<RecoveryRule> rules) {
  if (page_tokens == 0) return Status::InvalidArgument("recovery contract: page_tokens must be >= 1");
  if (rules.empty()) return Status::InvalidArgument("recovery contract: at least one group rule is required");
  if (rules.size() > kMaxGroups) {
    return Status::InvalidArgument(
        fmt::format("recovery contract: {} groups declared, at most {} allowed", rules.size(), kMaxGroups));
  }
  std::sort(rules.begin(), rules.end(), [](const auto& a, const auto& b) { return a.group < b.group; });
  for (size_t i = 0; i < rules.size(); ++i) {
    RecoveryRule& rule = rules[i];
    if (i > 0 && rules[i - 1].group == rule.group) {
      return Status::InvalidArgument(fmt::format("recovery contract: group {} declared twice", rule.group));
    }
    switch (rule.kind) {
      case RecoveryRuleKind::kWindow:
        if (rule.window_tokens == 0) {
          return Status::InvalidArgument(
              fmt::format("recovery contract: window group {} needs window_tokens >= 1", rule.group));
        }
        break;
      case RecoveryRuleKind::kPrefix:
      case RecoveryRuleKind::kCheckpoint:
        if (rule.window_tokens != 0) {
          return Status::InvalidArgument(
              fmt::format("recovery contract: {} group {} cannot have a window", RuleKindName(rule.kind), rule.group));
        }
        break;
      default:
        return Status::InvalidArgument(fmt::format("recovery contract: group {} has unknown rule kind {}", rule.group,
                                                   static_cast<int>(rule.kind)));
    }
    for (StateComponent c : rule.components) {
      if (!IsValidComponent(static_cast<uint8_t>(c))) {
        return Status::InvalidArgument(
            fmt::format("recovery contract: group {} lists unknown component {}", rule.group, static_cast<int>(c)));
      }
    }
    std::sort(rule.components.begin(), rule.components.end());
    rule.components.erase(std::unique(rule.components.begin(), rule.components.end()), rule.components.end());
  }
  return RecoveryContract(ns, page_tokens, std::move(rules));
}

Status RecoveryContract::CheckSpan(const StateNamespace& ns, uint64_t origin, uint64_t end) const {
  if (ns != ns_) {
    return Status::InvalidArgument(
        fmt::format("recovery: namespace {} does not match the contract's {}", ns.ShortHex(), ns_.ShortHex()));
  }
  if (end < origin) return Status::InvalidArgument(fmt::format("recovery: end {} < origin {}", end, origin));
  if (origin % page_tokens_ != 0 || end % page_tokens_ != 0) {
    return Status::InvalidArgument(
        fmt::format("recovery: span [{}, {}) is not aligned to {}-token pages", origin, end, page_tokens_));
  }
  return Status::Ok();
}

GroupRange RecoveryContract::RangeFor(const RecoveryRule& rule, uint64_t origin, uint64_t end) const {
  GroupRange range{rule.group, end, end};
  if (end == origin) return range;
  switch (rule.kind) {
    case RecoveryRuleKind::kPrefix:
      range.begin = origin;
      break;
    case RecoveryRuleKind::kWindow: {
      // The next token attends to the W-1 tokens before it; whole pages hold them.
      // Computed in pages so that huge windows (up to UINT64_MAX) cannot overflow into a smaller demand.
      uint64_t past = rule.window_tokens - 1;
      uint64_t pages = past / page_tokens_ + (past % page_tokens_ != 0 ? 1 : 0);
      uint64_t begin = pages >= end / page_tokens_ ? 0 : end - pages * page_tokens_;
      range.begin = std::max(origin, begin);
      break;
    }
    case RecoveryRuleKind::kCheckpoint:
      range.begin = end - page_tokens_;  // end > origin and both aligned, so this stays >= origin.
      break;
  }
  return range;
}

Result<RecoveryDemand> RecoveryContract::RequiredRanges(const StateNamespace& ns, uint64_t origin, uint64_t end) const {
  ORBITKV_RETURN_IF_ERROR(CheckSpan(ns, origin, end));
  RecoveryDemand demand{ns_, origin, end, {}};
  demand.ranges.reserve(rules_.size());
  for (const RecoveryRule& rule : rules_) demand.ranges.push_back(RangeFor(rule, origin, end));
  return demand;
}

Result<std::vector<uint64_t>> RecoveryContract::RestorableBoundaries(const StateNamespace& ns, uint64_t origin,
                                                                     uint64_t end,
                                                                     std::span<const GroupCoverage> coverage) const {
  ORBITKV_RETURN_IF_ERROR(CheckSpan(ns, origin, end));
  const uint64_t first_page = origin / page_tokens_;
  const uint64_t num_pages = (end - origin) / page_tokens_;
  if (num_pages > kMaxBoundaryPages || num_pages * rules_.size() > kMaxBoundaryCells) {
    return Status::OutOfRange(fmt::format("recovery: span [{}, {}) has {} pages, at most {} per call", origin, end,
                                          num_pages, kMaxBoundaryPages));
  }

  // Per group (in rules_ order), prefix sums of covered pages over [first_page, first_page + num_pages), so that
  // "is [a, b) fully covered" is one subtraction.
  std::vector<std::vector<uint32_t>> covered_prefix(rules_.size(), std::vector<uint32_t>(num_pages + 1, 0));
  std::set<uint32_t> seen;
  for (const GroupCoverage& gc : coverage) {
    auto rule = std::find_if(rules_.begin(), rules_.end(), [&](const auto& r) { return r.group == gc.group; });
    if (rule == rules_.end()) {
      return Status::InvalidArgument(
          fmt::format("recovery: coverage names group {} the contract does not declare", gc.group));
    }
    if (!seen.insert(gc.group).second) {
      return Status::InvalidArgument(fmt::format("recovery: coverage lists group {} twice", gc.group));
    }
    std::vector<uint32_t>& prefix = covered_prefix[rule - rules_.begin()];
    for (uint64_t page : gc.pages) {
      // Pages outside the span are irrelevant to these boundaries; duplicates count once.
      if (page >= first_page && page - first_page < num_pages) prefix[page - first_page + 1] = 1;
    }
    for (uint64_t i = 1; i <= num_pages; ++i) prefix[i] += prefix[i - 1];
  }

  std::vector<uint64_t> boundaries;
  // Iterate page counts, not token positions: origin + i * page <= end cannot overflow.
  for (uint64_t i = 1; i <= num_pages; ++i) {
    const uint64_t b = origin + i * page_tokens_;
    bool complete = true;
    for (size_t g = 0; g < rules_.size() && complete; ++g) {
      GroupRange r = RangeFor(rules_[g], origin, b);
      uint64_t lo = (r.begin - origin) / page_tokens_;
      uint64_t hi = (r.end - origin) / page_tokens_;
      complete = covered_prefix[g][hi] - covered_prefix[g][lo] == hi - lo;
    }
    if (complete) boundaries.push_back(b);
  }
  return boundaries;
}

std::vector<uint64_t> IntersectBoundaries(std::span<const std::vector<uint64_t>> sets) {
  if (sets.empty()) return {};
  std::vector<uint64_t> result = sets[0];
  for (size_t i = 1; i < sets.size() && !result.empty(); ++i) {
    std::vector<uint64_t> next;
    std::set_intersection(result.begin(), result.end(), sets[i].begin(), sets[i].end(), std::back_inserter(next));
    result = std::move(next);
  }
  return result;
}

}  // namespace orbitkv::state
