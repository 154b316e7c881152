// ResidencyInventory: the record of which replicas this Manager holds, kept as a bounded journal of
// changes plus an enumerable current view, per logical shard.
//
// Every residency transition of the block table (admission, replacement, eviction, restore,
// cleanup) calls Apply() in the same step that changes the table, with the table shard's lock held,
// so the journal and the table never disagree. The distributed catalog replays this: an owner
// streams each logical shard's journal to the shard's catalog hosts, and rebuilds a lost view with
// the snapshot cut of seed 000:
//   1. w0 = Watermark(shard); 2. Scan() pages with a stable key cursor; 3. w1 = Watermark(shard)
//   and ReadJournal(shard, w0, ...) through w1; the receiver applies records by record version (=
//   sequence); 4. CommitSnapshot(shard, subscriber, w1).
//
// Sequences are per (runtime incarnation, logical shard), start at 1 and have no gaps; each record
// also carries the monotonic time it was applied, so a receiver can measure its lag. The journal
// is bounded (16 MiB by default over all shards). A shard may have several subscribers (one per
// catalog host that receives it), each with its own acknowledged sequence and resync flag. When
// the journal is full its oldest record is dropped; every live subscriber that had not yet
// acknowledged it must resync (its flag is set and stays set until a CommitSnapshot), and the
// others never notice: a slow subscriber resyncs alone, and nothing ever waits for a subscriber
// (Apply never blocks on one). A reader asking for dropped history gets OutOfRange and must
// snapshot. Records hold keys and sizes, never payload references, so they never keep a block
// alive or delay an eviction. WaitForChange lets a streamer sleep until its shard moves.
//
// Thread safety: all methods are safe from any thread. Each logical shard has its own mutex, taken
// after (inside) a block-table shard lock and never the other way round; Scan() takes only the
// inventory shard mutex, never the payload (block table) locks.
#ifndef ORBITKV_CORE_INVENTORY_H_
#define ORBITKV_CORE_INVENTORY_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "base/clock.h"
#include "base/metrics.h"
#include "base/mutex.h"
#include "base/result.h"
#include "base/thread_annotations.h"
#include "state/state_key.h"

namespace orbitkv::core {

// Where a replica lives. Each tier of a key is an independent residence with its own generation.
enum class Tier : uint8_t { kDram = 1, kSsd = 2 };
const char* TierName(Tier tier);

// Why a residence appeared or disappeared.
enum class TransitionCause : uint8_t {
  kAdmit = 1,    // a published block became resident
  kReplace = 2,  // a residence was replaced by a newer generation of the same key
  kEvict = 3,    // capacity eviction
  kRestore = 4,  // filled from another tier or a peer
  kCleanup = 5,  // removed by cleanup (instance gone, explicit drop, fault)
};
const char* TransitionCauseName(TransitionCause cause);

struct ResidencyRecord {
  uint64_t sequence = 0;  // per (incarnation, shard); also the record version of the replica it describes
  state::StateKey key;
  Tier tier = Tier::kDram;
  bool present = false;  // true: residence added or replaced; false: removed
  TransitionCause cause = TransitionCause::kAdmit;
  uint64_t generation = 0;  // the residence's generation
  uint64_t bytes = 0;
  MonoTime applied_at;  // when Apply recorded it (monotonic): update lag is now - applied_at
};

// One current replica in the enumerable view.
struct InventoryRecord {
  state::StateKey key;
  Tier tier = Tier::kDram;
  uint64_t generation = 0;
  uint64_t bytes = 0;
  uint64_t version = 0;  // sequence of the record that created or last replaced it
};

// A stable position in a shard's key order; Scan resumes strictly after it.
struct InventoryCursor {
  state::StateKey key;
  Tier tier = Tier::kDram;
};

struct InventoryPage {
  std::vector<InventoryRecord> records;
  std::optional<InventoryCursor> next;  // nullopt: the scan is complete
  uint64_t watermark = 0;               // last sequence applied when the page was taken
};

struct JournalRead {
  std::vector<ResidencyRecord> records;  // in sequence order, all > after_sequence
  uint64_t watermark = 0;                // last sequence of the shard at read time
  bool resync_required = false;          // for the subscriber the read was for
};

// A receiver of one shard's journal (ResidencyInventory::Subscribe).
using InventorySubscriber = uint32_t;

class ResidencyInventory {
 public:
  static constexpr uint32_t kDefaultShards = 16;
  static constexpr uint64_t kDefaultJournalBytes = 16ull << 20;
  // What one retained record is charged against the journal budget.
  static constexpr uint64_t kRecordCharge = sizeof(ResidencyRecord);

