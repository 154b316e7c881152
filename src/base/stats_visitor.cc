#include "base/stats_visitor.h"

#include <fmt/format.h>

#include "base/json_text.h"

namespace orbitkv {

void JsonStatsWriter::Counter(std::string_view key, uint64_t value, const MetricName& /*metric*/) {
  if (!key.empty()) json_ += fmt::format(", \"{}\": {}", key, value);
}

void JsonStatsWriter::Gauge(std::string_view key, int64_t value, const MetricName& /*metric*/) {
  if (!key.empty()) json_ += fmt::format(", \"{}\": {}", key, value);
}

void JsonStatsWriter::Real(std::string_view key, double value, int decimals, const MetricName& /*metric*/) {
  if (!key.empty()) json_ += fmt::format(", \"{}\": {:.{}f}", key, value, decimals);
}

void JsonStatsWriter::Text(std::string_view key, std::string_view value) {
  if (!key.empty()) json_ += fmt::format(", \"{}\": \"{}\"", key, JsonText(value));
}

}  // namespace orbitkv
