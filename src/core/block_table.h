// BlockTable: the content-addressed table of cached blocks, keyed by StateKey, with DRAM payloads
// in the pinned pool and an independent SSD residence per key.
//
// A DRAM block moves through preparing -> sealed -> evicting. Prepare() allocates pool memory for a
// writer that is not visible to readers; Seal() publishes it as the key's DRAM residence with a
// fresh generation; eviction, cleanup or replacement unpublish it (evicting) and its memory returns
// to the pool once nothing references it. Readers only ever see sealed blocks. Every publish and
// unpublish of a residence, DRAM or SSD, goes through one transition function that changes the
// table and appends to the ResidencyInventory in the same locked step.
//
// A block slot is referenced by the table while it is the key's published residence, and once per
// BlockPin (a lease, a running copy, an SSD write-back, a peer read). A sealed block stays on its
// LRU list while pinned (pinning and lookups never relink lists, they bump a count or set a bit);
// eviction skips pinned blocks, so they are never evicted. A slot (and its pool memory) is reused
// only when it is unpublished (the seed's SemanticDead condition) and has no pin left
// (ExecutionComplete).
//
// Replacement is W-TinyLFU: new blocks enter a small admission window. While the pool has room,
// blocks leaving the window (beyond window_fraction of the pool) move to the main segment. Once
// memory must be freed, each eviction makes the window's oldest block (the candidate) duel the main
// segment's least recently used block (the victim) on estimated access frequency, and the loser is
// evicted. A block seen once therefore leaves through the window without flushing a hot prefix out
// of the main segment. Evictions start in the shard of the block being written, so each shard's
// window drains as fast as it fills.
//
// The table is split into shards by StateKey::Hash64 (leveldb's ShardedLRUCache shape), each with
// its own mutex, LRU lists and frequency sketch, so lookups from many sessions do not serialize on
// one lock. Lock order: a table shard's mutex, then the pool's and the inventory's; callbacks (the
// eviction listener) run with no lock.
//
// Thread safety: all methods are safe from any thread.
#ifndef ORBITKV_CORE_BLOCK_TABLE_H_
#define ORBITKV_CORE_BLOCK_TABLE_H_

#include <atomic>
#include <bit>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "absl/container/node_hash_map.h"
#include "base/metrics.h"
#include "base/mutex.h"
#include "base/result.h"
#include "base/thread_annotations.h"
#include "core/frequency_sketch.h"
#include "core/inventory.h"
#include "core/slab_pool.h"
#include "state/state_key.h"

namespace orbitkv::core {

class BlockTable;

// Names one DRAM block version: the slot and the slot's generation. This, packed, is what crosses a
// process boundary; a stale value is detected, never dereferenced.
struct BlockRef {
  uint32_t shard = 0;
  uint32_t index = 0;
  uint32_t generation = 0;  // 0 is never a live slot generation
  friend bool operator==(const BlockRef&, const BlockRef&) = default;
};

// One reference on a DRAM block: while it exists the block's bytes stay valid and unchanged and the
// block is not evicted. Move-only; destruction releases the reference (and frees the block if it
// was the last one and the block is no longer published).
class BlockPin {
 public:
  BlockPin() = default;
  BlockPin(BlockPin&& other) noexcept;
  BlockPin& operator=(BlockPin&& other) noexcept;
  BlockPin(const BlockPin&) = delete;
  BlockPin& operator=(const BlockPin&) = delete;
  ~BlockPin() { Reset(); }

  bool valid() const { return table_ != nullptr; }
  const BlockRef& ref() const { return ref_; }
  const uint8_t* data() const { return data_; }
  uint64_t bytes() const { return bytes_; }
  // Residence generation of the DRAM block (unique per publication, shared by every pin of it).
  uint64_t generation() const { return generation_; }
  // The inventory sequence of the record that published this residence: with the generation, the
  // exact version a peer was told about (PinExact).
  uint64_t sequence() const { return sequence_; }
  // Where the bytes are in the pool, for a transfer grant: arena index and offset inside it.
  uint32_t arena() const { return arena_; }
  uint64_t arena_offset() const;
  void Reset();
  // Another pin on the same block (published or not): it stays readable until both are gone. An
  // empty pin clones to an empty pin.
  BlockPin Clone() const;
  // Releases every pin in `pins` (taking each table shard's lock once) and clears the vector.
  static void ReleaseAll(std::vector<BlockPin>* pins);

