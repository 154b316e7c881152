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
// And the same store behind the real PeerService on a loopback gRPC port, asked by the real requester transport
// (GrpcRequesterTransport, as Discovery asks a catalog host), the route checked against the same N-member view:
//  - peer_lookup_us_at_N: Peer.Lookup of the hot key, against peer_health_us_at_N, Peer.Health to the same port
//    in the same run (the loopback gRPC round trip with the route check: what a lookup cannot beat),
//  - peer_lookup_batch_us_at_N: Peer.Lookup of a full batch (kMaxLookupKeys keys of that shard, the hot key among
//    them), against the same round trip.
//  - lookup_p99_us_at_N: p99 of a batch of kMaxLookupKeys keys looked up one by one (as Peer.Lookup asks the store),
//    against N = 64,
//  - owner_apply_p99_us_at_N: p99 of an owner's one-record delta while another thread looks batches up back to back,
//    against owner_apply_idle_p99_us_at_N, the same with no lookups,
//  - catalog_bytes_per_record: the allocator's bytes in use per record of a store holding 1 M records (64 owners x
//    16,384, one shard), against catalog_charged_bytes_per_record, what the budget charges one (EntryCharge),
//  - probe_rpcs_per_s_per_manager_at_N: the Health probes one Manager's PeerDirectory sends a second (one round every
//    2 s) when it probes the peers it talks to (16 catalog hosts), against probe_rpcs_per_s_full_mesh_at_N, the
//    same directory probing every member as before issue 70.
#include <fmt/format.h>

#include <malloc.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "catalog/catalog_grpc.h"  // first of the gRPC users (cluster/grpc.h)

#include "base/clock.h"
#include "base/logging.h"
#include "bench_keys.h"
#include "bench_report.h"
#include "catalog/peer_directory.h"
#include "catalog/peer_service.h"
#include "catalog/route.h"
#include "cluster/member_record.h"
#include "cluster/member_view.h"
#include "cluster/placement.h"
#include "peer_bench.h"

