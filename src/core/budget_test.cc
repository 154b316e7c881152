#include "core/budget.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

namespace orbitkv::core {
namespace {

Budget::Options Limits(uint64_t global, uint64_t per_owner, uint32_t tickets) {
  Budget::Options options;
  options.name = "test";
  options.global_bytes = global;
  options.per_owner_bytes = per_owner;
  options.max_tickets = tickets;
  return options;
}

TEST(BudgetTest, ChargesUntilTicketsAreDestroyed) {
  MetricsRegistry metrics;
  Budget budget(Limits(100, 0, 0), &metrics);
  {
    auto a = budget.TryReserve(1, 60);
    ASSERT_TRUE(a.ok());
    EXPECT_EQ(budget.reserved_bytes(), 60u);
    EXPECT_EQ(budget.TryReserve(2, 41).status().code(), StatusCode::kResourceExhausted);
    auto b = budget.TryReserve(2, 40);
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(budget.reserved_bytes(2), 40u);
    BudgetTicket moved = std::move(*b);
    EXPECT_FALSE(b->valid());
    EXPECT_EQ(budget.tickets(), 2u);
  }
  EXPECT_EQ(budget.reserved_bytes(), 0u);
  EXPECT_EQ(budget.tickets(), 0u);
  EXPECT_EQ(metrics.GetCounter("orbitkv_budget_waits_total", "", {{"budget", "test"}}).Value(), 1u);
  EXPECT_EQ(metrics.GetGauge("orbitkv_budget_reserved_bytes", "", {{"budget", "test"}}).Value(), 0.0);
}

TEST(BudgetTest, PerOwnerLimitIsolatesInstances) {
  MetricsRegistry metrics;
  Budget budget(Limits(100, 50, 0), &metrics);
  auto a = budget.TryReserve(1, 50);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(budget.TryReserve(1, 1).status().code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(budget.TryReserve(2, 50).ok());
}

TEST(BudgetTest, RequestsLargerThanALimitCanNeverFit) {
  MetricsRegistry metrics;
  Budget budget(Limits(100, 50, 0), &metrics);
  EXPECT_EQ(budget.TryReserve(1, 51).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(metrics.GetCounter("orbitkv_budget_bypasses_total", "", {{"budget", "test"}}).Value(), 1u);
  Budget unlimited(Limits(0, 0, 0), &metrics);
  EXPECT_TRUE(unlimited.TryReserve(1, uint64_t{1} << 60).ok());
}

TEST(BudgetTest, TicketCountIsBounded) {
  MetricsRegistry metrics;
  Budget budget(Limits(0, 0, 2), &metrics);
  auto a = budget.TryReserve(1, 0);
  auto b = budget.TryReserve(1, 0);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(budget.TryReserve(1, 0).status().code(), StatusCode::kResourceExhausted);
  a->Reset();
  EXPECT_TRUE(budget.TryReserve(1, 0).ok());
}

TEST(BudgetTest, WaitForRoomTimesOutOrWakesOnReturn) {
  MetricsRegistry metrics;
  Budget budget(Limits(10, 0, 0), &metrics);
  auto held = budget.TryReserve(1, 10);
  ASSERT_TRUE(held.ok());
  EXPECT_EQ(budget.WaitForRoom(2, 5, Deadline::After(std::chrono::milliseconds(5))).code(),
            StatusCode::kDeadlineExceeded);
  std::thread releaser([&] { held->Reset(); });
  EXPECT_TRUE(budget.WaitForRoom(2, 5, Deadline::Infinite()).ok());
  releaser.join();
  EXPECT_TRUE(budget.TryReserve(2, 10).ok());
}

TEST(BudgetTest, DestroyingABudgetWithTicketsOutIsAProgrammingError) {
  MetricsRegistry metrics;
  EXPECT_DEATH(
      {
        auto budget = std::make_unique<Budget>(Limits(10, 0, 0), &metrics);
        auto ticket = budget->TryReserve(1, 1);
        BudgetTicket leaked = std::move(*ticket);
        budget.reset();
        leaked = BudgetTicket();
      },
      "tickets outstanding");
}

}  // namespace
}  // namespace orbitkv::core
