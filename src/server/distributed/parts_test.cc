// The distributed wing's parts, each alone: the flags they are configured from, the registration hooks, the catalog
// host over a real inventory and store (its own streams to itself, no etcd), and the peer listener on loopback
// gRPC (bind failures, TLS files, a Health answered), the source over a real cache and UCX engine (its grants across
// a lapse, its upkeep revoking a vanished requester's), and the requester with remote work off. Fetches between
// real peers are remote_fetch_test.cc's and the mesh tests'.
#include "server/distributed/node_parts.h"  // first: it brings gRPC in

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <future>
#include <thread>

#include "base/runtime_id.h"
#include "base/temp_dir.h"
#include "catalog/testing/loopback_server.h"
#include "cluster/placement.h"
#include "cluster/testing/test_certs.h"
#include "core/test_util.h"
#include "server/distributed/node_config.h"
#include "server/distributed/node_identity.h"
#include "transfer/ucx_engine.h"

namespace orbitkv::server {
namespace {

using std::chrono::milliseconds;

ManagerConfig PeerConfig() {
  ManagerConfig config;
  config.node_id = "n0";
  config.cluster_name = "t";
  config.peer_endpoint = "127.0.0.1:0";
  config.etcd_endpoints = "127.0.0.1:2379";
  return config;
}

// --- node_config -------------------------------------------------------------------------------------------------

TEST(NodeConfigTest, TransferListenDefaultsToThePeerEndpointsHostAndAnyPort) {
  ManagerConfig config = PeerConfig();
  config.peer_endpoint = "10.0.0.5:7300";
  Result<TransferListen> listen = ParseTransferListen(config);
  ASSERT_TRUE(listen.ok()) << listen.status();
  EXPECT_EQ(listen->host, "10.0.0.5");
  EXPECT_EQ(listen->first_port, 0u);
  EXPECT_EQ(listen->last_port, 0u);
}

TEST(NodeConfigTest, TransferListenTakesAPortOrARange) {
  ManagerConfig config = PeerConfig();
  config.transfer_listen = "10.0.0.5:7400-7409";
  Result<TransferListen> range = ParseTransferListen(config);
  ASSERT_TRUE(range.ok()) << range.status();
  EXPECT_EQ(range->host, "10.0.0.5");
  EXPECT_EQ(range->first_port, 7400u);
  EXPECT_EQ(range->last_port, 7409u);
  config.transfer_listen = "10.0.0.5:7400";
  Result<TransferListen> one = ParseTransferListen(config);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->first_port, 7400u);
  EXPECT_EQ(one->last_port, 7400u);
}

TEST(NodeConfigTest, ABadTransferListenNamesTheFlagAndTheForm) {
  ManagerConfig config = PeerConfig();
  for (const char* bad : {":7400", "h:port", "h:7409-7400", "h:99999", "h:0-5", "h:7400-x"}) {
    config.transfer_listen = bad;
    Result<TransferListen> listen = ParseTransferListen(config);
    ASSERT_FALSE(listen.ok()) << bad;
    EXPECT_EQ(listen.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(listen.status().message().find("--transfer-listen"), std::string_view::npos) << listen.status();
    EXPECT_NE(listen.status().message().find("HOST:FIRST-LAST"), std::string_view::npos) << listen.status();
  }
}

TEST(NodeConfigTest, TheEtcdPasswordIsTheFilesFirstLineAndNeedsBothFlags) {
  orbitkv::testing::TempDir dir;
  const std::string file = dir.path() + "/password";
  std::ofstream(file) << "s3cret \r\nsecond line\n";
  ManagerConfig config = PeerConfig();
  EXPECT_EQ(*EtcdPassword(config), "");  // no user, no password
  config.etcd_password_file = file;
  EXPECT_EQ(EtcdPassword(config).status().code(), StatusCode::kInvalidArgument);  // a file without a user
  config.etcd_user = "orbitkv";
  Result<std::string> password = EtcdPassword(config);
  ASSERT_TRUE(password.ok()) << password.status();
  EXPECT_EQ(*password, "s3cret");
  config.etcd_password_file.clear();
  Result<std::string> missing = EtcdPassword(config);
  EXPECT_EQ(missing.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(missing.status().message().find("--etcd-password-file"), std::string_view::npos);
  config.etcd_password_file = dir.path() + "/absent";
  EXPECT_EQ(EtcdPassword(config).status().code(), StatusCode::kNotFound);
  std::ofstream(file, std::ios::trunc) << "\nsecond line\n";
  config.etcd_password_file = file;
  EXPECT_EQ(EtcdPassword(config).status().code(), StatusCode::kInvalidArgument);  // an empty first line
}

TEST(NodeConfigTest, MembershipOptionsCarryTheFlagsAndTheRuntime) {
  ManagerConfig config = PeerConfig();
  config.etcd_endpoints = "a:1, b:2";
  config.catalog_nodes = "n0,n1";
  config.catalog_replicas = 2;
  const RuntimeId runtime = RuntimeId::New();
  Result<cluster::MembershipOptions> options = MembershipOptionsOf(config, runtime);
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->etcd_endpoints, (std::vector<std::string>{"a:1", "b:2"}));
  EXPECT_EQ(options->catalog_nodes, (std::vector<std::string>{"n0", "n1"}));
  EXPECT_EQ(options->catalog_replicas, 2u);
  EXPECT_EQ(options->node_id, "n0");
  EXPECT_EQ(options->runtime_uuid, runtime.ToString());
  config.catalog_nodes = "n0,,n1";
  Result<cluster::MembershipOptions> bad = MembershipOptionsOf(config, runtime);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("--catalog-nodes"), std::string_view::npos) << bad.status();
}

TEST(NodeConfigTest, PeerTlsNeedsAllThreeFilesAndACertificateNamingThisNode) {
  ManagerConfig config = PeerConfig();
  Result<std::optional<cluster::TlsFiles>> none = PeerTlsFiles(config);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_FALSE(none->has_value());
  orbitkv::testing::TempDir dir;
  ASSERT_TRUE(cluster::testing::MakeTestCertificates(dir.path()).ok());
  ASSERT_TRUE(cluster::testing::MakeNodeCertificate(dir.path(), "n1").ok());
  config.peer_tls_cert = dir.path() + "/node-n1.pem";
  EXPECT_EQ(PeerTlsFiles(config).status().code(), StatusCode::kInvalidArgument);  // one of three
  config.peer_tls_key = dir.path() + "/node-n1.key";
  config.peer_tls_ca = dir.path() + "/ca.pem";
  Result<std::shared_ptr<grpc::ServerCredentials>> other = PeerServerCredentials(config);
  ASSERT_FALSE(other.ok());
  EXPECT_EQ(other.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(other.status().message().find("URI:orbitkv-node:n0"), std::string_view::npos) << other.status();
  ASSERT_TRUE(cluster::testing::MakeNodeCertificate(dir.path(), "n0").ok());
  config.peer_tls_cert = dir.path() + "/node-n0.pem";
  config.peer_tls_key = dir.path() + "/node-n0.key";
  Result<std::shared_ptr<grpc::ServerCredentials>> own = PeerServerCredentials(config);
  ASSERT_TRUE(own.ok()) << own.status();
  EXPECT_NE(*own, nullptr);
}

// --- registration hooks ------------------------------------------------------------------------------------------

TEST(RegistrationHooksTest, HooksRunUntilClearedAndClearingWaitsForARunningOne) {
  auto hooks = std::make_shared<RegistrationHooks>();
  hooks->Lapsed("nothing set");  // no-op
  std::atomic<int> lapsed{0};
  std::promise<void> entered;
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  hooks->Set(
      [&](const std::string& cause) {
        if (cause == "slow") {
          entered.set_value();
          released.wait();
        }
        lapsed.fetch_add(1);
      },
      nullptr);
  hooks->Lapsed("quick");
  EXPECT_EQ(lapsed.load(), 1);
  std::thread slow([&] { hooks->Lapsed("slow"); });
  entered.get_future().wait();
  std::atomic<bool> cleared{false};
  std::thread clear([&] {
    { RegistrationHooks::ClearOnExit guard(hooks); }
    cleared.store(true);
  });
  std::this_thread::sleep_for(milliseconds(50));
  EXPECT_FALSE(cleared.load());  // the running hook holds it
  release.set_value();
  slow.join();
  clear.join();
  EXPECT_TRUE(cleared.load());
  EXPECT_EQ(lapsed.load(), 2);
  hooks->Lapsed("after");  // cleared: nothing runs
  hooks->Registered(cluster::MemberRecord{});
  EXPECT_EQ(lapsed.load(), 2);
}

// --- the catalog host --------------------------------------------------------------------------------------------

class CatalogHostTest : public ::testing::Test {
 protected:
  void SetUp() override {
    core::ResidencyInventory::Options options;
    options.incarnation = runtime_.incarnation();
    options.shards = cluster::kNumShards;
    auto inventory = core::ResidencyInventory::Create(options, &metrics_);
    ASSERT_TRUE(inventory.ok()) << inventory.status();
    inventory_ = std::move(*inventory);
    Result<cluster::Placement> placement = cluster::Placement::Create({"n0"}, 1);
    ASSERT_TRUE(placement.ok()) << placement.status();
    live_ = std::make_unique<cluster::LivePlacement>(*placement);
    self_ = cluster::MemberRecord{"t", "n0", 1, "127.0.0.1:1", runtime_.ToString(), runtime_.incarnation()};
    std::map<std::string, cluster::Member> members;
    cluster::Member me;
    me.record = self_;
    members.emplace("n0", me);
    view_.Install(std::move(members), 1);
  }

  // Waits up to 10 s for `done`.
  template <typename F>
  bool Eventually(F done) {
    for (int i = 0; i < 1000; ++i) {
      if (done()) return true;
      std::this_thread::sleep_for(milliseconds(10));
    }
    return done();
  }

  MetricsRegistry metrics_;
  RuntimeId runtime_ = RuntimeId::New();
  std::unique_ptr<core::ResidencyInventory> inventory_;
  std::unique_ptr<cluster::LivePlacement> live_;
  cluster::MemberView view_;
  cluster::MemberRecord self_;
};

TEST_F(CatalogHostTest, EveryShardPlacedHereIsListedAndIncompleteBeforeAnyStream) {
  CatalogHost host({.node_id = "n0", .incarnation = runtime_.incarnation()}, &view_, live_.get(), inventory_.get());
  const std::vector<std::string> lines = host.CatalogStatusLines();
  ASSERT_EQ(lines.size(), cluster::kNumShards);
  for (const std::string& line : lines) EXPECT_NE(line.find(" incomplete "), std::string::npos) << line;
  const CatalogHost::Summary s = host.Summarize();
  EXPECT_EQ(s.hosted, cluster::kNumShards);
  EXPECT_EQ(s.streams, 0u);
  EXPECT_EQ(s.records, 0u);
}

TEST_F(CatalogHostTest, ItsOwnStreamsBringTheInventoryIntoItsStoreAndContinueAcrossRegistrations) {
  const state::StateKey key = core::testing::ChainKey(7, 0);
  const uint32_t shard = inventory_->ShardFor(key);
  inventory_->Apply(shard, key, core::Tier::kDram, true, core::TransitionCause::kAdmit, 1, 4096);
  CatalogHost host({.node_id = "n0", .incarnation = runtime_.incarnation(), .budget_bytes = 1 << 20}, &view_,
                   live_.get(), inventory_.get());
  ASSERT_TRUE(host.StartStreams(nullptr, self_).ok());
  ASSERT_TRUE(Eventually([&] {
    const CatalogHost::Summary s = host.Summarize();
    return s.streams == cluster::kNumShards && s.converged == cluster::kNumShards && s.records == 1 &&
           s.incomplete == 0;
  })) << "streams "
      << host.Summarize().streams << ", converged " << host.Summarize().converged << ", records "
      << host.Summarize().records << ", incomplete " << host.Summarize().incomplete;
  const std::vector<std::string> dump = host.CatalogLines(shard);
  ASSERT_EQ(dump.size(), 1u);
  EXPECT_EQ(dump[0].rfind("n0 ", 0), 0u) << dump[0];  // the owner node first
  EXPECT_EQ(host.Summarize().inventory_records, 1u);

  // Issue 69: the registration lapses (the streams pause) and is made again without a restart: a new runtime UUID
  // and epoch, the same inventory and so the same start. The streams continue from their acknowledged sequences:
  // no snapshot, the slices kept (never incomplete), and a change made meanwhile arrives as a delta.
  const uint64_t snapshots = host.Summarize().snapshots;
  host.PauseStreams();
  EXPECT_EQ(host.Summarize().streams, cluster::kNumShards);
  const state::StateKey later = core::testing::ChainKey(7, 1);
  inventory_->Apply(inventory_->ShardFor(later), later, core::Tier::kDram, true, core::TransitionCause::kAdmit, 1,
                    4096);
  cluster::MemberRecord again = self_;
  again.runtime_uuid = cluster::NewRuntimeUuid();
  again.epoch = 2;
  cluster::Member member;
  member.record = again;
  view_.Install({{"n0", member}}, 2);
  ASSERT_TRUE(host.StartStreams(nullptr, again).ok());
  ASSERT_TRUE(Eventually([&] {
    const CatalogHost::Summary s = host.Summarize();
    return s.records == 2 && s.incomplete == 0 && s.converged == cluster::kNumShards;
  })) << "records "
      << host.Summarize().records << ", incomplete " << host.Summarize().incomplete;
  EXPECT_EQ(host.Summarize().snapshots, snapshots) << "a registration made again resent the inventory";
  EXPECT_EQ(host.Summarize().continued, cluster::kNumShards);
  EXPECT_GE(host.store()->continuations(), 1u);
  for (const catalog::CatalogStore::OwnerSlice& slice : host.store()->Slices(shard)) {
    EXPECT_EQ(slice.owner_runtime, again.runtime_uuid);
  }

  host.StopStreams();
  EXPECT_EQ(host.Summarize().streams, 0u);
  EXPECT_GE(host.Summarize().snapshots, static_cast<uint64_t>(cluster::kNumShards));  // counted past their stop
  // Streams stopped for good (a fence, a shutdown) start anew: each snapshots its shard first.
  ASSERT_TRUE(host.StartStreams(nullptr, again).ok());
  EXPECT_EQ(host.Summarize().streams, cluster::kNumShards);
  ASSERT_TRUE(Eventually([&] { return host.Summarize().snapshots >= snapshots + cluster::kNumShards; }));
}

// Issue 84, item 5: when the placement drops a copy whose peer never answers, the owner streams to it are stopped
// and joined without the lock that the figures (`orbitkv stats`) take: a stream stuck in a call to that copy (up to
// its deadline) delays nothing that reads them.
TEST_F(CatalogHostTest, StreamsToADroppedCopyThatNeverAnswersEndWithoutHoldingUpTheFigures) {
  catalog::testing::HoldingPeer hung;
  catalog::testing::LoopbackServer server = catalog::testing::StartLoopbackServer({&hung});
  ASSERT_NE(server.server, nullptr);
  Result<cluster::Placement> both = cluster::Placement::Create({"n0", "n1"}, 2);
  ASSERT_TRUE(both.ok());
  cluster::LivePlacement live(*both);
  cluster::Member me;
  me.record = self_;
  cluster::Member peer;
  peer.record = cluster::MemberRecord{"t", "n1", 1, server.endpoint(), cluster::NewRuntimeUuid(), 9};
  view_.Install({{"n0", me}, {"n1", peer}}, 2);
  CatalogHost host({.node_id = "n0", .incarnation = runtime_.incarnation()}, &view_, &live, inventory_.get());
  ASSERT_TRUE(host.StartStreams(nullptr, self_).ok());
  ASSERT_EQ(host.Summarize().streams, 2 * cluster::kNumShards);
  ASSERT_TRUE(Eventually([&] { return hung.held.load() > 0; })) << "no stream reached the hung copy";

  // Generation 2 keeps every shard on n0 alone: the streams to n1 go. Every one of them is stuck in its call until
  // the test lets the copy answer, which a helper does after 3 s at the latest (the calls' own deadline is 5 s).
  Result<cluster::Placement> alone = cluster::Placement::Create({"n0"}, 1, 2);
  ASSERT_TRUE(alone.ok());
  ASSERT_EQ(live.Apply({{std::string(cluster::kPlacementRecordName), alone->Encode()}}), "");
  std::atomic<bool> done{false};
  std::thread releaser([&] {
    for (int i = 0; i < 300 && !done.load(); ++i) std::this_thread::sleep_for(milliseconds(10));
    hung.released.store(true);
  });
  // Until the copy is let go: the figures show the streams to n1 gone while those are still stuck in their calls.
  bool seen_while_held = false;
  while (!seen_while_held && !hung.released.load()) {
    const bool released = hung.released.load();
    const CatalogHost::Summary s = host.Summarize();  // what `orbitkv stats` reads
    seen_while_held = s.streams == cluster::kNumShards && !released;
    std::this_thread::sleep_for(milliseconds(1));
  }
  done.store(true);
  releaser.join();
  EXPECT_TRUE(seen_while_held) << "the figures waited for the streams stuck in calls to the dropped copy";
  EXPECT_EQ(host.Summarize().streams, cluster::kNumShards);
  host.StopStreams();
  server.server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
}

// --- the source and the requester --------------------------------------------------------------------------------

constexpr uint64_t kBlock = 64 << 10;

// A cache and a UCX engine (tcp on loopback) with the pool's arenas registered, as a Manager has them.
class NodeSideTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto options = core::testing::SmallCacheOptions(16ull << 20, 1ull << 20);
    options.incarnation = runtime_.incarnation();
    auto cache = core::BlockCache::Create(options, &metrics_);
    ASSERT_TRUE(cache.ok()) << cache.status();
    cache_ = std::move(*cache);
    transfer::UcxEngineOptions engine;
    engine.transports = "tcp";
    engine.require_grants = true;
    engine.engine_id = runtime_.incarnation();
    auto created = transfer::UcxTransferEngine::Create(engine);
    ASSERT_TRUE(created.ok()) << created.status();
    engine_ = std::move(*created);
    for (size_t i = 0; i < cache_->pool().arena_count(); ++i) {
      auto region = engine_->RegisterRegion(cache_->pool().arena(i).data(), cache_->pool().arena(i).size());
      ASSERT_TRUE(region.ok()) << region.status();
      arenas_.push_back(*region);
    }
  }
  void TearDown() override { engine_.reset(); }