namespace orbitkv::bench {
namespace {

constexpr uint32_t kShard = 3;
constexpr uint64_t kRecordsPerOwner = 16;
constexpr int kSamples = 2001;
constexpr int kBatchSamples = 51;  // a full batch at N = 4,096 is ~kMaxLookupKeys store lookups of ~1 ms each
constexpr char kFingerprint[] = "catalog-fleet-placement";

struct Figures {
  double lookup_us = 0, miss_us = 0, complete_us = 0, maintenance_ms = 0;
  double peer_lookup_us = 0, peer_batch_us = 0, peer_health_us = 0;
  uint64_t probes_used = 0, probes_mesh = 0;  // Health RPCs of one PeerDirectory round
  double batch_p99_us = 0;                    // Lookup of 128 keys, one by one as Peer.Lookup asks the store
  double apply_idle_p99_us = 0, apply_busy_p99_us = 0;
};

// Key `i` of chain `chain`.
state::StateKey Key(uint64_t chain, uint64_t i) {
  static const state::StateNamespace ns = BenchNamespace("bench/catalog-fleet-model");
  return BenchKey(ns, chain, i);
}

// The first key of chain `chain` that falls in kShard (where the bench keeps its slices, and where
// Peer.Lookup looks for it: state::ShardOf).
state::StateKey KeyInShard(uint64_t chain) {
  for (uint64_t i = 0;; ++i) {
    state::StateKey key = Key(chain, i);
    if (state::ShardOf(key, cluster::kNumShards) == kShard) return key;
  }
}

template <typename F>
double PercentileMicros(int samples, double p, F&& body) {
  std::vector<double> us;
  us.reserve(static_cast<size_t>(samples));
  for (int i = 0; i < samples; ++i) {
    const MonoTime t0 = MonoNow();
    body();
    us.push_back(std::chrono::duration<double, std::micro>(MonoNow() - t0).count());
  }
  return Percentile(us, p);
}

template <typename F>
double MedianMicros(int samples, F&& body) {
  return PercentileMicros(samples, 0.5, std::forward<F>(body));
}

catalog::PeerIdentity IdentityOf(const cluster::Member& m) {
  return catalog::PeerIdentity{.cluster = m.record.cluster,
                               .node_id = m.record.node_id,
                               .runtime_uuid = m.record.runtime_uuid,
                               .epoch = m.record.epoch,
                               .placement_fingerprint = kFingerprint};
}

// The store behind a PeerService on a loopback port: node-00000 hosts it, node-00001 asks (both in the view, whose
// record of node-00000 is given the port now, as the member view of a real fleet names it).
void MeasurePeer(catalog::CatalogStore& store, cluster::MemberView& view,
                 std::map<std::string, cluster::Member> members, const state::StateKey& hot, Figures& f) {
  cluster::Member& host = members.begin()->second;
  const cluster::Member& asker = std::next(members.begin())->second;
  catalog::PeerService::Options options;
  options.self = IdentityOf(host);
  options.incarnation = host.record.incarnation;
  options.capabilities = {"catalog.lookup"};
  options.catalog = &store;
  options.hosts_shard = [](uint32_t shard) { return shard < cluster::kNumShards; };
  catalog::PeerService service(options, &view);
  std::unique_ptr<grpc::Server> server = ListenLoopback(&service, &host.record.endpoint);
  view.Install(members, view.revision() + 1);

  catalog::GrpcRequesterTransport requester(IdentityOf(asker), &view, nullptr);
  std::vector<state::StateKey> batch = {hot};
  for (uint64_t i = 0; batch.size() < static_cast<size_t>(catalog::kMaxLookupKeys); ++i) {
    state::StateKey key = Key(3, i);
    if (state::ShardOf(key, cluster::kNumShards) == kShard) batch.push_back(std::move(key));
  }
  const auto ask = [&](std::span<const state::StateKey> keys) {
    Result<std::vector<catalog::LookupRow>> rows =
        requester.Lookup(host.record.node_id, keys, Deadline::After(std::chrono::seconds(30)), nullptr);
    if (!rows.ok() || rows->size() != keys.size() || !(*rows)[0].complete || (*rows)[0].candidates.empty()) {
      fmt::print(stderr, "catalog_fleet_bench: Peer.Lookup: {}\n",
                 rows.ok() ? "not the hot key's holders in a complete shard" : rows.status().ToString());
      std::exit(1);
    }
  };
  ask(batch);  // the channel connected, the answer checked once
  f.peer_health_us = HealthRoundTripP50Ms(host.record.endpoint, IdentityOf(asker), host.record, kSamples) * 1000;
  f.peer_lookup_us = MedianMicros(kSamples, [&] { ask(std::span<const state::StateKey>(batch.data(), 1)); });
  f.peer_batch_us = MedianMicros(kBatchSamples, [&] { ask(batch); });
  // One probe round of a Manager's PeerDirectory over the N members (every record naming this loopback port, so a
  // probe is a real RPC that answers at once): the peers it talks to (16 catalog hosts, issue 70) against the full
  // mesh of before (every member).
  cluster::MemberView probed;
  std::map<std::string, cluster::Member> local = members;
  for (auto& [node, m] : local) m.record.endpoint = host.record.endpoint;
  probed.Install(local, view.revision() + 1);
  auto round = [&](bool mesh) {
    catalog::PeerDirectory::Options o;
    o.self = IdentityOf(asker);
    if (mesh) o.max_probes_per_round = SIZE_MAX;  // as before issue 70: every member, every round
    if (!mesh) {
      o.always_probe = [&local] {
        std::vector<std::string> hosts;
        for (auto it = local.begin(); it != local.end() && hosts.size() < cluster::kMaxCatalogNodes; ++it) {
          hosts.push_back(it->first);
        }
        return hosts;
      };
    }
    catalog::PeerDirectory directory(o, &probed);
    directory.ProbeAll();
    return directory.probes_sent();
  };
  f.probes_used = round(false);
  f.probes_mesh = round(true);
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
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

  const state::StateKey hot = KeyInShard(1);
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
  const state::StateKey miss = KeyInShard(2);
  bool complete = false;
  size_t found = 0;
  f.lookup_us = MedianMicros(kSamples, [&] { found += store.Lookup(kShard, hot, &complete, "node-00001").size(); });
  f.miss_us = MedianMicros(kSamples, [&] { found += store.Lookup(kShard, miss, &complete, "node-00001").size(); });
  f.complete_us = MedianMicros(kSamples, [&] { complete = store.Complete(kShard) && complete; });
  f.maintenance_ms = MedianMicros(101, [&] { found += store.DropDeadOwners(); }) / 1000;
  if (found == 0 || !complete) std::abort();  // the hot key is held by every owner; the shard is complete
  // A batch of kMaxLookupKeys keys (the hot one, keys some owner holds, keys nobody holds), looked up one by one as
  // Peer.Lookup asks the store.
  std::vector<state::StateKey> batch = {hot};
  for (uint64_t i = 0; batch.size() < catalog::kMaxLookupKeys; ++i) {
    batch.push_back(i % 2 == 0 ? Key(1000 + 10 + (i % n), i % kRecordsPerOwner) : Key(7, i));
  }
  auto lookup_batch = [&] {
    for (const state::StateKey& key : batch) found += store.Lookup(kShard, key, &complete, "node-00001").size();
  };
  f.batch_p99_us = PercentileMicros(kBatchSamples * 4, 0.99, lookup_batch);
  // An owner's deltas (one record each, alternately adding and removing a key of the first owner's slice), idle, then
  // while another thread looks batches up back to back: what a catalog host's owner streams wait for lookups.
  const cluster::Member& owner = members.begin()->second;
  const catalog::StreamId owner_stream{owner.record.node_id, owner.record.runtime_uuid, kShard,
                                       options.incarnation,  owner.record.epoch,        owner.record.incarnation};
  const uint64_t first_sequence = kRecordsPerOwner + 2;  // after the snapshot's end watermark
  uint64_t sequence = first_sequence;
  const state::StateKey churned = Key(99, 0);
  auto apply = [&] {
    const bool add = (sequence - first_sequence) % 2 == 0;  // added, then removed, and so on
    const catalog::DeltaBatch delta{
        owner_stream, sequence, {catalog::CatalogRecord{churned, 1, add, sequence, 1, 4096}}};
    if (const catalog::CatalogReply r = store.Apply(delta); r.kind != catalog::CatalogReply::Kind::kAck) {
      fmt::print(stderr, "catalog-fleet: an owner delta was answered {}: {}\n", catalog::CatalogReplyName(r.kind),
                 r.reason);
      std::abort();
    }
    ++sequence;
  };
  f.apply_idle_p99_us = PercentileMicros(kSamples, 0.99, apply);
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> batches{0};
  std::thread lookups([&] {
    bool c = false;
    size_t seen = 0;
    while (!stop.load(std::memory_order_relaxed)) {
      for (const state::StateKey& key : batch) seen += store.Lookup(kShard, key, &c, "node-00002").size();
      batches.fetch_add(1, std::memory_order_relaxed);
    }
    if (seen == 0) std::abort();  // the hot key is in every batch
  });
  while (batches.load(std::memory_order_relaxed) == 0) std::this_thread::yield();  // the lookups run
  f.apply_busy_p99_us = PercentileMicros(kSamples, 0.99, apply);
  stop = true;
  lookups.join();
  MeasurePeer(store, view, members, hot, f);
  return f;
}

// Real memory per record (issue 70, item 3's baseline): the allocator's bytes in use before and after a store takes
// 1 M records (64 owners x 16,384 in one shard), against what the budget charges a record (EntryCharge).
double BytesPerRecord(size_t owners, size_t per_owner) {
  const size_t before = mallinfo2().uordblks;
  {
    catalog::CatalogStore::Options options;
    options.incarnation = 0xfeed;
    options.budget_bytes = 4ull << 30;
    auto store = std::make_unique<catalog::CatalogStore>(options);
    for (size_t o = 0; o < owners; ++o) {
      const catalog::StreamId stream{fmt::format("node-{:05}", o), "run", kShard, options.incarnation, 1, 1 + o};
      if (store->Begin({stream, 1, 0, per_owner}).kind != catalog::CatalogReply::Kind::kAck) std::abort();
      catalog::SnapshotEnd end{stream, 1, per_owner, {}};
      end.interval.reserve(per_owner);
      for (uint64_t r = 0; r < per_owner; ++r) {
        end.interval.push_back(catalog::CatalogRecord{Key(50000 + o, r), 1, true, r + 1, 1, 4096});
      }
      if (store->End(end).kind != catalog::CatalogReply::Kind::kAck) std::abort();
    }
    const size_t after = mallinfo2().uordblks;
    return static_cast<double>(after - before) / static_cast<double>(owners * per_owner);
  }
}

}  // namespace
}  // namespace orbitkv::bench

