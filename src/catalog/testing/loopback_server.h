// Test and bench helper: a gRPC server on a free loopback port (insecure, the peer message limits) serving the
// given services, as a Manager's peer listener would serve them. Header-only, so that every test and bench target
// that already links gRPC can use it.
#ifndef ORBITKV_CATALOG_TESTING_LOOPBACK_SERVER_H_
#define ORBITKV_CATALOG_TESTING_LOOPBACK_SERVER_H_

#include <fmt/format.h>

#include <initializer_list>
#include <memory>
#include <string>

#include "catalog/peer_grpc.h"
#include "catalog/route.h"

namespace orbitkv::catalog::testing {

struct LoopbackServer {
  std::unique_ptr<grpc::Server> server;  // null when it could not start
  int port = 0;
  std::string endpoint() const { return fmt::format("127.0.0.1:{}", port); }
};

inline LoopbackServer StartLoopbackServer(std::initializer_list<grpc::Service*> services) {
  LoopbackServer out;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &out.port);
  builder.SetMaxReceiveMessageSize(kMaxPeerMessageBytes);
  builder.SetMaxSendMessageSize(kMaxPeerMessageBytes);
  for (grpc::Service* service : services) builder.RegisterService(service);
  out.server = builder.BuildAndStart();
  return out;
}

}  // namespace orbitkv::catalog::testing

#endif  // ORBITKV_CATALOG_TESTING_LOOPBACK_SERVER_H_
