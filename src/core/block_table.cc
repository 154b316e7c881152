#include "core/block_table.h"

#include <algorithm>
#include <utility>

#include "base/check.h"
#include "base/logging.h"

namespace orbitkv::core {

using state::StateKey;

// ---- BlockPin / BlockWriter ----

BlockPin::BlockPin(BlockPin&& other) noexcept
    : table_(std::exchange(other.table_, nullptr)),
      ref_(other.ref_),
      data_(other.data_),
      bytes_(other.bytes_),
      generation_(other.generation_),
      sequence_(other.sequence_),
      arena_(other.arena_) {}

BlockPin& BlockPin::operator=(BlockPin&& other) noexcept {
  if (this != &other) {
    Reset();
    table_ = std::exchange(other.table_, nullptr);
    ref_ = other.ref_;
    data_ = other.data_;
    bytes_ = other.bytes_;
    generation_ = other.generation_;
    sequence_ = other.sequence_;
    arena_ = other.arena_;
  }
  return *this;
}

void BlockPin::Reset() {
  if (table_ != nullptr) std::exchange(table_, nullptr)->Unpin(ref_);
}

uint64_t BlockPin::arena_offset() const {
  // Computed on demand: pins are taken by the hundred per query, transfers ask for this rarely.
  return table_ == nullptr ? 0 : static_cast<uint64_t>(data_ - table_->pool_->arena(arena_).data());
}

BlockPin BlockPin::Clone() const {
  if (table_ == nullptr) return BlockPin();
  return table_->PinAgain(ref_);
}

BlockWriter::BlockWriter(BlockWriter&& other) noexcept
    : table_(std::exchange(other.table_, nullptr)), ref_(other.ref_), data_(other.data_), bytes_(other.bytes_) {}

BlockWriter& BlockWriter::operator=(BlockWriter&& other) noexcept {
  if (this != &other) {
    Abort();
    table_ = std::exchange(other.table_, nullptr);
    ref_ = other.ref_;
    data_ = other.data_;
    bytes_ = other.bytes_;
  }
  return *this;
}

void BlockWriter::Abort() {
  if (table_ != nullptr) std::exchange(table_, nullptr)->AbortWrite(ref_);
}

// ---- BlockTable ----

BlockTable::BlockTable(const Options& options, PinnedPool* pool, ResidencyInventory* inventory,
                       MetricsRegistry* metrics)
    : pool_(pool), inventory_(inventory) {
  ORBITKV_CHECK(pool != nullptr && inventory != nullptr && metrics != nullptr);
  ORBITKV_CHECK(options.shards >= 1);
  const uint64_t capacity = pool->Stats().capacity_bytes;
  window_bytes_per_shard_ =
      static_cast<uint64_t>(static_cast<double>(capacity) * std::clamp(options.window_fraction, 0.0, 1.0)) /
      options.shards;
  const uint64_t per_shard_entries = std::max<uint64_t>(options.expected_blocks / options.shards, 64);
  shards_.reserve(options.shards);
  for (uint32_t i = 0; i < options.shards; ++i) shards_.push_back(std::make_unique<Shard>(per_shard_entries));

  hits_ = &metrics->GetCounter("orbitkv_cache_hits_total", "Blocks found resident in DRAM by lookups");
  misses_ =
      &metrics->GetCounter("orbitkv_cache_misses_total", "Blocks asked for by lookups beyond the resident DRAM prefix");
  evictions_dram_ =
      &metrics->GetCounter("orbitkv_cache_evictions_total", "Residences evicted for capacity", {{"tier", "dram"}});
  admissions_rejected_ = &metrics->GetCounter("orbitkv_cache_admissions_rejected_total",
                                              "Window blocks that lost the W-TinyLFU frequency duel and were evicted "
                                              "instead of a main-segment block");
  prepare_exhausted_ =
      &metrics->GetCounter("orbitkv_cache_prepare_exhausted_total",
                           "Publishes refused because every DRAM block was pinned or being written (backpressure)");
  resident_bytes_dram_ =
      &metrics->GetGauge("orbitkv_cache_resident_bytes", "Bytes of published residences", {{"tier", "dram"}});
  resident_bytes_ssd_ =
      &metrics->GetGauge("orbitkv_cache_resident_bytes", "Bytes of published residences", {{"tier", "ssd"}});
  resident_blocks_dram_ =
      &metrics->GetGauge("orbitkv_cache_resident_blocks", "Published residences", {{"tier", "dram"}});
  pinned_blocks_ = &metrics->GetGauge("orbitkv_cache_pinned_blocks",
                                      "DRAM blocks held by leases, copies, write-backs or peer reads");
}

BlockTable::~BlockTable() {
  for (auto& shard_ptr : shards_) {
    Shard& shard = *shard_ptr;
    MutexLock lock(&shard.mu);
    for (size_t slot = 0; slot < shard.slots.size(); ++slot) {
      Block& block = shard.slots[slot];
      ORBITKV_CHECK_MSG(block.pins == 0 && block.state != BlockState::kPreparing,
                        "BlockTable destroyed while a block is pinned or being written");
      if (block.state == BlockState::kSealed) {
        resident_bytes_dram_->Add(-static_cast<double>(block.memory.requested_bytes));
        resident_blocks_dram_->Add(-1);
        pool_->Free(block.memory);
      }
    }
    resident_bytes_ssd_->Add(-static_cast<double>(shard.ssd_bytes));
  }
}

uint32_t BlockTable::AllocateSlot(Shard& shard) {
  if (!shard.free_slots.empty()) {
    uint32_t slot = shard.free_slots.back();
    shard.free_slots.pop_back();
    return slot;
  }
  ORBITKV_CHECK(shard.slots.size() < kNone);
  shard.slots.emplace_back();
  return static_cast<uint32_t>(shard.slots.size() - 1);
}

void BlockTable::ReleaseSlot(Shard& shard, uint32_t slot) {
  Block& block = shard.slots[slot];
  block.memory = PoolBlock{};
  block.key = nullptr;
  block.entry = nullptr;
  block.state = BlockState::kFree;
  block.segment = Segment::kNone;
  block.residence_generation = 0;
  block.under_pressure = false;
  block.referenced = false;
  // Generation 0 never names a live slot, so skip it on wrap-around.
  if (++block.slot_generation == 0) block.slot_generation = 1;
  shard.free_slots.push_back(slot);
}

void BlockTable::FreeBlock(Shard& shard, uint32_t slot) {
  Block& block = shard.slots[slot];
  ORBITKV_CHECK(block.pins == 0 && block.state == BlockState::kUnpublished);
  pool_->Free(block.memory);
  --shard.unpublished_blocks;
  ReleaseSlot(shard, slot);
}

BlockTable::List& BlockTable::ListOf(Shard& shard, Segment segment) {
  ORBITKV_CHECK(segment != Segment::kNone);
  return segment == Segment::kWindow ? shard.window : shard.main;
}

void BlockTable::PushFront(Shard& shard, uint32_t slot, Segment segment) {
  Block& block = shard.slots[slot];
  ORBITKV_CHECK(!block.on_list);
  List& list = ListOf(shard, segment);
  block.segment = segment;
  block.on_list = true;
  block.referenced = false;
  block.prev = kNone;
  block.next = list.head;
  if (list.head != kNone) shard.slots[list.head].prev = slot;
  list.head = slot;
  if (list.tail == kNone) list.tail = slot;
  list.bytes += block.memory.class_bytes;
  ++list.count;
}

void BlockTable::Unlink(Shard& shard, uint32_t slot) {
  Block& block = shard.slots[slot];
  if (!block.on_list) return;
  List& list = ListOf(shard, block.segment);
  if (block.prev != kNone)
    shard.slots[block.prev].next = block.next;
  else
    list.head = block.next;
  if (block.next != kNone)
    shard.slots[block.next].prev = block.prev;
  else
    list.tail = block.prev;
  block.prev = block.next = kNone;
  block.on_list = false;
  list.bytes -= block.memory.class_bytes;
  --list.count;
}

void BlockTable::Touch(Shard& shard, uint32_t slot) {
  // A bit, not a relink: SettledTail gives referenced blocks their second chance at eviction time.
  shard.slots[slot].referenced = true;
}

uint32_t BlockTable::SettledTail(Shard& shard, Segment segment) {
  List& list = ListOf(shard, segment);
  // Referenced blocks get a second chance and pinned blocks are skipped: both move to the front (a
  // referenced one losing its bit). Two passes at most (the first may only clear bits), so a list
  // of only pinned blocks yields kNone.
  for (uint64_t steps = 0; list.tail != kNone && steps < 2 * list.count; ++steps) {
    Block& block = shard.slots[list.tail];
    if (!block.referenced && block.pins == 0) return list.tail;
    block.referenced = false;
    const uint32_t slot = list.tail;
    Unlink(shard, slot);
    PushFront(shard, slot, segment);
  }
  return kNone;
}

void BlockTable::EraseEntryIfEmpty(Shard& shard, const StateKey& key, uint64_t hash, const Entry& entry) {
  if (entry.dram != kNone || entry.preparing != kNone || entry.ssd.has_value()) return;
  auto it = shard.entries.find(HashedKey{&key, hash});
  ORBITKV_CHECK(it != shard.entries.end() && &it->second == &entry);
  shard.entries.erase(it);
}

void BlockTable::TransitionDram(Shard& shard, Entry& entry, uint32_t slot, bool present, TransitionCause cause) {
  Block& block = shard.slots[slot];
  const uint64_t bytes = block.memory.requested_bytes;
  if (present) {
    ORBITKV_CHECK(entry.dram == kNone && block.state == BlockState::kPreparing);
    block.state = BlockState::kSealed;
    entry.dram = slot;
    ++shard.resident_blocks;
    shard.resident_bytes += bytes;
    resident_bytes_dram_->Add(static_cast<double>(bytes));
    resident_blocks_dram_->Add(1);
  } else {
    ORBITKV_CHECK(entry.dram == slot && block.state == BlockState::kSealed);
    Unlink(shard, slot);
    block.state = BlockState::kUnpublished;
    block.entry = nullptr;
    ++shard.unpublished_blocks;
    entry.dram = kNone;
    --shard.resident_blocks;
    shard.resident_bytes -= bytes;
    resident_bytes_dram_->Add(-static_cast<double>(bytes));
    resident_blocks_dram_->Add(-1);
  }
  const uint64_t sequence = inventory_->Apply(block.inventory_shard, *block.key, Tier::kDram, present, cause,
                                              block.residence_generation, bytes);
  if (present) block.residence_sequence = sequence;
}

uint64_t BlockTable::TransitionSsd(Shard& shard, Entry& entry, const StateKey& key,
                                   std::optional<SsdResidence> residence, TransitionCause cause) {
  const uint64_t old_bytes = entry.ssd.has_value() ? entry.ssd->bytes : 0;
  if (residence.has_value()) {
    if (!entry.ssd.has_value()) ++shard.ssd_residences;
    shard.ssd_bytes += residence->bytes - old_bytes;
    resident_bytes_ssd_->Add(static_cast<double>(residence->bytes) - static_cast<double>(old_bytes));
    entry.ssd = residence;
    inventory_->Apply(entry.inventory_shard, key, Tier::kSsd, true, cause, residence->generation, residence->bytes);
    return residence->generation;
  }
  ORBITKV_CHECK(entry.ssd.has_value());
  const uint64_t generation = entry.ssd->generation;
  --shard.ssd_residences;
  shard.ssd_bytes -= old_bytes;
  resident_bytes_ssd_->Add(-static_cast<double>(old_bytes));
  entry.ssd.reset();
  inventory_->Apply(entry.inventory_shard, key, Tier::kSsd, false, cause, generation, old_bytes);
  return generation;
}

BlockPin BlockTable::PinLocked(Shard& shard, uint32_t shard_index, uint32_t slot, int64_t* newly_pinned) {
  Block& block = shard.slots[slot];
  // A pinned block stays on its list (no relinking on the hot path); SettledTail skips it at
  // eviction time.
  if (block.pins == 0) {
    ++shard.pinned_blocks;
    ++*newly_pinned;
  }
  ++block.pins;
  return BlockPin(this, BlockRef{shard_index, slot, block.slot_generation}, block.memory.data,
                  block.memory.requested_bytes, block.residence_generation, block.residence_sequence,
                  block.memory.arena);
}

BlockPin BlockTable::PinOne(Shard& shard, uint32_t shard_index, uint32_t slot) {
  int64_t newly_pinned = 0;
  BlockPin pin = PinLocked(shard, shard_index, slot, &newly_pinned);
  if (newly_pinned != 0) pinned_blocks_->Add(static_cast<double>(newly_pinned));
  return pin;
}

bool BlockTable::UnpinLocked(Shard& shard, const BlockRef& ref) {
  Block& block = shard.slots[ref.index];
  ORBITKV_CHECK_MSG(block.slot_generation == ref.generation && block.pins > 0,
                    "unpin of block slot {} generation {} that holds no pin", ref.index, ref.generation);
  if (--block.pins > 0) return false;
  --shard.pinned_blocks;
  if (block.state == BlockState::kSealed) {
    block.referenced = true;  // the use just finished counts as a recent access
  } else {
    FreeBlock(shard, ref.index);
  }
  return true;
}

void BlockTable::Unpin(const BlockRef& ref) {
  Shard& shard = *shards_[ref.shard];
  bool unpinned;
  {
    MutexLock lock(&shard.mu);
    unpinned = UnpinLocked(shard, ref);
  }
  if (unpinned) pinned_blocks_->Add(-1);
}

void BlockTable::UnpinMany(std::vector<BlockRef>* refs) {
  // One lock per shard for the whole batch.
  std::sort(refs->begin(), refs->end(), [](const BlockRef& a, const BlockRef& b) { return a.shard < b.shard; });
  int64_t unpinned = 0;
  for (size_t start = 0; start < refs->size();) {
    Shard& shard = *shards_[(*refs)[start].shard];
    size_t end = start;
    MutexLock lock(&shard.mu);
    for (; end < refs->size() && (*refs)[end].shard == (*refs)[start].shard; ++end) {
      unpinned += UnpinLocked(shard, (*refs)[end]) ? 1 : 0;
    }
    start = end;
  }
  if (unpinned != 0) pinned_blocks_->Add(-static_cast<double>(unpinned));
}

void BlockPin::ReleaseAll(std::vector<BlockPin>* pins) {
  std::vector<BlockRef> refs;
  BlockTable* table = nullptr;
  for (BlockPin& pin : *pins) {
    if (pin.table_ == nullptr) continue;
    if (table != nullptr && pin.table_ != table) {
      pin.Reset();  // pins of another table (never in practice): one at a time
      continue;
    }
    table = pin.table_;
    refs.push_back(pin.ref_);
    pin.table_ = nullptr;
  }
  if (table != nullptr) table->UnpinMany(&refs);
  pins->clear();
}

Result<BlockWriter> BlockTable::Prepare(const StateKey& key, uint64_t bytes) {
  if (bytes == 0) return Status::InvalidArgument("cannot prepare an empty block");
  const uint64_t hash = key.Hash64();
  const uint32_t shard_index = ShardIndex(hash);
  Shard& shard = *shards_[shard_index];
  // SHA-256 placement is computed outside the lock; it is only needed for a new entry.
  const uint32_t inventory_shard = inventory_->ShardFor(key);
  uint32_t slot = kNone;
  uint32_t slot_generation = 0;
  {
    MutexLock lock(&shard.mu);
    shard.sketch.Increment(hash);
    auto [it, inserted] = shard.entries.try_emplace(key);
    Entry& entry = it->second;
    if (inserted) entry.inventory_shard = inventory_shard;
    if (entry.dram != kNone) return Status::AlreadyExists("block is already resident in DRAM");
    if (entry.preparing != kNone) return Status::Aborted("block is being written by another publisher");
    slot = AllocateSlot(shard);
    Block& block = shard.slots[slot];
    block.key = &it->first;
    block.hash = hash;
    block.inventory_shard = inventory_shard;
    block.entry = &entry;
    block.state = BlockState::kPreparing;
    slot_generation = block.slot_generation;
    entry.preparing = slot;
    ++shard.preparing_blocks;
  }

  // Allocation and eviction run without this shard's lock: eviction takes shard locks itself.
  // The key's own shard evicts first, so its admission window drains as fast as it fills.
  Result<PoolBlock> memory = pool_->Allocate(bytes);
  bool under_pressure = false;
  while (!memory.ok() && memory.status().code() == StatusCode::kResourceExhausted) {
    under_pressure = true;
    if (EvictOne(shard_index) == 0) break;
    memory = pool_->Allocate(bytes);
  }

  MutexLock lock(&shard.mu);
  Block& block = shard.slots[slot];
  if (!memory.ok()) {
    Entry& entry = *block.entry;
    entry.preparing = kNone;
    --shard.preparing_blocks;
    ReleaseSlot(shard, slot);
    EraseEntryIfEmpty(shard, key, hash, entry);
    if (memory.status().code() != StatusCode::kResourceExhausted) return memory.status();
    prepare_exhausted_->Increment();
    return Status::ResourceExhausted(
        fmt::format("DRAM pool cannot fit a {}-byte block: every block is pinned by a lease or copy, or being "
                    "written; retry after leases are released",
                    bytes));
  }
  block.memory = *memory;
  block.under_pressure = under_pressure;
  return BlockWriter(this, BlockRef{shard_index, slot, slot_generation}, block.memory.data, bytes);
}

uint64_t BlockTable::Seal(BlockWriter& writer, TransitionCause cause, BlockPin* pin) {
  ORBITKV_CHECK_MSG(writer.table_ == this, "Seal of a writer that is not live for this table");
  // Assigning over a live pin would unpin under the shard lock taken below.
  ORBITKV_CHECK(pin == nullptr || !pin->valid());
  const BlockRef ref = writer.ref_;
  writer.table_ = nullptr;
  Shard& shard = *shards_[ref.shard];
  MutexLock lock(&shard.mu);
  const uint64_t generation = SealLocked(shard, ref, cause);
  if (pin != nullptr) *pin = PinOne(shard, ref.shard, ref.index);
  return generation;
}

void BlockTable::SealAll(std::span<BlockWriter> writers, TransitionCause cause) {
  // One lock per shard for the whole batch, not one per block: a save of hundreds of blocks
  // otherwise contends with the Prepares of the next save block by block.
  std::vector<uint32_t> order(writers.size());
  for (size_t i = 0; i < writers.size(); ++i) {
    ORBITKV_CHECK_MSG(writers[i].table_ == this, "Seal of a writer that is not live for this table");
    order[i] = static_cast<uint32_t>(i);
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](uint32_t a, uint32_t b) { return writers[a].ref_.shard < writers[b].ref_.shard; });
  for (size_t i = 0; i < order.size();) {
    const uint32_t shard_index = writers[order[i]].ref_.shard;
    Shard& shard = *shards_[shard_index];
    MutexLock lock(&shard.mu);
    for (; i < order.size() && writers[order[i]].ref_.shard == shard_index; ++i) {
      BlockWriter& writer = writers[order[i]];
      const BlockRef ref = writer.ref_;
      writer.table_ = nullptr;
      SealLocked(shard, ref, cause);
    }
  }
}