int main(int argc, char** argv) {
  using namespace orbitkv;
  using namespace orbitkv::bench;
  const bool json = ParseBenchArgs(
      argc, argv,
      "The catalog store's own costs for a fleet: N members in the view, N baselined owner slices "
      "in one shard (lookup, completeness, maintenance), against N = 64 in the same run; and Peer.Lookup of that "
      "store over loopback gRPC, against Peer.Health on the same channel.");
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
    report.Add({fmt::format("peer_lookup_us_at_{}", n), "us", f.peer_lookup_us, fmt::format("peer_health_us_at_{}", n),
                f.peer_health_us});
    report.Add({fmt::format("peer_lookup_batch_us_at_{}", n), "us", f.peer_batch_us,
                fmt::format("peer_health_us_at_{}", n), f.peer_health_us});
    report.Add({fmt::format("lookup_p99_us_at_{}", n), "us", f.batch_p99_us, "lookup_p99_us_at_64", base.batch_p99_us});
    report.Add({fmt::format("owner_apply_p99_us_at_{}", n), "us", f.apply_busy_p99_us,
                fmt::format("owner_apply_idle_p99_us_at_{}", n), f.apply_idle_p99_us});
    // A round every 2 s (catalog::PeerDirectory::Options::probe_interval, jittered 80-120 %).
    report.Add({fmt::format("probe_rpcs_per_s_per_manager_at_{}", n), "rpc/s", static_cast<double>(f.probes_used) / 2,
                fmt::format("probe_rpcs_per_s_full_mesh_at_{}", n), static_cast<double>(f.probes_mesh) / 2});
  }
  report.Add({"catalog_bytes_per_record", "B", BytesPerRecord(64, 16384), "catalog_charged_bytes_per_record",
              static_cast<double>(catalog::CatalogStore::EntryCharge())});
  report.AddEnv("shard", fmt::format("one shard, N owner slices with a baseline each ({} records + one hot key "
                                     "every owner holds), the member view installed by hand, no etcd, no gRPC",
                                     kRecordsPerOwner));
  report.AddEnv("samples", fmt::format("median of {} calls ({} for a maintenance round, {} for a batch of {} keys)",
                                       kSamples, 101, kBatchSamples, catalog::kMaxLookupKeys));
  report.AddEnv("peer",
                "PeerService on 127.0.0.1 (insecure gRPC), asked by GrpcRequesterTransport; the baseline is "
                "Peer.Health to the same port on a channel of its own (its route check included)");
  report.Print(json);
  return 0;
}
