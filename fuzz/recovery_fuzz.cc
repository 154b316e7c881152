// Fuzzes RecoveryContract from arbitrary rule/coverage bytes: compile either fails cleanly or yields a contract
// whose ranges stay page-aligned inside [origin, end] and whose boundaries are ascending, in (origin, end], and
// each fully covered by the given pages.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <set>
#include <vector>

#include "state/recovery.h"

namespace {

struct Reader {
  const uint8_t* data;
  size_t size;
  uint64_t Next(uint64_t bound) {  // A value in [0, bound); 0 once input runs out.
    if (size == 0 || bound == 0) return 0;
    uint64_t v = *data++;
    --size;
    return v % bound;
  }
  uint64_t Wide() {  // Sometimes a full 64-bit value, to reach overflow edges.
    if (Next(4) != 0) return Next(300);
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v = v << 8 | Next(256);
    return v;
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace orbitkv::state;
  Reader r{data, size};
  StateNamespace ns;
  uint32_t page = static_cast<uint32_t>(r.Next(33));  // 0 is an allowed (rejected) input.
  std::vector<RecoveryRule> rules(r.Next(5));
  for (auto& rule : rules) {
    rule.group = static_cast<uint32_t>(r.Next(6));
    rule.kind = static_cast<RecoveryRuleKind>(r.Next(5));  // 0 and 4 are invalid kinds.
    // Windows only on window rules, except rarely, to also exercise that rejection.
    if (rule.kind == RecoveryRuleKind::kWindow || r.Next(16) == 0) rule.window_tokens = r.Wide();
  }
  auto contract = RecoveryContract::Compile(ns, page, rules);
  if (!contract.ok()) return 0;
  // Sometimes unaligned; sometimes at the very top of the uint64 range.
  uint64_t top = r.Next(8) == 0 ? (UINT64_MAX / page - 64) * page : 0;
  uint64_t origin = top + r.Next(20) * page + r.Next(2);
  uint64_t end = origin + r.Next(40) * page;
  std::vector<GroupCoverage> coverage;
  for (const auto& rule : contract->rules()) {
    GroupCoverage g{rule.group, {}};
    for (uint64_t n = r.Next(64); n > 0; --n) g.pages.push_back(top / page + r.Next(64));
    coverage.push_back(std::move(g));
  }
  auto demand = contract->RequiredRanges(ns, origin, end);
  auto boundaries = contract->RestorableBoundaries(ns, origin, end, coverage);
  if (demand.ok() != boundaries.ok()) std::abort();
  if (!demand.ok()) return 0;
  for (const GroupRange& gr : demand->ranges) {
    if (gr.begin < origin || gr.end != end || gr.begin > gr.end || gr.begin % page || gr.end % page) std::abort();
  }
  if (!std::is_sorted(boundaries->begin(), boundaries->end())) std::abort();
  for (uint64_t b : *boundaries) {
    if (b <= origin || b > end || b % page) std::abort();
    auto d = contract->RequiredRanges(ns, origin, b);
    for (const GroupRange& gr : d->ranges) {
      std::set<uint64_t> have;
      for (const auto& g : coverage) {
        if (g.group == gr.group) have.insert(g.pages.begin(), g.pages.end());
      }
      for (uint64_t t = gr.begin; t < gr.end; t += page) {
        if (!have.count(t / page)) std::abort();
      }
    }
  }
  return 0;
}
