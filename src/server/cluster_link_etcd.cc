// ClusterLink in a build with the cluster module: leased membership in etcd, and with --peer-endpoint the peer
// listener (orbitkv.peer.v1 over gRPC: the Manager's only gRPC listener; standalone Managers open none).
#include "catalog/peer_service.h"  // first: it brings gRPC in (see cluster/grpc.h)

#include "catalog/catalog_grpc.h"
#include "catalog/catalog_store.h"
#include "catalog/owner_streamer.h"
#include "catalog/peer_directory.h"
#include "catalog/release_queue.h"
#include "catalog/source_holds.h"
#include "catalog/transfer_grants.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <fstream>
#include <optional>
#include <set>
#include <thread>
#include <sstream>

#include "base/clock.h"
#include "base/json_text.h"
#include "fmt/ranges.h"
#include "base/logging.h"
#include "cluster/etcd_client.h"
#include "cluster/membership.h"
#include "cluster/placement.h"
#include "cluster/tls_files.h"
#include "server/cluster_link.h"
#include "server/placement_driver.h"
#include "server/remote_fetch.h"
#include "transfer/descriptor.h"
#include "transfer/ucx_engine.h"

namespace orbitkv::server {
namespace {

// The peer listener: one gRPC server serving PeerService on --peer-listen (default --peer-endpoint).
struct PeerListener {
  std::string address;
  bool tls = false;  // mutual TLS, certificates naming their node (issue 52)
  std::unique_ptr<catalog::PeerService> service;
  std::unique_ptr<grpc::Server> server;
  // The sending side: channels to the members and their Health (peer_directory.h).
  std::unique_ptr<catalog::PeerDirectory> directory;
};

// The --peer-tls-* files (all three, or none: null), re-read every --tls-reload-secs (cluster/tls_files.h).
Result<std::optional<cluster::TlsFiles>> PeerTlsFiles(const ManagerConfig& config) {
  const int given = !config.peer_tls_cert.empty() + !config.peer_tls_key.empty() + !config.peer_tls_ca.empty();
  if (given == 0) return std::optional<cluster::TlsFiles>();
  if (given != 3) {
    return Status::InvalidArgument(
        "mutual TLS between peers needs all of --peer-tls-cert, --peer-tls-key and --peer-tls-ca");
  }
  return std::optional<cluster::TlsFiles>(cluster::TlsFiles{config.peer_tls_ca, config.peer_tls_cert,
                                                            config.peer_tls_key, "--peer-tls-ca", "--peer-tls-cert",
                                                            "--peer-tls-key", config.tls_reload_secs});
}

// Mutual TLS from --peer-tls-cert/key/ca (all three), or null for an unauthenticated listener (none). The
// certificate must name this Manager's Node ID (issue 52), or every peer would refuse it.
Result<std::shared_ptr<grpc::ServerCredentials>> PeerCredentials(const ManagerConfig& config) {
  ORBITKV_ASSIGN_OR_RETURN(std::optional<cluster::TlsFiles> files, PeerTlsFiles(config));
  if (!files.has_value()) return std::shared_ptr<grpc::ServerCredentials>();
  // First the credentials: they check every file is readable PEM, naming its flag.
  ORBITKV_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                           cluster::WatchedServerCredentials(*files));
  const std::string wanted = fmt::format("{}{}", catalog::kNodeUriPrefix, config.node_id);
  const std::vector<std::string> uris = cluster::CertificateUris(files->cert);
  if (std::find(uris.begin(), uris.end(), wanted) == uris.end()) {
    return Status::InvalidArgument(fmt::format(
        "--peer-tls-cert {} does not name this node: peers accept a certificate only for the Node ID it carries as "
        "a subjectAltName URI; issue it with subjectAltName=URI:{},IP:<its address> (it names {})",
        files->cert, wanted, uris.empty() ? std::string("no URI") : fmt::format("{}", fmt::join(uris, ", "))));
  }
  return credentials;
}

// --transfer-listen HOST[:PORT[-PORT]] (default: the --peer-endpoint's host, any port) -> host, first and last port.
struct TransferListen {
  std::string host;
  uint32_t first_port = 0;
  uint32_t last_port = 0;
};

Result<TransferListen> ParseTransferListen(const ManagerConfig& config) {
  std::string spec = config.transfer_listen;
  if (spec.empty()) spec = config.peer_endpoint.substr(0, config.peer_endpoint.rfind(':'));
  TransferListen out;
  const size_t colon = spec.rfind(':');
  out.host = spec.substr(0, colon);
  const auto bad = [&](std::string_view why) {
    return Status::InvalidArgument(fmt::format(
        "--transfer-listen '{}': {} (give HOST, HOST:PORT or HOST:FIRST-LAST, e.g. 10.0.0.5:7400-7409)", spec, why));
  };
  if (out.host.empty()) return bad("no host");
  if (colon == std::string::npos) return out;
  const std::string ports = spec.substr(colon + 1);
  const size_t dash = ports.find('-');
  const auto port = [&](const std::string& text, uint32_t* value) {
    if (text.empty() || text.size() > 5 || text.find_first_not_of("0123456789") != std::string::npos) return false;
    *value = static_cast<uint32_t>(std::stoul(text));
    return *value <= 65535;
  };
  if (!port(ports.substr(0, dash), &out.first_port)) return bad("not a port");
  out.last_port = out.first_port;
  if (dash != std::string::npos && !port(ports.substr(dash + 1), &out.last_port)) return bad("not a port range");
  if (out.last_port < out.first_port || (out.first_port == 0 && out.last_port != 0)) return bad("an empty range");
  return out;
}

// The UCX transfer engine: serves the pool's arenas to peers, only inside grants (docs/transfer.md), with
// descriptors that name this start (the runtime incarnation); `regions` gets the transfer region of each arena.
Result<std::unique_ptr<transfer::UcxTransferEngine>> StartTransfer(const ManagerConfig& config, const RuntimeId& runtime,
                                                                   core::PinnedPool& pool,
                                                                   std::vector<transfer::RegionHandle>* regions,
                                                                   MetricsRegistry* metrics) {
  ORBITKV_ASSIGN_OR_RETURN(TransferListen listen, ParseTransferListen(config));
  transfer::UcxEngineOptions options;
  options.transports = config.ucx_tls;
  options.net_devices = config.ucx_net_devices;
  options.require_grants = true;
  options.engine_id = runtime.incarnation();
  options.metrics = metrics;
  Status last;
  for (uint32_t port = listen.first_port; port <= listen.last_port; ++port) {
    options.listen_address = fmt::format("{}:{}", listen.host, port);
    Result<std::unique_ptr<transfer::UcxTransferEngine>> engine = transfer::UcxTransferEngine::Create(options);
    if (!engine.ok()) {
      last = engine.status();
      if (last.code() == StatusCode::kUnavailable) continue;  // that port is taken: the next one
      return last.WithContext("starting the UCX transfer engine (--transfer-listen, --ucx-tls, --ucx-net-devices)");
    }
    regions->clear();
    for (size_t i = 0; i < pool.arena_count(); ++i) {
      Result<transfer::RegionHandle> region =
          (*engine)->RegisterRegion(pool.arena(i).data(), pool.arena(i).size());
      if (!region.ok()) return region.status().WithContext("registering the DRAM pool with UCX");
      regions->push_back(*region);
    }
    ORBITKV_LOG_INFO("manager: UCX transfer engine on {} (transports '{}', devices '{}'; reads only inside grants)",
                     (*engine)->ListenAddress(), config.ucx_tls.empty() ? "UCX default" : config.ucx_tls,
                     config.ucx_net_devices.empty() ? "all" : config.ucx_net_devices);
    return engine;
  }
  return Status::Unavailable(fmt::format("no port of --transfer-listen {}:{}-{} is free ({})", listen.host,
                                         listen.first_port, listen.last_port, last.ToString()));
}

// This Manager's client side of mutual TLS (the same three files), or insecure channels (null) without them.
Result<std::shared_ptr<grpc::ChannelCredentials>> PeerClientCredentials(const ManagerConfig& config) {
  ORBITKV_ASSIGN_OR_RETURN(std::optional<cluster::TlsFiles> files, PeerTlsFiles(config));
  if (!files.has_value()) return std::shared_ptr<grpc::ChannelCredentials>();
  return cluster::WatchedChannelCredentials(*files);
}

// The password of --etcd-user from --etcd-password-file (its first line), or an error naming the flags.
Result<std::string> EtcdPassword(const ManagerConfig& config) {
  if (config.etcd_user.empty()) {
    if (!config.etcd_password_file.empty()) {
      return Status::InvalidArgument("--etcd-password-file needs --etcd-user (the user whose password it holds)");
    }
    return std::string();
  }
  if (config.etcd_password_file.empty()) {
    return Status::InvalidArgument(
        "--etcd-user needs --etcd-password-file (a file holding the password; it is never taken on the command "
        "line)");
  }
  std::ifstream in(config.etcd_password_file, std::ios::binary);
  if (!in) {
    return Status::NotFound(fmt::format("--etcd-password-file {}: cannot read the file", config.etcd_password_file));
  }
  std::string password;
  std::getline(in, password);
  while (!password.empty() && (password.back() == '\r' || password.back() == ' ')) password.pop_back();
  if (password.empty()) {
    return Status::InvalidArgument(
        fmt::format("--etcd-password-file {}: the first line (the password) is empty", config.etcd_password_file));
  }
  return password;
}

// This Manager as its peers address it: the registration `self`, routing by the placement as it changes (issue 55).
catalog::PeerIdentity PeerIdentityOf(const cluster::MemberRecord& self, const cluster::LivePlacement& live) {
  catalog::PeerIdentity identity{self.cluster, self.node_id, self.runtime_uuid, self.epoch,
                                 live.Get()->committed.fingerprint()};
  identity.current_placement = [&live] { return live.Get()->committed.fingerprint(); };
  identity.accepts_placement = [&live](std::string_view fingerprint) { return live.Get()->Accepts(fingerprint); };
  return identity;
}

Result<std::unique_ptr<PeerListener>> StartPeerListener(const ManagerConfig& config, const RuntimeId& runtime,
                                                        const cluster::Membership& membership,
                                                        const transfer::TransferEngine& transfer,
                                                        catalog::CatalogStore* catalog,
                                                        catalog::SourceHolds* source,
                                                        std::function<std::string()> remote_off) {
  ORBITKV_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> tls, PeerCredentials(config));
  auto listener = std::make_unique<PeerListener>();
  listener->address = config.peer_listen.empty() ? config.peer_endpoint : config.peer_listen;
  catalog::PeerService::Options options;
  options.self = PeerIdentityOf(membership.self(), membership.live_placement());
  options.incarnation = runtime.incarnation();
  options.ucx_worker_address = transfer.ListenAddress();
  options.capabilities = {"health", "transfer.am", "transfer.grants", "catalog.stream", "catalog.lookup",
                          "source.authorize"};
  options.catalog = catalog;
  options.source = source;
  options.remote_off = std::move(remote_off);
  options.require_node_certificates = tls != nullptr;  // issue 52: a peer is who its certificate says
  const cluster::LivePlacement* live = &membership.live_placement();
  options.serves_generation = [live](int64_t generation) { return live->Get()->Serves(generation); };
  options.hosts_shard = [live, node = config.node_id](uint32_t shard) {
    return shard < cluster::kNumShards && live->Get()->Hosts(shard, node);
  };
  catalog::PeerDirectory::Options directory;
  directory.self = options.self;
  ORBITKV_ASSIGN_OR_RETURN(directory.credentials, PeerClientCredentials(config));
  listener->directory = std::make_unique<catalog::PeerDirectory>(std::move(directory), &membership.view());
  listener->service = std::make_unique<catalog::PeerService>(std::move(options), &membership.view());
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(listener->address, tls ? tls : grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(catalog::kMaxPeerMessageBytes);
  builder.SetMaxSendMessageSize(catalog::kMaxPeerMessageBytes);
  builder.RegisterService(listener->service.get());
  listener->tls = tls != nullptr;
  listener->server = builder.BuildAndStart();
  if (listener->server == nullptr || port == 0) {
    return Status::Unavailable(fmt::format("cannot listen for peers on {} (--peer-listen / --peer-endpoint): "
                                           "the address is in use or not this host's",
                                           listener->address));
  }
  if (tls) {
    ORBITKV_LOG_INFO("manager: peer listener on {} (mutual TLS: peers need a certificate from {} naming their "
                     "Node ID as subjectAltName URI:{}<node-id>)",
                     listener->address, config.peer_tls_ca, catalog::kNodeUriPrefix);
  } else {
    ORBITKV_LOG_WARN(
        "manager: peer listener on {} serves orbitkv.peer.v1 without TLS: peers are not authenticated beyond "
        "the route check against the member view (give --peer-tls-cert, --peer-tls-key and --peer-tls-ca)",
        listener->address);
  }
  listener->directory->Start();
  return listener;
}

// The catalog in this Manager (docs/catalog.md): the store for the shards placed here, one owner stream per
// shard and copy (this Manager's own store directly, others over orbitkv.peer.v1), and a maintenance thread that
// drops the slices of owners the member view no longer holds and refreshes the metrics. Issue 55: the placement
// changes online, so the store is there on every Manager (a node added to the catalog set starts hosting without a
// restart), the maintenance thread follows the live placement (owner streams to the copies of both generations
// while a change moves, the slices of retired copies dropped) and the set of streams is made anew on each change.
class CatalogNode {
 public:
  CatalogNode(const ManagerConfig& config, const RuntimeId& runtime, cluster::Membership& membership,
              core::ResidencyInventory* inventory, MetricsRegistry* metrics)
      : membership_(membership), inventory_(inventory), node_(config.node_id) {
    {
      catalog::CatalogStore::Options options;
      options.incarnation = runtime.incarnation();
      options.budget_bytes = config.catalog_budget_bytes;
      const cluster::MemberView* view = &membership.view();
      options.owner_live = [view](const std::string& node,
                                  const std::string& owner_runtime) -> std::optional<bool> {
        Result<cluster::Member> member = view->Find(node);
        if (member.status().code() == StatusCode::kUnavailable) return std::nullopt;  // view incomplete: unknown
        return member.ok() && member->record.runtime_uuid == owner_runtime;
      };
      options.num_shards = cluster::kNumShards;
      // A shard is complete only when every live member's owner stream has a baseline in it.
      options.live_owners = [view]() -> std::optional<std::vector<std::pair<std::string, std::string>>> {
        const cluster::MemberView::Snapshot snapshot = view->Read();
        if (!snapshot.complete) return std::nullopt;
        std::vector<std::pair<std::string, std::string>> live;
        for (const cluster::Member& m : snapshot.members) live.emplace_back(m.record.node_id, m.record.runtime_uuid);
        return live;
      };
      const cluster::LivePlacement* live = &membership.live_placement();
      options.hosts = [live, node = node_](uint32_t shard) { return live->Get()->Hosts(shard, node); };
      store_ = std::make_unique<catalog::CatalogStore>(std::move(options));
    }
    records_ = &metrics->GetGauge("orbitkv_catalog_records", "Residences this catalog host holds as evidence");
    bytes_ = &metrics->GetGauge("orbitkv_catalog_bytes", "Bytes charged to --catalog-budget on this catalog host");
    incomplete_ = &metrics->GetGauge("orbitkv_catalog_incomplete_shards",
                                     "Shards placed here whose evidence is incomplete (a live owner without a "
                                     "baseline: rebuilding, over budget, or after this catalog host restarted)");
    incomplete_seconds_ = &metrics->GetGauge(
        "orbitkv_catalog_incomplete_seconds_total",
        "Shard-seconds the shards placed here were incomplete (only grows; their misses are not authoritative)");
    streams_converged_ = &metrics->GetGauge(
        "orbitkv_catalog_streams_converged",
        "This Manager's owner streams that converge (one per shard and copy: 16 x --catalog-replicas)");
    snapshots_ = &metrics->GetGauge("orbitkv_catalog_stream_snapshots",
                                    "Snapshots this Manager's owner streams sent (since start)");
    lag_ms_ = &metrics->GetGauge("orbitkv_catalog_update_lag_ms",
                                 "Largest update lag of the owners' last deltas over the shards placed here (ms, "
                                 "owner side: the oldest record's age when sent)");
    stale_repair_s_ = &metrics->GetGauge("orbitkv_catalog_seconds_since_repair",
                                         "Seconds since the most recent snapshot installed on this catalog host");
  }

