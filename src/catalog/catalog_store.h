// CatalogStore: the evidence a catalog host keeps for the logical shards placed on it, per (owner
// start, shard) slice, built only from what owners stream (catalog_messages.h). Seed 000,
// "Inventory, replication and recovery":
//  - Deltas apply in the owner's sequence order: a batch whose records were applied already is
//    deduplicated, one that does not follow the applied sequence answers GAP, one for a stream
//    without a baseline here (unknown, or a new start of this host) answers RESYNC.
//  - A snapshot is built privately (its pages and its interval applied by record version, removals
//    kept as deletion evidence so a delayed addition never resurrects an evicted residency) and
//    installed only when its interval is complete; until then readers see the old view.
//  - Equal versions with different contents are a conflict: the slice loses its baseline (RESYNC).
//  - Owners that are not live members (fenced, expired, an older start) are refused, and their
//    slices dropped when the member view drops them.
//  - An owner's start is its inventory incarnation, not its registration: a registration made again
//    without a restart (a new runtime UUID and epoch, the same incarnation) continues its slices from
//    their applied sequence, with their baselines (issue 69); a new incarnation is a new start.
//  - Every entry of the live views, of the views being built and of reservations is charged to one
//    byte budget, never exceeded: a snapshot that cannot fit answers RETRY_LATER and leaves the
//    slice incomplete; a delta that cannot fit drops that slice's derived view (incomplete).
//
// Costs (issue 70): a lookup reads a per-shard index from the key's hash to its holders' entries (never every owner
// slice of the shard); completeness is cached per shard and derived again only when that shard's slices changed
// state (a baseline installed or lost, a snapshot begun or ended, a slice added, continued or dropped) or the member
// view moved (options.live_owners_generation), so a lookup never copies the member view; DropDeadOwners does nothing
// while the member view has not moved and no owner is within its absent grace.
//
// Thread safety: every method is safe from any thread (one mutex; each call is short and bounded by
// its message).
#ifndef ORBITKV_CATALOG_CATALOG_STORE_H_
#define ORBITKV_CATALOG_CATALOG_STORE_H_

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "base/clock.h"
#include "base/mutex.h"
#include "base/thread_annotations.h"
#include "catalog/catalog_messages.h"

namespace orbitkv::catalog {

class CatalogStore {
 public:
  static constexpr uint64_t kDefaultBudgetBytes = 256ull << 20;
  // An owner's current registration as the member view has it.
  struct OwnerRegistration {
    std::string runtime;  // empty: not a member now
    int64_t epoch = 0;
    uint64_t incarnation = 0;  // its start (0: not said)
  };
  struct Options {
    uint64_t incarnation = 0;  // this host's start: owners must address it
    uint64_t budget_bytes = kDefaultBudgetBytes;
    // Whether `runtime` is the live, registered start of `node` (the member view); nullopt while that is
    // unknown (the member view is incomplete): evidence is then not admitted (RETRY_LATER) and no slice is
    // dropped. Null: everyone.
    std::function<std::optional<bool>(const std::string& node, const std::string& runtime)> owner_live;
    // `node`'s current registration; nullopt while unknown (the member view is incomplete). It replaces owner_live
    // (an owner is live when its runtime is the registration's). With it, a slice
    // follows its owner across registrations of the same start (a new runtime and a higher epoch, the same
    // incarnation: DropDeadOwners rebinds it instead of dropping it), and a stream whose start is not its
    // member's is refused. Null: owner_live decides liveness.
    std::function<std::optional<OwnerRegistration>(const std::string& node)> owner_registration;
    // With owner_registration: how long the slices of an owner that is no member at all are kept (unseen by
    // lookups, dumps and status) before they go. An owner registering again revokes its old record before it
    // writes the new one, and a catalog's view can fall between the two; within the grace its slices continue.
    std::chrono::milliseconds absent_grace{10000};
    // The number of logical shards: a record whose key belongs to another shard than its stream's is refused
    // with its whole message. 0: not checked.
    uint32_t num_shards = 0;
    // The live members, as (node, runtime UUID), each of whose owner streams must have a baseline in a shard
    // for the shard to be complete (so a restarted catalog host reads incomplete until every owner
    // re-baselined); nullopt while the member view is incomplete (every shard then reads incomplete). Null:
    // the slices known here alone decide. Called under the store's lock.
    std::function<std::optional<std::vector<std::pair<std::string, std::string>>>()> live_owners;
    // A number that moves whenever live_owners' answer may have (the member view's generation): with it, live_owners
    // is called only when it moved and completeness is cached per shard. Null: live_owners is called every time.
    std::function<uint64_t()> live_owners_generation;
    // The shards placed on this host: Status reports each of them, those without any slice too. Empty: the
    // shards that have slices.
    std::vector<uint32_t> shards;
    // Whether this host currently keeps a copy of `shard` (the placement changes online): Status reports each such
    // shard (of num_shards), and DropUnhosted drops the slices of the others. Null: `shards` decides. Called under the
    // store's lock.
    std::function<bool(uint32_t shard)> hosts;
    // Called (under the store's lock: keep it short) when a stream's evidence became visible through
    // sequence `through` (from `from` + 1): a delta applied or a snapshot installed. For lag measurements.
    std::function<void(const StreamId& stream, uint64_t from, uint64_t through)> on_visible;
  };
  // What one entry costs the budget (key, value and the map's node).
  static uint64_t EntryCharge();