 private:
  friend class BlockTable;
  BlockPin(BlockTable* table, BlockRef ref, const uint8_t* data, uint64_t bytes, uint64_t generation,
           uint64_t sequence = 0, uint32_t arena = 0)
      : table_(table),
        ref_(ref),
        data_(data),
        bytes_(bytes),
        generation_(generation),
        sequence_(sequence),
        arena_(arena) {}

  BlockTable* table_ = nullptr;
  BlockRef ref_;
  const uint8_t* data_ = nullptr;
  uint64_t bytes_ = 0;
  uint64_t generation_ = 0;
  uint64_t sequence_ = 0;
  uint32_t arena_ = 0;
};

// Why PinExact stopped before the end of its keys.
enum class ExactStop : uint8_t {
  kNone = 0,      // every key pinned
  kAbsent = 1,    // no residence at all: evicted from every tier, or never held
  kNotDram = 2,   // resident, but not in DRAM (on SSD only)
  kReplaced = 3,  // in DRAM with another version (generation or sequence) than asked for
};

struct ExactPins {
  size_t pinned = 0;                  // the prefix pinned (one pin per key appended to the caller's vector)
  ExactStop stop = ExactStop::kNone;  // why key `pinned` was not
};

// Exclusive write access to a preparing block. Seal() publishes it; dropping it unsealed aborts the
// write and frees the memory. Move-only.
class BlockWriter {
 public:
  BlockWriter() = default;
  BlockWriter(BlockWriter&& other) noexcept;
  BlockWriter& operator=(BlockWriter&& other) noexcept;
  BlockWriter(const BlockWriter&) = delete;
  BlockWriter& operator=(const BlockWriter&) = delete;
  ~BlockWriter() { Abort(); }

  bool valid() const { return table_ != nullptr; }
  uint8_t* data() const { return data_; }
  uint64_t bytes() const { return bytes_; }
  const BlockRef& ref() const { return ref_; }
  void Abort();

 private:
  friend class BlockTable;
  BlockWriter(BlockTable* table, BlockRef ref, uint8_t* data, uint64_t bytes)
      : table_(table), ref_(ref), data_(data), bytes_(bytes) {}

  BlockTable* table_ = nullptr;
  BlockRef ref_;
  uint8_t* data_ = nullptr;
  uint64_t bytes_ = 0;
};

// An SSD residence as the table records it; the storage module owns the meaning of `locator`.
struct SsdResidence {
  uint64_t generation = 0;
  uint64_t locator = 0;
  uint64_t bytes = 0;
};

// Where each key of a lookup can be served from.
enum class Residence : uint8_t { kMiss = 0, kDram = 1, kSsd = 2 };

struct BlockTableStats {
  uint64_t resident_blocks = 0;     // sealed DRAM residences
  uint64_t resident_bytes = 0;      // their requested bytes
  uint64_t pinned_blocks = 0;       // DRAM blocks with at least one pin (published or not)
  uint64_t preparing_blocks = 0;    // writers not yet sealed
  uint64_t unpublished_blocks = 0;  // evicted or removed but still pinned
  uint64_t ssd_residences = 0;
  uint64_t ssd_bytes = 0;
};

class BlockTable {
 public:
  struct Options {
    uint32_t shards = 16;
    // Share of the pool's capacity that the W-TinyLFU admission window may hold.
    double window_fraction = 0.01;
    // Sizes the frequency sketches; about the number of blocks the pool holds.
    uint64_t expected_blocks = 65536;
  };

  // The SSD tier installs this to take a write-back copy of an evicted DRAM block. It runs with no
  // lock held, on the evicting thread; keeping the pin keeps the bytes valid until the copy is
  // done.
  using EvictionListener = std::function<void(const state::StateKey& key, BlockPin pin)>;

  // `pool`, `inventory` and `metrics` must outlive the table.
  BlockTable(const Options& options, PinnedPool* pool, ResidencyInventory* inventory, MetricsRegistry* metrics);
  // Every BlockPin and BlockWriter must be gone (CHECK); remaining published blocks are freed.
  ~BlockTable();
  BlockTable(const BlockTable&) = delete;
  BlockTable& operator=(const BlockTable&) = delete;

  // Set before use; not synchronized with concurrent evictions.
  void SetEvictionListener(EvictionListener listener) { eviction_listener_ = std::move(listener); }

  // Allocates `bytes` of pool memory for `key`, evicting unpinned blocks as needed.
  // AlreadyExists: the key already has a sealed DRAM residence (nothing to write).
  // Aborted: another writer is preparing the same key right now.
  // ResourceExhausted: nothing more can be evicted (all memory pinned or preparing): backpressure.
  // InvalidArgument: bytes is 0 or larger than the pool's largest block.
  Result<BlockWriter> Prepare(const state::StateKey& key, uint64_t bytes);