  catalog::CatalogStore* store() const { return store_.get(); }

  // Starts the owner streams of the registration `self` (one per shard and copy the live placement publishes to;
  // each new stream snapshots its shard first), and the maintenance thread the first time.
  Status StartStreams(std::shared_ptr<grpc::ChannelCredentials> credentials, const cluster::MemberRecord& self) {
    {
      MutexLock lock(&streams_mu_);
      ORBITKV_CHECK_MSG(streams_.empty() && !transport_, "owner streams started twice");
      streams_stop_.store(false, std::memory_order_release);
      transport_ = std::make_unique<catalog::GrpcCatalogTransport>(PeerIdentityOf(self, membership_.live_placement()),
                                                                   &membership_.view(), std::move(credentials),
                                                                   store_.get());
      owner_ = self;
      ORBITKV_RETURN_IF_ERROR(SyncStreams());
    }
    if (!maintenance_.joinable()) maintenance_ = std::thread([this] { Maintain(); });
    return Status::Ok();
  }

  // Stops and joins the owner streams (before streams of a new registration start: issue 51).
  void StopStreams() {
    MutexLock lock(&streams_mu_);
    streams_stop_.store(true, std::memory_order_release);
    for (auto& [where, stream] : streams_) stream->stop.store(true, std::memory_order_release);
    for (auto& [where, stream] : streams_) {
      if (stream->thread.joinable()) stream->thread.join();
    }
    streams_.clear();  // unsubscribes from the inventory
    if (transport_) stream_bytes_before_ += transport_->bytes_sent();
    transport_.reset();
  }

