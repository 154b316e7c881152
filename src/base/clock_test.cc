#include "base/clock.h"

#include <gtest/gtest.h>

#include <thread>

namespace orbitkv {
namespace {

using namespace std::chrono_literals;

TEST(ClockTest, MonotonicNeverGoesBack) {
  int64_t a = MonoNanos();
  int64_t b = MonoNanos();
  EXPECT_LE(a, b);
  EXPECT_GT(WallMicros(), int64_t{1'600'000'000} * 1'000'000);  // After 2020.
}

TEST(ClockTest, StopwatchMeasuresAtLeastTheSleep) {
  Stopwatch sw;
  std::this_thread::sleep_for(2ms);
  EXPECT_GE(sw.Elapsed(), 2ms);
  sw.Restart();
  EXPECT_LT(sw.Elapsed(), 1h);
}

TEST(ClockTest, InfiniteDeadlineNeverExpires) {
  Deadline d = Deadline::Infinite();
  EXPECT_TRUE(d.IsInfinite());
  EXPECT_FALSE(d.Expired());
  EXPECT_EQ(d.RemainingPollMs(), -1);
  EXPECT_EQ(d.Remaining(), MonoClock::duration::max());
}

TEST(ClockTest, HugeTimeoutSaturatesToInfinite) {
  EXPECT_TRUE(Deadline::After(MonoClock::duration::max()).IsInfinite());
  EXPECT_FALSE(Deadline::After(MonoClock::duration::max() - 1h).Expired());  // Near max: no wrap to the past.
  EXPECT_FALSE(Deadline::After(1h).IsInfinite());
}

TEST(ClockTest, PastDeadlineIsExpiredWithZeroRemaining) {
  Deadline d = Deadline::At(MonoNow() - 1s);
  EXPECT_TRUE(d.Expired());
  EXPECT_EQ(d.Remaining(), MonoClock::duration::zero());
  EXPECT_EQ(d.RemainingPollMs(), 0);
}

TEST(ClockTest, FutureDeadlineRoundsPollUp) {
  Deadline d = Deadline::After(1h);
  EXPECT_FALSE(d.Expired());
  EXPECT_GT(d.RemainingPollMs(), 3'500'000);
  EXPECT_LE(d.RemainingPollMs(), 3'600'000);
  // A sub-millisecond remainder rounds up to 1, never down to a busy 0.
  Deadline soon = Deadline::After(200us);
  int ms = soon.RemainingPollMs();
  EXPECT_TRUE(ms == 1 || (ms == 0 && soon.Expired()));
}

}  // namespace
}  // namespace orbitkv
