// Issue 53: the etcd client over TLS with user auth, against a real etcd 3.4 started with TLS (client
// certificates required) and `auth enable`d through etcdctl. Tokens that expire (a short --auth-token-ttl) are
// renewed without losing a registration; a wrong password, a wrong CA, an expired client certificate, a missing
// user and a plaintext client are refused with errors that name the flag to fix.
#include <gtest/gtest.h>

#include <filesystem>
#include <thread>

#include "cluster/testing/cluster_fixture.h"
#include "cluster/testing/test_certs.h"

namespace orbitkv::cluster {
namespace {

using testing::kWaitLimit;

constexpr const char* kUser = "orbit";
constexpr const char* kPassword = "s3cret-pw";
constexpr int kTokenTtlSecs = 2;

class EtcdSecurityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (testing::EtcdBinary().empty()) GTEST_SKIP() << "no etcd binary was found at configure time";
    char dir_template[] = "/tmp/orbitkv-etcd-tls-XXXXXX";
    ASSERT_NE(mkdtemp(dir_template), nullptr);
    dir_ = dir_template;
    const Status made = testing::MakeTestCertificates(dir_);
    ASSERT_TRUE(made.ok()) << made;
    Result<std::unique_ptr<testing::EtcdProcess>> etcd =
        testing::EtcdProcess::StartTls(dir_, /*client_cert_auth=*/true, Deadline::After(kWaitLimit),
                                       {"--auth-token-ttl", std::to_string(kTokenTtlSecs)});
    ASSERT_TRUE(etcd.ok()) << etcd.status();
    etcd_ = std::move(etcd).value();
    // The operator's steps (docs/cluster.md).
    const Status auth = etcd_->EnableAuth(kUser, kPassword);
    ASSERT_TRUE(auth.ok()) << auth;
  }

  void TearDown() override {
    etcd_.reset();
    std::error_code ignored;
    if (!dir_.empty()) std::filesystem::remove_all(dir_, ignored);
  }

  // The client options a Manager builds from --etcd-tls-* and --etcd-user/--etcd-password-file.
  EtcdClientOptions Options() const {
    EtcdClientOptions o = etcd_->ClientOptions();
    o.metrics = nullptr;
    o.call_timeout = std::chrono::milliseconds(3000);
    return o;
  }

  static Status Put(EtcdClient& client, const std::string& key, const std::string& value) {
    etcdserverpb::PutRequest put;
    put.set_key(key);
    put.set_value(value);
    return client.Put(put, Deadline::After(kWaitLimit)).status();
  }

  std::string dir_;
  std::unique_ptr<testing::EtcdProcess> etcd_;
};

TEST_F(EtcdSecurityTest, CallsOverTlsWithATokenThatIsRenewedWhenItExpires) {
  Result<std::unique_ptr<EtcdClient>> client = EtcdClient::Create(Options());
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_TRUE((*client)->tls() && (*client)->client_certificate() && (*client)->authenticates());
  ASSERT_TRUE(Put(**client, "/orbitkv/t/a", "1").ok());
  EXPECT_EQ((*client)->tokens_obtained(), 1u);
  // The role covers /orbitkv/ only: etcd checks the user's permissions, so the token is really the identity.
  const Status outside = Put(**client, "/elsewhere", "1");
  EXPECT_EQ(outside.code(), StatusCode::kPermissionDenied) << outside;
  EXPECT_NE(outside.message().find("role grant-permission"), std::string::npos) << outside;
  // Idle past the token's TTL: etcd forgets it; the next call gets a new one and succeeds.
  std::this_thread::sleep_for(std::chrono::seconds(kTokenTtlSecs + 2));
  const Status after = Put(**client, "/orbitkv/t/b", "2");
  ASSERT_TRUE(after.ok()) << after;
  EXPECT_EQ((*client)->tokens_obtained(), 2u);
}

