// Bounded discovery and source authorization: cold and warm lookups over three catalog hosts, stale candidates.
//
// All in one process over real gRPC on loopback, with a member view installed by hand (the route check runs on
// every request): three catalog hosts (a CatalogStore behind PeerService each, shards placed by rendezvous
// hashing as in a cluster), a source (a real BlockCache whose residency inventory streams to the catalog hosts
// through one OwnerStreamer per shard, serving Authorize through SourceHolds over a real UCX engine on loopback),
// and a requester (CandidateIndex, Discovery and AuthorizeBest over GrpcRequesterTransport, as in a Manager).
//   cold: 50 queries of 1,024 keys the requester never saw (RPCs per query; time to learn every candidate);
//   warm: 2,000 plans of 128 known keys (Discover + PlanSpan, no RPC);
//   stale: while the source replaces 400 blocks a second, spans of 16 blocks are discovered and authorized: the
//          share of authorizations the source refuses because the index named a version it no longer holds.
// Baselines in the same run: the loopback gRPC unary round trip (Health) and 128 lookups in an unordered_map of
// the same keys.
#include <atomic>
#include <cstdio>
#include <map>
#include <random>
#include <thread>
#include <unordered_map>

#include "catalog/peer_service.h"  // first of the gRPC users (cluster/grpc.h)

#include "base/logging.h"
#include "base/runtime_id.h"
#include "bench_report.h"
#include "catalog/catalog_grpc.h"
#include "catalog/catalog_store.h"
#include "catalog/owner_streamer.h"
#include "catalog/remote_plan.h"
#include "catalog/source_holds.h"
#include "catalog/transfer_grants.h"
#include "cluster/placement.h"
#include "core/block_cache.h"
#include "peer_bench.h"
#include "state/namespace.h"
#include "transfer/ucx_engine.h"

namespace orbitkv::bench {
namespace {

constexpr int kChains = 50;
constexpr size_t kChainKeys = 1024;
constexpr uint64_t kBlockBytes = 4096;
constexpr int kWarmPlans = 2000;
constexpr double kReplacementsPerSecond = 400;
constexpr double kStaleSeconds = 4;
constexpr char kPlacementFp[] = "bench-placement";

double Ms(MonoClock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

void Check(const Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "discovery_bench: %s: %s\n", what, s.ToString().c_str());
    std::exit(1);
  }
}

std::vector<state::StateKey> Chain(int chain) {
  state::NamespaceIdentity id;
  id.model_id = "bench/discovery-model";
  id.weights_revision = "r1";
  id.tokenizer = "bench/tok";
  id.engine_kind = "vllm";
  static const state::StateNamespace ns = *state::DeriveNamespace(id);
  std::vector<state::StateKey> keys;
  for (size_t i = 0; i < kChainKeys; ++i) {
    uint64_t native[2] = {static_cast<uint64_t>(chain), i};
    keys.push_back(*state::StateKey::Create(ns, 0, {i * 16, i * 16 + 16},
                                            std::span<const uint8_t>(reinterpret_cast<uint8_t*>(native), 16)));
  }
  return keys;
}

// A PeerService on a loopback gRPC server.
struct Server {
  std::unique_ptr<catalog::CatalogStore> store;  // catalog hosts only
  std::unique_ptr<catalog::PeerService> service;
  std::unique_ptr<grpc::Server> server;
  std::string endpoint;
  void Listen() { server = ListenLoopback(service.get(), &endpoint); }
};

}  // namespace
}  // namespace orbitkv::bench

