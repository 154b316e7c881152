// ClusterLink in a build with the cluster module: it only wires the distributed parts (node_parts.h) together.
// Each part is started in turn into its declared place; a start that fails returns, and the parts started so far
// stop in their declared order as the NodeParts goes.
#include "server/distributed/node_parts.h"  // first: it brings gRPC in

#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "base/logging.h"
#include "cluster/placement.h"
#include "fmt/format.h"
#include "fmt/ranges.h"
#include "server/distributed/cluster_link.h"
#include "server/distributed/node_config.h"
#include "server/distributed/node_identity.h"
#include "server/distributed/transfer_start.h"

namespace orbitkv::server {
namespace {

class DistributedLink final : public ClusterLink {
 public:
  explicit DistributedLink(std::unique_ptr<NodeParts> parts) : parts_(std::move(parts)) {}

  bool CanDoRemoteWork() const override { return parts_ != nullptr && parts_->CanDoRemoteWork(); }

  std::string StatusJson() const override {
    if (parts_ == nullptr) return ", \"membership\": \"stopped\", \"remote_work\": 0";
    return NodeStatusJson(*parts_);
  }

  std::vector<std::string> CatalogLines(uint32_t shard) const override {
    return parts_ != nullptr && parts_->catalog ? parts_->catalog->CatalogLines(shard) : std::vector<std::string>();
  }
  std::vector<std::string> CatalogStatusLines() const override {
    return parts_ != nullptr && parts_->catalog ? parts_->catalog->CatalogStatusLines() : std::vector<std::string>();
  }

  std::vector<std::string> PlacementLines() const override {
    if (parts_ == nullptr) return {"this Manager left the cluster"};
    if (parts_->placement_driver) return parts_->placement_driver->Lines();
    const cluster::Placement p = parts_->membership->placement();
    return {fmt::format("placement generation {}: catalog nodes {}, {} copies a shard, fingerprint {}", p.generation(),
                        fmt::join(p.catalog_nodes(), ","), p.replicas(), p.fingerprint()),
            "reconciler: not run here (this Manager has no --peer-endpoint)"};
  }
  Result<std::vector<std::string>> RequestPlacement(std::string_view verb, std::string_view node) override {
    if (parts_ == nullptr || !parts_->placement_driver) {
      return Status::FailedPrecondition(
          "this Manager runs no placement reconciler (no --peer-endpoint): ask a Manager with one");
    }
    return parts_->placement_driver->Request(verb, node, Deadline::After(std::chrono::seconds(5)));
  }

  std::optional<LoadingStage> RemoteStage(std::vector<state::StateKey> keys) override {
    if (parts_ == nullptr || parts_->requester == nullptr || !CanDoRemoteWork()) return std::nullopt;
    return parts_->requester->Stage(std::move(keys));
  }

  void Shutdown() override { parts_.reset(); }

 private:
  std::unique_ptr<NodeParts> parts_;  // null once shut down
};

// The peer-facing parts of a Manager with --peer-endpoint, started into `parts` (which holds the joined membership).
Status StartPeerParts(const ManagerConfig& config, const RuntimeId& runtime, core::BlockCache* cache,
                      core::SsdTier* ssd, MetricsRegistry* metrics, NodeParts& parts) {
  cluster::Membership* membership = parts.membership.get();
  const cluster::MemberView* view = &membership->view();
  const cluster::LivePlacement* live = &membership->live_placement();
  parts.catalog = std::make_unique<CatalogHost>(
      CatalogHost::Options{
          .node_id = config.node_id, .incarnation = runtime.incarnation(), .budget_bytes = config.catalog_budget_bytes},
      view, live, &cache->inventory());
  std::vector<transfer::RegionHandle> arenas;
  ORBITKV_ASSIGN_OR_RETURN(parts.transfer, StartTransferEngine(config, runtime, cache->pool(), &arenas, metrics));
  parts.source = std::make_unique<Source>(config, cache, ssd, parts.transfer.get(), arenas, metrics);
  parts.source_upkeep = std::make_unique<SourceUpkeep>(parts.source->holds(), view);
  ORBITKV_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials, PeerClientCredentials(config));
  const catalog::PeerIdentity identity = PeerIdentityOf(membership->self(), *live);
  ORBITKV_ASSIGN_OR_RETURN(
      parts.peers, PeerListener::Start(
                       config, PeerListener::Parts{.self = identity,
                                                   .incarnation = runtime.incarnation(),
                                                   .ucx_worker_address = parts.transfer->ListenAddress(),
                                                   .view = view,
                                                   .live = live,
                                                   .catalog = parts.catalog->store(),
                                                   .source = parts.source->holds(),
                                                   .remote_off = [membership] { return RemoteOffReason(*membership); },
                                                   .credentials = credentials}));
  parts.requester =
      std::make_unique<Requester>(config,
                                  Requester::Parts{.self = identity,
                                                   .view = view,
                                                   .live = live,
                                                   .can_work = [membership] { return membership->CanDoRemoteWork(); },
                                                   .cache = cache,
                                                   .engine = parts.transfer.get(),
                                                   .arenas = std::move(arenas),
                                                   .credentials = credentials},
                                  metrics);
  if (Status streams = parts.catalog->StartStreams(credentials, membership->self()); !streams.ok()) {
    return streams.WithContext("starting the catalog streams");
  }
  PlacementDriver::Options driver;
  driver.cluster = config.cluster_name;
  driver.node_id = config.node_id;
  driver.shard_bound = std::chrono::milliseconds(config.placement_shard_bound_ms);
  driver.retire_grace = std::chrono::milliseconds(config.placement_retire_grace_ms);
  parts.placement_driver =
      std::make_unique<PlacementDriver>(std::move(driver), membership, parts.requester->progress());

