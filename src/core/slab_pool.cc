#include "core/slab_pool.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include "base/check.h"

namespace orbitkv::core {
namespace {

constexpr uint32_t kNil = std::numeric_limits<uint32_t>::max();
constexpr uint8_t kNoClass = std::numeric_limits<uint8_t>::max();
static_assert(kMaxSizeClasses < kNoClass, "class ids must fit in a byte with kNoClass to spare");

uint64_t RoundUpToPage(uint64_t bytes) { return (bytes + kArenaPageBytes - 1) / kArenaPageBytes * kArenaPageBytes; }

}  // namespace

// One arena and the slabs cut from it. Every member but the immutable ones is guarded by mu_, and
// every method takes mu_ itself, so the pool never holds two arenas' locks at once.
class PinnedPool::Shard {
 public:
  // What one operation changed, for the pool's metrics (updated after mu_ is released).
  struct Change {
    bool slab_taken = false;     // A free slab was assigned to a class.
    bool slab_released = false;  // A slab went back to the free list.
  };
  struct Totals {
    uint64_t requested_bytes = 0;
    uint64_t allocated_bytes = 0;
    uint64_t blocks_in_use = 0;
    uint64_t free_slabs = 0;
    // Bit c: class c has a free object in a partly used slab.
    uint64_t classes_with_room = 0;
  };

  Shard(std::unique_ptr<PinnedArena> arena, uint64_t slab_bytes)
      : arena_(std::move(arena)),
        slab_bytes_(slab_bytes),
        objects_per_slab_max_(slab_bytes / kArenaPageBytes),
        slab_count_(static_cast<uint32_t>(arena_->size() / slab_bytes)) {
    MutexLock lock(&mu_);
    slabs_.resize(slab_count_);
    allocated_bits_.assign(static_cast<size_t>(slab_count_) * objects_per_slab_max_ / 64, 0);
    // Ascending order on the free list: the first allocations use the start of the arena.
    for (uint32_t s = slab_count_; s-- > 0;) PushFront(&free_slabs_, s);
    free_slab_count_ = slab_count_;
  }

  const PinnedArena& arena() const { return *arena_; }
  uint32_t slab_count() const { return slab_count_; }

  // Takes one object of class `id` from this arena; false when it has no room.
  bool TryAllocate(uint32_t id, const SizeClass& size_class, uint64_t requested_bytes, uint32_t arena_index,
                   PoolBlock* block, Change* change) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    SlabList& partial = partial_[id];
    uint32_t s = partial.head;
    if (s == kNil) {
      s = free_slabs_.head;
      if (s == kNil) return false;
      Remove(&free_slabs_, s);
      --free_slab_count_;
      slabs_[s] = Slab{.class_id = static_cast<uint8_t>(id)};
      PushFront(&partial, s);
      change->slab_taken = true;
    }
    Slab& slab = slabs_[s];
    uint8_t* slab_base = arena_->data() + static_cast<uint64_t>(s) * slab_bytes_;
    uint32_t index;
    if (slab.free_head != kNil) {
      index = slab.free_head;
      uint32_t next;
      std::memcpy(&next, slab_base + index * size_class.class_bytes, sizeof(next));
      ORBITKV_CHECK_MSG(next == kNil || (next < slab.bump && !TestBit(s, next)),
                        "pool arena '{}' slab {}: free list corrupted after object {} (was a block written "
                        "after Free?)",
                        arena_->name(), s, index);
      slab.free_head = next;
    } else {
      ORBITKV_CHECK(slab.bump < size_class.objects_per_slab);
      index = slab.bump++;
    }
    ORBITKV_CHECK(!TestBit(s, index));
    SetBit(s, index, true);
    if (++slab.in_use == size_class.objects_per_slab) Remove(&partial, s);
    requested_bytes_ += requested_bytes;
    allocated_bytes_ += size_class.class_bytes;
    ++blocks_in_use_;
    *block = PoolBlock{.data = slab_base + index * size_class.class_bytes,
                       .requested_bytes = requested_bytes,
                       .class_bytes = size_class.class_bytes,
                       .arena = arena_index,
                       .slab = s,
                       .index = index};
    return true;
  }