  struct Options {
    uint64_t incarnation = 0;  // this runtime's identity; sequences restart with every incarnation
    uint32_t shards = kDefaultShards;
    uint64_t journal_bytes = kDefaultJournalBytes;  // over all shards
    // False for a Manager with no catalog to stream to (single-host): nothing ever reads the
    // journal or the view, so Apply keeps neither and only numbers the transition (sequences stay
    // per shard, contiguous and increasing), and ShardFor places keys by the in-process hash
    // instead of the SHA-256 (placement only matters to a catalog). Saves then skip the
    // bookkeeping, a third of a 16 KiB block's save time. Subscribe, ReadJournal and Scan of such
    // an inventory refuse (FailedPrecondition) or come back empty; Size and ReplicaCount are 0.
    bool record = true;
  };

  // InvalidArgument when shards is 0 or journal_bytes cannot hold one record per shard.
  static Result<std::unique_ptr<ResidencyInventory>> Create(const Options& options, MetricsRegistry* metrics);

  ResidencyInventory(const ResidencyInventory&) = delete;
  ResidencyInventory& operator=(const ResidencyInventory&) = delete;

  uint64_t incarnation() const { return incarnation_; }
  bool recording() const { return record_; }
  uint32_t shard_count() const { return static_cast<uint32_t>(shards_.size()); }
  uint32_t ShardFor(const state::StateKey& key) const;

  // Records one transition on `shard` (== ShardFor(key), passed in because callers cache it) and
  // returns its sequence. Removing a residence that the view does not hold is a programming error
  // (CHECK).
  uint64_t Apply(uint32_t shard, const state::StateKey& key, Tier tier, bool present, TransitionCause cause,
                 uint64_t generation, uint64_t bytes);

  // Records after `after_sequence`, at most `max_records`. OutOfRange when records after it were
  // already dropped (the reader must snapshot); InvalidArgument for a bad shard or a sequence
  // beyond the watermark. With a subscriber, resync_required is that subscriber's.
  Result<JournalRead> ReadJournal(uint32_t shard, uint64_t after_sequence, size_t max_records) const;
  Result<JournalRead> ReadJournal(uint32_t shard, InventorySubscriber subscriber, uint64_t after_sequence,
                                  size_t max_records) const;

  // A new receiver of `shard`. It starts with resync set: it snapshots first (and commits).
  Result<InventorySubscriber> Subscribe(uint32_t shard);
  // Forgets the subscriber (a catalog host went away): retention no longer considers it.
  void Unsubscribe(uint32_t shard, InventorySubscriber subscriber);
  // The subscriber processed everything up to `sequence`; a record it acknowledged may be dropped
  // without setting its resync flag, and records every live subscriber acknowledged are let go
  // (retention follows the slowest live subscriber, within the journal's bound).
  void Acknowledge(uint32_t shard, InventorySubscriber subscriber, uint64_t sequence);
  bool resync_required(uint32_t shard, InventorySubscriber subscriber) const;
  // Ends a snapshot cut at `end_watermark` (what the subscriber read the interval through): its
  // acknowledged sequence becomes end_watermark and its resync flag clears, atomically, only if
  // every record after end_watermark is still retained. Aborted when one was dropped after the
  // cut (the flag stays set: snapshot again); InvalidArgument for a watermark beyond the shard's,
  // NotFound for an unknown subscriber.
  Status CommitSnapshot(uint32_t shard, InventorySubscriber subscriber, uint64_t end_watermark);
  // Blocks until the shard's watermark passes `after_sequence` (true) or `deadline` (false): a
  // streamer never polls.
  bool WaitForChange(uint32_t shard, uint64_t after_sequence, Deadline deadline) const;

