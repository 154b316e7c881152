#include "cluster/lease_keeper.h"

#include <gtest/gtest.h>

namespace orbitkv::cluster {
namespace {

using std::chrono::seconds;

TEST(RegistrationClockTest, ValidUntilHalfTheTtlFromTheSend) {
  const MonoTime t0 = MonoNow();
  RegistrationClock clock(t0 + seconds(5));
  EXPECT_TRUE(clock.Valid(t0));
  EXPECT_FALSE(clock.Valid(t0 + seconds(5)));
  // An acknowledgement of a request sent at t0+3 with TTL 10 extends to t0+8, however late it
  // arrives.
  EXPECT_TRUE(clock.OnAck(t0 + seconds(3), seconds(10), t0 + seconds(4)));
  EXPECT_TRUE(clock.Valid(t0 + seconds(7)));
  EXPECT_FALSE(clock.Valid(t0 + seconds(8)));
  // An older send never shortens validity.
  EXPECT_TRUE(clock.OnAck(t0 + seconds(1), seconds(10), t0 + seconds(4)));
  EXPECT_EQ(clock.valid_until(), t0 + seconds(8));
}

TEST(RegistrationClockTest, ALateAcknowledgementDoesNotRevive) {
  const MonoTime t0 = MonoNow();
  RegistrationClock clock(t0 + seconds(5));
  // Sent in time, but received after validity lapsed: the registration stays over.
  EXPECT_FALSE(clock.OnAck(t0 + seconds(4), seconds(10), t0 + seconds(6)));
  EXPECT_TRUE(clock.ended());
  EXPECT_FALSE(clock.Valid(t0 + seconds(7)));
  EXPECT_FALSE(clock.OnAck(t0 + seconds(7), seconds(10), t0 + seconds(7)));
  EXPECT_FALSE(clock.Valid(t0 + seconds(8)));
}

TEST(RegistrationClockTest, EndIsFinal) {
  const MonoTime t0 = MonoNow();
  RegistrationClock clock(t0 + seconds(100));
  EXPECT_TRUE(clock.End());
  EXPECT_FALSE(clock.End());
  EXPECT_FALSE(clock.Valid(t0));
  EXPECT_FALSE(clock.OnAck(t0, seconds(100), t0));
  EXPECT_FALSE(clock.Valid(t0));
}

}  // namespace
}  // namespace orbitkv::cluster
