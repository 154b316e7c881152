#include "core/block_cache.h"

#include <gtest/gtest.h>

#include <memory>

#include "core/test_util.h"

namespace orbitkv::core {
namespace {

using testing::Chain;

constexpr uint64_t kBlock = 64 << 10;

class BlockCacheTest : public ::testing::Test {
 protected:
  void Make(BlockCacheOptions options) {
    auto cache = BlockCache::Create(options, &metrics_);
    ASSERT_TRUE(cache.ok()) << cache.status();
    cache_ = std::move(*cache);
  }
  void PublishAll(const std::vector<state::StateKey>& keys) {
    for (size_t i = 0; i < keys.size(); ++i) {
      auto writer = cache_->Prepare(keys[i], kBlock);
      ASSERT_TRUE(writer.ok()) << writer.status();
      testing::Stamp(writer->data(), kBlock, i);
      cache_->Seal(*writer);
    }
  }

  MetricsRegistry metrics_;
  std::unique_ptr<BlockCache> cache_;
};

TEST_F(BlockCacheTest, DefaultsDeriveFromThePoolSize) {
  Make(testing::SmallCacheOptions(8 << 20));
  EXPECT_EQ(cache_->query_budget().options().global_bytes, 6u << 20);
  EXPECT_EQ(cache_->query_budget().options().per_owner_bytes, 6u << 20);
  EXPECT_EQ(cache_->transfer_budget().options().global_bytes, 4u << 20);
  EXPECT_EQ(cache_->transfer_budget().options().max_tickets, 1024u);
  EXPECT_EQ(cache_->incarnation(), 7u);
  auto random = testing::SmallCacheOptions();
  random.incarnation = 0;
  MetricsRegistry other_metrics;
  auto other = BlockCache::Create(random, &other_metrics);
  ASSERT_TRUE(other.ok());
  EXPECT_NE((*other)->incarnation(), 0u);
}

TEST_F(BlockCacheTest, QueryLeasesTheResidentPrefixAndChargesPaddedBytes) {
  Make(testing::SmallCacheOptions());
  const auto keys = Chain(1, 10);
  PublishAll(std::vector(keys.begin(), keys.begin() + 6));
  auto result = cache_->Query(5, keys, /*padded_block_bytes=*/kBlock + 512);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->hits, 6u);
  ASSERT_TRUE(result->lease.has_value());
  EXPECT_EQ(cache_->query_budget().reserved_bytes(5), 6 * (kBlock + 512));
  auto use = cache_->ConsumeLease(5, *result->lease);
  ASSERT_TRUE(use.ok());
  ASSERT_EQ(use->pins().size(), 6u);
  for (size_t i = 0; i < 6; ++i) EXPECT_TRUE(testing::CheckStamp(use->pins()[i].data(), kBlock, i));
  // The reservation lasts through the copy.
  EXPECT_EQ(cache_->query_budget().reserved_bytes(5), 6 * (kBlock + 512));
  use->Reset();
  EXPECT_EQ(cache_->query_budget().reserved_bytes(5), 0u);
  EXPECT_EQ(cache_->table().Stats().pinned_blocks, 0u);
}

TEST_F(BlockCacheTest, MissTakesNoLeaseAndNoBudget) {
  Make(testing::SmallCacheOptions());
  auto result = cache_->Query(1, Chain(2, 4), kBlock);
  ASSERT_TRUE(result.ok());
  EXPECT_EQ(result->hits, 0u);
  EXPECT_FALSE(result->lease.has_value());
  EXPECT_EQ(cache_->query_budget().tickets(), 0u);
}

TEST_F(BlockCacheTest, FullQueryBudgetIsBackpressureAndOversizedPrefixIsCut) {
  auto options = testing::SmallCacheOptions();
  options.query_budget_bytes = 4 * kBlock;
  options.query_instance_budget_bytes = 3 * kBlock;
  Make(options);
  const auto keys = Chain(3, 4);
  PublishAll(keys);
  auto first = cache_->Query(1, std::span(keys).first(3), kBlock);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(first->hits, 3u);
  auto busy = cache_->Query(1, std::span(keys).first(1), kBlock);
  EXPECT_EQ(busy.status().code(), StatusCode::kResourceExhausted);
  // Backpressure released its pins.
  EXPECT_EQ(cache_->table().Stats().pinned_blocks, 3u);
  // Four keys never fit a 3-block instance budget: the query is cut to 3, which must wait for room
  // now (1 block of the global budget is free).
  EXPECT_EQ(cache_->MaxQueryBlocks(kBlock), 3u);
  auto too_big = cache_->Query(2, keys, kBlock);
  EXPECT_EQ(too_big.status().code(), StatusCode::kResourceExhausted);
  ASSERT_TRUE(cache_->ReleaseLease(1, *first->lease).ok());
  auto cut = cache_->Query(2, keys, kBlock);
  ASSERT_TRUE(cut.ok());
  EXPECT_EQ(cut->hits, 3u);
  ASSERT_TRUE(cache_->ReleaseLease(2, *cut->lease).ok());
  EXPECT_EQ(cache_->ReleaseLease(1, *first->lease).code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(cache_->Query(1, std::span(keys).first(1), kBlock).ok());
}

TEST_F(BlockCacheTest, CleanupInstanceReleasesItsLeases) {
  Make(testing::SmallCacheOptions());
  const auto keys = Chain(4, 3);
  PublishAll(keys);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(cache_->Query(9, keys, kBlock).ok());
  EXPECT_EQ(cache_->leases().active(), 3u);
  EXPECT_EQ(cache_->CleanupInstance(9), 3u);
  EXPECT_EQ(cache_->leases().active(), 0u);
  EXPECT_EQ(cache_->query_budget().reserved_bytes(), 0u);
  EXPECT_EQ(cache_->table().Stats().pinned_blocks, 0u);
}

TEST_F(BlockCacheTest, MetricsAreExported) {
  Make(testing::SmallCacheOptions());
  const auto keys = Chain(5, 2);
  PublishAll(keys);
  ASSERT_TRUE(cache_->Query(1, Chain(5, 3), kBlock).ok());
  const std::string text = metrics_.RenderPrometheus();
  for (const char* name :
       {"orbitkv_cache_hits_total 2", "orbitkv_cache_misses_total 1", "orbitkv_leases_active 1",
        "orbitkv_cache_resident_bytes{tier=\"dram\"} 131072", "orbitkv_pool_capacity_bytes",
        "orbitkv_cache_evictions_total", "orbitkv_cache_admissions_rejected_total", "orbitkv_budget_waits_total"}) {
    EXPECT_NE(text.find(name), std::string::npos) << name;
  }
}

TEST_F(BlockCacheTest, ReportsAClearErrorForBadOptions) {
  auto options = testing::SmallCacheOptions();
  options.table.shards = 0;
  EXPECT_EQ(BlockCache::Create(options, &metrics_).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(BlockCache::Create(testing::SmallCacheOptions(), nullptr).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace orbitkv::core