uint64_t BlockTable::SealLocked(Shard& shard, const BlockRef& ref, TransitionCause cause) {
  Block& block = shard.slots[ref.index];
  ORBITKV_CHECK(block.slot_generation == ref.generation && block.state == BlockState::kPreparing);
  Entry& entry = *block.entry;
  ORBITKV_CHECK(entry.preparing == ref.index);
  entry.preparing = kNone;
  --shard.preparing_blocks;
  block.residence_generation = next_generation_.fetch_add(1, std::memory_order_relaxed);
  TransitionDram(shard, entry, ref.index, /*present=*/true, cause);
  PushFront(shard, ref.index, Segment::kWindow);
  if (!block.under_pressure) {
    // The pool had room, so the main segment does too: blocks leaving the window need no duel.
    while (shard.window.bytes > window_bytes_per_shard_ && shard.window.tail != ref.index) {
      const uint32_t oldest = shard.window.tail;
      Unlink(shard, oldest);
      PushFront(shard, oldest, Segment::kMain);
    }
  }
  return block.residence_generation;
}

void BlockTable::AbortWrite(const BlockRef& ref) {
  Shard& shard = *shards_[ref.shard];
  MutexLock lock(&shard.mu);
  Block& block = shard.slots[ref.index];
  ORBITKV_CHECK(block.slot_generation == ref.generation && block.state == BlockState::kPreparing);
  const StateKey key = *block.key;
  const uint64_t hash = block.hash;
  Entry& entry = *block.entry;
  ORBITKV_CHECK(entry.preparing == ref.index);
  entry.preparing = kNone;
  --shard.preparing_blocks;
  pool_->Free(block.memory);
  ReleaseSlot(shard, ref.index);
  EraseEntryIfEmpty(shard, key, hash, entry);
}