  void Stop() {
    StopStreams();
    stop_.store(true, std::memory_order_release);
    if (maintenance_.joinable()) maintenance_.join();
  }
  ~CatalogNode() { Stop(); }

  std::vector<std::string> CatalogLines(uint32_t shard) const {
    std::vector<std::string> lines;
    if (!store_) return lines;
    for (const std::string& owner : store_->Owners(shard)) {
      for (const catalog::CatalogRecord& r : store_->Dump(shard, owner)) {
        const auto key = r.key.Encode();
        lines.push_back(fmt::format("{} {:02x} {} {} {} {}", owner, fmt::join(key, ""), r.tier, r.version,
                                    r.generation, r.bytes));
      }
    }
    return lines;
  }

  std::vector<std::string> CatalogStatusLines() const {
    std::vector<std::string> lines;
    if (!store_) return lines;
    std::map<uint32_t, catalog::CatalogStore::ShardStatus> known;
    for (const auto& s : store_->Status()) known[s.shard] = s;
    const std::shared_ptr<const cluster::LivePlacement::State> live = membership_.live_placement().Get();
    for (uint32_t shard = 0; shard < cluster::kNumShards; ++shard) {
      if (!live->Hosts(shard, node_)) continue;
      const auto it = known.find(shard);
      catalog::CatalogStore::ShardStatus s = it == known.end() ? catalog::CatalogStore::ShardStatus{} : it->second;
      if (it == known.end()) s.complete = false;  // Status names every shard placed here: not one of them
      lines.push_back(fmt::format("{} {} {} {} {} {:.1f} {}", shard, s.owners, s.records, s.bytes,
                                  s.complete ? "complete" : "incomplete", s.lag_ms,
                                  s.last_repair_s < 0 ? std::string("never") : fmt::format("{:.1f}", s.last_repair_s)));
    }
    return lines;
  }

  std::string StatusJson() const {
    const Summary s = Summarize();
    size_t inventory = 0;
    for (uint32_t shard = 0; shard < cluster::kNumShards; ++shard) inventory += inventory_->Size(shard);
    size_t hosted = 0;
    const std::shared_ptr<const cluster::LivePlacement::State> live = membership_.live_placement().Get();
    for (uint32_t shard = 0; shard < cluster::kNumShards; ++shard) hosted += live->Hosts(shard, node_) ? 1 : 0;
    return fmt::format(", \"catalog_shards_hosted\": {}, \"catalog_records\": {}, \"catalog_bytes\": {}, "
                       "\"catalog_incomplete_shards\": {}, \"catalog_incomplete_shard_ms\": {}, \"catalog_streams\": {}, "
                       "\"catalog_streams_streaming\": {}, \"catalog_streams_converged\": {}, "
                       "\"catalog_stream_snapshots\": {}, \"inventory_records\": {}, \"catalog_stream_bytes_sent\": {}",
                       hosted, s.records, s.bytes, s.incomplete, incomplete_ms_.load(std::memory_order_relaxed),
                       s.streams, s.streaming, s.converged, s.snapshots, inventory, s.stream_bytes);
  }

