// The mesh fixture the distributed suites share (mesh_test.cc, mesh_recovery_test.cc): n hosts in network
// namespaces on one bridge (NetnsMesh), a real etcd on the bridge, Managers started per test, and the checks the
// suites read their stats with.
#ifndef ORBITKV_TESTS_INTEGRATION_MESH_FIXTURE_H_
#define ORBITKV_TESTS_INTEGRATION_MESH_FIXTURE_H_

#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "catalog/peer_service.h"  // first of the gRPC users (cluster/grpc.h)

#include "cluster/testing/etcd_process.h"
#include "distributed_util.h"
#include "engine_kv.h"
#include "netns_mesh.h"

namespace orbitkv::mesh_testing {

using ::orbitkv::testing::Health;
using ::orbitkv::testing::ManagerProcess;
using ::orbitkv::testing::NetnsMesh;
using ::orbitkv::testing::RecordOf;
using ::orbitkv::testing::StatsOf;
using ::orbitkv::testing::StringField;

inline constexpr int kHosts = 3;

class MeshTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto mesh = NetnsMesh::Create(hosts_);
    if (!mesh.ok() && mesh.status().code() == StatusCode::kFailedPrecondition) {
      GTEST_SKIP() << mesh.status() << " (CI runs this as root)";
    }
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    mesh_ = std::move(*mesh);
    auto etcd =
        cluster::testing::EtcdProcess::StartSingle(Deadline::After(std::chrono::seconds(60)), NetnsMesh::kRootAddress);
    ASSERT_TRUE(etcd.ok()) << etcd.status();
    etcd_ = std::move(*etcd);
  }

  std::string Node(int i) const { return fmt::format("node-{}", i); }
  std::string PeerEndpoint(int i) const { return mesh_->address(i) + ":7070"; }

  // Manager i on host i: pool sized for the test, one copy thread, short membership TTL, UCX on the veth.
  std::unique_ptr<ManagerProcess> StartManager(int i, const std::string& tag, std::vector<std::string> extra = {}) {
    std::vector<std::string> flags = {
        "--etcd-endpoints",
        etcd_endpoints_.empty() ? etcd_->endpoint_on(NetnsMesh::kRootAddress) : etcd_endpoints_,
        "--cluster-name",
        "mesh",
        "--node-id",
        Node(i),
        "--catalog-nodes",
        catalog_nodes_,
        "--catalog-replicas",
        catalog_replicas_,
        "--membership-ttl-secs",
        "3",
        "--peer-endpoint",
        PeerEndpoint(i),
        "--dram",
        "256MiB",
        "--copy-threads",
        "1"};
    for (const std::string& f : mesh_->TransferFlags(i)) flags.push_back(f);
    flags.insert(flags.end(), extra.begin(), extra.end());
    return std::make_unique<ManagerProcess>(flags, tag, mesh_->launcher(i));
  }

  // Stats of `manager` once `needle` shows in them (or the last ones after about 15 s).
  static std::string StatsWhen(const ManagerProcess& manager, const std::string& needle) {
    std::string stats;
    for (int i = 0; i < 750; ++i) {
      stats = StatsOf(manager);
      if (stats.find(needle) != std::string::npos) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return stats;
  }

  // Managers 0..n-1 on hosts 0..n-1 (StartManager with `extra`, tags TAG-i) into `managers`; fails with the log of
  // the first that does not run.
  ::testing::AssertionResult StartManagers(int n, const std::string& tag,
                                           std::vector<std::unique_ptr<ManagerProcess>>* managers,
                                           const std::vector<std::string>& extra = {}) {
    for (int i = 0; i < n; ++i) {
      managers->push_back(StartManager(i, fmt::format("{}-{}", tag, i), extra));
      if (!managers->back()->running()) {
        return ::testing::AssertionFailure() << Node(i) << " did not start: " << managers->back()->LogText();
      }
    }
    return ::testing::AssertionSuccess();
  }

  // The Managers a check looks at.
  static std::vector<const ManagerProcess*> All(const std::vector<std::unique_ptr<ManagerProcess>>& managers) {
    std::vector<const ManagerProcess*> out;
    for (const auto& m : managers) out.push_back(m.get());
    return out;
  }

  // The member view a requester played by the test routes by: the hosts' records as etcd holds them now.
  void InstallMembers(cluster::MemberView* view) const {
    std::map<std::string, cluster::Member> members;
    for (int i = 0; i < kHosts; ++i) {
      cluster::Member m;
      m.record = RecordOf(etcd_->endpoint(), Node(i), "mesh");
      members.emplace(Node(i), m);
    }
    view->Install(std::move(members), 1);
  }

  int hosts_ = kHosts;  // hosts of the mesh (a fixture for more sets it before SetUp)
  std::unique_ptr<NetnsMesh> mesh_;
  std::unique_ptr<cluster::testing::EtcdProcess> etcd_;
  std::string catalog_nodes_ = "node-0,node-1,node-2";
  std::string etcd_endpoints_;          // --etcd-endpoints of the Managers; empty: the fixture's single etcd
  std::string catalog_replicas_ = "3";  // --catalog-replicas (the default)
};