  // Returns `block` (of class `id`); CHECK-fails unless it is an allocated object of this arena.
  void Free(const PoolBlock& block, uint32_t id, const SizeClass& size_class, Change* change) EXCLUDES(mu_) {
    const uint32_t s = block.slab;
    ORBITKV_CHECK_MSG(s < slab_count_, "Free of a block from slab {} of an arena with {} slabs", s, slab_count_);
    uint8_t* slab_base = arena_->data() + static_cast<uint64_t>(s) * slab_bytes_;
    MutexLock lock(&mu_);
    Slab& slab = slabs_[s];
    ORBITKV_CHECK_MSG(slab.class_id == id && block.index < slab.bump &&
                          block.data == slab_base + block.index * size_class.class_bytes && TestBit(s, block.index),
                      "Free of a block that is not allocated from this pool (double free or foreign block): "
                      "arena '{}' slab {} index {} class {} bytes",
                      arena_->name(), s, block.index, block.class_bytes);
    SetBit(s, block.index, false);
    std::memcpy(block.data, &slab.free_head, sizeof(slab.free_head));
    slab.free_head = block.index;
    const bool was_full = slab.in_use == size_class.objects_per_slab;
    --slab.in_use;
    requested_bytes_ -= block.requested_bytes;
    allocated_bytes_ -= size_class.class_bytes;
    --blocks_in_use_;
    SlabList& partial = partial_[id];
    if (slab.in_use == 0) {
      // Empty: back to the arena, where any class can take it.
      if (!was_full) Remove(&partial, s);
      slab = Slab{};
      PushFront(&free_slabs_, s);
      ++free_slab_count_;
      change->slab_released = true;
    } else if (was_full) {
      PushBack(&partial, s);
    }
  }

  Totals GetTotals() const EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    Totals totals{.requested_bytes = requested_bytes_,
                  .allocated_bytes = allocated_bytes_,
                  .blocks_in_use = blocks_in_use_,
                  .free_slabs = free_slab_count_};
    for (size_t c = 0; c < kMaxSizeClasses; ++c) {
      if (partial_[c].head != kNil) totals.classes_with_room |= uint64_t{1} << c;
    }
    return totals;
  }

 private:
  struct Slab {
    uint8_t class_id = kNoClass;
    // Objects [bump, objects_per_slab) are unused since the slab was assigned to its class.
    uint32_t bump = 0;
    // Head of the intrusive list of freed objects below bump.
    uint32_t free_head = kNil;
    uint32_t in_use = 0;
    // Links in free_slabs_ (free slab) or partial_[class_id] (slab with a free object); a full slab
    // is in no list.
    uint32_t prev = kNil;
    uint32_t next = kNil;
  };
  struct SlabList {
    uint32_t head = kNil;
    uint32_t tail = kNil;
  };

  void PushFront(SlabList* list, uint32_t s) REQUIRES(mu_) {
    slabs_[s].prev = kNil;
    slabs_[s].next = list->head;
    if (list->head != kNil) slabs_[list->head].prev = s;
    list->head = s;
    if (list->tail == kNil) list->tail = s;
  }
  void PushBack(SlabList* list, uint32_t s) REQUIRES(mu_) {
    slabs_[s].next = kNil;
    slabs_[s].prev = list->tail;
    if (list->tail != kNil) slabs_[list->tail].next = s;
    list->tail = s;
    if (list->head == kNil) list->head = s;
  }
  void Remove(SlabList* list, uint32_t s) REQUIRES(mu_) {
    Slab& slab = slabs_[s];
    (slab.prev != kNil ? slabs_[slab.prev].next : list->head) = slab.next;
    (slab.next != kNil ? slabs_[slab.next].prev : list->tail) = slab.prev;
    slab.prev = slab.next = kNil;
  }

  bool TestBit(uint32_t s, uint32_t index) const REQUIRES(mu_) {
    const uint64_t bit = static_cast<uint64_t>(s) * objects_per_slab_max_ + index;
    return (allocated_bits_[bit / 64] >> (bit % 64) & 1) != 0;
  }
  void SetBit(uint32_t s, uint32_t index, bool value) REQUIRES(mu_) {
    const uint64_t bit = static_cast<uint64_t>(s) * objects_per_slab_max_ + index;
    const uint64_t mask = uint64_t{1} << (bit % 64);
    allocated_bits_[bit / 64] = value ? (allocated_bits_[bit / 64] | mask) : (allocated_bits_[bit / 64] & ~mask);
  }

  // Immutable after construction.
  const std::unique_ptr<PinnedArena> arena_;
  const uint64_t slab_bytes_;
  // The most objects a slab can hold (4 KiB class): the stride of the allocated bitmap.
  const uint64_t objects_per_slab_max_;
  const uint32_t slab_count_;

  mutable Mutex mu_;
  // Guarded by mu_.
  std::vector<Slab> slabs_ GUARDED_BY(mu_);
  // One bit per possible object of every slab: 1 bit per 4 KiB of arena.
  std::vector<uint64_t> allocated_bits_ GUARDED_BY(mu_);
  SlabList free_slabs_ GUARDED_BY(mu_);
  std::array<SlabList, kMaxSizeClasses> partial_ GUARDED_BY(mu_);
  uint64_t free_slab_count_ GUARDED_BY(mu_) = 0;
  uint64_t requested_bytes_ GUARDED_BY(mu_) = 0;
  uint64_t allocated_bytes_ GUARDED_BY(mu_) = 0;
  uint64_t blocks_in_use_ GUARDED_BY(mu_) = 0;
};