TEST_F(EtcdSecurityTest, ARegistrationSurvivesTokenExpiry) {
  MetricsRegistry metrics;
  MembershipOptions o;
  const EtcdClientOptions c = Options();
  o.etcd_endpoints = c.endpoints;
  o.etcd_tls_ca = c.tls_ca_file;
  o.etcd_tls_cert = c.tls_cert_file;
  o.etcd_tls_key = c.tls_key_file;
  o.etcd_user = kUser;
  o.etcd_password = kPassword;
  o.cluster_name = "sec";
  o.node_id = "node-a";
  o.membership_ttl_secs = 8;
  o.catalog_nodes = {"node-a"};
  o.peer_endpoint = "127.0.0.1:7999";
  Result<std::unique_ptr<Membership>> m = Membership::Create(o, &metrics);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_TRUE((*m)->Join(Deadline::After(kWaitLimit)).ok());
  // Several token lifetimes and a lease TTL: the keepalive stream and the view's watch keep going, and a unary call
  // after the token expired renews it.
  std::this_thread::sleep_for(std::chrono::seconds(3 * kTokenTtlSecs + 1));
  etcdserverpb::RangeRequest range;
  range.set_key("/orbitkv/");
  range.set_range_end("/orbitkv0");
  range.set_count_only(true);
  const auto counted = (*m)->etcd().Range(range, Deadline::After(kWaitLimit));
  ASSERT_TRUE(counted.ok()) << counted.status();
  const MembershipStatus status = (*m)->GetStatus();
  EXPECT_EQ(status.state, MembershipState::kRegistered);
  EXPECT_TRUE(status.registration_valid);
  EXPECT_EQ(status.registrations, 1) << "the registration lapsed: " << status.last_cause;
  EXPECT_TRUE((*m)->CanDoRemoteWork());
  EXPECT_GE((*m)->etcd().tokens_obtained(), 2u);
  // etcd restarts. The streams break and come back, the view is repaired (caught up), the registration holds. A token
  // etcd still knows (it replays the Authenticate from its log) is kept; one it refuses is renewed, once (issue 69: a
  // broken stream alone no longer drops the token, which had every Manager authenticate after every outage).
  const auto repairs = [&] {
    return testing::CounterValue(metrics, "orbitkv_membership_snapshots_total") +
           testing::CounterValue(metrics, "orbitkv_membership_view_catch_ups_total");
  };
  const uint64_t repaired = repairs();
  const uint64_t authenticates = (*m)->etcd().authenticate_calls();
  ASSERT_TRUE(etcd_->Stop().ok());
  ASSERT_TRUE(etcd_->Launch().ok());
  const Status ready = etcd_->WaitReady(Deadline::After(kWaitLimit));
  ASSERT_TRUE(ready.ok()) << ready;
  EXPECT_TRUE(testing::WaitUntil([&] {
    const MembershipStatus s = (*m)->GetStatus();
    return (*m)->CanDoRemoteWork() && s.registration_valid && repairs() > repaired;
  })) << (*m)->GetStatus().last_error;
  EXPECT_LE((*m)->etcd().authenticate_calls() - authenticates, 1u);
  EXPECT_EQ((*m)->GetStatus().registrations, 1) << "the registration lapsed: " << (*m)->GetStatus().last_cause;
  (*m)->Shutdown();
}

// Issue 69: Authenticate costs etcd a bcrypt check and a raft proposal, so a client never runs two at once: the
// threads that need a token while one is being obtained wait for it.
TEST_F(EtcdSecurityTest, ManyThreadsNeedingATokenCostOneAuthenticate) {
  Result<std::unique_ptr<EtcdClient>> client = EtcdClient::Create(Options());
  ASSERT_TRUE(client.ok()) << client.status();
  constexpr int kThreads = 16;
  std::vector<Status> results(kThreads);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] { results[i] = Put(**client, "/orbitkv/t/many-" + std::to_string(i), "v"); });
  }
  for (std::thread& t : threads) t.join();
  for (const Status& s : results) EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ((*client)->authenticate_calls(), 1u);
  EXPECT_EQ((*client)->tokens_obtained(), 1u);
}

// Issue 69: a stream that broke (an election, a reset connection) keeps the token: tokens outlive both, and
// dropping it made every Manager of a fleet authenticate again after each election. Only etcd's refusal of the
// token (UNAUTHENTICATED) drops it.
TEST_F(EtcdSecurityTest, OnlyARefusedTokenIsDropped) {
  Result<std::unique_ptr<EtcdClient>> client = EtcdClient::Create(Options());
  ASSERT_TRUE(client.ok()) << client.status();
  grpc::ClientContext context;
  const std::string token =
      (*client)->PrepareStreamContext(&context, EtcdClient::StreamKind::kWatch, (*client)->PreferredEndpoint());
  ASSERT_FALSE(token.empty());
  ASSERT_EQ((*client)->authenticate_calls(), 1u);
  (*client)->ReportStreamFailure(0, grpc::Status(grpc::StatusCode::UNAVAILABLE, "etcdserver: no leader"), token);
  (*client)->ReportStreamFailure(0, grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"), token);
  ASSERT_TRUE(Put(**client, "/orbitkv/t/kept", "1").ok());
  EXPECT_EQ((*client)->authenticate_calls(), 1u) << "a broken stream dropped a token etcd never refused";
  (*client)->ReportStreamFailure(0, grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "invalid auth token"), token);
  ASSERT_TRUE(Put(**client, "/orbitkv/t/renewed", "1").ok());
  EXPECT_EQ((*client)->authenticate_calls(), 2u);
  // A report about a token that is no longer the current one changes nothing.
  (*client)->ReportStreamFailure(0, grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "invalid auth token"), token);
  ASSERT_TRUE(Put(**client, "/orbitkv/t/again", "1").ok());
  EXPECT_EQ((*client)->authenticate_calls(), 2u);
}