  // Current replicas of `shard` strictly after `after` (from the start when null), at most
  // `max_records` (>= 1), in a stable order: by a hash of (key, tier), then key, then tier (the same on
  // every host). A page costs O(max_records + one hash bucket) under the shard's mutex, from the cursor's
  // bucket on (the view is kept in kViewBuckets hash-range buckets), whatever the shard's size.
  InventoryPage Scan(uint32_t shard, const InventoryCursor* after, size_t max_records) const;

  uint64_t Watermark(uint32_t shard) const;
  // Replicas currently in the shard's view (O(1)).
  size_t Size(uint32_t shard) const;
  // Replicas currently recorded for `tier` over all shards.
  uint64_t ReplicaCount(Tier tier) const;

 private:
  // The view is hash tables (one probe per Apply: a tree of ~100,000 128-byte keys cost a quarter of a
  // Manager's save time in pointer chasing and key compares), one per range of the scan hash (its top
  // kViewBucketBits bits), and Scan orders it on demand by (ScanHash, key, tier): a total order that is the
  // same on every host, so cursors resume exactly. A page sorts only the buckets it covers, so a snapshot of N
  // records costs O(N log(N / kViewBuckets)) in all and the mutex is held one page at a time.
  static constexpr int kViewBucketBits = 10;
  static constexpr size_t kViewBuckets = size_t{1} << kViewBucketBits;
  static uint64_t ScanHash(const state::StateKey& key, Tier tier) {
    return key.Hash64() ^ (static_cast<uint64_t>(tier) * 0x9e3779b97f4a7c15ULL);
  }
  static size_t BucketOf(uint64_t scan_hash) { return static_cast<size_t>(scan_hash >> (64 - kViewBucketBits)); }
  struct ViewKey {
    state::StateKey key;
    Tier tier;
    uint64_t hash;  // ScanHash(key, tier): computed once per Apply, for the bucket and the probe
    friend bool operator==(const ViewKey& a, const ViewKey& b) { return a.tier == b.tier && a.key == b.key; }
  };
  struct ViewKeyHash {
    size_t operator()(const ViewKey& k) const { return k.hash; }
  };
  struct ViewValue {
    uint64_t generation;
    uint64_t bytes;
    uint64_t version;
  };
  struct Subscription {
    uint64_t acked_sequence = 0;
    bool resync = true;
  };
  struct Shard {
    mutable Mutex mu;
    mutable std::condition_variable_any changed;  // the watermark moved
    uint64_t last_sequence GUARDED_BY(mu) = 0;
    std::deque<ResidencyRecord> journal GUARDED_BY(mu);
    // The view, by bucket (BucketOf(hash)); one probe per Apply.
    std::vector<absl::flat_hash_map<ViewKey, ViewValue, ViewKeyHash>> view GUARDED_BY(mu) =
        std::vector<absl::flat_hash_map<ViewKey, ViewValue, ViewKeyHash>>(kViewBuckets);
    size_t view_size GUARDED_BY(mu) = 0;
    std::map<InventorySubscriber, Subscription> subscribers GUARDED_BY(mu);
    InventorySubscriber next_subscriber GUARDED_BY(mu) = 1;
    mutable uint32_t waiters GUARDED_BY(mu) = 0;  // in WaitForChange
  };
  // The view and journal side of Apply (a recording inventory only).
  void RecordLocked(uint32_t shard_index, Shard& shard, uint64_t sequence, const state::StateKey& key, Tier tier,
                    bool present, TransitionCause cause, uint64_t generation, uint64_t bytes) REQUIRES(shard.mu);
  // Drops the oldest record, flagging every subscriber that had not acknowledged it.
  void DropOldestLocked(uint32_t shard_index, Shard& shard) REQUIRES(shard.mu);

  ResidencyInventory(const Options& options, MetricsRegistry* metrics);

  // Immutable after construction.
  const uint64_t incarnation_;
  const bool record_;
  const size_t journal_records_per_shard_;
  std::vector<std::unique_ptr<Shard>> shards_;
  Counter* records_total_ = nullptr;
  Counter* resync_total_ = nullptr;
  Gauge* journal_records_ = nullptr;
};

}  // namespace orbitkv::core

#endif  // ORBITKV_CORE_INVENTORY_H_
