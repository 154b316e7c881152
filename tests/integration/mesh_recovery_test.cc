// Distributed hardening in the mesh (issues 51, 54 and 84): an etcd outage ended by a new registration without a
// restart, a grant release behind a partition, a three-member etcd losing members, three catalog copies on four
// hosts losing two, and a placement change to a copy that never answers. Label `distributed` (serial: the mesh's
// addresses are fixed), fixture in mesh_fixture.h.
#include "mesh_fixture.h"  // first: it brings gRPC in

#include <fmt/ranges.h>

#include <atomic>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "catalog/candidate_index.h"
#include "catalog/catalog_grpc.h"
#include "catalog/discovery.h"
#include "catalog/remote_plan.h"
#include "catalog/testing/loopback_server.h"
#include "cluster/membership.h"
#include "cluster/placement.h"
#include "transfer/descriptor.h"
#include "transfer/test_util.h"
#include "transfer/ucx_engine.h"

namespace orbitkv {
namespace {

using namespace mesh_testing;  // NOLINT: the fixture and its checks

// Reads the first block a grant covers from its source, into a buffer of this process, through a UCX engine of
// the test's own on the bridge: the read a holder of the grant could make. The batch's status.
Status ReadFirstGrantedBlock(const catalog::Authorized& authorized, const std::string& device) {
  transfer::UcxEngineOptions options;
  options.listen_address = std::string(testing::NetnsMesh::kRootAddress) + ":0";
  options.transports = "tcp";
  options.net_devices = device;
  auto reader = transfer::UcxTransferEngine::Create(options);
  if (!reader.ok()) return reader.status();
  const catalog::SourceGrant& grant = authorized.reply.grant;
  if (grant.blocks.empty()) return Status::NotFound("the grant covers no block");
  const catalog::SourceGrant::Block& block = grant.blocks[0];
  std::vector<uint8_t> landing(block.bytes);
  auto local = (*reader)->RegisterRegion(landing.data(), landing.size());
  if (!local.ok()) return local.status();
  transfer::ReadBatchRequest read;
  read.peer = authorized.reply.ucx_address;
  read.grant = grant.grant_id;
  if (grant.grant_secret.size() == read.grant_secret.size()) {
    std::copy(grant.grant_secret.begin(), grant.grant_secret.end(), read.grant_secret.begin());
  }
  for (const auto& bytes : grant.regions) {
    auto descriptor = transfer::DecodeDescriptor(bytes);
    if (!descriptor.ok()) return descriptor.status();
    read.remotes.push_back(*descriptor);
  }
  read.fragments = {transfer::Fragment{block.region, block.offset, *local, 0, block.bytes}};
  read.deadline = Deadline::After(std::chrono::seconds(10));
  transfer::testing::BatchWaiter waiter;
  if (auto started = (*reader)->ReadBatch(read, waiter.Callback()); !started.ok()) return started.status();
  auto result = waiter.Wait(Deadline::After(std::chrono::seconds(20)));
  if (!result.has_value()) return Status::DeadlineExceeded("the read never completed");
  if (result->status.ok() && result->bytes != block.bytes) {
    return Status::DataLoss(fmt::format("{} bytes landed of {}", result->bytes, block.bytes));
  }
  return result->status;
}

// Issue 51: etcd stopped for twice the membership TTL (3 s) and started again. Every Manager serves locally
// throughout; each registers again, in-process, under a higher epoch and a new cluster-facing runtime UUID (its
// engine-facing incarnation and transfer engine stay); a remote hit afterwards is byte-exact; and a grant with a
// 30 s lifetime a peer took before the outage is refused a read after the recovery, well before its deadline (the
// source revoked every grant of its old registration, and freed their pins once drained).
TEST_F(MeshTest, AnEtcdOutageOfTwiceTheTtlEndsInANewRegistrationWithoutARestart) {
  std::vector<std::unique_ptr<ManagerProcess>> managers;
  ASSERT_TRUE(StartManagers(kHosts, "outage", &managers));
  auto all = [&] { return All(managers); };
  constexpr uint32_t kBlocks = 16;
  const auto x = testing::Chain(9700, kBlocks);
  MeshEngine a(*managers[0], 1, kBlocks);
  ASSERT_TRUE(testing::SaveChain(*a.client, 1, a.kv, x).ok());
  ASSERT_TRUE(CatalogsEqualInventories(all()));
  std::vector<uint64_t> epochs, snapshots, resent;
  std::vector<std::string> engine_uuids, cluster_uuids;
  for (const auto& m : managers) {
    const std::string stats = StatsOf(*m);
    epochs.push_back(Field(stats, "membership_epoch"));
    snapshots.push_back(Field(stats, "catalog_stream_snapshots"));
    resent.push_back(Field(stats, "catalog_stream_snapshot_records"));
    engine_uuids.push_back(StringField(stats, "runtime_uuid"));
    cluster_uuids.push_back(StringField(stats, "cluster_runtime_uuid"));
    EXPECT_EQ(cluster_uuids.back(), engine_uuids.back()) << stats;  // one identity until a registration is redone
  }

  // A peer played by the test, as node-1's current start, takes a 30 s grant of x at node-0 and reads under it.
  cluster::MemberView view;
  InstallMembers(&view);
  const cluster::MemberRecord r1 = view.Find(Node(1))->record;
  const std::string placement = StringField(StatsOf(*managers[0]), "placement_fingerprint");
  catalog::GrpcRequesterTransport transport({"mesh", Node(1), r1.runtime_uuid, r1.epoch, placement}, &view, nullptr);
  catalog::CandidateIndex index({});
  auto placed = cluster::Placement::Create({"node-0", "node-1", "node-2"});
  ASSERT_TRUE(placed.ok());
  catalog::Discovery::Options discovery_options;
  discovery_options.host_of = [&](const state::StateKey& key) {
    return placed->OwnerOf(cluster::Placement::ShardOf(key));
  };
  catalog::Discovery discovery(discovery_options, &index, &transport);
  ASSERT_EQ(discovery.Discover(x).known_prefix, x.size());
  catalog::AuthorizeOptions authorize;
  authorize.self_node = Node(1);
  authorize.request_id = 51;
  authorize.lifetime = std::chrono::seconds(30);
  const MonoTime granted_at = MonoNow();
  catalog::AuthorizeOutcome granted = catalog::AuthorizeBest(x, index, transport, authorize);
  ASSERT_TRUE(granted.authorized.has_value()) << granted.last_error;
  ASSERT_EQ(granted.authorized->span.node, Node(0));
  const Status before = ReadFirstGrantedBlock(*granted.authorized, mesh_->root_veth());
  ASSERT_TRUE(before.ok()) << before;
  EXPECT_EQ(Field(StatsOf(*managers[0]), "source_sessions"), 1u);

  // etcd down for 2 x TTL: every registration lapses; local saves and restores go on everywhere.
  ASSERT_TRUE(etcd_->Stop().ok());
  std::vector<std::unique_ptr<MeshEngine>> locals;
  for (int i = 0; i < kHosts; ++i) {
    locals.push_back(std::make_unique<MeshEngine>(*managers[i], 10 + i, kBlocks));
    const auto w = testing::Chain(9710 + i, kBlocks);
    ASSERT_TRUE(testing::SaveChain(*locals[i]->client, 10 + i, locals[i]->kv, w).ok());
    auto [hits, exact] = locals[i]->QueryAndRestore(w);
    EXPECT_EQ(hits, kBlocks) << Node(i);
    EXPECT_EQ(exact, kBlocks) << Node(i);
  }
  std::this_thread::sleep_for(std::chrono::seconds(6));
  for (int i = 0; i < kHosts; ++i) {
    const std::string stats = StatsOf(*managers[i]);
    EXPECT_EQ(StringField(stats, "membership"), "expired") << stats;
    EXPECT_EQ(Field(stats, "remote_work"), 0u) << stats;
    EXPECT_GE(Field(stats, "membership_attempts"), 1u) << stats;
    const auto w = testing::Chain(9710 + i, kBlocks);
    auto [hits, exact] = locals[i]->QueryAndRestore(w);
    EXPECT_EQ(hits, kBlocks) << Node(i);
    EXPECT_EQ(exact, kBlocks) << Node(i);
  }
  // `orbitkv status` says what is going on and why remote work is off.
  const std::string during = testing::CliOutput({"status", "--socket", managers[1]->socket()});
  EXPECT_NE(during.find("registration: expired for"), std::string::npos) << during;
  EXPECT_NE(during.find("registering again, attempt"), std::string::npos) << during;
  EXPECT_NE(during.find("remote work off: the registration lapsed"), std::string::npos) << during;
  // The source revoked the grants of its lapsed registration: the hold is gone once the grant drained.
  EXPECT_EQ(FieldWhen(*managers[0], "source_sessions", 0), 0u);

  ASSERT_TRUE(etcd_->Launch().ok());
  ASSERT_TRUE(etcd_->WaitReady(Deadline::After(std::chrono::seconds(30))).ok()) << etcd_->LogTail();
  for (int i = 0; i < kHosts; ++i) {
    EXPECT_EQ(FieldWhen(*managers[i], "remote_work", 1), 1u) << StatsOf(*managers[i]);
    const std::string stats = StatsOf(*managers[i]);
    EXPECT_EQ(StringField(stats, "membership"), "registered") << stats;
    EXPECT_GT(Field(stats, "membership_epoch"), epochs[i]) << stats;
    EXPECT_EQ(Field(stats, "membership_registrations"), 2u) << stats;
    EXPECT_NE(StringField(stats, "membership_last_cause"), "") << stats;
    EXPECT_NE(StringField(stats, "cluster_runtime_uuid"), cluster_uuids[i]) << stats;
    EXPECT_EQ(StringField(stats, "runtime_uuid"), engine_uuids[i]) << stats;  // the engine-facing identity stays
    // etcd holds the new registration.
    const cluster::MemberRecord record = RecordOf(etcd_->endpoint(), Node(i), "mesh");
    EXPECT_EQ(record.runtime_uuid, StringField(stats, "cluster_runtime_uuid"));
    EXPECT_EQ(static_cast<uint64_t>(record.epoch), Field(stats, "membership_epoch"));
  }
  const std::string recovered = testing::CliOutput({"status", "--socket", managers[1]->socket()});
  EXPECT_NE(recovered.find("registration: registered for"), std::string::npos) << recovered;
  EXPECT_NE(recovered.find("2 registrations); the last registration ended: "), std::string::npos) << recovered;
  EXPECT_NE(recovered.find("remote work on"), std::string::npos) << recovered;
  // A remote hit: node-1 fetches x from node-0, byte-exact (the new views and catalogs may need a moment).
  MeshEngine b(*managers[1], 2, kBlocks);
  size_t hits = 0, exact = 0;
  for (int attempt = 0; attempt < 40 && hits < kBlocks; ++attempt) {
    std::tie(hits, exact) = b.QueryAndRestore(x);
    if (hits < kBlocks) std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
  EXPECT_EQ(hits, kBlocks) << StatsOf(*managers[1]);
  EXPECT_EQ(exact, kBlocks);
  // Issue 69: the owner streams continued (the same inventory, so the same start): the catalogs hold every
  // inventory again, the saves made during the outage included, and no owner resent its inventory in a snapshot.
  EXPECT_TRUE(CatalogsEqualInventories(all()));
  for (int i = 0; i < kHosts; ++i) {
    const std::string stats = StatsOf(*managers[i]);
    EXPECT_EQ(Field(stats, "catalog_stream_snapshots"), snapshots[i]) << Node(i) << ": " << stats;
    EXPECT_EQ(Field(stats, "catalog_stream_snapshot_records"), resent[i]) << Node(i) << ": " << stats;
    EXPECT_GE(Field(stats, "catalog_streams_continued"), static_cast<uint64_t>(cluster::kNumShards)) << stats;
    EXPECT_EQ(FieldWhen(*managers[i], "catalog_incomplete_shards", 0), 0u) << stats;
  }
  // The grant taken before the outage is refused now, long before its 30 s are over.
  const Status after = ReadFirstGrantedBlock(*granted.authorized, mesh_->root_veth());
  EXPECT_FALSE(after.ok());
  EXPECT_LT(MonoNow() - granted_at, std::chrono::seconds(30));
  EXPECT_EQ(FieldWhen(*managers[0], "source_sessions", 0), 0u);
  EXPECT_EQ(Field(StatsOf(*managers[0]), "source_quarantined_bytes"), 0u);
  EXPECT_EQ(Field(StatsOf(*managers[0]), "transfer_grants"), 0u);
  EXPECT_TRUE(testing::EventuallyIdle(*b.client));
}

// Issue 51: gRPC between node-1 and node-0 blocked right after node-0 granted node-1 a prefix (its UCX port was
// blocked first, so the read hangs to the stage's deadline and the grant outlives it). The release waits in node-1's
// release queue, not on its one fetch worker: another prefix, from node-2, is fetched while that release is still
// pending, and once gRPC is open again the release goes through.
TEST_F(MeshTest, AReleaseBehindAPartitionBlocksNoOtherFetchAndGoesThroughOnceHealed) {
  catalog_nodes_ = "node-2";
  std::vector<std::unique_ptr<ManagerProcess>> managers;
  const std::vector<std::vector<std::string>> extra = {
      {"--transfer-listen", mesh_->address(0) + ":7400"},
      {"--remote-fetch-deadline-ms", "3000", "--remote-fetch-workers", "1"},
      {}};
  for (int i = 0; i < kHosts; ++i) {
    managers.push_back(StartManager(i, fmt::format("release-{}", i), extra[i]));
    ASSERT_TRUE(managers.back()->running()) << managers.back()->LogText();
  }
  constexpr uint32_t kBlocks = 16;
  const auto x = testing::Chain(9800, kBlocks), y = testing::Chain(9801, kBlocks);
  MeshEngine a(*managers[0], 1, kBlocks), c(*managers[2], 3, kBlocks);
  ASSERT_TRUE(testing::SaveChain(*a.client, 1, a.kv, x).ok());
  ASSERT_TRUE(testing::SaveChain(*c.client, 3, c.kv, y).ok());
  ASSERT_TRUE(CatalogsEqualInventories(All(managers)));
  MeshEngine b(*managers[1], 2, kBlocks);

  ASSERT_TRUE(mesh_->BlockPort(0, 7400).ok());
  std::future<std::pair<size_t, size_t>> fetching_x =
      std::async(std::launch::async, [&] { return b.QueryAndRestore(x); });
  ASSERT_EQ(FieldWhen(*managers[0], "source_sessions", 1), 1u);  // granted; the read hangs
  ASSERT_TRUE(mesh_->BlockPort(0, 7070, "okv_block_grpc").ok());
  const auto [hits_x, exact_x] = fetching_x.get();  // the stage's deadline ends it
  EXPECT_EQ(hits_x, 0u);
  EXPECT_EQ(exact_x, 0u);
  std::string stats = StatsOf(*managers[1]);
  EXPECT_EQ(Field(stats, "remote_releases_queued"), 1u) << stats;
  EXPECT_EQ(Field(stats, "remote_releases_pending"), 1u) << stats;

  // The only fetch worker is free at once: y comes from node-2 while x's release still waits behind the partition.
  const auto [hits_y, exact_y] = b.QueryAndRestore(y);
  EXPECT_EQ(hits_y, kBlocks);
  EXPECT_EQ(exact_y, kBlocks);
  // y's release goes through (the release queue sends it on its own thread: under ASan it can still be in flight
  // when the fetch returns) while x's stays behind the partition.
  EXPECT_EQ(FieldWhen(*managers[1], "remote_releases_pending", 1), 1u);
  stats = StatsOf(*managers[1]);
  EXPECT_EQ(Field(stats, "remote_releases_pending"), 1u) << stats;
  EXPECT_EQ(Field(stats, "remote_releases_released") + Field(stats, "remote_releases_not_held"), 1u) << stats;

  ASSERT_TRUE(mesh_->Unblock(0, "okv_block_grpc").ok());
  ASSERT_TRUE(mesh_->Unblock(0).ok());
  EXPECT_EQ(FieldWhen(*managers[1], "remote_releases_pending", 0), 0u);
  stats = StatsOf(*managers[1]);
  EXPECT_EQ(Field(stats, "remote_releases_released") + Field(stats, "remote_releases_not_held"), 2u) << stats;
  EXPECT_EQ(Field(stats, "remote_releases_abandoned"), 0u) << stats;
  EXPECT_EQ(FieldWhen(*managers[0], "source_sessions", 0), 0u);
  EXPECT_EQ(Field(StatsOf(*managers[0]), "source_pinned_bytes"), 0u);
  EXPECT_TRUE(testing::EventuallyIdle(*b.client));
}

// Issue 51: the Managers on a three-member etcd that the namespaces reach. A follower killed and started again, then
// the leader killed: the leases ride through both (keepalives and views move to a live member), so no registration
// lapses and a remote hit afterwards is byte-exact. The members' raft timings are scaled to the tests' 3 s TTL as a
// production cluster's defaults (100 ms heartbeat, 1 s election) are to the Managers' default 10 s.
TEST_F(MeshTest, AThreeMemberEtcdLosingAFollowerThenItsLeaderLapsesNoRegistration) {
  auto cluster =
      cluster::testing::EtcdCluster::Start(3, Deadline::After(std::chrono::seconds(60)), NetnsMesh::kRootAddress,
                                           {"--heartbeat-interval", "30", "--election-timeout", "300"});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  etcd_endpoints_ = fmt::format("{}", fmt::join((*cluster)->endpoints_on(NetnsMesh::kRootAddress), ","));
  std::vector<std::unique_ptr<ManagerProcess>> managers;
  ASSERT_TRUE(StartManagers(kHosts, "ha", &managers));
  auto all = [&] { return All(managers); };
  constexpr uint32_t kBlocks = 16;
  const auto x = testing::Chain(9900, kBlocks), y = testing::Chain(9901, kBlocks);
  MeshEngine a(*managers[0], 1, kBlocks);
  ASSERT_TRUE(testing::SaveChain(*a.client, 1, a.kv, x).ok());
  ASSERT_TRUE(testing::SaveChain(*a.client, 1, a.kv, y).ok());
  ASSERT_TRUE(CatalogsEqualInventories(all()));
  MeshEngine b(*managers[1], 2, kBlocks);
  auto [hits, exact] = b.QueryAndRestore(x);
  EXPECT_EQ(hits, kBlocks);
  EXPECT_EQ(exact, kBlocks);

  Result<size_t> leader = (*cluster)->LeaderIndex(Deadline::After(std::chrono::seconds(30)));
  ASSERT_TRUE(leader.ok()) << leader.status();
  const size_t follower = (*leader + 1) % 3;
  (*cluster)->member(follower).Kill();
  std::this_thread::sleep_for(std::chrono::seconds(2));
  ASSERT_TRUE((*cluster)->member(follower).Launch().ok());
  ASSERT_TRUE((*cluster)->member(follower).WaitReady(Deadline::After(std::chrono::seconds(30))).ok())
      << (*cluster)->member(follower).LogTail();
  (*cluster)->member(*leader).Kill();
  Result<size_t> next = (*cluster)->LeaderIndex(Deadline::After(std::chrono::seconds(30)));
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_NE(*next, *leader);
  // Two TTLs on the two survivors.
  std::this_thread::sleep_for(std::chrono::seconds(6));
  for (int i = 0; i < kHosts; ++i) {
    EXPECT_EQ(FieldWhen(*managers[i], "remote_work", 1), 1u) << StatsOf(*managers[i]);
    const std::string stats = StatsOf(*managers[i]);
    EXPECT_EQ(StringField(stats, "membership"), "registered") << stats;
    EXPECT_EQ(Field(stats, "membership_registrations"), 1u) << stats;  // never lapsed
    EXPECT_EQ(StringField(stats, "membership_last_cause"), "") << stats;
  }
  std::tie(hits, exact) = b.QueryAndRestore(y);
  EXPECT_EQ(hits, kBlocks) << StatsOf(*managers[1]);
  EXPECT_EQ(exact, kBlocks);
  EXPECT_TRUE(testing::EventuallyIdle(*b.client));
  ASSERT_TRUE((*cluster)->member(*leader).Launch().ok());
  managers.clear();  // before the cluster goes
}

// Four hosts: every shard's three copies on three of them, so any two may be lost.
class FourHostMeshTest : public MeshTest {
 protected:
  FourHostMeshTest() { hosts_ = 4; }
};

// Issue 54: three copies a shard on four catalog hosts. node-3 killed with SIGKILL while node-1 runs cold queries:
// no lookup fails and no hit is wrong (the killed copy's shards are asked of another copy in the same lookup);
// node-2's gRPC then blackholed (nftables drop): lookups that meet it first are hedged (the next copy asked beside
// it after --discovery-hedge-ms, the blackholed call cancelled); with both lost every shard still has a copy, so cold
// queries still hit in full, and a cached prefix is served locally.
TEST_F(FourHostMeshTest, ThreeCopiesKeepEveryLookupThroughAKilledABlackholedAndTwoLostCatalogHosts) {
  catalog_nodes_ = "node-0,node-1,node-2,node-3";
  std::vector<std::unique_ptr<ManagerProcess>> managers;
  ASSERT_TRUE(StartManagers(4, "copies", &managers));
  constexpr uint32_t kBlocks = 16;
  constexpr int kChains = 12;
  MeshEngine a(*managers[0], 1, kBlocks);
  std::vector<std::vector<state::StateKey>> chains;
  for (int c = 0; c < kChains; ++c) {
    chains.push_back(testing::Chain(9950 + static_cast<uint64_t>(c), kBlocks));
    ASSERT_TRUE(testing::SaveChain(*a.client, 1, a.kv, chains.back()).ok());
  }
  ASSERT_TRUE(CatalogsEqualInventories(All(managers)));
  EXPECT_EQ(Field(StatsOf(*managers[1]), "catalog_replicas"), 3u);
  EXPECT_EQ(Field(StatsOf(*managers[1]), "catalog_reduced_coverage"), 0u);
  const std::string status = testing::CliOutput({"status", "--socket", managers[1]->socket()});
  EXPECT_NE(status.find("catalog: 3 copies of each shard\n"), std::string::npos) << status;
  MeshEngine b(*managers[1], 2, kBlocks);
  auto expect_full = [&](int c) {
    auto [hits, exact] = b.QueryAndRestore(chains[static_cast<size_t>(c)]);
    EXPECT_EQ(hits, kBlocks) << "chain " << c << ": " << StatsOf(*managers[1]);
    EXPECT_EQ(exact, hits) << "chain " << c;
  };

  // node-3 killed while the cold queries run.
  std::thread killer([&] {
    AwaitRemoteFetch(*managers[1]);
    managers[3]->Stop(SIGKILL);
  });
  for (int c = 0; c < 4; ++c) expect_full(c);
  killer.join();
  for (int c = 4; c < 6; ++c) expect_full(c);
  std::string stats = StatsOf(*managers[1]);
  EXPECT_EQ(Field(stats, "remote_no_source"), 0u) << stats;
  EXPECT_EQ(Field(stats, "remote_fetch_failures"), 0u) << stats;

  // node-2's peer port blackholed as well: two of four catalog hosts lost.
  ASSERT_TRUE(mesh_->BlockPort(2, 7070).ok());
  const uint64_t failovers = Field(stats, "discovery_failovers");
  const uint64_t hedges = Field(stats, "discovery_hedges");
  for (int c = 6; c < kChains; ++c) expect_full(c);
  stats = StatsOf(*managers[1]);
  EXPECT_EQ(Field(stats, "remote_no_source"), 0u) << stats;
  EXPECT_GT(Field(stats, "discovery_failovers"), failovers) << stats;
  EXPECT_GT(Field(stats, "discovery_hedges"), hedges) << stats;
  // A prefix already fetched is served locally, whatever the catalogs.
  expect_full(0);
  ASSERT_TRUE(mesh_->Unblock(2).ok());
  EXPECT_TRUE(testing::EventuallyIdle(*b.client));
}

// Issue 55: a fourth catalog node added under load. The operator asks with `orbitkv catalog placement --add node-3`;
// the elected reconciler moves at most two shards at a time (owners publish to both generations, the new copies
// catch up past their watermarks), commits generation 2, and the old copies retire after the grace period. Meanwhile
// an engine on node-0 keeps saving and engines on node-1 and node-3 keep asking for prefixes saved before the change:
// every query hits in full with the right bytes, no lookup fails, no Manager fences or restarts, and afterwards every
// copy equals its owners' inventories.
TEST_F(FourHostMeshTest, AFourthCatalogNodeAddedUnderLoadCommitsTheNextGenerationWithoutALookupError) {
  std::vector<std::unique_ptr<ManagerProcess>> managers;
  ASSERT_TRUE(StartManagers(4, "placement", &managers, {"--placement-retire-grace-ms", "1000"}));
  constexpr uint32_t kBlocks = 16;
  constexpr int kChains = 24;
  MeshEngine a(*managers[0], 1, kBlocks);
  std::vector<std::vector<state::StateKey>> chains;
  for (int c = 0; c < kChains; ++c) {
    chains.push_back(testing::Chain(7700 + static_cast<uint64_t>(c), kBlocks));
    ASSERT_TRUE(testing::SaveChain(*a.client, 1, a.kv, chains.back()).ok());
  }
  ASSERT_TRUE(CatalogsEqualInventories(All(managers)));
  EXPECT_EQ(Field(StatsOf(*managers[3]), "catalog_shards_hosted"), 0u);
  EXPECT_EQ(Field(StatsOf(*managers[3]), "placement_generation"), 1u);
  // Asking for a node that is not a member is refused with the fix named; asking for node-3 is taken.
  const std::string refused = testing::CliOutput(
      {"catalog", "placement", "--add", "node-9", "--socket", managers[1]->socket()}, /*with_errors=*/true);
  EXPECT_NE(refused.find("not a live member"), std::string::npos) << refused;
  const std::string asked =
      testing::CliOutput({"catalog", "placement", "--add", "node-3", "--socket", managers[1]->socket()});
  ASSERT_NE(asked.find("requested: catalog nodes node-0,node-1,node-2,node-3"), std::string::npos) << asked;

  std::atomic<bool> done{false};
  uint64_t most_moving = 0, samples_moving = 0;
  std::thread sampler([&] {  // the transition record as node-2 follows it
    while (!done.load()) {
      const std::string stats = StatsOf(*managers[2]);
      most_moving = std::max(most_moving, Field(stats, "placement_shards_moving"));
      samples_moving += StringField(stats, "placement_change") == "moving" ? 1 : 0;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  });
  std::thread writer([&] {  // load: node-0's engine keeps saving new prefixes
    MeshEngine w(*managers[0], 5, kBlocks);
    for (uint64_t c = 0; !done.load(); ++c) {
      EXPECT_TRUE(testing::SaveChain(*w.client, 5, w.kv, testing::Chain(8800 + c, kBlocks)).ok());
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  MeshEngine b(*managers[1], 2, kBlocks);
  MeshEngine d(*managers[3], 4, kBlocks);
  int queried = 0;
  const auto committed = [&] {
    for (const auto& m : managers) {
      const std::string stats = StatsOf(*m);
      if (Field(stats, "placement_generation") != 2 || StringField(stats, "placement_change") != "none") return false;
    }
    return true;
  };
  for (int round = 0; round < 3000 && !committed(); ++round) {
    if (queried < kChains) {  // cold queries from both requesters while the shards move
      MeshEngine& e = queried % 2 == 0 ? b : d;
      const auto [hits, exact] = e.QueryAndRestore(chains[static_cast<size_t>(queried)]);
      EXPECT_EQ(hits, kBlocks) << "chain " << queried << ": " << StatsOf(*managers[queried % 2 == 0 ? 1 : 3]);
      EXPECT_EQ(exact, hits) << "chain " << queried;
      ++queried;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  done.store(true);
  writer.join();
  sampler.join();
  ASSERT_TRUE(committed()) << testing::CliOutput({"catalog", "placement", "--socket", managers[1]->socket()});
  EXPECT_GT(queried, 0);
  EXPECT_GT(samples_moving, 0u) << "the change was never seen moving";
  EXPECT_GE(most_moving, 1u);
  EXPECT_LE(most_moving, 2u);
  for (int i = 0; i < 4; ++i) {
    const std::string stats = StatsOf(*managers[static_cast<size_t>(i)]);
    EXPECT_EQ(StringField(stats, "membership"), "registered") << stats;
    EXPECT_EQ(Field(stats, "membership_registrations"), 1u) << stats;
    EXPECT_EQ(Field(stats, "remote_no_source"), 0u) << "node-" << i << ": " << stats;
    EXPECT_EQ(Field(stats, "remote_fetch_failures"), 0u) << "node-" << i << ": " << stats;
    EXPECT_EQ(Field(stats, "discovery_failed_hosts"), 0u) << "node-" << i << ": " << stats;
  }
  EXPECT_GT(Field(StatsOf(*managers[3]), "catalog_shards_hosted"), 0u);
  uint64_t committed_by = 0;
  for (const auto& m : managers) committed_by += Field(StatsOf(*m), "placement_changes_committed");
  EXPECT_EQ(committed_by, 1u);  // one leader committed it once
  const std::string shown = testing::CliOutput({"catalog", "placement", "--socket", managers[3]->socket()});
  EXPECT_NE(shown.find("placement generation 2: catalog nodes node-0,node-1,node-2,node-3"), std::string::npos)
      << shown;
  EXPECT_NE(shown.find("change: none"), std::string::npos) << shown;
  // The old copies retired: every copy of generation 2 equals its owners' inventories, and nothing more is held.
  ASSERT_TRUE(CatalogsEqualInventories(All(managers)));
  // The rest of the prefixes, asked after the commit, hit in full as well.
  for (; queried < kChains; ++queried) {
    const auto [hits, exact] = b.QueryAndRestore(chains[static_cast<size_t>(queried)]);
    EXPECT_EQ(hits, kBlocks) << "chain " << queried;
    EXPECT_EQ(exact, hits);
  }
  EXPECT_TRUE(testing::EventuallyIdle(*b.client));
  EXPECT_TRUE(testing::EventuallyIdle(*d.client));
}

// A member with a real registration (its lease and etcd traffic a Manager's) whose peer port, on the mesh's bridge,
// holds every call (catalog::testing::HoldingPeer), joined to the fixture's cluster with the catalog on node-0 and
// node-1.
struct SilentMember {
  catalog::testing::HoldingPeer service;
  std::unique_ptr<grpc::Server> server;
  MetricsRegistry metrics;
  std::unique_ptr<cluster::Membership> membership;
  ~SilentMember() {
    service.released.store(true);
    if (membership) membership->Shutdown();
    if (server) server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  }
};

::testing::AssertionResult JoinSilentMember(const std::string& etcd_endpoint, SilentMember* out) {
  catalog::testing::LoopbackServer listening =
      catalog::testing::StartLoopbackServer({&out->service}, NetnsMesh::kRootAddress);
  out->server = std::move(listening.server);
  if (out->server == nullptr) return ::testing::AssertionFailure() << "the silent peer did not listen";
  cluster::MembershipOptions options;
  options.etcd_endpoints = {etcd_endpoint};
  options.cluster_name = "mesh";
  options.node_id = "silent-node";
  options.membership_ttl_secs = 3;
  options.catalog_nodes = {"node-0", "node-1"};
  options.catalog_replicas = 2;
  options.peer_endpoint = listening.endpoint();
  Result<std::unique_ptr<cluster::Membership>> member = cluster::Membership::Create(options, &out->metrics);
  if (!member.ok()) return ::testing::AssertionFailure() << member.status();
  out->membership = std::move(member).value();
  if (Status joined = out->membership->Join(Deadline::After(std::chrono::seconds(30))); !joined.ok()) {
    return ::testing::AssertionFailure() << joined;
  }
  return ::testing::AssertionSuccess();
}

// Issue 84, item 5: the catalog on two hosts, `--placement-shard-bound-ms 5000`, and a third member whose peer port
// accepts calls and never answers is added to the catalog set. The change ends (aborted, generation 1 stays) within
// three times its bound, the leader counts the abort, and `orbitkv stats` answers on every catalog host throughout
// (within the CLI's 3 s): no lock is held across a call to the silent copy.
TEST_F(MeshTest, APlacementChangeToACopyThatNeverAnswersEndsWithinItsBoundAndStatsStillAnswer) {
  catalog_nodes_ = "node-0,node-1";
  catalog_replicas_ = "2";
  std::vector<std::unique_ptr<ManagerProcess>> managers;
  ASSERT_TRUE(StartManagers(kHosts, "silent", &managers,
                            {"--placement-shard-bound-ms", "5000", "--placement-retire-grace-ms", "1000"}));
  MeshEngine a(*managers[2], 1, 16);
  for (uint64_t c = 0; c < 8; ++c) {
    ASSERT_TRUE(testing::SaveChain(*a.client, 1, a.kv, testing::Chain(9900 + c, 16)).ok());
  }
  ASSERT_TRUE(CatalogsEqualInventories(All(managers)));
  SilentMember silent;
  ASSERT_TRUE(JoinSilentMember(etcd_->endpoint(), &silent));

  const std::string asked =
      testing::CliOutput({"catalog", "placement", "--add", "silent-node", "--socket", managers[0]->socket()}, true);
  ASSERT_NE(asked.find("requested: catalog nodes node-0,node-1,silent-node"), std::string::npos) << asked;
  const MonoTime start = MonoNow();
  bool seen_moving = false;
  int stats_failures = 0;
  std::string failed_stats;
  const auto ended = [&] {
    for (const auto& m : managers) {
      const std::string change = StringField(StatsOf(*m), "placement_change");
      seen_moving = seen_moving || change == "moving";
      if (change == "moving" || (change == "none" && !seen_moving)) return false;
    }
    return true;
  };
  while (!ended() && MonoNow() - start < std::chrono::seconds(60)) {
    for (int i = 0; i < 2; ++i) {  // the catalog hosts, as an operator asks them
      const std::string out = testing::CliOutput(
          {"stats", "--json", "--socket", managers[static_cast<size_t>(i)]->socket()}, /*with_errors=*/true);
      if (out.find("\"placement_change\"") == std::string::npos) {
        ++stats_failures;
        failed_stats = out;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  const double seconds = std::chrono::duration<double>(MonoNow() - start).count();
  ASSERT_TRUE(ended()) << testing::CliOutput({"catalog", "placement", "--socket", managers[0]->socket()});
  EXPECT_TRUE(seen_moving);
  EXPECT_LE(seconds, 15.0) << "the change did not end within three times its 5 s bound";
  EXPECT_EQ(stats_failures, 0) << failed_stats;
  uint64_t aborted = 0;
  for (const auto& m : managers) {
    const std::string stats = StatsOf(*m);
    EXPECT_EQ(Field(stats, "placement_generation"), 1u) << stats;
    aborted += Field(stats, "placement_changes_aborted");
  }
  EXPECT_EQ(aborted, 1u) << "the leader did not count its abort";
  const std::string shown = testing::CliOutput({"catalog", "placement", "--socket", managers[1]->socket()});
  EXPECT_NE(shown.find("placement generation 1: catalog nodes node-0,node-1"), std::string::npos) << shown;
}

// Issue 84, item 1: `orbitkv catalog placement --abort` through the CLI. Refused with nothing moving; while a change
// to a copy that never answers moves (its bound a minute away), it ends the change at the reconciler's next pass.
TEST_F(MeshTest, AnOperatorsAbortEndsAMoveThatWouldOtherwiseWaitForItsBound) {
  catalog_nodes_ = "node-0,node-1";
  catalog_replicas_ = "2";
  std::vector<std::unique_ptr<ManagerProcess>> managers;
  ASSERT_TRUE(StartManagers(kHosts, "abort", &managers, {"--placement-shard-bound-ms", "60000"}));
  SilentMember silent;
  ASSERT_TRUE(JoinSilentMember(etcd_->endpoint(), &silent));
  const std::string nothing =
      testing::CliOutput({"catalog", "placement", "--abort", "--socket", managers[1]->socket()}, true);
  EXPECT_NE(nothing.find("nothing to abort"), std::string::npos) << nothing;
  const std::string asked =
      testing::CliOutput({"catalog", "placement", "--add", "silent-node", "--socket", managers[0]->socket()}, true);
  ASSERT_NE(asked.find("requested"), std::string::npos) << asked;
  const auto change_of = [&](const ManagerProcess& m) { return StringField(StatsOf(m), "placement_change"); };
  for (int i = 0; i < 600 && change_of(*managers[1]) != "moving"; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_EQ(change_of(*managers[1]), "moving");
  const std::string abort =
      testing::CliOutput({"catalog", "placement", "--abort", "--socket", managers[1]->socket()}, true);
  EXPECT_NE(abort.find("abort requested"), std::string::npos) << abort;
  std::string placement;
  for (int i = 0; i < 600; ++i) {
    placement = testing::CliOutput({"catalog", "placement", "--socket", managers[0]->socket()});
    if (placement.find("aborted by the operator (asked on node node-1)") != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_NE(placement.find("aborted by the operator (asked on node node-1)"), std::string::npos) << placement;
  for (const auto& m : managers) EXPECT_EQ(Field(StatsOf(*m), "placement_generation"), 1u);
}

}  // namespace
}  // namespace orbitkv
