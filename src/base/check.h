// CHECK: the crash for a broken invariant. Data-path errors are a Status; a CHECK failure means OrbitKV's own
// logic is wrong, so it logs the condition and location, flushes the log and aborts.
#ifndef ORBITKV_BASE_CHECK_H_
#define ORBITKV_BASE_CHECK_H_

#include <fmt/format.h>

#include <string_view>

namespace orbitkv::internal {
[[noreturn]] void CheckFailed(const char* file, int line, const char* condition, std::string_view message);
}  // namespace orbitkv::internal

#define ORBITKV_CHECK(cond)                                            \
  do {                                                                 \
    if (!(cond)) [[unlikely]]                                          \
      ::orbitkv::internal::CheckFailed(__FILE__, __LINE__, #cond, {}); \
  } while (false)

// ORBITKV_CHECK_MSG(cond, "fmt {}", args...): the message is formatted only on failure.
#define ORBITKV_CHECK_MSG(cond, ...)                                                           \
  do {                                                                                         \
    if (!(cond)) [[unlikely]]                                                                  \
      ::orbitkv::internal::CheckFailed(__FILE__, __LINE__, #cond, ::fmt::format(__VA_ARGS__)); \
  } while (false)

#ifdef NDEBUG
#define ORBITKV_DCHECK(cond) \
  do {                       \
  } while (false && (cond))
#else
#define ORBITKV_DCHECK(cond) ORBITKV_CHECK(cond)
#endif

#endif  // ORBITKV_BASE_CHECK_H_
