// A real orbitkv-manager joining a cluster registered in a real etcd: membership state, epoch, view
// and the remote-work gate reach `orbitkv status`, and a duplicate Node ID refuses to start.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <regex>
#include <string>
#include <thread>

#include "catalog/peer_service.h"  // first of the gRPC users (cluster/grpc.h)

#include "base/runtime_id.h"
#include "catalog/testing/loopback_server.h"
#include "client/cache_client.h"
#include "cluster/cluster_keys.h"
#include "cluster/etcd_client.h"
#include "cluster/member_record.h"
#include "cluster/membership.h"
#include "cluster/testing/etcd_process.h"
#include "cluster/testing/test_certs.h"
#include "distributed_util.h"
#include "manager_process.h"
#include "transfer/test_util.h"
#include "transfer/ucx_engine.h"

namespace orbitkv {
namespace {

using testing::CliOutput;
using testing::Health;
using testing::Loopback;
using testing::ManagerProcess;
using testing::RecordedRuntimeUuid;
using testing::RecordOf;
using testing::StatsOf;
using testing::StringField;

// One runtime identity per start: the stats, /metrics, the inventory's incarnation and the member
// record in etcd all carry it, and a restarted Manager has a new one.
TEST(DistributedManagerTest, OneRuntimeIdentityEverywhereAndANewOneAfterARestart) {
  auto etcd = cluster::testing::EtcdProcess::StartSingle(Deadline::After(std::chrono::seconds(60)));
  ASSERT_TRUE(etcd.ok()) << etcd.status();
  const std::vector<std::string> flags = {"--etcd-endpoints", (*etcd)->endpoint(),
                                          "--cluster-name",   "it",
                                          "--node-id",        "node-r",
                                          "--catalog-nodes",  "node-r",
                                          "--peer-endpoint",  fmt::format("127.0.0.1:{}", testing::FreeLoopbackPort())};
  std::string first_uuid;
  for (int run = 0; run < 2; ++run) {
    const uint16_t metrics_port = testing::FreeLoopbackPort();
    std::vector<std::string> run_flags = flags;
    run_flags.push_back("--metrics-addr");
    run_flags.push_back(fmt::format("127.0.0.1:{}", metrics_port));
    ManagerProcess manager(run_flags, run == 0 ? "rid-a" : "rid-b");
    ASSERT_TRUE(manager.running()) << manager.LogText();
    const std::string stats = StatsOf(manager);
    const std::string uuid = StringField(stats, "runtime_uuid");
    Result<RuntimeId> id = RuntimeId::Parse(uuid);
    ASSERT_TRUE(id.ok()) << id.status() << "\n" << stats;
    EXPECT_NE(stats.find(fmt::format("\"incarnation\": {},", id->incarnation())), std::string::npos) << stats;
    EXPECT_EQ(RecordedRuntimeUuid((*etcd)->endpoint(), "node-r"), uuid);
    // `orbitkv status` tells an operator the same.
    const std::string status = CliOutput({"status", "--socket", manager.socket()});
    EXPECT_NE(status.find("runtime " + uuid), std::string::npos) << status;
    EXPECT_NE(status.find("membership registered"), std::string::npos) << status;
    const std::string metrics = testing::MetricsText(metrics_port);
    EXPECT_NE(metrics.find(fmt::format("orbitkv_runtime_info{{runtime_uuid=\"{}\"}} 1", uuid)), std::string::npos)
        << metrics;
    if (run == 0) {
      first_uuid = uuid;
      EXPECT_EQ(manager.Stop(SIGTERM), 0);
    } else {
      EXPECT_NE(uuid, first_uuid);
    }
  }
}

TEST(DistributedManagerTest, JoinsTheClusterAndReportsMembership) {
  auto etcd = cluster::testing::EtcdProcess::StartSingle(Deadline::After(std::chrono::seconds(60)));
  ASSERT_TRUE(etcd.ok()) << etcd.status();
  const std::string endpoints = (*etcd)->endpoint();
  ManagerProcess first({"--etcd-endpoints", endpoints, "--cluster-name", "it", "--node-id", "node-a", "--catalog-nodes",
                        "node-a", "--peer-endpoint", Loopback()},
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
  ManagerProcess duplicate({"--etcd-endpoints", endpoints, "--cluster-name", "it", "--node-id", "node-a",
                            "--catalog-nodes", "node-a", "--peer-endpoint", Loopback()},
                           "dist-dup");
  EXPECT_FALSE(duplicate.running());

  // A graceful stop revokes the lease: the Node ID is free again at once, with a new epoch.
  EXPECT_EQ(first.Stop(SIGTERM), 0);
  ManagerProcess again({"--etcd-endpoints", endpoints, "--cluster-name", "it", "--node-id", "node-a", "--catalog-nodes",
                        "node-a", "--peer-endpoint", Loopback()},
                       "dist-again");
  ASSERT_TRUE(again.running()) << again.LogText();
  EXPECT_NE(StatsOf(again).find("\"membership_epoch\": 2"), std::string::npos);
}

// Two Managers with peer listeners: Health answers a member's well-routed request with the runtime
// UUID etcd holds; a stale destination, a stranger and a restarted source's old identity are refused.
TEST(DistributedManagerTest, PeerListenersAnswerHealthAndRefuseBadRoutes) {
  auto etcd = cluster::testing::EtcdProcess::StartSingle(Deadline::After(std::chrono::seconds(60)));
  ASSERT_TRUE(etcd.ok()) << etcd.status();
  const std::string endpoints = (*etcd)->endpoint();
  const std::string peer_a = Loopback(), peer_b = Loopback();
  auto flags = [&](const std::string& node, const std::string& peer) {
    return std::vector<std::string>{"--etcd-endpoints", endpoints,       "--cluster-name",  "it", "--node-id", node,
                                    "--catalog-nodes",  "node-a,node-b", "--peer-endpoint", peer};
  };
  ManagerProcess a(flags("node-a", peer_a), "peer-a");
  ManagerProcess b(flags("node-b", peer_b), "peer-b");
  ASSERT_TRUE(a.running() && b.running()) << a.LogText() << b.LogText();
  std::string stats_b;
  for (int i = 0; i < 500; ++i) {  // the views complete asynchronously after the joins
    stats_b = StatsOf(b);
    if (stats_b.find("\"members\": 2") != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_NE(stats_b.find("\"members\": 2"), std::string::npos) << stats_b;
  EXPECT_NE(stats_b.find("\"peer_listen\": \"" + peer_b + "\""), std::string::npos) << stats_b;
  const std::string placement = StringField(stats_b, "placement_fingerprint");
  ASSERT_FALSE(placement.empty()) << stats_b;
  const cluster::MemberRecord record_a = RecordOf(endpoints, "node-a");
  const cluster::MemberRecord record_b = RecordOf(endpoints, "node-b");
  const catalog::PeerIdentity as_a{"it", "node-a", record_a.runtime_uuid, record_a.epoch, placement};

  peer::v1::HealthResponse health;
  grpc::Status ok = Health(peer_b, catalog::MakeRoute(as_a, record_b), &health);
  ASSERT_TRUE(ok.ok()) << ok.error_message();
  EXPECT_EQ(health.node_id(), "node-b");
  EXPECT_EQ(health.runtime_uuid(), record_b.runtime_uuid);
  EXPECT_EQ(health.runtime_uuid(), StringField(stats_b, "runtime_uuid"));
  EXPECT_EQ(health.epoch(), record_b.epoch);
  // The UCX transfer engine of this start: its address in Health and status, its engine id the runtime
  // incarnation, and it serves nothing outside a grant (no request without one, RMA off).
  const std::string transfer_b = StringField(stats_b, "transfer_listen");
  ASSERT_FALSE(transfer_b.empty()) << stats_b;
  EXPECT_EQ(health.ucx_worker_address(), transfer_b);
  EXPECT_EQ(transfer_b.substr(0, transfer_b.rfind(':')), "127.0.0.1");
  EXPECT_NE(std::find(health.capabilities().begin(), health.capabilities().end(), "transfer.grants"),
            health.capabilities().end());
  EXPECT_EQ(testing::ReadManagersPool(transfer_b, health.incarnation(), 0).code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(testing::ReadManagersPool(transfer_b, health.incarnation(), 0x1234567890abcdefull).code(),
            StatusCode::kPermissionDenied);  // a grant never issued

  peer::v1::RouteHeader stale = catalog::MakeRoute(as_a, record_b);
  stale.set_destination_runtime_uuid(record_a.runtime_uuid);
  EXPECT_EQ(Health(peer_b, stale, &health).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  catalog::PeerIdentity stranger = as_a;
  stranger.node_id = "node-x";
  EXPECT_EQ(Health(peer_b, catalog::MakeRoute(stranger, record_b), &health).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);

  // node-a restarts: a new runtime UUID; its old identity is refused by its peer.
  EXPECT_EQ(a.Stop(SIGTERM), 0);
  ManagerProcess a2(flags("node-a", Loopback()), "peer-a2");
  ASSERT_TRUE(a2.running()) << a2.LogText();
  for (int i = 0; i < 500 && RecordOf(endpoints, "node-a").runtime_uuid == record_a.runtime_uuid; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const cluster::MemberRecord record_a2 = RecordOf(endpoints, "node-a");
  ASSERT_NE(record_a2.runtime_uuid, record_a.runtime_uuid);
  grpc::Status old = grpc::Status::OK;
  for (int i = 0; i < 500; ++i) {  // until b's view has the new record
    old = Health(peer_b, catalog::MakeRoute(as_a, record_b), &health);
    if (old.error_code() == grpc::StatusCode::PERMISSION_DENIED) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(old.error_code(), grpc::StatusCode::PERMISSION_DENIED) << old.error_message();
  const catalog::PeerIdentity as_a2{"it", "node-a", record_a2.runtime_uuid, record_a2.epoch, placement};
  EXPECT_TRUE(Health(peer_b, catalog::MakeRoute(as_a2, record_b), &health).ok());
  EXPECT_NE(StatsOf(b).find("\"peer_refused\": "), std::string::npos);
}

// A peer of another OrbitKV version: a registered member whose Health answers (or refuses) with
// another protocol version. The real Manager cannot be made to speak another version, so the test
// plays that member: it joins the cluster through the real membership code and serves Health.
class OtherVersionPeer final : public peer::v1::Peer::Service {
 public:
  // kAnswersNext: Health answers with the next protocol version; kRefusesThis: Health refuses this Manager's
  // version; kSpeaksThis: upgraded to this version.
  enum class Mode { kAnswersNext, kRefusesThis, kSpeaksThis };
  std::atomic<Mode> mode{Mode::kAnswersNext};
  std::string node_id, runtime_uuid;
  grpc::Status Health(grpc::ServerContext*, const peer::v1::HealthRequest* request,
                      peer::v1::HealthResponse* response) override {
    if (mode == Mode::kRefusesThis) {
      // As the route check of a Manager of that version refuses (catalog/route.cc): the reason is what counts.
      return catalog::ToGrpc(
          Status::FailedPrecondition(fmt::format("peer protocol version {} from node '{}', this Manager speaks {}",
                                                 request->route().protocol_version(), request->route().source_node_id(),
                                                 catalog::kPeerProtocolVersion + 1))
              .WithReason(StatusReason::kPeerProtocolVersion));
    }
    response->set_protocol_version(mode == Mode::kAnswersNext ? catalog::kPeerProtocolVersion + 1
                                                              : catalog::kPeerProtocolVersion);
    response->set_node_id(node_id);
    response->set_runtime_uuid(runtime_uuid);
    return grpc::Status::OK;
  }
};

TEST(DistributedManagerTest, APeerOfAnotherProtocolVersionTurnsRemoteWorkOffAndLocalServiceGoesOn) {
  auto etcd = cluster::testing::EtcdProcess::StartSingle(Deadline::After(std::chrono::seconds(60)));
  ASSERT_TRUE(etcd.ok()) << etcd.status();
  const std::string endpoints = (*etcd)->endpoint();
  const uint16_t metrics_port = testing::FreeLoopbackPort();
  ManagerProcess a(
      {"--etcd-endpoints", endpoints, "--cluster-name", "it", "--node-id", "node-a", "--catalog-nodes", "node-a,node-x",
       "--peer-endpoint", Loopback(), "--metrics-addr", fmt::format("127.0.0.1:{}", metrics_port)},
      "ver-a");
  ASSERT_TRUE(a.running()) << a.LogText();

  // A member played by the test: `peer` serves its Health on a loopback port, and it joins as `node` through the
  // real membership code.
  MetricsRegistry registry;
  auto join_as = [&](const std::string& node, OtherVersionPeer& peer,
                     catalog::testing::LoopbackServer& listener) -> std::unique_ptr<cluster::Membership> {
    listener = catalog::testing::StartLoopbackServer({&peer});
    if (listener.server == nullptr) return nullptr;
    cluster::MembershipOptions options;
    options.etcd_endpoints = {endpoints};
    options.cluster_name = "it";
    options.node_id = node;
    options.catalog_nodes = {"node-a", "node-x"};
    options.peer_endpoint = listener.endpoint();
    options.runtime_uuid = RuntimeId::New().ToString();
    peer.node_id = node;
    peer.runtime_uuid = options.runtime_uuid;
    auto membership = cluster::Membership::Create(options, &registry);
    if (!membership.ok() || !(*membership)->Join(Deadline::After(std::chrono::seconds(30))).ok()) return nullptr;
    return std::move(*membership);
  };
  OtherVersionPeer other;
  catalog::testing::LoopbackServer other_listener;
  std::unique_ptr<cluster::Membership> membership = join_as("node-x", other, other_listener);
  ASSERT_NE(membership, nullptr);

  auto await = [&](const std::string& needle) {
    std::string stats;
    for (int i = 0; i < 750; ++i) {  // the view, then the next probe (every 2 s)
      stats = StatsOf(a);
      if (stats.find(needle) != std::string::npos) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return stats;
  };
  std::string stats = await("\"peers_incompatible\": 1");
  EXPECT_NE(stats.find("\"peers_incompatible\": 1"), std::string::npos) << stats;
  EXPECT_NE(stats.find("\"remote_work\": 0"), std::string::npos) << stats;
  EXPECT_NE(StringField(stats, "remote_work_off_reason")
                .find(fmt::format("speaks orbitkv.peer v{}", catalog::kPeerProtocolVersion + 1)),
            std::string::npos)
      << stats;
  EXPECT_NE(testing::MetricsText(metrics_port).find("orbitkv_membership_remote_work_enabled 0"), std::string::npos);
  EXPECT_NE(CliOutput({"status", "--socket", a.socket()}).find("remote work off: node 'node-x' speaks"),
            std::string::npos)
      << CliOutput({"status", "--socket", a.socket()});
  // Local service continues.
  {
    client::ClientOptions client_options;
    client_options.socket_path = a.socket();
    auto client = client::CacheClient::Connect(client_options);
    ASSERT_TRUE(client.ok()) << client.status();
    EXPECT_TRUE((*client)->Ping().ok());
  }
  // A peer that refuses this Manager's version is incompatible the same way.
  other.mode = OtherVersionPeer::Mode::kRefusesThis;
  stats = await("refuses this Manager");
  EXPECT_NE(StringField(stats, "remote_work_off_reason")
                .find(fmt::format("refuses this Manager's orbitkv.peer v{}", catalog::kPeerProtocolVersion)),
            std::string::npos)
      << stats;
  EXPECT_NE(stats.find("\"remote_work\": 0"), std::string::npos) << stats;
  // Upgraded to this version: remote work is on again.
  other.mode = OtherVersionPeer::Mode::kSpeaksThis;
  stats = await("\"peers_healthy\": 1");
  EXPECT_NE(stats.find("\"peers_incompatible\": 0"), std::string::npos) << stats;
  EXPECT_NE(stats.find("\"remote_work\": 1"), std::string::npos) << stats;
  EXPECT_EQ(StringField(stats, "remote_work_off_reason"), "");
  // Issue 70's rule: only the peers a Manager talks to are probed (the catalog hosts, and those whose requests
  // reached it). A member of another version that is neither (node-y: no catalog host, it never calls node-a) is
  // not probed, and remote work stays on over several probe rounds.
  OtherVersionPeer elsewhere;
  catalog::testing::LoopbackServer elsewhere_listener;
  std::unique_ptr<cluster::Membership> y_membership = join_as("node-y", elsewhere, elsewhere_listener);
  ASSERT_NE(y_membership, nullptr);
  stats = await("\"members\": 3");
  ASSERT_NE(stats.find("\"members\": 3"), std::string::npos) << stats;
  const uint64_t probes = std::stoull(stats.substr(stats.find("\"peer_probes\": ") + 15));
  for (int i = 0; i < 25; ++i) {  // 5 s: two probe rounds at least
    stats = StatsOf(a);
    EXPECT_NE(stats.find("\"remote_work\": 1"), std::string::npos) << stats;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  EXPECT_NE(stats.find("\"peers_incompatible\": 0"), std::string::npos) << stats;
  EXPECT_GT(std::stoull(stats.substr(stats.find("\"peer_probes\": ") + 15)), probes);  // node-x still probed
  y_membership->Shutdown();
  elsewhere_listener.server->Shutdown();
  membership->Shutdown();
  other_listener.server->Shutdown();
}

std::string ReadFile(const std::string& path) {
  std::string out;
  if (std::FILE* f = std::fopen(path.c_str(), "rb"); f != nullptr) {
    char buf[4096];
    for (size_t n; (n = std::fread(buf, 1, sizeof(buf), f)) > 0;) out.append(buf, n);
    std::fclose(f);
  }
  return out;
}

// Mutual TLS between peers: a peer with a certificate from the cluster's CA is served; one without a
// certificate, or with one from another CA, is refused in the handshake, before any handler runs. Issue 52: the
// certificate must also name the node the request claims to come from (subjectAltName URI:orbitkv-node:<id>):
// another node's certificate of the same CA is refused on every RPC kind, one naming no node with an error that
// says how to issue it, and a Manager whose own certificate does not name it is refused at start.
TEST(DistributedManagerTest, MutualTlsRefusesPeersWithoutTheClustersCertificate) {
  char dir_template[] = "/tmp/orbitkv-tls-XXXXXX";
  ASSERT_NE(mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template;
  Status made = cluster::testing::MakeTestCertificates(dir);
  for (const char* node : {"node-t", "node-u"}) {
    if (made.ok()) made = cluster::testing::MakeNodeCertificate(dir, node);
  }
  ASSERT_TRUE(made.ok()) << made;
  auto etcd = cluster::testing::EtcdProcess::StartSingle(Deadline::After(std::chrono::seconds(60)));
  ASSERT_TRUE(etcd.ok()) << etcd.status();
  const std::string peer = Loopback();
  ManagerProcess manager(
      {"--etcd-endpoints", (*etcd)->endpoint(), "--cluster-name", "it", "--node-id", "node-t", "--catalog-nodes",
       "node-t", "--peer-endpoint", peer, "--peer-tls-cert", dir + "/node-node-t.pem", "--peer-tls-key",
       dir + "/node-node-t.key", "--peer-tls-ca", dir + "/ca.pem"},
      "tls");
  ASSERT_TRUE(manager.running()) << manager.LogText();
  const cluster::MemberRecord self = RecordOf((*etcd)->endpoint(), "node-t");
  const std::string placement = StringField(StatsOf(manager), "placement_fingerprint");
  // The Manager itself is the one registered member: a well-routed request as node-t.
  const peer::v1::RouteHeader route =
      catalog::MakeRoute(catalog::PeerIdentity{"it", "node-t", self.runtime_uuid, self.epoch, placement}, self);
  const auto stub = [&](std::shared_ptr<grpc::ChannelCredentials> credentials) {
    return peer::v1::Peer::NewStub(grpc::CreateChannel(peer, credentials));
  };
  const auto deadline = [] { return std::chrono::system_clock::now() + std::chrono::seconds(5); };
  auto call = [&](std::shared_ptr<grpc::ChannelCredentials> credentials) {
    grpc::ClientContext context;
    context.set_deadline(deadline());
    peer::v1::HealthRequest request;
    *request.mutable_route() = route;
    peer::v1::HealthResponse response;
    return stub(credentials)->Health(&context, request, &response);
  };
  // Every RPC kind of orbitkv.peer.v1, routed as node-t, through `credentials`.
  auto every_kind = [&](std::shared_ptr<grpc::ChannelCredentials> credentials) {
    std::vector<std::pair<std::string, grpc::Status>> out;
    auto s = stub(credentials);
    const auto ask = [&](const char* kind, auto request, auto response, auto rpc) {
      grpc::ClientContext c;
      c.set_deadline(deadline());
      *request.mutable_route() = route;
      out.emplace_back(kind, rpc(&c, request, &response));
    };
    ask("Health", peer::v1::HealthRequest(), peer::v1::HealthResponse(),
        [&](auto* c, const auto& r, auto* a) { return s->Health(c, r, a); });
    ask("Lookup", peer::v1::LookupRequest(), peer::v1::LookupResponse(),
        [&](auto* c, const auto& r, auto* a) { return s->Lookup(c, r, a); });
    ask("Catalog", peer::v1::CatalogRequest(), peer::v1::CatalogResponse(),
        [&](auto* c, const auto& r, auto* a) { return s->Catalog(c, r, a); });
    peer::v1::AuthorizeRequest authorize;
    authorize.set_request_id(7);
    ask("Authorize", authorize, peer::v1::AuthorizeResponse(),
        [&](auto* c, const auto& r, auto* a) { return s->Authorize(c, r, a); });
    for (const uint64_t grant : {uint64_t{0}, uint64_t{0x1234}}) {
      peer::v1::ReleaseRequest release;
      release.set_request_id(7);
      release.set_grant_id(grant);
      ask(grant == 0 ? "Release by request" : "Release by grant", release, peer::v1::ReleaseResponse(),
          [&](auto* c, const auto& r, auto* a) { return s->Release(c, r, a); });
    }
    return out;
  };
  auto tls = [&](const std::string& who) {
    grpc::SslCredentialsOptions options;
    options.pem_root_certs = ReadFile(dir + "/ca.pem");
    if (!who.empty()) {
      options.pem_private_key = ReadFile(dir + "/" + who + ".key");
      options.pem_cert_chain = ReadFile(dir + "/" + who + ".pem");
    }
    return grpc::SslCredentials(options);
  };
  grpc::Status ok = call(tls("node-node-t"));
  EXPECT_TRUE(ok.ok()) << ok.error_message();
  EXPECT_EQ(call(tls("")).error_code(), grpc::StatusCode::UNAVAILABLE);       // no client certificate
  EXPECT_EQ(call(tls("rogue")).error_code(), grpc::StatusCode::UNAVAILABLE);  // another CA's
  EXPECT_EQ(call(grpc::InsecureChannelCredentials()).error_code(), grpc::StatusCode::UNAVAILABLE);
  // node-u's certificate (the cluster's CA) claiming to be node-t: refused by every RPC, before any handler.
  for (const auto& [kind, status] : every_kind(tls("node-node-u"))) {
    EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << kind << ": " << status.error_message();
    EXPECT_NE(status.error_message().find("claiming to come from node 'node-t' over a certificate of node 'node-u'"),
              std::string::npos)
        << kind << ": " << status.error_message();
  }
  // A certificate of the cluster's CA that names no node: refused, and the error says how to issue one.
  const grpc::Status unnamed = call(tls("client"));
  EXPECT_EQ(unnamed.error_code(), grpc::StatusCode::PERMISSION_DENIED) << unnamed.error_message();
  EXPECT_NE(unnamed.error_message().find("subjectAltName=URI:orbitkv-node:<node-id>"), std::string::npos)
      << unnamed.error_message();
  const std::string refusals = StatsOf(manager);
  EXPECT_NE(refusals.find("\"peer_refused_certificate_without_node\": 1, "
                          "\"peer_refused_certificate_of_another_node\": 6"),
            std::string::npos)
      << refusals;
  const std::string status = CliOutput({"status", "--socket", manager.socket()});
  EXPECT_NE(status.find("peer security: mutual TLS, each certificate naming its node (refused: 1 naming no node, 6 "
                        "naming another); grants bound to their holder (refused without the grant's secret: 0 reads, "
                        "0 releases)"),
            std::string::npos)
      << status;
  // Managers probe the peers they talk to with their own certificates (issue 70: the catalog hosts, and the peers
  // whose requests reached them): a second one of the cluster's CA is healthy to node-t, the catalog host, and
  // node-t to it (its owner streams reached node-t); one with another CA's certificate reaches nobody, and nobody
  // probes it (none of its requests got through). node-u and node-r do not talk to each other: neither probes the
  // other.
  auto tls_manager = [&](const std::string& node, const std::string& who, const std::string& ca) {
    return std::make_unique<ManagerProcess>(
        std::vector<std::string>{"--etcd-endpoints", (*etcd)->endpoint(), "--cluster-name", "it", "--node-id", node,
                                 "--catalog-nodes", "node-t", "--peer-endpoint", Loopback(), "--peer-tls-cert",
                                 dir + "/" + who + ".pem", "--peer-tls-key", dir + "/" + who + ".key", "--peer-tls-ca",
                                 dir + "/" + ca + ".pem"},
        "tls-" + node);
  };
  auto second = tls_manager("node-u", "node-node-u", "ca");
  auto rogue = tls_manager("node-r", "rogue", "rogue-ca");
  ASSERT_TRUE(second->running() && rogue->running()) << second->LogText() << rogue->LogText();
  std::string second_stats, rogue_stats, catalog_stats;
  const std::string healthy_alone = "\"peers_healthy\": 1, \"peers_unreachable\": 0";
  const std::string reaches_nobody = "\"peers_healthy\": 0, \"peers_unreachable\": 1";
  for (int i = 0; i < 750; ++i) {
    second_stats = StatsOf(*second);
    rogue_stats = StatsOf(*rogue);
    catalog_stats = StatsOf(manager);
    if (second_stats.find(healthy_alone) != std::string::npos &&
        rogue_stats.find(reaches_nobody) != std::string::npos &&
        catalog_stats.find(healthy_alone) != std::string::npos) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_NE(second_stats.find(healthy_alone), std::string::npos) << second_stats;
  EXPECT_NE(rogue_stats.find(reaches_nobody), std::string::npos) << rogue_stats;
  EXPECT_NE(catalog_stats.find(healthy_alone), std::string::npos) << catalog_stats;
  // Half a TLS configuration is refused at start, naming what is missing.
  ManagerProcess half(
      {"--etcd-endpoints", (*etcd)->endpoint(), "--cluster-name", "it", "--node-id", "node-h", "--catalog-nodes",
       "node-t", "--peer-endpoint", Loopback(), "--peer-tls-cert", dir + "/server.pem"},
      "tls-half");
  EXPECT_FALSE(half.running());
  EXPECT_NE(half.LogText().find("--peer-tls-key"), std::string::npos) << half.LogText();
  // A certificate that does not name this node (node-u's, given to node-v) is refused at start, with the fix.
  auto misnamed = tls_manager("node-v", "node-node-u", "ca");
  EXPECT_FALSE(misnamed->running());
  EXPECT_NE(misnamed->LogText().find("does not name this node"), std::string::npos) << misnamed->LogText();
  EXPECT_NE(misnamed->LogText().find("subjectAltName=URI:orbitkv-node:node-v"), std::string::npos)
      << misnamed->LogText();
  std::system(("rm -rf '" + dir + "'").c_str());
}

// Issue 53: Managers join and serve through an etcd that speaks TLS only, requires client certificates and has
// user auth on, with a token TTL shorter than the test: the tokens expire and are renewed, the registrations never
// lapse. `orbitkv status` says how etcd is reached. A wrong password stops a Manager at start with an error naming
// the flag. A peer certificate rotated on disk is what new connections get, without a restart.
TEST(DistributedManagerTest, ManagersJoinThroughATlsEtcdWithUserAuthAndPeerCertificatesRotate) {
  char dir_template[] = "/tmp/orbitkv-etcd-auth-XXXXXX";
  ASSERT_NE(mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template;
  Status made = cluster::testing::MakeTestCertificates(dir);
  for (const char* node : {"node-a", "node-b"}) {
    if (made.ok()) made = cluster::testing::MakeNodeCertificate(dir, node);
  }
  ASSERT_TRUE(made.ok()) << made;
  auto etcd = cluster::testing::EtcdProcess::StartTls(
      dir, /*client_cert_auth=*/true, Deadline::After(std::chrono::seconds(60)), {"--auth-token-ttl", "2"});
  ASSERT_TRUE(etcd.ok()) << etcd.status();
  const Status auth = (*etcd)->EnableAuth("orbit", "pw-53");
  ASSERT_TRUE(auth.ok()) << auth;
  const auto write = [&](const std::string& name, const std::string& text) {
    std::FILE* f = std::fopen((dir + "/" + name).c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs(text.c_str(), f);
    std::fclose(f);
  };
  write("password", "pw-53\n");
  write("wrong-password", "pw-54\n");
  const auto manager = [&](const std::string& node, const std::string& peer_cert, const std::string& password) {
    return std::make_unique<ManagerProcess>(std::vector<std::string>{"--etcd-endpoints",
                                                                     "https://" + (*etcd)->endpoint(),
                                                                     "--etcd-tls-ca",
                                                                     dir + "/ca.pem",
                                                                     "--etcd-tls-cert",
                                                                     dir + "/client.pem",
                                                                     "--etcd-tls-key",
                                                                     dir + "/client.key",
                                                                     "--etcd-user",
                                                                     "orbit",
                                                                     "--etcd-password-file",
                                                                     dir + "/" + password,
                                                                     "--cluster-name",
                                                                     "auth",
                                                                     "--node-id",
                                                                     node,
                                                                     "--catalog-nodes",
                                                                     "node-a,node-b",
                                                                     "--membership-ttl-secs",
                                                                     "4",
                                                                     "--peer-endpoint",
                                                                     Loopback(),
                                                                     "--peer-tls-cert",
                                                                     dir + "/" + peer_cert + ".pem",
                                                                     "--peer-tls-key",
                                                                     dir + "/" + peer_cert + ".key",
                                                                     "--peer-tls-ca",
                                                                     dir + "/ca.pem",
                                                                     "--tls-reload-secs",
                                                                     "1"},
                                            "auth-" + node);
  };
  auto a = manager("node-a", "node-node-a", "password");
  auto b = manager("node-b", "node-node-b", "password");
  ASSERT_TRUE(a->running() && b->running()) << a->LogText() << b->LogText();
  const auto healthy = [](const ManagerProcess& m) {
    const std::string stats = StatsOf(m);
    return stats.find("\"peers_healthy\": 1,") != std::string::npos &&
           stats.find("\"remote_work\": 1") != std::string::npos;
  };
  for (int i = 0; i < 750 && !(healthy(*a) && healthy(*b)); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_TRUE(healthy(*a) && healthy(*b)) << StatsOf(*a) << StatsOf(*b);
  const std::string stats = StatsOf(*a);
  EXPECT_NE(stats.find("\"etcd_tls\": 2, \"etcd_user\": \"orbit\""), std::string::npos) << stats;
  EXPECT_NE(CliOutput({"status", "--socket", a->socket()})
                .find("etcd: over TLS (etcd's certificate verified; client certificate); authenticated as user "
                      "'orbit'"),
            std::string::npos)
      << CliOutput({"status", "--socket", a->socket()});
  // Tokens expire every 2 s of disuse; the lease TTL is 4 s. Three TTLs later both are still on their first
  // registration, with remote work on.
  std::this_thread::sleep_for(std::chrono::seconds(7));
  for (ManagerProcess* m : {a.get(), b.get()}) {
    const std::string now = StatsOf(*m);
    EXPECT_NE(now.find("\"membership\": \"registered\""), std::string::npos) << now;
    EXPECT_NE(now.find("\"membership_registrations\": 1,"), std::string::npos) << now;
    EXPECT_TRUE(healthy(*m)) << now;
  }
  // A wrong password: the Manager does not start, and says which flag to fix.
  auto wrong = manager("node-w", "node-node-a", "wrong-password");
  EXPECT_FALSE(wrong->running());
  EXPECT_NE(wrong->LogText().find("--etcd-password-file"), std::string::npos) << wrong->LogText();
  // Rotation: node-a's peer certificate is reissued on disk (CN=node-a-rotated); within a few reloads new
  // connections to its peer listener get it, and node-a was not restarted.
  const std::string peer_a = StringField(StatsOf(*a), "peer_listen");
  Result<std::string> before = cluster::testing::PresentedCommonName(peer_a, dir);
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_EQ(*before, "node-a");
  const Status reissued = cluster::testing::ReissueCertificate(dir, "node-node-a", "node-a-rotated", {"127.0.0.1"},
                                                               {"orbitkv-node:node-a"});
  ASSERT_TRUE(reissued.ok()) << reissued;
  std::string presented;
  for (int i = 0; i < 100 && presented != "node-a-rotated"; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    presented = cluster::testing::PresentedCommonName(peer_a, dir).value_or("");
  }
  EXPECT_EQ(presented, "node-a-rotated");
  EXPECT_TRUE(a->running());
  // node-b, reconnecting with its own certificate, still finds node-a healthy over the rotated certificate.
  EXPECT_TRUE(healthy(*b)) << StatsOf(*b);
  std::system(("rm -rf '" + dir + "'").c_str());
}

TEST(DistributedManagerTest, SingleHostModeSaysSo) {
  ManagerProcess manager({}, "single");
  ASSERT_TRUE(manager.running());
  const std::string stats = StatsOf(manager);
  EXPECT_NE(stats.find("\"membership\": \"single-host\""), std::string::npos) << stats;
  // It keeps no residency inventory (no catalog reads one), and a dump says why.
  const std::string dump = CliOutput({"inventory", "dump", "--shard", "0", "--socket", manager.socket()}, true);
  EXPECT_NE(dump.find("runs single-host"), std::string::npos) << dump;
}

}  // namespace
}  // namespace orbitkv
