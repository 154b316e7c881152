// RecoveryContract: which stored state a restore must bring back for a given token boundary.
//
// An engine with a hybrid model keeps several recovery groups (full attention, sliding-window attention,
// recurrent/convolution checkpoints, ...). To resume at token boundary `end` after its valid HBM prefix ends at
// `origin`, each group needs a different slice:
//   - prefix     : every page from origin to end (full attention, MLA, indexer, draft KV);
//   - window W   : the W-1 tokens before end, rounded up to whole pages and never reaching before origin
//                  (sliding-window attention);
//   - checkpoint : only the final page before end (recurrent and convolution state sealed at that page).
// Compile() normalizes the declared rules once at registration; RequiredRanges() turns (origin, end) into
// absolute page-aligned token intervals per group; RestorableBoundaries() lists every boundary whose demand is
// completely covered by leased pages. Boundaries of different ranks or shards are reconciled with
// IntersectBoundaries(): callers intersect legal sets, never take the minimum of per-rank maxima, because a
// window or checkpoint group can make the legal boundaries non-contiguous.
//
// All positions are absolute token positions; page p covers tokens [p*page, (p+1)*page).
// Thread safety: a compiled contract is immutable and may be shared across threads.
#ifndef ORBITKV_STATE_RECOVERY_H_
#define ORBITKV_STATE_RECOVERY_H_

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "base/result.h"
#include "state/component.h"
#include "state/namespace.h"

namespace orbitkv::state {

enum class RecoveryRuleKind : uint8_t { kPrefix = 1, kWindow = 2, kCheckpoint = 3 };
std::string_view RuleKindName(RecoveryRuleKind kind);  // "prefix", "window", "checkpoint"

// One declared rule per recovery group.
struct RecoveryRule {
  uint32_t group = 0;
  RecoveryRuleKind kind = RecoveryRuleKind::kPrefix;
  // Components stored in this group; informational (a checkpoint group usually holds recurrent + convolution).
  std::vector<StateComponent> components;
  // Attention window in tokens (window rules only; >= 1).
  uint64_t window_tokens = 0;
};

// The slice of one group a boundary needs: tokens [begin, end), both page-aligned; empty when begin == end.
struct GroupRange {
  uint32_t group = 0;
  uint64_t begin = 0;
  uint64_t end = 0;

  bool empty() const { return end <= begin; }
  uint64_t tokens() const { return end - begin; }
  friend bool operator==(const GroupRange&, const GroupRange&) = default;
};

// The compiled demand for one boundary: one range per group, in ascending group order.
struct RecoveryDemand {
  StateNamespace ns;
  uint64_t origin = 0;
  uint64_t end = 0;
  std::vector<GroupRange> ranges;
};

// The pages of one group that are present and leased, as absolute page indices (any order, duplicates allowed).
struct GroupCoverage {
  uint32_t group = 0;
  std::vector<uint64_t> pages;
};

class RecoveryContract {
 public:
  // RestorableBoundaries() works in memory proportional to the span; longer spans are OutOfRange.
  static constexpr uint64_t kMaxBoundaryPages = uint64_t{1} << 22;
  // And at most this many (group, page) cells per call (bounds its memory to 64 MiB).
  static constexpr uint64_t kMaxBoundaryCells = uint64_t{1} << 24;
  static constexpr size_t kMaxGroups = 64;

  // InvalidArgument for: page_tokens == 0, no rules, more than kMaxGroups rules, a group declared twice, a window rule
  // without a window, a window or checkpoint rule carrying a window of the wrong kind.
  static Result<RecoveryContract> Compile(const StateNamespace& ns, uint32_t page_tokens,
                                          std::vector<RecoveryRule> rules);

  const StateNamespace& ns() const { return ns_; }
  uint32_t page_tokens() const { return page_tokens_; }
  // Sorted by group.
  const std::vector<RecoveryRule>& rules() const { return rules_; }

  // Ranges each group needs to resume at `end` from the valid prefix `origin`. InvalidArgument when the
  // namespace differs from the contract's, when origin or end is not page-aligned, or when end < origin.
  Result<RecoveryDemand> RequiredRanges(const StateNamespace& ns, uint64_t origin, uint64_t end) const;

  // Every boundary b in (origin, end], ascending and page-aligned, whose RequiredRanges(origin, b) is fully
  // covered. Groups missing from `coverage` have no pages. InvalidArgument for the same inputs RequiredRanges
  // rejects, for a coverage group the contract does not declare, and for a group listed twice; OutOfRange for a
  // span over kMaxBoundaryPages pages or kMaxBoundaryCells (group, page) cells.
  Result<std::vector<uint64_t>> RestorableBoundaries(const StateNamespace& ns, uint64_t origin, uint64_t end,
                                                     std::span<const GroupCoverage> coverage) const;

 private:
  RecoveryContract(const StateNamespace& ns, uint32_t page_tokens, std::vector<RecoveryRule> rules)
      : ns_(ns), page_tokens_(page_tokens), rules_(std::move(rules)) {}

  Status CheckSpan(const StateNamespace& ns, uint64_t origin, uint64_t end) const;
  GroupRange RangeFor(const RecoveryRule& rule, uint64_t origin, uint64_t end) const;

  // Immutable after construction.
  StateNamespace ns_;
  uint32_t page_tokens_ = 0;
  std::vector<RecoveryRule> rules_;
};

// Boundaries legal on every rank/shard: the intersection of ascending sets, ascending. Empty input -> empty.
std::vector<uint64_t> IntersectBoundaries(std::span<const std::vector<uint64_t>> sets);

}  // namespace orbitkv::state

#endif  // ORBITKV_STATE_RECOVERY_H_
