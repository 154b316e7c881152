// A crash says where: std::terminate (what "pure virtual method called" ends in) and a fatal signal write the
// process's name, what happened and a stack to stderr, and the process still dies of it. Under a sanitizer the
// signal is the sanitizer's to report, and still is after InstallCrashReport.
#include "base/crash_report.h"

#include <gtest/gtest.h>
#include <signal.h>

#include <exception>

namespace orbitkv {
namespace {

TEST(CrashReportDeathTest, TerminateWritesTheStack) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        InstallCrashReport("crash-test");
        std::terminate();
      },
      "crash-test: terminate \\(an uncaught exception, or a pure virtual call\\); stack:");
}

TEST(CrashReportDeathTest, AFatalSignalWritesTheStack) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  if (SanitizerReportsSignals()) {
    EXPECT_DEATH(
        {
          InstallCrashReport("crash-test");
          raise(SIGSEGV);
        },
        "Sanitizer");
    return;
  }
  EXPECT_EXIT(
      {
        InstallCrashReport("crash-test");
        raise(SIGSEGV);
      },
      ::testing::KilledBySignal(SIGSEGV), "crash-test: fatal signal Segmentation fault; stack:");
}

}  // namespace
}  // namespace orbitkv
