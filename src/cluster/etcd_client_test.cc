// The etcd client against a real etcd: the calls the cluster module makes, error mapping, failover
// across endpoints and deadlines on an endpoint that never answers.
#include "cluster/etcd_client.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <thread>

#include "base/scoped_fd.h"
#include "cluster/testing/cluster_fixture.h"

namespace orbitkv::cluster {
namespace {

using testing::EtcdTest;
using testing::kWaitLimit;

class EtcdClientTest : public EtcdTest {};

Deadline Soon() { return Deadline::After(kWaitLimit); }

TEST_F(EtcdClientTest, KeyValueTxnAndLeaseCalls) {
  etcdserverpb::PutRequest put;
  put.set_key("/t/a");
  put.set_value("1");
  ASSERT_TRUE(raw_->Put(put, Soon()).ok());

  etcdserverpb::RangeRequest range;
  range.set_key("/t/");
  range.set_range_end(PrefixEnd("/t/"));
  Result<etcdserverpb::RangeResponse> got = raw_->Range(range, Soon());
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->kvs_size(), 1);
  EXPECT_EQ(got->kvs(0).value(), "1");
  EXPECT_NE(got->header().cluster_id(), 0u);

  // Create-if-absent: the second attempt fails and reports the holder.
  etcdserverpb::TxnRequest txn;
  etcdserverpb::Compare* c = txn.add_compare();
  c->set_key("/t/b");
  c->set_target(etcdserverpb::Compare::CREATE);
  c->set_create_revision(0);
  txn.add_success()->mutable_request_put()->set_key("/t/b");
  txn.mutable_success(0)->mutable_request_put()->set_value("first");
  txn.add_failure()->mutable_request_range()->set_key("/t/b");
  Result<etcdserverpb::TxnResponse> first = raw_->Txn(txn, Soon());
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_TRUE(first->succeeded());
  Result<etcdserverpb::TxnResponse> second = raw_->Txn(txn, Soon());
  ASSERT_TRUE(second.ok());
  EXPECT_FALSE(second->succeeded());
  EXPECT_EQ(second->responses(0).response_range().kvs(0).value(), "first");

