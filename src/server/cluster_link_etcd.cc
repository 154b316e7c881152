// ClusterLink in a build with the cluster module: leased membership in etcd.
#include "base/clock.h"
#include "base/logging.h"
#include "cluster/membership.h"
#include "cluster/placement.h"
#include "server/cluster_link.h"

namespace orbitkv::server {
namespace {

class MembershipLink final : public ClusterLink {
 public:
  explicit MembershipLink(std::unique_ptr<cluster::Membership> membership)
      : membership_(std::move(membership)) {}
  ~MembershipLink() override { Shutdown(); }

  bool CanDoRemoteWork() const override { return membership_->CanDoRemoteWork(); }

  std::string StatusJson() const override {
    const cluster::MembershipStatus status = membership_->GetStatus();
    return fmt::format(
        ", \"membership\": \"{}\", \"membership_epoch\": {}, \"remote_work\": {}, "
        "\"view_revision\": {}, \"members\": {}",
        cluster::MembershipStateName(status.state), status.self.epoch,
        status.remote_work_allowed ? 1 : 0, status.view.revision, status.view.members.size());
  }

  void Shutdown() override { membership_->Shutdown(); }

 private:
  std::unique_ptr<cluster::Membership> membership_;
};

}  // namespace

Result<std::unique_ptr<ClusterLink>> ClusterLink::Start(const ManagerConfig& config,
                                                        const RuntimeId& runtime,
                                                        uint32_t inventory_shards,
                                                        MetricsRegistry* metrics) {
  if (config.etcd_endpoints.empty()) return std::unique_ptr<ClusterLink>();
  if (inventory_shards != cluster::kNumShards) {
    return Status::FailedPrecondition(fmt::format(
        "distributed mode needs the residency inventory in the placement's {} shards, not {}",
        cluster::kNumShards, inventory_shards));
  }
  cluster::MembershipOptions options;
  ORBITKV_ASSIGN_OR_RETURN(options.etcd_endpoints,
                           cluster::SplitFlagList("--etcd-endpoints", config.etcd_endpoints));
  options.cluster_name = config.cluster_name;
  options.node_id = config.node_id;
  options.membership_ttl_secs = config.membership_ttl_secs;
  if (!config.catalog_nodes.empty()) {
    ORBITKV_ASSIGN_OR_RETURN(options.catalog_nodes,
                             cluster::SplitFlagList("--catalog-nodes", config.catalog_nodes));
  }
  options.peer_endpoint = config.peer_endpoint;
  options.runtime_uuid = runtime.ToString();
  ORBITKV_ASSIGN_OR_RETURN(std::unique_ptr<cluster::Membership> membership,
                           cluster::Membership::Create(std::move(options), metrics));
  Status joined = membership->Join(Deadline::After(std::chrono::seconds(30)));
  if (!joined.ok()) return joined.WithContext("joining the cluster");
  ORBITKV_LOG_INFO("manager: joined cluster '{}' as node {}", config.cluster_name, config.node_id);
  return std::unique_ptr<ClusterLink>(new MembershipLink(std::move(membership)));
}

}  // namespace orbitkv::server