  // Saves one block and names its exact version, as a requester's lookup would.
  catalog::SourceBlockVersion SaveBlock(uint64_t chain) {
    const state::StateKey key = core::testing::ChainKey(chain, 0);
    auto writer = cache_->Prepare(key, kBlock);
    EXPECT_TRUE(writer.ok()) << writer.status();
    const uint64_t generation = cache_->Seal(*writer);
    auto pin = cache_->table().Pin(key);
    EXPECT_TRUE(pin.ok());
    return catalog::SourceBlockVersion{key, generation, pin->sequence()};
  }

  void InstallView(const std::string& requester_runtime) {
    std::map<std::string, cluster::Member> members;
    cluster::Member m;
    m.record = cluster::MemberRecord{"t", "r", 1, "127.0.0.1:1", requester_runtime};
    members.emplace("r", m);
    view_.Install(std::move(members), ++revision_);
  }

  template <typename F>
  bool Eventually(F done) {
    for (int i = 0; i < 1000 && !done(); ++i) std::this_thread::sleep_for(milliseconds(10));
    return done();
  }

  MetricsRegistry metrics_;
  RuntimeId runtime_ = RuntimeId::New();
  std::unique_ptr<core::BlockCache> cache_;
  std::unique_ptr<transfer::UcxTransferEngine> engine_;
  std::vector<transfer::RegionHandle> arenas_;
  cluster::MemberView view_;
  int64_t revision_ = 0;
};

