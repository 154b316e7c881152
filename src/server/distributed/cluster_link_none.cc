// ClusterLink in a build without the cluster module: single-host only, and --etcd-endpoints is a
// clear error naming the build option.
#include "server/distributed/cluster_link.h"

namespace orbitkv::server {

Result<std::unique_ptr<ClusterLink>> ClusterLink::Start(const ManagerConfig& config, const RuntimeId& /*runtime*/,
                                                        core::BlockCache* /*cache*/, core::SsdTier* /*ssd*/,
                                                        MetricsRegistry* /*metrics*/) {
  if (config.etcd_endpoints.empty()) return std::unique_ptr<ClusterLink>();
  return Status::FailedPrecondition(
      "--etcd-endpoints needs the cluster and transfer modules, which this build lacks (configure "
      "with -DORBITKV_WITH_ETCD=ON and -DORBITKV_WITH_UCX=ON, gRPC and UCX installed)");
}

}  // namespace orbitkv::server