  // Leases: etcd may raise the TTL, never lower it; revoking deletes attached keys.
  etcdserverpb::LeaseGrantRequest grant;
  grant.set_ttl(30);
  Result<etcdserverpb::LeaseGrantResponse> lease = raw_->LeaseGrant(grant, Soon());
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_GE(lease->ttl(), 30);
  put.set_key("/t/leased");
  put.set_lease(lease->id());
  ASSERT_TRUE(raw_->Put(put, Soon()).ok());
  etcdserverpb::LeaseTimeToLiveRequest ttl;
  ttl.set_id(lease->id());
  ttl.set_keys(true);
  Result<etcdserverpb::LeaseTimeToLiveResponse> alive = raw_->LeaseTimeToLive(ttl, Soon());
  ASSERT_TRUE(alive.ok());
  ASSERT_EQ(alive->keys_size(), 1);
  EXPECT_EQ(alive->keys(0), "/t/leased");
  etcdserverpb::LeaseRevokeRequest revoke;
  revoke.set_id(lease->id());
  ASSERT_TRUE(raw_->LeaseRevoke(revoke, Soon()).ok());
  range.set_key("/t/leased");
  range.clear_range_end();
  EXPECT_EQ(raw_->Range(range, Soon())->kvs_size(), 0);
  EXPECT_EQ(raw_->LeaseRevoke(revoke, Soon()).status().code(), StatusCode::kNotFound);
  Result<etcdserverpb::LeaseTimeToLiveResponse> gone = raw_->LeaseTimeToLive(ttl, Soon());
  ASSERT_TRUE(gone.ok());
  EXPECT_EQ(gone->ttl(), -1);
}

TEST_F(EtcdClientTest, ErrorsKeepTheGrpcCodeAndNameMethodAndEndpoint) {
  etcdserverpb::RangeRequest range;
  range.set_key("/t");
  range.set_revision(1'000'000);
  Result<etcdserverpb::RangeResponse> future = raw_->Range(range, Soon());
  ASSERT_FALSE(future.ok());
  EXPECT_EQ(future.status().code(), StatusCode::kOutOfRange);
  EXPECT_NE(future.status().message().find("etcd Range at " + etcd_->endpoint()), std::string_view::npos)
      << future.status();
  etcdserverpb::RangeRequest empty;
  EXPECT_EQ(raw_->Range(empty, Soon()).status().code(), StatusCode::kInvalidArgument);
}

TEST_F(EtcdClientTest, FailsOverFromADeadEndpoint) {
  Result<int> dead_port = testing::PickFreePort();
  ASSERT_TRUE(dead_port.ok());
  MetricsRegistry metrics;
  EtcdClientOptions options;
  options.endpoints = {"127.0.0.1:" + std::to_string(*dead_port), "http://" + etcd_->endpoint()};
  options.metrics = &metrics;
  Result<std::unique_ptr<EtcdClient>> client = EtcdClient::Create(options);
  ASSERT_TRUE(client.ok());
  etcdserverpb::RangeRequest range;
  range.set_key("/t");
  Result<etcdserverpb::RangeResponse> got = (*client)->Range(range, Soon());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ((*client)->failovers_total(), 1u);
  EXPECT_EQ((*client)->PreferredEndpoint(), 1u);
  // The preference sticks: the next call goes straight to the live endpoint.
  ASSERT_TRUE((*client)->Range(range, Soon()).ok());
  EXPECT_EQ((*client)->failovers_total(), 1u);
  EXPECT_EQ(testing::CounterValue(metrics, "orbitkv_etcd_calls_total", {{"method", "Range"}}), 3u);
  EXPECT_EQ(testing::CounterValue(metrics, "orbitkv_etcd_call_failures_total", {{"method", "Range"}}), 1u);
}

// While etcd is down, a fresh channel cannot connect either: the client's channel is kept (a channel is replaced only
// when a fresh one answers while it cannot connect, EtcdClient::Slot), and once etcd is back the calls go through.
TEST_F(EtcdClientTest, AChannelIsNotReplacedWhileEtcdIsDownAndCallsResumeWhenItIsBack) {
  EtcdClientOptions options;
  options.endpoints = {etcd_->endpoint()};
  options.call_timeout = std::chrono::milliseconds(500);
  Result<std::unique_ptr<EtcdClient>> client = EtcdClient::Create(options);
  ASSERT_TRUE(client.ok());
  etcdserverpb::RangeRequest range;
  range.set_key("/t");
  ASSERT_TRUE((*client)->Range(range, Soon()).ok());
  ASSERT_TRUE(etcd_->Stop().ok());
  const MonoTime until = MonoNow() + std::chrono::milliseconds(2 * EtcdClient::kStuckAfterMs);
  int failed = 0;
  while (MonoNow() < until) {
    failed += (*client)->Range(range, Deadline::After(std::chrono::milliseconds(500))).ok() ? 0 : 1;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_GT(failed, 0);
  EXPECT_EQ((*client)->channel_resets(), 0u) << "a channel was replaced by one that could not connect either";
  ASSERT_TRUE(etcd_->Launch().ok());
  ASSERT_TRUE(etcd_->WaitReady(Soon()).ok());
  EXPECT_TRUE(
      testing::WaitUntil([&] { return (*client)->Range(range, Deadline::After(std::chrono::seconds(1))).ok(); }));
  EXPECT_LE((*client)->channel_resets(), 1u);
}

TEST_F(EtcdClientTest, EveryCallHasADeadline) {
  // A socket that completes TCP handshakes (backlog) but never speaks HTTP/2: a call must not hang
  // on it.
  ScopedFd listener(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  ASSERT_TRUE(listener.valid());
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(listener.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(listener.get(), 16), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(getsockname(listener.get(), reinterpret_cast<sockaddr*>(&addr), &len), 0);

  EtcdClientOptions options;
  options.endpoints = {"127.0.0.1:" + std::to_string(ntohs(addr.sin_port))};
  options.call_timeout = std::chrono::milliseconds(300);
  Result<std::unique_ptr<EtcdClient>> client = EtcdClient::Create(options);
  ASSERT_TRUE(client.ok());
  etcdserverpb::RangeRequest range;
  range.set_key("/t");
  // The caller's deadline is infinite; the client's call timeout bounds the call.
  Result<etcdserverpb::RangeResponse> got = (*client)->Range(range, Deadline::Infinite());
  ASSERT_FALSE(got.ok());
  EXPECT_TRUE(got.status().code() == StatusCode::kDeadlineExceeded || got.status().code() == StatusCode::kUnavailable)
      << got.status();
}

TEST_F(EtcdClientTest, CountsCallsPerThread) {
  const uint64_t before = EtcdClient::CallsOnThisThread();
  etcdserverpb::RangeRequest range;
  range.set_key("/t");
  ASSERT_TRUE(raw_->Range(range, Soon()).ok());
  ASSERT_TRUE(raw_->Range(range, Soon()).ok());
  EXPECT_EQ(EtcdClient::CallsOnThisThread(), before + 2);
  uint64_t other_thread = 0;
  std::thread([&] { other_thread = EtcdClient::CallsOnThisThread(); }).join();
  EXPECT_EQ(other_thread, 0u);
}

TEST(EtcdClientOptionsTest, RejectsBadEndpointLists) {
  EXPECT_EQ(EtcdClient::Create({}).status().code(), StatusCode::kInvalidArgument);
  for (const char* bad : {"", "host", "https://h:1", "h:x", "a b:1"}) {
    EtcdClientOptions options;
    options.endpoints = {bad};
    EXPECT_EQ(EtcdClient::Create(options).status().code(), StatusCode::kInvalidArgument) << bad;
  }
  EtcdClientOptions dup;
  dup.endpoints = {"h:1", "http://h:1/"};
  EXPECT_EQ(EtcdClient::Create(dup).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace orbitkv::cluster