TEST_F(NodeSideTest, ASourceGrantsUntilItsRegistrationLapsesAndItsUpkeepFreesAVanishedRequestersHolds) {
  const std::string requester = RuntimeId::New().ToString();
  InstallView(requester);
  Source source(PeerConfig(), cache_.get(), nullptr, engine_.get(), arenas_, &metrics_);
  catalog::AuthorizeArgs args{.peer_node = "r", .peer_runtime = requester, .request_id = 1, .blocks = {SaveBlock(1)}};
  Result<catalog::SourceGrant> granted = source.holds()->Authorize(args);
  ASSERT_TRUE(granted.ok()) << granted.status();
  EXPECT_EQ(granted->outcome, catalog::SourceOutcome::kGranted);
  // The registration lapsed: every grant goes, and none is given until a new registration.
  source.OnLapsed("testing");
  args.request_id = 2;
  EXPECT_EQ(source.holds()->Authorize(args).status().code(), StatusCode::kFailedPrecondition);
  source.OnRegistered();
  Result<catalog::SourceGrant> again = source.holds()->Authorize(args);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->outcome, catalog::SourceOutcome::kGranted);
  const auto sessions = [&] {
    JsonStatsWriter json;
    source.VisitStats(json);
    return json.json();
  };
  // The lapsed grant is quarantined until the engine says it drained (on its own thread), then freed.
  EXPECT_TRUE(Eventually([&] { return sessions().find("\"source_sessions\": 1,") != std::string::npos; }))
      << sessions();
  {
    SourceUpkeep upkeep(source.holds(), &view_, milliseconds(10));
    std::this_thread::sleep_for(milliseconds(50));
    EXPECT_NE(sessions().find("\"source_sessions\": 1"), std::string::npos) << "its requester is still a member";
    InstallView(RuntimeId::New().ToString());  // the requester restarted: its old start is gone
    EXPECT_TRUE(Eventually([&] { return sessions().find("\"source_sessions\": 0") != std::string::npos; }))
        << sessions();
  }
  EXPECT_EQ(cache_->table().Stats().pinned_blocks, 0u);
}

