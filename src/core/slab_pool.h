// PinnedPool: the size-class/slab allocator that carves KV blocks out of pinned arenas (one arena
// per NUMA node).
//
// Each arena is cut into slabs of slab_bytes. A slab is either free or belongs to one size class,
// and then holds slab_bytes / class_bytes objects of that class. A request is rounded up to a
// multiple of 4 KiB (its class), so every block is 4 KiB aligned. Classes are created on first use
// (at most kMaxSizeClasses). Allocation pops an object from a partially used slab of the class, or
// assigns a free slab to the class; when the last object of a slab is freed the slab goes back to
// its arena's free list, so memory flows between classes. Both operations are O(1): a slab hands
// out never-used objects with a bump index and reuses freed ones from an intrusive free list (the
// first 4 bytes of a free object hold the index of the next one), so nothing is allocated and no
// system call is made per block.
//
// Fragmentation is bounded: a block wastes under 4 KiB to rounding, and a slab wastes slab_bytes
// mod class_bytes, less than 1/(n+1) of the slab for n objects per slab (under 1/9 when blocks are
// at most 1/8 of a slab; keep slab_bytes well above the largest block). Free objects in partly used
// slabs are the only memory one class can hold that another cannot use; a slab that gains a free
// object goes to the back of its class's list, so allocations fill the older slabs and the slabs
// whose blocks are being freed get the chance to empty.
//
// Invariants: every allocated object has its bit set in its arena's allocated bitmap (Free of a
// block whose bit is clear, or that does not match its slab's class and address, is a CHECK
// failure: a double free or a foreign block). Stats() are exact: per arena they are updated under
// that arena's mutex together with the slabs.
//
// Thread safety: all methods are safe from any thread. Each arena has its own mutex, held for a few
// dozen instructions; the size-class table is read without a lock (see slab_pool.cc).
#ifndef ORBITKV_CORE_SLAB_POOL_H_
#define ORBITKV_CORE_SLAB_POOL_H_

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "base/metrics.h"
#include "base/mutex.h"
#include "base/result.h"
#include "core/pinned_arena.h"

namespace orbitkv::core {

inline constexpr size_t kMaxSizeClasses = 64;
inline constexpr uint64_t kMinSlabBytes = uint64_t{1} << 20;
inline constexpr uint64_t kMaxSlabBytes = uint64_t{1} << 30;

struct PoolOptions {
  // Total bytes over all arenas; split evenly, each part rounded up to a whole number of slabs.
  uint64_t capacity_bytes = 0;
  // One arena per entry, in this order; -1 is an unbound arena. Empty means MemoryNumaNodes().
  std::vector<int> numa_nodes;
  PinMode pin_mode = PinMode::kRequireLocked;
  // A power of two in [kMinSlabBytes, kMaxSlabBytes]; also the largest block.
  uint64_t slab_bytes = uint64_t{32} << 20;
  // Not owned; must outlive the pool. Register is called for each arena after creation, Unregister
  // before the arena is destroyed.
  ArenaRegistrar* registrar = nullptr;
};

// One allocated block, as a plain value. Its owner calls Free exactly once, with the value as is.
struct PoolBlock {
  uint8_t* data = nullptr;       // 4 KiB aligned; class_bytes writable bytes.
  uint64_t requested_bytes = 0;  // What Allocate was asked for.
  uint64_t class_bytes = 0;      // requested_bytes rounded up to 4 KiB.
  uint32_t arena = 0;            // Index into arena(i).
  uint32_t slab = 0;             // Slab within the arena.
  uint32_t index = 0;            // Object within the slab.