  // Publishes the written block as the key's DRAM residence (inventory cause kAdmit, or kRestore
  // when it was filled from another tier or a peer) and returns its residence generation. The
  // writer becomes invalid.
  // With `pin` (an empty BlockPin), it also pins the block in the same step, so nothing can evict it
  // in between.
  uint64_t Seal(BlockWriter& writer, TransitionCause cause = TransitionCause::kAdmit, BlockPin* pin = nullptr);
  // Seals every writer (as Seal, without pins), taking each table shard's lock once.
  void SealAll(std::span<BlockWriter> writers, TransitionCause cause = TransitionCause::kAdmit);

  // Length of the longest prefix of `keys` with sealed DRAM residences. Counts as an access to each
  // examined key.
  size_t LookupPrefix(std::span<const state::StateKey> keys);
  // Per key, the best residence (DRAM before SSD), up to the first key with neither; returns that
  // prefix length.
  size_t LookupPrefixTiers(std::span<const state::StateKey> keys, std::vector<Residence>* tiers);

  // Pins the longest DRAM-resident prefix of `keys`, appending one pin per key to `pins`; returns
  // its length.
  size_t PinPrefix(std::span<const state::StateKey> keys, std::vector<BlockPin>* pins);
  // Pins the longest prefix of `keys` whose DRAM residences are exactly the versions named (key i
  // with residence generation generations[i] and inventory sequence sequences[i]), appending one
  // pin per key to `pins`, and says why it stopped. A source serves a peer only what it announced:
  // a replaced or re-admitted block is never handed out under an old version. The spans must have
  // equal lengths (CHECK).
  ExactPins PinExact(std::span<const state::StateKey> keys, std::span<const uint64_t> generations,
                     std::span<const uint64_t> sequences, std::vector<BlockPin>* pins);
  // NotFound when the key has no sealed DRAM residence.
  Result<BlockPin> Pin(const state::StateKey& key);
  // Clone(): one more pin on the block `ref` names, which `existing` already pins (CHECK).
  BlockPin PinAgain(const BlockRef& ref);
  // Re-pins a block named by a ref from another process. Aborted when the ref is stale (slot reused
  // or freed), InvalidArgument when it is out of range.
  Result<BlockPin> PinRef(const BlockRef& ref);

  // Unpublishes the key's residence on `tier` (cause kCleanup by default). A pinned DRAM block
  // stays readable through its pins and is freed after the last one. NotFound when there is no such
  // residence.
  Status Remove(const state::StateKey& key, Tier tier, TransitionCause cause = TransitionCause::kCleanup);
  // Unpublishes every DRAM residence (pinned ones stay readable through their pins). Returns how
  // many.
  size_t RemoveAllDram();
  // Evicts unpinned DRAM blocks in replacement order until at least `bytes` were unpublished or
  // none is left.
  uint64_t EvictBytes(uint64_t bytes);

  // Publishes (or replaces) the key's SSD residence after its write completed; returns the new
  // generation.
  uint64_t PublishSsd(const state::StateKey& key, uint64_t locator, uint64_t bytes,
                      TransitionCause cause = TransitionCause::kAdmit);
  std::optional<SsdResidence> FindSsd(const state::StateKey& key);
  // Removes the SSD residence only if it still has `generation` (a late failure never drops a newer
  // copy). NotFound when absent, Aborted when the generation differs.
  Status DropSsd(const state::StateKey& key, uint64_t generation, TransitionCause cause);

  // How often `key` was accessed recently (the W-TinyLFU sketch's estimate, 0..16); the SSD tier's
  // admission filter reads it for evicted blocks.
  uint32_t Frequency(const state::StateKey& key);
  // Keys with a sealed DRAM residence and no SSD residence, accessed at least `min_frequency` times
  // recently, most frequent first (the SSD tier writes them before the Manager exits).
  std::vector<state::StateKey> DramOnlyKeys(uint32_t min_frequency);

  BlockTableStats Stats() const;
  uint32_t shard_count() const { return static_cast<uint32_t>(shards_.size()); }

 private:
  friend class BlockPin;
  friend class BlockWriter;

  static constexpr uint32_t kNone = UINT32_MAX;

  enum class BlockState : uint8_t { kFree, kPreparing, kSealed, kUnpublished };
  enum class Segment : uint8_t { kNone, kWindow, kMain };

