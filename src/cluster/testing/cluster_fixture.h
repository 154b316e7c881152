// Test-only fixture for tests against a real etcd: one single-member etcd per test, a raw client
// for poking at it, Membership options, and a condition waiter with a generous deadline (no fixed
// sleeps).
#ifndef ORBITKV_CLUSTER_TESTING_CLUSTER_FIXTURE_H_
#define ORBITKV_CLUSTER_TESTING_CLUSTER_FIXTURE_H_

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "base/metrics.h"
#include "cluster/cluster_keys.h"
#include "cluster/etcd_client.h"
#include "cluster/member_record.h"
#include "cluster/membership.h"
#include "cluster/testing/etcd_process.h"

namespace orbitkv::cluster::testing {

// Generous: CI shares two cores between several suites.
inline constexpr std::chrono::seconds kWaitLimit{60};

// Polls `condition` until it holds or kWaitLimit passes; returns whether it held.
inline bool WaitUntil(const std::function<bool()>& condition, std::chrono::seconds limit = kWaitLimit) {
  const Deadline deadline = Deadline::After(limit);
  while (!condition()) {
    if (deadline.Expired()) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

inline uint64_t CounterValue(MetricsRegistry& metrics, std::string_view name, MetricLabels labels = {}) {
  return metrics.GetCounter(name, "", std::move(labels)).Value();
}

class EtcdTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (EtcdBinary().empty()) GTEST_SKIP() << "no etcd binary was found at configure time";
    Result<std::unique_ptr<EtcdProcess>> etcd = EtcdProcess::StartSingle(Deadline::After(kWaitLimit));
    ASSERT_TRUE(etcd.ok()) << etcd.status();
    etcd_ = std::move(etcd).value();
    EtcdClientOptions options;
    options.endpoints = {etcd_->endpoint()};
    options.metrics = &raw_metrics_;
    Result<std::unique_ptr<EtcdClient>> raw = EtcdClient::Create(options);
    ASSERT_TRUE(raw.ok()) << raw.status();
    raw_ = std::move(raw).value();
  }

  MembershipOptions Options(const std::string& node, std::vector<std::string> catalog = {"node-a"},
                            int64_t ttl_secs = 20) {
    MembershipOptions o;
    o.etcd_endpoints = {etcd_->endpoint()};
    o.cluster_name = cluster_;
    o.node_id = node;
    o.membership_ttl_secs = ttl_secs;
    o.catalog_nodes = std::move(catalog);
    o.peer_endpoint = "127.0.0.1:" + std::to_string(7000 + next_port_++);
    return o;
  }

  // Creates and joins; fails the test on error.
  std::unique_ptr<Membership> Join(MembershipOptions options, MetricsRegistry* metrics) {
    Result<std::unique_ptr<Membership>> m = Membership::Create(std::move(options), metrics);
    EXPECT_TRUE(m.ok()) << m.status();
    if (!m.ok()) return nullptr;
    const Status joined = (*m)->Join(Deadline::After(kWaitLimit));
    EXPECT_TRUE(joined.ok()) << joined;
    if (!joined.ok()) return nullptr;
    return std::move(m).value();
  }

  static bool Sees(const Membership& m, const std::string& node) { return m.view().Find(node).ok(); }

  Status RawPut(const std::string& key, const std::string& value, int64_t lease = 0) {
    etcdserverpb::PutRequest put;
    put.set_key(key);
    put.set_value(value);
    put.set_lease(lease);
    return raw_->Put(put, Deadline::After(kWaitLimit)).status();
  }

  // The value at `key` (NotFound when absent).
  Result<std::string> RawGet(const std::string& key) {
    etcdserverpb::RangeRequest range;
    range.set_key(key);
    ORBITKV_ASSIGN_OR_RETURN(etcdserverpb::RangeResponse r, raw_->Range(range, Deadline::After(kWaitLimit)));
    if (r.kvs_size() == 0) return Status::NotFound(key);
    return r.kvs(0).value();
  }

  Status RawDelete(const std::string& key) {
    etcdserverpb::DeleteRangeRequest del;
    del.set_key(key);
    return raw_->DeleteRange(del, Deadline::After(kWaitLimit)).status();
  }

  Result<int64_t> CurrentRevision() {
    etcdserverpb::RangeRequest range;
    range.set_key("/");
    range.set_count_only(true);
    ORBITKV_ASSIGN_OR_RETURN(etcdserverpb::RangeResponse r, raw_->Range(range, Deadline::After(kWaitLimit)));
    return r.header().revision();
  }

  // A well-formed member record for `node` that no Manager owns.
  std::string FakeRecord(const std::string& node, int64_t epoch = 1) {
    MemberRecord r;
    r.cluster = cluster_;
    r.node_id = node;
    r.epoch = epoch;
    r.endpoint = "127.0.0.1:9";
    r.runtime_uuid = NewRuntimeUuid();
    return EncodeMemberRecord(r);
  }

  std::string cluster_ = "test-cluster";
  std::unique_ptr<EtcdProcess> etcd_;
  MetricsRegistry raw_metrics_;
  std::unique_ptr<EtcdClient> raw_;
  int next_port_ = 0;
};

}  // namespace orbitkv::cluster::testing

#endif  // ORBITKV_CLUSTER_TESTING_CLUSTER_FIXTURE_H_
