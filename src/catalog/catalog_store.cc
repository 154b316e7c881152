#include "catalog/catalog_store.h"

#include <algorithm>

#include "fmt/format.h"
#include "state/state_key.h"

namespace orbitkv::catalog {

std::string_view CatalogReplyName(CatalogReply::Kind kind) {
  switch (kind) {
    case CatalogReply::Kind::kAck:
      return "ack";
    case CatalogReply::Kind::kGap:
      return "gap";
    case CatalogReply::Kind::kResync:
      return "resync";
    case CatalogReply::Kind::kRetryLater:
      return "retry_later";
    case CatalogReply::Kind::kRefused:
      return "refused";
  }
  return "unknown";
}

uint64_t CatalogStore::EntryCharge() {
  // The view's map node (three pointers, color, padding), and the entry's index node (its next pointer and cached
  // hash, the allocator's header, a bucket's share).
  return sizeof(EntryKey) + sizeof(Entry) + 48 + sizeof(IndexRef) + 64;  // + the key's list: its node, spare capacity
}

bool CatalogStore::IndexBefore(const IndexRef& a, const IndexRef& b) {
  if (a.entry->first.tier != b.entry->first.tier) return a.entry->first.tier < b.entry->first.tier;
  if (*a.owner_node != *b.owner_node) return *a.owner_node < *b.owner_node;
  return std::less<const void*>{}(a.entry, b.entry);  // two keys of one hash held by one owner
}

void CatalogStore::SetAbsent(Slice& slice, std::optional<MonoTime> since) {
  if (slice.absent_since.has_value() == since.has_value()) {
    if (since.has_value()) slice.absent_since = since;
    return;
  }
  slice.absent_since = since;
  if (since.has_value()) {
    ++absent_slices_;
  } else {
    --absent_slices_;
  }
}

void CatalogStore::Touch(uint32_t shard) { ++shard_changes_[shard]; }

void CatalogStore::IndexAdd(const Slice& slice, const View::value_type& entry) {
  KeyList& list = index_[slice.shard][entry.first.key.Hash64()];
  const IndexRef ref{&entry, &slice, slice.node};
  if (!list.refs.empty() && list.refs.front().entry->first.key != entry.first.key) list.mixed = true;
  list.refs.insert(std::upper_bound(list.refs.begin(), list.refs.end(), ref, IndexBefore), ref);
}

void CatalogStore::IndexRemove(const Slice& slice, const View::value_type& entry) {
  auto shard = index_.find(slice.shard);
  if (shard == index_.end()) return;
  auto list = shard->second.find(entry.first.key.Hash64());
  if (list == shard->second.end()) return;
  std::vector<IndexRef>& refs = list->second.refs;
  const IndexRef ref{&entry, &slice, slice.node};
  auto it = std::lower_bound(refs.begin(), refs.end(), ref, IndexBefore);
  if (it != refs.end() && it->entry == &entry) refs.erase(it);
  if (refs.empty()) shard->second.erase(list);
  if (shard->second.empty()) index_.erase(shard);
}

CatalogStore::CatalogStore(Options options) : options_(std::move(options)) {}

CatalogReply CatalogStore::Reply(CatalogReply::Kind kind, uint64_t applied, std::string reason) const {
  CatalogReply reply;
  reply.kind = kind;
  reply.applied_sequence = applied;
  reply.catalog_incarnation = options_.incarnation;
  reply.reason = std::move(reason);
  return reply;
}

std::optional<CatalogReply> CatalogStore::Admit(const StreamId& stream) const {
  // One member-view lookup a message: the owner's registration says both whether the stream's runtime is live and
  // which start it is; without it, owner_live says the first.
  std::optional<bool> live = true;
  std::optional<OwnerRegistration> current;
  if (options_.owner_registration) {
    current = options_.owner_registration(stream.owner_node);
    live = current.has_value() ? std::optional<bool>(current->runtime == stream.owner_runtime) : std::nullopt;
  } else if (options_.owner_live) {
    live = options_.owner_live(stream.owner_node, stream.owner_runtime);
  }
  if (!live.has_value()) {
    return Reply(CatalogReply::Kind::kRetryLater, 0,
                 "the member view is incomplete: evidence is admitted once it is whole again");
  }
  if (!*live) {
    return Reply(CatalogReply::Kind::kRefused, 0,
                 fmt::format("owner '{}' runtime {} is not a live member (fenced, expired or an older start)",
                             stream.owner_node, stream.owner_runtime));
  }
  if (current.has_value() && stream.owner_incarnation != 0 && current->incarnation != 0 &&
      current->incarnation != stream.owner_incarnation) {
    return Reply(CatalogReply::Kind::kRefused, 0,
                 fmt::format("owner '{}' names start {:016x}, its member record {:016x}", stream.owner_node,
                             stream.owner_incarnation, current->incarnation));
  }
  if (stream.catalog_incarnation != 0 && stream.catalog_incarnation != options_.incarnation) {
    return Reply(CatalogReply::Kind::kResync, 0,
                 fmt::format("this catalog host restarted (incarnation {:016x}, the stream names {:016x}): "
                             "a new baseline is needed",
                             options_.incarnation, stream.catalog_incarnation));
  }
  return std::nullopt;
}

std::optional<CatalogReply> CatalogStore::StaleStart(const Slice& slice, const StreamId& stream) const {
  if (slice.owner_runtime.empty()) return std::nullopt;  // a new slice
  // Epochs come from the owner's registrations (each one higher); 0 is an owner that names none: then a new
  // runtime is taken as a new start.
  if (stream.owner_epoch < slice.owner_epoch || (stream.owner_epoch == slice.owner_epoch && stream.owner_epoch != 0 &&
                                                 stream.owner_runtime != slice.owner_runtime)) {
    return Reply(CatalogReply::Kind::kRefused, 0,
                 fmt::format("owner '{}' start {} (epoch {}) is older than the one this slice holds ({}, epoch {}): "
                             "a slice never moves to an older start",
                             stream.owner_node, stream.owner_runtime, stream.owner_epoch, slice.owner_runtime,
                             slice.owner_epoch));
  }
  return std::nullopt;
}

bool CatalogStore::SameStart(const Slice& slice, const StreamId& stream) {
  if (slice.owner_incarnation != 0 && stream.owner_incarnation != 0) {
    return slice.owner_incarnation == stream.owner_incarnation;
  }
  return slice.owner_runtime == stream.owner_runtime;
}

void CatalogStore::Continue(Slice& slice, const StreamId& stream) {
  if (slice.owner_runtime == stream.owner_runtime || !SameStart(slice, stream)) return;
  slice.owner_runtime = stream.owner_runtime;
  slice.owner_epoch = stream.owner_epoch;
  ++continuations_;
  Touch(slice.shard);
}

std::optional<CatalogReply> CatalogStore::ForeignKey(const StreamId& stream,
                                                     const std::vector<CatalogRecord>& records) const {
  if (options_.num_shards == 0) return std::nullopt;
  for (const CatalogRecord& r : records) {
    const uint32_t shard = state::ShardOf(r.key, options_.num_shards);
    if (shard != stream.shard) {
      return Reply(CatalogReply::Kind::kRefused, 0,
                   fmt::format("a key of shard {} on shard {}'s stream (owner '{}'): refused with its message", shard,
                               stream.shard, stream.owner_node));
    }
  }
  return std::nullopt;
}

bool CatalogStore::ApplyByVersion(View& view, const CatalogRecord& record) {
  const EntryKey key{record.key, record.tier};
  const Entry entry{record.present, record.version, record.generation, record.bytes};
  auto [it, inserted] = view.try_emplace(key, entry);
  if (inserted) return true;
  Entry& old = it->second;
  if (old.version > record.version) return true;  // older evidence: the newer one stands
  if (old.version == record.version) {
    return old.present == entry.present && old.generation == entry.generation && old.bytes == entry.bytes;
  }
  old = entry;
  return true;
}

uint64_t CatalogStore::BuildingCharge(const Building& building) const {
  return std::max<uint64_t>(building.reserved, building.view.size() * EntryCharge());
}

void CatalogStore::AbortBuilding(Slice& slice) {
  if (!slice.building) return;
  used_ -= BuildingCharge(*slice.building);
  slice.building.reset();
  Touch(slice.shard);
}

void CatalogStore::DropView(Slice& slice) {
  for (const View::value_type& entry : slice.view) IndexRemove(slice, entry);
  used_ -= slice.view.size() * EntryCharge();
  slice.view.clear();
  slice.baseline = false;
  Touch(slice.shard);
}

CatalogReply CatalogStore::Apply(const DeltaBatch& batch) {
  SpinningMutexLock lock(&mu_);
  if (auto refused = Admit(batch.stream)) return *refused;
  if (auto foreign = ForeignKey(batch.stream, batch.records)) return *foreign;
  auto it = slices_.find({batch.stream.shard, batch.stream.owner_node});
  if (it != slices_.end()) {
    if (auto stale = StaleStart(it->second, batch.stream)) return *stale;
    Continue(it->second, batch.stream);
    SetAbsent(it->second, std::nullopt);  // admitted: a live member
  }
  if (it == slices_.end() || !it->second.baseline || it->second.owner_runtime != batch.stream.owner_runtime) {
    return Reply(CatalogReply::Kind::kResync, 0, "no baseline for this stream here: send a snapshot");
  }
  Slice& slice = it->second;
  // A resend overlapping what was applied: an equal version must carry the same content (a record that differs
  // is a conflict, never resolved by arrival order).
  for (size_t i = 0; i < batch.records.size() && batch.first_sequence + i <= slice.applied; ++i) {
    const CatalogRecord& r = batch.records[i];
    auto held = slice.view.find(EntryKey{r.key, r.tier});
    if (held != slice.view.end() && held->second.version == r.version &&
        (!r.present || held->second.generation != r.generation || held->second.bytes != r.bytes)) {
      DropView(slice);
      return Reply(CatalogReply::Kind::kResync, 0,
                   fmt::format("sequence {} was applied with other contents: a new baseline is needed", r.version));
    }
  }
  for (size_t i = 0; i < batch.records.size(); ++i) {
    if (batch.records[i].version != batch.first_sequence + i) {
      DropView(slice);
      return Reply(CatalogReply::Kind::kResync, 0, "a delta batch with non-contiguous sequences");
    }
  }
  if (batch.records.empty()) {  // a heartbeat: the owner is at first_sequence - 1
    if (batch.first_sequence > slice.applied + 1) {
      return Reply(CatalogReply::Kind::kGap, slice.applied,
                   fmt::format("the owner is at {}, this slice at {}", batch.first_sequence - 1, slice.applied));
    }
    return Reply(CatalogReply::Kind::kAck, slice.applied, "");
  }
  const uint64_t last = batch.first_sequence + batch.records.size() - 1;
  if (last <= slice.applied) {
    return Reply(CatalogReply::Kind::kAck, slice.applied, "");  // a duplicate: applied already
  }
  if (batch.first_sequence > slice.applied + 1) {
    return Reply(CatalogReply::Kind::kGap, slice.applied,
                 fmt::format("expected sequence {}, got {}", slice.applied + 1, batch.first_sequence));
  }
  // Only what follows the applied sequence (an overlapping resend is deduplicated).
  for (size_t i = slice.applied + 1 - batch.first_sequence; i < batch.records.size(); ++i) {
    const CatalogRecord& r = batch.records[i];
    const EntryKey key{r.key, r.tier};
    auto entry = slice.view.find(key);
    if (!r.present) {
      if (entry == slice.view.end()) {  // removing what this view never held: the views disagree
        DropView(slice);
        return Reply(CatalogReply::Kind::kResync, 0,
                     fmt::format("sequence {} removes a residence this view does not hold", r.version));
      }
      IndexRemove(slice, *entry);
      slice.view.erase(entry);
      used_ -= EntryCharge();
    } else if (entry != slice.view.end()) {
      entry->second = Entry{true, r.version, r.generation, r.bytes};
    } else {
      if (used_ + EntryCharge() > options_.budget_bytes) {
        DropView(slice);
        return Reply(CatalogReply::Kind::kRetryLater, 0,
                     fmt::format("the catalog budget ({} bytes) is full: this slice is incomplete until a "
                                 "snapshot fits",
                                 options_.budget_bytes));
      }
      IndexAdd(slice, *slice.view.emplace(key, Entry{true, r.version, r.generation, r.bytes}).first);
      used_ += EntryCharge();
    }
    slice.applied = r.version;
  }
  if (options_.on_visible) options_.on_visible(batch.stream, batch.first_sequence - 1, slice.applied);
  slice.lag_ms = static_cast<double>(batch.oldest_age_us) / 1000;  // plus transit, not measurable across clocks
  return Reply(CatalogReply::Kind::kAck, slice.applied, "");
}

CatalogReply CatalogStore::Begin(const SnapshotBegin& begin) {
  SpinningMutexLock lock(&mu_);
  if (auto refused = Admit(begin.stream)) return *refused;
  if (auto found = slices_.find({begin.stream.shard, begin.stream.owner_node}); found != slices_.end()) {
    // An older start's Begin (reordered, or a fenced owner) neither replaces nor reserves anything.
    if (auto stale = StaleStart(found->second, begin.stream)) return *stale;
    Continue(found->second, begin.stream);
    SetAbsent(found->second, std::nullopt);  // admitted: a live member
    const Slice& current = found->second;
    if (current.owner_runtime == begin.stream.owner_runtime &&
        (begin.snapshot_id <= current.installed_snapshot ||
         (current.building && begin.snapshot_id <= current.building->id))) {
      // A replayed Begin of a snapshot installed or superseded already: answered, and nothing built or charged.
      return Reply(CatalogReply::Kind::kAck, current.applied, "a stale Begin: that snapshot is done");
    }
  }
  auto placed = slices_.try_emplace({begin.stream.shard, begin.stream.owner_node}).first;
  Slice& slice = placed->second;
  slice.shard = begin.stream.shard;
  slice.node = &placed->first.second;
  Touch(slice.shard);
  if (slice.owner_runtime != begin.stream.owner_runtime) {  // a new start of that owner: its old view is void
    AbortBuilding(slice);
    DropView(slice);
    slice.applied = 0;
    slice.installed_snapshot = 0;
    slice.owner_runtime = begin.stream.owner_runtime;
  }
  slice.owner_incarnation = begin.stream.owner_incarnation;
  slice.owner_epoch = begin.stream.owner_epoch;
  AbortBuilding(slice);
  const uint64_t reserve = begin.expected_records * EntryCharge();
  if (used_ + reserve > options_.budget_bytes && slice.baseline) {
    // The old view and the new one cannot both fit: the old one goes (the slice reads incomplete, never a frozen
    // view called complete), which may make room for the new one.
    DropView(slice);
  }
  if (used_ + reserve > options_.budget_bytes) {
    return Reply(CatalogReply::Kind::kRetryLater, slice.applied,
                 fmt::format("a snapshot of {} records does not fit the catalog budget ({} of {} bytes used): the "
                             "slice is incomplete until one fits",
                             begin.expected_records, used_, options_.budget_bytes));
  }
  Building building;
  building.id = begin.snapshot_id;
  building.start = begin.start_watermark;
  building.reserved = reserve;
  building.interval_next = begin.start_watermark + 1;
  used_ += reserve;
  slice.building = std::move(building);
  return Reply(CatalogReply::Kind::kAck, slice.applied, "");
}

bool CatalogStore::IntervalFollows(const Building& building, const std::vector<CatalogRecord>& records) {
  for (size_t i = 0; i < records.size(); ++i) {
    if (records[i].version != building.interval_next + i) return false;
  }
  return true;
}

CatalogStore::Slice* CatalogStore::FindBuilding(const StreamId& stream, uint64_t snapshot_id) {
  auto it = slices_.find({stream.shard, stream.owner_node});
  if (it == slices_.end() || !it->second.building || it->second.building->id != snapshot_id ||
      !SameStart(it->second, stream) || StaleStart(it->second, stream)) {
    return nullptr;
  }
  Continue(it->second, stream);
  return &it->second;
}

std::optional<CatalogReply> CatalogStore::AddToBuilding(Slice& slice, const std::vector<CatalogRecord>& records) {
  Building& building = *slice.building;
  const uint64_t before = BuildingCharge(building);
  const uint64_t worst = std::max<uint64_t>(building.reserved, (building.view.size() + records.size()) * EntryCharge());
  if (used_ - before + worst > options_.budget_bytes) {
    AbortBuilding(slice);
    return Reply(CatalogReply::Kind::kRetryLater, slice.applied,
                 "the snapshot outgrew its reservation and the catalog budget is full");
  }
  for (const CatalogRecord& r : records) {
    if (!ApplyByVersion(building.view, r)) {
      AbortBuilding(slice);
      return Reply(CatalogReply::Kind::kResync, slice.applied,
                   fmt::format("conflicting records of version {}: a new baseline is needed", r.version));
    }
  }
  used_ += BuildingCharge(building) - before;
  return std::nullopt;
}

CatalogReply CatalogStore::Page(const SnapshotPage& page) {
  SpinningMutexLock lock(&mu_);
  if (auto refused = Admit(page.stream)) return *refused;
  Slice* slice = FindBuilding(page.stream, page.snapshot_id);
  if (slice == nullptr) return Reply(CatalogReply::Kind::kResync, 0, "no such snapshot in progress: begin again");
  if (auto foreign = ForeignKey(page.stream, page.records)) {
    AbortBuilding(*slice);
    return *foreign;
  }
  if (page.interval && !IntervalFollows(*slice->building, page.records)) {
    AbortBuilding(*slice);
    return Reply(CatalogReply::Kind::kResync, slice->applied, "the snapshot's interval is out of order");
  }
  if (auto trouble = AddToBuilding(*slice, page.records)) return *trouble;
  if (page.interval) slice->building->interval_next += page.records.size();
  return Reply(CatalogReply::Kind::kAck, slice->applied, "");
}

CatalogReply CatalogStore::End(const SnapshotEnd& end) {
  SpinningMutexLock lock(&mu_);
  if (auto refused = Admit(end.stream)) return *refused;
  Slice* found = FindBuilding(end.stream, end.snapshot_id);
  if (found == nullptr) return Reply(CatalogReply::Kind::kResync, 0, "no such snapshot in progress: begin again");
  Slice& slice = *found;
  if (auto foreign = ForeignKey(end.stream, end.interval)) {
    AbortBuilding(slice);
    return *foreign;
  }
  Building& building = *slice.building;
  // The interval must be exactly (start, end]: anything less would install a view that misses a change.
  if (!IntervalFollows(building, end.interval)) {
    AbortBuilding(slice);
    return Reply(CatalogReply::Kind::kResync, slice.applied, "the snapshot's interval is out of order");
  }
  const uint64_t through = building.interval_next + end.interval.size() - 1;
  if (end.end_watermark < building.start || through != end.end_watermark) {
    AbortBuilding(slice);
    return Reply(CatalogReply::Kind::kResync, slice.applied,
                 fmt::format("the snapshot's interval ends at {}, not at its end watermark {} (it began after {})",
                             through, end.end_watermark, building.start));
  }
  if (auto trouble = AddToBuilding(slice, end.interval)) return *trouble;
  // Install: the deletion evidence has done its work (the applied sequence now rejects anything older).
  View installed;
  for (auto& [key, entry] : building.view) {
    if (entry.present) installed.emplace(key, entry);
  }
  used_ -= BuildingCharge(building);
  DropView(slice);
  slice.view = std::move(installed);
  for (const View::value_type& entry : slice.view) IndexAdd(slice, entry);
  used_ += slice.view.size() * EntryCharge();
  slice.applied = end.end_watermark;
  slice.baseline = true;
  slice.installed_snapshot = end.snapshot_id;
  slice.building.reset();
  Touch(slice.shard);
  slice.installed_at = MonoNow();
  if (options_.on_visible) options_.on_visible(end.stream, 0, slice.applied);
  return Reply(CatalogReply::Kind::kAck, slice.applied, "");
}

CatalogReply CatalogStore::Handle(const CatalogMessage& message) {
  return std::visit(
      [this](const auto& m) -> CatalogReply {
        using T = std::decay_t<decltype(m)>;
        if constexpr (std::is_same_v<T, DeltaBatch>) return Apply(m);
        if constexpr (std::is_same_v<T, SnapshotBegin>) return Begin(m);
        if constexpr (std::is_same_v<T, SnapshotPage>) return Page(m);
        if constexpr (std::is_same_v<T, SnapshotEnd>) return End(m);
      },
      message);
}

size_t CatalogStore::DropSlicesWhere(const std::function<bool(const SliceKey&, const Slice&)>& drop) {
  size_t dropped = 0;
  for (auto it = slices_.begin(); it != slices_.end();) {
    if (!drop(it->first, it->second)) {
      ++it;
      continue;
    }
    AbortBuilding(it->second);
    DropView(it->second);
    SetAbsent(it->second, std::nullopt);
    Touch(it->first.first);
    it = slices_.erase(it);
    ++dropped;
  }
  return dropped;
}

size_t CatalogStore::DropUnhosted() {
  if (!options_.hosts) return 0;
  SpinningMutexLock lock(&mu_);
  return DropSlicesWhere([this](const SliceKey& key, const Slice&) { return !options_.hosts(key.first); });
}

size_t CatalogStore::DropDeadOwners() {
  if (!options_.owner_live && !options_.owner_registration) return 0;
  SpinningMutexLock lock(&mu_);
  if (!options_.owner_registration) {
    // Live, or unknown (an incomplete member view drops nothing), stays.
    return DropSlicesWhere([this](const SliceKey& key, const Slice& slice) {
      return options_.owner_live(key.second, slice.owner_runtime) == std::optional<bool>(false);
    });
  }
  // A slice whose owner registered again without a restart follows it (the same start, a newer epoch), so the next
  // message continues it and lookups name the live registration. One whose owner is no member at all waits out the
  // grace (its owner may be between revoking its old record and writing the new one). Any other goes: another start,
  // or an older registration than the member's. Nothing of that changes while the member view stands still (slices
  // admitted meanwhile were checked against it) and no owner waits out its grace: then the round is skipped.
  std::optional<uint64_t> generation;
  if (options_.live_owners_generation) {
    generation = options_.live_owners_generation();
    if (dropped_at_generation_ == generation && !absent_pending_) return 0;
  }
  const MonoTime now = MonoNow();
  std::map<SliceKey, bool> dead;
  bool absent = false, unknown = false;
  for (auto& [key, slice] : slices_) {
    const std::optional<OwnerRegistration> registered = options_.owner_registration(key.second);
    if (!registered.has_value()) {  // unknown (an incomplete member view): nothing changes
      unknown = true;
      continue;
    }
    if (registered->runtime.empty()) {
      if (!slice.absent_since.has_value()) SetAbsent(slice, now);
      dead[key] = now - *slice.absent_since >= options_.absent_grace;
      absent = absent || !dead[key];
      continue;
    }
    SetAbsent(slice, std::nullopt);
    if (registered->runtime != slice.owner_runtime && slice.owner_incarnation != 0 &&
        registered->incarnation == slice.owner_incarnation && registered->epoch > slice.owner_epoch) {
      Continue(slice,
               StreamId{key.second, registered->runtime, key.first, 0, registered->epoch, registered->incarnation});
    }
    dead[key] = registered->runtime != slice.owner_runtime;
  }
  dropped_at_generation_ = unknown ? std::nullopt : generation;
  absent_pending_ = absent;
  return DropSlicesWhere([&dead](const SliceKey& key, const Slice&) {
    auto it = dead.find(key);
    return it != dead.end() && it->second;
  });
}

uint64_t CatalogStore::continuations() const {
  SpinningMutexLock lock(&mu_);
  return continuations_;
}

const CatalogStore::LiveOwners& CatalogStore::ReadLiveOwners() const {
  if (!options_.live_owners) {
    if (!live_read_) {
      live_ = std::vector<std::pair<std::string, std::string>>{};
      live_read_ = true;
    }
    return live_;
  }
  if (!options_.live_owners_generation) {
    live_ = options_.live_owners();
    return live_;
  }
  // The generation first: a view that moves between the two reads is read again next time.
  const uint64_t generation = options_.live_owners_generation();
  if (!live_read_ || generation != live_generation_) {
    live_ = options_.live_owners();
    live_generation_ = generation;
    live_read_ = true;
  }
  return live_;
}

bool CatalogStore::ShardComplete(uint32_t shard, const LiveOwners& live) const {
  if (!options_.live_owners_generation) return ComputeShardComplete(shard, live);
  auto changes = shard_changes_.find(shard);
  const uint64_t changed = changes == shard_changes_.end() ? 0 : changes->second;
  auto [cached, fresh] = complete_cache_.try_emplace(shard);
  if (fresh || cached->second.live_generation != live_generation_ || cached->second.changes != changed) {
    cached->second = CompleteCache{live_generation_, changed, ComputeShardComplete(shard, live)};
  }
  return cached->second.complete;
}

bool CatalogStore::ComputeShardComplete(uint32_t shard, const LiveOwners& live) const {
  if (!options_.live_owners) {
    for (auto it = slices_.lower_bound({shard, std::string()}); it != slices_.end() && it->first.first == shard; ++it) {
      if (!it->second.baseline || it->second.building) return false;
    }
    return true;
  }
  if (!live) return false;  // the member view is incomplete: nobody knows who must have reported
  for (const auto& [node, runtime] : *live) {
    auto it = slices_.find({shard, node});
    if (it == slices_.end() || it->second.owner_runtime != runtime || !it->second.baseline || it->second.building) {
      return false;
    }
  }
  return true;
}

std::vector<CatalogStore::ShardStatus> CatalogStore::Status() const {
  SpinningMutexLock lock(&mu_);
  std::map<uint32_t, ShardStatus> shards;
  if (options_.hosts) {
    for (uint32_t shard = 0; shard < options_.num_shards; ++shard) {
      if (options_.hosts(shard)) shards[shard].shard = shard;
    }
  } else {
    for (uint32_t shard : options_.shards) shards[shard].shard = shard;
  }
  for (const auto& [key, slice] : slices_) {
    ShardStatus& s = shards[key.first];
    s.shard = key.first;
    if (slice.baseline && !slice.absent_since.has_value()) {
      s.owners += 1;
      s.records += slice.view.size();
    }
    s.bytes += slice.view.size() * EntryCharge() + (slice.building ? BuildingCharge(*slice.building) : 0);
    s.lag_ms = std::max(s.lag_ms, slice.lag_ms);
    if (slice.installed_at != MonoTime{}) {
      const double ago = std::chrono::duration<double>(MonoNow() - slice.installed_at).count();
      s.last_repair_s = s.last_repair_s < 0 ? ago : std::min(s.last_repair_s, ago);
    }
  }
  const LiveOwners& live = ReadLiveOwners();
  std::vector<ShardStatus> out;
  for (auto& [shard, s] : shards) {
    s.complete = ShardComplete(shard, live);
    out.push_back(s);
  }
  return out;
}

std::vector<CatalogRecord> CatalogStore::Dump(uint32_t shard, const std::string& owner_node) const {
  SpinningMutexLock lock(&mu_);
  std::vector<CatalogRecord> out;
  auto it = slices_.find({shard, owner_node});
  if (it == slices_.end() || !it->second.baseline || it->second.absent_since.has_value()) return out;
  for (const auto& [key, entry] : it->second.view) {
    out.push_back(CatalogRecord{key.key, key.tier, true, entry.version, entry.generation, entry.bytes});
  }
  return out;
}

std::vector<CatalogStore::Holder> CatalogStore::Lookup(uint32_t shard, const state::StateKey& key, bool* complete,
                                                       std::string_view requester, size_t max_holders) const {
  SpinningMutexLock lock(&mu_);
  if (complete != nullptr) *complete = ShardComplete(shard, ReadLiveOwners());
  // FNV-1a of the requester's node id: the same start on every catalog host and every run (none: the first).
  size_t start = 0;
  if (!requester.empty()) {
    uint64_t h = 14695981039346656037ull;
    for (const char c : requester) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ull;
    start = static_cast<size_t>(h);
  }
  std::vector<Holder> holders;
  auto take = [&](const std::string& node, const Slice& slice, uint8_t tier, const Entry& entry) {
    holders.push_back(Holder{node, slice.owner_runtime,
                             CatalogRecord{key, tier, true, entry.version, entry.generation, entry.bytes}});
  };
  const KeyList* list = nullptr;
  if (auto index = index_.find(shard); index != index_.end()) {
    if (auto found = index->second.find(key.Hash64()); found != index->second.end()) list = &found->second;
  }
  if (list == nullptr) return holders;
  const std::vector<IndexRef>* refs = &list->refs;
  // DRAM (the lower tier number) first, then node order within a tier from the requester's point. The list is in
  // that order already: with every owner a member (no slice within its absent grace) each tier's run is its holders,
  // and the chosen ranks are read directly, whatever the number of holders. A list that never held two keys of one
  // hash holds one key, checked once; a mixed one is walked below.
  if (!list->mixed && refs->front().entry->first.key != key) return holders;  // one other key of this hash
  if (absent_slices_ == 0 && !list->mixed) {
    for (size_t first = 0; first < refs->size() && holders.size() < max_holders;) {
      const uint8_t tier = (*refs)[first].entry->first.tier;
      const auto run_end = std::upper_bound(refs->begin() + static_cast<ptrdiff_t>(first), refs->end(), tier,
                                            [](uint8_t t, const IndexRef& r) { return t < r.entry->first.tier; });
      const size_t end = static_cast<size_t>(run_end - refs->begin());
      const size_t count = end - first;
      for (size_t i = 0; i < count && holders.size() < max_holders; ++i) {
        const IndexRef& ref = (*refs)[first + (start + i) % count];
        take(*ref.owner_node, *ref.slice, tier, ref.entry->second);
      }
      first = end;
    }
    return holders;
  }
  // The walk: the key's holders filtered (members only, this key only), then the chosen ranks selected within each
  // tier (nth_element, partial_sort), not the whole list sorted.
  struct Found {
    const std::string* node;
    const Slice* slice;
    uint8_t tier;
    const Entry* entry;
  };
  std::vector<Found> found;
  for (const IndexRef& ref : *refs) {
    if (ref.entry->first.key != key) continue;                                  // another key with the same hash
    if (!ref.slice->baseline || ref.slice->absent_since.has_value()) continue;  // no member is no holder
    found.push_back(Found{ref.owner_node, ref.slice, ref.entry->first.tier, &ref.entry->second});
  }
  const auto by_node = [](const Found& a, const Found& b) { return *a.node < *b.node; };
  for (auto first = found.begin(); first != found.end() && holders.size() < max_holders;) {
    uint8_t tier = first->tier;
    for (auto it = first; it != found.end(); ++it) tier = std::min(tier, it->tier);
    const auto end = std::partition(first, found.end(), [tier](const Found& f) { return f.tier == tier; });
    const size_t count = static_cast<size_t>(end - first);
    const size_t need = std::min(max_holders - holders.size(), count);
    // Ranks start % count, ... (need of them, wrapping to 0) in node order.
    const size_t at = start % count;
    const size_t head = std::min(need, count - at);  // ranks at .. at + head - 1
    const size_t wrap = need - head;                 // then ranks 0 .. wrap - 1
    const auto at_it = first + static_cast<ptrdiff_t>(at);
    std::nth_element(first, at_it, end, by_node);  // [first, at_it) holds the `at` smallest
    std::partial_sort(at_it, at_it + static_cast<ptrdiff_t>(head), end, by_node);
    for (size_t i = 0; i < head; ++i) {
      const Found& f = *(at_it + static_cast<ptrdiff_t>(i));
      take(*f.node, *f.slice, f.tier, *f.entry);
    }
    std::partial_sort(first, first + static_cast<ptrdiff_t>(wrap), at_it, by_node);
    for (size_t i = 0; i < wrap; ++i) {
      const Found& f = *(first + static_cast<ptrdiff_t>(i));
      take(*f.node, *f.slice, f.tier, *f.entry);
    }
    first = end;
  }
  return holders;
}

bool CatalogStore::Complete(uint32_t shard) const {
  SpinningMutexLock lock(&mu_);
  return ShardComplete(shard, ReadLiveOwners());
}

std::vector<std::string> CatalogStore::Owners(uint32_t shard) const {
  SpinningMutexLock lock(&mu_);
  std::vector<std::string> owners;
  for (const auto& [key, slice] : slices_) {
    if (key.first == shard && slice.baseline && !slice.absent_since.has_value()) owners.push_back(key.second);
  }
  return owners;
}

std::vector<CatalogStore::OwnerSlice> CatalogStore::Slices(uint32_t shard) const {
  SpinningMutexLock lock(&mu_);
  std::vector<OwnerSlice> out;
  for (const auto& [key, slice] : slices_) {
    if (key.first == shard) {
      out.push_back({key.second, slice.owner_runtime, slice.baseline, slice.applied, slice.owner_incarnation});
    }
  }
  return out;
}

uint64_t CatalogStore::used_bytes() const {
  SpinningMutexLock lock(&mu_);
  return used_;
}

}  // namespace orbitkv::catalog
