#include "server/config.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "server/options.h"

namespace orbitkv::server {
namespace {

Result<ParsedArgs> Parse(std::vector<std::string> args) {
  args.insert(args.begin(), "orbitkv-manager");
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  return ParseManagerArgs(static_cast<int>(argv.size()), argv.data());
}

TEST(ConfigTest, SizesAcceptSuffixesAndRejectGarbage) {
  EXPECT_EQ(*ParseSize("1048576"), 1048576u);
  EXPECT_EQ(*ParseSize("4GiB"), 4ull << 30);
  EXPECT_EQ(*ParseSize("512m"), 512ull << 20);
  EXPECT_EQ(*ParseSize("2T"), 2ull << 40);
  EXPECT_EQ(ParseSize("GiB").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseSize("4XB").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseSize("99999999999999T").status().code(), StatusCode::kInvalidArgument);
}

TEST(ConfigTest, EmbeddedDefaultsServeOneHost) {
  auto parsed = Parse({});
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  const ManagerConfig& c = parsed->config;
  EXPECT_EQ(c.socket_path, DefaultSocketPath());
  EXPECT_GE(c.dram_bytes, 256ull << 20);
  EXPECT_LE(c.dram_bytes, 32ull << 30);
  EXPECT_EQ(c.numa, "auto");
  EXPECT_FALSE(c.allow_unpinned);
  EXPECT_TRUE(c.metrics_addr.empty());
}

TEST(ConfigTest, OnlyADistributedManagerRecordsItsResidencyInventory) {
  // Nothing reads the inventory of a single-host Manager, so its saves skip that bookkeeping.
  auto single = Parse({});
  ASSERT_TRUE(single.ok()) << single.status();
  EXPECT_FALSE(CacheOptionsFor(single->config).record_inventory);
  auto distributed = Parse({"--etcd-endpoints", "127.0.0.1:2379"});
  ASSERT_TRUE(distributed.ok()) << distributed.status();
  EXPECT_TRUE(CacheOptionsFor(distributed->config).record_inventory);
}

TEST(ConfigTest, OrbitkvSocketNamesTheDefaultSocketOfManagerAndEngines) {
  const char* before = std::getenv("ORBITKV_SOCKET");
  const std::string saved = before == nullptr ? "" : before;
  ASSERT_EQ(setenv("ORBITKV_SOCKET", "/run/orbitkv/manager.sock", 1), 0);
  auto parsed = Parse({});
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->config.socket_path, "/run/orbitkv/manager.sock");
  EXPECT_EQ(Parse({"--socket", "/tmp/flag.sock"})->config.socket_path,
            "/tmp/flag.sock");                    // a flag wins
  ASSERT_EQ(setenv("ORBITKV_SOCKET", "", 1), 0);  // empty: as if unset
  EXPECT_NE(Parse({})->config.socket_path, "");
  EXPECT_NE(Parse({})->config.socket_path, "/run/orbitkv/manager.sock");
  if (before == nullptr) {
    unsetenv("ORBITKV_SOCKET");
  } else {
    setenv("ORBITKV_SOCKET", saved.c_str(), 1);
  }
}

TEST(ConfigTest, GpusNamesAllNoneOrCudaOrdinals) {
  EXPECT_FALSE(Parse({})->config.gpus.has_value());  // default: every visible GPU
  EXPECT_FALSE(Parse({"--gpus", "all"})->config.gpus.has_value());
  auto none = Parse({"--gpus", "none"});
  ASSERT_TRUE(none.ok()) << none.status();
  ASSERT_TRUE(none->config.gpus.has_value());
  EXPECT_TRUE(none->config.gpus->empty());
  auto two = Parse({"--gpus=1,0"});
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_EQ(*two->config.gpus, (std::vector<int>{1, 0}));
  for (const char* bad : {"", "0,", "-1", "0,0", "gpu0", "1.5"}) {
    auto parsed = Parse({"--gpus", bad});
    ASSERT_FALSE(parsed.ok()) << bad;
    EXPECT_NE(parsed.status().message().find("--gpus"), std::string::npos) << parsed.status();
  }
}

TEST(ConfigTest, CheckConfigValidatesWithoutStopping) {
  auto parsed = Parse({"--check-config", "--dram", "1GiB"});
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_TRUE(parsed->check_config);
  EXPECT_EQ(parsed->config.dram_bytes, 1ull << 30);
  EXPECT_FALSE(Parse({"--check-config", "--dram", "lots"}).ok());  // a bad value is still an error
}

TEST(ConfigTest, FlagsInBothSpellings) {
  auto parsed = Parse({"--dram", "1GiB", "--socket=/tmp/x.sock", "--allow-unpinned", "--allow-uid", "1001,1002",
                       "--log-level", "debug", "--copy-threads=4", "--metrics-addr", "127.0.0.1:0"});
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  const ManagerConfig& c = parsed->config;
  EXPECT_EQ(c.dram_bytes, 1ull << 30);
  EXPECT_EQ(c.socket_path, "/tmp/x.sock");
  EXPECT_TRUE(c.allow_unpinned);
  EXPECT_EQ(c.allowed_uids, (std::vector<uid_t>{1001, 1002}));
  EXPECT_EQ(c.log_level, log::Level::kDebug);
  EXPECT_EQ(c.copy_threads, 4u);
  EXPECT_EQ(c.metrics_addr, "127.0.0.1:0");
}

TEST(ConfigTest, ErrorsNameTheFlag) {
  auto unknown = Parse({"--no-such-flag"});
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("no-such-flag"), std::string::npos);
  auto bad = Parse({"--copy-threads", "0"});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().ToString().find("--copy-threads"), std::string::npos);
  EXPECT_FALSE(Parse({"--dram"}).ok());
  EXPECT_FALSE(Parse({"--numa", "north"}).ok());
  EXPECT_FALSE(Parse({"--slot-bytes", "5000"}).ok());
  EXPECT_FALSE(Parse({"positional"}).ok());
  auto staging = Parse({"--gpu-restore-staging", "20KiB"});
  ASSERT_FALSE(staging.ok());
  EXPECT_NE(staging.status().ToString().find("multiple of 16KiB"), std::string::npos);
  auto ring = Parse({"--gpu-restore-staging", "256MiB"});
  ASSERT_TRUE(ring.ok()) << ring.status();
  EXPECT_EQ(ring->config.gpu_restore_staging_bytes, uint64_t{256} << 20);
  EXPECT_EQ(Parse({})->config.gpu_restore_staging_bytes, uint64_t{64} << 20);
  EXPECT_EQ(Parse({"--gpu-restore-staging", "0"})->config.gpu_restore_staging_bytes, 0u);
  EXPECT_TRUE(Parse({"--help"})->help);
  EXPECT_EQ(Parse({})->config.remote_fetch_workers, 4u);
  EXPECT_EQ(Parse({"--remote-fetch-workers", "8"})->config.remote_fetch_workers, 8u);
  auto workers = Parse({"--remote-fetch-workers", "0"});
  ASSERT_FALSE(workers.ok());
  EXPECT_NE(workers.status().ToString().find("--remote-fetch-workers"), std::string::npos);
  EXPECT_FALSE(Parse({"--remote-fetch-workers", "65"}).ok());
}