Result<std::unique_ptr<PinnedPool>> PinnedPool::Create(const PoolOptions& options, MetricsRegistry* metrics) {
  const uint64_t slab_bytes = options.slab_bytes;
  if (!std::has_single_bit(slab_bytes) || slab_bytes < kMinSlabBytes || slab_bytes > kMaxSlabBytes) {
    return Status::InvalidArgument(
        fmt::format("pool slab size {} is not a power of two in [{}, {}]", slab_bytes, kMinSlabBytes, kMaxSlabBytes));
  }
  if (options.capacity_bytes == 0) return Status::InvalidArgument("pool capacity is 0 bytes");
  std::vector<int> nodes = options.numa_nodes;
  if (nodes.empty()) {
    ORBITKV_ASSIGN_OR_RETURN(nodes, MemoryNumaNodes());
  }
  // An even split, each part rounded up to whole slabs: at least the capacity asked for.
  const uint64_t part = options.capacity_bytes / nodes.size() + (options.capacity_bytes % nodes.size() != 0);
  const uint64_t slabs_per_arena = part / slab_bytes + (part % slab_bytes != 0);
  if (slabs_per_arena >= kNil || slabs_per_arena > std::numeric_limits<uint64_t>::max() / slab_bytes) {
    return Status::InvalidArgument(
        fmt::format("pool capacity {} bytes needs {} slabs of {} bytes per arena; use larger slabs",
                    options.capacity_bytes, slabs_per_arena, slab_bytes));
  }

  std::unique_ptr<PinnedPool> pool(new PinnedPool(slab_bytes, options.registrar));
  for (size_t i = 0; i < nodes.size(); ++i) {
    ArenaOptions arena_options{
        .bytes = slabs_per_arena * slab_bytes,
        .numa_node = nodes[i],
        .pin_mode = options.pin_mode,
        .name = nodes[i] >= 0 ? fmt::format("orbitkv-pool-{}-node{}", i, nodes[i]) : fmt::format("orbitkv-pool-{}", i)};
    ORBITKV_ASSIGN_OR_RETURN(std::unique_ptr<PinnedArena> arena, PinnedArena::Create(arena_options));
    pool->shards_.push_back(std::make_unique<Shard>(std::move(arena), slab_bytes));
    pool->registered_.push_back(false);
    if (options.registrar != nullptr) {
      const PinnedArena& a = pool->shards_.back()->arena();
      // On failure the pool's destructor unregisters the arenas registered so far.
      ORBITKV_RETURN_IF_ERROR(options.registrar->Register(a.data(), a.size(), a.numa_node())
                                  .WithContext(fmt::format("registering pool arena '{}'", a.name())));
      pool->registered_.back() = true;
    }
  }

  if (metrics != nullptr) {
    // Gauges are adjusted by deltas (and the destructor takes its share back), so pools sharing a
    // registry add up instead of overwriting each other.
    pool->metrics_ = Metrics{
        .capacity_bytes = &metrics->GetGauge("orbitkv_pool_capacity_bytes", "Bytes of pinned host memory in the pool"),
        .allocated_bytes =
            &metrics->GetGauge("orbitkv_pool_allocated_bytes", "Bytes of pool blocks in use, counted by size class"),
        .requested_bytes =
            &metrics->GetGauge("orbitkv_pool_requested_bytes", "Bytes requested by the pool blocks in use"),
        .free_slabs = &metrics->GetGauge("orbitkv_pool_free_slabs", "Pool slabs assigned to no size class"),
        .allocation_failures =
            &metrics->GetCounter("orbitkv_pool_allocation_failures_total", "Pool allocations that found no room")};
    const PoolStats stats = pool->Stats();
    pool->metrics_.capacity_bytes->Add(static_cast<double>(stats.capacity_bytes));
    pool->metrics_.free_slabs->Add(static_cast<double>(stats.free_slabs));
  }
  return pool;
}