bool BlockTable::EvictOneLocked(Shard& shard, uint32_t shard_index, std::vector<Evicted>* out) {
  uint32_t target = kNone;
  const uint32_t candidate = SettledTail(shard, Segment::kWindow);
  const uint32_t victim = SettledTail(shard, Segment::kMain);
  if (candidate != kNone && victim != kNone) {
    // Admission duel: the window's oldest block enters the main segment only if it is accessed more
    // often than the main segment's least recently used block; ties keep the incumbent.
    if (shard.sketch.AdmitCandidate(shard.slots[candidate].hash, shard.slots[victim].hash)) {
      Unlink(shard, candidate);
      PushFront(shard, candidate, Segment::kMain);
      target = victim;
    } else {
      target = candidate;
      admissions_rejected_->Increment();
    }
  } else if (victim != kNone) {
    target = victim;
  } else if (candidate != kNone) {
    target = candidate;
  } else {
    return false;
  }
  Block& block = shard.slots[target];
  const StateKey key = *block.key;
  const uint64_t hash = block.hash;
  Entry& entry = *block.entry;
  TransitionDram(shard, entry, target, /*present=*/false, TransitionCause::kEvict);
  evictions_dram_->Increment();
  // The table's reference becomes the pin handed to the listener; the block is freed when it drops.
  out->push_back(Evicted{key, PinOne(shard, shard_index, target)});
  EraseEntryIfEmpty(shard, key, hash, entry);
  return true;
}

