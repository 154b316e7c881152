#include "core/frequency_sketch.h"

#include <algorithm>
#include <bit>

#include "base/check.h"

namespace orbitkv::core {
namespace {

constexpr int kCountersPerWord = 16;  // 4-bit counters in a uint64_t.
// 16 doorkeeper bits per unit of width: with 3 probes the false-positive rate is about 0.5% after
// width() distinct keys in a sample period, 3% after 2 * width() and 15% after 4 * width(). A false
// positive only sends a first sighting to the counters, so it costs accuracy, never correctness.
constexpr uint64_t kDoorkeeperBitsPerWidth = 16;
// Aging every 10 * width() accesses, as in the W-TinyLFU paper and Caffeine, lets a key's count
// reach the saturation point within one period if it is hot, while a period is short enough to
// follow a shifting workload.
constexpr uint64_t kSampleFactor = 10;
// Clears the top bit of each nibble after a word is shifted right by one, so halving never borrows
// a bit from the neighbouring counter.
constexpr uint64_t kHalveMask = 0x7777'7777'7777'7777;

// Distinct odd multipliers (from splitmix64, xxHash and MurmurHash3). Multiply-shift with a
// distinct odd multiplier per row gives each row its own index from one mixed hash.
constexpr uint64_t kRowMultipliers[FrequencySketch::kRows] = {0x9E37'79B9'7F4A'7C15, 0xC2B2'AE3D'27D4'EB4F,
                                                              0x1656'67B1'9E37'79F9, 0xD6E8'FEB8'6659'FD93};
constexpr uint64_t kProbeMultipliers[FrequencySketch::kDoorkeeperProbes] = {
    0xBF58'476D'1CE4'E5B9, 0x94D0'49BB'1331'11EB, 0xFF51'AFD7'ED55'8CCD};
static_assert(std::all_of(std::begin(kRowMultipliers), std::end(kRowMultipliers),
                          [](uint64_t m) { return (m & 1) == 1; }),
              "multiply-shift needs odd multipliers");
static_assert(std::all_of(std::begin(kProbeMultipliers), std::end(kProbeMultipliers),
                          [](uint64_t m) { return (m & 1) == 1; }),
              "multiply-shift needs odd multipliers");

// splitmix64's finalizer: a bijection that spreads every input bit over the whole word. The input
// is already a hash, but mixing again keeps the rows independent of whatever structure the caller's
// hash has.
constexpr uint64_t Mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58'476D'1CE4'E5B9;
  x ^= x >> 27;
  x *= 0x94D0'49BB'1331'11EB;
  x ^= x >> 31;
  return x;
}

uint64_t WidthFor(uint64_t expected_entries) {
  return std::bit_ceil(std::clamp(expected_entries, FrequencySketch::kMinWidth, FrequencySketch::kMaxWidth));
}

int ShiftFor(uint64_t power_of_two) { return 64 - std::countr_zero(power_of_two); }

}  // namespace

FrequencySketch::FrequencySketch(uint64_t expected_entries)
    : width_(WidthFor(expected_entries)),
      sample_size_(kSampleFactor * width_),
      counter_shift_(ShiftFor(width_)),
      doorkeeper_shift_(ShiftFor(kDoorkeeperBitsPerWidth * width_)),
      counters_(kRows * width_ / kCountersPerWord, 0),
      doorkeeper_(kDoorkeeperBitsPerWidth * width_ / 64, 0) {
  ORBITKV_CHECK(std::has_single_bit(width_) && width_ >= kMinWidth && width_ <= kMaxWidth);
}

FrequencySketch::Slots FrequencySketch::SlotsFor(uint64_t key_hash) const {
  Slots slots;
  const uint64_t h = Mix64(key_hash);
  for (int row = 0; row < kRows; ++row) {
    slots.counter[row] = (h * kRowMultipliers[row]) >> counter_shift_;
  }
  // The next splitmix64 step (add its golden-ratio increment, mix again): doorkeeper bits drawn
  // from it do not track the counter indices.
  const uint64_t g = Mix64(h + 0x9E37'79B9'7F4A'7C15);
  for (int probe = 0; probe < kDoorkeeperProbes; ++probe) {
    slots.doorkeeper_bit[probe] = (g * kProbeMultipliers[probe]) >> doorkeeper_shift_;
  }
  return slots;
}

uint32_t FrequencySketch::Counter(int row, uint64_t index) const {
  const uint64_t flat = static_cast<uint64_t>(row) * width_ + index;
  const int shift = static_cast<int>(flat % kCountersPerWord) * 4;
  return static_cast<uint32_t>((counters_[flat / kCountersPerWord] >> shift) & 0xF);
}

bool FrequencySketch::DoorkeeperContains(const Slots& slots) const {
  for (uint64_t bit : slots.doorkeeper_bit) {
    if ((doorkeeper_[bit / 64] & (uint64_t{1} << (bit % 64))) == 0) return false;
  }
  return true;
}

void FrequencySketch::Increment(uint64_t key_hash) {
  const Slots slots = SlotsFor(key_hash);
  if (!DoorkeeperContains(slots)) {
    for (uint64_t bit : slots.doorkeeper_bit) doorkeeper_[bit / 64] |= uint64_t{1} << (bit % 64);
  } else {
    uint32_t values[kRows];
    uint32_t min_value = kMaxCounter;
    for (int row = 0; row < kRows; ++row) {
      values[row] = Counter(row, slots.counter[row]);
      min_value = std::min(min_value, values[row]);
    }
    if (min_value < kMaxCounter) {
      // Conservative update: counters above the minimum already over-count this key; raising them
      // would only inflate the keys they collide with.
      for (int row = 0; row < kRows; ++row) {
        if (values[row] != min_value) continue;
        const uint64_t flat = static_cast<uint64_t>(row) * width_ + slots.counter[row];
        counters_[flat / kCountersPerWord] += uint64_t{1} << ((flat % kCountersPerWord) * 4);
      }
    }
  }
  if (++additions_since_age_ >= sample_size_) Age();
}

uint32_t FrequencySketch::Estimate(uint64_t key_hash) const {
  const Slots slots = SlotsFor(key_hash);
  uint32_t min_value = kMaxCounter;
  for (int row = 0; row < kRows; ++row) {
    min_value = std::min(min_value, Counter(row, slots.counter[row]));
  }
  return min_value + (DoorkeeperContains(slots) ? 1 : 0);
}

void FrequencySketch::Age() {
  for (uint64_t& word : counters_) word = (word >> 1) & kHalveMask;
  std::fill(doorkeeper_.begin(), doorkeeper_.end(), 0);
  additions_since_age_ = 0;
}

size_t FrequencySketch::MemoryBytes() const { return (counters_.size() + doorkeeper_.size()) * sizeof(uint64_t); }

}  // namespace orbitkv::core