inline uint64_t Field(const std::string& stats, const std::string& name) {
  const size_t at = stats.find("\"" + name + "\": ");
  return at == std::string::npos ? 0 : std::stoull(stats.substr(at + name.size() + 4));
}

// Returns once `manager` started a remote stage (or after about a second): a fault injected next lands mid-fetch.
inline void AwaitRemoteFetch(const ManagerProcess& manager) {
  for (int i = 0; i < 4000 && Field(StatsOf(manager), "remote_fetches") == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::microseconds(250));
  }
}

// Every copy of every shard holds what its owners hold: the records over all catalog hosts equal the records of
// all live owners' inventories times the copies a shard has (issue 54), and every owner stream (one per shard and
// copy) follows with deltas. Within `tries` x 20 ms.
inline ::testing::AssertionResult CatalogsEqualInventories(const std::vector<const ManagerProcess*>& managers,
                                                           int tries = 1500) {
  std::string last;
  for (int i = 0; i < tries; ++i) {
    uint64_t catalog = 0, inventory = 0, streaming = 0, incomplete = 0, replicas = 0;
    last.clear();
    for (const ManagerProcess* m : managers) {
      const std::string stats = StatsOf(*m);
      catalog += Field(stats, "catalog_records");
      inventory += Field(stats, "inventory_records");
      streaming += Field(stats, "catalog_streams_streaming");
      incomplete += Field(stats, "catalog_incomplete_shards");
      replicas = Field(stats, "catalog_replicas");
      last += fmt::format("[records {} of inventory {}, streaming {}, incomplete {}] ", Field(stats, "catalog_records"),
                          Field(stats, "inventory_records"), Field(stats, "catalog_streams_streaming"),
                          Field(stats, "catalog_incomplete_shards"));
    }
    if (catalog == replicas * inventory && streaming == 16 * replicas * managers.size() && incomplete == 0 &&
        inventory > 0) {
      return ::testing::AssertionSuccess() << last;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return ::testing::AssertionFailure() << "catalogs never equalled the inventories: " << last;
}

// An engine on one Manager: KV memory of `pages` pages (EngineKv) registered as group 0 of `instance`, in the
// sample namespace every engine of the tests shares (the same model on every host).
struct MeshEngine {
  MeshEngine(const ManagerProcess& manager, uint64_t id, uint32_t pages) : kv(pages), instance(id) {
    client = testing::Connect(manager);
    EXPECT_TRUE(client->RegisterInstance(instance, state::testing::SampleNamespace()).ok());
    EXPECT_TRUE(client->RegisterGroup(instance, 0, pages, kv.Specs()).ok());
  }
  // Queries `keys` (waiting out Loading) and restores the hit into poisoned pages 0..; returns the hits, and how
  // many of them hold exactly their key's bytes.
  std::pair<size_t, size_t> QueryAndRestore(const std::vector<state::StateKey>& keys) {
    kv.Poison();
    auto hit = client->QueryWait(instance, 0, keys, std::chrono::seconds(20));
    EXPECT_TRUE(hit.ok()) << hit.status();
    if (!hit.ok() || hit->hits == 0) return {0, 0};
    std::vector<uint32_t> pages(hit->hits);
    for (uint32_t i = 0; i < pages.size(); ++i) pages[i] = i;
    EXPECT_TRUE(client->Restore(instance, 0, hit->lease, pages).ok());
    size_t exact = 0;
    for (uint32_t i = 0; i < pages.size(); ++i) exact += kv.Holds(i, keys[i]) ? 1 : 0;
    return {hit->hits, exact};
  }
  std::unique_ptr<client::CacheClient> client;
  testing::EngineKv kv;
  uint64_t instance;
};

// Until `field` of `manager`'s stats is `value` (about 15 s at most); returns the last value seen.
inline uint64_t FieldWhen(const ManagerProcess& manager, const std::string& field, uint64_t value) {
  uint64_t seen = 0;
  for (int i = 0; i < 750; ++i) {
    seen = Field(StatsOf(manager), field);
    if (seen == value) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return seen;
}

// Every Manager gives back what remote work held: the source's sessions and pins, the requester's staging.
inline void ExpectNothingHeld(const std::vector<std::unique_ptr<ManagerProcess>>& managers) {
  for (size_t i = 0; i < managers.size(); ++i) {
    if (!managers[i]->running()) continue;
    EXPECT_EQ(FieldWhen(*managers[i], "source_sessions", 0), 0u) << "node-" << i;
    EXPECT_EQ(FieldWhen(*managers[i], "source_pinned_bytes", 0), 0u) << "node-" << i;
    EXPECT_EQ(FieldWhen(*managers[i], "remote_staging_bytes", 0), 0u) << "node-" << i;
  }
}

}  // namespace orbitkv::mesh_testing

#endif  // ORBITKV_TESTS_INTEGRATION_MESH_FIXTURE_H_