 private:
  // The figures status and metrics show, over the shards placed here and this Manager's own streams.
  struct Summary {
    size_t records = 0, incomplete = 0, converged = 0, streaming = 0, streams = 0;
    uint64_t stream_bytes = 0;  // catalog stream messages this Manager sent to other hosts' copies
    uint64_t bytes = 0, snapshots = 0;
    double lag_ms = 0, last_repair_s = -1;
  };
  Summary Summarize() const {
    Summary sum;
    if (store_) {
      for (const auto& shard : store_->Status()) {
        sum.records += shard.records;
        sum.incomplete += shard.complete ? 0 : 1;
        sum.lag_ms = std::max(sum.lag_ms, shard.lag_ms);
        if (shard.last_repair_s >= 0) {
          sum.last_repair_s = sum.last_repair_s < 0 ? shard.last_repair_s : std::min(sum.last_repair_s, shard.last_repair_s);
        }
      }
      sum.bytes = store_->used_bytes();
    }
    MutexLock lock(&streams_mu_);
    sum.streams = streams_.size();
    sum.stream_bytes = stream_bytes_before_ + (transport_ ? transport_->bytes_sent() : 0);
    for (const auto& [where, stream] : streams_) {
      const catalog::OwnerStreamer& s = *stream->streamer;
      sum.converged += s.converged() ? 1 : 0;
      sum.streaming += s.state() == catalog::OwnerStreamer::State::kStreaming ? 1 : 0;
      sum.snapshots += s.snapshots();
    }
    sum.snapshots += snapshots_before_;
    return sum;
  }

  // Makes the owner streams those the live placement publishes to now: starts the missing ones, stops those no
  // longer wanted (a retired or aborted copy). Nothing while no registration streams.
  Status SyncStreams() REQUIRES(streams_mu_) {
    if (!transport_) return Status::Ok();
    const std::shared_ptr<const cluster::LivePlacement::State> live = membership_.live_placement().Get();
    std::set<std::pair<uint32_t, std::string>> wanted;
    for (uint32_t shard = 0; shard < cluster::kNumShards; ++shard) {
      for (const std::string& copy : live->PublishCopies(shard)) wanted.emplace(shard, copy);
    }
    std::vector<std::unique_ptr<Stream>> gone;
    for (auto it = streams_.begin(); it != streams_.end();) {
      if (wanted.contains(it->first)) {
        ++it;
        continue;
      }
      it->second->stop.store(true, std::memory_order_release);
      gone.push_back(std::move(it->second));
      it = streams_.erase(it);
    }
    for (auto& stream : gone) {
      if (stream->thread.joinable()) stream->thread.join();
      snapshots_before_ += stream->streamer->snapshots();
    }
    for (const auto& [shard, copy] : wanted) {
      if (streams_.contains({shard, copy})) continue;
      // Issue 54: every copy of a shard is built from the owners' streams alone: one stream per (shard, copy), each
      // with its own journal subscriber, so a slow or dead copy resyncs alone.
      catalog::OwnerStreamer::Options options;
      options.owner_node = owner_.node_id;
      options.owner_runtime = owner_.runtime_uuid;
      options.owner_epoch = owner_.epoch;
      options.shard = shard;
      options.catalog_node = copy;
      ORBITKV_ASSIGN_OR_RETURN(std::unique_ptr<catalog::OwnerStreamer> streamer,
                               catalog::OwnerStreamer::Create(options, inventory_, transport_.get()));
      auto stream = std::make_unique<Stream>();
      stream->streamer = std::move(streamer);
      Stream* raw = stream.get();
      raw->thread = std::thread([raw] { raw->streamer->Run(raw->stop); });
      streams_.emplace(std::make_pair(shard, copy), std::move(stream));
    }
    return Status::Ok();
  }

  void Maintain() {
    MonoTime last = MonoNow();
    size_t incomplete = 0;  // as of the last round: the state the time since then is charged to
    while (!stop_.load(std::memory_order_acquire)) {
      FollowPlacement();
      if (store_) store_->DropDeadOwners();
      const Summary s = Summarize();
      const MonoTime now = MonoNow();
      const double seconds = std::chrono::duration<double>(now - last).count() * static_cast<double>(incomplete);
      incomplete_ms_.fetch_add(static_cast<uint64_t>(seconds * 1000), std::memory_order_relaxed);
      last = now;
      incomplete = s.incomplete;
      incomplete_seconds_->Set(static_cast<double>(incomplete_ms_.load(std::memory_order_relaxed)) / 1000);
      records_->Set(static_cast<int64_t>(s.records));
      bytes_->Set(static_cast<int64_t>(s.bytes));
      incomplete_->Set(static_cast<int64_t>(s.incomplete));
      streams_converged_->Set(static_cast<int64_t>(s.converged));
      snapshots_->Set(static_cast<int64_t>(s.snapshots));
      lag_ms_->Set(static_cast<int64_t>(s.lag_ms));
      stale_repair_s_->Set(static_cast<int64_t>(s.last_repair_s));
      for (int i = 0; i < 10 && !stop_.load(std::memory_order_acquire); ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        if (membership_.live_placement().version() != followed_version_.load(std::memory_order_acquire)) {
          FollowPlacement();
        }
      }
    }
  }

  // The placement changed: the streams follow it, and the slices of copies retired here go.
  void FollowPlacement() {
    const uint64_t version = membership_.live_placement().version();
    if (version == followed_version_.load(std::memory_order_acquire)) return;
    {
      MutexLock lock(&streams_mu_);
      if (streams_stop_.load(std::memory_order_acquire)) {
        // No registration streams now; the next StartStreams follows the placement.
      } else if (Status synced = SyncStreams(); !synced.ok()) {
        ORBITKV_LOG_ERROR("manager: the catalog streams did not follow the placement: {}", synced.ToString());
        return;  // tried again on the next round
      }
    }
    if (const size_t dropped = store_->DropUnhosted(); dropped > 0) {
      ORBITKV_LOG_INFO("manager: dropped {} catalog slice(s) of shards no longer placed on node {}", dropped, node_);
    }
    followed_version_.store(version, std::memory_order_release);
  }

  // One owner stream and its thread.
  struct Stream {
    std::unique_ptr<catalog::OwnerStreamer> streamer;
    std::atomic<bool> stop{false};
    std::thread thread;
  };