  explicit CatalogStore(Options options);

  CatalogReply Apply(const DeltaBatch& batch) EXCLUDES(mu_);
  CatalogReply Begin(const SnapshotBegin& begin) EXCLUDES(mu_);
  CatalogReply Page(const SnapshotPage& page) EXCLUDES(mu_);
  CatalogReply End(const SnapshotEnd& end) EXCLUDES(mu_);
  // Whichever of the four `message` is.
  CatalogReply Handle(const CatalogMessage& message) EXCLUDES(mu_);

  // Drops the slices of owners that are no longer live; returns how many.
  size_t DropDeadOwners() EXCLUDES(mu_);
  // Drops the slices of shards this host no longer keeps a copy of (options.hosts: a retired copy after a placement
  // change); returns how many.
  size_t DropUnhosted() EXCLUDES(mu_);

  struct ShardStatus {
    uint32_t shard = 0;
    size_t owners = 0;   // slices with an installed baseline
    size_t records = 0;  // present residences over those slices
    uint64_t bytes = 0;  // charged for the shard (views, views being built, reservations)
    // Every live owner's stream (options.live_owners; without it every known slice) has a baseline here and
    // no snapshot pending: only then is a miss in this shard an answer.
    bool complete = true;
    // The largest update lag over its slices' last deltas: the owner's age of the oldest record at send time
    // plus the time until it applied here (ms).
    double lag_ms = 0;
    // Seconds since the last snapshot of any of its slices was installed (-1: none yet).
    double last_repair_s = -1;
  };
  std::vector<ShardStatus> Status() const EXCLUDES(mu_);
  // Who holds `key` (in `shard`): at most `max_holders` of the owner slices with a baseline whose view has it,
  // each as (owner node, owner runtime, its record); a slice holds one record per (key, tier), the newest its
  // owner streamed. DRAM holders come before SSD ones; within a tier the owners are taken in node order from a
  // point that `requester` (the asking node) chooses, so each requester is steered to the same holders across
  // the keys of a prefix (long spans from one source) while different requesters spread over a hot prefix's
  // holders. `complete` says whether the shard's evidence here is complete (an empty answer from an incomplete
  // shard says nothing; even a complete one only says what the owners reported).
  static constexpr size_t kMaxHoldersPerKey = 4;  // seed 000: at most 4 candidates per key
  struct Holder {
    std::string owner_node;
    std::string owner_runtime;
    CatalogRecord record;
  };
  std::vector<Holder> Lookup(uint32_t shard, const state::StateKey& key, bool* complete,
                             std::string_view requester = {}, size_t max_holders = kMaxHoldersPerKey) const
      EXCLUDES(mu_);
  // Whether `shard`'s evidence here is complete (ShardStatus::complete); Lookup with a null `complete` skips
  // this, so a caller answering many keys of one shard asks once.
  bool Complete(uint32_t shard) const EXCLUDES(mu_);
  // The owners with an installed baseline for `shard`, in order.
  std::vector<std::string> Owners(uint32_t shard) const EXCLUDES(mu_);
  // Every owner slice of `shard`, baseline or not, with the sequence applied (for CatalogStatus).
  struct OwnerSlice {
    std::string owner_node;
    std::string owner_runtime;
    bool baseline = false;
    uint64_t applied = 0;
    uint64_t owner_incarnation = 0;  // the owner's start (0: not said)
  };
  std::vector<OwnerSlice> Slices(uint32_t shard) const EXCLUDES(mu_);
  // One owner's current evidence for `shard`, in (key, tier) order.
  std::vector<CatalogRecord> Dump(uint32_t shard, const std::string& owner_node) const EXCLUDES(mu_);
  uint64_t used_bytes() const EXCLUDES(mu_);
  // Slices that followed their owner to a new registration of the same start (kept, not rebuilt), since start.
  uint64_t continuations() const EXCLUDES(mu_);
  uint64_t incarnation() const { return options_.incarnation; }

