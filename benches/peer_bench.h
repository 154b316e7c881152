// Helpers of the benchmarks that run Managers' peer services in one process: a member record for a hand-installed
// member view, and a PeerService on a loopback gRPC server.
#ifndef ORBITKV_BENCHES_PEER_BENCH_H_
#define ORBITKV_BENCHES_PEER_BENCH_H_

#include "catalog/peer_service.h"  // first of the gRPC users (cluster/grpc.h)

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "base/clock.h"
#include "bench_report.h"
#include "catalog/route.h"
#include "catalog/testing/loopback_server.h"
#include "cluster/member_view.h"

namespace orbitkv::bench {

inline cluster::Member MemberOf(const std::string& node, const std::string& uuid, const std::string& endpoint) {
  cluster::Member m;
  m.record.cluster = "bench";
  m.record.node_id = node;
  m.record.epoch = 1;
  m.record.endpoint = endpoint;
  m.record.runtime_uuid = uuid;
  m.create_revision = m.mod_revision = 1;
  return m;
}

// Serves `service` on 127.0.0.1 (any port, the peer protocol's message limits); sets `endpoint`. Exits the
// benchmark when no port can be had.
inline std::unique_ptr<grpc::Server> ListenLoopback(grpc::Service* service, std::string* endpoint) {
  catalog::testing::LoopbackServer loopback = catalog::testing::StartLoopbackServer({service});
  if (loopback.server == nullptr || loopback.port == 0) {
    std::fprintf(stderr, "bench: no loopback port for a peer server\n");
    std::exit(1);
  }
  *endpoint = loopback.endpoint();
  return std::move(loopback.server);
}

// The p50 of the loopback gRPC unary round trip (Health, route check included) from `as` to `to` at `endpoint`:
// `rounds` calls after 20 of warm-up. Exits the benchmark when a call fails.
inline double HealthRoundTripP50Ms(const std::string& endpoint, const catalog::PeerIdentity& as,
                                   const cluster::MemberRecord& to, int rounds = 500) {
  auto stub = catalog::NewPeerStub(endpoint, nullptr);
  std::vector<double> ms;
  for (int i = 0; i < rounds + 20; ++i) {
    peer::v1::HealthRequest request;
    *request.mutable_route() = catalog::MakeRoute(as, to);
    peer::v1::HealthResponse response;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    const MonoTime t0 = MonoNow();
    const grpc::Status s = stub->Health(&context, request, &response);
    if (!s.ok()) {
      std::fprintf(stderr, "bench: loopback Health: %s\n", s.error_message().c_str());
      std::exit(1);
    }
    if (i >= 20) ms.push_back(std::chrono::duration<double, std::milli>(MonoNow() - t0).count());
  }
  return Percentile(ms, 0.5);
}

}  // namespace orbitkv::bench

#endif  // ORBITKV_BENCHES_PEER_BENCH_H_
