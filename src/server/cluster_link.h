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
#ifndef ORBITKV_SERVER_CLUSTER_LINK_H_
#define ORBITKV_SERVER_CLUSTER_LINK_H_

#include <memory>
#include <string>
#include <vector>

#include "base/metrics.h"
#include "base/result.h"
#include "base/runtime_id.h"
#include "core/inventory.h"
#include "server/config.h"

namespace orbitkv::server {

class ClusterLink {
 public:
  // Joins the cluster the config names (within 30 s); null without --etcd-endpoints.
  // FailedPrecondition when the build has no cluster module but --etcd-endpoints is set.
  // `runtime` is the Manager's identity, written into its member record; `inventory_shards` the
  // residency inventory's shard count must be the placement's (FailedPrecondition otherwise:
  // catalog shards and inventory shards are the same thing).
  // `pool_arenas` are the DRAM pool's arenas (base, bytes): with --peer-endpoint the link starts
  // the UCX transfer engine and registers them, so peers can read blocks inside grants. They must
  // outlive the link.
  struct Arena {
    uint8_t* base = nullptr;
    uint64_t bytes = 0;
  };
  // `inventory` is the residency inventory the owner streams replay (it must outlive the link).
  static Result<std::unique_ptr<ClusterLink>> Start(const ManagerConfig& config,
                                                    const RuntimeId& runtime,
                                                    core::ResidencyInventory* inventory,
                                                    const std::vector<Arena>& pool_arenas,
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
  // Leaves the cluster (revokes the lease: peers see this Manager leave at once).
  virtual void Shutdown() = 0;
};

}  // namespace orbitkv::server

#endif  // ORBITKV_SERVER_CLUSTER_LINK_H_
