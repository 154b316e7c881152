// PeerService over a real gRPC server on loopback: Health answers who this start is, and the route check
// refuses before the handler does anything, with the status code and reason on the wire.
#include "catalog/peer_service.h"

#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <memory>
#include <set>
#include <thread>

#include "catalog/peer_directory.h"
#include "catalog/testing/loopback_server.h"
#include "core/test_util.h"

namespace orbitkv::catalog {
namespace {

class PeerServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::map<std::string, cluster::Member> members;
    for (auto [node, uuid] : {std::pair{"a", "uuid-a"}, std::pair{"b", "uuid-b"}}) {
      cluster::Member m;
      m.record = cluster::MemberRecord{"c1", node, 1, std::string(node) + ":7100", uuid};
      members.emplace(node, m);
    }
    view_.Install(std::move(members), 5);
    PeerService::Options options;
    options.self = PeerIdentity{"c1", "b", "uuid-b", 1, "fp"};
    options.incarnation = 42;
    options.ucx_worker_address = std::string("\x01\x02", 2);
    options.capabilities = {"health"};
    options.catalog = &store_;
    options.hosts_shard = [](uint32_t shard) { return shard == 3; };
    options.serves_generation = [](int64_t generation) { return generation == 1; };
    service_ = std::make_unique<PeerService>(options, &view_);
    testing::LoopbackServer loopback = testing::StartLoopbackServer({service_.get()});
    server_ = std::move(loopback.server);
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(loopback.port, 0);
    stub_ = peer::v1::Peer::NewStub(grpc::CreateChannel(loopback.endpoint(), grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    if (server_) server_->Shutdown();
  }
  grpc::Status Health(const peer::v1::RouteHeader& route, peer::v1::HealthResponse* response) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    peer::v1::HealthRequest request;
    *request.mutable_route() = route;
    return stub_->Health(&context, request, response);
  }
  peer::v1::RouteHeader FromA() const {
    return MakeRoute(PeerIdentity{"c1", "a", "uuid-a", 1, "fp"},
                     cluster::MemberRecord{"c1", "b", 1, "b:7100", "uuid-b"});
  }