void BlockTable::FinishEvictions(std::vector<Evicted>* evicted) {
  for (Evicted& e : *evicted) {
    if (eviction_listener_) eviction_listener_(e.key, std::move(e.pin));
    e.pin.Reset();
  }
  evicted->clear();
}

uint64_t BlockTable::EvictOne(uint32_t first) {
  const uint32_t n = shard_count();
  std::vector<Evicted> evicted;
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t shard_index = (first + i) % n;
    Shard& shard = *shards_[shard_index];
    MutexLock lock(&shard.mu);
    if (EvictOneLocked(shard, shard_index, &evicted)) break;
  }
  if (evicted.empty()) return 0;
  const uint64_t bytes = evicted.front().pin.bytes();
  FinishEvictions(&evicted);
  return bytes;
}

uint64_t BlockTable::EvictBytes(uint64_t bytes) {
  uint64_t evicted = 0;
  while (evicted < bytes) {
    const uint64_t one = EvictOne(evict_cursor_.fetch_add(1, std::memory_order_relaxed) % shard_count());
    if (one == 0) break;
    evicted += one;
  }
  return evicted;
}

template <typename Visit>
size_t BlockTable::ScanPrefix(std::span<const StateKey> keys, Visit&& visit) {
  // Each shard is locked once per call rather than once per key: keys are bucketed by shard (a
  // counting sort that keeps their order), each bucket is visited under one lock, and the prefix
  // ends at the first key the visitor rejects. Keys past a rejection already found are skipped.
  // Every visited key counts as an access.
  const size_t n = keys.size();
  if (n == 0) return 0;
  {
    // A cold prefix usually misses on its first key: answer that without hashing the rest.
    const uint64_t hash = keys[0].Hash64();
    const uint32_t shard_index = ShardIndex(hash);
    Shard& shard = *shards_[shard_index];
    MutexLock lock(&shard.mu);
    auto it = shard.entries.find(HashedKey{&keys[0], hash});
    if (it == shard.entries.end()) {
      shard.sketch.Increment(hash);
      (void)visit(shard, shard_index, 0, nullptr);
      return 0;
    }
  }
  const size_t shard_count = shards_.size();
  std::vector<uint64_t> hashes(n);
  std::vector<uint32_t> shard_of(n);
  std::vector<uint32_t> bucket_start(shard_count + 1, 0);
  for (size_t i = 0; i < n; ++i) {
    hashes[i] = keys[i].Hash64();
    shard_of[i] = ShardIndex(hashes[i]);
    ++bucket_start[shard_of[i] + 1];
  }
  for (size_t s = 0; s < shard_count; ++s) bucket_start[s + 1] += bucket_start[s];
  std::vector<uint32_t> order(n);
  {
    std::vector<uint32_t> fill(bucket_start.begin(), bucket_start.end() - 1);
    for (size_t i = 0; i < n; ++i) order[fill[shard_of[i]]++] = static_cast<uint32_t>(i);
  }
  size_t first_miss = n;
  for (uint32_t shard_index = 0; shard_index < shard_count; ++shard_index) {
    const uint32_t begin = bucket_start[shard_index];
    const uint32_t end = bucket_start[shard_index + 1];
    if (begin == end || order[begin] >= first_miss) continue;
    Shard& shard = *shards_[shard_index];
    MutexLock lock(&shard.mu);
    for (uint32_t k = begin; k < end && order[k] < first_miss; ++k) {
      const size_t i = order[k];
      shard.sketch.Increment(hashes[i]);
      auto it = shard.entries.find(HashedKey{&keys[i], hashes[i]});
      if (!visit(shard, shard_index, i, it == shard.entries.end() ? nullptr : &it->second)) {
        first_miss = i;
        break;
      }
    }
  }
  return first_miss;
}

