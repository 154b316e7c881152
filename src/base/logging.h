// The logging facade. Everything in OrbitKV logs through these macros; only logging.cc includes spdlog.
//
//   ORBITKV_LOG_INFO("restored {} blocks in {} us", n, us);
//
// Arguments are formatted (fmt syntax) only when the level is enabled, so a disabled debug line costs one relaxed
// atomic load. Nothing is logged per block on hot paths (STYLE.md §4): count with metrics instead.
//
// Thread safety: every function is safe to call from any thread. Init() is meant for process start.
#ifndef ORBITKV_BASE_LOGGING_H_
#define ORBITKV_BASE_LOGGING_H_

#include <fmt/format.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "base/status.h"

namespace orbitkv::log {

enum class Level : uint8_t { kTrace = 0, kDebug, kInfo, kWarn, kError, kCritical, kOff };

// "trace", "debug", "info", "warn" (or "warning"), "error", "critical", "off"; case-insensitive.
std::optional<Level> ParseLevel(std::string_view text);
std::string_view LevelName(Level level);

struct Options {
  Level level = Level::kInfo;
  // Empty: stderr. Otherwise lines are appended to this file.
  std::string file;
  // Prefix for every line, e.g. "manager" or "engine-3".
  std::string name = "orbitkv";
};

// Replaces the process logger. Fails with a clear status when the file cannot be opened; the previous logger
// then stays in place.
Status Init(const Options& options);

void SetLevel(Level level);
Level GetLevel();
bool Enabled(Level level);

// Flushes buffered lines (also done on CHECK failure and at exit).
void Flush();

void Write(Level level, const char* file, int line, std::string_view message);

}  // namespace orbitkv::log

#define ORBITKV_LOG(level, ...)                                                                                       \
  do {                                                                                                                \
    if (::orbitkv::log::Enabled(level)) ::orbitkv::log::Write(level, __FILE__, __LINE__, ::fmt::format(__VA_ARGS__)); \
  } while (false)

#define ORBITKV_LOG_TRACE(...) ORBITKV_LOG(::orbitkv::log::Level::kTrace, __VA_ARGS__)
#define ORBITKV_LOG_DEBUG(...) ORBITKV_LOG(::orbitkv::log::Level::kDebug, __VA_ARGS__)
#define ORBITKV_LOG_INFO(...) ORBITKV_LOG(::orbitkv::log::Level::kInfo, __VA_ARGS__)
#define ORBITKV_LOG_WARN(...) ORBITKV_LOG(::orbitkv::log::Level::kWarn, __VA_ARGS__)
#define ORBITKV_LOG_ERROR(...) ORBITKV_LOG(::orbitkv::log::Level::kError, __VA_ARGS__)

#endif  // ORBITKV_BASE_LOGGING_H_
