#include "base/logging.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

#include "base/check.h"

namespace orbitkv {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class LoggingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = ::testing::TempDir() + "orbitkv_log_" + std::to_string(::getpid()) + ".log";
    std::remove(path_.c_str());
  }
  void TearDown() override {
    ASSERT_TRUE(log::Init(log::Options{}).ok());
    std::remove(path_.c_str());
  }
  std::string path_;
};

TEST_F(LoggingTest, ParsesLevels) {
  EXPECT_EQ(log::ParseLevel("INFO"), log::Level::kInfo);
  EXPECT_EQ(log::ParseLevel("warning"), log::Level::kWarn);
  EXPECT_EQ(log::ParseLevel("off"), log::Level::kOff);
  EXPECT_FALSE(log::ParseLevel("verbose").has_value());
  EXPECT_EQ(log::LevelName(log::Level::kError), "error");
}

TEST_F(LoggingTest, WritesToFileAboveLevelOnly) {
  ASSERT_TRUE(log::Init({.level = log::Level::kInfo, .file = path_, .name = "unit"}).ok());
  ORBITKV_LOG_DEBUG("hidden {}", 1);
  ORBITKV_LOG_INFO("visible {} blocks", 42);
  ORBITKV_LOG_ERROR("bad {}", "thing");
  log::Flush();
  std::string text = ReadFile(path_);
  EXPECT_EQ(text.find("hidden"), std::string::npos);
  EXPECT_NE(text.find("visible 42 blocks"), std::string::npos);
  EXPECT_NE(text.find("error unit"), std::string::npos);
  EXPECT_NE(text.find("logging_test.cc:"), std::string::npos);
}

TEST_F(LoggingTest, DisabledLevelDoesNotEvaluateFormatting) {
  ASSERT_TRUE(log::Init({.level = log::Level::kWarn, .file = path_}).ok());
  int evaluated = 0;
  auto count = [&] { return ++evaluated; };
  ORBITKV_LOG_INFO("x {}", count());
  EXPECT_EQ(evaluated, 0);
  ORBITKV_LOG_WARN("x {}", count());
  EXPECT_EQ(evaluated, 1);
}

TEST_F(LoggingTest, UnopenableFileIsAClearError) {
  Status s = log::Init({.file = "/dev/null/not-a-dir/x.log"});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("/dev/null/not-a-dir/x.log"), std::string_view::npos);
}

TEST(CheckDeathTest, CheckFailureNamesConditionAndMessage) {
  EXPECT_DEATH(ORBITKV_CHECK(1 + 1 == 3), "CHECK failed: 1 \\+ 1 == 3");
  EXPECT_DEATH(ORBITKV_CHECK_MSG(false, "slot {} busy", 7), "slot 7 busy");
}

}  // namespace
}  // namespace orbitkv