  struct Entry;
  struct Block {
    // The key of its entry (the entries map's node holds the one copy, and nodes never move): set by
    // Prepare, read only while that entry exists (Seal, Abort, eviction, the transition that
    // unpublishes it), cleared when the slot is freed.
    const state::StateKey* key = nullptr;
    uint64_t hash = 0;
    PoolBlock memory;
    uint64_t residence_generation = 0;
    uint64_t residence_sequence = 0;  // the inventory record that published it (sealed blocks)
    uint32_t slot_generation = 1;
    uint32_t pins = 0;  // live BlockPins; a sealed block is also referenced by the table itself
    uint32_t inventory_shard = 0;
    BlockState state = BlockState::kFree;
    Segment segment = Segment::kNone;  // the segment it belongs to, kept while pinned
    bool on_list = false;
    bool under_pressure = false;  // its Prepare had to evict: the pool was full
    bool referenced = false;      // accessed since it was last placed at the front of its list
    uint32_t prev = kNone;
    uint32_t next = kNone;
    // Its table entry while it is being written or published (entry->preparing or entry->dram
    // names this slot), so Seal, Abort and eviction need no second lookup of the 128-byte key;
    // the entries map's nodes never move. Null once unpublished or free.
    Entry* entry = nullptr;
  };

  struct Entry {
    uint32_t dram = kNone;       // sealed block slot
    uint32_t preparing = kNone;  // writer's slot
    std::optional<SsdResidence> ssd;
    uint32_t inventory_shard = 0;
  };

  // A key with its hash computed once: lookups hash each key once for the shard choice and the map
  // probe.
  struct HashedKey {
    const state::StateKey* key;
    uint64_t hash;
  };
  struct EntryHash {
    using is_transparent = void;
    // Rotated: the shard is hash % shards, so within a shard the low bits, which SwissTable uses as
    // its 7-bit tag, would repeat.
    size_t operator()(const state::StateKey& key) const { return Mix(key.Hash64()); }
    size_t operator()(const HashedKey& key) const { return Mix(key.hash); }
    static size_t Mix(uint64_t hash) { return std::rotl(hash, 32); }
  };
  struct EntryEqual {
    using is_transparent = void;
    bool operator()(const state::StateKey& a, const state::StateKey& b) const { return a == b; }
    bool operator()(const HashedKey& a, const state::StateKey& b) const { return *a.key == b; }
    bool operator()(const state::StateKey& a, const HashedKey& b) const { return a == *b.key; }
  };

  struct List {
    uint32_t head = kNone;  // most recently used
    uint32_t tail = kNone;  // least recently used
    uint64_t bytes = 0;
    uint64_t count = 0;
  };

  struct Shard {
    explicit Shard(uint64_t expected_entries) : sketch(expected_entries) {}
    mutable Mutex mu;
    // A SwissTable: one probe of a control group, then the node (std::unordered_map walked a
    // bucket's chain of cold nodes, a quarter of a 16 KiB save's time). Nodes stay put, so
    // Block::entry stays valid.
    absl::node_hash_map<state::StateKey, Entry, EntryHash, EntryEqual> entries GUARDED_BY(mu);
    std::deque<Block> slots GUARDED_BY(mu);
    std::vector<uint32_t> free_slots GUARDED_BY(mu);
    List window GUARDED_BY(mu);
    List main GUARDED_BY(mu);
    FrequencySketch sketch GUARDED_BY(mu);
    uint64_t resident_blocks GUARDED_BY(mu) = 0;
    uint64_t resident_bytes GUARDED_BY(mu) = 0;
    uint64_t pinned_blocks GUARDED_BY(mu) = 0;
    uint64_t preparing_blocks GUARDED_BY(mu) = 0;
    uint64_t unpublished_blocks GUARDED_BY(mu) = 0;
    uint64_t ssd_residences GUARDED_BY(mu) = 0;
    uint64_t ssd_bytes GUARDED_BY(mu) = 0;
  };

  // A block unpublished under a shard lock, handed to the listener (or just released) after
  // unlocking.
  struct Evicted {
    state::StateKey key;
    BlockPin pin;
  };

  Shard& ShardOf(uint64_t hash) { return *shards_[hash % shards_.size()]; }
  uint32_t ShardIndex(uint64_t hash) const { return static_cast<uint32_t>(hash % shards_.size()); }

