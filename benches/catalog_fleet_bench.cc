// The catalog store's own costs for a fleet: N members in the view, N baselined owner slices in one shard, no etcd.
//
// Issue 69's in-process bench (the index issue, 70, measures against it): a MemberView with N members installed by
// hand, and a CatalogStore wired to it the way a catalog host wires it (owner liveness, the live owners a shard must
// cover, the owners' registrations), holding one shard with a baseline from each of the N owners (16 records each;
// every owner also holds one shared hot key). Per N (64, 256, 1,024, 4,096): the median time of
//  - store_lookup_us_at_N: Lookup of the hot key with its completeness (what a Peer.Lookup row costs the store),
//  - store_lookup_miss_us_at_N: Lookup of a key nobody holds,
//  - store_complete_us_at_N: Complete(shard) alone (every live owner's baseline checked),
//  - store_maintenance_ms_at_N: one DropDeadOwners round (the catalog host's every 500 ms),
// each against the same figure at N = 64 measured in this run (the ratio is the growth factor; the seed's limits
// want it flat or logarithmic, and today it is linear where the store walks every owner).
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "catalog/catalog_grpc.h"  // first of the gRPC users (cluster/grpc.h)

#include "base/clock.h"
#include "base/logging.h"
#include "bench_report.h"
#include "cluster/member_record.h"
#include "cluster/member_view.h"
#include "state/namespace.h"
#include "state/state_key.h"

namespace orbitkv::bench {
namespace {

constexpr uint32_t kShard = 3;
constexpr uint64_t kRecordsPerOwner = 16;
constexpr int kSamples = 2001;

struct Figures {
  double lookup_us = 0, miss_us = 0, complete_us = 0, maintenance_ms = 0;
};

// Key `i` of chain `chain` in a namespace of the bench's own.
state::StateKey Key(uint64_t chain, uint64_t i) {
  static const state::StateNamespace ns = [] {
    state::NamespaceIdentity id;
    id.model_id = "bench/catalog-fleet-model";
    id.weights_revision = "r1";
    id.tokenizer = "bench/tok";
    id.engine_kind = "vllm";
    return *state::DeriveNamespace(id);
  }();
  uint64_t native[2] = {chain, i};
  return *state::StateKey::Create(ns, 0, {i * 16, i * 16 + 16},
                                  std::span<const uint8_t>(reinterpret_cast<uint8_t*>(native), 16));
}

template <typename F>
double MedianMicros(int samples, F&& body) {
  std::vector<double> us;
  us.reserve(static_cast<size_t>(samples));
  for (int i = 0; i < samples; ++i) {
    const MonoTime t0 = MonoNow();
    body();
    us.push_back(std::chrono::duration<double, std::micro>(MonoNow() - t0).count());
  }
  return Percentile(us, 0.5);
}

Figures Measure(size_t n) {
  cluster::MemberView view;
  std::map<std::string, cluster::Member> members;
  for (size_t i = 0; i < n; ++i) {
    cluster::Member m;
    m.record.cluster = "fleet";
    m.record.node_id = fmt::format("node-{:05}", i);
    m.record.epoch = 1;
    m.record.endpoint = "10.0.0.1:7300";
    m.record.runtime_uuid = cluster::NewRuntimeUuid();
    m.record.incarnation = 1000 + i;
    m.create_revision = static_cast<int64_t>(10 + i);
    members.emplace(m.record.node_id, m);
  }
  view.Install(members, static_cast<int64_t>(10 + n));

  catalog::CatalogStore::Options options;
  options.incarnation = 0xfeed;
  options.budget_bytes = 1ull << 30;
  catalog::FollowMemberView(&view, &options);  // as a catalog host wires its store
  catalog::CatalogStore store(options);

  const state::StateKey hot = Key(1, 0);
  for (const auto& [node, m] : members) {
    const catalog::StreamId stream{node,           m.record.runtime_uuid, kShard, options.incarnation,
                                   m.record.epoch, m.record.incarnation};
    if (store.Begin({stream, 1, 0, kRecordsPerOwner + 1}).kind != catalog::CatalogReply::Kind::kAck) std::abort();
    catalog::SnapshotEnd end{stream, 1, kRecordsPerOwner + 1, {}};
    end.interval.push_back(catalog::CatalogRecord{hot, 1, true, 1, 1, 4096});
    const uint64_t salt = 1000 + static_cast<uint64_t>(m.create_revision);
    for (uint64_t r = 0; r < kRecordsPerOwner; ++r) {
      end.interval.push_back(catalog::CatalogRecord{Key(salt, r), 1, true, r + 2, 1, 4096});
    }
    if (store.End(end).kind != catalog::CatalogReply::Kind::kAck) std::abort();
  }
  if (!store.Complete(kShard)) std::abort();

  Figures f;
  const state::StateKey miss = Key(2, 0);
  bool complete = false;
  size_t found = 0;
  f.lookup_us = MedianMicros(kSamples, [&] { found += store.Lookup(kShard, hot, &complete, "node-00001").size(); });
  f.miss_us = MedianMicros(kSamples, [&] { found += store.Lookup(kShard, miss, &complete, "node-00001").size(); });
  f.complete_us = MedianMicros(kSamples, [&] { complete = store.Complete(kShard) && complete; });
  f.maintenance_ms = MedianMicros(101, [&] { found += store.DropDeadOwners(); }) / 1000;
  if (found == 0 || !complete) std::abort();  // the hot key is held by every owner; the shard is complete
  return f;
}

}  // namespace
}  // namespace orbitkv::bench

int main(int argc, char** argv) {
  using namespace orbitkv;
  using namespace orbitkv::bench;
  const bool json =
      ParseBenchArgs(argc, argv,
                     "The catalog store's own costs for a fleet: N members in the view, N baselined owner slices "
                     "in one shard (lookup, completeness, maintenance), against N = 64 in the same run.");
  log::SetLevel(log::Level::kError);
  BenchReport report("catalog-fleet");
  AddStandardEnv(report);
  const Figures base = Measure(64);
  for (size_t n : {size_t{64}, size_t{256}, size_t{1024}, size_t{4096}}) {
    const Figures f = n == 64 ? base : Measure(n);
    report.Add({fmt::format("store_lookup_us_at_{}", n), "us", f.lookup_us, "store_lookup_us_at_64", base.lookup_us});
    report.Add(
        {fmt::format("store_lookup_miss_us_at_{}", n), "us", f.miss_us, "store_lookup_miss_us_at_64", base.miss_us});
    report.Add(
        {fmt::format("store_complete_us_at_{}", n), "us", f.complete_us, "store_complete_us_at_64", base.complete_us});
    report.Add({fmt::format("store_maintenance_ms_at_{}", n), "ms", f.maintenance_ms, "store_maintenance_ms_at_64",
                base.maintenance_ms});
  }
  report.AddEnv("shard", fmt::format("one shard, N owner slices with a baseline each ({} records + one hot key "
                                     "every owner holds), the member view installed by hand, no etcd, no gRPC",
                                     kRecordsPerOwner));
  report.AddEnv("samples", fmt::format("median of {} calls ({} for a maintenance round)", kSamples, 101));
  report.Print(json);
  return 0;
}