TEST_F(NodeSideTest, ARequesterStagesNothingWhileRemoteWorkIsOffAndVisitsItsFigures) {
  Result<cluster::Placement> placement = cluster::Placement::Create({"n0"}, 1);
  ASSERT_TRUE(placement.ok()) << placement.status();
  cluster::LivePlacement live(*placement);
  std::atomic<bool> can_work{false};
  ManagerConfig config = PeerConfig();
  config.remote_fetch_workers = 3;
  Requester requester(config,
                      Requester::Parts{.self = catalog::PeerIdentity{"t", "n0", runtime_.ToString(), 1, "fp"},
                                       .view = &view_,
                                       .live = &live,
                                       .can_work = [&can_work] { return can_work.load(); },
                                       .cache = cache_.get(),
                                       .engine = engine_.get(),
                                       .arenas = arenas_},
                      &metrics_);
  EXPECT_FALSE(requester.Stage(core::testing::Chain(5, 4)).has_value());
  JsonStatsWriter json;
  requester.VisitStats(json);
  for (const char* key : {"\"remote_fetch_workers\": 3", "\"remote_fetches\": 0", "\"candidate_index_entries\": 0",
                          "\"remote_releases_pending\": 0", "\"discovery_failovers\": 0"}) {
    EXPECT_NE(json.json().find(key), std::string::npos) << key << " in " << json.json();
  }
  // The figures with a metric reach /metrics through a collector, read when scraped.
  auto collector = metrics_.AddCollector([&requester](StatsVisitor& v) { requester.VisitStats(v); });
  const std::string text = metrics_.RenderPrometheus();
  EXPECT_NE(text.find("# TYPE orbitkv_remote_fetches_total counter\norbitkv_remote_fetches_total 0\n"),
            std::string::npos);
  EXPECT_NE(text.find("orbitkv_candidate_index_entries 0\n"), std::string::npos);
}