size_t BlockTable::LookupPrefix(std::span<const StateKey> keys) {
  // The visitors run under the shard lock ScanPrefix holds; the analysis cannot follow that into a
  // lambda.
  const size_t hit = ScanPrefix(keys, [this](Shard& shard, uint32_t, size_t, Entry* entry) NO_THREAD_SAFETY_ANALYSIS {
    if (entry == nullptr || entry->dram == kNone) return false;
    Touch(shard, entry->dram);
    return true;
  });
  hits_->Increment(hit);
  misses_->Increment(keys.size() - hit);
  return hit;
}

size_t BlockTable::LookupPrefixTiers(std::span<const StateKey> keys, std::vector<Residence>* tiers) {
  std::vector<Residence> found(keys.size(), Residence::kMiss);
  const size_t prefix =
      ScanPrefix(keys, [this, &found](Shard& shard, uint32_t, size_t i, Entry* entry) NO_THREAD_SAFETY_ANALYSIS {
        if (entry == nullptr) return false;
        if (entry->dram != kNone) {
          Touch(shard, entry->dram);
          found[i] = Residence::kDram;
          return true;
        }
        if (!entry->ssd.has_value()) return false;
        found[i] = Residence::kSsd;
        return true;
      });
  size_t dram_hits = 0;
  for (size_t i = 0; i < prefix; ++i) {
    tiers->push_back(found[i]);
    dram_hits += found[i] == Residence::kDram ? 1 : 0;
  }
  hits_->Increment(dram_hits);
  misses_->Increment(keys.size() - dram_hits);
  return prefix;
}