  bool valid() const { return data != nullptr; }
};

struct PoolStats {
  uint64_t capacity_bytes = 0;   // Sum of arena sizes.
  uint64_t requested_bytes = 0;  // Sum of requested_bytes of the blocks in use.
  uint64_t allocated_bytes = 0;  // Sum of class_bytes of the blocks in use.
  uint64_t free_slabs = 0;       // Slabs assigned to no class.
  uint64_t total_slabs = 0;      // Over all arenas.
  uint64_t blocks_in_use = 0;    // Allocated and not yet freed.
  // Allocate calls that found no room (invalid sizes and the class limit do not count).
  uint64_t allocation_failures = 0;
  // The largest block that one Allocate could get now: slab_bytes if a free slab exists, else the
  // largest class that has a free object, else 0.
  uint64_t largest_free_bytes = 0;
};

class PinnedPool {
 public:
  // Creates the arenas (see PinnedArena::Create for the pinning errors), registers them with
  // options.registrar and, when metrics is not null, registers the orbitkv_pool_* metrics there
  // (metrics must outlive the pool). InvalidArgument for a zero capacity or a bad slab size; an
  // arena or registration error is returned as is, after unregistering the arenas registered.
  static Result<std::unique_ptr<PinnedPool>> Create(const PoolOptions& options, MetricsRegistry* metrics);

  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;
  // Unregisters and unmaps every arena. Blocks still allocated become invalid: free them first.
  ~PinnedPool();

  // A block of at least `bytes`, from the arena of preferred_node when it has room, else from
  // another arena (-1: no preference; arenas take turns). O(1).
  //   InvalidArgument:   bytes is 0 or larger than slab_bytes.
  //   ResourceExhausted: no arena has room (the cache evicts and retries).
  //   FailedPrecondition: the request needs a new size class and kMaxSizeClasses exist (a
  //                      configuration problem, which the message says; evicting cannot help).
  // The caller owns the block until it passes it to Free.
  Result<PoolBlock> Allocate(uint64_t bytes, int preferred_node = -1);

  // Returns a block to the pool. O(1). A block that is not allocated from this pool (double free,
  // foreign or altered value) is a CHECK failure.
  void Free(const PoolBlock& block);

  PoolStats Stats() const;

  // The class a request of `bytes` gets: bytes rounded up to 4 KiB (0 if bytes is 0 or too big).
  uint64_t ClassBytes(uint64_t bytes) const;
  uint64_t slab_bytes() const { return slab_bytes_; }
  // Size classes created so far.
  size_t class_count() const;
  size_t arena_count() const { return shards_.size(); }
  const PinnedArena& arena(size_t i) const;

 private:
  class Shard;
  struct SizeClass {
    uint64_t class_bytes = 0;
    uint32_t objects_per_slab = 0;
  };
  struct Metrics {
    Gauge* capacity_bytes = nullptr;
    Gauge* allocated_bytes = nullptr;
    Gauge* requested_bytes = nullptr;
    Gauge* free_slabs = nullptr;
    Counter* allocation_failures = nullptr;
  };

  PinnedPool(uint64_t slab_bytes, ArenaRegistrar* registrar);

  // The id of the class for `class_bytes`, creating it on first use.
  Result<uint32_t> ClassFor(uint64_t class_bytes) EXCLUDES(classes_mu_);

  // Immutable once Create() returns.
  const uint64_t slab_bytes_;
  ArenaRegistrar* const registrar_;
  Metrics metrics_;  // All null without a registry.
  std::vector<std::unique_ptr<Shard>> shards_;
  // Per arena: whether registrar_->Register succeeded (the destructor unregisters exactly those).
  std::vector<bool> registered_;

  // Size classes. A class is written once under classes_mu_ and then published by a release store
  // of its id + 1 into class_of_pages_[pages - 1]; readers find it with an acquire load and never
  // lock. Classes are never removed, so a published SizeClass is immutable.
  Mutex classes_mu_;
  std::array<SizeClass, kMaxSizeClasses> classes_;
  std::unique_ptr<std::atomic<uint8_t>[]> class_of_pages_;
  std::atomic<uint32_t> class_count_{0};

  // Relaxed: it only picks the first arena to try for requests without a preferred node.
  std::atomic<uint32_t> next_arena_{0};
  // Relaxed: a statistic that orders nothing; fetch_add keeps it exact.
  std::atomic<uint64_t> allocation_failures_{0};
};

}  // namespace orbitkv::core

#endif  // ORBITKV_CORE_SLAB_POOL_H_