// --- the peer listener -------------------------------------------------------------------------------------------

class PeerListenerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Result<cluster::Placement> placement = cluster::Placement::Create({"n0"}, 1);
    ASSERT_TRUE(placement.ok()) << placement.status();
    live_ = std::make_unique<cluster::LivePlacement>(*placement);
    self_ = cluster::MemberRecord{"t", "n0", 1, "127.0.0.1:1", runtime_.ToString(), runtime_.incarnation()};
    peer_ = cluster::MemberRecord{"t", "n1", 1, "127.0.0.1:2", RuntimeId::New().ToString()};
    std::map<std::string, cluster::Member> members;
    for (const cluster::MemberRecord& record : {self_, peer_}) {
      cluster::Member m;
      m.record = record;
      members.emplace(record.node_id, m);
    }
    view_.Install(std::move(members), 1);
  }

  PeerListener::Parts Parts() {
    return PeerListener::Parts{.self = PeerIdentityOf(self_, *live_),
                               .incarnation = runtime_.incarnation(),
                               .ucx_worker_address = "ucx-address",
                               .view = &view_,
                               .live = live_.get(),
                               .remote_off = [] { return std::string("testing"); }};
  }

  RuntimeId runtime_ = RuntimeId::New();
  std::unique_ptr<cluster::LivePlacement> live_;
  cluster::MemberView view_;
  cluster::MemberRecord self_;
  cluster::MemberRecord peer_;
};