void BlockTable::KeepPinnedPrefix(size_t base, size_t prefix, std::vector<BlockPin>* pins) {
  if (base + prefix == pins->size()) return;
  // Pins found past the end of the prefix are released now, outside every lock.
  std::vector<BlockPin> beyond;
  for (size_t i = base + prefix; i < pins->size(); ++i) {
    if ((*pins)[i].valid()) beyond.push_back(std::move((*pins)[i]));
  }
  pins->resize(base + prefix);
  BlockPin::ReleaseAll(&beyond);
}

size_t BlockTable::PinPrefix(std::span<const StateKey> keys, std::vector<BlockPin>* pins) {
  const size_t base = pins->size();
  pins->resize(base + keys.size());
  int64_t newly_pinned = 0;
  const size_t prefix = ScanPrefix(keys, [this, pins, base, &newly_pinned](Shard& shard, uint32_t shard_index, size_t i,
                                                                           Entry* entry) NO_THREAD_SAFETY_ANALYSIS {
    if (entry == nullptr || entry->dram == kNone) return false;
    (*pins)[base + i] = PinLocked(shard, shard_index, entry->dram, &newly_pinned);
    return true;
  });
  if (newly_pinned != 0) pinned_blocks_->Add(static_cast<double>(newly_pinned));
  KeepPinnedPrefix(base, prefix, pins);
  hits_->Increment(prefix);
  misses_->Increment(keys.size() - prefix);
  return prefix;
}