  // A registration that lapses ends the grants this source gave and pauses the owner streams; one made again gives
  // every peer-facing part the new identity, and the owner streams continue where they were: the inventory, its
  // incarnation (the owner's start) and its sequences stay, so the catalog keeps the slices (issue 69). The UCX
  // engine, its registered pool and the engine-facing incarnation stay too.
  CatalogHost* catalog = parts.catalog.get();
  Source* source = parts.source.get();
  Requester* requester = parts.requester.get();
  PeerListener* peers = parts.peers.get();
  PlacementDriver* placement = parts.placement_driver.get();
  parts.hooks->Set(
      [catalog, source, placement](const std::string& cause) {
        placement->OnLapsed();  // leadership goes before the registration is made again
        source->OnLapsed(cause);
        catalog->PauseStreams();
      },
      [catalog, source, requester, peers, placement, live, credentials](const cluster::MemberRecord& self) {
        placement->OnRegistered(self);
        const catalog::PeerIdentity registered = PeerIdentityOf(self, *live);
        peers->SetSelf(registered);
        requester->OnRegistered(registered);
        source->OnRegistered();
        catalog->PauseStreams();  // none running normally (the lapse paused them): a lapse before the hooks were set
        if (Status started = catalog->StartStreams(credentials, self); !started.ok()) {
          ORBITKV_LOG_ERROR("manager: the catalog streams of the new registration did not start: {}",
                            started.ToString());
        }
      });
  // A lapse or fence between the join and now went unseen by the hooks: catch up (both are idempotent; the
  // supervisor may call them again now that they are set).
  if (membership->state() != cluster::MembershipState::kRegistered) {
    parts.hooks->Lapsed("the registration ended while the Manager was starting");
  } else if (const cluster::MemberRecord now = membership->self(); now.runtime_uuid != runtime.ToString()) {
    parts.hooks->Registered(now);
  }
  parts.placement_driver->Start();
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<ClusterLink>> ClusterLink::Start(const ManagerConfig& config, const RuntimeId& runtime,
                                                        core::BlockCache* cache, core::SsdTier* ssd,
                                                        MetricsRegistry* metrics) {
  if (config.etcd_endpoints.empty()) return std::unique_ptr<ClusterLink>();
  core::ResidencyInventory* inventory = &cache->inventory();
  if (!inventory->recording()) {
    return Status::FailedPrecondition(
        "distributed mode needs a recording residency inventory (its catalog replays it); this cache was "
        "created for a single-host Manager");
  }
  if (const uint32_t shards = inventory->shard_count(); shards != cluster::kNumShards) {
    return Status::FailedPrecondition(
        fmt::format("distributed mode needs the residency inventory in the placement's {} shards, not {}",
                    cluster::kNumShards, shards));
  }
  ORBITKV_ASSIGN_OR_RETURN(cluster::MembershipOptions options, MembershipOptionsOf(config, runtime));
  auto parts = std::make_unique<NodeParts>();
  options.on_lapsed = [hooks = parts->hooks](const std::string& cause) { hooks->Lapsed(cause); };
  options.on_registered = [hooks = parts->hooks](const cluster::MemberRecord& self) { hooks->Registered(self); };
  ORBITKV_ASSIGN_OR_RETURN(parts->membership, cluster::Membership::Create(std::move(options), metrics));
  if (Status joined = parts->membership->Join(Deadline::After(std::chrono::seconds(30))); !joined.ok()) {
    return joined.WithContext("joining the cluster");
  }
  ORBITKV_LOG_INFO("manager: joined cluster '{}' as node {}", config.cluster_name, config.node_id);
  if (!config.peer_endpoint.empty()) {
    ORBITKV_RETURN_IF_ERROR(StartPeerParts(config, runtime, cache, ssd, metrics, *parts));
  }
  parts->metrics_collector = metrics->AddCollector([node = parts.get()](StatsVisitor& v) { node->VisitExported(v); });
  return std::unique_ptr<ClusterLink>(new DistributedLink(std::move(parts)));
}

}  // namespace orbitkv::server
