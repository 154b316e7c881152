// A real orbitkv-manager joining a cluster registered in a real etcd: membership state, epoch, view
// and the remote-work gate reach `orbitkv status`, and a duplicate Node ID refuses to start.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <chrono>
#include <string>
#include <thread>

#include "client/cache_client.h"
#include "cluster/testing/etcd_process.h"
#include "manager_process.h"

namespace orbitkv {
namespace {

using testing::ManagerProcess;

std::string StatsOf(const ManagerProcess& manager) {
  client::ClientOptions options;
  options.socket_path = manager.socket();
  auto client = client::CacheClient::Connect(options);
  EXPECT_TRUE(client.ok()) << client.status();
  if (!client.ok()) return "";
  auto stats = (*client)->Stats();
  EXPECT_TRUE(stats.ok()) << stats.status();
  return stats.ok() ? *stats : "";
}

TEST(DistributedManagerTest, JoinsTheClusterAndReportsMembership) {
  auto etcd = cluster::testing::EtcdProcess::StartSingle(Deadline::After(std::chrono::seconds(60)));
  ASSERT_TRUE(etcd.ok()) << etcd.status();
  const std::string endpoints = (*etcd)->endpoint();
  ManagerProcess first({"--etcd-endpoints", endpoints, "--cluster-name", "it", "--node-id",
                        "node-a", "--catalog-nodes", "node-a", "--peer-endpoint", "127.0.0.1:7001"},
                       "dist-a");
  ASSERT_TRUE(first.running()) << first.LogText();
  // The view completes asynchronously after the join.
  std::string stats;
  for (int i = 0; i < 500; ++i) {
    stats = StatsOf(first);
    if (stats.find("\"remote_work\": 1") != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_NE(stats.find("\"membership\": \"registered\""), std::string::npos) << stats;
  EXPECT_NE(stats.find("\"membership_epoch\": 1"), std::string::npos) << stats;
  EXPECT_NE(stats.find("\"members\": 1"), std::string::npos) << stats;
  EXPECT_NE(stats.find("\"remote_work\": 1"), std::string::npos) << stats;

  // The same Node ID while the first is live: the second Manager refuses to start.
  ManagerProcess duplicate(
      {"--etcd-endpoints", endpoints, "--cluster-name", "it", "--node-id", "node-a",
       "--catalog-nodes", "node-a", "--peer-endpoint", "127.0.0.1:7002"},
      "dist-dup");
  EXPECT_FALSE(duplicate.running());

  // A graceful stop revokes the lease: the Node ID is free again at once, with a new epoch.
  EXPECT_EQ(first.Stop(SIGTERM), 0);
  ManagerProcess again({"--etcd-endpoints", endpoints, "--cluster-name", "it", "--node-id",
                        "node-a", "--catalog-nodes", "node-a", "--peer-endpoint", "127.0.0.1:7001"},
                       "dist-again");
  ASSERT_TRUE(again.running()) << again.LogText();
  EXPECT_NE(StatsOf(again).find("\"membership_epoch\": 2"), std::string::npos);
}

TEST(DistributedManagerTest, SingleHostModeSaysSo) {
  ManagerProcess manager({}, "single");
  ASSERT_TRUE(manager.running());
  const std::string stats = StatsOf(manager);
  EXPECT_NE(stats.find("\"membership\": \"single-host\""), std::string::npos) << stats;
}

}  // namespace
}  // namespace orbitkv