  cluster::Membership& membership_;
  core::ResidencyInventory* const inventory_;
  const std::string node_;
  std::unique_ptr<catalog::CatalogStore> store_;
  // The owner streams of the current registration (stopped and made anew when it registers again), by (shard, copy).
  mutable Mutex streams_mu_;
  std::unique_ptr<catalog::GrpcCatalogTransport> transport_ GUARDED_BY(streams_mu_);
  cluster::MemberRecord owner_ GUARDED_BY(streams_mu_);  // the registration the streams send as
  std::map<std::pair<uint32_t, std::string>, std::unique_ptr<Stream>> streams_ GUARDED_BY(streams_mu_);
  uint64_t stream_bytes_before_ GUARDED_BY(streams_mu_) = 0;  // sent by the streams of earlier registrations
  uint64_t snapshots_before_ GUARDED_BY(streams_mu_) = 0;     // sent by streams stopped since
  std::atomic<uint64_t> followed_version_{0};  // the live placement's version the streams and the store follow
  std::atomic<bool> streams_stop_{false};
  std::thread maintenance_;
  std::atomic<bool> stop_{false};
  Gauge* records_;
  Gauge* bytes_;
  Gauge* incomplete_;
  Gauge* incomplete_seconds_;
  std::atomic<uint64_t> incomplete_ms_{0};  // shard-milliseconds incomplete, as orbitkv_catalog_incomplete_seconds_total
  Gauge* streams_converged_;
  Gauge* snapshots_;
  Gauge* lag_ms_;
  Gauge* stale_repair_s_;
};

// Remote work in this Manager (issues 21-22): the requester's candidate index, discovery and fetches, and the
// source's holds, with a maintenance thread that expires grants, revokes those of requesters that left the member
// view, and refreshes the gauges.
class RemoteNode {
 public:
  RemoteNode(const ManagerConfig& config, cluster::Membership& membership,
             core::BlockCache* cache, core::SsdTier* ssd, transfer::TransferEngine* engine, std::vector<transfer::RegionHandle> arenas,
             std::shared_ptr<grpc::ChannelCredentials> credentials, MetricsRegistry* metrics)
      : membership_(membership),
        index_(catalog::CandidateIndex::Options{
            .budget_bytes = 16ull << 20, .ttl = std::chrono::milliseconds(config.candidate_ttl_ms)}),
        requester_(PeerIdentityOf(membership.self(), membership.live_placement()), &membership.view(),
                   std::move(credentials)),
        releases_(catalog::ReleaseQueue::Options{}, &requester_, metrics),
        issuer_(engine, arenas) {
    catalog::Discovery::Options discovery;
    discovery.max_hosts = config.discovery_max_hosts;
    discovery.hedge_after = std::chrono::milliseconds(config.discovery_hedge_ms);
    // Issue 54: a shard's copies, tried one after another; the rotation spreads requesters over them.
    // Issue 55: while the placement changes, a moving shard's new copies come after its committed ones.
    discovery.copies_of = [live = &membership.live_placement()](const state::StateKey& key) {
      return live->Get()->QueryCopies(state::ShardOf(key, cluster::kNumShards));
    };
    discovery.rotation = std::hash<std::string>{}(config.node_id);
    discovery.shard_of = [](const state::StateKey& key) { return state::ShardOf(key, cluster::kNumShards); };
    discovery_ = std::make_unique<catalog::Discovery>(std::move(discovery), &index_, &requester_);
    catalog::SourceHolds::Options source;
    if (ssd != nullptr) {
      // Issue 56: this source serves its SSD-resident blocks too, read into DRAM (the SSD tier's coalesced, verified
      // path) before they are granted, within their own staging budget.
      const uint64_t staging = config.remote_ssd_staging_budget_bytes != 0 ? config.remote_ssd_staging_budget_bytes
                                                                            : cache->pool().Stats().capacity_bytes / 8;
      ssd_staging_ = std::make_unique<core::Budget>(
          core::Budget::Options{.name = "remote_ssd_staging", .global_bytes = staging}, metrics);
      source.ssd_staging = ssd_staging_.get();
      source.load_ssd = [ssd](std::vector<state::StateKey> keys,
                              std::function<void(std::vector<core::BlockPin>)> done) {
        return ssd->Load(std::move(keys), std::move(done));
      };
    }
    holds_ = std::make_unique<catalog::SourceHolds>(std::move(source), &cache->table(), &cache->pool(),
                                                    &cache->transfer_budget(), &issuer_, metrics);
    RemoteFetcher::Options fetch;
    fetch.self_node = config.node_id;
    fetch.deadline = std::chrono::milliseconds(config.remote_fetch_deadline_ms);
    fetch.threads = fetch_workers_ = config.remote_fetch_workers;
    fetch.staging_budget_bytes = config.remote_staging_budget_bytes;
    fetch.can_work = [&membership] { return membership.CanDoRemoteWork(); };
    // Authorizations go straight to the peers; releases through the release queue's own workers.
    fetcher_ = std::make_unique<RemoteFetcher>(std::move(fetch), cache, &index_, discovery_.get(), &releases_,
                                               engine, std::move(arenas), metrics);
    index_entries_ = &metrics->GetGauge("orbitkv_candidate_index_entries", "Blocks the candidate index knows holders of");
    index_bytes_ = &metrics->GetGauge("orbitkv_candidate_index_bytes",
                                      "Logical bytes of the candidate index (of its 16 MiB budget)");
    index_hits_ = &metrics->GetGauge("orbitkv_candidate_index_hits",
                                     "Candidate index reads that found a fresh holder (since start)");
    index_misses_ = &metrics->GetGauge("orbitkv_candidate_index_misses",
                                       "Candidate index reads that found none, or only expired ones (since start)");
    staging_bytes_ = &metrics->GetGauge("orbitkv_remote_staging_bytes",
                                        "Pool bytes of blocks being fetched from peers, not sealed yet");
    maintenance_ = std::thread([this] { Maintain(); });
  }
  ~RemoteNode() { Stop(); }

  // Stops fetching (running fetches finish within their deadlines) and the maintenance thread. The holds stay
  // until the node goes (after the transfer engine stopped).
  void Stop() {
    fetcher_->Stop();
    releases_.Stop();  // after the fetches: the last releases are queued
    stop_.store(true, std::memory_order_release);
    if (maintenance_.joinable()) maintenance_.join();
  }

  // The registration lapsed: every grant this source gave goes (quarantined until drained).
  void OnLapsed(const std::string& cause) {
    holds_->RevokeAll(fmt::format("the registration ended: {}", cause), /*stop_accepting=*/true);
  }
  // A new registration: requests name it, and what was learnt of peers' starts before is forgotten.
  void OnRegistered(const catalog::PeerIdentity& self) {
    requester_.SetSelf(self);
    index_.Clear();
    discovery_->ResetBreakers();
    holds_->RevokeAll("registered again");  // none normally: no grant is given while remote work is off
    holds_->Accept();
  }

  catalog::SourceHolds* holds() { return holds_.get(); }
  // The CatalogStatus RPCs of the placement reconciler go through the requester's channels.
  cluster::CatalogProgress* progress() { return &requester_; }
  std::optional<LoadingStage> Stage(std::vector<state::StateKey> keys) { return fetcher_->Stage(std::move(keys)); }

