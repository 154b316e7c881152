// The requester: how this Manager fetches prefixes its local tiers miss from peers (seed 000, "Query path"). It
// owns the candidate index (who held which block lately), the gRPC requester transport (Lookup, Authorize, Release
// and CatalogStatus to peers), the release queue, discovery over the catalog copies, and the RemoteFetcher that runs
// remote stages. Its figures are read when visited (VisitStats), never copied.
//
// Lifetime: it reads through the transfer engine, so it must stop (be destroyed) before the engine; the placement
// driver asks the copies through its transport, so the driver must stop before it.
//
// Thread safety: every method is safe from any thread.
#ifndef ORBITKV_SERVER_DISTRIBUTED_REQUESTER_H_
#define ORBITKV_SERVER_DISTRIBUTED_REQUESTER_H_

#include "catalog/catalog_grpc.h"  // first: it brings gRPC in

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "base/metrics.h"
#include "catalog/candidate_index.h"
#include "catalog/discovery.h"
#include "catalog/release_queue.h"
#include "cluster/live_placement.h"
#include "cluster/member_view.h"
#include "core/block_cache.h"
#include "server/config.h"
#include "server/distributed/remote_fetch.h"
#include "server/loading_registry.h"
#include "transfer/transfer_engine.h"

namespace orbitkv::server {

class Requester {
 public:
  // What the requester reaches: the member view and live placement (discovery routes by them), whether remote
  // work is allowed now, the cache it fetches into, the transfer engine and its arena regions it reads with.
  struct Parts {
    catalog::PeerIdentity self;
    const cluster::MemberView* view = nullptr;
    const cluster::LivePlacement* live = nullptr;
    std::function<bool()> can_work;
    core::BlockCache* cache = nullptr;
    transfer::TransferEngine* engine = nullptr;
    std::vector<transfer::RegionHandle> arenas;
    std::shared_ptr<grpc::ChannelCredentials> credentials;  // null: insecure channels
  };

  Requester(const ManagerConfig& config, Parts parts, MetricsRegistry* metrics);
  // Stops fetching (running fetches finish within their deadlines), then the release queue after the last release
  // was queued.
  ~Requester();
  Requester(const Requester&) = delete;
  Requester& operator=(const Requester&) = delete;

  // A new registration: requests name it, and what was learnt of peers' starts before is forgotten.
  void OnRegistered(const catalog::PeerIdentity& self);

  // The remote stage for `keys` (a chain's keys from where the local tiers stop); none while remote work is off.
  std::optional<LoadingStage> Stage(std::vector<state::StateKey> keys) { return fetcher_->Stage(std::move(keys)); }
  // The placement reconciler's CatalogStatus RPCs go through the requester's channels.
  cluster::CatalogProgress* progress() { return &transport_; }
  // What remote work has done: the fetcher's, the candidate index's, the release queue's and discovery's figures.
  void VisitStats(StatsVisitor& v) const;

 private:
  catalog::CandidateIndex index_;
  catalog::GrpcRequesterTransport transport_;
  catalog::ReleaseQueue releases_;  // over transport_
  std::unique_ptr<catalog::Discovery> discovery_;
  std::unique_ptr<RemoteFetcher> fetcher_;
  const size_t fetch_workers_;  // --remote-fetch-workers
};

}  // namespace orbitkv::server

#endif  // ORBITKV_SERVER_DISTRIBUTED_REQUESTER_H_