int main(int argc, char** argv) {
  using namespace orbitkv;
  using namespace orbitkv::bench;
  const bool json = ParseBenchArgs(
      argc, argv,
      "Bounded discovery over three catalog hosts on loopback gRPC: Lookup RPCs and time per cold 1,024-key query, "
      "a warm 128-key plan against 128 unordered_map lookups, the stale-candidate rate while the source replaces "
      "blocks, and the candidate index's bytes.");
  log::SetLevel(log::Level::kError);
  BenchReport report("discovery");
  AddStandardEnv(report);

  const std::vector<std::string> hosts = {"cat-0", "cat-1", "cat-2"};
  auto placement = cluster::Placement::Create(hosts);
  Check(placement.status(), "placement");
  cluster::MemberView view;
  std::map<std::string, std::string> uuid;
  for (const char* n : {"cat-0", "cat-1", "cat-2", "source", "requester"}) uuid[n] = RuntimeId::New().ToString();
  const auto identity = [&](const std::string& node) {
    return catalog::PeerIdentity{"bench", node, uuid[node], 1, kPlacementFp};
  };

  // The source: its cache, its UCX engine (grants only), its holds.
  MetricsRegistry metrics;
  core::BlockCacheOptions cache_options;
  cache_options.pool.capacity_bytes = 512ull << 20;
  cache_options.pool.slab_bytes = 4ull << 20;
  cache_options.pool.numa_nodes = {-1};
  cache_options.pool.pin_mode = core::PinMode::kAllowUnpinned;
  cache_options.table.expected_blocks = kChains * kChainKeys;
  auto cache = core::BlockCache::Create(cache_options, &metrics);
  Check(cache.status(), "source cache");
  transfer::UcxEngineOptions ucx;
  ucx.transports = "tcp";
  ucx.require_grants = true;
  ucx.engine_id = RuntimeId::Parse(uuid["source"])->incarnation();
  auto engine = transfer::UcxTransferEngine::Create(ucx);
  Check(engine.status(), "UCX engine");
  std::vector<transfer::RegionHandle> arenas;
  for (size_t i = 0; i < (*cache)->pool().arena_count(); ++i) {
    auto region = (*engine)->RegisterRegion((*cache)->pool().arena(i).data(), (*cache)->pool().arena(i).size());
    Check(region.status(), "registering the pool");
    arenas.push_back(*region);
  }
  catalog::TransferGrantIssuer issuer(engine->get(), arenas);
  catalog::SourceHolds holds({}, &(*cache)->table(), &(*cache)->pool(), &(*cache)->transfer_budget(), &issuer);

  // Three catalog hosts and the source's listener.
  std::vector<std::unique_ptr<Server>> catalogs;
  for (const std::string& name : hosts) {
    auto s = std::make_unique<Server>();
    catalog::CatalogStore::Options store;
    store.incarnation = RuntimeId::Parse(uuid[name])->incarnation();
    s->store = std::make_unique<catalog::CatalogStore>(std::move(store));
    catalog::PeerService::Options service;
    service.self = identity(name);
    service.catalog = s->store.get();
    service.hosts_shard = [&placement, name](uint32_t shard) { return placement->OwnerOf(shard) == name; };
    s->service = std::make_unique<catalog::PeerService>(std::move(service), &view);
    s->Listen();
    catalogs.push_back(std::move(s));
  }
  Server source;
  {
    catalog::PeerService::Options service;
    service.self = identity("source");
    service.source = &holds;
    service.ucx_worker_address = (*engine)->ListenAddress();
    source.service = std::make_unique<catalog::PeerService>(std::move(service), &view);
    source.Listen();
  }
  {
    std::map<std::string, cluster::Member> members;
    for (size_t i = 0; i < hosts.size(); ++i) {
      members.emplace(hosts[i], MemberOf(hosts[i], uuid[hosts[i]], catalogs[i]->endpoint));
    }
    members.emplace("source", MemberOf("source", uuid["source"], source.endpoint));
    members.emplace("requester", MemberOf("requester", uuid["requester"], ""));
    view.Install(std::move(members), 1);
  }

  // Baseline: the loopback gRPC unary round trip (Health, route check included).
  const double rtt_p50 = HealthRoundTripP50Ms(catalogs[0]->endpoint, identity("requester"), view.Find("cat-0")->record);

  // The source's blocks, streamed to the catalog hosts.
  std::vector<std::vector<state::StateKey>> chains;
  for (int c = 0; c < kChains; ++c) chains.push_back(Chain(c));
  const auto publish = [&](const state::StateKey& key) {
    auto writer = (*cache)->Prepare(key, kBlockBytes);
    if (!writer.ok()) return;  // being replaced by another thread, or no room
    std::memset(writer->data(), 0x5a, kBlockBytes);
    (*cache)->Seal(*writer);
  };
  for (const auto& chain : chains) {
    for (const auto& key : chain) publish(key);
  }
  catalog::GrpcCatalogTransport streams_transport(identity("source"), &view, nullptr, nullptr);
  std::vector<std::unique_ptr<catalog::OwnerStreamer>> streamers;
  for (uint32_t shard = 0; shard < cluster::kNumShards; ++shard) {
    catalog::OwnerStreamer::Options o;
    o.owner_node = "source";
    o.owner_runtime = uuid["source"];
    o.shard = shard;
    o.catalog_node = placement->OwnerOf(shard);
    auto streamer = catalog::OwnerStreamer::Create(o, &(*cache)->inventory(), &streams_transport);
    Check(streamer.status(), "owner stream");
    streamers.push_back(std::move(*streamer));
  }
  std::atomic<bool> stop{false};
  std::vector<std::thread> stream_threads;
  for (auto& s : streamers) stream_threads.emplace_back([&stop, s = s.get()] { s->Run(stop); });
  const size_t blocks = static_cast<size_t>(kChains) * kChainKeys;
  for (int i = 0; i < 6000; ++i) {
    size_t records = 0;
    for (const auto& c : catalogs) {
      for (const auto& shard : c->store->Status()) records += shard.records;
    }
    if (records >= blocks) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }

  // The requester.
  catalog::GrpcRequesterTransport requester(identity("requester"), &view, nullptr);
  catalog::CandidateIndex index({});
  catalog::Discovery::Options discovery_options;
  discovery_options.host_of = [&placement](const state::StateKey& key) {
    return placement->OwnerOf(cluster::Placement::ShardOf(key));
  };
  catalog::Discovery discovery(discovery_options, &index, &requester);

  // Cold: 1,024 keys never seen, learnt whole.
  std::vector<double> cold_ms;
  size_t cold_rpcs = 0;
  for (int c = 0; c < kChains; ++c) {
    const MonoTime t0 = MonoNow();
    const catalog::Discovery::Outcome outcome = discovery.Discover(chains[c]);
    cold_ms.push_back(Ms(MonoNow() - t0));
    cold_rpcs += outcome.rpcs;
    if (outcome.known_prefix != kChainKeys) {
      Check(Status::Internal(fmt::format("a cold query learnt {} of {} keys", outcome.known_prefix, kChainKeys)),
            "cold discovery");
    }
  }

  // Warm: plans of 128 known keys; the baseline looks the same keys up in an unordered_map.
  std::vector<double> warm_us;
  std::mt19937_64 rng(21);
  const uint64_t rpcs_before_warm = requester.lookups();
  for (int i = 0; i < kWarmPlans; ++i) {
    const auto& chain = chains[rng() % kChains];
    const size_t at = rng() % (kChainKeys - 128);
    const std::span<const state::StateKey> keys(chain.data() + at, 128);
    const MonoTime t0 = MonoNow();
    const catalog::Discovery::Outcome outcome = discovery.Discover(keys);
    const auto span = catalog::PlanSpan(keys, index, "requester", {});
    warm_us.push_back(std::chrono::duration<double, std::micro>(MonoNow() - t0).count());
    if (outcome.rpcs != 0 || !span.has_value()) Check(Status::Internal("a warm plan asked the directory"), "warm");
  }
  const uint64_t warm_rpcs = requester.lookups() - rpcs_before_warm;
  std::unordered_map<state::StateKey, std::vector<catalog::Candidate>, state::StateKeyHash> map;
  for (const auto& chain : chains) {
    for (const auto& key : chain) map[key] = index.Find(key);
  }
  std::vector<double> map_us;
  size_t found = 0;
  for (int i = 0; i < kWarmPlans; ++i) {
    const auto& chain = chains[rng() % kChains];
    const size_t at = rng() % (kChainKeys - 128);
    const MonoTime t0 = MonoNow();
    for (size_t k = at; k < at + 128; ++k) found += map.find(chain[k])->second.size();
    map_us.push_back(std::chrono::duration<double, std::micro>(MonoNow() - t0).count());
  }
  const uint64_t index_bytes = index.GetStats().bytes;

  // Stale: the source replaces blocks (evict, save again: a new version) while spans are discovered and
  // authorized; a refused authorization is a stale candidate.
  std::atomic<bool> churn_stop{false};
  std::atomic<uint64_t> replaced{0};
  std::thread churn([&] {
    std::mt19937_64 r(5);
    const MonoTime start = MonoNow();
    while (!churn_stop.load()) {
      const auto due = start + std::chrono::duration_cast<MonoClock::duration>(
                                   std::chrono::duration<double>(replaced.load() / kReplacementsPerSecond));
      if (MonoNow() < due) {
        std::this_thread::sleep_until(due);
        continue;
      }
      const state::StateKey& key = chains[r() % kChains][r() % kChainKeys];
      if ((*cache)->table().Remove(key, core::Tier::kDram).ok()) publish(key);
      replaced.fetch_add(1);
    }
  });
  uint64_t attempts = 0, rejections = 0, request = 1;
  const MonoTime stale_start = MonoNow();
  while (MonoNow() - stale_start < std::chrono::duration<double>(kStaleSeconds)) {
    const auto& chain = chains[rng() % kChains];
    const size_t at = rng() % (kChainKeys - 16);
    const std::span<const state::StateKey> keys(chain.data() + at, 16);
    (void)discovery.Discover(keys);
    catalog::AuthorizeOptions options;
    options.self_node = "requester";
    options.request_id = request++;
    const catalog::AuthorizeOutcome outcome = catalog::AuthorizeBest(keys, index, requester, options);
    attempts += outcome.attempts;
    rejections += outcome.rejections;
    if (outcome.authorized.has_value()) {
      (void)requester.Release(outcome.authorized->span.node, outcome.authorized->span.runtime, options.request_id,
                              outcome.authorized->reply.grant.grant_id, outcome.authorized->reply.grant.grant_secret,
                              Deadline::After(std::chrono::seconds(2)));
    }
  }
  const double stale_s = std::chrono::duration<double>(MonoNow() - stale_start).count();
  churn_stop.store(true);
  churn.join();
  stop.store(true);
  for (auto& t : stream_threads) t.join();
  for (int i = 0; i < 200 && holds.GetStats().sessions != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }

  report.AddEnv("catalog_hosts", "3");
  report.AddEnv("source_blocks", std::to_string(blocks));
  report.AddEnv("transport", "loopback gRPC (insecure), route check on every request, one process; UCX tcp");
  report.AddEnv("candidate_ttl_ms", "5000");
  report.AddEnv("replacements_per_s", fmt::format("{:.0f}", static_cast<double>(replaced.load()) / stale_s));
  report.AddEnv("warm_plan_rpcs", std::to_string(warm_rpcs));
  report.AddEnv("authorizations", std::to_string(attempts));
  report.AddEnv("map_lookups_found", std::to_string(found));
  const double bound = static_cast<double>(kChainKeys / 128 + 2);
  report.Add({"discovery_rpcs_per_cold_query", "RPCs", static_cast<double>(cold_rpcs) / kChains,
              "rpc_bound_ceil_1024_128_plus_2", bound});
  report.Add({"discovery_cold_p50", "ms", Percentile(cold_ms, 0.5), "grpc_unary_rtt_p50", rtt_p50});
  report.Add({"discovery_cold_p99", "ms", Percentile(cold_ms, 0.99), "grpc_unary_rtt_p50", rtt_p50});
  report.Add(
      {"discovery_warm_p50", "us", Percentile(warm_us, 0.5), "unordered_map_lookup_128", Percentile(map_us, 0.5)});
  report.Add({"candidate_stale_rate", "fraction", attempts == 0 ? 0 : static_cast<double>(rejections) / attempts,
              "source_replaced_fraction", static_cast<double>(replaced.load()) / static_cast<double>(blocks)});
  report.Add({"candidate_index_bytes", "B", static_cast<double>(index_bytes), "candidate_index_budget",
              static_cast<double>(16ull << 20)});
  report.Add({"grpc_unary_rtt_p50", "ms", rtt_p50, "", 0});
  report.Add({"unordered_map_lookup_128", "us", Percentile(map_us, 0.5), "", 0});
  report.Print(json);
  return 0;
}
