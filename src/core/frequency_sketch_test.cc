#include "core/frequency_sketch.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace orbitkv::core {
namespace {

// `count` distinct pseudo-random key hashes from a fixed seed, so every run sees the same keys.
std::vector<uint64_t> DistinctHashes(size_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::unordered_set<uint64_t> seen;
  std::vector<uint64_t> hashes;
  hashes.reserve(count);
  while (hashes.size() < count) {
    uint64_t h = rng();
    if (seen.insert(h).second) hashes.push_back(h);
  }
  return hashes;
}

TEST(FrequencySketchTest, SizesItselfFromExpectedEntries) {
  struct Case {
    uint64_t expected_entries;
    uint64_t width;
  };
  for (Case c : {Case{0, 64}, Case{1, 64}, Case{64, 64}, Case{65, 128}, Case{1000, 1024}, Case{1024, 1024},
                 Case{100'000, 131'072}}) {
    FrequencySketch sketch(c.expected_entries);
    EXPECT_EQ(sketch.width(), c.width) << c.expected_entries;
    EXPECT_EQ(sketch.sample_size(), 10 * c.width) << c.expected_entries;
    EXPECT_EQ(sketch.additions_since_age(), 0u);
    // 4 rows of 4-bit counters (2 bytes per unit of width) plus 16 doorkeeper bits (2 bytes per
    // unit of width).
    EXPECT_EQ(sketch.MemoryBytes(), 4 * c.width) << c.expected_entries;
  }
}

TEST(FrequencySketchTest, MemoryForOneThousandEntries) {
  FrequencySketch sketch(1000);
  EXPECT_EQ(sketch.MemoryBytes(), 4096u);
  // Nothing grows as keys arrive.
  for (uint64_t h : DistinctHashes(50'000, 7)) sketch.Increment(h);
  EXPECT_EQ(sketch.MemoryBytes(), 4096u);
}

TEST(FrequencySketchTest, NeverSeenKeysEstimateZero) {
  FrequencySketch sketch(1024);
  for (uint64_t h : DistinctHashes(1000, 1)) EXPECT_EQ(sketch.Estimate(h), 0u);
  EXPECT_EQ(sketch.Estimate(0), 0u);
  EXPECT_EQ(sketch.Estimate(UINT64_MAX), 0u);
}

TEST(FrequencySketchTest, FirstSightingOnlySetsTheDoorkeeper) {
  FrequencySketch sketch(1024);
  const uint64_t key = 0x1234'5678'9ABC'DEF0;
  sketch.Increment(key);
  EXPECT_EQ(sketch.Estimate(key), 1u);
  EXPECT_EQ(sketch.additions_since_age(), 1u);
  // Clearing the doorkeeper forgets the key entirely: no counter was touched.
  sketch.Age();
  EXPECT_EQ(sketch.Estimate(key), 0u);
}

TEST(FrequencySketchTest, LaterSightingsReachTheCounters) {
  FrequencySketch sketch(1024);
  const uint64_t key = 42;
  for (uint32_t n = 1; n <= 5; ++n) {
    sketch.Increment(key);
    EXPECT_EQ(sketch.Estimate(key), n);
  }
  // Counters hold 4; aging halves them to 2 and clears the doorkeeper.
  sketch.Age();
  EXPECT_EQ(sketch.Estimate(key), 2u);
}

TEST(FrequencySketchTest, SaturatesAtFifteenPlusTheDoorkeeper) {
  FrequencySketch sketch(1024);
  const uint64_t key = 7;
  for (int i = 0; i < 100; ++i) sketch.Increment(key);
  EXPECT_EQ(sketch.Estimate(key), FrequencySketch::kMaxEstimate);
  EXPECT_EQ(FrequencySketch::kMaxEstimate, 16u);
  // A saturated counter does not wrap into its neighbour: other keys stay unseen.
  for (uint64_t h : DistinctHashes(200, 2)) EXPECT_EQ(sketch.Estimate(h), 0u) << h;
}

TEST(FrequencySketchTest, AgeHalvesEstimatesAndClearsTheDoorkeeper) {
  FrequencySketch sketch(1024);
  const uint64_t saturated = 1001, nine = 1002, two = 1003, once = 1004;
  for (int i = 0; i < 40; ++i) sketch.Increment(saturated);  // counters 15, doorkeeper set: 16
  for (int i = 0; i < 9; ++i) sketch.Increment(nine);        // counters 8: 9
  for (int i = 0; i < 2; ++i) sketch.Increment(two);         // counters 1: 2
  sketch.Increment(once);                                    // doorkeeper only: 1
  ASSERT_EQ(sketch.Estimate(saturated), 16u);
  ASSERT_EQ(sketch.Estimate(nine), 9u);
  ASSERT_EQ(sketch.Estimate(two), 2u);
  ASSERT_EQ(sketch.Estimate(once), 1u);
  ASSERT_EQ(sketch.additions_since_age(), 52u);

  sketch.Age();
  EXPECT_EQ(sketch.Estimate(saturated), 7u);
  EXPECT_EQ(sketch.Estimate(nine), 4u);
  EXPECT_EQ(sketch.Estimate(two), 0u);
  EXPECT_EQ(sketch.Estimate(once), 0u);
  EXPECT_EQ(sketch.additions_since_age(), 0u);

  // With the doorkeeper cleared, the next sighting goes back to the doorkeeper first.
  sketch.Increment(nine);
  EXPECT_EQ(sketch.Estimate(nine), 5u);
  sketch.Increment(nine);
  EXPECT_EQ(sketch.Estimate(nine), 6u);
}

TEST(FrequencySketchTest, AgeHalvesEveryCounterWithoutBorrowing) {
  // A dense sketch where most words hold several non-zero counters, so a halving that let one
  // counter's low bit spill into its neighbour would show. Every key seen since the last aging has
  // its doorkeeper bits set, so its estimate is counters + 1 before and counters / 2 after (the
  // minimum commutes with halving).
  FrequencySketch sketch(64);
  const std::vector<uint64_t> keys = DistinctHashes(100, 13);
  std::mt19937_64 rng(14);
  std::geometric_distribution<size_t> pick(0.05);
  std::unordered_set<uint64_t> seen;
  for (uint64_t i = 0; i < sketch.sample_size() - 1; ++i) {
    const uint64_t key = keys[pick(rng) % keys.size()];
    sketch.Increment(key);
    seen.insert(key);
  }
  std::unordered_map<uint64_t, uint32_t> before;
  for (uint64_t key : seen) before[key] = sketch.Estimate(key);
  sketch.Age();
  size_t odd_counts = 0;
  for (const auto& [key, estimate] : before) {
    ASSERT_GE(estimate, 1u);
    if ((estimate - 1) % 2 == 1) ++odd_counts;
    EXPECT_EQ(sketch.Estimate(key), (estimate - 1) / 2) << key;
  }
  EXPECT_GT(odd_counts, 10u) << "the stream should leave many odd counters to halve";
}

TEST(FrequencySketchTest, AgesOnItsOwnAfterSampleSizeIncrements) {
  FrequencySketch sketch(64);
  ASSERT_EQ(sketch.sample_size(), 640u);
  const uint64_t hot = 99;
  for (int i = 0; i < 20; ++i) sketch.Increment(hot);
  ASSERT_EQ(sketch.Estimate(hot), 16u);

  // Fill the period up to one increment short of the sample size. The hot key's counters are
  // saturated, so no collision can move them, and its doorkeeper bits stay set until aging.
  const std::vector<uint64_t> filler = DistinctHashes(sketch.sample_size() - 21, 3);
  for (uint64_t h : filler) sketch.Increment(h);
  EXPECT_EQ(sketch.additions_since_age(), sketch.sample_size() - 1);
  EXPECT_EQ(sketch.Estimate(hot), 16u);

  sketch.Increment(filler.front());
  EXPECT_EQ(sketch.additions_since_age(), 0u);
  EXPECT_EQ(sketch.Estimate(hot), 7u);
}

TEST(FrequencySketchTest, NeverUnderestimatesBetweenAgings) {
  // A skewed stream over a sketch much smaller than the key space: collisions abound, yet each
  // estimate is at least the key's true count (capped at 16), which is the count-min guarantee
  // conservative update keeps.
  FrequencySketch sketch(256);
  const std::vector<uint64_t> keys = DistinctHashes(2000, 4);
  std::mt19937_64 rng(5);
  std::geometric_distribution<size_t> pick(0.01);
  std::unordered_map<uint64_t, uint32_t> truth;
  const uint64_t accesses = sketch.sample_size() - 1;  // stays inside one period
  for (uint64_t i = 0; i < accesses; ++i) {
    const uint64_t key = keys[pick(rng) % keys.size()];
    sketch.Increment(key);
    ++truth[key];
  }
  ASSERT_EQ(sketch.additions_since_age(), accesses);
  ASSERT_GT(truth.size(), 200u);
  for (const auto& [key, count] : truth) {
    EXPECT_GE(sketch.Estimate(key), std::min(count, FrequencySketch::kMaxEstimate)) << key;
  }
}

TEST(FrequencySketchTest, HotKeysOutrankOneHitWonders) {
  FrequencySketch sketch(100'000);
  const std::vector<uint64_t> all = DistinctHashes(100'100, 6);
  const std::vector<uint64_t> hot(all.begin(), all.begin() + 100);
  const std::vector<uint64_t> cold(all.begin() + 100, all.end());

  // 100 hot keys seen 10 times each, shuffled into 100k keys seen once.
  std::vector<uint64_t> stream(cold);
  for (uint64_t h : hot) stream.insert(stream.end(), 10, h);
  std::shuffle(stream.begin(), stream.end(), std::mt19937_64(8));
  for (uint64_t h : stream) sketch.Increment(h);
  ASSERT_LT(stream.size(), sketch.sample_size()) << "the test assumes no aging";

  uint32_t min_hot = FrequencySketch::kMaxEstimate;
  for (uint64_t h : hot) min_hot = std::min(min_hot, sketch.Estimate(h));
  EXPECT_GE(min_hot, 10u);

  size_t cold_at_least_hot = 0;
  size_t cold_above_one = 0;
  for (uint64_t h : cold) {
    const uint32_t estimate = sketch.Estimate(h);
    if (estimate >= min_hot) ++cold_at_least_hot;
    if (estimate > 1) ++cold_above_one;
  }
  EXPECT_LE(cold_at_least_hot, 10u);
  // A cold key estimates 1 unless its first sighting hit a doorkeeper false positive or its
  // counters all collide with other keys'.
  EXPECT_LE(cold_above_one, cold.size() / 100);
}

TEST(FrequencySketchTest, HotKeysSurviveAScanThroughASmallSketch) {
  // The regime admission exists for: a 1024-entry cache whose stream is mostly unique blocks. Aging
  // runs many times; hot keys must still beat the typical one-hit key.
  FrequencySketch sketch(1024);
  const std::vector<uint64_t> hot = DistinctHashes(64, 9);
  const std::vector<uint64_t> cold = DistinctHashes(200'000, 10);
  std::mt19937_64 rng(11);
  size_t next_cold = 0;
  uint64_t accesses = 0;
  for (int round = 0; round < 40'000; ++round) {
    sketch.Increment(hot[rng() % hot.size()]);
    for (int i = 0; i < 4; ++i) sketch.Increment(cold[next_cold++]);
    accesses += 5;
  }
  ASSERT_GT(accesses / sketch.sample_size(), 10u) << "the test assumes many agings";

  const std::vector<uint64_t> fresh = DistinctHashes(1000, 12);
  size_t hot_rejected = 0;
  for (uint64_t h : hot) {
    // A brand-new block never displaces a hot one, and a hot block displaces a recent one-hit
    // block.
    EXPECT_FALSE(sketch.AdmitCandidate(fresh[h % fresh.size()], h));
    if (!sketch.AdmitCandidate(h, cold[next_cold - 1 - (h % 1000)])) ++hot_rejected;
  }
  EXPECT_LE(hot_rejected, 2u);

  // Even this crowded, most never-seen keys still estimate 0: conservative update keeps the one-hit
  // traffic that slips past the doorkeeper from raising every counter it touches (about 80% here;
  // plain count-min, 50%).
  size_t fresh_at_zero = 0;
  for (uint64_t h : fresh) fresh_at_zero += sketch.Estimate(h) == 0 ? 1 : 0;
  EXPECT_GE(fresh_at_zero, 700u);
}

TEST(FrequencySketchTest, AdmitCandidateNeedsAStrictlyHigherEstimate) {
  FrequencySketch sketch(1024);
  const uint64_t hot = 500, one_hit = 501, unseen = 502, other_unseen = 503;
  for (int i = 0; i < 10; ++i) sketch.Increment(hot);
  sketch.Increment(one_hit);

  EXPECT_FALSE(sketch.AdmitCandidate(one_hit, hot));  // a one-hit wonder does not flush a hot block
  EXPECT_TRUE(sketch.AdmitCandidate(hot, one_hit));   // a hot block displaces a cold one
  EXPECT_TRUE(sketch.AdmitCandidate(one_hit, unseen));
  // Ties reject the candidate.
  EXPECT_FALSE(sketch.AdmitCandidate(unseen, other_unseen));
  EXPECT_FALSE(sketch.AdmitCandidate(hot, hot));
  EXPECT_FALSE(sketch.AdmitCandidate(one_hit, one_hit));
}

}  // namespace
}  // namespace orbitkv::core
