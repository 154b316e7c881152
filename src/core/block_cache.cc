#include "core/block_cache.h"

#include <algorithm>
#include <random>
#include <utility>
#include <vector>

#include "base/logging.h"

namespace orbitkv::core {

Result<std::unique_ptr<BlockCache>> BlockCache::Create(const BlockCacheOptions& options, MetricsRegistry* metrics) {
  if (metrics == nullptr) return Status::InvalidArgument("BlockCache needs a metrics registry");
  std::unique_ptr<BlockCache> cache(new BlockCache());
  ORBITKV_ASSIGN_OR_RETURN(cache->pool_, PinnedPool::Create(options.pool, metrics));
  const uint64_t capacity = cache->pool_->Stats().capacity_bytes;

  ResidencyInventory::Options inventory_options;
  inventory_options.incarnation = options.incarnation;
  if (inventory_options.incarnation == 0) {
    std::random_device random;
    inventory_options.incarnation = (static_cast<uint64_t>(random()) << 32 | random()) | 1;
  }
  inventory_options.shards = options.inventory_shards;
  inventory_options.journal_bytes = options.journal_bytes;
  inventory_options.record = options.record_inventory;
  ORBITKV_ASSIGN_OR_RETURN(cache->inventory_, ResidencyInventory::Create(inventory_options, metrics));

  if (options.table.shards == 0) return Status::InvalidArgument("the block table needs at least one shard");
  cache->table_ = std::make_unique<BlockTable>(options.table, cache->pool_.get(), cache->inventory_.get(), metrics);

  Budget::Options query;
  query.name = "query";
  query.global_bytes = options.query_budget_bytes != 0 ? options.query_budget_bytes : capacity / 4 * 3;
  query.per_owner_bytes =
      options.query_instance_budget_bytes != 0 ? options.query_instance_budget_bytes : query.global_bytes;
  cache->query_budget_ = std::make_unique<Budget>(std::move(query), metrics);

  Budget::Options transfer;
  transfer.name = "transfer";
  transfer.global_bytes = options.transfer_budget_bytes != 0 ? options.transfer_budget_bytes : capacity / 2;
  transfer.max_tickets = options.max_transfer_sessions;
  transfer.per_owner_bytes = options.transfer_peer_budget_bytes;
  cache->transfer_budget_ = std::make_unique<Budget>(std::move(transfer), metrics);

  cache->coalescer_ = std::make_unique<ReadCoalescer>(metrics);
  LeaseTable::Options lease_options;
  lease_options.max_leases = options.max_leases;
  if (lease_options.max_leases == 0) return Status::InvalidArgument("max_leases must be at least 1");
  cache->leases_ = std::make_unique<LeaseTable>(lease_options, metrics);
  ORBITKV_LOG_INFO("block cache: {} MiB pool in {} arena(s), incarnation {:016x}", capacity >> 20,
                   cache->pool_->arena_count(), cache->inventory_->incarnation());
  return cache;
}

BlockCache::~BlockCache() {
  // Leases hold pins into the table and tickets into the budgets: release them first.
  leases_.reset();
  coalescer_.reset();
  transfer_budget_.reset();
  query_budget_.reset();
  table_.reset();
  inventory_.reset();
  pool_.reset();
}

BlockCache::Stats BlockCache::GetStats() const {
  Stats stats;
  stats.pool = pool_->Stats();
  stats.table = table_->Stats();
  stats.leases_active = leases_->active();
  stats.query_reserved_bytes = query_budget_->reserved_bytes();
  return stats;
}

size_t BlockCache::MaxQueryBlocks(uint64_t padded_block_bytes) const {
  const Budget::Options& limits = query_budget_->options();
  uint64_t limit = UINT64_MAX;
  if (limits.global_bytes != 0) limit = std::min(limit, limits.global_bytes);
  if (limits.per_owner_bytes != 0) limit = std::min(limit, limits.per_owner_bytes);
  if (padded_block_bytes == 0) return 0;
  return static_cast<size_t>(std::min<uint64_t>(limit / padded_block_bytes, SIZE_MAX));
}

Result<QueryResult> BlockCache::Query(uint64_t instance, std::span<const state::StateKey> keys,
                                      uint64_t padded_block_bytes) {
  // A prefix longer than the budget can ever hold is answered for the part that fits.
  keys = keys.first(std::min(keys.size(), MaxQueryBlocks(padded_block_bytes)));
  std::vector<BlockPin> pins;
  pins.reserve(keys.size());
  const size_t hits = table_->PinPrefix(keys, &pins);
  QueryResult result;
  if (hits == 0) return result;
  Result<BudgetTicket> ticket = query_budget_->TryReserve(instance, hits * padded_block_bytes);
  if (!ticket.ok()) {
    BlockPin::ReleaseAll(&pins);
    // OutOfRange cannot happen for a prefix cut to MaxQueryBlocks; answer a miss rather than keep
    // the engine waiting if it does.
    if (ticket.status().code() == StatusCode::kOutOfRange) return result;
    return ticket.status();
  }
  ORBITKV_ASSIGN_OR_RETURN(LeaseId lease, leases_->Create(instance, std::move(pins), std::move(*ticket)));
  result.hits = hits;
  result.lease = lease;
  return result;
}

}  // namespace orbitkv::core