 private:
  struct EntryKey {
    state::StateKey key;
    uint8_t tier;
    friend auto operator<=>(const EntryKey&, const EntryKey&) = default;
  };
  struct Entry {
    bool present = true;
    uint64_t version = 0;
    uint64_t generation = 0;
    uint64_t bytes = 0;
  };
  using View = std::map<EntryKey, Entry>;
  struct Building {
    uint64_t id = 0;
    uint64_t start = 0;
    uint64_t reserved = 0;       // bytes reserved at Begin
    uint64_t interval_next = 0;  // the next interval sequence expected (start + 1 at Begin)
    View view;                   // with deletion evidence (present == false)
  };
  struct Slice {
    uint32_t shard = 0;
    const std::string* node = nullptr;  // its owner node: the key of its place in slices_
    std::string owner_runtime;          // the owner registration whose messages it takes now
    uint64_t owner_incarnation = 0;     // the owner's start (0: not said: the runtime is the start)
    int64_t owner_epoch = 0;            // of the owner start whose evidence this is: never moves back
    uint64_t installed_snapshot = 0;    // the id of the last snapshot installed from that start
    uint64_t applied = 0;
    bool baseline = false;
    View view;  // present entries only: the applied sequence makes older events rejectable
    std::optional<Building> building;
    std::optional<MonoTime> absent_since;  // its owner is no member (owner_registration): kept for the grace
    double lag_ms = 0;                     // of the last delta applied
    MonoTime installed_at{};               // of the last snapshot installed
  };
  using SliceKey = std::pair<uint32_t, std::string>;  // (shard, owner node)

  using LiveOwners = std::optional<std::vector<std::pair<std::string, std::string>>>;
  // The live owners, read again only when options.live_owners_generation moved.
  const LiveOwners& ReadLiveOwners() const REQUIRES(mu_);
  // Whether `shard`'s evidence is complete (see ShardStatus::complete), given ReadLiveOwners(); cached per shard.
  bool ShardComplete(uint32_t shard, const LiveOwners& live) const REQUIRES(mu_);
  bool ComputeShardComplete(uint32_t shard, const LiveOwners& live) const REQUIRES(mu_);
  // A slice of `shard` changed what completeness reads (baseline, building, runtime, existence).
  void Touch(uint32_t shard) REQUIRES(mu_);

