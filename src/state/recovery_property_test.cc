// Property tests over random contracts, spans and coverage (fixed seeds, so every run checks the same cases).
#include <gtest/gtest.h>

#include <random>
#include <set>

#include "state/recovery.h"
#include "state/test_util.h"

namespace orbitkv::state {
namespace {

struct Case {
  uint32_t page;
  std::vector<RecoveryRule> rules;
};

Case RandomCase(std::mt19937_64& rng) {
  static constexpr uint32_t kPages[] = {1, 2, 4, 8, 16, 32, 64, 256};
  Case c;
  c.page = kPages[rng() % std::size(kPages)];
  int groups = 1 + static_cast<int>(rng() % 4);
  for (int g = 0; g < groups; ++g) {
    RecoveryRule r;
    r.group = static_cast<uint32_t>(g * 3 + rng() % 3);  // Sparse, unordered-ish ids.
    r.kind = static_cast<RecoveryRuleKind>(1 + rng() % 3);
    if (r.kind == RecoveryRuleKind::kWindow) r.window_tokens = 1 + rng() % 1024;
    c.rules.push_back(r);
  }
  return c;
}

class RecoveryPropertyTest : public ::testing::Test {
 protected:
  StateNamespace ns_ = testing::SampleNamespace();
};

TEST_F(RecoveryPropertyTest, RangesArePageAlignedInsideTheSpanAndFollowTheirRule) {
  std::mt19937_64 rng(0x5eed);
  for (int iter = 0; iter < 3000; ++iter) {
    Case c = RandomCase(rng);
    auto contract = RecoveryContract::Compile(ns_, c.page, c.rules);
    ASSERT_TRUE(contract.ok()) << contract.status();
    uint64_t origin = (rng() % 64) * c.page;
    uint64_t end = origin + (rng() % 64) * c.page;
    auto demand = contract->RequiredRanges(ns_, origin, end);
    ASSERT_TRUE(demand.ok()) << demand.status();
    ASSERT_EQ(demand->ranges.size(), contract->rules().size());
    for (size_t i = 0; i < demand->ranges.size(); ++i) {
      const GroupRange& r = demand->ranges[i];
      const RecoveryRule& rule = contract->rules()[i];
      ASSERT_EQ(r.group, rule.group);
      ASSERT_LE(origin, r.begin);
      ASSERT_LE(r.begin, r.end);
      ASSERT_EQ(r.end, end);
      ASSERT_EQ(r.begin % c.page, 0u);
      ASSERT_EQ(r.end % c.page, 0u);
      if (end == origin) {
        ASSERT_TRUE(r.empty());
        continue;
      }
      switch (rule.kind) {
        case RecoveryRuleKind::kPrefix:
          ASSERT_EQ(r.begin, origin);
          break;
        case RecoveryRuleKind::kWindow: {
          // Never beyond the tail, never longer than the window rounded up to pages, and it holds every token
          // the window needs unless the tail is shorter.
          uint64_t need = rule.window_tokens - 1;
          uint64_t reach = (need + c.page - 1) / c.page * c.page;
          ASSERT_LE(r.tokens(), reach);
          ASSERT_GE(r.tokens(), std::min(need, end - origin));
          ASSERT_LT(r.tokens(), need + c.page);
          break;
        }
        case RecoveryRuleKind::kCheckpoint:
          ASSERT_EQ(r.tokens(), c.page);
          break;
      }
    }
  }
}

// Brute-force reference: a boundary is legal when every required page of every group is covered.
std::vector<uint64_t> Reference(const RecoveryContract& contract, const StateNamespace& ns, uint64_t origin,
                                uint64_t end, const std::vector<GroupCoverage>& cov) {
  std::vector<uint64_t> out;
  for (uint64_t b = origin + contract.page_tokens(); b <= end; b += contract.page_tokens()) {
    auto d = contract.RequiredRanges(ns, origin, b);
    bool ok = true;
    for (const GroupRange& r : d->ranges) {
      std::set<uint64_t> have;
      for (const auto& g : cov) {
        if (g.group == r.group) have.insert(g.pages.begin(), g.pages.end());
      }
      for (uint64_t t = r.begin; t < r.end; t += contract.page_tokens())
        ok &= have.count(t / contract.page_tokens()) > 0;
    }
    if (ok) out.push_back(b);
  }
  return out;
}

std::vector<GroupCoverage> RandomCoverage(std::mt19937_64& rng, const RecoveryContract& c, uint64_t origin,
                                          uint64_t end, int density_percent) {
  std::vector<GroupCoverage> cov;
  for (const auto& rule : c.rules()) {
    if (rng() % 10 == 0) continue;  // Sometimes a group has nothing at all.
    GroupCoverage g{rule.group, {}};
    for (uint64_t p = origin / c.page_tokens(); p < end / c.page_tokens() + 2; ++p) {
      if (static_cast<int>(rng() % 100) < density_percent) g.pages.push_back(p);
    }
    cov.push_back(std::move(g));
  }
  return cov;
}

TEST_F(RecoveryPropertyTest, BoundariesMatchBruteForce) {
  std::mt19937_64 rng(42);
  for (int iter = 0; iter < 1500; ++iter) {
    Case c = RandomCase(rng);
    auto contract = RecoveryContract::Compile(ns_, c.page, c.rules);
    uint64_t origin = (rng() % 16) * c.page;
    uint64_t end = origin + (rng() % 40) * c.page;
    auto cov = RandomCoverage(rng, *contract, origin, end, 60 + static_cast<int>(rng() % 41));
    auto got = contract->RestorableBoundaries(ns_, origin, end, cov);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(*got, Reference(*contract, ns_, origin, end, cov)) << "iteration " << iter;
    ASSERT_TRUE(std::is_sorted(got->begin(), got->end()));
    for (uint64_t b : *got) {
      ASSERT_GT(b, origin);
      ASSERT_LE(b, end);
      ASSERT_EQ(b % c.page, 0u);
    }
  }
}

TEST_F(RecoveryPropertyTest, MoreCoverageNeverRemovesABoundary) {
  std::mt19937_64 rng(7);
  for (int iter = 0; iter < 800; ++iter) {
    Case c = RandomCase(rng);
    auto contract = RecoveryContract::Compile(ns_, c.page, c.rules);
    uint64_t end = (rng() % 48) * c.page;
    auto cov = RandomCoverage(rng, *contract, 0, end, 70);
    auto before = *contract->RestorableBoundaries(ns_, 0, end, cov);
    for (auto& g : cov) g.pages.push_back(rng() % (end / c.page + 1));
    auto after = *contract->RestorableBoundaries(ns_, 0, end, cov);
    ASSERT_TRUE(std::includes(after.begin(), after.end(), before.begin(), before.end()));
  }
}

TEST_F(RecoveryPropertyTest, IntersectionIsMonotone) {
  std::mt19937_64 rng(99);
  for (int iter = 0; iter < 500; ++iter) {
    Case c = RandomCase(rng);
    auto contract = RecoveryContract::Compile(ns_, c.page, c.rules);
    uint64_t end = (rng() % 48) * c.page;
    std::vector<std::vector<uint64_t>> ranks;
    int num_ranks = 1 + static_cast<int>(rng() % 5);
    for (int r = 0; r < num_ranks; ++r) {
      ranks.push_back(*contract->RestorableBoundaries(ns_, 0, end, RandomCoverage(rng, *contract, 0, end, 85)));
    }
    std::vector<uint64_t> previous = ranks[0];
    for (int k = 1; k <= num_ranks; ++k) {
      auto now = IntersectBoundaries(std::span(ranks).first(k));
      // Adding a rank never adds a boundary, and the result is legal on every rank considered.
      ASSERT_TRUE(std::includes(previous.begin(), previous.end(), now.begin(), now.end()));
      for (int r = 0; r < k; ++r) ASSERT_TRUE(std::includes(ranks[r].begin(), ranks[r].end(), now.begin(), now.end()));
      previous = now;
    }
  }
}

}  // namespace
}  // namespace orbitkv::state