  // Visits the keys of a prefix lookup shard by shard (one lock per shard); `visit(shard,
  // shard_index, i, entry or nullptr)` runs under the shard lock and returns whether key i extends
  // the prefix. Returns the prefix length.
  template <typename Visit>
  size_t ScanPrefix(std::span<const state::StateKey> keys, Visit&& visit);

  // The one residency transition function: publishes (present) or unpublishes a residence in the
  // table and records it in the inventory, in one step under the shard lock.
  void TransitionDram(Shard& shard, Entry& entry, uint32_t slot, bool present, TransitionCause cause)
      REQUIRES(shard.mu);
  uint64_t TransitionSsd(Shard& shard, Entry& entry, const state::StateKey& key, std::optional<SsdResidence> residence,
                         TransitionCause cause) REQUIRES(shard.mu);

  // Picks and unpublishes one victim in `shard` by W-TinyLFU; false when the shard has nothing
  // evictable.
  bool EvictOneLocked(Shard& shard, uint32_t shard_index, std::vector<Evicted>* out) REQUIRES(shard.mu);
  // Evicts one block from shard `first`, or else the next shard that has one; returns its bytes, 0
  // when no shard has anything evictable.
  uint64_t EvictOne(uint32_t first);
  void FinishEvictions(std::vector<Evicted>* evicted);

  uint32_t AllocateSlot(Shard& shard) REQUIRES(shard.mu);
  void ReleaseSlot(Shard& shard, uint32_t slot) REQUIRES(shard.mu);
  // Pins `slot`; counts a first pin in *newly_pinned (the caller updates the gauge once per batch).
  BlockPin PinLocked(Shard& shard, uint32_t shard_index, uint32_t slot, int64_t* newly_pinned) REQUIRES(shard.mu);
  BlockPin PinOne(Shard& shard, uint32_t shard_index, uint32_t slot) REQUIRES(shard.mu);
  // Seal's step under the shard's lock; returns the residence generation.
  uint64_t SealLocked(Shard& shard, const BlockRef& ref, TransitionCause cause) REQUIRES(shard.mu);
  // Keeps the first `prefix` of the pins appended after `base` and releases the rest (no lock
  // held).
  void KeepPinnedPrefix(size_t base, size_t prefix, std::vector<BlockPin>* pins);
  // Drops one pin; true when it was the block's last.
  bool UnpinLocked(Shard& shard, const BlockRef& ref) REQUIRES(shard.mu);
  void UnpinMany(std::vector<BlockRef>* refs);
  void FreeBlock(Shard& shard, uint32_t slot) REQUIRES(shard.mu);
  void Unpin(const BlockRef& ref);
  void AbortWrite(const BlockRef& ref);
  void Touch(Shard& shard, uint32_t slot) REQUIRES(shard.mu);

  List& ListOf(Shard& shard, Segment segment) REQUIRES(shard.mu);
  // The least recently used block of `list`, after giving referenced blocks at the tail a second
  // chance (moving them to the front): lookups only set a bit, so the hot path never relinks lists.
  // kNone when empty.
  uint32_t SettledTail(Shard& shard, Segment segment) REQUIRES(shard.mu);
  void PushFront(Shard& shard, uint32_t slot, Segment segment) REQUIRES(shard.mu);
  void Unlink(Shard& shard, uint32_t slot) REQUIRES(shard.mu);
  void EraseEntryIfEmpty(Shard& shard, const state::StateKey& key, uint64_t hash, const Entry& entry)
      REQUIRES(shard.mu);

  // Immutable after construction.
  PinnedPool* const pool_;
  ResidencyInventory* const inventory_;
  uint64_t window_bytes_per_shard_ = 0;
  std::vector<std::unique_ptr<Shard>> shards_;
  EvictionListener eviction_listener_;

  // Residence generations are unique per publication across the table; relaxed: only uniqueness
  // matters.
  std::atomic<uint64_t> next_generation_{1};
  // Where the next cross-shard eviction search starts, so pressure spreads over shards; relaxed: a
  // hint.
  std::atomic<uint32_t> evict_cursor_{0};

  Counter* hits_ = nullptr;
  Counter* misses_ = nullptr;
  Counter* evictions_dram_ = nullptr;
  Counter* admissions_rejected_ = nullptr;
  Counter* prepare_exhausted_ = nullptr;
  Gauge* resident_bytes_dram_ = nullptr;
  Gauge* resident_bytes_ssd_ = nullptr;
  Gauge* resident_blocks_dram_ = nullptr;
  Gauge* pinned_blocks_ = nullptr;
};

}  // namespace orbitkv::core

#endif  // ORBITKV_CORE_BLOCK_TABLE_H_
