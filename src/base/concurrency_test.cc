// Concurrency tests for base: run in every suite and again under ThreadSanitizer in CI (label "concurrency").
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "base/logging.h"
#include "base/metrics.h"

namespace orbitkv {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(MetricsConcurrencyTest, IncrementsRegistrationsAndScrapesRace) {
  MetricsRegistry r;
  constexpr int kThreads = 4;
  constexpr int kPerThread = 20000;
  std::atomic<bool> done{false};
  // A scraper renders while writers register and update: every scrape must be self-consistent.
  std::thread scraper([&] {
    while (!done.load(std::memory_order_acquire)) {
      // Parse the histogram of each scrape: buckets never decrease and _count equals the +Inf bucket.
      std::istringstream text(r.RenderPrometheus());
      std::string line;
      uint64_t le1 = 0, inf = 0, count = 0;
      bool seen = false;
      while (std::getline(text, line)) {
        auto value = [&line] { return std::stoull(line.substr(line.rfind(' ') + 1)); };
        if (line.starts_with("v_bucket{le=\"1\"}")) le1 = value(), seen = true;
        if (line.starts_with("v_bucket{le=\"+Inf\"}")) inf = value();
        if (line.starts_with("v_count ")) count = value();
      }
      if (seen) {
        EXPECT_LE(le1, inf);
        EXPECT_EQ(inf, count);
      }
    }
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&r, t] {
      for (int i = 0; i < kPerThread; ++i) {
        r.GetCounter("ops_total", "ops").Increment();
        r.GetHistogram("v", "v", {1}).Observe(0.5);
        r.GetGauge("g", "g", {{"thread", std::to_string(t)}}).Add(1);
      }
    });
  }
  for (auto& t : threads) t.join();
  done.store(true, std::memory_order_release);
  scraper.join();
  EXPECT_EQ(r.GetCounter("ops_total", "ops").Value(), uint64_t{kThreads} * kPerThread);
  EXPECT_EQ(r.GetHistogram("v", "v", {1}).Count(), uint64_t{kThreads} * kPerThread);
  EXPECT_THAT(r.RenderPrometheus(), HasSubstr("v_bucket{le=\"1\"} 80000\n"));
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_DOUBLE_EQ(r.GetGauge("g", "g", {{"thread", std::to_string(t)}}).Value(), kPerThread);
  }
}

TEST(LoggingConcurrencyTest, LoggingWhileTheLoggerIsReplacedLosesNoLine) {
  // One file per Init so that no two stdio buffers append to the same file (which could split a line).
  constexpr int kInits = 20;
  auto path = [](int i) {
    return ::testing::TempDir() + "orbitkv_log_race_" + std::to_string(::getpid()) + "_" + std::to_string(i) + ".log";
  };
  for (int i = 0; i <= kInits; ++i) std::remove(path(i).c_str());
  ASSERT_TRUE(log::Init({.level = log::Level::kInfo, .file = path(0)}).ok());
  constexpr int kThreads = 3;
  constexpr int kLines = 500;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([t] {
      for (int i = 0; i < kLines; ++i) ORBITKV_LOG_INFO("thread {} line {}", t, i);
    });
  }
  // Replace the logger while the writers run.
  for (int i = 1; i <= kInits; ++i) ASSERT_TRUE(log::Init({.level = log::Level::kInfo, .file = path(i)}).ok());
  for (auto& t : threads) t.join();
  log::Flush();
  ASSERT_TRUE(log::Init(log::Options{}).ok());
  int count = 0;
  for (int i = 0; i <= kInits; ++i) {
    std::ifstream in(path(i));
    std::stringstream ss;
    ss << in.rdbuf();
    std::string text = ss.str();
    for (size_t pos = text.find(" line "); pos != std::string::npos; pos = text.find(" line ", pos + 1)) ++count;
    std::remove(path(i).c_str());
  }
  EXPECT_EQ(count, kThreads * kLines);
}

}  // namespace
}  // namespace orbitkv
