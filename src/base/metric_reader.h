// MetricReader: the value a part visits for one metric series (stats_visitor.h).
//
// Thread safety: one thread at a time, like any visitor.
#ifndef ORBITKV_BASE_METRIC_READER_H_
#define ORBITKV_BASE_METRIC_READER_H_

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>

#include "base/stats_visitor.h"

namespace orbitkv {

// The value visited for one metric series: its name and, for a labelled one, the label's value. For a caller that
// wants one figure (a test, say); NaN when it was not visited.
class MetricReader final : public StatsVisitor {
 public:
  explicit MetricReader(std::string_view name, std::string_view label_value = {})
      : name_(name), label_value_(label_value) {}
  void Counter(std::string_view /*key*/, uint64_t value, const MetricName& metric = {}) override {
    Take(metric, static_cast<double>(value));
  }
  void Gauge(std::string_view /*key*/, int64_t value, const MetricName& metric = {}) override {
    Take(metric, static_cast<double>(value));
  }
  void Real(std::string_view /*key*/, double value, int /*decimals*/, const MetricName& metric = {}) override {
    Take(metric, value);
  }
  void Text(std::string_view /*key*/, std::string_view /*value*/) override {}

  double value() const { return value_; }

 private:
  void Take(const MetricName& metric, double value) {
    if (metric.name == name_ && metric.label_value == label_value_) value_ = value;
  }

  const std::string name_;
  const std::string label_value_;
  double value_ = std::numeric_limits<double>::quiet_NaN();
};

}  // namespace orbitkv

#endif  // ORBITKV_BASE_METRIC_READER_H_
