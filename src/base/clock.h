// Clock helpers. Durations are std::chrono types or integers with the unit in the name (STYLE.md §5).
// Monotonic time measures intervals and deadlines; wall time is only for logs and records shown to people.
#ifndef ORBITKV_BASE_CLOCK_H_
#define ORBITKV_BASE_CLOCK_H_

#include <chrono>
#include <cstdint>

namespace orbitkv {

using MonoClock = std::chrono::steady_clock;
using MonoTime = MonoClock::time_point;

inline MonoTime MonoNow() { return MonoClock::now(); }
// Nanoseconds since an arbitrary fixed origin (CLOCK_MONOTONIC); for timestamps in shared memory.
int64_t MonoNanos();
// Microseconds since the Unix epoch (CLOCK_REALTIME).
int64_t WallMicros();

// Measures elapsed monotonic time since construction or the last Restart().
class Stopwatch {
 public:
  Stopwatch() : start_(MonoNow()) {}
  void Restart() { start_ = MonoNow(); }
  MonoClock::duration Elapsed() const { return MonoNow() - start_; }
  double ElapsedSeconds() const { return std::chrono::duration<double>(Elapsed()).count(); }
  int64_t ElapsedMicros() const { return std::chrono::duration_cast<std::chrono::microseconds>(Elapsed()).count(); }

 private:
  MonoTime start_;
};

// A point in monotonic time after which work should stop. Infinite() never expires.
class Deadline {
 public:
  // Saturates to Infinite() for timeouts too large to add to now (e.g. duration::max()).
  static Deadline After(MonoClock::duration timeout) {
    MonoTime now = MonoNow();
    if (timeout >= MonoTime::max() - now) return Infinite();
    return Deadline(now + timeout);
  }
  static Deadline At(MonoTime when) { return Deadline(when); }
  static Deadline Infinite() { return Deadline(MonoTime::max()); }

  bool IsInfinite() const { return when_ == MonoTime::max(); }
  bool Expired() const { return !IsInfinite() && MonoNow() >= when_; }
  MonoTime when() const { return when_; }
  // Zero once expired; MonoClock::duration::max() when infinite.
  MonoClock::duration Remaining() const;
  // Remaining time in whole milliseconds, rounded up, clamped to [0, INT32_MAX]: the shape poll(2) wants, with
  // -1 for infinite.
  int RemainingPollMs() const;

 private:
  explicit Deadline(MonoTime when) : when_(when) {}
  MonoTime when_;
};

}  // namespace orbitkv

#endif  // ORBITKV_BASE_CLOCK_H_
