// Test and bench helpers: a gRPC server on a free loopback port (insecure, the peer message limits) serving the
// given services, as a Manager's peer listener would serve them; and a peer that accepts calls and never answers
// them. Header-only, so that every test and bench target that already links gRPC can use them.
#ifndef ORBITKV_CATALOG_TESTING_LOOPBACK_SERVER_H_
#define ORBITKV_CATALOG_TESTING_LOOPBACK_SERVER_H_

#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <initializer_list>
#include <memory>
#include <string>
#include <thread>

#include "catalog/peer_grpc.h"
#include "catalog/route.h"

namespace orbitkv::catalog::testing {

struct LoopbackServer {
  std::unique_ptr<grpc::Server> server;  // null when it could not start
  int port = 0;
  std::string host = "127.0.0.1";
  std::string endpoint() const { return fmt::format("{}:{}", host, port); }
};

// A peer whose port accepts calls and never answers them (a hung process): Health, Catalog and CatalogStatus are
// each held until the caller gives up or the test lets them go (`released`), then answer UNAVAILABLE. `held`
// counts the calls it took.
class HoldingPeer final : public peer::v1::Peer::Service {
 public:
  grpc::Status Health(grpc::ServerContext* context, const peer::v1::HealthRequest*,
                      peer::v1::HealthResponse*) override {
    return Hold(context);
  }
  grpc::Status Catalog(grpc::ServerContext* context, const peer::v1::CatalogRequest*,
                       peer::v1::CatalogResponse*) override {
    return Hold(context);
  }
  grpc::Status CatalogStatus(grpc::ServerContext* context, const peer::v1::CatalogStatusRequest*,
                             peer::v1::CatalogStatusResponse*) override {
    return Hold(context);
  }
  std::atomic<int> held{0};
  std::atomic<bool> released{false};

 private:
  grpc::Status Hold(grpc::ServerContext* context) {
    held.fetch_add(1);
    while (!released.load() && !context->IsCancelled()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "a peer that holds every call");
  }
};

// On `host` ("127.0.0.1" unless a test needs another address, e.g. a mesh's bridge).
inline LoopbackServer StartLoopbackServer(std::initializer_list<grpc::Service*> services,
                                          const std::string& host = "127.0.0.1") {
  LoopbackServer out;
  grpc::ServerBuilder builder;
  builder.AddListeningPort(host + ":0", grpc::InsecureServerCredentials(), &out.port);
  out.host = host;
  builder.SetMaxReceiveMessageSize(kMaxPeerMessageBytes);
  builder.SetMaxSendMessageSize(kMaxPeerMessageBytes);
  for (grpc::Service* service : services) builder.RegisterService(service);
  out.server = builder.BuildAndStart();
  return out;
}

}  // namespace orbitkv::catalog::testing

#endif  // ORBITKV_CATALOG_TESTING_LOOPBACK_SERVER_H_