  std::string StatusJson() const {
    const RemoteFetcher::Stats f = fetcher_->GetStats();
    const catalog::SourceHolds::Stats h = holds_->GetStats();
    const catalog::CandidateIndex::Stats i = index_.GetStats();
    const catalog::Discovery::Stats d = discovery_->GetStats();
    const catalog::ReleaseQueue::Stats r = releases_.GetStats();
    return fmt::format(", \"remote_fetches\": {}, \"remote_fetched_blocks\": {}, \"remote_fetched_bytes\": {}, "
                       "\"remote_no_source\": {}, \"remote_fetch_failures\": {}, \"remote_staging_bytes\": {}, "
                       "\"discovery_rpcs\": {}, \"source_authorizations\": {}, \"candidate_rejections\": {}, "
                       "\"candidate_index_entries\": {}, \"candidate_index_bytes\": {}, \"candidate_index_hits\": {}, "
                       "\"candidate_index_misses\": {}, \"source_sessions\": {}, \"source_pinned_bytes\": {}, "
                       "\"source_quarantined_bytes\": {}, \"source_grants\": {}, \"source_rejections\": {}",
                       f.fetches, f.fetched_blocks, f.fetched_bytes, f.no_source, f.failed, f.staging_bytes,
                       f.discovery_rpcs, f.authorizations, f.rejections, i.entries, i.bytes, i.hits, i.misses,
                       h.sessions, h.pinned_bytes, h.quarantined_bytes, h.granted, h.rejected) +
           fmt::format(", \"source_release_secret_refusals\": {}", h.release_secret_refusals) +
           fmt::format(", \"source_ssd_preparations\": {}, \"source_ssd_preparing\": {}, \"source_ssd_granted\": {}, "
                       "\"source_ssd_backpressure\": {}, \"source_ssd_missing\": {}, \"source_ssd_prepared_blocks\": {}, "
                       "\"source_ssd_prepared_bytes\": {}, \"source_ssd_staging_bytes\": {}, "
                       "\"remote_ssd_fetched_blocks\": {}, \"remote_authorize_polls\": {}, "
                       "\"remote_ssd_backpressure\": {}, \"remote_ssd_missing\": {}",
                       h.ssd_preparations, h.ssd_preparing, h.ssd_granted, h.ssd_backpressure, h.ssd_missing,
                       h.ssd_prepared_blocks, h.ssd_prepared_bytes, h.ssd_staging_bytes, f.fetched_ssd_blocks,
                       f.authorize_polls, f.source_backpressure, f.source_missing) +
           fmt::format(", \"remote_releases_queued\": {}, \"remote_releases_released\": {}, "
                       "\"remote_releases_not_held\": {}, \"remote_releases_retries\": {}, "
                       "\"remote_releases_abandoned\": {}, \"remote_releases_pending\": {}",
                       r.queued, r.released, r.not_held, r.retries, r.abandoned, r.pending) +
           fmt::format(", \"discovery_skipped_hosts\": {}, \"discovery_failed_hosts\": {}, "
                       "\"discovery_coalesced\": {}, \"discovery_max_hosts_in_flight\": {}, "
                       "\"discovery_refused_hosts\": {}, \"discovery_failovers\": {}, \"discovery_hedges\": {}, "
                       "\"remote_fetches_shared\": {}, \"remote_fetch_seconds\": {:.6f}, "
                       "\"remote_sources_skipped\": {}, \"remote_fetch_workers\": {}",
                       d.skipped_hosts, d.failed_hosts, d.coalesced, d.max_hosts_in_flight, d.refused_hosts, d.failovers, d.hedges,
                       f.shared,
                       f.fetch_seconds, f.sources_skipped, fetch_workers_);
  }

 private:
  void Maintain() {
    const cluster::MemberView* view = &membership_.view();
    const auto alive = [view](const std::string& node, const std::string& runtime) {
      Result<cluster::Member> member = view->Find(node);
      if (member.status().code() == StatusCode::kUnavailable) return true;  // view incomplete: decide later
      return member.ok() && member->record.runtime_uuid == runtime;
    };
    while (!stop_.load(std::memory_order_acquire)) {
      holds_->ExpireDue();
      holds_->DropVanished(alive);
      const catalog::CandidateIndex::Stats i = index_.GetStats();
      index_entries_->Set(static_cast<int64_t>(i.entries));
      index_bytes_->Set(static_cast<int64_t>(i.bytes));
      index_hits_->Set(static_cast<int64_t>(i.hits));
      index_misses_->Set(static_cast<int64_t>(i.misses));
      staging_bytes_->Set(static_cast<int64_t>(fetcher_->GetStats().staging_bytes));
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }

  cluster::Membership& membership_;
  catalog::CandidateIndex index_;
  catalog::GrpcRequesterTransport requester_;
  catalog::ReleaseQueue releases_;  // over requester_
  catalog::TransferGrantIssuer issuer_;
  std::unique_ptr<catalog::Discovery> discovery_;
  std::unique_ptr<core::Budget> ssd_staging_;  // before the holds that charge it (issue 56)
  std::unique_ptr<catalog::SourceHolds> holds_;
  std::unique_ptr<RemoteFetcher> fetcher_;
  size_t fetch_workers_ = 0;  // --remote-fetch-workers, reported in stats
  Gauge* index_entries_;
  Gauge* index_bytes_;
  Gauge* index_hits_;
  Gauge* index_misses_;
  Gauge* staging_bytes_;
  std::atomic<bool> stop_{false};
  std::thread maintenance_;
};

// What the membership's supervisor calls when a registration lapses and when it registers again (issue 51), set
// once the Manager's distributed parts exist and cleared before they stop. The hooks run under `mu`, so clearing
// waits for one that runs.
struct RegistrationHooks {
  Mutex mu;
  std::function<void(const std::string& cause)> lapsed GUARDED_BY(mu);
  std::function<void(const cluster::MemberRecord& self)> registered GUARDED_BY(mu);
  void Clear() {
    MutexLock lock(&mu);
    lapsed = nullptr;
    registered = nullptr;
  }
};

// Why remote work is off now, for peers refused a grant and for `orbitkv status` (empty: it is on).
std::string RemoteOffReason(const cluster::Membership& m) {
  if (m.CanDoRemoteWork()) return std::string();
  const cluster::MembershipStatus s = m.GetStatus();
  const double since = static_cast<double>(s.since.count()) / 1000;
  switch (s.state) {
    case cluster::MembershipState::kRegistered:
      return s.registration_valid ? "the member view is incomplete (etcd unreachable?)"
                                  : "the registration is not acknowledged by etcd";
    case cluster::MembershipState::kExpired:
      return fmt::format("the registration lapsed {:.1f} s ago ({}); registering again, attempt {}", since, s.reason,
                         s.attempts);
    case cluster::MembershipState::kFenced:
      return fmt::format("fenced {:.1f} s ago ({}): restart the Manager", since, s.reason);
    default:
      return fmt::format("membership is {}", cluster::MembershipStateName(s.state));
  }
}

class MembershipLink final : public ClusterLink {
 public:
  MembershipLink(std::unique_ptr<cluster::Membership> membership, std::unique_ptr<CatalogNode> catalog,
                 std::unique_ptr<RemoteNode> remote, std::unique_ptr<transfer::UcxTransferEngine> transfer,
                 std::unique_ptr<PeerListener> peers, std::unique_ptr<PlacementDriver> placement,
                 std::shared_ptr<RegistrationHooks> hooks)
      : hooks_(std::move(hooks)),
        membership_(std::move(membership)),
        catalog_(std::move(catalog)),
        remote_(std::move(remote)),
        transfer_(std::move(transfer)),
        peers_(std::move(peers)),
        placement_(std::move(placement)) {}
  ~MembershipLink() override { Shutdown(); }