PinnedPool::PinnedPool(uint64_t slab_bytes, ArenaRegistrar* registrar)
    : slab_bytes_(slab_bytes),
      registrar_(registrar),
      class_of_pages_(std::make_unique<std::atomic<uint8_t>[]>(slab_bytes / kArenaPageBytes)) {}

PinnedPool::~PinnedPool() {
  if (metrics_.capacity_bytes != nullptr) {
    const PoolStats stats = Stats();
    metrics_.capacity_bytes->Add(-static_cast<double>(stats.capacity_bytes));
    metrics_.allocated_bytes->Add(-static_cast<double>(stats.allocated_bytes));
    metrics_.requested_bytes->Add(-static_cast<double>(stats.requested_bytes));
    metrics_.free_slabs->Add(-static_cast<double>(stats.free_slabs));
  }
  for (size_t i = shards_.size(); i-- > 0;) {
    if (registered_[i]) registrar_->Unregister(shards_[i]->arena().data());
  }
}

uint64_t PinnedPool::ClassBytes(uint64_t bytes) const {
  if (bytes == 0 || bytes > slab_bytes_) return 0;
  return RoundUpToPage(bytes);
}

size_t PinnedPool::class_count() const {
  // Acquire pairs with the release in ClassFor; only the count is read here.
  return class_count_.load(std::memory_order_acquire);
}

const PinnedArena& PinnedPool::arena(size_t i) const {
  ORBITKV_CHECK_MSG(i < shards_.size(), "arena {} of a pool with {} arenas", i, shards_.size());
  return shards_[i]->arena();
}

Result<uint32_t> PinnedPool::ClassFor(uint64_t class_bytes) {
  std::atomic<uint8_t>& slot = class_of_pages_[class_bytes / kArenaPageBytes - 1];
  // Acquire pairs with the release store below: whoever sees the id sees its SizeClass.
  uint8_t published = slot.load(std::memory_order_acquire);
  if (published != 0) return published - 1U;
  MutexLock lock(&classes_mu_);
  // Relaxed: every store to slot happens under classes_mu_, which we hold.
  published = slot.load(std::memory_order_relaxed);
  if (published != 0) return published - 1U;
  const uint32_t id = class_count_.load(std::memory_order_relaxed);
  if (id == kMaxSizeClasses) {
    return Status::FailedPrecondition(
        fmt::format("pinned pool has {} size classes already, the most it supports, and a {} byte block needs "
                    "another: this is a configuration problem (too many distinct block sizes), not a full pool",
                    kMaxSizeClasses, class_bytes));
  }
  classes_[id] =
      SizeClass{.class_bytes = class_bytes, .objects_per_slab = static_cast<uint32_t>(slab_bytes_ / class_bytes)};
  slot.store(static_cast<uint8_t>(id + 1), std::memory_order_release);
  // Release pairs with the acquire in class_count().
  class_count_.store(id + 1, std::memory_order_release);
  return id;
}

