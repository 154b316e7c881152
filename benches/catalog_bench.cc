// The embedded catalog: 16 owners streaming 16 shards each to one catalog host over real gRPC, under churn.
//
// One catalog host (a CatalogStore behind the real PeerService on a loopback gRPC server) and 16 owners, each
// a real ResidencyInventory of 16 shards with one OwnerStreamer per shard over GrpcCatalogTransport (256
// streams), all in this process with a member view installed by hand (the route check runs on every request).
// 30,000 residences are loaded, then a driver changes residences at a fixed rate for a few seconds; the update
// lag of each change is the time from the inventory's Apply to the catalog making it visible. Then the catalog
// host "restarts" (a new start with an empty store): replay is the time until it covers every owner's records
// again. Baselines measured in the same run: the p50 of one etcd Put on a real etcd, and the p50 of the loopback
// gRPC unary round trip (Health, route check included) to the same server.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <map>
#include <random>
#include <set>
#include <thread>

#include "catalog/peer_service.h"  // first of the gRPC users (cluster/grpc.h)

#include "base/logging.h"
#include "base/runtime_id.h"
#include "bench_report.h"
#include "catalog/catalog_grpc.h"
#include "catalog/catalog_store.h"
#include "catalog/owner_streamer.h"
#include "cluster/etcd_client.h"
#include "cluster/placement.h"
#include "cluster/testing/etcd_process.h"
#include "core/inventory.h"
#include "peer_bench.h"
#include "state/namespace.h"

namespace orbitkv::bench {
namespace {

constexpr int kOwners = 16;
constexpr uint32_t kShards = 16;
constexpr int kRecords = 30000;  // loaded before the churn, and what the replay must cover
constexpr double kChangesPerSecond = 4500;
constexpr double kChurnSeconds = 5;
constexpr char kPlacement[] = "bench-placement";

double Ms(MonoClock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

void Check(const Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "catalog_bench: %s: %s\n", what, s.ToString().c_str());
    std::exit(1);
  }
}

state::StateNamespace BenchNamespace() {
  state::NamespaceIdentity id;
  id.model_id = "bench/catalog-model";
  id.weights_revision = "r1";
  id.tokenizer = "bench/tok";
  id.engine_kind = "vllm";
  return *state::DeriveNamespace(id);
}

state::StateKey Key(int owner, uint64_t i) {
  static const state::StateNamespace ns = BenchNamespace();
  uint64_t native[2] = {static_cast<uint64_t>(owner), i};
  return *state::StateKey::Create(ns, 0, {i * 16, i * 16 + 16},
                                  std::span<const uint8_t>(reinterpret_cast<uint8_t*>(native), 16));
}

// When each (owner, shard, sequence) was applied at its owner, for the lag of its visibility at the catalog.
class ApplyTimes {
 public:
  void Record(int owner, uint32_t shard, uint64_t sequence, MonoTime at) {
    MutexLock lock(&mu_);
    auto& v = times_[{owner, shard}];
    if (v.size() < sequence + 1) v.resize(sequence + 1);
    v[sequence] = at;
  }
  // Lag samples of sequences (from, through] of a stream, taken now (only those recorded while measuring).
  void Visible(int owner, uint32_t shard, uint64_t from, uint64_t through) {
    const MonoTime now = MonoNow();
    MutexLock lock(&mu_);
    if (!measuring_) return;
    auto it = times_.find({owner, shard});
    if (it == times_.end()) return;
    for (uint64_t s = from + 1; s <= through && s < it->second.size(); ++s) {
      if (it->second[s] >= since_) lags_.push_back(Ms(now - it->second[s]));
      it->second[s] = MonoTime{};  // counted once
    }
  }
  void Start() {
    MutexLock lock(&mu_);
    measuring_ = true;
    since_ = MonoNow();
  }
  std::vector<double> Stop() {
    MutexLock lock(&mu_);
    measuring_ = false;
    return lags_;
  }

 private:
  Mutex mu_;
  std::map<std::pair<int, uint32_t>, std::vector<MonoTime>> times_ GUARDED_BY(mu_);
  std::vector<double> lags_ GUARDED_BY(mu_);
  bool measuring_ GUARDED_BY(mu_) = false;
  MonoTime since_ GUARDED_BY(mu_){};
};

// The catalog host: a store behind the real PeerService on a loopback gRPC server.
struct CatalogHost {
  std::unique_ptr<catalog::CatalogStore> store;
  std::unique_ptr<catalog::PeerService> service;
  std::unique_ptr<grpc::Server> server;
  std::string endpoint;
  std::string uuid;