  // The per-shard index of the live views: a key's hash to the entries that hold it, kept in the order a lookup
  // names holders in (tier, then owner node), so a lookup selects its ranks without walking them. Several keys may
  // share a hash: the chosen entries are compared with the key, and any mismatch walks the list.
  struct IndexRef {
    const View::value_type* entry;
    const Slice* slice;
    const std::string* owner_node;
  };
  static bool IndexBefore(const IndexRef& a, const IndexRef& b);
  struct KeyList {
    std::vector<IndexRef> refs;
    bool mixed = false;  // it once held two keys of one hash: lookups walk it (ranks count one key's holders only)
  };
  using KeyIndex = std::unordered_map<uint64_t, KeyList>;
  // Marks a slice's owner absent (no member: kept for the grace, no holder meanwhile) or back.
  void SetAbsent(Slice& slice, std::optional<MonoTime> since) REQUIRES(mu_);
  void IndexAdd(const Slice& slice, const View::value_type& entry) REQUIRES(mu_);
  void IndexRemove(const Slice& slice, const View::value_type& entry) REQUIRES(mu_);
  // Common checks; a reply when the message must be answered without applying it.
  std::optional<CatalogReply> Admit(const StreamId& stream) const REQUIRES(mu_);
  // A refusal when `stream` is an older owner start than the one `slice` holds evidence of (an older epoch, or
  // another runtime of the same epoch), which must never replace it.
  std::optional<CatalogReply> StaleStart(const Slice& slice, const StreamId& stream) const;
  // Whether `stream` comes from the start whose evidence `slice` holds: the same incarnation when both say one,
  // else the same runtime.
  static bool SameStart(const Slice& slice, const StreamId& stream);
  // The same start under a newer registration (StaleStart refused older ones): the slice follows it, keeping its
  // view, its applied sequence and its baseline.
  void Continue(Slice& slice, const StreamId& stream) REQUIRES(mu_);
  // A refusal when a record's key belongs to another shard than the stream's.
  std::optional<CatalogReply> ForeignKey(const StreamId& stream, const std::vector<CatalogRecord>& records) const;
  CatalogReply Reply(CatalogReply::Kind kind, uint64_t applied, std::string reason) const;
  // Applies `record` to a view with deletion evidence by version; false on an equal-version conflict.
  static bool ApplyByVersion(View& view, const CatalogRecord& record);
  uint64_t BuildingCharge(const Building& building) const;
  // Whether `records` continue the building's interval contiguously.
  static bool IntervalFollows(const Building& building, const std::vector<CatalogRecord>& records);
  // The slice whose snapshot `snapshot_id` of `stream` is being built, or null.
  Slice* FindBuilding(const StreamId& stream, uint64_t snapshot_id) REQUIRES(mu_);
  // Applies snapshot records to the slice's private view within the budget; a reply when it aborted.
  std::optional<CatalogReply> AddToBuilding(Slice& slice, const std::vector<CatalogRecord>& records) REQUIRES(mu_);
  void AbortBuilding(Slice& slice) REQUIRES(mu_);
  // Drops (and uncharges) every slice `drop` picks; returns how many.
  size_t DropSlicesWhere(const std::function<bool(const SliceKey&, const Slice&)>& drop) REQUIRES(mu_);
  void DropView(Slice& slice) REQUIRES(mu_);

  const Options options_;
  // Taken with SpinningMutexLock: a lookup or a delta holds it well under a microsecond, and an owner stream's Apply
  // that slept behind a lookup would wait for its wake-up, ten times longer.
  mutable Mutex mu_;
  std::map<SliceKey, Slice> slices_ GUARDED_BY(mu_);
  std::unordered_map<uint32_t, KeyIndex> index_ GUARDED_BY(mu_);
  std::unordered_map<uint32_t, uint64_t> shard_changes_ GUARDED_BY(mu_);  // Touch counts, per shard
  struct CompleteCache {
    uint64_t live_generation = 0;
    uint64_t changes = 0;
    bool complete = false;
  };
  mutable std::unordered_map<uint32_t, CompleteCache> complete_cache_ GUARDED_BY(mu_);
  mutable LiveOwners live_ GUARDED_BY(mu_);
  mutable uint64_t live_generation_ GUARDED_BY(mu_) = 0;
  mutable bool live_read_ GUARDED_BY(mu_) = false;
  // DropDeadOwners' last round: the member view's generation then, and whether an owner was absent (in its grace).
  std::optional<uint64_t> dropped_at_generation_ GUARDED_BY(mu_);
  bool absent_pending_ GUARDED_BY(mu_) = false;
  size_t absent_slices_ GUARDED_BY(mu_) = 0;  // slices whose absent_since is set: lookups then filter every holder
  uint64_t used_ GUARDED_BY(mu_) = 0;
  uint64_t continuations_ GUARDED_BY(mu_) = 0;
};

}  // namespace orbitkv::catalog

#endif  // ORBITKV_CATALOG_CATALOG_STORE_H_
