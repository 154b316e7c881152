// The parts of a distributed Manager, declared in the order they start, so that they stop in the reverse order by
// themselves, after a clean shutdown and after a failed start alike: each part stops its own threads in its
// destructor, and a part that was not started is null. The order is the rule:
//   - the membership goes last (its destructor revokes the lease: peers see this Manager leave at once), after
//     every part that reads its member view or live placement;
//   - the catalog host's store and the source's holds outlive the peer listener, whose service uses them;
//   - the source's holds outlive the transfer engine (nothing reads their pins once it is gone), while its upkeep,
//     which revokes grants through the engine, stops before it;
//   - the requester, which reads through the engine, stops before it;
//   - the placement driver, which asks the copies through the requester's channels, stops before the requester;
//   - the registration hooks are cleared first, so that no registration made again restarts a part that stops,
//     after the metrics collector (it reads every part).
// A part that is started later than its place (the source after the engine: it grants through it) is still
// declared in its place.
//
// Thread safety: the parts are; the struct is built by one thread (ClusterLink::Start) and destroyed by one.
#ifndef ORBITKV_SERVER_DISTRIBUTED_NODE_PARTS_H_
#define ORBITKV_SERVER_DISTRIBUTED_NODE_PARTS_H_

#include "server/distributed/peer_listener.h"  // first: it brings gRPC in

#include <memory>
#include <string>

#include "base/metrics.h"
#include "base/stats_visitor.h"
#include "cluster/membership.h"
#include "server/distributed/catalog_host.h"
#include "server/distributed/placement_driver.h"
#include "server/distributed/registration_hooks.h"
#include "server/distributed/requester.h"
#include "server/distributed/source.h"
#include "transfer/ucx_engine.h"

namespace orbitkv::server {

struct NodeParts {
  std::shared_ptr<RegistrationHooks> hooks = std::make_shared<RegistrationHooks>();
  std::unique_ptr<cluster::Membership> membership;
  // With --peer-endpoint only: a Manager without one is a member that neither serves nor fetches.
  std::unique_ptr<CatalogHost> catalog;
  std::unique_ptr<Source> source;
  std::unique_ptr<transfer::UcxTransferEngine> transfer;
  std::unique_ptr<SourceUpkeep> source_upkeep;
  std::unique_ptr<PeerListener> peers;
  std::unique_ptr<Requester> requester;
  std::unique_ptr<PlacementDriver> placement_driver;
  RegistrationHooks::ClearOnExit clear_hooks{hooks};
  // The metrics endpoint's collector over VisitStats: removed first, before anything it reads.
  std::unique_ptr<MetricsRegistry::CollectorHandle> metrics_collector;

  // Whether remote work is allowed now: registered with a complete member view, and no peer speaking another
  // protocol version.
  bool CanDoRemoteWork() const;
  // Every distributed figure, once, from the part that keeps it (the membership must be there).
  void VisitStats(StatsVisitor& v) const;
  // The parts whose figures name orbitkv_* metrics (what a scrape reads): the placement driver, the catalog host, the
  // requester and the source. The membership's own figures, the peers' and etcd's are stats JSON only.
  void VisitExported(StatsVisitor& v) const;
};

// The distributed fields of `orbitkv stats --json` (", \"membership\": ..."), from every part started.
std::string NodeStatusJson(const NodeParts& parts);

}  // namespace orbitkv::server

#endif  // ORBITKV_SERVER_DISTRIBUTED_NODE_PARTS_H_
