// Template part of bench_report.h.
#ifndef ORBITKV_BENCHES_BENCH_REPORT_INL_H_
#define ORBITKV_BENCHES_BENCH_REPORT_INL_H_

#include <algorithm>
#include <chrono>
#include <cstdint>

namespace orbitkv::bench {

template <typename Body>
double BestRate(Body&& body, double min_seconds, int repeats) {
  using Clock = std::chrono::steady_clock;
  uint64_t iterations = 1;
  for (;;) {
    auto start = Clock::now();
    body(iterations);
    double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    if (seconds >= min_seconds) break;
    iterations = seconds <= 0 ? iterations * 10
                              : std::max<uint64_t>(iterations * 2,
                                                   static_cast<uint64_t>(iterations * min_seconds / seconds * 1.2));
  }
  double best = 0;
  for (int r = 0; r < repeats; ++r) {
    auto start = Clock::now();
    body(iterations);
    double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    best = std::max(best, static_cast<double>(iterations) / seconds);
  }
  return best;
}

}  // namespace orbitkv::bench

#endif  // ORBITKV_BENCHES_BENCH_REPORT_INL_H_
