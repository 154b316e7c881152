// FrequencySketch: the approximate access-frequency history behind W-TinyLFU admission.
//
// The block table keeps sealed, unpinned blocks on an LRU list; when the pool is full, a newly
// sealed block (the candidate) may only displace the LRU tail (the victim) if it has been asked for
// more often recently. That keeps a burst of one-hit wonders (a long unique prompt, a scan) from
// flushing hot shared prefixes. This class answers "how often, recently?" in 4 bytes per cached
// block:
//
// - A doorkeeper: a Bloom filter that absorbs the first sighting of a key. Most keys are seen once,
//   so they never reach the counters.
// - A count-min sketch: 4 rows of width() 4-bit saturating counters, packed 16 to a uint64_t word.
//   A key maps to one counter per row; its count is the minimum of the four. Increments are
//   conservative: only the counters that equal that minimum grow, which keeps collisions from
//   inflating other keys' counts.
// - Aging: after sample_size() increments, every counter is halved and the doorkeeper is cleared,
//   so the history follows the workload rather than all time.
//
// Invariants: width() is a power of two in [kMinWidth, kMaxWidth]; each counter is in [0, 15];
// Estimate() is in [0, 16]. Between two agings, Estimate(k) >= min(increments of k, 16): like any
// count-min sketch it may overestimate (hash collisions, doorkeeper false positives) but never
// underestimates. The counters and the doorkeeper are allocated once, in the constructor; nothing
// allocates afterwards.
//
// Thread safety: none. A FrequencySketch must be externally synchronized; the block table keeps one
// per shard and calls it only under that shard's mutex. The const methods only read, so they may
// run concurrently with each other while nothing mutates the sketch.
#ifndef ORBITKV_CORE_FREQUENCY_SKETCH_H_
#define ORBITKV_CORE_FREQUENCY_SKETCH_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace orbitkv::core {

class FrequencySketch {
 public:
  // Sizing bounds for width(), in counters per row.
  static constexpr uint64_t kMinWidth = 64;
  static constexpr uint64_t kMaxWidth = uint64_t{1} << 30;
  // A counter saturates at 15; the doorkeeper adds one more.
  static constexpr uint32_t kMaxCounter = 15;
  static constexpr uint32_t kMaxEstimate = kMaxCounter + 1;
  // Count-min rows, and doorkeeper bits probed per key.
  static constexpr int kRows = 4;
  static constexpr int kDoorkeeperProbes = 3;

  // `expected_entries` is the number of blocks the owner caches (the table shard's capacity).
  // width() becomes the next power of two >= expected_entries, clamped to [kMinWidth, kMaxWidth];
  // sample_size() is 10 * width(). Memory is 4 bytes per unit of width (see MemoryBytes()).
  explicit FrequencySketch(uint64_t expected_entries);

  FrequencySketch(const FrequencySketch&) = delete;
  FrequencySketch& operator=(const FrequencySketch&) = delete;

  // Records one access of the key whose 64-bit hash is `key_hash` (already a good hash, e.g.
  // StateKey::Hash64()). The first sighting since the last aging only sets the key's doorkeeper
  // bits; later ones increment its count-min counters (conservatively, saturating at 15). Every
  // call counts toward sample_size(); the call that reaches it ages the sketch (see Age()).
  void Increment(uint64_t key_hash);

  // The key's approximate access count since the last aging, plus its halved history: the minimum
  // of its four counters, plus 1 if the doorkeeper holds it. 0 for a key never seen (barring
  // collisions); at most 16.
  uint32_t Estimate(uint64_t key_hash) const;

  // W-TinyLFU's admission test: true when the candidate (a block about to be cached) has a strictly
  // higher estimate than the victim (the block it would evict). Ties reject the candidate: the
  // victim is already cached and was at least as popular, so evicting it would only churn the
  // cache.
  bool AdmitCandidate(uint64_t candidate_hash, uint64_t victim_hash) const {
    return Estimate(candidate_hash) > Estimate(victim_hash);
  }

  // Halves every counter (rounding down), clears the doorkeeper and restarts the sample count.
  // Increment() calls it on its own; it is public so that the owner and tests can age on demand.
  void Age();

  uint64_t width() const { return width_; }
  uint64_t sample_size() const { return sample_size_; }
  // Increment() calls since the last aging; always < sample_size().
  uint64_t additions_since_age() const { return additions_since_age_; }
  // Heap bytes held: the counter table and the doorkeeper, 2 * width() bytes each.
  size_t MemoryBytes() const;

 private:
  // The key's counter index (in [0, width_)) in each row, and its doorkeeper bit indices.
  struct Slots {
    uint64_t counter[kRows];
    uint64_t doorkeeper_bit[kDoorkeeperProbes];
  };
  Slots SlotsFor(uint64_t key_hash) const;

  uint32_t Counter(int row, uint64_t index) const;
  bool DoorkeeperContains(const Slots& slots) const;

  // Immutable after construction.
  const uint64_t width_;
  const uint64_t sample_size_;
  const int counter_shift_;     // 64 - log2(width_): multiply-shift yields a counter index.
  const int doorkeeper_shift_;  // 64 - log2(doorkeeper bits): multiply-shift yields a bit index.

  // Mutable state (the owner synchronizes).
  // Row r's counter i is nibble (r * width_ + i) % 16 of word (r * width_ + i) / 16.
  std::vector<uint64_t> counters_;
  std::vector<uint64_t> doorkeeper_;
  uint64_t additions_since_age_ = 0;
};

}  // namespace orbitkv::core

#endif  // ORBITKV_CORE_FREQUENCY_SKETCH_H_