ExactPins BlockTable::PinExact(std::span<const StateKey> keys, std::span<const uint64_t> generations,
                               std::span<const uint64_t> sequences, std::vector<BlockPin>* pins) {
  ORBITKV_CHECK(keys.size() == generations.size() && keys.size() == sequences.size());
  const size_t base = pins->size();
  pins->resize(base + keys.size());
  int64_t newly_pinned = 0;
  // Why each key was refused; the prefix ends at the first refusal, whose reason is the answer.
  std::vector<ExactStop> refused(keys.size(), ExactStop::kNone);
  const size_t prefix =
      ScanPrefix(keys, [&](Shard& shard, uint32_t shard_index, size_t i, Entry* entry) NO_THREAD_SAFETY_ANALYSIS {
        if (entry == nullptr || (entry->dram == kNone && !entry->ssd.has_value())) {
          refused[i] = ExactStop::kAbsent;
          return false;
        }
        if (entry->dram == kNone) {
          refused[i] = ExactStop::kNotDram;
          return false;
        }
        const Block& block = shard.slots[entry->dram];
        if (block.residence_generation != generations[i] || block.residence_sequence != sequences[i]) {
          refused[i] = ExactStop::kReplaced;
          return false;
        }
        (*pins)[base + i] = PinLocked(shard, shard_index, entry->dram, &newly_pinned);
        return true;
      });
  if (newly_pinned != 0) pinned_blocks_->Add(static_cast<double>(newly_pinned));
  KeepPinnedPrefix(base, prefix, pins);
  return ExactPins{prefix, prefix < keys.size() ? refused[prefix] : ExactStop::kNone};
}

Result<BlockPin> BlockTable::Pin(const StateKey& key) {
  const uint64_t hash = key.Hash64();
  const uint32_t shard_index = ShardIndex(hash);
  Shard& shard = *shards_[shard_index];
  MutexLock lock(&shard.mu);
  auto it = shard.entries.find(key);
  if (it == shard.entries.end() || it->second.dram == kNone) {
    return Status::NotFound("block is not resident in DRAM");
  }
  return PinOne(shard, shard_index, it->second.dram);
}

Result<BlockPin> BlockTable::PinRef(const BlockRef& ref) {
  if (ref.shard >= shards_.size()) {
    return Status::InvalidArgument(fmt::format("block ref names shard {} of {}", ref.shard, shards_.size()));
  }
  Shard& shard = *shards_[ref.shard];
  MutexLock lock(&shard.mu);
  if (ref.index >= shard.slots.size()) {
    return Status::InvalidArgument(fmt::format("block ref names slot {} of {}", ref.index, shard.slots.size()));
  }
  Block& block = shard.slots[ref.index];
  if (block.slot_generation != ref.generation || block.state != BlockState::kSealed) {
    return Status::Aborted(fmt::format("block ref slot {} generation {} is stale", ref.index, ref.generation));
  }
  return PinOne(shard, ref.shard, ref.index);
}

BlockPin BlockTable::PinAgain(const BlockRef& ref) {
  Shard& shard = *shards_[ref.shard];
  MutexLock lock(&shard.mu);
  const Block& block = shard.slots[ref.index];
  ORBITKV_CHECK_MSG(block.slot_generation == ref.generation && block.pins > 0,
                    "cloning a pin of block slot {} generation {} that holds none", ref.index, ref.generation);
  return PinOne(shard, ref.shard, ref.index);
}

Status BlockTable::Remove(const StateKey& key, Tier tier, TransitionCause cause) {
  const uint64_t hash = key.Hash64();
  Shard& shard = ShardOf(hash);
  MutexLock lock(&shard.mu);
  auto it = shard.entries.find(key);
  if (tier == Tier::kDram) {
    if (it == shard.entries.end() || it->second.dram == kNone) return Status::NotFound("no DRAM residence");
    const uint32_t slot = it->second.dram;
    TransitionDram(shard, it->second, slot, /*present=*/false, cause);
    if (shard.slots[slot].pins == 0) FreeBlock(shard, slot);
  } else {
    if (it == shard.entries.end() || !it->second.ssd.has_value()) return Status::NotFound("no SSD residence");
    TransitionSsd(shard, it->second, key, std::nullopt, cause);
  }
  EraseEntryIfEmpty(shard, key, hash, it->second);
  return Status::Ok();
}

