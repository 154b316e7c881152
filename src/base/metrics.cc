#include "base/metrics.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "base/check.h"

namespace orbitkv {
namespace {

// Prometheus floats: +Inf, -Inf, NaN spelled as the format requires; otherwise the shortest round-trip form.
std::string FormatValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  return fmt::format("{}", v);
}

// Label values escape backslash, double quote and newline.
std::string EscapeLabelValue(std::string_view value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

// HELP text escapes backslash and newline.
std::string EscapeHelp(std::string_view help) {
  std::string out;
  for (char c : help) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

// {a="1",b="2"} with an optional extra label appended (used for histogram "le"); empty for no labels.
std::string RenderLabels(const MetricLabels& labels, std::string_view extra_name = {},
                         std::string_view extra_value = {}) {
  if (labels.empty() && extra_name.empty()) return "";
  std::string out = "{";
  bool first = true;
  auto add = [&](std::string_view name, std::string_view value) {
    if (!first) out += ',';
    first = false;
    out += name;
    out += "=\"";
    out += EscapeLabelValue(value);
    out += '"';
  };
  for (const auto& [name, value] : labels) add(name, value);
  if (!extra_name.empty()) add(extra_name, extra_value);
  out += '}';
  return out;
}

bool IsNameChar(char c, bool first, bool allow_colon) {
  bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (allow_colon && c == ':');
  return first ? alpha : alpha || (c >= '0' && c <= '9');
}

}  // namespace

Histogram::Histogram(std::vector<double> upper_bounds)
    : upper_bounds_(std::move(upper_bounds)),
      buckets_(std::make_unique<std::atomic<uint64_t>[]>(upper_bounds_.size() + 1)) {
  ORBITKV_CHECK_MSG(std::is_sorted(upper_bounds_.begin(), upper_bounds_.end()) &&
                        std::adjacent_find(upper_bounds_.begin(), upper_bounds_.end()) == upper_bounds_.end(),
                    "histogram bounds must be strictly increasing");
  for (double b : upper_bounds_) ORBITKV_CHECK_MSG(std::isfinite(b), "histogram bound {} is not finite", b);
}

void Histogram::Observe(double value) {
  // A NaN observation is a caller bug that would poison _sum forever; drop it.
  if (std::isnan(value)) return;
  // First bucket whose bound is >= value ("le" semantics).
  size_t index = std::lower_bound(upper_bounds_.begin(), upper_bounds_.end(), value) - upper_bounds_.begin();
  buckets_[index].fetch_add(1, std::memory_order_relaxed);
  count_.fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(value, std::memory_order_relaxed);
}

std::vector<uint64_t> Histogram::BucketCounts() const {
  std::vector<uint64_t> out(upper_bounds_.size() + 1);
  for (size_t i = 0; i < out.size(); ++i) out[i] = buckets_[i].load(std::memory_order_relaxed);
  return out;
}

std::vector<double> Histogram::ExponentialBounds(double start, double factor, int count) {
  ORBITKV_CHECK(start > 0 && factor > 1 && count > 0);
  std::vector<double> bounds;
  bounds.reserve(count);
  double b = start;
  for (int i = 0; i < count; ++i, b *= factor) bounds.push_back(b);
  return bounds;
}

bool MetricsRegistry::IsValidMetricName(std::string_view name) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    if (!IsNameChar(name[i], i == 0, /*allow_colon=*/true)) return false;
  }
  return true;
}

bool MetricsRegistry::IsValidLabelName(std::string_view name) {
  if (name.empty() || name.starts_with("__")) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    if (!IsNameChar(name[i], i == 0, /*allow_colon=*/false)) return false;
  }
  return true;
}

MetricsRegistry::Family& MetricsRegistry::FamilyFor(std::string_view name, std::string_view help, Type type,
                                                    MetricLabels& labels) {
  ORBITKV_CHECK_MSG(IsValidMetricName(name), "invalid metric name '{}'", name);
  std::sort(labels.begin(), labels.end());
  for (size_t i = 0; i < labels.size(); ++i) {
    ORBITKV_CHECK_MSG(IsValidLabelName(labels[i].first), "metric '{}': invalid label name '{}'", name, labels[i].first);
    ORBITKV_CHECK_MSG(i == 0 || labels[i].first != labels[i - 1].first, "metric '{}': duplicate label '{}'", name,
                      labels[i].first);
    ORBITKV_CHECK_MSG(type != Type::kHistogram || labels[i].first != "le",
                      "metric '{}': histogram label 'le' is reserved", name);
  }
  auto it = families_.find(name);
  if (it == families_.end()) {
    it = families_.emplace(std::string(name), Family{type, std::string(help), {}, {}, {}, {}}).first;
  }
  ORBITKV_CHECK_MSG(it->second.type == type, "metric '{}' already registered with another type", name);
  return it->second;
}

Counter& MetricsRegistry::GetCounter(std::string_view name, std::string_view help, MetricLabels labels) {
  MutexLock lock(&mu_);
  Family& family = FamilyFor(name, help, Type::kCounter, labels);
  auto& slot = family.counters[labels];
  if (!slot) slot = std::make_unique<Counter>();
  return *slot;
}

Gauge& MetricsRegistry::GetGauge(std::string_view name, std::string_view help, MetricLabels labels) {
  MutexLock lock(&mu_);
  Family& family = FamilyFor(name, help, Type::kGauge, labels);
  auto& slot = family.gauges[labels];
  if (!slot) slot = std::make_unique<Gauge>();
  return *slot;
}

