#include "core/lease_table.h"

#include <gtest/gtest.h>

#include <memory>

#include "core/test_util.h"

namespace orbitkv::core {
namespace {

using testing::Chain;

constexpr uint64_t kBlock = 64 << 10;

class LeaseTableTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto cache = BlockCache::Create(testing::SmallCacheOptions(), &metrics_);
    ASSERT_TRUE(cache.ok()) << cache.status();
    cache_ = std::move(*cache);
    keys_ = Chain(1, 4);
    for (size_t i = 0; i < keys_.size(); ++i) {
      auto writer = cache_->Prepare(keys_[i], kBlock);
      ASSERT_TRUE(writer.ok());
      testing::Stamp(writer->data(), kBlock, i);
      cache_->Seal(*writer);
    }
  }

  std::vector<BlockPin> PinAll() {
    std::vector<BlockPin> pins;
    EXPECT_EQ(cache_->table().PinPrefix(keys_, &pins), keys_.size());
    return pins;
  }

  MetricsRegistry metrics_;
  std::unique_ptr<BlockCache> cache_;
  std::vector<state::StateKey> keys_;
};

TEST_F(LeaseTableTest, ReleaseUnpinsAndSecondReleaseIsAClearError) {
  LeaseTable& leases = cache_->leases();
  auto ticket = cache_->query_budget().TryReserve(7, 1000);
  ASSERT_TRUE(ticket.ok());
  auto id = leases.Create(7, PinAll(), std::move(*ticket));
  ASSERT_TRUE(id.ok());
  EXPECT_EQ(cache_->table().Stats().pinned_blocks, 4u);
  EXPECT_EQ(*leases.BlockCount(*id, 7), 4u);
  EXPECT_EQ(leases.Release(*id, 8).code(), StatusCode::kPermissionDenied);
  EXPECT_TRUE(leases.Release(*id, 7).ok());
  EXPECT_EQ(cache_->table().Stats().pinned_blocks, 0u);
  EXPECT_EQ(cache_->query_budget().reserved_bytes(), 0u);
  Status again = leases.Release(*id, 7);
  EXPECT_EQ(again.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(again.message().find("already released"), std::string::npos);
  EXPECT_EQ(leases.Release(LeaseId{12345, 1}, 7).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(leases.Release(LeaseId{id->index, 0}, 7).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(metrics_.GetCounter("orbitkv_lease_stale_total", "").Value(), 3u);
}

TEST_F(LeaseTableTest, ReusedSlotGetsANewGenerationSoOldIdsStayStale) {
  LeaseTable& leases = cache_->leases();
  auto first = leases.Create(1, PinAll(), BudgetTicket());
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE(leases.Release(*first, 1).ok());
  auto second = leases.Create(1, PinAll(), BudgetTicket());
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(second->index, first->index);
  EXPECT_NE(second->generation, first->generation);
  EXPECT_EQ(leases.Release(*first, 1).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(LeaseId::Unpack(second->Pack()), *second);
  EXPECT_TRUE(leases.Release(*second, 1).ok());
}

TEST_F(LeaseTableTest, ConsumedLeaseHoldsPinsUntilTheCopyCompletes) {
  LeaseTable& leases = cache_->leases();
  auto id = leases.Create(3, PinAll(), BudgetTicket());
  ASSERT_TRUE(id.ok());
  auto use = leases.Consume(*id, 3);
  ASSERT_TRUE(use.ok());
  EXPECT_EQ(leases.active(), 0u);
  EXPECT_EQ(leases.Release(*id, 3).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(leases.Consume(*id, 3).status().code(), StatusCode::kFailedPrecondition);
  // Blocks stay pinned (and readable) even if the cache tries to drop them.
  EXPECT_EQ(cache_->table().RemoveAllDram(), 4u);
  for (size_t i = 0; i < use->pins().size(); ++i) {
    EXPECT_TRUE(testing::CheckStamp(use->pins()[i].data(), kBlock, i));
  }
  EXPECT_EQ(cache_->pool().Stats().blocks_in_use, 4u);
  use->Reset();
  EXPECT_EQ(cache_->pool().Stats().blocks_in_use, 0u);
}

TEST_F(LeaseTableTest, ReleaseOwnerCleansUpOnlyThatInstance) {
  LeaseTable& leases = cache_->leases();
  ASSERT_TRUE(leases.Create(1, PinAll(), BudgetTicket()).ok());
  ASSERT_TRUE(leases.Create(1, PinAll(), BudgetTicket()).ok());
  auto other = leases.Create(2, PinAll(), BudgetTicket());
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(leases.ReleaseOwner(1), 2u);
  EXPECT_EQ(leases.active(), 1u);
  EXPECT_EQ(cache_->table().Stats().pinned_blocks, 4u);
  EXPECT_TRUE(leases.Release(*other, 2).ok());
  EXPECT_EQ(leases.ReleaseOwner(1), 0u);
}

TEST_F(LeaseTableTest, LeaseCountIsBounded) {
  LeaseTable::Options options;
  options.max_leases = 2;
  LeaseTable leases(options, &metrics_);
  ASSERT_TRUE(leases.Create(1, PinAll(), BudgetTicket()).ok());
  ASSERT_TRUE(leases.Create(1, PinAll(), BudgetTicket()).ok());
  auto third = leases.Create(1, PinAll(), BudgetTicket());
  EXPECT_EQ(third.status().code(), StatusCode::kResourceExhausted);
  // The refused lease's pins were released.
  EXPECT_EQ(leases.ReleaseOwner(1), 2u);
  EXPECT_EQ(cache_->table().Stats().pinned_blocks, 0u);
}

}  // namespace
}  // namespace orbitkv::core