size_t BlockTable::RemoveAllDram() {
  size_t removed = 0;
  for (auto& shard_ptr : shards_) {
    Shard& shard = *shard_ptr;
    MutexLock lock(&shard.mu);
    for (auto it = shard.entries.begin(); it != shard.entries.end();) {
      Entry& entry = it->second;
      if (entry.dram != kNone) {
        const uint32_t slot = entry.dram;
        TransitionDram(shard, entry, slot, /*present=*/false, TransitionCause::kCleanup);
        if (shard.slots[slot].pins == 0) FreeBlock(shard, slot);
        ++removed;
      }
      if (entry.dram == kNone && entry.preparing == kNone && !entry.ssd.has_value()) {
        shard.entries.erase(it++);
      } else {
        ++it;
      }
    }
  }
  return removed;
}

uint64_t BlockTable::PublishSsd(const StateKey& key, uint64_t locator, uint64_t bytes, TransitionCause cause) {
  const uint64_t hash = key.Hash64();
  Shard& shard = ShardOf(hash);
  const uint32_t inventory_shard = inventory_->ShardFor(key);
  MutexLock lock(&shard.mu);
  auto [it, inserted] = shard.entries.try_emplace(key);
  if (inserted) it->second.inventory_shard = inventory_shard;
  const uint64_t generation = next_generation_.fetch_add(1, std::memory_order_relaxed);
  const TransitionCause effective = it->second.ssd.has_value() ? TransitionCause::kReplace : cause;
  return TransitionSsd(shard, it->second, key, SsdResidence{generation, locator, bytes}, effective);
}

std::optional<SsdResidence> BlockTable::FindSsd(const StateKey& key) {
  Shard& shard = ShardOf(key.Hash64());
  MutexLock lock(&shard.mu);
  auto it = shard.entries.find(key);
  if (it == shard.entries.end()) return std::nullopt;
  return it->second.ssd;
}

uint32_t BlockTable::Frequency(const StateKey& key) {
  const uint64_t hash = key.Hash64();
  Shard& shard = ShardOf(hash);
  MutexLock lock(&shard.mu);
  return shard.sketch.Estimate(hash);
}

std::vector<StateKey> BlockTable::DramOnlyKeys(uint32_t min_frequency) {
  std::vector<std::pair<uint32_t, StateKey>> found;
  for (auto& shard_ptr : shards_) {
    Shard& shard = *shard_ptr;
    MutexLock lock(&shard.mu);
    for (const auto& [key, entry] : shard.entries) {
      if (entry.dram == kNone || entry.ssd.has_value()) continue;
      const uint32_t frequency = shard.sketch.Estimate(shard.slots[entry.dram].hash);
      if (frequency >= min_frequency) found.emplace_back(frequency, key);
    }
  }
  std::stable_sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<StateKey> keys;
  keys.reserve(found.size());
  for (auto& [frequency, key] : found) keys.push_back(std::move(key));
  return keys;
}

Status BlockTable::DropSsd(const StateKey& key, uint64_t generation, TransitionCause cause) {
  const uint64_t hash = key.Hash64();
  Shard& shard = ShardOf(hash);
  MutexLock lock(&shard.mu);
  auto it = shard.entries.find(key);
  if (it == shard.entries.end() || !it->second.ssd.has_value()) return Status::NotFound("no SSD residence");
  if (it->second.ssd->generation != generation) {
    return Status::Aborted(
        fmt::format("SSD residence generation is {}, not {}", it->second.ssd->generation, generation));
  }
  TransitionSsd(shard, it->second, key, std::nullopt, cause);
  EraseEntryIfEmpty(shard, key, hash, it->second);
  return Status::Ok();
}

BlockTableStats BlockTable::Stats() const {
  BlockTableStats stats;
  for (const auto& shard_ptr : shards_) {
    const Shard& shard = *shard_ptr;
    MutexLock lock(&shard.mu);
    stats.resident_blocks += shard.resident_blocks;
    stats.resident_bytes += shard.resident_bytes;
    stats.pinned_blocks += shard.pinned_blocks;
    stats.preparing_blocks += shard.preparing_blocks;
    stats.unpublished_blocks += shard.unpublished_blocks;
    stats.ssd_residences += shard.ssd_residences;
    stats.ssd_bytes += shard.ssd_bytes;
  }
  return stats;
}

}  // namespace orbitkv::core
