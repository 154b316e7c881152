#include "bench_report.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>

namespace orbitkv::bench {
namespace {

std::string JsonString(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          out += fmt::format("\\u{:04x}", c);
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

std::string JsonNumber(double v) { return std::isfinite(v) ? fmt::format("{}", v) : "null"; }

double Ratio(const BenchResult& r) { return r.baseline != 0 ? r.value / r.baseline : NAN; }

}  // namespace

std::string BenchReport::ToJson() const {
  std::string out = fmt::format("{{\"bench\": {}, \"results\": [", JsonString(name_));
  for (size_t i = 0; i < results_.size(); ++i) {
    const BenchResult& r = results_[i];
    out += fmt::format(
        "{}{{\"metric\": {}, \"unit\": {}, \"value\": {}, \"baseline_metric\": {}, \"baseline\": {}, \"ratio\": {}}}",
        i ? ", " : "", JsonString(r.metric), JsonString(r.unit), JsonNumber(r.value), JsonString(r.baseline_metric),
        JsonNumber(r.baseline), JsonNumber(Ratio(r)));
  }
  out += "], \"env\": {";
  for (size_t i = 0; i < env_.size(); ++i) {
    out += fmt::format("{}{}: {}", i ? ", " : "", JsonString(env_[i].first), JsonString(env_[i].second));
  }
  return out + "}}";
}

std::string BenchReport::ToTable() const {
  std::string out = fmt::format("benchmark: {}\n", name_);
  out += fmt::format("{:<36} {:>14} {:<10} {:<30} {:>14} {:>7}\n", "metric", "value", "unit", "baseline", "value",
                     "ratio");
  for (const BenchResult& r : results_) {
    out += fmt::format("{:<36} {:>14.4g} {:<10} {:<30} {:>14.4g} {:>7.3f}\n", r.metric, r.value, r.unit,
                       r.baseline_metric, r.baseline, Ratio(r));
  }
  for (const auto& [k, v] : env_) out += fmt::format("  {}: {}\n", k, v);
  return out;
}

void BenchReport::Print(bool json) const {
  std::string text = json ? ToJson() + "\n" : ToTable();
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fflush(stdout);
}

bool ParseBenchArgs(int argc, char** argv, std::string_view description) {
  bool json = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--json") == 0) {
      json = true;
    } else if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) {
      fmt::print("{}\n\nUsage: {} [--json]\n", description, argv[0]);
      std::exit(0);
    } else {
      fmt::print(stderr, "{}: unknown argument '{}' (usage: [--json])\n", argv[0], argv[i]);
      std::exit(2);
    }
  }
  return json;
}

void AddStandardEnv(BenchReport& report) {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  report.AddEnv("host", host);
  report.AddEnv("cpus", std::to_string(::sysconf(_SC_NPROCESSORS_ONLN)));
#if defined(__clang__)
  report.AddEnv("compiler", fmt::format("clang {}", __clang_version__));
#elif defined(__GNUC__)
  report.AddEnv("compiler", fmt::format("gcc {}.{}.{}", __GNUC__, __GNUC_MINOR__, __GNUC_PATCHLEVEL__));
#endif
#ifdef NDEBUG
  report.AddEnv("build", "optimized");
#else
  report.AddEnv("build", "debug");
#endif
}

}  // namespace orbitkv::bench
