// Issue 73: Managers restarted under their engines and peers. Several hosts in network namespaces (mesh_fixture.h).
// Label `distributed`.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>

#include "catalog/peer_service.h"  // first of the gRPC users (cluster/grpc.h)

#include "client/manager_link.h"
#include "distributed_util.h"
#include "engine_kv.h"
#include "mesh_fixture.h"

namespace orbitkv {
namespace {

using namespace mesh_testing;  // NOLINT: the fixture and its checks

// A source whose UCX listener has a fixed port (--transfer-listen HOST:PORT, the one opened in a firewall), restarted
// with SIGTERM after a peer read from it: the new start binds the same port at once and serves the peer again with
// no failed fetch. Before: the old start's connections held the port in TIME_WAIT and the restart failed ("no port
// of --transfer-listen ... is free") for up to a minute.
TEST_F(MeshTest, ASourceRestartedOnItsFixedTransferPortListensAtOnceAndServesAgain) {
  const std::string fixed = mesh_->address(0) + ":7071";
  std::vector<std::unique_ptr<ManagerProcess>> managers;
  managers.push_back(StartManager(0, "fixed-0", {"--transfer-listen", fixed}));
  managers.push_back(StartManager(1, "fixed-1"));
  managers.push_back(StartManager(2, "fixed-2"));
  for (const auto& m : managers) ASSERT_TRUE(m->running()) << m->LogText();
  constexpr uint32_t kBlocks = 8;
  // An engine on node-0 saves a chain; one on node-1 reads it from node-0 (8 blocks, byte-exact).
  auto save_and_fetch = [&](uint64_t chain, uint64_t reader) {
    MeshEngine a(*managers[0], 1, 64);
    const auto keys = testing::Chain(chain, kBlocks);
    ASSERT_TRUE(testing::SaveChain(*a.client, 1, a.kv, keys).ok());
    ASSERT_TRUE(CatalogsEqualInventories(All(managers)));
    MeshEngine b(*managers[1], reader, 64);
    EXPECT_EQ(b.QueryAndRestore(keys), std::make_pair(size_t{kBlocks}, size_t{kBlocks}));
    EXPECT_EQ(StringField(StatsOf(*managers[0]), "transfer_listen"), fixed);
  };
  save_and_fetch(100, 2);
  managers[0]->Restart(SIGTERM);
  ASSERT_TRUE(managers[0]->running()) << managers[0]->LogText();
  save_and_fetch(101, 3);
  const std::string stats = StatsOf(*managers[1]);
  EXPECT_EQ(Field(stats, "remote_fetched_blocks"), 2 * kBlocks) << stats;
  EXPECT_EQ(Field(stats, "remote_fetch_failures"), 0u) << stats;
  ExpectNothingHeld(managers);
}

// An engine on a client::ManagerLink on node-1 while node-1's Manager restarts (SIGTERM, same flags and socket):
// the link connects to the new start and replays the engine's registration without a call failing first, and the
// engine's first query once the new start registered is a remote hit of what node-0 saved, byte-exact, with no
// failed fetch.
TEST_F(MeshTest, AnEngineAcrossItsManagersRestartGetsARemoteHitOnceItRegistered) {
  std::vector<std::unique_ptr<ManagerProcess>> managers;
  ASSERT_TRUE(StartManagers(kHosts, "ride", &managers));
  constexpr uint32_t kBlocks = 8;
  MeshEngine a(*managers[0], 1, 64);
  testing::EngineKv kv(64);
  client::ManagerLink::Options options;
  options.client.socket_path = managers[1]->socket();
  options.on_connect = [&](client::CacheClient& client) {
    ORBITKV_RETURN_IF_ERROR(client.RegisterInstance(2, state::testing::SampleNamespace()));
    return client.RegisterGroup(2, 0, kv.pages(), kv.Specs()).status();
  };
  auto link = client::ManagerLink::Start(options);
  ASSERT_TRUE(link.ok()) << link.status();
  auto restore = [&](const std::vector<state::StateKey>& keys) -> std::pair<size_t, size_t> {
    std::shared_ptr<client::CacheClient> client = (*link)->WaitClient(std::chrono::seconds(10));
    if (client == nullptr) return {0, 0};
    kv.Poison();
    auto hit = client->QueryWait(2, 0, keys, std::chrono::seconds(20));
    EXPECT_TRUE(hit.ok()) << hit.status();
    if (!hit.ok() || hit->hits == 0) return {0, 0};
    std::vector<uint32_t> pages(hit->hits);
    for (uint32_t i = 0; i < pages.size(); ++i) pages[i] = i;
    EXPECT_TRUE(client->Restore(2, 0, hit->lease, pages).ok());
    size_t exact = 0;
    for (uint32_t i = 0; i < pages.size(); ++i) exact += kv.Holds(i, keys[i]) ? 1 : 0;
    return {hit->hits, exact};
  };
  const auto before = testing::Chain(200, kBlocks);
  ASSERT_TRUE(testing::SaveChain(*a.client, 1, a.kv, before).ok());
  ASSERT_TRUE(CatalogsEqualInventories(All(managers)));
  EXPECT_EQ(restore(before), std::make_pair(size_t{kBlocks}, size_t{kBlocks}));

  std::shared_ptr<client::CacheClient> old = (*link)->Client();
  managers[1]->Restart(SIGTERM);
  ASSERT_TRUE(managers[1]->running()) << managers[1]->LogText();
  EXPECT_EQ(StringField(StatsOf(*managers[1]), "membership"), "registered");  // it serves engines once registered
  const auto after = testing::Chain(201, kBlocks);
  ASSERT_TRUE(testing::SaveChain(*a.client, 1, a.kv, after).ok());
  ASSERT_TRUE(CatalogsEqualInventories(All(managers)));
  EXPECT_EQ(restore(after), std::make_pair(size_t{kBlocks}, size_t{kBlocks}));
  EXPECT_NE((*link)->Client(), old);
  EXPECT_EQ((*link)->GetStats().connects, 2u);
  const std::string stats = StatsOf(*managers[1]);
  EXPECT_EQ(Field(stats, "remote_fetched_blocks"), kBlocks) << stats;
  EXPECT_EQ(Field(stats, "remote_fetch_failures"), 0u) << stats;
  ExpectNothingHeld(managers);
}

}  // namespace
}  // namespace orbitkv
