// A crash says where: std::terminate (what "pure virtual method called" ends in) and a fatal signal write the
// process's name, what happened and a stack to stderr, and the process still dies of it.
#include "base/crash_report.h"

#include <gtest/gtest.h>
#include <signal.h>

#include <exception>

namespace orbitkv {
namespace {

bool UnderSanitizer() {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  return true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
  return true;
#else
  return false;
#endif
#else
  return false;
#endif
}

TEST(CrashReportDeathTest, TerminateAndFatalSignalsWriteTheStack) {
  if (UnderSanitizer()) GTEST_SKIP() << "the sanitizers report crashes themselves; the report is not installed";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        InstallCrashReport("crash-test");
        std::terminate();
      },
      "crash-test: terminate \\(an uncaught exception, or a pure virtual call\\); stack:");
  EXPECT_EXIT(
      {
        InstallCrashReport("crash-test");
        raise(SIGSEGV);
      },
      ::testing::KilledBySignal(SIGSEGV), "crash-test: fatal signal Segmentation fault; stack:");
}

}  // namespace
}  // namespace orbitkv