  cluster::MemberView view_;
  CatalogStore store_{CatalogStore::Options{.incarnation = 0xc0ffee}};
  std::unique_ptr<PeerService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<peer::v1::Peer::Stub> stub_;
};

TEST_F(PeerServiceTest, HealthNamesThisStart) {
  peer::v1::HealthResponse response;
  grpc::Status status = Health(FromA(), &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.protocol_version(), kPeerProtocolVersion);
  EXPECT_EQ(response.node_id(), "b");
  EXPECT_EQ(response.runtime_uuid(), "uuid-b");
  EXPECT_EQ(response.epoch(), 1);
  EXPECT_EQ(response.incarnation(), 42u);
  EXPECT_EQ(response.ucx_worker_address(), std::string("\x01\x02", 2));
  ASSERT_EQ(response.capabilities_size(), 1);
  EXPECT_EQ(service_->refused(), 0u);
}

TEST_F(PeerServiceTest, ARefusedRouteCarriesItsCodeAndReasonOverTheWire) {
  peer::v1::RouteHeader stale = FromA();
  stale.set_destination_runtime_uuid("uuid-b-before-restart");
  peer::v1::HealthResponse response;
  Status status = FromGrpc(Health(stale, &response));
  EXPECT_EQ(status.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(status.message().find("stale incarnation"), std::string::npos) << status;
  EXPECT_TRUE(response.runtime_uuid().empty());  // the handler did nothing
  peer::v1::RouteHeader stranger = FromA();
  stranger.set_source_node_id("mallory");
  EXPECT_EQ(FromGrpc(Health(stranger, &response)).code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(service_->refused(), 2u);
}

// Issue 55: what a catalog copy holds of a shard, owner by owner, for the placement reconciler: the route is
// checked first, and a shard or a placement generation not kept here is FAILED_PRECONDITION.
TEST_F(PeerServiceTest, CatalogStatusReportsEachOwnersBaselineAndSequence) {
  const StreamId a{"a", "uuid-a", 3, 0xc0ffee, 1};
  ASSERT_EQ(store_.Begin({a, 1, 0, 2}).kind, CatalogReply::Kind::kAck);
  SnapshotEnd end{a, 1, 2, {}};
  for (uint64_t i = 0; i < 2; ++i) {
    end.interval.push_back(CatalogRecord{core::testing::ChainKey(5, i), 1, true, i + 1, 1, 4096});
  }
  ASSERT_EQ(store_.End(end).kind, CatalogReply::Kind::kAck);
  ASSERT_EQ(store_.Apply({a, 3, {CatalogRecord{core::testing::ChainKey(5, 9), 1, true, 3, 1, 4096}}}).kind,
            CatalogReply::Kind::kAck);
  const StreamId b{"b", "uuid-b", 3, 0xc0ffee, 1};
  ASSERT_EQ(store_.Begin({b, 1, 0, 1}).kind, CatalogReply::Kind::kAck);  // building: no baseline yet
  auto ask = [&](uint32_t shard, int64_t generation, const peer::v1::RouteHeader& route,
                 peer::v1::CatalogStatusResponse* response) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    peer::v1::CatalogStatusRequest request;
    *request.mutable_route() = route;
    request.set_shard(shard);
    request.set_generation(generation);
    return FromGrpc(stub_->CatalogStatus(&context, request, response));
  };
  peer::v1::CatalogStatusResponse response;
  ASSERT_TRUE(ask(3, 1, FromA(), &response).ok());
  ASSERT_EQ(response.owners_size(), 2);
  EXPECT_EQ(response.owners(0).owner_node(), "a");
  EXPECT_TRUE(response.owners(0).baseline());
  EXPECT_EQ(response.owners(0).sequence(), 3u);
  EXPECT_EQ(response.owners(1).owner_node(), "b");
  EXPECT_FALSE(response.owners(1).baseline());
  EXPECT_FALSE(response.complete());  // b's snapshot is still being built
  EXPECT_EQ(ask(4, 1, FromA(), &response).code(), StatusCode::kFailedPrecondition);
  const Status generation = ask(3, 2, FromA(), &response);
  EXPECT_EQ(generation.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(generation.message().find("does not serve placement generation 2"), std::string::npos) << generation;
  peer::v1::RouteHeader stranger = FromA();
  stranger.set_source_node_id("mallory");
  EXPECT_EQ(ask(3, 1, stranger, &response).code(), StatusCode::kPermissionDenied);
}

// A Health that takes its time and counts how many probes reach it at once (the peers of a large cluster, all
// answering from one server here).
class SlowHealth final : public peer::v1::Peer::Service {
 public:
  grpc::Status Health(grpc::ServerContext*, const peer::v1::HealthRequest* request,
                      peer::v1::HealthResponse* response) override {
    const int now = ++in_flight;
    for (int seen = max_in_flight.load(); now > seen && !max_in_flight.compare_exchange_weak(seen, now);) {
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    --in_flight;
    ++answered;
    response->set_protocol_version(kPeerProtocolVersion);
    response->set_node_id(request->route().destination_node_id());
    response->set_runtime_uuid(request->route().destination_runtime_uuid());
    return grpc::Status::OK;
  }
  std::atomic<int> in_flight{0}, max_in_flight{0}, answered{0};
};

// Issue 52, item 3: one probe round over 48 members runs in parallel, never more than max_probes_in_flight at
// once, and learns every member.
TEST(PeerDirectoryTest, AProbeRoundRunsInParallelWithinItsBound) {
  SlowHealth health;
  testing::LoopbackServer loopback = testing::StartLoopbackServer({&health});
  std::unique_ptr<grpc::Server>& server = loopback.server;
  const int port = loopback.port;
  ASSERT_NE(server, nullptr);
  cluster::MemberView view;
  std::map<std::string, cluster::Member> members;
  for (int i = 0; i < 48; ++i) {
    cluster::Member m;
    const std::string node = "n" + std::to_string(i);
    m.record = cluster::MemberRecord{"c1", node, 1, "127.0.0.1:" + std::to_string(port), "uuid-" + node};
    members.emplace(node, m);
  }
  view.Install(std::move(members), 1);
  PeerDirectory::Options options;
  options.self = PeerIdentity{"c1", "self", "uuid-self", 1, "fp"};
  options.max_probes_in_flight = 8;
  PeerDirectory directory(options, &view);
  directory.ProbeAll();
  EXPECT_EQ(health.answered.load(), 48);
  EXPECT_LE(health.max_in_flight.load(), 8);
  EXPECT_LE(directory.max_probes_seen(), 8u);
  EXPECT_GE(directory.max_probes_seen(), 2u);  // not one after another
  const std::vector<PeerDirectory::Peer> peers = directory.Peers();
  ASSERT_EQ(peers.size(), 48u);
  for (const auto& peer : peers) EXPECT_EQ(peer.health, PeerDirectory::Health::kHealthy) << peer.reason;
  server->Shutdown();
}

// Issue 70, item 2: a Manager probes the peers it talks to, not the fleet: the catalog hosts (always_probe) and the
// peers that used it within use_window, at most max_probes_per_round a round (the rest in the next rounds, what
// earlier rounds learnt kept meanwhile). Probes per round stay flat however many members the view holds.
TEST(PeerDirectoryTest, OnlyCatalogHostsAndRecentPeersAreProbedWithinABoundPerRound) {
  SlowHealth health;
  testing::LoopbackServer loopback = testing::StartLoopbackServer({&health});
  ASSERT_NE(loopback.server, nullptr);
  for (const int fleet : {64, 512}) {
    SCOPED_TRACE(fleet);
    cluster::MemberView view;
    std::map<std::string, cluster::Member> members;
    for (int i = 0; i < fleet; ++i) {
      cluster::Member m;
      const std::string node = "n" + std::to_string(i);
      m.record = cluster::MemberRecord{"c1", node, 1, "127.0.0.1:" + std::to_string(loopback.port), "uuid-" + node};
      members.emplace(node, m);
    }
    view.Install(std::move(members), 1);
    PeerDirectory::Options options;
    options.self = PeerIdentity{"c1", "n0", "uuid-n0", 1, "fp"};
    options.always_probe = [] { return std::vector<std::string>{"n0", "n1", "n2", "n3"}; };  // n0 is this Manager
    options.use_window = std::chrono::milliseconds(300);
    options.max_probes_per_round = 4;
    PeerDirectory directory(options, &view);
    directory.ProbeAll();
    EXPECT_EQ(directory.probes_sent(), 3u);  // the three other catalog hosts
    EXPECT_EQ(directory.Peers().size(), 3u);
    // Three peers talked to this Manager: six due, four probed this round, the other two next round.
    for (const char* node : {"n10", "n11", "n12"}) directory.Use(node);
    directory.ProbeAll();
    EXPECT_EQ(directory.probes_sent(), 7u);
    directory.ProbeAll();
    EXPECT_EQ(directory.probes_sent(), 11u);
    std::set<std::string> known;
    for (const auto& peer : directory.Peers()) known.insert(peer.node_id);
    EXPECT_EQ(known, (std::set<std::string>{"n1", "n2", "n3", "n10", "n11", "n12"}));
    // Past the window the peers that stopped talking are no longer probed, nor listed.
    std::this_thread::sleep_for(std::chrono::milliseconds(350));
    directory.ProbeAll();
    EXPECT_EQ(directory.probes_sent(), 14u);
    EXPECT_EQ(directory.Peers().size(), 3u);
    EXPECT_EQ(directory.incompatibility(), "");
  }
  loopback.server->Shutdown();
}

}  // namespace
}  // namespace orbitkv::catalog