  static std::unique_ptr<CatalogHost> Start(const cluster::MemberView& view, ApplyTimes& times) {
    auto host = std::make_unique<CatalogHost>();
    const RuntimeId runtime = RuntimeId::New();
    host->uuid = runtime.ToString();
    catalog::CatalogStore::Options options;
    options.incarnation = runtime.incarnation();
    options.on_visible = [&times](const catalog::StreamId& s, uint64_t from, uint64_t through) {
      times.Visible(std::stoi(s.owner_node.substr(6)), s.shard, from, through);
    };
    host->store = std::make_unique<catalog::CatalogStore>(std::move(options));
    catalog::PeerService::Options service;
    service.self = catalog::PeerIdentity{"bench", "catalog", host->uuid, 1, kPlacement};
    service.incarnation = runtime.incarnation();
    service.catalog = host->store.get();
    service.hosts_shard = [](uint32_t shard) { return shard < kShards; };
    host->service = std::make_unique<catalog::PeerService>(std::move(service), &view);
    host->server = ListenLoopback(host->service.get(), &host->endpoint);
    return host;
  }
};

void InstallView(cluster::MemberView& view, const CatalogHost& host, const std::vector<std::string>& owners,
                 int64_t revision) {
  std::map<std::string, cluster::Member> members;
  members.emplace("catalog", MemberOf("catalog", host.uuid, host.endpoint));
  for (int i = 0; i < kOwners; ++i) {
    const std::string node = fmt::format("owner-{}", i);
    members.emplace(node, MemberOf(node, owners[i], ""));
  }
  view.Install(std::move(members), revision);
}

// A snapshot of one large shard under churn (issue 50): one inventory shard of kScaleRecords residences, an
// OwnerStreamer snapshotting it to a CatalogStore in this process (no network: the inventory's side is what is
// measured) while a driver changes kScaleChangesPerSecond residences of that shard. Also the longest shard-mutex
// hold of one Scan page (a Scan holds the mutex for the whole call: the call is timed) over the whole shard,
// against one walk over the shard's view (ReplicaCount, which walks it under the same mutex), and the cost of
// one Apply into the large shard.
constexpr uint64_t kScaleRecords = 250000;
constexpr double kScaleChangesPerSecond = 5000;

struct ScaleFigures {
  double converge_s = -1, page_max_hold_us = 0, page_p50_hold_us = 0, walk_us = 0, apply_ns = 0;
};

class LocalCatalog final : public catalog::CatalogTransport {
 public:
  explicit LocalCatalog(catalog::CatalogStore* store) : store_(store) {}
  Result<catalog::CatalogReply> Deliver(const std::string&, const catalog::CatalogMessage& message) override {
    return store_->Handle(message);
  }

