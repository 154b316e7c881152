#include "base/clock.h"

#include <time.h>

#include <algorithm>
#include <limits>

namespace orbitkv {

int64_t MonoNanos() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

int64_t WallMicros() {
  timespec ts{};
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000 + ts.tv_nsec / 1000;
}

MonoClock::duration Deadline::Remaining() const {
  if (IsInfinite()) return MonoClock::duration::max();
  auto now = MonoNow();
  return now >= when_ ? MonoClock::duration::zero() : when_ - now;
}

int Deadline::RemainingPollMs() const {
  if (IsInfinite()) return -1;
  auto remaining = Remaining();
  // Round up so that a poll never wakes just before the deadline and spins.
  auto ms = std::chrono::ceil<std::chrono::milliseconds>(remaining).count();
  return static_cast<int>(std::clamp<int64_t>(ms, 0, std::numeric_limits<int32_t>::max()));
}

}  // namespace orbitkv
