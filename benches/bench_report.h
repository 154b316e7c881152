// BenchReport: the one output format of every OrbitKV benchmark.
//
// Each result pairs a measured metric with a baseline measured in the same run (memcpy, raw SHA-256, a raw
// socket round trip...) and their ratio. Print() writes either one JSON object
//   {"bench": NAME, "results": [{"metric", "unit", "value", "baseline_metric", "baseline", "ratio"}], "env": {...}}
// or, for people, an aligned table.
#ifndef ORBITKV_BENCHES_BENCH_REPORT_H_
#define ORBITKV_BENCHES_BENCH_REPORT_H_

#include <algorithm>
#include <cstdio>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace orbitkv::bench {

struct BenchResult {
  std::string metric;
  std::string unit;
  double value = 0;
  std::string baseline_metric;
  double baseline = 0;
};

class BenchReport {
 public:
  explicit BenchReport(std::string name) : name_(std::move(name)) {}

  void Add(BenchResult result) { results_.push_back(std::move(result)); }
  void AddEnv(std::string key, std::string value) { env_.emplace_back(std::move(key), std::move(value)); }

  std::string ToJson() const;
  std::string ToTable() const;
  // JSON when `json`, else the table; to stdout.
  void Print(bool json) const;

 private:
  std::string name_;
  std::vector<BenchResult> results_;
  std::vector<std::pair<std::string, std::string>> env_;
};

// True when argv holds --json; exits with usage on any other argument (or prints help for --help).
bool ParseBenchArgs(int argc, char** argv, std::string_view description);

// Host, CPU count, compiler and build facts every report carries.
void AddStandardEnv(BenchReport& report);

// Runs `body(iterations)` with growing iteration counts until one run takes >= min_seconds, repeats that
// `repeats` times and returns the best rate in operations per second (best-of, to reject noise from the other
// tenant of a 2-core machine).
template <typename Body>
double BestRate(Body&& body, double min_seconds = 0.2, int repeats = 5);

// The p-quantile (0 <= p <= 1) of `samples` by nearest rank; 0 for none.
inline double Percentile(std::vector<double> samples, double p) {
  if (samples.empty()) return 0;
  std::sort(samples.begin(), samples.end());
  const auto last = static_cast<double>(samples.size() - 1);
  return samples[std::min(samples.size() - 1, static_cast<size_t>(p * last + 0.5))];
}

}  // namespace orbitkv::bench

#include "bench_report_inl.h"

#endif  // ORBITKV_BENCHES_BENCH_REPORT_H_