 private:
  catalog::CatalogStore* const store_;
};

ScaleFigures InventoryAtScale() {
  ScaleFigures f;
  MetricsRegistry metrics;
  core::ResidencyInventory::Options options;
  options.incarnation = 77;
  options.shards = 1;
  auto inventory = core::ResidencyInventory::Create(options, &metrics);
  Check(inventory.status(), "inventory at scale");
  core::ResidencyInventory& inv = **inventory;
  uint64_t generation = 1;
  const MonoTime load = MonoNow();
  for (uint64_t k = 0; k < kScaleRecords; ++k) {
    inv.Apply(0, Key(900, k), core::Tier::kDram, true, core::TransitionCause::kAdmit, ++generation, 2359296);
  }
  f.apply_ns = std::chrono::duration<double, std::nano>(MonoNow() - load).count() / kScaleRecords;
  // Scan pages over the whole shard (the streamer's page size): the longest call.
  // Three whole scans; each page's hold is its best of the three (a VM's preemption inflates one call, not the
  // work), and the figure is the longest page.
  std::vector<double> holds;
  for (int round = 0; round < 3; ++round) {
    std::optional<core::InventoryCursor> cursor;
    size_t scanned = 0, index = 0;
    do {
      const MonoTime t0 = MonoNow();
      core::InventoryPage page =
          inv.Scan(0, cursor ? &*cursor : nullptr, catalog::OwnerStreamer::Options{}.page_records);
      const double us = Ms(MonoNow() - t0) * 1000;
      if (round == 0) {
        holds.push_back(us);
      } else if (index < holds.size()) {
        holds[index] = std::min(holds[index], us);
      }
      ++index;
      scanned += page.records.size();
      cursor = page.next;
    } while (cursor);
    if (scanned != kScaleRecords) Check(Status::Internal(fmt::format("scanned {}", scanned)), "scan");
  }
  f.page_max_hold_us = *std::max_element(holds.begin(), holds.end());
  f.page_p50_hold_us = Percentile(holds, 0.5);
  f.walk_us = 1e18;
  for (int i = 0; i < 3; ++i) {
    const MonoTime t0 = MonoNow();
    if (inv.ReplicaCount(core::Tier::kDram) != kScaleRecords) Check(Status::Internal("walk"), "walk");
    f.walk_us = std::min(f.walk_us, Ms(MonoNow() - t0) * 1000);
  }
  // The snapshot under churn: from the streamer's start to its first committed snapshot (it then streams).
  catalog::CatalogStore store({.incarnation = 5});
  LocalCatalog transport(&store);
  catalog::OwnerStreamer::Options stream;
  stream.owner_node = "owner-scale";
  stream.owner_runtime = "scale-run";
  stream.shard = 0;
  stream.catalog_node = "catalog";
  std::atomic<bool> stop{false};
  std::thread churn([&] {
    uint64_t next = kScaleRecords, oldest = 0, changes = 0;
    const MonoTime start = MonoNow();
    while (!stop.load()) {
      const double due = std::chrono::duration<double>(MonoNow() - start).count() * kScaleChangesPerSecond;
      for (; changes < due; ++changes) {  // alternately a new residence and an eviction of the oldest
        if (changes % 2 == 0) {
          inv.Apply(0, Key(900, next++), core::Tier::kDram, true, core::TransitionCause::kAdmit, ++generation, 2359296);
        } else {
          inv.Apply(0, Key(900, oldest++), core::Tier::kDram, false, core::TransitionCause::kEvict, ++generation,
                    2359296);
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  auto streamer = catalog::OwnerStreamer::Create(stream, &inv, &transport);
  Check(streamer.status(), "streamer at scale");
  const MonoTime t0 = MonoNow();
  while (Ms(MonoNow() - t0) < 30000) {
    (*streamer)->Step();
    if ((*streamer)->snapshots() > 0 && (*streamer)->state() == catalog::OwnerStreamer::State::kStreaming) {
      f.converge_s = Ms(MonoNow() - t0) / 1000;
      break;
    }
  }
  stop = true;
  churn.join();
  return f;
}

// Bounded Lookup rows (issue 50): kHotHolders owners hold the same 128 keys (a hot prefix every host fetched and
// re-advertised), each key in its own shard's slice; one Lookup RPC of those keys from one requester to the real
// PeerService over loopback. Returns the reply's bytes; exits when the RPC fails or a row names more than the
// bound.
constexpr int kHotHolders = 200;
constexpr int kHotKeys = 128;

double HotPrefixLookupReplyBytes() {
  cluster::MemberView view;
  const RuntimeId catalog_runtime = RuntimeId::New();
  catalog::CatalogStore store({.incarnation = catalog_runtime.incarnation()});
  catalog::PeerService::Options options;
  options.self = catalog::PeerIdentity{"bench", "catalog", catalog_runtime.ToString(), 1, kPlacement};
  options.incarnation = catalog_runtime.incarnation();
  options.catalog = &store;
  options.hosts_shard = [](uint32_t) { return true; };
  catalog::PeerService service(std::move(options), &view);
  std::string endpoint;
  std::unique_ptr<grpc::Server> server = ListenLoopback(&service, &endpoint);
  std::map<std::string, cluster::Member> members;
  const cluster::Member catalog_member = MemberOf("catalog", catalog_runtime.ToString(), endpoint);
  members.emplace("catalog", catalog_member);
  const std::string requester_uuid = RuntimeId::New().ToString();
  members.emplace("requester", MemberOf("requester", requester_uuid, ""));
  std::map<uint32_t, std::vector<catalog::CatalogRecord>> by_shard;
  std::vector<state::StateKey> keys;
  for (int k = 0; k < kHotKeys; ++k) {
    keys.push_back(Key(0, static_cast<uint64_t>(k)));
    auto& records = by_shard[state::ShardOf(keys.back(), cluster::kNumShards)];
    // Each stream's interval is its owner's contiguous sequence: versions 1..n per shard.
    records.push_back(catalog::CatalogRecord{keys.back(), 1, true, records.size() + 1, 1, 2359296});
  }
  for (int o = 0; o < kHotHolders; ++o) {
    const std::string node = fmt::format("holder-{}", o);
    const std::string uuid = RuntimeId::New().ToString();
    members.emplace(node, MemberOf(node, uuid, ""));
    for (const auto& [shard, records] : by_shard) {
      const catalog::StreamId stream{node, uuid, shard, catalog_runtime.incarnation()};
      const uint64_t last = records.size();
      if (store.Begin({stream, 1, 0, last}).kind != catalog::CatalogReply::Kind::kAck ||
          store.End({stream, 1, last, records}).kind != catalog::CatalogReply::Kind::kAck) {
        Check(Status::Internal("a holder's snapshot was not installed"), "hot prefix");
      }
    }
  }
  view.Install(std::move(members), 1);
  auto stub = catalog::NewPeerStub(endpoint, nullptr);
  peer::v1::LookupRequest request;
  *request.mutable_route() =
      catalog::MakeRoute({"bench", "requester", requester_uuid, 1, kPlacement}, catalog_member.record);
  for (const state::StateKey& key : keys) {
    const auto encoded = key.Encode();
    request.add_keys(std::string(reinterpret_cast<const char*>(encoded.data()), encoded.size()));
  }
  peer::v1::LookupResponse response;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  const grpc::Status status = stub->Lookup(&context, request, &response);
  if (!status.ok()) Check(Status::Internal(status.error_message()), "hot-prefix Lookup");
  for (const peer::v1::LookupRow& row : response.rows()) {
    if (row.candidates_size() > static_cast<int>(catalog::CatalogStore::kMaxHoldersPerKey)) {
      Check(Status::Internal(fmt::format("a row of {} candidates", row.candidates_size())), "hot-prefix Lookup");
    }
  }
  server->Shutdown(std::chrono::system_clock::now());
  return static_cast<double>(response.ByteSizeLong());
}

}  // namespace
}  // namespace orbitkv::bench

int main(int argc, char** argv) {
  using namespace orbitkv;
  using namespace orbitkv::bench;
  const bool json = ParseBenchArgs(
      argc, argv,
      "The embedded catalog: update lag p50/p99 of 16 owners x 16 shards streaming to one catalog host over "
      "loopback gRPC at 4,500 changes/s, metadata bytes, index bytes, replay after a catalog restart, resyncs; "
      "against the etcd Put and gRPC unary round trips.");
  log::SetLevel(log::Level::kWarn);
  BenchReport report("catalog");
  AddStandardEnv(report);

  // Baseline 1: one etcd Put round trip on a real etcd.
  auto etcd = cluster::testing::EtcdProcess::StartSingle(Deadline::After(std::chrono::seconds(60)));
  Check(etcd.status(), "starting etcd");
  cluster::EtcdClientOptions etcd_options;
  etcd_options.endpoints = {(*etcd)->endpoint()};
  auto etcd_client = cluster::EtcdClient::Create(etcd_options);
  Check(etcd_client.status(), "etcd client");
  std::vector<double> put_ms;
  for (int i = 0; i < 200; ++i) {
    etcdserverpb::PutRequest put;
    put.set_key("/bench/catalog-baseline");
    put.set_value(std::to_string(i));
    const MonoTime t0 = MonoNow();
    Check((*etcd_client)->Put(put, Deadline::After(std::chrono::seconds(10))).status(), "etcd put");
    put_ms.push_back(Ms(MonoNow() - t0));
  }
  const double put_p50 = Percentile(put_ms, 0.5);

  ApplyTimes times;
  cluster::MemberView view;
  std::vector<std::string> owner_uuids;
  for (int i = 0; i < kOwners; ++i) owner_uuids.push_back(RuntimeId::New().ToString());
  std::unique_ptr<CatalogHost> host = CatalogHost::Start(view, times);
  InstallView(view, *host, owner_uuids, 1);

  // Baseline 2: the loopback gRPC unary round trip to the same server (Health, route check included).
  const double rtt_p50 = HealthRoundTripP50Ms(host->endpoint, {"bench", "owner-0", owner_uuids[0], 1, kPlacement},
                                              MemberOf("catalog", host->uuid, host->endpoint).record);

  // 16 owners, 16 streams each.
  MetricsRegistry metrics;
  std::vector<std::unique_ptr<core::ResidencyInventory>> inventories;
  std::vector<std::unique_ptr<catalog::GrpcCatalogTransport>> transports;
  std::vector<std::unique_ptr<catalog::OwnerStreamer>> streamers;
  for (int i = 0; i < kOwners; ++i) {
    core::ResidencyInventory::Options options;
    options.incarnation = static_cast<uint64_t>(i + 1);
    options.shards = kShards;
    auto inventory = core::ResidencyInventory::Create(options, &metrics);
    Check(inventory.status(), "inventory");
    inventories.push_back(std::move(*inventory));
    const catalog::PeerIdentity self{"bench", fmt::format("owner-{}", i), owner_uuids[i], 1, kPlacement};
    transports.push_back(std::make_unique<catalog::GrpcCatalogTransport>(self, &view, nullptr, nullptr));
    for (uint32_t shard = 0; shard < kShards; ++shard) {
      catalog::OwnerStreamer::Options options_s;
      options_s.owner_node = self.node_id;
      options_s.owner_runtime = self.runtime_uuid;
      options_s.shard = shard;
      options_s.catalog_node = "catalog";
      options_s.backoff_max = std::chrono::milliseconds(200);
      auto streamer = catalog::OwnerStreamer::Create(options_s, inventories.back().get(), transports.back().get());
      Check(streamer.status(), "streamer");
      streamers.push_back(std::move(*streamer));
    }
  }
  // Load: 30,000 residences before the streams start.
  std::vector<std::set<uint64_t>> present(kOwners);
  std::mt19937_64 rng(7);
  uint64_t generation = 1;
  auto apply = [&](int owner, uint64_t k, bool add) {
    const state::StateKey key = Key(owner, k);
    auto& inventory = *inventories[owner];
    const uint32_t shard = inventory.ShardFor(key);
    const uint64_t seq =
        inventory.Apply(shard, key, core::Tier::kDram, add,
                        add ? core::TransitionCause::kAdmit : core::TransitionCause::kEvict, ++generation, 65536);
    times.Record(owner, shard, seq, MonoNow());
    if (add) {
      present[owner].insert(k);
    } else {
      present[owner].erase(k);
    }
  };
  for (int i = 0; i < kRecords; ++i) apply(i % kOwners, static_cast<uint64_t>(i / kOwners), true);
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  for (auto& s : streamers) threads.emplace_back([&stop, s = s.get()] { s->Run(stop); });
  auto covered = [&] {
    size_t records = 0;
    for (const auto& shard : host->store->Status()) records += shard.records;
    size_t streaming = 0;
    for (const auto& s : streamers) streaming += s->state() == catalog::OwnerStreamer::State::kStreaming ? 1 : 0;
    size_t live = 0;
    for (const auto& p : present) live += p.size();
    return records == live && streaming == streamers.size();
  };
  for (int i = 0; i < 6000 && !covered(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  if (!covered()) Check(Status::DeadlineExceeded("the catalog never covered the load"), "load");
  uint64_t snapshots_after_load = 0;
  for (const auto& s : streamers) snapshots_after_load += s->snapshots();
  uint64_t bytes_before = 0;
  for (const auto& t : transports) bytes_before += t->bytes_sent();

  // Churn: each change evicts one residence of an owner and admits another (the size stays 30,000).
  times.Start();
  const MonoTime churn_start = MonoNow();
  uint64_t changes = 0;
  uint64_t next_key = kRecords;
  while (MonoNow() - churn_start < std::chrono::duration<double>(kChurnSeconds)) {
    const auto due = churn_start + std::chrono::duration_cast<MonoClock::duration>(
                                       std::chrono::duration<double>(changes / kChangesPerSecond));
    if (MonoNow() < due) {
      std::this_thread::sleep_until(due);
      continue;
    }
    const int owner = static_cast<int>(rng() % kOwners);
    if (changes % 2 == 0) {
      auto it = present[owner].begin();
      std::advance(it, static_cast<long>(rng() % present[owner].size()));
      apply(owner, *it, false);
    } else {
      apply(owner, next_key++, true);
    }
    ++changes;
  }
  const double churn_s = std::chrono::duration<double>(MonoNow() - churn_start).count();
  size_t live = 0;
  for (const auto& p : present) live += p.size();
  for (int i = 0; i < 2000; ++i) {  // drain: every change visible
    size_t records = 0;
    for (const auto& shard : host->store->Status()) records += shard.records;
    bool acked = true;
    for (size_t s = 0; s < streamers.size() && acked; ++s) {
      acked = streamers[s]->acknowledged() == inventories[s / kShards]->Watermark(static_cast<uint32_t>(s % kShards));
    }
    if (acked && records == live) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  const std::vector<double> lags = times.Stop();
  uint64_t bytes_after = 0;
  for (const auto& t : transports) bytes_after += t->bytes_sent();
  uint64_t snapshots_after_churn = 0;
  for (const auto& s : streamers) snapshots_after_churn += s->snapshots();
  const uint64_t index_bytes = host->store->used_bytes();

  // The catalog host restarts empty: a new start at a new endpoint; the owners find it in the view.
  const MonoTime restart = MonoNow();
  std::unique_ptr<CatalogHost> old = std::move(host);
  host = CatalogHost::Start(view, times);
  InstallView(view, *host, owner_uuids, 2);
  old->server->Shutdown(std::chrono::system_clock::now());
  for (int i = 0; i < 12000 && !covered(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const double replay_s = std::chrono::duration<double>(MonoNow() - restart).count();
  if (!covered()) Check(Status::DeadlineExceeded("no full replay within 12 s"), "replay");

  stop = true;
  for (auto& t : threads) t.join();
  streamers.clear();
  host->server->Shutdown(std::chrono::system_clock::now());

  report.AddEnv("owners", std::to_string(kOwners));
  report.AddEnv("streams", std::to_string(kOwners * kShards));
  report.AddEnv("records", std::to_string(kRecords));
  report.AddEnv("changes_per_s", fmt::format("{:.0f}", static_cast<double>(changes) / churn_s));
  report.AddEnv("transport", "loopback gRPC (insecure), route check on every request, one process");
  report.AddEnv("lag_samples", std::to_string(lags.size()));
  report.Add({"catalog_update_lag_p50", "ms", Percentile(lags, 0.5), "grpc_unary_rtt_p50", rtt_p50});
  report.Add({"catalog_update_lag_p99", "ms", Percentile(lags, 0.99), "grpc_unary_rtt_p50", rtt_p50});
  report.Add({"catalog_metadata_bytes_per_s", "B/s", static_cast<double>(bytes_after - bytes_before) / churn_s,
              "changes_per_s", static_cast<double>(changes) / churn_s});
  report.Add({"catalog_replay_s", "s", replay_s, "etcd_put_rtt_p50", put_p50 / 1000});
  report.Add({"catalog_index_bytes_per_host", "B", static_cast<double>(index_bytes), "records",
              static_cast<double>(kRecords)});
  report.Add({"catalog_resyncs", "snapshots", static_cast<double>(snapshots_after_churn - snapshots_after_load),
              "streams", static_cast<double>(kOwners * kShards)});
  const ScaleFigures scale = InventoryAtScale();
  if (scale.converge_s < 0) Check(Status::DeadlineExceeded("no converged snapshot within 30 s"), "at scale");
  report.Add({"snapshot_converge_s_250k", "s", scale.converge_s, "", 0});
  report.Add({"scan_page_max_hold_us", "us", scale.page_max_hold_us, "shard_walk_us_250k", scale.walk_us});
  report.Add({"shard_walk_us_250k", "us", scale.walk_us, "", 0});
  report.AddEnv("scan_page_p50_hold_us", fmt::format("{:.1f}", scale.page_p50_hold_us));
  report.Add({"inventory_apply_ns_250k", "ns", scale.apply_ns, "", 0});
  report.AddEnv("scale",
                fmt::format("one shard of {} residences, {:.0f} changes/s during the snapshot, pages of "
                            "{} (the owner streams' default)",
                            kScaleRecords, kScaleChangesPerSecond, catalog::OwnerStreamer::Options{}.page_records));
  report.Add({"lookup_reply_bytes_max", "B", HotPrefixLookupReplyBytes(), "peer_message_limit_bytes",
              static_cast<double>(catalog::kMaxPeerMessageBytes)});
  report.AddEnv("lookup_hot_prefix",
                fmt::format("{} holders of the same {} keys, one Lookup of them", kHotHolders, kHotKeys));
  report.Add({"etcd_put_rtt_p50", "ms", put_p50, "", 0});
  report.Add({"grpc_unary_rtt_p50", "ms", rtt_p50, "", 0});
  report.Print(json);
  return 0;
}
