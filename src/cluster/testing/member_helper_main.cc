// Test helper: one Manager's membership in its own process, so tests can kill -9 a member.
//
//   orbitkv_cluster_member_helper ENDPOINTS CLUSTER NODE TTL_SECS CATALOG_NODES PEER_ENDPOINT
//
// Prints "joined <epoch> <uuid>" (or "error <status>") on stdout, then runs until stdin reaches
// EOF, shuts down gracefully (revoking the lease) and prints "stopped".
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "base/metrics.h"
#include "cluster/membership.h"

int main(int argc, char** argv) {
  using namespace orbitkv;
  using namespace orbitkv::cluster;
  if (argc != 7) {
    std::fprintf(stderr, "usage: %s ENDPOINTS CLUSTER NODE TTL_SECS CATALOG_NODES PEER_ENDPOINT\n", argv[0]);
    return 2;
  }
  MembershipOptions options;
  Result<std::vector<std::string>> endpoints = SplitFlagList("--etcd-endpoints", argv[1]);
  Result<std::vector<std::string>> catalog = SplitFlagList("--catalog-nodes", argv[5]);
  if (!endpoints.ok() || !catalog.ok()) {
    std::printf("error bad lists\n");
    return 2;
  }
  options.etcd_endpoints = *endpoints;
  options.cluster_name = argv[2];
  options.node_id = argv[3];
  options.membership_ttl_secs = std::atoll(argv[4]);
  options.catalog_nodes = *catalog;
  options.peer_endpoint = argv[6];
  MetricsRegistry metrics;
  Result<std::unique_ptr<Membership>> membership = Membership::Create(options, &metrics);
  Status joined =
      membership.ok() ? (*membership)->Join(Deadline::After(std::chrono::seconds(20))) : membership.status();
  if (!joined.ok()) {
    std::printf("error %s\n", joined.ToString().c_str());
    std::fflush(stdout);
    return 1;
  }
  std::printf("joined %lld %s\n", static_cast<long long>((*membership)->self().epoch),
              (*membership)->self().runtime_uuid.c_str());
  std::fflush(stdout);
  char buf[64];
  while (read(STDIN_FILENO, buf, sizeof(buf)) > 0) {
  }
  (*membership)->Shutdown();
  std::printf("stopped\n");
  std::fflush(stdout);
  return 0;
}
