// Scale, part 1: a fleet of N members on a real etcd (lean simulated members plus real registrations).
//
// Per N (--members 64,256,1024 by default; 4096 where a machine carries it), on a fresh single-member etcd:
//  - N lean members, each with the wire of a real one for membership: its own lease, renewed at a real Manager's
//    rate (every TTL/6, TTL 10 s) on one LeaseKeepAlive stream shared by the fleet, and its member record attached
//    to that lease. What they do NOT simulate is said in the env block: one view watch for the whole fleet (a
//    real fleet has one per Manager; idle watches cost etcd memory, not requests) and no owner streams.
//  - kReal catalog hosts and --owners owners (SimNode): each a real registration (cluster::Membership) with a
//    Manager's catalog parts: a residency inventory of --owner-records blocks changing --owner-churn times a second,
//    its CatalogHost (one owner stream per shard and copy over the real peer wire, the store of the shards placed on
//    it) and, on a host, the real PeerService on a loopback port; the registration hooks as a Manager sets them.
//  - view_sync_s_at_N: a fresh Manager's Join until its view is complete (N members); baseline: the same records
//    read by a bare client in pages of 128 at one revision (what a view sync cannot beat).
//  - etcd_requests_per_s_per_member, etcd_bytes_per_s_per_member: etcd's own counters (/metrics: gRPC messages
//    received, client bytes in and out) over a steady window, per member; baseline: the keepalive floor (6/TTL
//    requests a second; bytes: that rate times one keepalive request and reply measured in the same run).
//  - reregistration_resent_records_at_N: the inventory records the owner streams sent in snapshots from an etcd
//    outage longer than TTL/2 (every registration lapses and is made again) until every catalog copy holds exactly
//    the owners' inventories again; baseline: those inventories' records (what a resend of everything costs).
// Once, at the limit (4,096 member records): member_limit_join_refused (1 when a Manager joining a full cluster is
// refused) and remote_work_managers_lost (real Managers that lost remote work when one more member raced past the
// refusal; target 0). Once, on a three-member etcd with user auth: authenticate_calls_per_member_after_election
// (Authenticate calls a Manager made because the raft leader was killed; baseline: those it made to join, 1).
#include <fmt/format.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <deque>
#include <sstream>
#include <thread>
#include <vector>

#include "server/distributed/catalog_host.h"  // first: it brings gRPC in (the rule of cluster/grpc.h)

#include "base/clock.h"
#include "base/logging.h"
#include "base/metrics.h"
#include "base/runtime_id.h"
#include "bench_keys.h"
#include "bench_report.h"
#include "catalog/peer_service.h"
#include "cluster/bidi_stream.h"
#include "cluster/cluster_keys.h"
#include "cluster/etcd_client.h"
#include "cluster/member_record.h"
#include "cluster/membership.h"
#include "cluster/testing/etcd_process.h"
#include "cluster/view_sync.h"
#include "core/inventory.h"
#include "server/distributed/node_identity.h"
#include "server/distributed/registration_hooks.h"

