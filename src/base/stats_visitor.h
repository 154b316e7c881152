// StatsVisitor: the one path a figure takes to `orbitkv stats --json`, `orbitkv status` (which reads that JSON) and
// the Prometheus endpoint. A part keeps each figure in one place (its own atomic or state) and visits it once,
// naming its stats JSON key and, where Prometheus exports it, its metric; JsonStatsWriter and the metrics
// registry's scrape-time collectors (metrics.h) are visitors. Nothing is copied into a registry counter or counted
// a second time under a lock to be shown.
//
// Thread safety: a visitor is used by one thread at a time; a part's visit method may run on any thread.
#ifndef ORBITKV_BASE_STATS_VISITOR_H_
#define ORBITKV_BASE_STATS_VISITOR_H_

#include <cstdint>
#include <string>
#include <string_view>

namespace orbitkv {

// A figure's Prometheus metric; an empty name: not exported there. One optional label (e.g. {reason="stale"}).
struct MetricName {
  std::string_view name;
  std::string_view help;
  std::string_view label = {};
  std::string_view label_value = {};
};

class StatsVisitor {
 public:
  virtual ~StatsVisitor() = default;
  // A count since start (a Prometheus counter). An empty `key`: a metric with no stats JSON key.
  virtual void Counter(std::string_view key, uint64_t value, const MetricName& metric = {}) = 0;
  // A level now (a Prometheus gauge), an integer in JSON.
  virtual void Gauge(std::string_view key, int64_t value, const MetricName& metric = {}) = 0;
  // A measurement now (a Prometheus gauge), with `decimals` in JSON.
  virtual void Real(std::string_view key, double value, int decimals, const MetricName& metric = {}) = 0;
  // A string (stats JSON only).
  virtual void Text(std::string_view key, std::string_view value) = 0;
};

// Writes each visited key as `, "key": value` (the form the Manager's stats JSON is assembled from); metrics are
// ignored.
class JsonStatsWriter final : public StatsVisitor {
 public:
  void Counter(std::string_view key, uint64_t value, const MetricName& metric = {}) override;
  void Gauge(std::string_view key, int64_t value, const MetricName& metric = {}) override;
  void Real(std::string_view key, double value, int decimals, const MetricName& metric = {}) override;
  void Text(std::string_view key, std::string_view value) override;

  const std::string& json() const { return json_; }

 private:
  std::string json_;
};

}  // namespace orbitkv

#endif  // ORBITKV_BASE_STATS_VISITOR_H_
