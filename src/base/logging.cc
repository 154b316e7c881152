#include "base/logging.h"

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <memory>

#include "base/check.h"
#include "base/mutex.h"

namespace orbitkv::log {
namespace {

// Relaxed: the level is a filter; a thread seeing a level change slightly late is harmless.
std::atomic<Level> g_level{Level::kInfo};

Mutex g_logger_mu;
// The pointer is guarded, not the logger (spdlog loggers are thread-safe).
std::shared_ptr<spdlog::logger> g_logger GUARDED_BY(g_logger_mu);

spdlog::level::level_enum ToSpd(Level level) {
  switch (level) {
    case Level::kTrace:
      return spdlog::level::trace;
    case Level::kDebug:
      return spdlog::level::debug;
    case Level::kInfo:
      return spdlog::level::info;
    case Level::kWarn:
      return spdlog::level::warn;
    case Level::kError:
      return spdlog::level::err;
    case Level::kCritical:
      return spdlog::level::critical;
    case Level::kOff:
      return spdlog::level::off;
  }
  return spdlog::level::info;
}

std::shared_ptr<spdlog::logger> MakeLogger(const Options& options) {
  std::shared_ptr<spdlog::logger> logger;
  if (options.file.empty()) {
    logger = std::make_shared<spdlog::logger>(options.name, std::make_shared<spdlog::sinks::stderr_sink_mt>());
  } else {
    logger = std::make_shared<spdlog::logger>(
        options.name, std::make_shared<spdlog::sinks::basic_file_sink_mt>(options.file, /*truncate=*/false));
  }
  // ISO-8601 time with microseconds, level, component name, thread id, source location, message.
  logger->set_pattern("%Y-%m-%dT%H:%M:%S.%f %l %n [%t] %v");
  logger->set_level(spdlog::level::trace);  // Filtering happens in Enabled() before formatting.
  logger->flush_on(spdlog::level::warn);
  return logger;
}

std::shared_ptr<spdlog::logger> Logger() {
  MutexLock lock(&g_logger_mu);
  if (!g_logger) g_logger = MakeLogger(Options{});
  return g_logger;
}

const char* Basename(const char* path) {
  const char* base = path;
  for (const char* p = path; *p; ++p) {
    if (*p == '/') base = p + 1;
  }
  return base;
}

}  // namespace

std::optional<Level> ParseLevel(std::string_view text) {
  std::string lower(text);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (lower == "trace") return Level::kTrace;
  if (lower == "debug") return Level::kDebug;
  if (lower == "info") return Level::kInfo;
  if (lower == "warn" || lower == "warning") return Level::kWarn;
  if (lower == "error") return Level::kError;
  if (lower == "critical") return Level::kCritical;
  if (lower == "off") return Level::kOff;
  return std::nullopt;
}

std::string_view LevelName(Level level) {
  switch (level) {
    case Level::kTrace:
      return "trace";
    case Level::kDebug:
      return "debug";
    case Level::kInfo:
      return "info";
    case Level::kWarn:
      return "warn";
    case Level::kError:
      return "error";
    case Level::kCritical:
      return "critical";
    case Level::kOff:
      return "off";
  }
  return "unknown";
}

Status Init(const Options& options) {
  std::shared_ptr<spdlog::logger> logger;
  try {
    // spdlog reports an unopenable file by throwing; this is the one place OrbitKV meets an exception.
    logger = MakeLogger(options);
  } catch (const spdlog::spdlog_ex& e) {
    return Status::InvalidArgument(fmt::format("cannot open log file '{}': {}", options.file, e.what()));
  }
  {
    MutexLock lock(&g_logger_mu);
    if (g_logger) g_logger->flush();
    g_logger = std::move(logger);
  }
  SetLevel(options.level);
  return Status::Ok();
}

void SetLevel(Level level) { g_level.store(level, std::memory_order_relaxed); }
Level GetLevel() { return g_level.load(std::memory_order_relaxed); }
bool Enabled(Level level) { return level != Level::kOff && level >= g_level.load(std::memory_order_relaxed); }

void Flush() { Logger()->flush(); }

void Write(Level level, const char* file, int line, std::string_view message) {
  Logger()->log(ToSpd(level), "{}:{} {}", Basename(file), line, message);
}

}  // namespace orbitkv::log

namespace orbitkv::internal {

void CheckFailed(const char* file, int line, const char* condition, std::string_view message) {
  log::Write(log::Level::kCritical, file, line,
             message.empty() ? fmt::format("CHECK failed: {}", condition)
                             : fmt::format("CHECK failed: {}: {}", condition, message));
  log::Flush();
  std::abort();
}

}  // namespace orbitkv::internal