  // A peer that speaks another protocol version turns remote work off (local service continues).
  bool CanDoRemoteWork() const override {
    return membership_->CanDoRemoteWork() && (peers_ == nullptr || peers_->directory->incompatibility().empty());
  }

  std::string StatusJson() const override {
    const cluster::MembershipStatus status = membership_->GetStatus();
    return fmt::format(
        ", \"membership\": \"{}\", \"membership_epoch\": {}, \"remote_work\": {}, "
        "\"view_revision\": {}, \"members\": {}",
        cluster::MembershipStateName(status.state), status.self.epoch,
        CanDoRemoteWork() ? 1 : 0, status.view.revision, status.view.members.size()) +
           fmt::format(", \"membership_for_s\": {:.1f}, \"membership_reason\": \"{}\", "
                       "\"membership_last_cause\": \"{}\", \"membership_registrations\": {}, "
                       "\"membership_attempts\": {}, \"membership_last_error\": \"{}\", "
                       "\"cluster_runtime_uuid\": \"{}\", \"membership_off_reason\": \"{}\"",
                       static_cast<double>(status.since.count()) / 1000, JsonText(status.reason),
                       JsonText(status.last_cause), status.registrations, status.attempts,
                       JsonText(status.last_error), status.self.runtime_uuid,
                       JsonText(RemoteOffReason(*membership_))) +
           fmt::format(", \"placement_fingerprint\": \"{}\", \"catalog_replicas\": {}, "
                       "\"catalog_reduced_coverage\": {}, \"peer_listen\": \"{}\", \"peer_refused\": {}",
                       membership_->placement().fingerprint(), membership_->placement().replicas(),
                       membership_->placement().reduced_coverage() ? 1 : 0, peers_ ? peers_->address : "",
                       peers_ ? peers_->service->refused() : 0) +
           fmt::format(", \"peer_tls\": {}", peers_ != nullptr && peers_->tls ? 1 : 0) +
           fmt::format(", \"peer_refused_certificate_without_node\": {}, "
                       "\"peer_refused_certificate_of_another_node\": {}",
                       peers_ ? peers_->service->refused_certificate_without_node() : 0,
                       peers_ ? peers_->service->refused_certificate_of_another_node() : 0) +
           (peers_ ? peers_->directory->StatusJson() : std::string()) +
           (placement_ ? placement_->StatusJson()
                       : fmt::format(", \"placement_generation\": {}", membership_->placement().generation())) +
           (catalog_ ? catalog_->StatusJson() : std::string()) +
           (remote_ ? remote_->StatusJson() : std::string()) +
           (transfer_ ? fmt::format(", \"transfer_listen\": \"{}\", \"transfer_grants\": {}, "
                                    "\"transfer_grant_secret_refusals\": {}",
                                    transfer_->ListenAddress(), transfer_->Stats().live_grants,
                                    transfer_->Stats().grant_secret_refusals)
                      : std::string(", \"transfer_listen\": \"\"")) +
           EtcdSecurityJson();
  }

  // How etcd is reached (issue 53): "etcd_tls" (0: plaintext, 1: TLS verifying etcd, 2: and a client
  // certificate), "etcd_user" (empty: no user auth) and the tokens obtained so far.
  std::string EtcdSecurityJson() const {
    cluster::EtcdClient& etcd = membership_->etcd();
    return fmt::format(", \"etcd_tls\": {}, \"etcd_user\": \"{}\", \"etcd_auth_tokens\": {}",
                       etcd.tls() ? (etcd.client_certificate() ? 2 : 1) : 0, JsonText(etcd.options().user),
                       etcd.tokens_obtained());
  }

  std::vector<std::string> CatalogLines(uint32_t shard) const override {
    return catalog_ ? catalog_->CatalogLines(shard) : std::vector<std::string>();
  }
  std::vector<std::string> CatalogStatusLines() const override {
    return catalog_ ? catalog_->CatalogStatusLines() : std::vector<std::string>();
  }

  std::vector<std::string> PlacementLines() const override {
    if (placement_) return placement_->Lines();
    const cluster::Placement p = membership_->placement();
    return {fmt::format("placement generation {}: catalog nodes {}, {} copies a shard, fingerprint {}",
                        p.generation(), fmt::join(p.catalog_nodes(), ","), p.replicas(), p.fingerprint()),
            "reconciler: not run here (this Manager has no --peer-endpoint)"};
  }
  Result<std::vector<std::string>> RequestPlacement(std::string_view verb, std::string_view node) override {
    if (!placement_) {
      return Status::FailedPrecondition(
          "this Manager runs no placement reconciler (no --peer-endpoint): ask a Manager with one");
    }
    return placement_->Request(verb, node, Deadline::After(std::chrono::seconds(5)));
  }

  std::optional<LoadingStage> RemoteStage(std::vector<state::StateKey> keys) override {
    if (remote_ == nullptr || !CanDoRemoteWork()) return std::nullopt;
    return remote_->Stage(std::move(keys));
  }

  void Shutdown() override {
    hooks_->Clear();  // no registration made again restarts a part after it stopped
    if (placement_ != nullptr) placement_->Stop();  // before the channels its CatalogStatus RPCs use
    if (remote_ != nullptr) remote_->Stop();  // fetches end before the engine, the channels and the view
    if (catalog_ != nullptr) catalog_->Stop();  // the owner streams end before the channels and the view
    if (peers_ != nullptr) peers_->directory->Stop();  // stops probing before the member view goes
    if (peers_ != nullptr && peers_->server != nullptr) {
      peers_->server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    }
    membership_->Shutdown();
  }

