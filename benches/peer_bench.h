// Helpers of the benchmarks that run Managers' peer services in one process: a member record for a hand-installed
// member view, and a PeerService on a loopback gRPC server.
#ifndef ORBITKV_BENCHES_PEER_BENCH_H_
#define ORBITKV_BENCHES_PEER_BENCH_H_

#include "catalog/peer_service.h"  // first of the gRPC users (cluster/grpc.h)

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

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
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(catalog::kMaxPeerMessageBytes);
  builder.SetMaxSendMessageSize(catalog::kMaxPeerMessageBytes);
  builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    std::fprintf(stderr, "bench: no loopback port for a peer server\n");
    std::exit(1);
  }
  *endpoint = "127.0.0.1:" + std::to_string(port);
  return server;
}

}  // namespace orbitkv::bench

#endif  // ORBITKV_BENCHES_PEER_BENCH_H_