TEST_F(PeerListenerTest, AnswersHealthAsThisStartOnItsAddress) {
  ManagerConfig config = PeerConfig();
  config.peer_listen = "127.0.0.1:0";
  Result<std::unique_ptr<PeerListener>> listener = PeerListener::Start(config, Parts());
  ASSERT_TRUE(listener.ok()) << listener.status();
  EXPECT_FALSE((*listener)->tls());
  ASSERT_NE((*listener)->port(), 0);
  auto stub = catalog::NewPeerStub(fmt::format("127.0.0.1:{}", (*listener)->port()), nullptr);
  peer::v1::HealthRequest request;
  *request.mutable_route() = catalog::MakeRoute(PeerIdentityOf(peer_, *live_), self_);
  peer::v1::HealthResponse response;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  const grpc::Status status = stub->Health(&context, request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.runtime_uuid(), runtime_.ToString());
  EXPECT_EQ(response.ucx_worker_address(), "ucx-address");
}

TEST_F(PeerListenerTest, AnAddressNotOfThisHostNamesTheFlags) {
  ManagerConfig config = PeerConfig();
  config.peer_listen = "192.0.2.1:0";  // TEST-NET-1: no interface of this host has it
  Result<std::unique_ptr<PeerListener>> listener = PeerListener::Start(config, Parts());
  ASSERT_FALSE(listener.ok());
  EXPECT_EQ(listener.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(listener.status().message().find("--peer-listen"), std::string_view::npos) << listener.status();
}

TEST_F(PeerListenerTest, IncompleteTlsFilesAreRefusedBeforeBinding) {
  ManagerConfig config = PeerConfig();
  config.peer_listen = "127.0.0.1:0";
  config.peer_tls_ca = "/nonexistent/ca.pem";
  Result<std::unique_ptr<PeerListener>> listener = PeerListener::Start(config, Parts());
  ASSERT_FALSE(listener.ok());
  EXPECT_EQ(listener.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(listener.status().message().find("--peer-tls-cert"), std::string_view::npos) << listener.status();
}

}  // namespace
}  // namespace orbitkv::server