TEST(ConfigTest, TomlFileUsesTheFlagNamesAndFlagsWin) {
  const std::string path = fmt::format("/tmp/orbitkv-config-test-{}.toml", getpid());
  {
    std::ofstream out(path);
    out << "dram = \"2GiB\"\nallow-unpinned = true\ncopy-threads = 3\nallow-uid = [7, "
           "8]\nlog-level = \"warn\"\n";
  }
  auto parsed = Parse({"--config", path, "--copy-threads", "5"});
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->config.dram_bytes, 2ull << 30);
  EXPECT_TRUE(parsed->config.allow_unpinned);
  EXPECT_EQ(parsed->config.copy_threads, 5u);
  EXPECT_EQ(parsed->config.allowed_uids, (std::vector<uid_t>{7, 8}));
  EXPECT_EQ(parsed->config.log_level, log::Level::kWarn);
  {
    std::ofstream out(path);
    out << "dram = \"2GiB\"\nfrobnicate = 1\n";
  }
  auto unknown = Parse({"--config", path});
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("frobnicate"), std::string::npos);
  {
    std::ofstream out(path);
    out << "dram = \n";
  }
  auto syntax = Parse({"--config", path});
  ASSERT_FALSE(syntax.ok());
  EXPECT_NE(syntax.status().message().find("line 1"), std::string::npos);
  EXPECT_FALSE(Parse({"--config", "/nonexistent/orbitkv.toml"}).ok());
  unlink(path.c_str());
}

TEST(ConfigTest, HelpDocumentsEveryFlag) {
  const std::string help = ManagerHelp();
  for (const char* flag : {"--socket", "--dram", "--numa", "--allow-unpinned", "--query-budget",
                           "--query-instance-budget", "--transfer-budget", "--metrics-addr", "--log-level", "--config",
                           "--allow-uid", "--copy-threads", "--max-operations", "--gpu-restore-staging"}) {
    EXPECT_NE(help.find(flag), std::string::npos) << flag;
  }
}

}  // namespace
}  // namespace orbitkv::server
