#include "core/read_coalescer.h"

#include <gtest/gtest.h>

#include <vector>

#include "core/test_util.h"

namespace orbitkv::core {
namespace {

TEST(ReadCoalescerTest, OneLeaderManyWaitersEachCalledOnce) {
  MetricsRegistry metrics;
  ReadCoalescer coalescer(&metrics);
  const auto key = testing::ChainKey(1, 0);
  const auto other = testing::ChainKey(1, 1);
  std::vector<int> calls(4, 0);
  std::vector<StatusCode> codes(4, StatusCode::kOk);
  auto waiter = [&](int i) {
    return [&, i](const Status& s) {
      ++calls[i];
      codes[i] = s.code();
    };
  };
  EXPECT_TRUE(coalescer.Join(key, waiter(0)));
  EXPECT_FALSE(coalescer.Join(key, waiter(1)));
  EXPECT_FALSE(coalescer.Join(key, waiter(2)));
  EXPECT_TRUE(coalescer.Join(other, waiter(3)));
  EXPECT_EQ(coalescer.in_flight(), 2u);
  coalescer.Complete(key, Status::DataLoss("checksum mismatch"));
  EXPECT_EQ(calls, (std::vector<int>{1, 1, 1, 0}));
  EXPECT_EQ(codes[1], StatusCode::kDataLoss);
  // A new read of the same key starts fresh.
  EXPECT_TRUE(coalescer.Join(key, waiter(0)));
  coalescer.Complete(key, Status::Ok());
  coalescer.Complete(other, Status::Ok());
  EXPECT_EQ(calls, (std::vector<int>{2, 1, 1, 1}));
  EXPECT_EQ(metrics.GetCounter("orbitkv_cache_coalesced_reads_total", "").Value(), 2u);
  EXPECT_EQ(coalescer.in_flight(), 0u);
}

TEST(ReadCoalescerTest, WaitersMayJoinFromTheCompletionCallback) {
  MetricsRegistry metrics;
  ReadCoalescer coalescer(&metrics);
  const auto key = testing::ChainKey(2, 0);
  bool rejoined = false;
  ASSERT_TRUE(coalescer.Join(key, [&](const Status&) { rejoined = coalescer.Join(key, [](const Status&) {}); }));
  coalescer.Complete(key, Status::Ok());
  EXPECT_TRUE(rejoined);  // no lock held during callbacks, and the old read is gone
  coalescer.Complete(key, Status::Ok());
}

TEST(ReadCoalescerTest, CompletingAReadThatIsNotInFlightIsAProgrammingError) {
  MetricsRegistry metrics;
  ReadCoalescer coalescer(&metrics);
  EXPECT_DEATH(coalescer.Complete(testing::ChainKey(3, 0), Status::Ok()), "no read in flight");
}

}  // namespace
}  // namespace orbitkv::core