Result<PoolBlock> PinnedPool::Allocate(uint64_t bytes, int preferred_node) {
  if (bytes == 0 || bytes > slab_bytes_) {
    return Status::InvalidArgument(
        fmt::format("pool block of {} bytes: must be between 1 and the slab size {}", bytes, slab_bytes_));
  }
  const uint64_t class_bytes = RoundUpToPage(bytes);
  ORBITKV_ASSIGN_OR_RETURN(const uint32_t id, ClassFor(class_bytes));
  const SizeClass& size_class = classes_[id];

  const size_t n = shards_.size();
  size_t first = n;
  if (preferred_node >= 0) {
    for (size_t i = 0; i < n && first == n; ++i) {
      if (shards_[i]->arena().numa_node() == preferred_node) first = i;
    }
  }
  if (first == n) first = next_arena_.fetch_add(1, std::memory_order_relaxed) % n;
  for (size_t k = 0; k < n; ++k) {
    const size_t i = (first + k) % n;
    PoolBlock block;
    Shard::Change change;
    const bool allocated = shards_[i]->TryAllocate(id, size_class, bytes, static_cast<uint32_t>(i), &block, &change);
    if (!allocated) continue;
    if (metrics_.allocated_bytes != nullptr) {
      metrics_.allocated_bytes->Add(static_cast<double>(class_bytes));
      metrics_.requested_bytes->Add(static_cast<double>(bytes));
      if (change.slab_taken) metrics_.free_slabs->Add(-1);
    }
    return block;
  }
  allocation_failures_.fetch_add(1, std::memory_order_relaxed);
  if (metrics_.allocation_failures != nullptr) metrics_.allocation_failures->Increment();
  return Status::ResourceExhausted(
      fmt::format("pinned pool is full: no free {} KiB block and no free slab in {} arena(s)", class_bytes / 1024, n));
}

void PinnedPool::Free(const PoolBlock& block) {
  ORBITKV_CHECK_MSG(block.arena < shards_.size() && block.class_bytes != 0 && block.class_bytes <= slab_bytes_ &&
                        block.class_bytes % kArenaPageBytes == 0 &&
                        ClassBytes(block.requested_bytes) == block.class_bytes,
                    "Free of a block that is not from this pool: arena {} requested {} class {} bytes", block.arena,
                    block.requested_bytes, block.class_bytes);
  // Acquire: see ClassFor.
  const uint8_t published = class_of_pages_[block.class_bytes / kArenaPageBytes - 1].load(std::memory_order_acquire);
  ORBITKV_CHECK_MSG(published != 0, "Free of a block of {} bytes, a size class this pool never had", block.class_bytes);
  const uint32_t id = published - 1U;
  Shard::Change change;
  shards_[block.arena]->Free(block, id, classes_[id], &change);
  if (metrics_.allocated_bytes != nullptr) {
    metrics_.allocated_bytes->Add(-static_cast<double>(block.class_bytes));
    metrics_.requested_bytes->Add(-static_cast<double>(block.requested_bytes));
    if (change.slab_released) metrics_.free_slabs->Add(1);
  }
}

PoolStats PinnedPool::Stats() const {
  PoolStats stats;
  for (const std::unique_ptr<Shard>& shard : shards_) {
    const Shard::Totals totals = shard->GetTotals();
    stats.capacity_bytes += shard->arena().size();
    stats.total_slabs += shard->slab_count();
    stats.requested_bytes += totals.requested_bytes;
    stats.allocated_bytes += totals.allocated_bytes;
    stats.blocks_in_use += totals.blocks_in_use;
    stats.free_slabs += totals.free_slabs;
    if (totals.free_slabs > 0) stats.largest_free_bytes = slab_bytes_;
    // A class with a slab in a shard was published before that slab was taken under the shard's
    // mutex, which GetTotals took after it: reading its SizeClass needs no further ordering.
    for (uint64_t room = totals.classes_with_room; room != 0; room &= room - 1) {
      const size_t c = static_cast<size_t>(std::countr_zero(room));
      stats.largest_free_bytes = std::max(stats.largest_free_bytes, classes_[c].class_bytes);
    }
  }
  stats.allocation_failures = allocation_failures_.load(std::memory_order_relaxed);
  return stats;
}

}  // namespace orbitkv::core
