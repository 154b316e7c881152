// Metrics registry: counters, gauges and histograms, rendered in the Prometheus text exposition format
// (version 0.0.4) for the Manager's metrics endpoint.
//
// Registration returns a reference that stays valid for the registry's lifetime, so hot paths keep the
// reference and update it with one relaxed atomic operation; the registry lock is taken only to register and to
// render. Asking again for the same name and labels returns the same metric. A name registered with another type
// or other histogram bounds, or a name or label that Prometheus would reject, is a programming error and
// CHECK-fails: metric names are constants in code.
//
// Thread safety: all methods are safe from any thread.
#ifndef ORBITKV_BASE_METRICS_H_
#define ORBITKV_BASE_METRICS_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/mutex.h"
#include "base/stats_visitor.h"
#include "base/thread_annotations.h"

namespace orbitkv {

// Label name -> value pairs. Order does not matter: {a=1,b=2} and {b=2,a=1} name the same metric.
using MetricLabels = std::vector<std::pair<std::string, std::string>>;

class Counter {
 public:
  // Relaxed: counters order nothing; a scrape may see increments slightly late.
  void Increment(uint64_t n = 1) { value_.fetch_add(n, std::memory_order_relaxed); }
  uint64_t Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> value_{0};
};

class Gauge {
 public:
  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  void Add(double delta) { value_.fetch_add(delta, std::memory_order_relaxed); }
  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// Cumulative histogram with fixed upper bounds (an implicit +Inf bucket is always last).
class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);

  // NaN is ignored (it would make _sum NaN forever); +Inf counts in the +Inf bucket.
  void Observe(double value);

  const std::vector<double>& upper_bounds() const { return upper_bounds_; }
  // Per-bucket counts (not cumulative), one more than upper_bounds() for +Inf.
  std::vector<uint64_t> BucketCounts() const;
  uint64_t Count() const { return count_.load(std::memory_order_relaxed); }
  double Sum() const { return sum_.load(std::memory_order_relaxed); }

  // Exponential bounds start, start*factor, ... (count of them), for latencies and sizes.
  static std::vector<double> ExponentialBounds(double start, double factor, int count);

 private:
  // Immutable after construction.
  const std::vector<double> upper_bounds_;
  // One slot per bound plus +Inf.
  std::unique_ptr<std::atomic<uint64_t>[]> buckets_;
  std::atomic<uint64_t> count_{0};
  std::atomic<double> sum_{0.0};
};

class MetricsRegistry {
 public:
  MetricsRegistry() = default;
  MetricsRegistry(const MetricsRegistry&) = delete;
  MetricsRegistry& operator=(const MetricsRegistry&) = delete;

  // Counter names should end in "_total" (Prometheus convention); this is not enforced.
  Counter& GetCounter(std::string_view name, std::string_view help, MetricLabels labels = {});
  Gauge& GetGauge(std::string_view name, std::string_view help, MetricLabels labels = {});
  Histogram& GetHistogram(std::string_view name, std::string_view help, std::vector<double> upper_bounds,
                          MetricLabels labels = {});

  // A function that visits figures kept outside the registry (stats_visitor.h); every render runs it and exports
  // the figures it names a metric for, as counters or gauges beside the registered families. The returned handle
  // removes it when it goes (waiting for a render that runs it): it must go before what the function reads.
  // A collected name must not also be registered (CHECK at render).
  class CollectorHandle {
   public:
    CollectorHandle(MetricsRegistry* registry, uint64_t id) : registry_(registry), id_(id) {}
    ~CollectorHandle();
    CollectorHandle(const CollectorHandle&) = delete;
    CollectorHandle& operator=(const CollectorHandle&) = delete;

   private:
    MetricsRegistry* const registry_;
    const uint64_t id_;
  };
  [[nodiscard]] std::unique_ptr<CollectorHandle> AddCollector(std::function<void(StatsVisitor&)> collect)
      EXCLUDES(collect_mu_);

  // The whole registry in Prometheus text format: families sorted by name, each with # HELP and # TYPE.
  std::string RenderPrometheus() const EXCLUDES(collect_mu_, mu_);

  // True for [a-zA-Z_:][a-zA-Z0-9_:]*.
  static bool IsValidMetricName(std::string_view name);
  // True for [a-zA-Z_][a-zA-Z0-9_]* not starting with "__" (reserved).
  static bool IsValidLabelName(std::string_view name);

 private:
  enum class Type { kCounter, kGauge, kHistogram };
  struct Family {
    Type type;
    std::string help;
    std::vector<double> bounds;  // Histograms only.
    // Canonical (sorted) labels -> metric; exactly one of the pointers is set, by type.
    std::map<MetricLabels, std::unique_ptr<Counter>> counters;
    std::map<MetricLabels, std::unique_ptr<Gauge>> gauges;
    std::map<MetricLabels, std::unique_ptr<Histogram>> histograms;
  };

  Family& FamilyFor(std::string_view name, std::string_view help, Type type, MetricLabels& labels) REQUIRES(mu_);

  mutable Mutex mu_;
  // Guarded by mu_.
  std::map<std::string, Family, std::less<>> families_ GUARDED_BY(mu_);
  // Held while collectors run (before mu_), so removing one waits for a render that runs it.
  mutable Mutex collect_mu_;
  std::map<uint64_t, std::function<void(StatsVisitor&)>> collectors_ GUARDED_BY(collect_mu_);
  uint64_t next_collector_ GUARDED_BY(collect_mu_) = 0;
};

}  // namespace orbitkv

#endif  // ORBITKV_BASE_METRICS_H_
