// Cluster membership on a real etcd: view convergence for 1,000 members and Watch propagation, vs
// one etcd put.
//
// Starts its own etcd (Debian's etcd-server) on free loopback ports with a temp data dir. Baseline:
// the p50 round trip of one etcd Put from the same client in the same run. view_converge_1000 is
// the median time, over several runs, from starting an observer ViewSync to a complete view of
// 1,000 simulated members (a fresh snapshot of 8 pages of 128 at one revision).
// watch_propagation_p50/p99 time a member record Put until the observer's cached view shows it.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <thread>
#include <vector>

#include "base/clock.h"
#include "base/logging.h"
#include "base/metrics.h"
#include "bench_report.h"
#include "cluster/cluster_keys.h"
#include "cluster/etcd_client.h"
#include "cluster/member_record.h"
#include "cluster/member_view.h"
#include "cluster/testing/etcd_process.h"
#include "cluster/view_sync.h"

namespace orbitkv::bench {
namespace {

using namespace orbitkv::cluster;

constexpr char kCluster[] = "bench";
constexpr int kMembers = 1000;
constexpr int kConvergeRuns = 7;
constexpr int kPutSamples = 300;
constexpr int kWatchSamples = 300;

double Ms(MonoClock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

std::string Record(const std::string& node, int64_t epoch) {
  MemberRecord r;
  r.cluster = kCluster;
  r.node_id = node;
  r.epoch = epoch;
  r.endpoint = "10.0.0.1:7300";
  r.runtime_uuid = NewRuntimeUuid();
  return EncodeMemberRecord(r);
}

void Check(const Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "membership_bench: %s: %s\n", what, s.ToString().c_str());
    std::exit(1);
  }
}

Status Put(EtcdClient& client, const std::string& key, const std::string& value) {
  etcdserverpb::PutRequest put;
  put.set_key(key);
  put.set_value(value);
  return client.Put(put, Deadline::After(std::chrono::seconds(10))).status();
}

// An observer view with its thread; destroyed (stopped and joined) at scope end.
struct Observer {
  explicit Observer(EtcdClient* client) : sync(client, &view, MakeOptions(&metrics)) {
    thread = std::thread([this] { sync.Run(); });
  }
  ~Observer() {
    sync.Stop();
    thread.join();
  }
  static ViewSync::Options MakeOptions(MetricsRegistry* metrics) {
    ViewSync::Options o;
    o.cluster = kCluster;
    o.metrics = metrics;
    return o;
  }
  MetricsRegistry metrics;
  MemberView view;
  ViewSync sync;
  std::thread thread;
};

}  // namespace
}  // namespace orbitkv::bench

int main(int argc, char** argv) {
  using namespace orbitkv;
  using namespace orbitkv::bench;
  const bool json = ParseBenchArgs(argc, argv,
                                   "Cluster membership on a real etcd: view convergence for 1,000 members and "
                                   "Watch propagation p50/p99, against the p50 round trip of one etcd Put.");
  log::SetLevel(log::Level::kWarn);
  BenchReport report("membership");
  AddStandardEnv(report);

  Result<std::unique_ptr<testing::EtcdProcess>> etcd =
      testing::EtcdProcess::StartSingle(Deadline::After(std::chrono::seconds(60)));
  Check(etcd.status(), "starting etcd");
  EtcdClientOptions options;
  options.endpoints = {(*etcd)->endpoint()};
  Result<std::unique_ptr<EtcdClient>> writer = EtcdClient::Create(options);
  Result<std::unique_ptr<EtcdClient>> reader = EtcdClient::Create(options);
  Check(writer.status(), "client");
  Check(reader.status(), "client");

  // Baseline: one Put round trip from the same client.
  std::vector<double> put_ms;
  for (int i = 0; i < kPutSamples; ++i) {
    const MonoTime t0 = MonoNow();
    Check(Put(**writer, "/bench-baseline/k", std::to_string(i)), "baseline put");
    put_ms.push_back(Ms(MonoNow() - t0));
  }
  const double put_p50 = Percentile(put_ms, 0.5);

  // 1,000 simulated members, written in transactions of 100 (not timed).
  for (int start = 0; start < kMembers; start += 100) {
    etcdserverpb::TxnRequest txn;
    for (int i = start; i < start + 100; ++i) {
      const std::string node = fmt::format("sim-{:04}", i);
      etcdserverpb::PutRequest* put = txn.add_success()->mutable_request_put();
      put->set_key(MemberKey(kCluster, node));
      put->set_value(Record(node, 1));
    }
    Check((*writer)->Txn(txn, Deadline::After(std::chrono::seconds(10))).status(), "seeding members");
  }
  // Warm the reader's connection so that convergence does not include the TCP/HTTP2 handshake.
  etcdserverpb::RangeRequest warm;
  warm.set_key("/bench-baseline/k");
  Check((*reader)->Range(warm, Deadline::After(std::chrono::seconds(10))).status(), "warm-up");

  std::vector<double> converge_ms;
  for (int run = 0; run < kConvergeRuns; ++run) {
    const MonoTime t0 = MonoNow();
    Observer observer(reader->get());
    while (!(observer.view.complete() && observer.view.size() == kMembers)) std::this_thread::yield();
    converge_ms.push_back(Ms(MonoNow() - t0));
  }

  // Watch propagation: a Put of a member record until the observer's view holds that exact record.
  std::vector<double> watch_ms;
  {
    Observer observer(reader->get());
    while (!observer.view.complete()) std::this_thread::yield();
    for (int i = 0; i < kWatchSamples; ++i) {
      const std::string node = fmt::format("sim-{:04}", i % kMembers);
      const int64_t epoch = 2 + i;
      const std::string value = Record(node, epoch);
      const MonoTime t0 = MonoNow();
      Check(Put(**writer, MemberKey(kCluster, node), value), "member put");
      while (true) {
        Result<Member> m = observer.view.Find(node);
        if (m.ok() && m->record.epoch == epoch) break;
        std::this_thread::yield();
      }
      watch_ms.push_back(Ms(MonoNow() - t0));
    }
  }

  report.Add({"view_converge_1000", "ms", Percentile(converge_ms, 0.5), "etcd_put_rtt_p50", put_p50});
  report.Add({"watch_propagation_p50", "ms", Percentile(watch_ms, 0.5), "etcd_put_rtt_p50", put_p50});
  report.Add({"watch_propagation_p99", "ms", Percentile(watch_ms, 0.99), "etcd_put_rtt_p50", put_p50});
  report.AddEnv("etcd", "3.4 single member, loopback, fresh data dir");
  report.Print(json);
  return 0;
}