Histogram& MetricsRegistry::GetHistogram(std::string_view name, std::string_view help, std::vector<double> upper_bounds,
                                         MetricLabels labels) {
  MutexLock lock(&mu_);
  Family& family = FamilyFor(name, help, Type::kHistogram, labels);
  if (family.histograms.empty()) {
    family.bounds = upper_bounds;
  } else {
    ORBITKV_CHECK_MSG(family.bounds == upper_bounds, "histogram '{}' registered again with other bounds", name);
  }
  auto& slot = family.histograms[labels];
  if (!slot) slot = std::make_unique<Histogram>(std::move(upper_bounds));
  return *slot;
}

namespace {

// The figures collectors name metrics for, by metric name: the type, help and each label set's rendered sample.
struct CollectedFamily {
  bool counter = false;
  std::string help;
  std::map<std::string, std::string> samples;  // rendered labels -> value
};

class PrometheusCollector final : public StatsVisitor {
 public:
  void Counter(std::string_view /*key*/, uint64_t value, const MetricName& metric) override {
    Add(metric, true, fmt::format("{}", value));
  }
  void Gauge(std::string_view /*key*/, int64_t value, const MetricName& metric) override {
    Add(metric, false, fmt::format("{}", value));
  }
  void Real(std::string_view /*key*/, double value, int /*decimals*/, const MetricName& metric) override {
    Add(metric, false, FormatValue(value));
  }
  void Text(std::string_view /*key*/, std::string_view /*value*/) override {}

  std::map<std::string, CollectedFamily, std::less<>>& families() { return families_; }

 private:
  void Add(const MetricName& metric, bool counter, std::string value) {
    if (metric.name.empty()) return;
    ORBITKV_CHECK_MSG(MetricsRegistry::IsValidMetricName(metric.name), "invalid collected metric name");
    auto [it, fresh] = families_.try_emplace(std::string(metric.name));
    if (fresh) {
      it->second.counter = counter;
      it->second.help = std::string(metric.help);
    }
    ORBITKV_CHECK_MSG(it->second.counter == counter, "a collected metric visited as both counter and gauge");
    MetricLabels labels;
    if (!metric.label.empty()) labels.emplace_back(std::string(metric.label), std::string(metric.label_value));
    it->second.samples[RenderLabels(labels)] = std::move(value);
  }

  std::map<std::string, CollectedFamily, std::less<>> families_;
};

}  // namespace

MetricsRegistry::CollectorHandle::~CollectorHandle() {
  MutexLock lock(&registry_->collect_mu_);
  registry_->collectors_.erase(id_);
}

std::unique_ptr<MetricsRegistry::CollectorHandle> MetricsRegistry::AddCollector(
    std::function<void(StatsVisitor&)> collect) {
  MutexLock lock(&collect_mu_);
  const uint64_t id = next_collector_++;
  collectors_.emplace(id, std::move(collect));
  return std::make_unique<CollectorHandle>(this, id);
}

std::string MetricsRegistry::RenderPrometheus() const {
  PrometheusCollector collected;
  {
    MutexLock lock(&collect_mu_);
    for (const auto& [id, collect] : collectors_) collect(collected);
  }
  // Each family's text by name, registered and collected together, so the output stays sorted by name.
  std::map<std::string, std::string, std::less<>> rendered;
  for (const auto& [name, family] : collected.families()) {
    std::string& out = rendered[name];
    out = fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, EscapeHelp(family.help), name,
                      family.counter ? "counter" : "gauge");
    for (const auto& [labels, value] : family.samples) out += fmt::format("{}{} {}\n", name, labels, value);
  }
  MutexLock lock(&mu_);
  for (const auto& [name, family] : families_) {
    ORBITKV_CHECK_MSG(!rendered.contains(name), "a metric is both registered and collected");
    std::string& out = rendered[name];
    std::string_view type_name = family.type == Type::kCounter ? "counter"
                                 : family.type == Type::kGauge ? "gauge"
                                                               : "histogram";
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, EscapeHelp(family.help), name, type_name);
    for (const auto& [labels, counter] : family.counters) {
      out += fmt::format("{}{} {}\n", name, RenderLabels(labels), counter->Value());
    }
    for (const auto& [labels, gauge] : family.gauges) {
      out += fmt::format("{}{} {}\n", name, RenderLabels(labels), FormatValue(gauge->Value()));
    }
    for (const auto& [labels, histogram] : family.histograms) {
      std::vector<uint64_t> counts = histogram->BucketCounts();
      uint64_t cumulative = 0;
      for (size_t i = 0; i < counts.size(); ++i) {
        cumulative += counts[i];
        std::string le = i < family.bounds.size() ? FormatValue(family.bounds[i]) : "+Inf";
        out += fmt::format("{}_bucket{} {}\n", name, RenderLabels(labels, "le", le), cumulative);
      }
      // _count equals the +Inf bucket by construction, so a scrape is always self-consistent.
      out += fmt::format("{}_sum{} {}\n", name, RenderLabels(labels), FormatValue(histogram->Sum()));
      out += fmt::format("{}_count{} {}\n", name, RenderLabels(labels), cumulative);
    }
  }
  std::string out;
  for (const auto& [name, text] : rendered) out += text;
  return out;
}

}  // namespace orbitkv