 private:
  std::shared_ptr<RegistrationHooks> hooks_;
  std::unique_ptr<cluster::Membership> membership_;
  std::unique_ptr<CatalogNode> catalog_;  // with the peer listener; after it in destruction (the service uses it)
  // With the peer listener: its holds go after the transfer engine (nothing reads their pins any more) and the
  // service (which uses them).
  std::unique_ptr<RemoteNode> remote_;
  std::unique_ptr<transfer::UcxTransferEngine> transfer_;  // with the peer listener; before it in destruction
  std::unique_ptr<PeerListener> peers_;
  std::unique_ptr<PlacementDriver> placement_;  // first in destruction: it uses remote_'s channels
};

}  // namespace

Result<std::unique_ptr<ClusterLink>> ClusterLink::Start(const ManagerConfig& config,
                                                        const RuntimeId& runtime,
                                                        core::BlockCache* cache, core::SsdTier* ssd,
                                                        MetricsRegistry* metrics) {
  if (config.etcd_endpoints.empty()) return std::unique_ptr<ClusterLink>();
  core::ResidencyInventory* inventory = &cache->inventory();
  if (!inventory->recording()) {
    return Status::FailedPrecondition(
        "distributed mode needs a recording residency inventory (its catalog replays it); this cache was "
        "created for a single-host Manager");
  }
  const uint32_t inventory_shards = inventory->shard_count();
  if (inventory_shards != cluster::kNumShards) {
    return Status::FailedPrecondition(fmt::format(
        "distributed mode needs the residency inventory in the placement's {} shards, not {}",
        cluster::kNumShards, inventory_shards));
  }
  cluster::MembershipOptions options;
  ORBITKV_ASSIGN_OR_RETURN(options.etcd_endpoints,
                           cluster::SplitFlagList("--etcd-endpoints", config.etcd_endpoints));
  options.etcd_tls_ca = config.etcd_tls_ca;
  options.etcd_tls_cert = config.etcd_tls_cert;
  options.etcd_tls_key = config.etcd_tls_key;
  options.tls_reload_secs = config.tls_reload_secs;
  options.etcd_user = config.etcd_user;
  ORBITKV_ASSIGN_OR_RETURN(options.etcd_password, EtcdPassword(config));
  options.cluster_name = config.cluster_name;
  options.node_id = config.node_id;
  options.membership_ttl_secs = config.membership_ttl_secs;
  options.catalog_replicas = config.catalog_replicas;
  if (!config.catalog_nodes.empty()) {
    ORBITKV_ASSIGN_OR_RETURN(options.catalog_nodes,
                             cluster::SplitFlagList("--catalog-nodes", config.catalog_nodes));
  }
  options.peer_endpoint = config.peer_endpoint;
  options.runtime_uuid = runtime.ToString();
  auto hooks = std::make_shared<RegistrationHooks>();
  options.on_lapsed = [hooks](const std::string& cause) {
    MutexLock lock(&hooks->mu);
    if (hooks->lapsed) hooks->lapsed(cause);
  };
  options.on_registered = [hooks](const cluster::MemberRecord& self) {
    MutexLock lock(&hooks->mu);
    if (hooks->registered) hooks->registered(self);
  };
  ORBITKV_ASSIGN_OR_RETURN(std::unique_ptr<cluster::Membership> membership,
                           cluster::Membership::Create(std::move(options), metrics));
  Status joined = membership->Join(Deadline::After(std::chrono::seconds(30)));
  if (!joined.ok()) return joined.WithContext("joining the cluster");
  ORBITKV_LOG_INFO("manager: joined cluster '{}' as node {}", config.cluster_name, config.node_id);
  // Destroyed in reverse: the listener (its service uses the holds), the engine, then the holds and the catalog.
  std::unique_ptr<CatalogNode> catalog;
  std::unique_ptr<RemoteNode> remote;
  std::unique_ptr<transfer::UcxTransferEngine> transfer;
  std::unique_ptr<PeerListener> peers;
  std::unique_ptr<PlacementDriver> placement;
  if (!config.peer_endpoint.empty()) {
    catalog = std::make_unique<CatalogNode>(config, runtime, *membership, inventory, metrics);
    std::vector<transfer::RegionHandle> arenas;
    Result<std::unique_ptr<transfer::UcxTransferEngine>> engine =
        StartTransfer(config, runtime, cache->pool(), &arenas, metrics);
    if (!engine.ok()) {
      membership->Shutdown();
      return engine.status();
    }
    transfer = std::move(*engine);
    Result<std::shared_ptr<grpc::ChannelCredentials>> credentials = PeerClientCredentials(config);
    if (!credentials.ok()) {
      membership->Shutdown();
      return credentials.status();
    }
    remote = std::make_unique<RemoteNode>(config, *membership, cache, ssd, transfer.get(), std::move(arenas),
                                          std::move(*credentials), metrics);
    cluster::Membership* m = membership.get();
    Result<std::unique_ptr<PeerListener>> started =
        StartPeerListener(config, runtime, *membership, *transfer, catalog->store(), remote->holds(),
                          [m]() -> std::string { return RemoteOffReason(*m); });
    if (!started.ok()) {
      remote->Stop();
      membership->Shutdown();
      return started.status();
    }
    peers = std::move(*started);
    Result<std::shared_ptr<grpc::ChannelCredentials>> stream_credentials = PeerClientCredentials(config);
    Status streams = stream_credentials.status();
    if (streams.ok()) streams = catalog->StartStreams(*stream_credentials, membership->self());
    if (!streams.ok()) {
      remote->Stop();
      catalog->Stop();
      peers->server->Shutdown();
      membership->Shutdown();
      return streams.WithContext("starting the catalog streams");
    }
    PlacementDriver::Options driver;
    driver.cluster = config.cluster_name;
    driver.node_id = config.node_id;
    driver.shard_bound = std::chrono::milliseconds(config.placement_shard_bound_ms);
    driver.retire_grace = std::chrono::milliseconds(config.placement_retire_grace_ms);
    placement = std::make_unique<PlacementDriver>(std::move(driver), membership.get(), remote->progress(), metrics);
  }
  if (peers != nullptr) {
    // Issue 51: a registration that lapses ends the grants this source gave and the owner streams; one made again
    // gives every peer-facing part the new identity and streams the inventory anew as the new owner start. The UCX
    // engine, its registered pool, the engine-facing incarnation and the inventory's sequences stay.
    CatalogNode* c = catalog.get();
    RemoteNode* r = remote.get();
    PeerListener* p = peers.get();
    PlacementDriver* d = placement.get();
    const cluster::LivePlacement* live = &membership->live_placement();
    std::shared_ptr<grpc::ChannelCredentials> credentials = PeerClientCredentials(config).value();
    MutexLock lock(&hooks->mu);
    hooks->lapsed = [c, r, d](const std::string& cause) {
      d->OnLapsed();  // issue 55: leadership goes before the registration is made again
      r->OnLapsed(cause);
      c->StopStreams();
    };
    hooks->registered = [c, r, p, d, live, credentials](const cluster::MemberRecord& self) {
      d->OnRegistered(self);
      const catalog::PeerIdentity identity = PeerIdentityOf(self, *live);
      p->service->SetSelf(identity);
      p->directory->SetSelf(identity);
      r->OnRegistered(identity);
      c->StopStreams();  // none normally (the lapse stopped them): a lapse before these hooks were set
      if (Status started = c->StartStreams(credentials, self); !started.ok()) {
        ORBITKV_LOG_ERROR("manager: the catalog streams of the new registration did not start: {}",
                          started.ToString());
      }
    };
    // A lapse or fence between the join and now went unseen by the hooks: catch up (both are idempotent; the
    // supervisor may call them again once these hooks are set).
    if (membership->state() != cluster::MembershipState::kRegistered) {
      hooks->lapsed("the registration ended while the Manager was starting");
    } else if (const cluster::MemberRecord now = membership->self(); now.runtime_uuid != runtime.ToString()) {
      hooks->registered(now);
    }
  }
  if (placement != nullptr) placement->Start();
  return std::unique_ptr<ClusterLink>(
      new MembershipLink(std::move(membership), std::move(catalog), std::move(remote), std::move(transfer),
                         std::move(peers), std::move(placement), std::move(hooks)));
}

}  // namespace orbitkv::server
