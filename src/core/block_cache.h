// BlockCache: the Manager's cache core, assembled: the pinned pool, the block table with W-TinyLFU
// replacement, leases, the query and transfer budgets, the residency inventory and the read
// coalescer.
//
// It holds no process, socket or device code. The server maps engine operations onto it:
//   save           -> Prepare (memory for the block, evicting as needed) + copy into writer.data()
//   + Seal query_prefetch -> Query: the longest DRAM-resident prefix, pinned under a lease and
//   charged to the query
//                     budget at the group's padded bytes per block
//   start_restore  -> ConsumeLease: the copy owns the pins and the reservation until it completes
//   release        -> ReleaseLease;  engine gone -> CleanupInstance
// Lower tiers and peers plug in through BlockTable's SSD residence and eviction listener.
//
// Thread safety: all methods are safe from any thread; see the components for their lock orders.
#ifndef ORBITKV_CORE_BLOCK_CACHE_H_
#define ORBITKV_CORE_BLOCK_CACHE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <span>

#include "base/metrics.h"
#include "base/result.h"
#include "core/block_table.h"
#include "core/budget.h"
#include "core/inventory.h"
#include "core/lease_table.h"
#include "core/read_coalescer.h"
#include "core/slab_pool.h"
#include "state/state_key.h"

namespace orbitkv::core {

struct BlockCacheOptions {
  PoolOptions pool;
  BlockTable::Options table;
  uint64_t incarnation = 0;  // 0: a random one is drawn
  uint64_t journal_bytes = ResidencyInventory::kDefaultJournalBytes;
  uint32_t inventory_shards = ResidencyInventory::kDefaultShards;
  // False where no catalog will ever read the residency inventory (a single-host Manager): see
  // ResidencyInventory::Options::record.
  bool record_inventory = true;
  uint64_t query_budget_bytes = 0;           // 0: 75% of the pool
  uint64_t query_instance_budget_bytes = 0;  // 0: the global query budget
  uint64_t transfer_budget_bytes = 0;        // 0: half the pool
  uint64_t transfer_peer_budget_bytes = 0;   // 0: the transfer budget
  uint32_t max_transfer_sessions = 1024;
  uint32_t max_leases = 1u << 16;
};

// What Query found: `hits` blocks of the asked prefix are resident in DRAM. When hits > 0, `lease`
// pins exactly those blocks (in order) and holds their budget reservation.
struct QueryResult {
  size_t hits = 0;
  std::optional<LeaseId> lease;
};

class BlockCache {
 public:
  // Creates the pool (mlocking it unless options.pool.pin_mode allows otherwise) and the rest.
  // Errors: the pool's (ResourceExhausted with the `ulimit -l` advice when memory cannot be
  // locked), InvalidArgument for inconsistent options. `metrics` must outlive the cache.
  static Result<std::unique_ptr<BlockCache>> Create(const BlockCacheOptions& options, MetricsRegistry* metrics);
  ~BlockCache();
  BlockCache(const BlockCache&) = delete;
  BlockCache& operator=(const BlockCache&) = delete;

  // Publish path. See BlockTable::Prepare for the errors (AlreadyExists means nothing to write).
  Result<BlockWriter> Prepare(const state::StateKey& key, uint64_t bytes) { return table_->Prepare(key, bytes); }
  uint64_t Seal(BlockWriter& writer, TransitionCause cause = TransitionCause::kAdmit, BlockPin* pin = nullptr) {
    return table_->Seal(writer, cause, pin);
  }
  void SealAll(std::span<BlockWriter> writers, TransitionCause cause = TransitionCause::kAdmit) {
    table_->SealAll(writers, cause);
  }

  // Pins the longest DRAM-resident prefix of `keys` under a lease owned by `instance`, reserving
  // hits * padded_block_bytes of the query budget. A miss (hits == 0) takes no lease. Errors:
  // ResourceExhausted when the query budget or the lease table is full right now (backpressure:
  // keep the query pending and retry). Only the first MaxQueryBlocks() keys are looked at: a
  // longer prefix could never be leased at once.
  Result<QueryResult> Query(uint64_t instance, std::span<const state::StateKey> keys, uint64_t padded_block_bytes);

  // The most blocks of `padded_block_bytes` one lease can hold (the query budget's limits).
  size_t MaxQueryBlocks(uint64_t padded_block_bytes) const;
  Status ReleaseLease(uint64_t instance, LeaseId lease) { return leases_->Release(lease, instance); }
  // A use of the lease's blocks for a partial restore: pins of their own, no reservation (that
  // stays with the lease, which stays valid; LeaseTable::Borrow).
  Result<LeaseUse> BorrowLease(uint64_t instance, LeaseId lease) const {
    ORBITKV_ASSIGN_OR_RETURN(std::vector<BlockPin> pins, leases_->Borrow(lease, instance));
    return LeaseUse(std::move(pins), BudgetTicket(), instance);
  }
  // Whether `key` has an SSD residence (a query's prefix continues there).
  bool OnSsd(const state::StateKey& key) { return table_->FindSsd(key).has_value(); }

  // The numbers `orbitkv stats` shows, in one snapshot.
  struct Stats {
    PoolStats pool;
    BlockTableStats table;
    size_t leases_active = 0;
    uint64_t query_reserved_bytes = 0;
  };
  Stats GetStats() const;
  Result<LeaseUse> ConsumeLease(uint64_t instance, LeaseId lease) { return leases_->Consume(lease, instance); }
  // The engine instance went away: releases its live leases. Returns how many.
  size_t CleanupInstance(uint64_t instance) { return leases_->ReleaseOwner(instance); }

  PinnedPool& pool() { return *pool_; }
  BlockTable& table() { return *table_; }
  LeaseTable& leases() { return *leases_; }
  ResidencyInventory& inventory() { return *inventory_; }
  Budget& query_budget() { return *query_budget_; }
  Budget& transfer_budget() { return *transfer_budget_; }
  ReadCoalescer& coalescer() { return *coalescer_; }
  uint64_t incarnation() const { return inventory_->incarnation(); }

 private:
  BlockCache() = default;

  // Destroyed in reverse order: leases (pins, tickets) before the table and budgets, the table
  // before the pool.
  std::unique_ptr<PinnedPool> pool_;
  std::unique_ptr<ResidencyInventory> inventory_;
  std::unique_ptr<BlockTable> table_;
  std::unique_ptr<Budget> query_budget_;
  std::unique_ptr<Budget> transfer_budget_;
  std::unique_ptr<ReadCoalescer> coalescer_;
  std::unique_ptr<LeaseTable> leases_;
};

}  // namespace orbitkv::core

#endif  // ORBITKV_CORE_BLOCK_CACHE_H_
