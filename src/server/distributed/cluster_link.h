// ClusterLink: the Manager's optional distributed-mode component, the one seam for the cluster
// module.
//
// In distributed mode (--etcd-endpoints) the Manager joins the cluster in etcd (leased membership,
// member view, catalog placement; docs/cluster.md); cache operations read the link without any etcd
// call. Start returns null in single-host mode. Later parts (the peer listener, the catalog, remote
// Loading stages) attach here. cluster_link_etcd.cc implements it when the module is built,
// cluster_link_none.cc when it is not: no source holds an `#if` on it.
//
// Thread safety: every method is safe from any thread.
#ifndef ORBITKV_SERVER_DISTRIBUTED_CLUSTER_LINK_H_
#define ORBITKV_SERVER_DISTRIBUTED_CLUSTER_LINK_H_

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/metrics.h"
#include "base/result.h"
#include "base/runtime_id.h"
#include "core/block_cache.h"
#include "core/ssd_tier.h"
#include "server/config.h"
#include "server/loading_registry.h"

namespace orbitkv::server {

class ClusterLink {
 public:
  // Joins the cluster the config names (within 30 s); null without --etcd-endpoints.
  // FailedPrecondition when the build has no cluster module but --etcd-endpoints is set.
  // `runtime` is the Manager's identity, written into its member record; `inventory_shards` the
  // residency inventory's shard count must be the placement's (FailedPrecondition otherwise:
  // catalog shards and inventory shards are the same thing).
  // `cache` (it must outlive the link): its residency inventory is what the owner streams replay;
  // with --peer-endpoint the link starts the UCX transfer engine and registers the pool's arenas,
  // so peers can read blocks inside grants (the source side pins them under the transfer budget),
  // and fetches remote blocks into the pool (RemoteStage).
  static Result<std::unique_ptr<ClusterLink>> Start(const ManagerConfig& config, const RuntimeId& runtime,
                                                    core::BlockCache* cache, core::SsdTier* ssd,
                                                    MetricsRegistry* metrics);
  virtual ~ClusterLink() = default;

  // Whether remote work is allowed now (registered, member view complete).
  virtual bool CanDoRemoteWork() const = 0;
  // ", \"membership\": ..." fields for `orbitkv stats`.
  virtual std::string StatusJson() const = 0;
  // The catalog evidence held here for `shard`, one line per record ("OWNER KEYHEX TIER VERSION
  // GENERATION BYTES", by owner then key), and one line per shard placed here ("SHARD OWNERS
  // RECORDS BYTES complete|incomplete LAG_MS LAST_REPAIR_S"); empty when this Manager hosts none.
  virtual std::vector<std::string> CatalogLines(uint32_t shard) const = 0;
  virtual std::vector<std::string> CatalogStatusLines() const = 0;
  // `orbitkv catalog placement`: the placement, the reconciler and any change in progress.
  virtual std::vector<std::string> PlacementLines() const = 0;
  // `orbitkv catalog placement --add/--remove NODE`: asks for a change (placement_driver.h); what was asked.
  virtual Result<std::vector<std::string>> RequestPlacement(std::string_view verb, std::string_view node) = 0;
  // The remote stage of a Loading operation for `keys` (a chain's keys from where the local tiers
  // stop): none while remote work is off, or without a peer endpoint.
  virtual std::optional<LoadingStage> RemoteStage(std::vector<state::StateKey> keys) = 0;
  // Leaves the cluster (revokes the lease: peers see this Manager leave at once).
  virtual void Shutdown() = 0;
};

}  // namespace orbitkv::server

#endif  // ORBITKV_SERVER_DISTRIBUTED_CLUSTER_LINK_H_
