// The names operators and dashboards read stay exactly as they are: the keys of `orbitkv stats --json` and the
// orbitkv_* metric names of /metrics, from a single-host Manager with an SSD tier and from a distributed one (a
// real etcd, a peer endpoint, an SSD tier), are the sets checked in at tests/integration/stats_keys.txt, and every
// metric the shipped Grafana dashboard reads is among them.
//
// To regenerate the file after a deliberate change: ORBITKV_WRITE_STATS_KEYS=1 ./distributed_stats_keys_test, then
// review the diff (a renamed or dropped name breaks every dashboard and alert built on it).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>

#include "base/temp_dir.h"
#include "cluster/testing/etcd_process.h"
#include "distributed_util.h"
#include "manager_process.h"

namespace orbitkv {
namespace {

using testing::ManagerProcess;
using testing::StatsOf;

using KeySets = std::map<std::string, std::set<std::string>>;  // "<configuration> <json|metrics>" -> names

std::set<std::string> JsonKeys(const std::string& json) {
  std::set<std::string> keys;
  static const std::regex key(R"re("([A-Za-z0-9_]+)":)re");
  for (auto it = std::sregex_iterator(json.begin(), json.end(), key); it != std::sregex_iterator(); ++it) {
    keys.insert((*it)[1].str());
  }
  return keys;
}

std::set<std::string> MetricNames(const std::string& text) {
  std::set<std::string> names;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("orbitkv_", 0) != 0) continue;
    names.insert(line.substr(0, line.find_first_of("{ ")));
  }
  return names;
}

std::string KeysFile() { return std::string(ORBITKV_SOURCE_DIR) + "/tests/integration/stats_keys.txt"; }

KeySets ReadKeysFile() {
  KeySets sets;
  std::ifstream in(KeysFile());
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream fields(line);
    std::string configuration, kind, name;
    fields >> configuration >> kind >> name;
    sets[configuration + " " + kind].insert(name);
  }
  return sets;
}

void WriteKeysFile(const KeySets& sets) {
  std::ofstream out(KeysFile(), std::ios::trunc);
  out << "# The stats JSON keys and orbitkv_* metric names of a running Manager, by configuration "
         "(tests/integration/stats_keys_test.cc).\n"
         "# Generated with ORBITKV_WRITE_STATS_KEYS=1; a change here renames what dashboards and alerts read.\n";
  for (const auto& [set, names] : sets) {
    for (const std::string& name : names) out << set << " " << name << "\n";
  }
}

// Waits until `manager`'s stats satisfy `ready` (10 s), and returns them.
template <typename Ready>
std::string StatsWhen(const ManagerProcess& manager, Ready ready) {
  std::string stats;
  for (int i = 0; i < 500; ++i) {
    stats = StatsOf(manager);
    if (ready(stats)) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return stats;
}

void Collect(const std::string& configuration, const ManagerProcess& manager, uint16_t metrics_port,
             const std::string& stats, KeySets* sets) {
  (*sets)[configuration + " json"] = JsonKeys(stats);
  (*sets)[configuration + " metrics"] = MetricNames(testing::MetricsText(metrics_port));
  EXPECT_FALSE((*sets)[configuration + " json"].empty()) << manager.LogText();
  EXPECT_FALSE((*sets)[configuration + " metrics"].empty()) << manager.LogText();
}

std::string Difference(const std::set<std::string>& want, const std::set<std::string>& got) {
  std::string out;
  for (const std::string& name : want) {
    if (!got.contains(name)) out += "  missing: " + name + "\n";
  }
  for (const std::string& name : got) {
    if (!want.contains(name)) out += "  new:     " + name + "\n";
  }
  return out;
}

TEST(StatsKeysTest, TheJsonKeysAndMetricNamesOfRunningManagersAreTheCheckedInSets) {
  orbitkv::testing::TempDir ssd_dir;
  KeySets got;
  {
    const uint16_t port = testing::FreeLoopbackPort();
    ManagerProcess single(
        {"--metrics-addr", fmt::format("127.0.0.1:{}", port), "--ssd-path", ssd_dir.path(), "--ssd-capacity", "64MiB"},
        "keys-single");
    ASSERT_TRUE(single.running()) << single.LogText();
    Collect("single-host", single, port, StatsOf(single), &got);
  }
  auto etcd = cluster::testing::EtcdProcess::StartSingle(Deadline::After(std::chrono::seconds(60)));
  ASSERT_TRUE(etcd.ok()) << etcd.status();
  orbitkv::testing::TempDir ssd_dir_2;
  {
    const uint16_t port = testing::FreeLoopbackPort();
    ManagerProcess distributed(
        {"--etcd-endpoints", (*etcd)->endpoint(), "--cluster-name", "keys", "--node-id", "node-k", "--catalog-nodes",
         "node-k", "--peer-endpoint", testing::Loopback(), "--metrics-addr", fmt::format("127.0.0.1:{}", port),
         "--ssd-path", ssd_dir_2.path(), "--ssd-capacity", "64MiB"},
        "keys-distributed");
    ASSERT_TRUE(distributed.running()) << distributed.LogText();
    // Steady state: registered with a complete view and every owner stream converged.
    const std::string stats = StatsWhen(distributed, [](const std::string& s) {
      return s.find("\"remote_work\": 1") != std::string::npos &&
             s.find("\"catalog_streams_converged\": 16") != std::string::npos;
    });
    ASSERT_NE(stats.find("\"remote_work\": 1"), std::string::npos) << stats;
    Collect("distributed", distributed, port, stats, &got);
  }
  if (std::getenv("ORBITKV_WRITE_STATS_KEYS") != nullptr) {
    WriteKeysFile(got);
    GTEST_SKIP() << "wrote " << KeysFile() << ": review and commit it";
  }
  const KeySets want = ReadKeysFile();
  ASSERT_FALSE(want.empty()) << "no " << KeysFile();
  for (const auto& [set, names] : want) {
    EXPECT_EQ(Difference(names, got[set]), "") << set << " differs from " << KeysFile();
  }
  for (const auto& [set, names] : got) EXPECT_TRUE(want.contains(set)) << set;

  // Every metric the shipped dashboard reads is exported (a histogram by its _bucket/_sum/_count series).
  std::ifstream dashboard(std::string(ORBITKV_SOURCE_DIR) + "/packaging/grafana/orbitkv.json");
  const std::string text((std::istreambuf_iterator<char>(dashboard)), std::istreambuf_iterator<char>());
  ASSERT_FALSE(text.empty());
  std::set<std::string> exported;
  for (const auto& [set, names] : want) {
    if (set.ends_with(" metrics")) exported.insert(names.begin(), names.end());
  }
  static const std::regex metric(R"(orbitkv_[a-z0-9_]+)");
  size_t read = 0;
  for (auto it = std::sregex_iterator(text.begin(), text.end(), metric); it != std::sregex_iterator(); ++it) {
    ++read;
    EXPECT_TRUE(exported.contains(it->str())) << "the dashboard reads " << it->str() << ", which no Manager exports";
  }
  EXPECT_GT(read, 0u);
}

}  // namespace
}  // namespace orbitkv