// Issue 69: the keepalive stream's open never waits for an Authenticate (its registration's validity runs while
// it would): without a token it opens with none, and a background thread obtains one for the next.
TEST_F(EtcdSecurityTest, AKeepaliveStreamOpensWithoutWaitingForAToken) {
  Result<std::unique_ptr<EtcdClient>> client = EtcdClient::Create(Options());
  ASSERT_TRUE(client.ok()) << client.status();
  const uint64_t calls_before = EtcdClient::CallsOnThisThread();
  grpc::ClientContext context;
  const std::string token = (*client)->PrepareStreamContext(&context, EtcdClient::StreamKind::kLeaseKeepAlive, 0);
  EXPECT_TRUE(token.empty());
  // The stream open itself, and no Authenticate, on this thread.
  EXPECT_EQ(EtcdClient::CallsOnThisThread() - calls_before, 1u);
  EXPECT_TRUE(testing::WaitUntil([&] { return (*client)->tokens_obtained() == 1; }));
  grpc::ClientContext next;
  EXPECT_FALSE((*client)->PrepareStreamContext(&next, EtcdClient::StreamKind::kLeaseKeepAlive, 0).empty());
  EXPECT_EQ((*client)->authenticate_calls(), 1u);
}

TEST_F(EtcdSecurityTest, RefusalsNameTheFlagToFix) {
  struct Case {
    std::string what;
    EtcdClientOptions options;
    std::string names;  // what the error must mention
  };
  std::vector<Case> cases;
  EtcdClientOptions wrong_password = Options();
  wrong_password.password = "not-it";
  cases.push_back({"wrong password", wrong_password, "--etcd-password-file"});
  EtcdClientOptions wrong_ca = Options();
  wrong_ca.tls_ca_file = dir_ + "/rogue-ca.pem";
  cases.push_back({"wrong CA", wrong_ca, "--etcd-tls-ca"});
  EtcdClientOptions expired = Options();
  expired.tls_cert_file = dir_ + "/expired.pem";
  expired.tls_key_file = dir_ + "/expired.key";
  cases.push_back({"expired client certificate", expired, "--etcd-tls-cert"});
  EtcdClientOptions no_user = Options();
  no_user.user.clear();
  no_user.password.clear();
  cases.push_back({"no user", no_user, "--etcd-user"});
  EtcdClientOptions plaintext = Options();
  plaintext.tls_ca_file.clear();
  plaintext.tls_cert_file.clear();
  plaintext.tls_key_file.clear();
  cases.push_back({"plaintext to a TLS etcd", plaintext, "--etcd-tls-ca"});
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    Result<std::unique_ptr<EtcdClient>> client = EtcdClient::Create(c.options);
    ASSERT_TRUE(client.ok()) << client.status();
    const Status refused = Put(**client, "/orbitkv/t/refused", "x");
    ASSERT_FALSE(refused.ok());
    EXPECT_NE(refused.message().find(c.names), std::string::npos) << refused;
  }
  // Nothing was written by any of them.
  Result<std::unique_ptr<EtcdClient>> good = EtcdClient::Create(Options());
  ASSERT_TRUE(good.ok());
  etcdserverpb::RangeRequest range;
  range.set_key("/orbitkv/t/refused");
  const auto got = (*good)->Range(range, Deadline::After(kWaitLimit));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->kvs_size(), 0);
}

TEST(EtcdClientOptionsTest, BadTlsAndAuthOptionsAreRefusedAtCreation) {
  EtcdClientOptions o;
  o.endpoints = {"https://127.0.0.1:2379"};
  EXPECT_NE(EtcdClient::Create(o).status().message().find("--etcd-tls-ca"), std::string::npos);
  o.endpoints = {"127.0.0.1:2379"};
  o.tls_cert_file = "/nonexistent.pem";
  EXPECT_NE(EtcdClient::Create(o).status().message().find("--etcd-tls-ca"), std::string::npos);
  o.tls_ca_file = "/nonexistent-ca.pem";
  o.tls_key_file = "/nonexistent.key";
  const Status missing = EtcdClient::Create(o).status();
  EXPECT_EQ(missing.code(), StatusCode::kNotFound) << missing;
  EXPECT_NE(missing.message().find("--etcd-tls-ca /nonexistent-ca.pem"), std::string::npos) << missing;
  EtcdClientOptions user;
  user.endpoints = {"127.0.0.1:2379"};
  user.user = "orbit";
  EXPECT_NE(EtcdClient::Create(user).status().message().find("--etcd-password-file"), std::string::npos);
}

}  // namespace
}  // namespace orbitkv::cluster
