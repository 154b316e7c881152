// Several hosts on one machine: Managers in network namespaces on one bridge (NetnsMesh), a real etcd
// on the bridge, engines in the root namespace over the Managers' Unix sockets, UCX on the veths.
// Label `distributed` (serial: the mesh's addresses are fixed).
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <set>
#include <string>
#include <thread>

#include "catalog/peer_service.h"  // first of the gRPC users (cluster/grpc.h)

#include "catalog/candidate_index.h"
#include "catalog/catalog_grpc.h"
#include "catalog/discovery.h"
#include "cluster/placement.h"

#include <fcntl.h>
#include <sys/mman.h>

#include "cluster/testing/etcd_process.h"
#include "distributed_util.h"
#include "engine_kv.h"
#include "mesh_fixture.h"
#include "netns_mesh.h"
#include "transfer/test_util.h"
#include "transfer/ucx_engine.h"

namespace orbitkv {
namespace {

using namespace mesh_testing;  // NOLINT: the fixture and its checks

// Three hosts report one runtime UUID each, the same in `orbitkv stats`, in etcd and in Health (asked
// across the bridge), and see each other healthy; a restarted Manager gets a new UUID and a request
// naming its old start is refused by its peers.
TEST_F(MeshTest, ThreeManagersOneRuntimeIdentityEachAndARestartIsRefused) {
  std::vector<std::unique_ptr<ManagerProcess>> managers;
  ASSERT_TRUE(StartManagers(kHosts, "mesh", &managers));
  std::set<std::string> uuids;
  std::string placement;
  for (int i = 0; i < kHosts; ++i) {
    const std::string stats = StatsWhen(*managers[i], "\"peers_healthy\": 2");
    ASSERT_NE(stats.find("\"members\": 3"), std::string::npos) << stats;
    ASSERT_NE(stats.find("\"peers_healthy\": 2"), std::string::npos) << stats << managers[i]->LogText();
    EXPECT_NE(stats.find("\"remote_work\": 1"), std::string::npos) << stats;
    const std::string uuid = StringField(stats, "runtime_uuid");
    EXPECT_EQ(RecordOf(etcd_->endpoint(), Node(i), "mesh").runtime_uuid, uuid);
    EXPECT_EQ(RecordOf(etcd_->endpoint(), Node(i), "mesh").endpoint, PeerEndpoint(i));
    EXPECT_EQ(StringField(stats, "transfer_listen").rfind(mesh_->address(i) + ":", 0), 0u) << stats;
    uuids.insert(uuid);
    placement = StringField(stats, "placement_fingerprint");
  }
  EXPECT_EQ(uuids.size(), 3u);

  // Health from the root namespace, routed as node-0, to node-1: its UUID, its UCX engine on its veth.
  const cluster::MemberRecord r0 = RecordOf(etcd_->endpoint(), Node(0), "mesh");
  const cluster::MemberRecord r1 = RecordOf(etcd_->endpoint(), Node(1), "mesh");
  const catalog::PeerIdentity as0{"mesh", Node(0), r0.runtime_uuid, r0.epoch, placement};
  peer::v1::HealthResponse health;
  grpc::Status answered = Health(PeerEndpoint(1), catalog::MakeRoute(as0, r1), &health);
  ASSERT_TRUE(answered.ok()) << answered.error_message();
  EXPECT_EQ(health.runtime_uuid(), r1.runtime_uuid);
  EXPECT_EQ(health.ucx_worker_address(), StringField(StatsOf(*managers[1]), "transfer_listen"));

  // UCX across the bridge: a reader in the root namespace reaches node-1's engine, which refuses a read
  // outside any grant.
  const Status refused = testing::ReadManagersPool(health.ucx_worker_address(), health.incarnation(), 0,
                                                   std::string(NetnsMesh::kRootAddress) + ":0", mesh_->root_veth());
  EXPECT_EQ(refused.code(), StatusCode::kPermissionDenied) << refused;

  // node-1 restarts: a new UUID everywhere; its old start is refused as a destination and as a source.
  ASSERT_EQ(managers[1]->Stop(SIGTERM), 0);
  managers[1] = StartManager(1, "mesh-1b");
  ASSERT_TRUE(managers[1]->running()) << managers[1]->LogText();
  const std::string restarted = StatsWhen(*managers[1], "\"peers_healthy\": 2");
  const std::string new_uuid = StringField(restarted, "runtime_uuid");
  EXPECT_EQ(uuids.count(new_uuid), 0u);
  EXPECT_EQ(RecordOf(etcd_->endpoint(), Node(1), "mesh").runtime_uuid, new_uuid);
  EXPECT_EQ(Health(PeerEndpoint(1), catalog::MakeRoute(as0, r1), &health).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);  // names node-1's old start
  const catalog::PeerIdentity old1{"mesh", Node(1), r1.runtime_uuid, r1.epoch, placement};
  grpc::Status stale = grpc::Status::OK;
  for (int i = 0; i < 500; ++i) {  // until node-0's view holds node-1's new record
    stale = Health(PeerEndpoint(0), catalog::MakeRoute(old1, r0), &health);
    if (stale.error_code() == grpc::StatusCode::PERMISSION_DENIED) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(stale.error_code(), grpc::StatusCode::PERMISSION_DENIED) << stale.error_message();
  // The others see the new start healthy.
  EXPECT_NE(StatsWhen(*managers[0], "\"peers_healthy\": 2").find("\"peers_healthy\": 2"), std::string::npos);
}

// An engine on the root namespace saving `count` blocks of 4 KiB into one Manager.
class BlockWriter {
 public:
  BlockWriter(const ManagerProcess& manager, uint64_t instance, size_t count) : count_(count) {
    client::ClientOptions options;
    options.socket_path = manager.socket();
    auto client = client::CacheClient::Connect(options);
    EXPECT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
    fd_ = ScopedFd(memfd_create("kv", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    EXPECT_EQ(ftruncate(fd_.get(), static_cast<off_t>(count * kPage)), 0);
    EXPECT_EQ(fcntl(fd_.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
    memory_ = static_cast<uint8_t*>(mmap(nullptr, count * kPage, PROT_READ | PROT_WRITE, MAP_SHARED, fd_.get(), 0));
    EXPECT_TRUE(client_->RegisterInstance(instance, state::testing::SampleNamespace()).ok());
    client::BufferSpec spec{fd_.get(), count * kPage, 0, kPage, kPage};
    EXPECT_TRUE(client_->RegisterGroup(instance, 0, static_cast<uint32_t>(count), std::span(&spec, 1)).ok());
    instance_ = instance;
  }
  ~BlockWriter() { munmap(memory_, count_ * kPage); }
  // Saves blocks [first, first + n) of chain `chain`; returns how many the Manager wrote.
  uint64_t Save(uint64_t chain, size_t first, size_t n) {
    const auto keys = testing::Chain(chain, first + n);
    uint64_t written = 0;
    for (size_t at = first; at < first + n; at += 500) {
      std::vector<client::SaveItem> items;
      for (size_t i = at; i < std::min(first + n, at + 500); ++i) {
        std::memset(memory_ + (i % count_) * kPage, static_cast<int>(i), kPage);
        items.push_back({keys[i], static_cast<uint32_t>(i % count_)});
      }
      auto saved = client_->Save(instance_, 0, items);
      EXPECT_TRUE(saved.ok()) << saved.status();
      written += saved.ok() ? saved->written : 0;
    }
    return written;
  }

 private:
  static constexpr uint64_t kPage = 4096;
  size_t count_;
  uint64_t instance_ = 0;
  std::unique_ptr<client::CacheClient> client_;
  ScopedFd fd_;
  uint8_t* memory_ = nullptr;
};

// All lines of a listing of `manager` (channel::DumpKind), page by page as `orbitkv ... dump` reads them.
std::vector<std::string> DumpLines(const ManagerProcess& manager, channel::DumpKind kind, uint32_t shard) {
  client::ClientOptions options;
  options.socket_path = manager.socket();
  auto client = client::CacheClient::Connect(options);
  EXPECT_TRUE(client.ok()) << client.status();
  std::vector<std::string> lines;
  uint64_t first = 0;
  do {
    auto page = (*client)->Dump(kind, shard, first);
    if (!page.ok()) return lines;  // not a catalog host
    for (size_t at = 0; at < page->text.size();) {
      const size_t end = page->text.find('\n', at);
      lines.push_back(page->text.substr(at, end - at));
      at = end + 1;
    }
    first = page->next;
  } while (first != 0);
  return lines;
}

// Record for record: for every shard, the evidence each of its copies holds equals the union of the live owners'
// inventories (each line prefixed with its owner's node id), as the dumps show them, and there are as many such
// copies as the placement keeps (issue 54).
void ExpectDumpsEqual(const std::vector<std::pair<std::string, const ManagerProcess*>>& managers) {
  size_t records = 0;
  const uint64_t replicas = Field(StatsOf(*managers.front().second), "catalog_replicas");
  for (uint32_t shard = 0; shard < 16; ++shard) {
    std::multiset<std::string> inventories;
    std::vector<std::multiset<std::string>> copies;
    for (const auto& [node, m] : managers) {
      std::vector<std::string> lines = DumpLines(*m, channel::DumpKind::kCatalog, shard);
      if (!lines.empty()) copies.emplace_back(lines.begin(), lines.end());
      for (const std::string& line : DumpLines(*m, channel::DumpKind::kInventory, shard)) {
        inventories.insert(node + " " + line);
      }
    }
    if (inventories.empty()) continue;
    EXPECT_EQ(copies.size(), replicas) << "shard " << shard;
    for (const auto& copy : copies) EXPECT_EQ(copy, inventories) << "shard " << shard;
    records += inventories.size();
  }
  EXPECT_GT(records, 0u);
}

// Three Managers with 10,000 blocks each, two of them catalog hosts: the catalogs equal their owners'
// inventories; a catalog host killed and restarted is repaired from the surviving owners; an owner killed
// disappears from every catalog once the member view drops it.
TEST_F(MeshTest, CatalogsHoldTheirOwnersEvidenceAndRecoverFromLostHostsAndOwners) {
  catalog_nodes_ = "node-0,node-2";  // node-1 only owns: killing it loses an owner, not a catalog host
  std::vector<std::unique_ptr<ManagerProcess>> managers;
  std::vector<std::string> nodes = {Node(0), Node(1), Node(2)};
  ASSERT_TRUE(StartManagers(kHosts, "cat", &managers));
  {
    std::vector<std::unique_ptr<BlockWriter>> writers;
    for (int i = 0; i < kHosts; ++i) {
      writers.push_back(std::make_unique<BlockWriter>(*managers[i], 10 + i, 10000));
      EXPECT_EQ(writers.back()->Save(500 + i, 0, 10000), 10000u);
    }
  }
  auto all = [&] { return All(managers); };
  ASSERT_TRUE(CatalogsEqualInventories(all()));
  auto named = [&] {
    std::vector<std::pair<std::string, const ManagerProcess*>> out;
    for (size_t i = 0; i < managers.size(); ++i) out.emplace_back(nodes[i], managers[i].get());
    return out;
  };
  ExpectDumpsEqual(named());
  // The operator's view of the same: one "complete" line per shard placed on node-0, and the dumps as lines.
  const std::string status0 = testing::CliOutput({"catalog", "status", "--socket", managers[0]->socket()});
  size_t complete = 0;
  for (size_t at = 0; (at = status0.find(" complete ", at)) != std::string::npos; ++at) ++complete;
  EXPECT_EQ(complete, Field(StatsOf(*managers[0]), "catalog_shards_hosted")) << status0;
  EXPECT_GT(complete, 0u);
  const std::string inventory_dump =
      testing::CliOutput({"inventory", "dump", "--shard", "5", "--socket", managers[1]->socket()});
  EXPECT_EQ(static_cast<size_t>(std::count(inventory_dump.begin(), inventory_dump.end(), '\n')),
            DumpLines(*managers[1], channel::DumpKind::kInventory, 5).size());

  // Lookup from the root namespace, routed as node-0: for keys node-1 saved, every host keeping a copy of the key's
  // shard names node-1's current start (DRAM, with the sequence its inventory has); a host without one says not
  // placed here.
  {
    const std::string placement = StringField(StatsOf(*managers[0]), "placement_fingerprint");
    const cluster::MemberRecord r0 = RecordOf(etcd_->endpoint(), Node(0), "mesh");
    const cluster::MemberRecord r1 = RecordOf(etcd_->endpoint(), Node(1), "mesh");
    const catalog::PeerIdentity as0{"mesh", Node(0), r0.runtime_uuid, r0.epoch, placement};
    const auto keys = testing::Chain(501, 100);
    size_t answered = 0;
    for (int host : {0, 2}) {
      const cluster::MemberRecord to = RecordOf(etcd_->endpoint(), Node(host), "mesh");
      peer::v1::LookupRequest request;
      *request.mutable_route() = catalog::MakeRoute(as0, to);
      for (const auto& key : keys) {
        const auto bytes = key.Encode();
        request.add_keys(bytes.data(), bytes.size());
      }
      peer::v1::LookupResponse response;
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
      const grpc::Status status = catalog::NewPeerStub(to.endpoint, nullptr)->Lookup(&context, request, &response);
      ASSERT_TRUE(status.ok()) << status.error_message();
      ASSERT_EQ(response.rows_size(), 100);
      for (const auto& row : response.rows()) {
        if (!row.placed_here()) {
          EXPECT_EQ(row.candidates_size(), 0);
          continue;
        }
        EXPECT_TRUE(row.complete());
        ASSERT_EQ(row.candidates_size(), 1);
        EXPECT_EQ(row.candidates(0).owner_node(), Node(1));
        EXPECT_EQ(row.candidates(0).owner_runtime_uuid(), r1.runtime_uuid);
        EXPECT_EQ(row.candidates(0).tier(), 1u);
        ++answered;
      }
      // More than 128 keys in one request is refused.
      for (int i = 0; i < 29; ++i) request.add_keys(request.keys(0));
      grpc::ClientContext again;
      again.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
      EXPECT_EQ(catalog::NewPeerStub(to.endpoint, nullptr)->Lookup(&again, request, &response).error_code(),
                grpc::StatusCode::INVALID_ARGUMENT);
    }
    // Every key answered by each of its copies (two catalog nodes: both keep every shard, reduced coverage).
    EXPECT_EQ(answered, 100u * Field(StatsOf(*managers[0]), "catalog_replicas"));
    EXPECT_EQ(Field(StatsOf(*managers[0]), "catalog_reduced_coverage"), 1u);
    const std::string status = testing::CliOutput({"status", "--socket", managers[0]->socket()});
    EXPECT_NE(status.find("catalog: 2 copies of each shard (reduced failure coverage"), std::string::npos) << status;
  }
  // The same through Discovery over Peer.Lookup: 1,000 of node-1's keys are learnt in batches per catalog host
  // (at most ceil(1000/128) + 1 RPCs for two hosts), then a warm repeat asks nobody. (Kept past the catalog
  // restart below: a requester's learnt candidates outlive it.)
  cluster::MemberView view;
  InstallMembers(&view);
  auto placement_record = cluster::Placement::Create({"node-0", "node-2"});
  ASSERT_TRUE(placement_record.ok());
  const cluster::MemberRecord requester = RecordOf(etcd_->endpoint(), Node(0), "mesh");
  catalog::GrpcRequesterTransport transport(
      catalog::PeerIdentity{"mesh", Node(0), requester.runtime_uuid, requester.epoch,
                            StringField(StatsOf(*managers[0]), "placement_fingerprint")},
      &view, nullptr);
  catalog::CandidateIndex index({.ttl = std::chrono::minutes(5)});
  catalog::Discovery::Options options;
  options.host_of = [&](const state::StateKey& key) {
    return placement_record->OwnerOf(cluster::Placement::ShardOf(key));
  };
  catalog::Discovery discovery(options, &index, &transport);
  const auto many = testing::Chain(501, 1000);
  catalog::Discovery::Outcome cold = discovery.Discover(many);
  EXPECT_EQ(cold.known_prefix, 1000u);
  EXPECT_LE(cold.rpcs, 1000u / 128 + 2);
  EXPECT_TRUE(cold.failed_hosts.empty());
  ASSERT_EQ(index.Find(many[0]).size(), 1u);
  EXPECT_EQ(index.Find(many[0])[0].owner_node, Node(1));
  EXPECT_EQ(discovery.Discover(many).rpcs, 0u);

  // kill -9 the catalog host node-2 and start it again (empty: a new start): the owners resync it.
  managers[2]->Stop(SIGKILL);
  // Meanwhile the requester plans from what it learnt: the whole prefix, node-1 as its source, no Lookup RPC to
  // the lost (then incomplete) catalog host.
  const catalog::Discovery::Outcome during = discovery.Discover(many);
  EXPECT_EQ(during.known_prefix, 1000u);
  EXPECT_EQ(during.rpcs, 0u);
  EXPECT_EQ(index.Find(many[999])[0].owner_node, Node(1));
  for (int attempt = 0; attempt < 20; ++attempt) {  // its Node ID is held until its lease expires (3 s)
    managers[2] = StartManager(2, fmt::format("cat-2b{}", attempt));
    if (managers[2]->running()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
  ASSERT_TRUE(managers[2]->running()) << managers[2]->LogText();
  EXPECT_TRUE(CatalogsEqualInventories(all()));
  const std::string restarted = StatsOf(*managers[2]);
  EXPECT_GT(Field(restarted, "catalog_records"), 0u) << restarted;
  // The restarted catalog host read incomplete until every live owner had re-baselined its shards (an empty store
  // used to read complete), and is complete now.
  EXPECT_GT(Field(restarted, "catalog_incomplete_shard_ms"), 0u) << restarted;
  EXPECT_EQ(Field(restarted, "catalog_incomplete_shards"), 0u) << restarted;
  EXPECT_EQ(Field(restarted, "inventory_records"), 0u) << restarted;
  ExpectDumpsEqual(named());

  // kill -9 the owner node-1: once the member view drops it (TTL 3 s), its slices go from every catalog.
  managers[1]->Stop(SIGKILL);
  managers.erase(managers.begin() + 1);
  nodes.erase(nodes.begin() + 1);
  EXPECT_TRUE(CatalogsEqualInventories(all()));
  ExpectDumpsEqual(named());
}

// node-0 hosts every shard; the owners' journals hold 64 KiB. node-0 stopped with SIGSTOP while the owners
// churn far past what their journals keep: their saves go on (a Publish never waits for a catalog), and after
// SIGCONT the owners resync by snapshots and the catalog equals the inventories again; then 3 % packet loss on
// an owner's veth while it streams. A catalog RPC from an older start of an owner, or for a shard placed
// elsewhere, is refused.
TEST_F(MeshTest, AStoppedCatalogHostAndASmallJournalStillConverge) {
  catalog_nodes_ = "node-0";
  std::vector<std::unique_ptr<ManagerProcess>> managers;
  ASSERT_TRUE(StartManagers(kHosts, "stop", &managers, {"--inventory-journal-bytes", "64KiB"}));
  std::vector<std::unique_ptr<BlockWriter>> writers;
  for (int i = 0; i < kHosts; ++i) {
    writers.push_back(std::make_unique<BlockWriter>(*managers[i], 20 + i, 4000));
    EXPECT_EQ(writers.back()->Save(700 + i, 0, 2000), 2000u);
  }
  auto all = [&] { return All(managers); };
  ASSERT_TRUE(CatalogsEqualInventories(all()));
  const uint64_t snapshots_before = Field(StatsOf(*managers[1]), "catalog_stream_snapshots");

  ASSERT_EQ(kill(managers[0]->pid(), SIGSTOP), 0);
  for (int i = 1; i < kHosts; ++i) EXPECT_EQ(writers[i]->Save(700 + i, 2000, 2000), 2000u);  // never waits
  ASSERT_EQ(kill(managers[0]->pid(), SIGCONT), 0);
  EXPECT_TRUE(CatalogsEqualInventories(all()));
  EXPECT_GT(Field(StatsOf(*managers[1]), "catalog_stream_snapshots"), snapshots_before)
      << "the owners had to resync: their journals could not hold what node-0 missed";

  // 3 % loss each way on node-2's veth while it streams 2,000 more: TCP retransmits, nothing wrong is
  // installed, and the catalog converges (the loss stays on while it does).
  ASSERT_TRUE(mesh_->Loss(2, 3).ok());
  EXPECT_EQ(writers[2]->Save(900, 0, 2000), 2000u);
  EXPECT_TRUE(CatalogsEqualInventories(all()));
  ASSERT_TRUE(mesh_->NoLoss(2).ok());
  ExpectDumpsEqual({{Node(0), managers[0].get()}, {Node(1), managers[1].get()}, {Node(2), managers[2].get()}});

  // Catalog RPCs the route check refuses before any evidence is touched.
  const cluster::MemberRecord r0 = RecordOf(etcd_->endpoint(), Node(0), "mesh");
  const cluster::MemberRecord r1 = RecordOf(etcd_->endpoint(), Node(1), "mesh");
  const std::string placement = StringField(StatsOf(*managers[0]), "placement_fingerprint");
  auto catalog_call = [&](const catalog::PeerIdentity& as, const cluster::MemberRecord& to) {
    auto stub = catalog::NewPeerStub(to.endpoint, nullptr);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    catalog::CatalogMessage heartbeat =
        catalog::DeltaBatch{catalog::StreamId{as.node_id, as.runtime_uuid, 3, 0}, 1, {}};
    peer::v1::CatalogRequest request = catalog::ToRequest(heartbeat);
    *request.mutable_route() = catalog::MakeRoute(as, to);
    peer::v1::CatalogResponse response;
    return stub->Catalog(&context, request, &response);
  };
  const catalog::PeerIdentity old_start{"mesh", Node(1), "00000000-0000-4000-8000-000000000001", r1.epoch, placement};
  EXPECT_EQ(catalog_call(old_start, r0).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  const catalog::PeerIdentity as1{"mesh", Node(1), r1.runtime_uuid, r1.epoch, placement};
  EXPECT_TRUE(catalog_call(as1, r0).ok());
  EXPECT_EQ(catalog_call(as1, RecordOf(etcd_->endpoint(), Node(2), "mesh")).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);  // node-2 hosts no shard
}

// The issue-22 path end to end, through the ordinary engine calls: a 64-block prefix saved by an engine on node-0
// is queried by an engine on node-1 (Loading, then a hit: discovered, authorized, read over UCX, sealed) and
// restored byte-exact into poisoned pages; the fetched copy is advertised, so with node-0 stopped an engine on
// node-2 gets it from node-1. Sources hold nothing afterwards, and the cold query stayed within the RPC bound.
TEST_F(MeshTest, APrefixSavedOnOneHostIsRestoredOnAnotherAndItsCopyServesAThird) {
  catalog_nodes_ = "node-1,node-2";  // node-0 is only a source: stopping it leaves the catalog whole
  std::vector<std::unique_ptr<ManagerProcess>> managers;
  ASSERT_TRUE(StartManagers(kHosts, "fetch", &managers, {"--candidate-ttl-ms", "600000"}));
  auto all = [&] { return All(managers); };
  constexpr uint32_t kBlocks = 64;
  const auto keys = testing::Chain(4242, kBlocks);
  MeshEngine a(*managers[0], 1, kBlocks);
  ASSERT_TRUE(testing::SaveChain(*a.client, 1, a.kv, keys).ok());
  ASSERT_TRUE(CatalogsEqualInventories(all()));

  MeshEngine b(*managers[1], 2, kBlocks);
  const auto [hits_b, exact_b] = b.QueryAndRestore(keys);
  EXPECT_EQ(hits_b, kBlocks);
  EXPECT_EQ(exact_b, kBlocks);
  const std::string stats_b = StatsOf(*managers[1]);
  EXPECT_EQ(Field(stats_b, "remote_fetched_blocks"), kBlocks) << stats_b;
  EXPECT_EQ(Field(stats_b, "remote_fetch_failures"), 0u);
  // One cold query of 64 keys over three catalog hosts: at most ceil(64 / 128) + 2 Lookup RPCs.
  EXPECT_GE(Field(stats_b, "discovery_rpcs"), 1u);
  EXPECT_LE(Field(stats_b, "discovery_rpcs"), 3u);
  // The source gave everything back once the requester released.
  EXPECT_EQ(FieldWhen(*managers[0], "source_sessions", 0), 0u);
  EXPECT_EQ(Field(StatsOf(*managers[0]), "source_pinned_bytes"), 0u);
  EXPECT_EQ(Field(StatsOf(*managers[0]), "source_grants"), 1u);
  EXPECT_EQ(FieldWhen(*managers[1], "remote_staging_bytes", 0), 0u);

  // node-1's copy is a resident like any other: streamed to the catalog, found by node-2 with node-0 stopped.
  ASSERT_TRUE(CatalogsEqualInventories(all()));
  ASSERT_EQ(kill(managers[0]->pid(), SIGSTOP), 0);
  MeshEngine c(*managers[2], 3, kBlocks);
  const auto [hits_c, exact_c] = c.QueryAndRestore(keys);
  ASSERT_EQ(kill(managers[0]->pid(), SIGCONT), 0);
  EXPECT_EQ(hits_c, kBlocks) << StatsOf(*managers[2]);
  EXPECT_EQ(exact_c, kBlocks);
  EXPECT_EQ(Field(StatsOf(*managers[1]), "source_grants"), 1u);  // node-1 served it
  // node-0 (the tie's winner) was asked first and did not answer in time; node-1 was the one alternative.
  EXPECT_EQ(Field(StatsOf(*managers[2]), "source_authorizations"), 2u);
  EXPECT_EQ(Field(StatsOf(*managers[2]), "remote_fetched_blocks"), kBlocks);

  // Two engines on node-1 asking for another missing prefix (saved on node-2: node-0's registration lapsed while it
  // was stopped) at once share one fetch: both get all of it, and it crosses the bridge once.
  const auto keys2 = testing::Chain(4243, kBlocks);
  ASSERT_TRUE(testing::SaveChain(*c.client, 3, c.kv, keys2).ok());
  ASSERT_TRUE(CatalogsEqualInventories(all()));
  const uint64_t fetched_before = Field(StatsOf(*managers[1]), "remote_fetched_blocks");
  MeshEngine b2(*managers[1], 4, kBlocks);
  std::pair<size_t, size_t> first, second;
  std::thread other([&] { second = b2.QueryAndRestore(keys2); });
  first = b.QueryAndRestore(keys2);
  other.join();
  EXPECT_EQ(first, std::make_pair(size_t{kBlocks}, size_t{kBlocks}));
  EXPECT_EQ(second, std::make_pair(size_t{kBlocks}, size_t{kBlocks}));
  EXPECT_EQ(Field(StatsOf(*managers[1]), "remote_fetched_blocks"), fetched_before + kBlocks);

  ExpectNothingHeld(managers);
  EXPECT_TRUE(testing::EventuallyIdle(*b.client));
  EXPECT_TRUE(testing::EventuallyIdle(*c.client));
}

// The sum of orbitkv_etcd_calls_total over the unary methods (Watch and LeaseKeepAlive count stream opens: the
// membership's streams are counted apart) in a /metrics text.
uint64_t EtcdUnaryCalls(const std::string& metrics) {
  uint64_t total = 0;
  const std::regex line(R"re(orbitkv_etcd_calls_total\{method="([A-Za-z]+)"\} ([0-9]+))re");
  for (auto it = std::sregex_iterator(metrics.begin(), metrics.end(), line); it != std::sregex_iterator(); ++it) {
    const std::string method = (*it)[1].str();
    if (method != "Watch" && method != "LeaseKeepAlive") total += std::stoull((*it)[2].str());
  }
  return total;
}

// Issue 21's design goals in counters, not timing. node-0 holds the blocks but pins nothing for anyone (a 4 KiB
// transfer budget: every authorization is refused as busy, which keeps the candidates), so every query node-1's
// engine makes plans again from its candidate index. A cold 1,024-key query over three catalog hosts makes at most
// ceil(1024/128) + 2 Lookup RPCs, never more than --discovery-max-hosts 2 hosts at once; then 2,000 plans whose
// candidates are cached make no Lookup RPC and no etcd unary call (each still authorizes: they are plans).
// Batching is what is measured, so node-1 hedges no lookup within the budget (--discovery-hedge-ms 2500): a hedge
// asks a slow copy's keys of the next copy as well, by design, and on a loaded machine the first lookup to a host
// (a new channel) may take the default 100 ms (hedging has tests of its own: DiscoveryTest, mesh recovery).
TEST_F(MeshTest, WarmPlansAskNobodyAndAColdQueryIsBatchedPerCatalogHost) {
  const std::string metrics1 = mesh_->address(1);
  std::vector<std::unique_ptr<ManagerProcess>> managers;
  managers.push_back(StartManager(0, "warm-0", {"--transfer-budget", "4KiB"}));
  managers.push_back(StartManager(1, "warm-1",
                                  {"--candidate-ttl-ms", "600000", "--discovery-max-hosts", "2", "--discovery-hedge-ms",
                                   "2500", "--metrics-addr", metrics1 + ":9100"}));
  managers.push_back(StartManager(2, "warm-2"));
  for (auto& m : managers) ASSERT_TRUE(m->running()) << m->LogText();
  auto all = [&] { return All(managers); };
  const auto long_chain = testing::Chain(8800, 1024);
  const auto short_chain = testing::Chain(8801, 8);
  {
    MeshEngine a(*managers[0], 1, 1024);
    ASSERT_TRUE(testing::SaveChain(*a.client, 1, a.kv, long_chain).ok());
    ASSERT_TRUE(testing::SaveChain(*a.client, 1, a.kv, short_chain).ok());
  }
  ASSERT_TRUE(CatalogsEqualInventories(all()));
  MeshEngine b(*managers[1], 2, 8);

  auto hit = b.client->QueryWait(2, 0, long_chain, std::chrono::seconds(20));
  ASSERT_TRUE(hit.ok()) << hit.status();
  EXPECT_EQ(hit->hits, 0u);  // the only source refused: the engine recomputes
  std::string stats = StatsOf(*managers[1]);
  EXPECT_GE(Field(stats, "discovery_rpcs"), 3u) << stats;  // each of the three hosts holds some shards
  EXPECT_LE(Field(stats, "discovery_rpcs"), 1024u / 128 + 2) << stats;
  EXPECT_EQ(Field(stats, "discovery_hedges"), 0u) << stats;
  EXPECT_LE(Field(stats, "discovery_max_hosts_in_flight"), 2u) << stats;
  EXPECT_GE(Field(stats, "discovery_max_hosts_in_flight"), 1u) << stats;
  EXPECT_EQ(Field(stats, "candidate_index_entries"), 1024u) << stats;
  EXPECT_EQ(Field(stats, "source_authorizations"), 1u) << stats;
  EXPECT_EQ(Field(StatsOf(*managers[0]), "source_rejections"), 1u);

  // The short chain once (cold), then 2,000 warm plans.
  hit = b.client->QueryWait(2, 0, short_chain, std::chrono::seconds(20));
  ASSERT_TRUE(hit.ok()) << hit.status();
  stats = StatsOf(*managers[1]);
  const uint64_t rpcs = Field(stats, "discovery_rpcs");
  const uint64_t authorizations = Field(stats, "source_authorizations");
  const std::string metrics_before = testing::MetricsText(9100, metrics1.c_str());
  const uint64_t etcd_before = EtcdUnaryCalls(metrics_before);
  ASSERT_NE(metrics_before.find("orbitkv_etcd_calls_total"), std::string::npos) << metrics_before;
  for (int i = 0; i < 2000; ++i) {
    hit = b.client->QueryWait(2, 0, short_chain, std::chrono::seconds(20));
    ASSERT_TRUE(hit.ok()) << hit.status();
    ASSERT_EQ(hit->hits, 0u);
  }
  stats = StatsOf(*managers[1]);
  EXPECT_EQ(Field(stats, "discovery_rpcs"), rpcs) << stats;
  EXPECT_EQ(Field(stats, "source_authorizations"), authorizations + 2000) << stats;
  EXPECT_EQ(EtcdUnaryCalls(testing::MetricsText(9100, metrics1.c_str())), etcd_before);
  EXPECT_EQ(FieldWhen(*managers[0], "source_sessions", 0), 0u);
  EXPECT_TRUE(testing::EventuallyIdle(*b.client));
}

// The requester's half played by the test under node-1's identity (route source node-1's current start), against
// real sources: node-0 and node-2 hold the same chain. A grant covers exactly the versions held and is released
// once (a second Release finds nothing); versions the sources no longer hold (what the index names after a
// replacement) are refused by both, pin nothing, leave no session, and are removed from the index with no new
// Lookup; the 1,025th session is ResourceExhausted; and when node-1 dies holding 1,024 grants, node-0 revokes its
// transport once the member view drops it and frees everything.
TEST_F(MeshTest, SourcesGrantOnlyTheVersionsTheyHoldAndFreeAVanishedRequestersHolds) {
  std::vector<std::unique_ptr<ManagerProcess>> managers;
  ASSERT_TRUE(StartManagers(kHosts, "auth", &managers));
  auto all = [&] { return All(managers); };
  const auto keys = testing::Chain(9100, 4);
  MeshEngine a(*managers[0], 1, 4), c(*managers[2], 3, 4);
  ASSERT_TRUE(testing::SaveChain(*a.client, 1, a.kv, keys).ok());
  ASSERT_TRUE(testing::SaveChain(*c.client, 3, c.kv, keys).ok());
  ASSERT_TRUE(CatalogsEqualInventories(all()));

  cluster::MemberView view;
  InstallMembers(&view);
  const cluster::MemberRecord r1 = view.Find(Node(1))->record;
  const std::string placement = StringField(StatsOf(*managers[0]), "placement_fingerprint");
  const catalog::PeerIdentity as1{"mesh", Node(1), r1.runtime_uuid, r1.epoch, placement};
  auto placed = cluster::Placement::Create({"node-0", "node-1", "node-2"});
  ASSERT_TRUE(placed.ok());
  catalog::GrpcRequesterTransport transport(as1, &view, nullptr);
  catalog::CandidateIndex index({});
  catalog::Discovery::Options options;
  options.host_of = [&](const state::StateKey& key) { return placed->OwnerOf(cluster::Placement::ShardOf(key)); };
  catalog::Discovery discovery(options, &index, &transport);
  ASSERT_EQ(discovery.Discover(keys).known_prefix, keys.size());
  ASSERT_EQ(index.Find(keys[0]).size(), 2u);

  catalog::AuthorizeOptions authorize;
  authorize.self_node = Node(1);
  authorize.request_id = 1;
  catalog::AuthorizeOutcome granted = catalog::AuthorizeBest(keys, index, transport, authorize);
  ASSERT_TRUE(granted.authorized.has_value()) << granted.last_error;
  EXPECT_EQ(granted.authorized->span.node, Node(0));  // a tie: the smaller node id
  EXPECT_EQ(granted.authorized->reply.grant.granted, keys.size());
  EXPECT_NE(granted.authorized->reply.grant.grant_id, 0u);
  EXPECT_FALSE(granted.authorized->reply.ucx_address.empty());
  const std::vector<catalog::SourceBlockVersion> versions = granted.authorized->span.versions;
  const std::string rt0 = granted.authorized->span.runtime;
  EXPECT_EQ(Field(StatsOf(*managers[0]), "source_sessions"), 1u);
  EXPECT_GE(Field(StatsOf(*managers[0]), "source_pinned_bytes"), keys.size() * testing::kBlockBytes);
  auto released = transport.Release(Node(0), rt0, 1, /*grant_id=*/0, "", Deadline::After(std::chrono::seconds(5)));
  ASSERT_TRUE(released.ok()) << released.status();
  EXPECT_TRUE(*released);
  // The grant drains asynchronously (its transport revoked first); a Release that comes meanwhile still answers
  // true (the first one is draining it), so the duplicate is asked once the session is gone.
  EXPECT_EQ(FieldWhen(*managers[0], "source_sessions", 0), 0u);
  EXPECT_EQ(Field(StatsOf(*managers[0]), "source_pinned_bytes"), 0u);
  released = transport.Release(Node(0), rt0, 1, /*grant_id=*/0, "", Deadline::After(std::chrono::seconds(5)));
  ASSERT_TRUE(released.ok()) << released.status();
  EXPECT_FALSE(*released);  // a duplicate Release: nothing held any more, no error

  // Stale versions: both sources refuse, nothing is pinned, the refused versions leave the index.
  for (const catalog::Candidate& held : index.Find(keys[0])) {
    catalog::Candidate newer = held;
    newer.generation += 1000;  // another publication than the sources hold
    index.Insert(keys[0], {newer});
  }
  const uint64_t lookups = transport.lookups();
  authorize.request_id = 2;
  catalog::AuthorizeOutcome stale = catalog::AuthorizeBest(keys, index, transport, authorize);
  EXPECT_FALSE(stale.authorized.has_value());
  EXPECT_EQ(stale.attempts, 2u);
  EXPECT_EQ(stale.rejections, 2u);
  EXPECT_TRUE(index.Find(keys[0]).empty());
  EXPECT_EQ(index.Find(keys[1]).size(), 2u);  // only the refused versions went
  EXPECT_EQ(transport.lookups(), lookups);    // and no directory RPC was made for an alternative
  for (int i : {0, 2}) {
    const std::string source = StatsOf(*managers[i]);
    EXPECT_EQ(Field(source, "source_sessions"), 0u) << source;
    EXPECT_EQ(Field(source, "source_rejections"), 1u) << source;
    EXPECT_EQ(Field(source, "source_pinned_bytes"), 0u) << source;
  }

  // 1,024 sessions at most: the next is ResourceExhausted (pinning nothing more).
  const std::span<const catalog::SourceBlockVersion> one(versions.data(), 1);
  for (uint64_t r = 0; r < 1024; ++r) {
    auto grant = transport.Authorize(Node(0), rt0, 100 + r, one, 0, std::chrono::seconds(30),
                                     Deadline::After(std::chrono::seconds(10)));
    ASSERT_TRUE(grant.ok()) << r << ": " << grant.status();
    ASSERT_EQ(grant->grant.granted, 1u);
  }
  auto over = transport.Authorize(Node(0), rt0, 5000, one, 0, std::chrono::seconds(30),
                                  Deadline::After(std::chrono::seconds(10)));
  EXPECT_EQ(over.status().code(), StatusCode::kResourceExhausted) << over.status();
  std::string source = StatsOf(*managers[0]);
  EXPECT_EQ(Field(source, "source_sessions"), 1024u) << source;

  // node-1 dies holding them: its lease expires (3 s), node-0 revokes its transport, drains and frees.
  managers[1]->Stop(SIGKILL);
  EXPECT_EQ(FieldWhen(*managers[0], "source_sessions", 0), 0u);
  source = StatsOf(*managers[0]);
  EXPECT_EQ(Field(source, "source_pinned_bytes"), 0u) << source;
  EXPECT_EQ(Field(source, "source_quarantined_bytes"), 0u) << source;
  EXPECT_EQ(Field(source, "transfer_grants"), 0u) << source;
}

// How many of `keys`, from the first, have their catalog shard on a host other than `down` (the prefix a requester
// can learn while `down` does not answer).
size_t PrefixAvoiding(const std::vector<state::StateKey>& keys, const std::string& down,
                      const std::vector<std::string>& catalog_nodes) {
  auto placement = cluster::Placement::Create(catalog_nodes);
  EXPECT_TRUE(placement.ok());
  size_t n = 0;
  while (n < keys.size() && placement->OwnerOf(cluster::Placement::ShardOf(keys[n])) != down) ++n;
  return n;
}

// Faults between discovery and transfer, each bounded and none wrong: a source that dies after the lookup costs one
// failed Authorize and the alternative serves; a dead catalog host cuts the learnt prefix exactly at its first
// shard, and later cold queries skip it at once (breaker) while local service goes on; a catalog host and source
// stopped with SIGSTOP cost one budget, and after SIGCONT it serves again. Every gauge returns to 0.
TEST_F(MeshTest, FaultsBetweenLookupAndTransferAreBoundedAndServiceContinues) {
  catalog_replicas_ = "1";  // one copy a shard: what a lost catalog host costs then (issue 54 keeps three)
  std::vector<std::unique_ptr<ManagerProcess>> managers;
  // A 30 s lease (keepalives every 10 s, each valid for 15 s): node-0 stopped for one discovery budget and one
  // Authorize bound is still registered after SIGCONT.
  ASSERT_TRUE(StartManagers(kHosts, "fault", &managers, {"--membership-ttl-secs", "30"}));
  auto all = [&] { return All(managers); };
  constexpr uint32_t kBlocks = 32;
  const auto x = testing::Chain(9300, kBlocks), y = testing::Chain(9301, kBlocks), z = testing::Chain(9302, kBlocks),
             q = testing::Chain(9303, kBlocks), w = testing::Chain(9304, kBlocks);
  MeshEngine a(*managers[0], 1, kBlocks), c(*managers[2], 3, kBlocks);
  // node-2 holds all of x, node-0 its first half (node-2's span is the longest); node-0 holds y, z and q.
  ASSERT_TRUE(testing::SaveChain(*c.client, 3, c.kv, x).ok());
  ASSERT_TRUE(testing::SaveChain(*a.client, 1, a.kv, std::vector<state::StateKey>(x.begin(), x.begin() + 16)).ok());
  for (const auto* chain : {&y, &z, &q}) ASSERT_TRUE(testing::SaveChain(*a.client, 1, a.kv, *chain).ok());
  ASSERT_TRUE(CatalogsEqualInventories(all()));

  // The source dies between Lookup and Authorize (the requester played by the test, as node-1).
  {
    cluster::MemberView view;
    InstallMembers(&view);
    const cluster::MemberRecord r1 = view.Find(Node(1))->record;
    const catalog::PeerIdentity as1{"mesh", Node(1), r1.runtime_uuid, r1.epoch,
                                    StringField(StatsOf(*managers[0]), "placement_fingerprint")};
    auto placed = cluster::Placement::Create({"node-0", "node-1", "node-2"});
    ASSERT_TRUE(placed.ok());
    catalog::GrpcRequesterTransport transport(as1, &view, nullptr);
    catalog::CandidateIndex index({});
    catalog::Discovery::Options options;
    options.host_of = [&](const state::StateKey& key) { return placed->OwnerOf(cluster::Placement::ShardOf(key)); };
    catalog::Discovery discovery(options, &index, &transport);
    ASSERT_EQ(discovery.Discover(x).known_prefix, x.size());
    managers[2]->Stop(SIGKILL);  // node-2: the longest span's source, and a catalog host
    catalog::AuthorizeOptions authorize;
    authorize.self_node = Node(1);
    authorize.request_id = 77;
    catalog::AuthorizeOutcome outcome = catalog::AuthorizeBest(x, index, transport, authorize);
    ASSERT_TRUE(outcome.authorized.has_value()) << outcome.last_error;
    EXPECT_EQ(outcome.attempts, 2u);
    EXPECT_EQ(outcome.failures, 1u);
    EXPECT_EQ(outcome.authorized->span.node, Node(0));
    EXPECT_EQ(outcome.authorized->reply.grant.granted, 16u);
    auto released =
        transport.Release(Node(0), outcome.authorized->span.runtime, 77, outcome.authorized->reply.grant.grant_id,
                          outcome.authorized->reply.grant.grant_secret, Deadline::After(std::chrono::seconds(5)));
    ASSERT_TRUE(released.ok() && *released) << released.status();
  }

  // node-2 (a catalog host) is gone: node-1's engine learns y only up to the first key of node-2's shards, and
  // fetches exactly that prefix; a later cold query (z) skips node-2 at once.
  const std::vector<std::string> catalogs = {"node-0", "node-1", "node-2"};
  for (const auto* chain : {&y, &z, &q}) {  // the chains are chosen so that each case has something to fetch
    ASSERT_GT(PrefixAvoiding(*chain, Node(2), catalogs), 0u);
    ASSERT_LT(PrefixAvoiding(*chain, Node(2), catalogs), kBlocks);
  }
  MeshEngine b(*managers[1], 2, kBlocks);
  auto [hits_y, exact_y] = b.QueryAndRestore(y);
  EXPECT_EQ(hits_y, PrefixAvoiding(y, Node(2), catalogs));
  EXPECT_EQ(exact_y, hits_y);
  std::string stats = StatsOf(*managers[1]);
  EXPECT_EQ(Field(stats, "discovery_failed_hosts"), 1u) << stats;
  const uint64_t skipped = Field(stats, "discovery_skipped_hosts");
  auto [hits_z, exact_z] = b.QueryAndRestore(z);
  EXPECT_EQ(hits_z, PrefixAvoiding(z, Node(2), catalogs));
  EXPECT_EQ(exact_z, hits_z);
  stats = StatsOf(*managers[1]);
  EXPECT_EQ(Field(stats, "discovery_failed_hosts"), 1u) << stats;  // not asked again: skipped
  EXPECT_GT(Field(stats, "discovery_skipped_hosts"), skipped) << stats;
  // Local service is untouched: node-1's own chain saves and hits whole.
  ASSERT_TRUE(testing::SaveChain(*b.client, 2, b.kv, w).ok());
  auto [hits_w, exact_w] = b.QueryAndRestore(w);
  EXPECT_EQ(hits_w, kBlocks);
  EXPECT_EQ(exact_w, kBlocks);

  // node-0 (catalog host and the only source of q) stopped: the query ends within its stage's bounds with what is
  // local (nothing); after SIGCONT, once node-0's breaker closed, q is fetched up to node-2's first shard again.
  ASSERT_EQ(kill(managers[0]->pid(), SIGSTOP), 0);
  auto stopped = b.client->QueryWait(2, 0, q, std::chrono::seconds(20));
  ASSERT_EQ(kill(managers[0]->pid(), SIGCONT), 0);
  ASSERT_TRUE(stopped.ok()) << stopped.status();
  EXPECT_EQ(stopped->hits, 0u);
  EXPECT_EQ(stopped->loading_op, 0u);  // answered, not still loading
  if (stopped->lease != 0) {
    EXPECT_TRUE(b.client->Release(2, stopped->lease).ok());
  }
  size_t hits_q = 0, exact_q = 0;
  for (int attempt = 0; attempt < 40 && hits_q < PrefixAvoiding(q, Node(2), catalogs); ++attempt) {
    std::tie(hits_q, exact_q) = b.QueryAndRestore(q);
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
  EXPECT_EQ(hits_q, PrefixAvoiding(q, Node(2), catalogs));
  EXPECT_EQ(exact_q, hits_q);

  EXPECT_EQ(FieldWhen(*managers[0], "source_sessions", 0), 0u);
  EXPECT_EQ(FieldWhen(*managers[0], "source_pinned_bytes", 0), 0u);
  EXPECT_EQ(FieldWhen(*managers[1], "remote_staging_bytes", 0), 0u);
  EXPECT_TRUE(testing::EventuallyIdle(*b.client));
}

// etcd stopped: a Manager's registration stops being valid after half its lease TTL, and remote work goes off with
// it (a query is answered from what is local, no remote stage), while local saves and hits go on; once etcd is back
// (the lease survived: etcd keeps it across its restart) remote work comes back on and the same query is fetched.
TEST_F(MeshTest, RemoteWorkStopsWhileEtcdIsDownAndComesBackWithIt) {
  catalog_nodes_ = "node-0,node-1";
  std::vector<std::unique_ptr<ManagerProcess>> managers;
  ASSERT_TRUE(StartManagers(2, "etcd", &managers, {"--membership-ttl-secs", "10"}));
  constexpr uint32_t kBlocks = 16;
  const auto x = testing::Chain(9400, kBlocks), w = testing::Chain(9401, kBlocks);
  MeshEngine a(*managers[0], 1, kBlocks);
  ASSERT_TRUE(testing::SaveChain(*a.client, 1, a.kv, x).ok());
  ASSERT_TRUE(CatalogsEqualInventories({managers[0].get(), managers[1].get()}));
  MeshEngine b(*managers[1], 2, kBlocks);

  ASSERT_TRUE(etcd_->Stop().ok());
  EXPECT_EQ(FieldWhen(*managers[1], "remote_work", 0), 0u) << StatsOf(*managers[1]);
  const uint64_t fetches = Field(StatsOf(*managers[1]), "remote_fetches");
  auto offline = b.client->QueryWait(2, 0, x, std::chrono::seconds(20));
  ASSERT_TRUE(offline.ok()) << offline.status();
  EXPECT_EQ(offline->hits, 0u);
  EXPECT_EQ(offline->loading_op, 0u);
  EXPECT_EQ(Field(StatsOf(*managers[1]), "remote_fetches"), fetches);  // no remote stage was started
  ASSERT_TRUE(testing::SaveChain(*b.client, 2, b.kv, w).ok());
  auto [hits_w, exact_w] = b.QueryAndRestore(w);
  EXPECT_EQ(hits_w, kBlocks);
  EXPECT_EQ(exact_w, kBlocks);

  ASSERT_TRUE(etcd_->Launch().ok());
  ASSERT_TRUE(etcd_->WaitReady(Deadline::After(std::chrono::seconds(30))).ok()) << etcd_->LogTail();
  EXPECT_EQ(FieldWhen(*managers[1], "remote_work", 1), 1u) << StatsOf(*managers[1]);
  // node-1's remote work is on again, but its view of node-0 may lag a moment (seen once under ASan with a
  // loaded machine: the first query found no source), so the query is asked again until the fetch is back.
  size_t hits_x = 0, exact_x = 0;
  for (int attempt = 0; attempt < 40 && hits_x < kBlocks; ++attempt) {
    std::tie(hits_x, exact_x) = b.QueryAndRestore(x);
    if (hits_x < kBlocks) std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
  EXPECT_EQ(hits_x, kBlocks);
  EXPECT_EQ(exact_x, kBlocks);
  EXPECT_EQ(FieldWhen(*managers[0], "source_sessions", 0), 0u);
  EXPECT_TRUE(testing::EventuallyIdle(*b.client));
}

// Issue 22's network faults, each ending with 0 wrong bytes and the gauges at 0: node-0's UCX port blocked while
// gRPC still reaches it (the grant is released, the stage ends by its deadline, and the next query skips node-0 at
// once instead of waiting again); a partition between a requester and node-0 (the query ends within its bounds, and
// once healed the next query fetches); 3 % loss on node-0's veth (TCP retransmits, the bytes are exact); and an
// engine that leaves mid-fetch (the fetch completes on its own and the next engine gets a local hit).
TEST_F(MeshTest, BlockedTransfersPartitionsLossAndAnEngineLeavingMidFetchLoseNothing) {
  catalog_nodes_ = "node-2";
  std::vector<std::unique_ptr<ManagerProcess>> managers;
  const std::vector<std::vector<std::string>> extra = {
      {"--transfer-listen", mesh_->address(0) + ":7400", "--membership-ttl-secs", "10"},
      {"--remote-fetch-deadline-ms", "3000", "--membership-ttl-secs", "10"},
      {"--membership-ttl-secs", "10"}};
  for (int i = 0; i < kHosts; ++i) {
    managers.push_back(StartManager(i, fmt::format("net-{}", i), extra[i]));
    ASSERT_TRUE(managers.back()->running()) << managers.back()->LogText();
  }
  auto all = [&] { return All(managers); };
  constexpr uint32_t kBlocks = 64;
  std::vector<std::vector<state::StateKey>> chains;
  MeshEngine a(*managers[0], 1, kBlocks);
  for (uint64_t c = 0; c < 5; ++c) {
    chains.push_back(testing::Chain(9500 + c, kBlocks));
    ASSERT_TRUE(testing::SaveChain(*a.client, 1, a.kv, chains.back()).ok());
  }
  ASSERT_TRUE(CatalogsEqualInventories(all()));
  MeshEngine b(*managers[1], 2, kBlocks), c(*managers[2], 3, kBlocks);

  // node-0's UCX port blocked, gRPC open: authorized, the reads never land, released, skipped afterwards.
  ASSERT_TRUE(mesh_->BlockPort(0, 7400).ok());
  auto [hits, exact] = b.QueryAndRestore(chains[0]);
  const MonoTime failed_at = MonoNow();  // node-1's breaker for node-0 opened (for 5 s) by now
  EXPECT_EQ(hits, 0u);
  EXPECT_EQ(exact, hits);
  std::string stats = StatsOf(*managers[1]);
  EXPECT_EQ(Field(stats, "remote_fetch_failures"), 1u) << stats;
  EXPECT_EQ(FieldWhen(*managers[0], "source_sessions", 0), 0u);
  const uint64_t authorizations = Field(stats, "source_authorizations");
  std::tie(hits, exact) = b.QueryAndRestore(chains[1]);
  EXPECT_EQ(hits, 0u);
  stats = StatsOf(*managers[1]);
  EXPECT_EQ(Field(stats, "source_authorizations"), authorizations) << stats;  // node-0 not asked again
  EXPECT_GE(Field(stats, "remote_sources_skipped"), 1u) << stats;
  ASSERT_TRUE(mesh_->Unblock(0).ok());

  // node-2 partitioned from node-0: the authorization times out, nothing is fetched; healed, it fetches.
  ASSERT_TRUE(mesh_->Partition(2, 0).ok());
  std::tie(hits, exact) = c.QueryAndRestore(chains[2]);
  EXPECT_EQ(hits, 0u);
  ASSERT_TRUE(mesh_->Unblock(2).ok());
  std::tie(hits, exact) = c.QueryAndRestore(chains[2]);
  EXPECT_EQ(hits, kBlocks);
  EXPECT_EQ(exact, kBlocks);

  // 3 % loss each way on node-0's veth: slower, exact.
  ASSERT_TRUE(mesh_->Loss(0, 3).ok());
  std::tie(hits, exact) = c.QueryAndRestore(chains[3]);
  ASSERT_TRUE(mesh_->NoLoss(0).ok());
  EXPECT_EQ(hits, kBlocks);
  EXPECT_EQ(exact, kBlocks);

  // node-1's engine asks for a prefix and leaves while it is being fetched (node-1's breaker for node-0 closed
  // first: 5 s after the blocked transfer failed).
  std::this_thread::sleep_until(failed_at + std::chrono::seconds(6));
  const uint64_t fetched = Field(StatsOf(*managers[1]), "remote_fetched_blocks");
  {
    MeshEngine leaving(*managers[1], 4, kBlocks);
    auto loading = leaving.client->Query(4, 0, chains[4]);
    ASSERT_TRUE(loading.ok()) << loading.status();
    EXPECT_NE(loading->loading_op, 0u);
  }  // its session closes here, mid-fetch
  EXPECT_EQ(FieldWhen(*managers[1], "remote_fetched_blocks", fetched + kBlocks), fetched + kBlocks);
  std::tie(hits, exact) = b.QueryAndRestore(chains[4]);
  EXPECT_EQ(hits, kBlocks);
  EXPECT_EQ(exact, kBlocks);
  EXPECT_EQ(Field(StatsOf(*managers[1]), "remote_fetched_blocks"), fetched + kBlocks);  // a local hit

  ExpectNothingHeld(managers);
  EXPECT_TRUE(testing::EventuallyIdle(*b.client));
  EXPECT_TRUE(testing::EventuallyIdle(*c.client));
}

// The source killed -9 while a fetch from it runs (at whatever point the kill lands: before the authorization,
// between batches or mid-batch): the query ends within its bounds, every block it reports is exact, nothing
// unverified is left staged, and a later query does not wait for the dead source.
TEST_F(MeshTest, ASourceKilledDuringAFetchCostsTheRestOfThePrefixOnly) {
  catalog_nodes_ = "node-2";
  std::vector<std::unique_ptr<ManagerProcess>> managers;
  ASSERT_TRUE(StartManagers(kHosts, "kill", &managers, {"--membership-ttl-secs", "10"}));
  constexpr uint32_t kBlocks = 512;  // 16 MiB: several batches
  const auto keys = testing::Chain(9600, kBlocks), more = testing::Chain(9601, 64);
  {
    MeshEngine a(*managers[0], 1, kBlocks);
    ASSERT_TRUE(testing::SaveChain(*a.client, 1, a.kv, keys).ok());
    ASSERT_TRUE(testing::SaveChain(*a.client, 1, a.kv, more).ok());
  }
  ASSERT_TRUE(CatalogsEqualInventories({managers[0].get(), managers[1].get(), managers[2].get()}));
  MeshEngine b(*managers[1], 2, kBlocks);
  std::pair<size_t, size_t> result;
  std::thread query([&] { result = b.QueryAndRestore(keys); });
  AwaitRemoteFetch(*managers[1]);  // kill it once node-1 is fetching (or as soon as possible after)
  managers[0]->Stop(SIGKILL);
  query.join();
  EXPECT_EQ(result.second, result.first);  // every block reported is exact
  EXPECT_LE(result.first, kBlocks);
  auto [hits, exact] = b.QueryAndRestore(more);
  EXPECT_EQ(hits, 0u);
  EXPECT_EQ(exact, 0u);
  EXPECT_EQ(FieldWhen(*managers[1], "remote_staging_bytes", 0), 0u);
  EXPECT_TRUE(testing::EventuallyIdle(*b.client));
  RecordProperty("blocks_fetched_before_the_kill", std::to_string(result.first));
}

// One Loading operation over three tiers: node-1 holds the first 16 blocks of a prefix in DRAM, the next 16 on its
// SSD only (written through, then node-1 restarted: its SSD is found again, its DRAM is empty), and node-0 holds all
// 48; node-1's engine gets the whole prefix in one query ([ssd span][remote span] after the DRAM hit), byte-exact.
TEST_F(MeshTest, APrefixContinuesFromDramToSsdToAPeer) {
  catalog_nodes_ = "node-0";
  const std::string ssd = fmt::format("/tmp/orbitkv-mesh-ssd-{}", getpid());
  std::filesystem::remove_all(ssd);
  std::filesystem::create_directories(ssd);
  const std::vector<std::string> ssd_flags = {
      "--ssd-path", ssd, "--ssd-capacity", "256MiB", "--ssd-policy", "write-through", "--ssd-min-frequency", "1"};
  std::vector<std::unique_ptr<ManagerProcess>> managers;
  managers.push_back(StartManager(0, "tier-0"));
  managers.push_back(StartManager(1, "tier-1", ssd_flags));
  for (auto& m : managers) ASSERT_TRUE(m->running()) << m->LogText();
  constexpr uint32_t kBlocks = 48;
  const auto keys = testing::Chain(9700, kBlocks);
  MeshEngine a(*managers[0], 1, kBlocks);
  ASSERT_TRUE(testing::SaveChain(*a.client, 1, a.kv, keys).ok());
  {
    MeshEngine b(*managers[1], 2, kBlocks);
    ASSERT_TRUE(
        testing::SaveChain(*b.client, 2, b.kv, std::vector<state::StateKey>(keys.begin(), keys.begin() + 32)).ok());
    // Written through to the SSD before the stop.
    EXPECT_EQ(FieldWhen(*managers[1], "writes", 32), 32u) << StatsOf(*managers[1]);
  }
  managers[1]->Stop(SIGTERM);
  managers[1] = StartManager(1, "tier-1b", ssd_flags);
  ASSERT_TRUE(managers[1]->running()) << managers[1]->LogText();
  EXPECT_EQ(Field(StatsOf(*managers[1]), "resident_blocks"), 0u);
  MeshEngine b(*managers[1], 2, kBlocks);
  auto [hits, exact] = b.QueryAndRestore(std::vector<state::StateKey>(keys.begin(), keys.begin() + 16));
  ASSERT_EQ(hits, 16u);  // from its SSD into DRAM
  ASSERT_TRUE(CatalogsEqualInventories(All(managers)));
  const uint64_t reads = Field(StatsOf(*managers[1]), "reads");
  std::tie(hits, exact) = b.QueryAndRestore(keys);
  EXPECT_EQ(hits, kBlocks);
  EXPECT_EQ(exact, kBlocks);
  const std::string stats = StatsOf(*managers[1]);
  EXPECT_EQ(Field(stats, "remote_fetched_blocks"), 16u) << stats;  // only the tail came from node-0
  EXPECT_EQ(Field(stats, "reads"), reads + 16) << stats;           // the middle from the SSD
  EXPECT_TRUE(testing::EventuallyIdle(*b.client));
  std::filesystem::remove_all(ssd);
}

// Issue 56: a prefix only on a peer's SSD is a remote hit. node-0 (a 16 MiB pool, written through to its SSD) saves
// chains X, Y and W, then a filler evicts them from its DRAM. node-1 gets X byte-exact: node-0 reads it from its SSD
// into DRAM (its answer held back meanwhile, or pending) and grants it. node-0 restarted on its SSD files serves Y to
// node-2 the same way. With node-0's SSD staging budget too small for a span, the answer is backpressure and node-2
// recomputes at once; with node-0's records corrupted on disk, W is a miss (checksum), never served. Nothing stays
// staged, pinned or granted on any Manager.
TEST_F(MeshTest, APrefixOnlyOnAPeersSsdIsARemoteHitAndItsFaultsAreMisses) {
  const std::string ssd = fmt::format("/tmp/orbitkv-mesh-rssd-{}", getpid());
  std::filesystem::remove_all(ssd);
  std::filesystem::create_directories(ssd);
  const std::vector<std::string> ssd_flags = {
      "--dram",       "16MiB",         "--ssd-path",          ssd, "--ssd-capacity", "128MiB",
      "--ssd-policy", "write-through", "--ssd-min-frequency", "1", "--ssd-queue",    "64MiB"};
  std::vector<std::unique_ptr<ManagerProcess>> managers;
  managers.push_back(StartManager(0, "rssd-0", ssd_flags));
  managers.push_back(StartManager(1, "rssd-1"));
  managers.push_back(StartManager(2, "rssd-2"));
  for (auto& m : managers) ASSERT_TRUE(m->running()) << m->LogText();
  constexpr uint32_t kBlocks = 32;  // 1 MiB a chain (32 KiB blocks)
  const auto x = testing::Chain(5600, kBlocks), y = testing::Chain(5601, kBlocks), w = testing::Chain(5602, kBlocks);
  {
    MeshEngine a(*managers[0], 1, 640);
    ASSERT_TRUE(testing::SaveChain(*a.client, 1, a.kv, x).ok());
    ASSERT_TRUE(testing::SaveChain(*a.client, 1, a.kv, y, kBlocks).ok());
    ASSERT_TRUE(testing::SaveChain(*a.client, 1, a.kv, w, 2 * kBlocks).ok());
    EXPECT_EQ(FieldWhen(*managers[0], "writes", 3 * kBlocks), 3 * kBlocks) << StatsOf(*managers[0]);
    // 40 MiB of fillers, each saved three times (every save counts as a use in W-TinyLFU's sketch, so the fillers
    // win the admission duels the once-saved X, Y and W would otherwise win on a tie): most of X, Y and W leave
    // node-0's DRAM (the table's shards feel the pressure unevenly), their SSD copies stay.
    for (uint64_t c = 0; c < 40; ++c) {
      const auto filler = testing::Chain(5700 + c, kBlocks);
      for (int times = 0; times < 3; ++times) {
        ASSERT_TRUE(testing::SaveChain(*a.client, 1, a.kv, filler, 3 * kBlocks + (c % 17) * kBlocks).ok());
      }
    }
  }
  ASSERT_TRUE(CatalogsEqualInventories(All(managers)));

  MeshEngine b(*managers[1], 2, kBlocks);
  auto [hits, exact] = b.QueryAndRestore(x);
  EXPECT_EQ(hits, kBlocks) << StatsOf(*managers[1]);
  EXPECT_EQ(exact, kBlocks);
  std::string stats = StatsOf(*managers[1]);
  // One span from node-0: what it still had in DRAM and what it had on SSD only, prepared whole there (how much of X
  // the fillers evicted varies with how the table's shards felt the pressure: 12 to 24 of 32 blocks were seen; the
  // restart below serves a prefix from SSD alone).
  const uint64_t from_ssd = Field(stats, "remote_ssd_fetched_blocks");
  EXPECT_GT(from_ssd, 0u) << stats;
  EXPECT_EQ(Field(stats, "remote_fetched_blocks"), kBlocks) << stats;
  stats = StatsOf(*managers[0]);
  EXPECT_GE(Field(stats, "source_ssd_preparations"), 1u) << stats;  // read from SSD for node-1 (not already in DRAM)
  EXPECT_GE(Field(stats, "source_ssd_granted"), 1u) << stats;
  // Each block node-1 got from an SSD residence was read from node-0's SSD once; the span's DRAM blocks were not.
  EXPECT_EQ(Field(stats, "source_ssd_prepared_blocks"), from_ssd) << stats;
  EXPECT_EQ(FieldWhen(*managers[0], "source_ssd_staging_bytes", 0), 0u);
  EXPECT_EQ(FieldWhen(*managers[0], "source_sessions", 0), 0u);

  // node-0 restarted on its SSD files (its DRAM empty): Y from its SSD to node-2.
  managers[0]->Stop(SIGTERM);
  managers[0] = StartManager(0, "rssd-0b", ssd_flags);
  ASSERT_TRUE(managers[0]->running()) << managers[0]->LogText();
  ASSERT_TRUE(CatalogsEqualInventories(All(managers)));
  MeshEngine c(*managers[2], 3, kBlocks);
  std::tie(hits, exact) = c.QueryAndRestore(y);
  EXPECT_EQ(hits, kBlocks) << StatsOf(*managers[2]);
  EXPECT_EQ(exact, kBlocks);
  EXPECT_EQ(Field(StatsOf(*managers[2]), "remote_ssd_fetched_blocks"), kBlocks);

  // A staging budget smaller than one block: backpressure, node-2 answers with what it has (nothing) at once.
  managers[0]->Stop(SIGTERM);
  std::vector<std::string> tight = ssd_flags;
  tight.insert(tight.end(), {"--remote-ssd-staging-budget", "16KiB", "--ssd-persist-on-exit", "0"});
  managers[0] = StartManager(0, "rssd-0c", tight);
  ASSERT_TRUE(managers[0]->running()) << managers[0]->LogText();
  ASSERT_TRUE(CatalogsEqualInventories(All(managers)));
  std::tie(hits, exact) = c.QueryAndRestore(w);
  EXPECT_EQ(hits, 0u);
  EXPECT_GE(Field(StatsOf(*managers[0]), "source_ssd_backpressure"), 1u) << StatsOf(*managers[0]);
  EXPECT_GE(Field(StatsOf(*managers[2]), "remote_ssd_backpressure"), 1u) << StatsOf(*managers[2]);

  // Every record on node-0's SSD corrupted on disk: W's checksum fails at the source, a miss, never served (asked by
  // node-1, whose candidate index has not learnt W's holders yet: node-2's still names node-0's previous start).
  managers[0]->Stop(SIGTERM);
  testing::CorruptEveryRecord(ssd);
  std::vector<std::string> plain = ssd_flags;
  plain.insert(plain.end(), {"--ssd-persist-on-exit", "0"});
  managers[0] = StartManager(0, "rssd-0d", plain);
  ASSERT_TRUE(managers[0]->running()) << managers[0]->LogText();
  ASSERT_TRUE(CatalogsEqualInventories(All(managers)));
  std::tie(hits, exact) = b.QueryAndRestore(w);
  EXPECT_EQ(hits, exact);  // never a wrong byte
  EXPECT_LT(hits, kBlocks);
  stats = StatsOf(*managers[0]);
  EXPECT_GE(Field(stats, "verify_failures"), 1u) << stats;
  EXPECT_GE(Field(stats, "source_ssd_missing") + Field(stats, "source_ssd_prepared_blocks"), 1u) << stats;
  ExpectNothingHeld(managers);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(FieldWhen(*managers[static_cast<size_t>(i)], "source_ssd_staging_bytes", 0), 0u) << "node-" << i;
  }
  EXPECT_TRUE(testing::EventuallyIdle(*b.client));
  EXPECT_TRUE(testing::EventuallyIdle(*c.client));
  std::filesystem::remove_all(ssd);
}

// The source stopped with SIGSTOP while a fetch from it runs, then etcd stopped while another fetch runs: each query
// ends within its bounds with an exact prefix, nothing stays staged or pinned, and once the source (or etcd) is back
// the next query gets the whole prefix.
TEST_F(MeshTest, ASourceStoppedMidFetchAndEtcdStoppedMidFetchAreBounded) {
  catalog_nodes_ = "node-1";
  std::vector<std::unique_ptr<ManagerProcess>> managers;
  // 30 s leases: a registration stays valid through a few seconds of SIGSTOP or of etcd being down (its keepalives
  // every 10 s, valid for 15 s from each), so both Managers serve again afterwards.
  managers.push_back(StartManager(0, "stop-src-0", {"--membership-ttl-secs", "30"}));
  managers.push_back(
      StartManager(1, "stop-src-1", {"--membership-ttl-secs", "30", "--remote-fetch-deadline-ms", "3000"}));
  for (auto& m : managers) ASSERT_TRUE(m->running()) << m->LogText();
  constexpr uint32_t kBlocks = 512;
  const auto first = testing::Chain(9800, kBlocks), second = testing::Chain(9801, kBlocks);
  {
    MeshEngine a(*managers[0], 1, kBlocks);
    ASSERT_TRUE(testing::SaveChain(*a.client, 1, a.kv, first).ok());
    ASSERT_TRUE(testing::SaveChain(*a.client, 1, a.kv, second).ok());
  }
  ASSERT_TRUE(CatalogsEqualInventories(All(managers)));
  MeshEngine b(*managers[1], 2, kBlocks);
  const auto once_fetching = [&](uint64_t fetches) {
    for (int i = 0; i < 4000 && Field(StatsOf(*managers[1]), "remote_fetches") <= fetches; ++i) {
      std::this_thread::sleep_for(std::chrono::microseconds(250));
    }
  };

  // The source stopped mid-fetch (or just before or after: wherever the stop lands) until the query ended.
  std::pair<size_t, size_t> result;
  uint64_t fetches = Field(StatsOf(*managers[1]), "remote_fetches");
  std::thread query([&] { result = b.QueryAndRestore(first); });
  once_fetching(fetches);
  ASSERT_EQ(kill(managers[0]->pid(), SIGSTOP), 0);
  query.join();  // bounded by the remote stage's deadline (3 s), with the source still stopped
  ASSERT_EQ(kill(managers[0]->pid(), SIGCONT), 0);
  EXPECT_EQ(result.second, result.first);
  EXPECT_EQ(FieldWhen(*managers[1], "remote_staging_bytes", 0), 0u);
  EXPECT_EQ(FieldWhen(*managers[0], "source_sessions", 0), 0u);
  size_t hits = 0, exact = 0;
  for (int attempt = 0; attempt < 40 && hits < kBlocks; ++attempt) {  // node-0 skipped while its breaker is open
    std::tie(hits, exact) = b.QueryAndRestore(first);
    if (hits < kBlocks) std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
  EXPECT_EQ(hits, kBlocks);
  EXPECT_EQ(exact, kBlocks);

  // etcd stopped while a fetch runs: the fetch already granted goes on or stops, never wrong; back with etcd.
  fetches = Field(StatsOf(*managers[1]), "remote_fetches");
  std::thread query2([&] { result = b.QueryAndRestore(second); });
  once_fetching(fetches);
  ASSERT_TRUE(etcd_->Stop().ok());
  query2.join();
  EXPECT_EQ(result.second, result.first);
  ASSERT_TRUE(etcd_->Launch().ok());
  ASSERT_TRUE(etcd_->WaitReady(Deadline::After(std::chrono::seconds(30))).ok()) << etcd_->LogTail();
  EXPECT_EQ(FieldWhen(*managers[1], "remote_work", 1), 1u);
  hits = 0;
  for (int attempt = 0; attempt < 40 && hits < kBlocks; ++attempt) {
    std::tie(hits, exact) = b.QueryAndRestore(second);
    if (hits < kBlocks) std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
  EXPECT_EQ(hits, kBlocks);
  EXPECT_EQ(exact, kBlocks);
  ExpectNothingHeld(managers);
  EXPECT_TRUE(testing::EventuallyIdle(*b.client));
}

// A catalog host killed -9 while a query's discovery may be asking it: the query ends within its bounds with an exact
// prefix, and the next query of another prefix gets exactly what the surviving catalog host's shards lead to.
TEST_F(MeshTest, ACatalogHostKilledDuringAQueryCostsItsShardsOnly) {
  catalog_replicas_ = "1";  // one copy a shard: what a lost catalog host costs then (issue 54 keeps three)
  catalog_nodes_ = "node-0,node-2";
  std::vector<std::unique_ptr<ManagerProcess>> managers;
  ASSERT_TRUE(StartManagers(kHosts, "catkill", &managers, {"--membership-ttl-secs", "30"}));
  constexpr uint32_t kBlocks = 256;
  const auto keys = testing::Chain(9900, kBlocks), next = testing::Chain(9901, 64);
  {
    MeshEngine a(*managers[0], 1, kBlocks);
    ASSERT_TRUE(testing::SaveChain(*a.client, 1, a.kv, keys).ok());
    ASSERT_TRUE(testing::SaveChain(*a.client, 1, a.kv, next).ok());
  }
  ASSERT_TRUE(CatalogsEqualInventories(All(managers)));
  const std::vector<std::string> catalogs = {"node-0", "node-2"};
  ASSERT_GT(PrefixAvoiding(next, Node(2), catalogs), 0u);
  MeshEngine b(*managers[1], 2, kBlocks);
  std::pair<size_t, size_t> result;
  std::thread query([&] { result = b.QueryAndRestore(keys); });
  AwaitRemoteFetch(*managers[1]);
  managers[2]->Stop(SIGKILL);
  query.join();
  EXPECT_EQ(result.second, result.first);
  auto [hits, exact] = b.QueryAndRestore(next);
  EXPECT_EQ(hits, PrefixAvoiding(next, Node(2), catalogs));
  EXPECT_EQ(exact, hits);
  EXPECT_EQ(FieldWhen(*managers[0], "source_sessions", 0), 0u);
  EXPECT_EQ(FieldWhen(*managers[1], "remote_staging_bytes", 0), 0u);
  EXPECT_TRUE(testing::EventuallyIdle(*b.client));
}

}  // namespace
}  // namespace orbitkv