namespace orbitkv::bench {
namespace {

using namespace orbitkv::cluster;

constexpr char kCluster[] = "scale";
constexpr int64_t kTtlSecs = 10;  // the Manager's default --membership-ttl-secs
constexpr int kReal = 3;
constexpr std::chrono::seconds kSteadyWindow{12};
constexpr std::chrono::seconds kWait{120};
constexpr std::chrono::seconds kConverge{30};  // owner streams: a few seconds at most

void Check(const Status& s, const std::string& what) {
  if (!s.ok()) {
    std::fprintf(stderr, "scale_bench: %s: %s\n", what.c_str(), s.ToString().c_str());
    std::exit(1);
  }
}

bool WaitFor(const std::function<bool()>& condition, std::chrono::seconds limit = kWait) {
  const MonoTime until = MonoNow() + limit;
  while (MonoNow() < until) {
    if (condition()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return condition();
}

// The targets missed (--check makes them the exit status).
std::vector<std::string> g_missed;

double Seconds(MonoClock::duration d) { return std::chrono::duration<double>(d).count(); }

// etcd's /metrics (served on its client port), summed per metric name over its labels.
struct EtcdCounters {
  double messages_received = 0;  // grpc_server_msg_received_total
  double bytes = 0;              // etcd_network_client_grpc_{received,sent}_bytes_total
};

Result<EtcdCounters> ScrapeEtcd(const std::string& endpoint) {
  const size_t colon = endpoint.rfind(':');
  const int port = std::stoi(endpoint.substr(colon + 1));
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return Status::Internal("socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return Status::Unavailable(fmt::format("connect to etcd /metrics at {}", endpoint));
  }
  const std::string request = "GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
  (void)!::write(fd, request.data(), request.size());
  std::string body;
  char buffer[65536];
  while (true) {
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n <= 0) break;
    body.append(buffer, static_cast<size_t>(n));
  }
  ::close(fd);
  EtcdCounters counters;
  std::istringstream lines(body);
  std::string line;
  const auto value_of = [](const std::string& l) { return std::strtod(l.c_str() + l.rfind(' ') + 1, nullptr); };
  while (std::getline(lines, line)) {
    if (line.starts_with("grpc_server_msg_received_total")) counters.messages_received += value_of(line);
    if (line.starts_with("etcd_network_client_grpc_received_bytes_total") ||
        line.starts_with("etcd_network_client_grpc_sent_bytes_total")) {
      counters.bytes += value_of(line);
    }
  }
  if (counters.messages_received == 0) return Status::Internal("etcd /metrics had no grpc_server_msg_received_total");
  return counters;
}

std::string Record(const std::string& node, const std::string& uuid) {
  MemberRecord r;
  r.cluster = kCluster;
  r.node_id = node;
  r.epoch = 1;
  r.endpoint = "10.0.0.1:7300";
  r.runtime_uuid = uuid;
  return EncodeMemberRecord(r);
}

// N lean members: a lease each, renewed every TTL/6 on one shared keepalive stream, and a member record on it.
class LeanFleet {
 public:
  // `renew` false: records without a lease and no keepalives (where only the member count matters).
  LeanFleet(EtcdClient* client, int count, bool renew = true) : client_(client) {
    for (int i = 0; renew && i < count; ++i) {
      etcdserverpb::LeaseGrantRequest grant;
      grant.set_ttl(kTtlSecs);
      Result<etcdserverpb::LeaseGrantResponse> granted = client_->LeaseGrant(grant, Deadline::After(kWait));
      Check(granted.status(), "lean member lease");
      leases_.push_back(granted->id());
    }
    for (int start = 0; start < count; start += static_cast<int>(kSnapshotPageSize)) {
      etcdserverpb::TxnRequest txn;
      for (int i = start; i < std::min(count, start + static_cast<int>(kSnapshotPageSize)); ++i) {
        const std::string node = fmt::format("sim-{:05}", i);
        etcdserverpb::PutRequest* put = txn.add_success()->mutable_request_put();
        put->set_key(MemberKey(kCluster, node));
        put->set_value(Record(node, NewRuntimeUuid()));
        if (renew) put->set_lease(leases_[static_cast<size_t>(i)]);
      }
      Check(client_->Txn(txn, Deadline::After(kWait)).status(), "lean member records");
    }
    if (renew) thread_ = std::thread([this] { Run(); });
  }
  ~LeanFleet() {
    stopping_ = true;
    if (thread_.joinable()) thread_.join();
  }
  uint64_t acks() const { return acks_.load(); }
  // The size of one renewal as etcd counts client bytes (gRPC message payloads): its request and its reply.
  double renewal_bytes() const { return static_cast<double>(renewal_bytes_.load()); }

 private:
  using Stream = BidiStream<etcdserverpb::LeaseKeepAliveRequest, etcdserverpb::LeaseKeepAliveResponse>;
  void Run() {
    while (!stopping_) {
      Stream stream;
      (void)client_->PrepareStreamContext(stream.context(), EtcdClient::StreamKind::kLeaseKeepAlive, 0);
      if (!stream.Start(
              [&](grpc::ClientContext* c, grpc::CompletionQueue* q) {
                return client_->LeaseStub(0)->PrepareAsyncLeaseKeepAlive(c, q);
              },
              Deadline::After(std::chrono::seconds(5)))) {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        continue;
      }
      etcdserverpb::LeaseKeepAliveResponse response;
      stream.StartRead(&response);
      size_t next = 0;
      MonoTime round_start = MonoNow();
      const auto interval = std::chrono::milliseconds(kTtlSecs * 1000 / 6);
      bool broken = false;
      while (!stopping_ && !broken) {
        if (!stream.write_pending() && next < leases_.size()) {
          etcdserverpb::LeaseKeepAliveRequest request;
          request.set_id(leases_[next++]);
          stream.StartWrite(request);
        }
        if (next == leases_.size() && MonoNow() >= round_start + interval) {
          next = 0;
          round_start = MonoNow();
        }
        const MonoTime wake = next < leases_.size() && !stream.write_pending()
                                  ? MonoNow()
                                  : std::min(round_start + interval, MonoNow() + std::chrono::milliseconds(100));
        std::optional<Stream::Event> event = stream.Next(Deadline::At(wake));
        if (!event.has_value()) continue;
        if (!event->ok) {
          broken = true;
          break;
        }
        if (event->op == Stream::Op::kRead) {
          acks_.fetch_add(1);
          etcdserverpb::LeaseKeepAliveRequest request;
          request.set_id(leases_.front());
          renewal_bytes_.store(request.ByteSizeLong() + response.ByteSizeLong());
          response.Clear();
          stream.StartRead(&response);
        }
      }
    }
  }

  EtcdClient* const client_;
  std::vector<int64_t> leases_;
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> acks_{0};
  std::atomic<uint64_t> renewal_bytes_{0};
  std::thread thread_;
};

MembershipOptions RealOptions(const std::vector<std::string>& endpoints, const std::string& node) {
  MembershipOptions o;
  o.etcd_endpoints = endpoints;
  o.cluster_name = kCluster;
  o.node_id = node;
  o.membership_ttl_secs = kTtlSecs;
  o.catalog_nodes = {"real-0", "real-1", "real-2"};
  o.peer_endpoint = "127.0.0.1:7300";
  return o;
}

struct Real {
  std::unique_ptr<MetricsRegistry> metrics = std::make_unique<MetricsRegistry>();
  std::unique_ptr<Membership> membership;
};

Real JoinReal(const MembershipOptions& options) {
  Real r;
  Result<std::unique_ptr<Membership>> m = Membership::Create(options, r.metrics.get());
  Check(m.status(), "membership");
  Check((*m)->Join(Deadline::After(kWait)), "join " + options.node_id);
  r.membership = std::move(m).value();
  return r;
}

// A fresh single-member etcd and a bare client of it.
struct Etcd {
  std::unique_ptr<testing::EtcdProcess> process;
  std::vector<std::string> endpoints;
  std::unique_ptr<EtcdClient> client;
};

Etcd StartEtcd() {
  Result<std::unique_ptr<testing::EtcdProcess>> process = testing::EtcdProcess::StartSingle(Deadline::After(kWait));
  Check(process.status(), "starting etcd");
  Etcd etcd;
  etcd.process = std::move(process).value();
  EtcdClientOptions options;
  options.endpoints = {etcd.process->endpoint()};
  etcd.endpoints = options.endpoints;
  Result<std::unique_ptr<EtcdClient>> client = EtcdClient::Create(options);
  Check(client.status(), "client");
  etcd.client = std::move(client).value();
  return etcd;
}

// The whole view range read by a bare client in pages of 128 at one revision: the floor of a view sync.
double RawRangeSeconds(EtcdClient& client) {
  const MonoTime t0 = MonoNow();
  std::string cursor = ViewRangeBegin(kCluster);
  int64_t revision = 0;
  while (true) {
    etcdserverpb::RangeRequest request;
    request.set_key(cursor);
    request.set_range_end(ViewRangeEnd(kCluster));
    request.set_limit(kSnapshotPageSize);
    request.set_revision(revision);
    Result<etcdserverpb::RangeResponse> page = client.Range(request, Deadline::After(kWait));
    Check(page.status(), "raw range");
    if (revision == 0) revision = page->header().revision();
    if (!page->more() || page->kvs().empty()) break;
    cursor = page->kvs(page->kvs_size() - 1).key();
    cursor.push_back('\0');
  }
  return Seconds(MonoNow() - t0);
}

// --- owner streams (issue 69): catalog hosts and a sample of owners, as a Manager's catalog parts ---------------

// Key `i` of owner `owner`'s inventory.
state::StateKey OwnerKey(uint64_t owner, uint64_t i) {
  static const state::StateNamespace ns = BenchNamespace("bench/scale-model");
  return BenchKey(ns, owner, i);
}

// A Manager's catalog parts without its cache, engines or transfers: its real registration (cluster::Membership,
// with the inventory's incarnation as the owner's start), a residency inventory of `records` blocks, its CatalogHost
// (the store of the shards placed on it, and one owner stream per shard and copy over the real peer wire) and, on a
// catalog node, the real PeerService on a loopback port. The registration hooks do what a Manager's do
// (cluster_link.cc): a lapse pauses the owner streams, a registration made again continues them.
class SimNode {
 public:
  SimNode(const std::vector<std::string>& endpoints, const std::string& node, uint64_t salt, size_t records,
          bool catalog_host)
      : salt_(salt) {
    core::ResidencyInventory::Options inventory;
    inventory.incarnation = runtime_.incarnation();
    inventory.shards = kNumShards;
    Result<std::unique_ptr<core::ResidencyInventory>> made = core::ResidencyInventory::Create(inventory, &metrics_);
    Check(made.status(), "inventory");
    inventory_ = std::move(made).value();
    for (size_t i = 0; i < records; ++i) Admit();

    MembershipOptions options = RealOptions(endpoints, node);
    int port = 1;  // an owner that hosts nothing is never dialled
    if (catalog_host) {
      Result<int> free = testing::PickFreePort();
      Check(free.status(), "a port for a catalog host");
      port = *free;
    }
    options.peer_endpoint = fmt::format("127.0.0.1:{}", port);
    options.runtime_uuid = runtime_.ToString();
    options.incarnation = runtime_.incarnation();
    options.on_lapsed = [hooks = hooks_](const std::string& cause) { hooks->Lapsed(cause); };
    options.on_registered = [hooks = hooks_](const MemberRecord& self) { hooks->Registered(self); };
    Result<std::unique_ptr<Membership>> membership = Membership::Create(options, &metrics_);
    Check(membership.status(), "membership");
    membership_ = std::move(membership).value();
    Check(membership_->Join(Deadline::After(kWait)), "join " + node);
    const MemberView* view = &membership_->view();
    const LivePlacement* live = &membership_->live_placement();
    catalog_ = std::make_unique<server::CatalogHost>(
        server::CatalogHost::Options{
            .node_id = node, .incarnation = runtime_.incarnation(), .budget_bytes = 1ull << 30},
        view, live, inventory_.get());
    if (catalog_host) {
      catalog::PeerService::Options service;
      service.self = server::PeerIdentityOf(membership_->self(), *live);
      service.incarnation = runtime_.incarnation();
      service.capabilities = {"health", "catalog.stream", "catalog.lookup"};
      service.catalog = catalog_->store();
      service.serves_generation = [live](int64_t generation) { return live->Get()->Serves(generation); };
      service.hosts_shard = [live, node](uint32_t shard) {
        return shard < kNumShards && live->Get()->Hosts(shard, node);
      };
      service_ = std::make_unique<catalog::PeerService>(std::move(service), view);
      grpc::ServerBuilder builder;
      int bound = 0;
      builder.AddListeningPort(options.peer_endpoint, grpc::InsecureServerCredentials(), &bound);
      builder.SetMaxReceiveMessageSize(catalog::kMaxPeerMessageBytes);
      builder.SetMaxSendMessageSize(catalog::kMaxPeerMessageBytes);
      builder.RegisterService(service_.get());
      server_ = builder.BuildAndStart();
      if (server_ == nullptr || bound != port) Check(Status::Unavailable(options.peer_endpoint), "peer service");
    }
    Check(catalog_->StartStreams(nullptr, membership_->self()), "owner streams");
    server::CatalogHost* catalog = catalog_.get();
    catalog::PeerService* peer = service_.get();
    hooks_->Set([catalog](const std::string&) { catalog->PauseStreams(); },
                [catalog, peer, live](const MemberRecord& self) {
                  if (peer != nullptr) peer->SetSelf(server::PeerIdentityOf(self, *live));
                  catalog->PauseStreams();
                  Check(catalog->StartStreams(nullptr, self), "owner streams of the registration made again");
                });
    if (membership_->self().runtime_uuid != runtime_.ToString()) hooks_->Registered(membership_->self());
  }
  ~SimNode() {
    StopChurn();
    hooks_->Clear();
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    catalog_.reset();
    membership_->Shutdown();
  }

  // `per_s` inventory changes a second (each one block dropped and another admitted, so the size stays), on a
  // thread of its own until StopChurn.
  void StartChurn(double per_s) {
    if (per_s <= 0) return;
    churning_ = true;
    churn_ = std::thread([this, period = std::chrono::duration<double>(1.0 / per_s)] {
      MonoTime next = MonoNow();
      while (churning_) {
        Drop();
        Admit();
        changes_.fetch_add(1);
        next += std::chrono::duration_cast<MonoClock::duration>(period);
        std::this_thread::sleep_until(next);
      }
    });
  }
  void StopChurn() {
    churning_ = false;
    if (churn_.joinable()) churn_.join();
  }

  Membership& membership() { return *membership_; }
  server::CatalogHost& catalog() { return *catalog_; }
  core::ResidencyInventory& inventory() { return *inventory_; }
  uint64_t changes() const { return changes_.load(); }
  // Whether its registration was made again since the first (a new runtime UUID; the owner's start stays).
  bool registered_again() const { return membership_->self().runtime_uuid != runtime_.ToString(); }

 private:
  void Admit() {
    const state::StateKey key = OwnerKey(salt_, next_++);
    inventory_->Apply(inventory_->ShardFor(key), key, core::Tier::kDram, true, core::TransitionCause::kAdmit, 1, 16384);
    held_.push_back(key);
  }
  void Drop() {
    const state::StateKey key = held_.front();
    held_.pop_front();
    inventory_->Apply(inventory_->ShardFor(key), key, core::Tier::kDram, false, core::TransitionCause::kEvict, 1,
                      16384);
  }

  const uint64_t salt_;
  MetricsRegistry metrics_;
  const RuntimeId runtime_ = RuntimeId::New();
  std::unique_ptr<core::ResidencyInventory> inventory_;
  std::deque<state::StateKey> held_;  // the churn thread's alone once it runs
  uint64_t next_ = 0;
  std::shared_ptr<server::RegistrationHooks> hooks_ = std::make_shared<server::RegistrationHooks>();
  std::unique_ptr<Membership> membership_;
  std::unique_ptr<server::CatalogHost> catalog_;
  std::unique_ptr<catalog::PeerService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::atomic<bool> churning_{false};
  std::atomic<uint64_t> changes_{0};
  std::thread churn_;
};

// What the owner streams are given (--owners, --owner-records, --owner-churn).
struct OwnerLoad {
  int owners = 8;          // owners with streams besides the kReal catalog hosts (which own as much)
  size_t records = 2000;   // each owner's inventory
  double churn_per_s = 5;  // each owner's inventory changes a second
};
OwnerLoad g_owners;

// The catalog hosts' stores hold exactly what every owner's inventory holds of the shards placed on them: in each
// shard placed there, each owner's slice has a baseline, names the owner's current registration and has applied the
// inventory's last sequence, and the records add up. (The shards themselves stay incomplete: a shard waits for a
// baseline from every live member, and the lean members have no owner streams.)
bool CatalogsMatch(const std::vector<std::unique_ptr<SimNode>>& hosts, const std::vector<SimNode*>& owners,
                   bool explain = false) {
  for (const std::unique_ptr<SimNode>& host : hosts) {
    const std::shared_ptr<const LivePlacement::State> live = host->membership().live_placement().Get();
    const std::string& node = host->membership().self().node_id;
    size_t expected = 0;
    size_t behind = 0;
    for (uint32_t shard = 0; shard < kNumShards; ++shard) {
      if (!live->Hosts(shard, node)) continue;
      const std::vector<catalog::CatalogStore::OwnerSlice> slices = host->catalog().store()->Slices(shard);
      for (SimNode* owner : owners) {
        expected += owner->inventory().Size(shard);
        const MemberRecord self = owner->membership().self();
        const auto slice = std::find_if(slices.begin(), slices.end(), [&](const catalog::CatalogStore::OwnerSlice& s) {
          return s.owner_node == self.node_id && s.owner_runtime == self.runtime_uuid;
        });
        if (slice == slices.end() || !slice->baseline || slice->applied != owner->inventory().Watermark(shard)) {
          ++behind;
        }
      }
    }
    const server::CatalogHost::Summary s = host->catalog().Summarize();
    if (behind != 0 || s.records != expected) {
      if (explain) {
        fmt::print(stderr, "scale_bench: catalog host {}: {} owner slices behind, {} records of {}\n", node, behind,
                   s.records, expected);
        for (SimNode* owner : owners) {
          const server::CatalogHost::Summary o = owner->catalog().Summarize();
          fmt::print(stderr, "scale_bench:   owner {}: {} streams, {} converged, {} streaming, {} snapshots\n",
                     owner->membership().self().node_id, o.streams, o.converged, o.streaming, o.snapshots);
        }
      }
      return false;
    }
  }
  return true;
}

uint64_t SnapshotRecords(const std::vector<SimNode*>& nodes) {
  uint64_t sum = 0;
  for (SimNode* node : nodes) sum += node->catalog().Summarize().snapshot_records;
  return sum;
}

// N members in all: N - kReal - owners - 1 lean ones, kReal catalog hosts, the owners, and the fresh Manager whose
// view sync is timed.
void MeasureAt(int n, BenchReport& report) {
  const int lean = n - kReal - g_owners.owners - 1;
  fmt::print(stderr,
             "scale_bench: N = {}: etcd, {} lean members, {} catalog hosts, {} owners of {} records each and a fresh "
             "Manager\n",
             n, lean, kReal, g_owners.owners, g_owners.records);
  Etcd etcd = StartEtcd();
  std::vector<std::unique_ptr<SimNode>> hosts;
  std::vector<std::unique_ptr<SimNode>> sampled;
  std::vector<SimNode*> owners;  // every node that streams: the catalog hosts and the sampled owners
  for (int i = 0; i < kReal; ++i) {
    hosts.push_back(std::make_unique<SimNode>(etcd.endpoints, fmt::format("real-{}", i), static_cast<uint64_t>(i),
                                              g_owners.records, /*catalog_host=*/true));
    owners.push_back(hosts.back().get());
  }
  for (int i = 0; i < g_owners.owners; ++i) {
    sampled.push_back(std::make_unique<SimNode>(etcd.endpoints, fmt::format("owner-{}", i),
                                                static_cast<uint64_t>(kReal + i), g_owners.records,
                                                /*catalog_host=*/false));
    owners.push_back(sampled.back().get());
  }
  LeanFleet fleet(etcd.client.get(), lean);
  const size_t members = static_cast<size_t>(n - 1);  // without the fresh one
  Membership& observer = hosts[0]->membership();
  if (!WaitFor([&] { return observer.view().size() == members; })) Check(Status::Internal("view"), "fleet");
  if (!WaitFor([&] { return CatalogsMatch(hosts, owners); }, kConverge) && !CatalogsMatch(hosts, owners, true)) {
    Check(Status::Internal("the catalog hosts never held the owners' inventories"), "owner streams");
  }
  for (SimNode* owner : owners) owner->StartChurn(g_owners.churn_per_s);

  // A fresh Manager's complete view, against the bare paged read of the same records.
  std::vector<double> raw;
  std::vector<double> sync;
  for (int run = 0; run < 3; ++run) {
    raw.push_back(RawRangeSeconds(*etcd.client));
    const MonoTime t0 = MonoNow();
    Real fresh = JoinReal(RealOptions(etcd.endpoints, fmt::format("fresh-{}", run)));
    if (!WaitFor(
            [&] { return fresh.membership->view().complete() && fresh.membership->view().size() == members + 1; })) {
      Check(Status::Internal("the fresh Manager's view never completed"), "view sync");
    }
    sync.push_back(Seconds(MonoNow() - t0));
    fresh.membership->Shutdown();
    if (!WaitFor([&] { return observer.view().size() == members; })) Check(Status::Internal("leave"), "fresh");
  }

  // Steady state: etcd's counters over a window.
  std::this_thread::sleep_for(std::chrono::seconds(2));
  Result<EtcdCounters> before = ScrapeEtcd(etcd.process->endpoint());
  Check(before.status(), "etcd metrics");
  const MonoTime t0 = MonoNow();
  const uint64_t acks0 = fleet.acks();
  std::this_thread::sleep_for(kSteadyWindow);
  Result<EtcdCounters> after = ScrapeEtcd(etcd.process->endpoint());
  Check(after.status(), "etcd metrics");
  const double window = Seconds(MonoNow() - t0);
  const uint64_t acks = fleet.acks() - acks0;
  const double per_member = static_cast<double>(members) * window;
  const double requests = (after->messages_received - before->messages_received) / per_member;
  const double bytes = (after->bytes - before->bytes) / per_member;
  // The floor: one keepalive every TTL/6, and in bytes that many renewals at their wire size.
  const double floor_requests = 6.0 / static_cast<double>(kTtlSecs);
  if (acks == 0) Check(Status::Internal("no lean keepalive was acknowledged in the window"), "steady state");
  report.Add({fmt::format("view_sync_s_at_{}", n), "s", Percentile(sync, 0.5),
              fmt::format("raw_paged_range_s_at_{}", n), Percentile(raw, 0.5)});
  report.Add({fmt::format("etcd_requests_per_s_per_member_at_{}", n), "1/s", requests, "keepalive_floor_per_s",
              floor_requests});
  report.Add({fmt::format("etcd_bytes_per_s_per_member_at_{}", n), "B/s", bytes, "keepalive_floor_bytes_per_s",
              floor_requests * fleet.renewal_bytes()});

  // An etcd outage longer than TTL/2 (every registration lapses and is made again) while the owners' inventories
  // change: the owner streams continue (the owners' starts did not change), so nothing is resent in snapshots; the
  // changes made meanwhile arrive as deltas.
  const uint64_t resent_before = SnapshotRecords(owners);
  uint64_t changes_before = 0;
  for (SimNode* owner : owners) changes_before += owner->changes();
  Check(etcd.process->Stop(), "stopping etcd");
  std::this_thread::sleep_for(std::chrono::milliseconds(kTtlSecs * 1000 / 2 + 1500));
  Check(etcd.process->Launch(), "starting etcd again");
  Check(etcd.process->WaitReady(Deadline::After(kWait)), "etcd ready again");
  const MonoTime up = MonoNow();
  if (!WaitFor([&] {
        for (SimNode* owner : owners) {
          if (!owner->registered_again() || !owner->membership().CanDoRemoteWork()) return false;
        }
        return true;
      })) {
    Check(Status::Internal("a registration was not made again after the outage"), "outage");
  }
  uint64_t changes = 0;
  for (SimNode* owner : owners) {
    owner->StopChurn();
    changes += owner->changes();
  }
  changes -= changes_before;
  if (!WaitFor([&] { return CatalogsMatch(hosts, owners); }, kConverge) && !CatalogsMatch(hosts, owners, true)) {
    Check(Status::Internal("the catalog hosts did not hold the owners' inventories after the outage"), "outage");
  }
  const double recovery_s = Seconds(MonoNow() - up);
  const uint64_t resent = SnapshotRecords(owners) - resent_before;
  size_t inventory = 0;
  for (SimNode* owner : owners) inventory += owner->catalog().Summarize().inventory_records;
  report.Add({fmt::format("reregistration_resent_records_at_{}", n), "records", static_cast<double>(resent),
              fmt::format("inventory_records_at_{}", n), static_cast<double>(inventory)});
  report.AddEnv(fmt::format("outage_at_{}", n),
                fmt::format("etcd stopped {:.1f} s (TTL {} s); {} owners registered again; {} inventory changes "
                            "made from the outage to the registrations; every catalog copy exact again {:.2f} s "
                            "after etcd answered",
                            (kTtlSecs * 1000 / 2 + 1500) / 1000.0, kTtlSecs, owners.size(), changes, recovery_s));
  if (resent > changes) {
    g_missed.push_back(
        fmt::format("reregistration_resent_records_at_{} is {}, above the {} changes made", n, resent, changes));
  }
}

void MeasureLimit(BenchReport& report) {
  fmt::print(stderr, "scale_bench: the member limit: {} member records, then one more\n", kMaxMembers);
  Etcd etcd = StartEtcd();
  std::vector<Real> reals;
  for (int i = 0; i < kReal; ++i) reals.push_back(JoinReal(RealOptions(etcd.endpoints, fmt::format("real-{}", i))));
  LeanFleet fleet(etcd.client.get(), static_cast<int>(kMaxMembers) - kReal, /*renew=*/false);
  if (!WaitFor([&] {
        for (Real& r : reals) {
          if (!r.membership->CanDoRemoteWork() || r.membership->view().size() != kMaxMembers) return false;
        }
        return true;
      })) {
    Check(Status::Internal("the real Managers never saw the full cluster"), "limit");
  }
  MetricsRegistry refused_metrics;
  Result<std::unique_ptr<Membership>> refused =
      Membership::Create(RealOptions(etcd.endpoints, "one-more"), &refused_metrics);
  Check(refused.status(), "membership");
  const Status join = (*refused)->Join(Deadline::After(kWait));
  const double join_refused = join.code() == StatusCode::kResourceExhausted ? 1 : 0;
  if (join_refused == 0)
    fmt::print(stderr, "scale_bench: the join past the limit was not refused: {}\n", join.ToString());
  MembershipOptions racing = RealOptions(etcd.endpoints, "one-more");
  racing.refuse_join_when_full = false;
  Real raced = JoinReal(racing);
  (void)WaitFor(
      [&] { return reals[0].membership->view().PlaceOf("one-more").standing == MemberView::Standing::kWaiting; });
  std::this_thread::sleep_for(std::chrono::seconds(3));
  double lost = 0;
  for (Real& r : reals) lost += r.membership->CanDoRemoteWork() ? 0 : 1;
  report.Add({"member_limit_join_refused", "count", join_refused, "joins_past_the_limit", 1});
  report.Add({"remote_work_managers_lost", "count", lost, "real_managers", static_cast<double>(kReal)});
  if (join_refused != 1) g_missed.push_back("member_limit_join_refused is not 1: " + join.ToString());
  if (lost != 0) g_missed.push_back(fmt::format("remote_work_managers_lost is {}, not 0", lost));
  raced.membership->Shutdown();
  for (Real& r : reals) r.membership->Shutdown();
}

void MeasureElection(BenchReport& report) {
  constexpr int kManagers = 8;
  fmt::print(stderr, "scale_bench: a leader election under user auth, {} Managers\n", kManagers);
  Result<std::unique_ptr<testing::EtcdCluster>> cluster = testing::EtcdCluster::Start(3, Deadline::After(kWait));
  Check(cluster.status(), "starting a three-member etcd");
  Check((*cluster)->member(0).EnableAuth("orbit", "pw-scale"), "etcd auth");
  for (size_t i = 1; i < (*cluster)->size(); ++i) (*cluster)->member(i).SetClientAuth("orbit", "pw-scale");
  Result<size_t> leader = (*cluster)->LeaderIndex(Deadline::After(kWait));
  Check(leader.status(), "leader");
  std::vector<std::string> endpoints = (*cluster)->endpoints();
  std::rotate(endpoints.begin(), endpoints.begin() + static_cast<long>(*leader), endpoints.end());
  std::vector<Real> reals;
  for (int i = 0; i < kManagers; ++i) {
    MembershipOptions o = RealOptions(endpoints, fmt::format("real-{}", i));
    o.etcd_user = "orbit";
    o.etcd_password = "pw-scale";
    reals.push_back(JoinReal(o));
  }
  (void)WaitFor([&] {
    for (Real& r : reals) {
      if (!r.membership->CanDoRemoteWork()) return false;
    }
    return true;
  });
  double at_join = 0;
  std::vector<uint64_t> before;
  for (Real& r : reals) {
    before.push_back(r.membership->etcd().authenticate_calls());
    at_join += static_cast<double>(before.back());
  }
  (*cluster)->member(*leader).Kill();
  // Every Manager's streams broke and came back: its view was invalidated and is complete again.
  for (Real& r : reals) {
    (void)WaitFor([&] {
      return r.membership->CanDoRemoteWork() &&
             r.metrics->GetCounter("orbitkv_membership_view_invalidations_total", "", {{"reason", "reconnect"}})
                     .Value() >= 1;
    });
  }
  std::this_thread::sleep_for(std::chrono::seconds(2));
  double after = 0;
  for (size_t i = 0; i < reals.size(); ++i) {
    after += static_cast<double>(reals[i].membership->etcd().authenticate_calls() - before[i]);
  }
  report.Add({"authenticate_calls_per_member_after_election", "count", after / kManagers,
              "authenticate_calls_per_member_at_join", at_join / kManagers});
  if (after / kManagers > 1) {
    g_missed.push_back(fmt::format("authenticate_calls_per_member_after_election is {}, above 1", after / kManagers));
  }
  for (Real& r : reals) r.membership->Shutdown();
}

}  // namespace
}  // namespace orbitkv::bench

int main(int argc, char** argv) {
  using namespace orbitkv;
  using namespace orbitkv::bench;
  // --members N[,N...] is ours; the rest is the house's (--json).
  std::vector<int> sizes = {64, 256, 1024};
  std::vector<char*> rest = {argv[0]};
  bool check = false;
  for (int i = 1; i < argc; ++i) {
    std::string_view arg = argv[i];
    if (arg == "--check") {
      check = true;
    } else if (arg.starts_with("--owners=")) {
      g_owners.owners = std::stoi(std::string(arg.substr(9)));
    } else if (arg.starts_with("--owner-records=")) {
      g_owners.records = std::stoul(std::string(arg.substr(16)));
    } else if (arg.starts_with("--owner-churn=")) {
      g_owners.churn_per_s = std::stod(std::string(arg.substr(14)));
    } else if (arg.starts_with("--members=")) {
      sizes.clear();
      std::string list(arg.substr(10));
      std::stringstream in(list);
      std::string item;
      while (std::getline(in, item, ',')) sizes.push_back(std::stoi(item));
    } else {
      rest.push_back(argv[i]);
    }
  }
  const bool json =
      ParseBenchArgs(static_cast<int>(rest.size()), rest.data(),
                     "A fleet of N members on a real etcd (lean simulated members, real registrations): view sync, "
                     "steady etcd load per member, the member limit, and authentication after an election. "
                     "--members=N[,N...] (default 64,256,1024; at most 4096), --owners=K (members with owner "
                     "streams besides the 3 catalog hosts, default 8), --owner-records=M (each one's inventory, "
                     "default 2000), --owner-churn=C (inventory changes a second each, default 5), --check (exit 1 "
                     "when a count misses its target: the smoke in scripts/test).");
  if (g_owners.owners < 0 || g_owners.churn_per_s < 0) {
    fmt::print(stderr, "scale_bench: --owners and --owner-churn cannot be negative\n");
    return 2;
  }
  for (int n : sizes) {
    const int least = kReal + g_owners.owners + 2;
    if (n < least || n > static_cast<int>(kMaxMembers)) {
      fmt::print(stderr, "scale_bench: --members: {} is outside {}..{} (with --owners={})\n", n, least, kMaxMembers,
                 g_owners.owners);
      return 2;
    }
  }
  log::SetLevel(log::Level::kError);
  BenchReport report("scale");
  AddStandardEnv(report);
  for (int n : sizes) MeasureAt(n, report);
  MeasureLimit(report);
  MeasureElection(report);
  report.AddEnv("etcd", "3.4, a fresh single member per N on loopback (the election: three members, user auth)");
  report.AddEnv("members",
                fmt::format("N in all: N - {} lean simulated; {} catalog hosts and {} owners, each a real registration "
                            "(cluster::Membership) with a Manager's catalog parts (CatalogHost: its store, its owner "
                            "streams; the hosts' PeerService on loopback gRPC); and the fresh one whose view sync is "
                            "timed. The member limit with 4,096 records (lean ones without keepalives there), the "
                            "election with 8 real ones",
                            kReal + g_owners.owners + 1, kReal, g_owners.owners));
  report.AddEnv("simulated",
                fmt::format("each lean member: its own lease renewed every TTL/6 (TTL {} s, the Manager's rate, not "
                            "scaled down) on one keepalive stream shared by the lean fleet, and its member record; one "
                            "view watch for the lean fleet (a real fleet has one per Manager); no owner streams. Owner "
                            "streams for a sample: the {} catalog hosts and {} owners, {} records and {} changes a "
                            "second each, one stream per shard and copy ({} shards x {} copies), heartbeats at the "
                            "Manager's rate (1 s); no engines, cache or transfers behind them",
                            kTtlSecs, kReal, g_owners.owners, g_owners.records, g_owners.churn_per_s, kNumShards,
                            kDefaultCatalogReplicas));
  report.Print(json);
  for (const std::string& missed : g_missed) fmt::print(stderr, "scale_bench: target missed: {}\n", missed);
  return check && !g_missed.empty() ? 1 : 0;
}
