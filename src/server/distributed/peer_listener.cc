#include "server/distributed/peer_listener.h"

#include <chrono>
#include <utility>

#include "base/logging.h"
#include "cluster/placement.h"
#include "fmt/format.h"
#include "server/distributed/node_config.h"

namespace orbitkv::server {

Result<std::unique_ptr<PeerListener>> PeerListener::Start(const ManagerConfig& config, Parts parts) {
  ORBITKV_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> tls, PeerServerCredentials(config));
  std::unique_ptr<PeerListener> listener(new PeerListener());
  listener->address_ = config.peer_listen.empty() ? config.peer_endpoint : config.peer_listen;
  catalog::PeerService::Options options;
  options.self = parts.self;
  options.incarnation = parts.incarnation;
  options.ucx_worker_address = parts.ucx_worker_address;
  options.capabilities = {"health",         "transfer.am",    "transfer.grants",
                          "catalog.stream", "catalog.lookup", "source.authorize"};
  options.catalog = parts.catalog;
  options.source = parts.source;
  options.remote_off = std::move(parts.remote_off);
  options.require_node_certificates = tls != nullptr;  // a peer is who its certificate says
  const cluster::LivePlacement* live = parts.live;
  options.serves_generation = [live](int64_t generation) { return live->Get()->Serves(generation); };
  options.hosts_shard = [live, node = config.node_id](uint32_t shard) {
    return shard < cluster::kNumShards && live->Get()->Hosts(shard, node);
  };
  catalog::PeerDirectory::Options directory;
  directory.self = std::move(parts.self);
  directory.credentials = std::move(parts.credentials);
  // Probed: the catalog hosts of the committed placement and of a change in progress, and the peers whose requests
  // reached this Manager lately; never the whole fleet.
  directory.always_probe = [live] {
    const std::shared_ptr<const cluster::LivePlacement::State> state = live->Get();
    std::vector<std::string> nodes = state->committed.catalog_nodes();
    if (state->next.has_value()) {
      for (const std::string& node : state->next->catalog_nodes()) nodes.push_back(node);
    }
    return nodes;
  };
  listener->directory_ = std::make_unique<catalog::PeerDirectory>(std::move(directory), parts.view);
  options.on_admitted = [directory = listener->directory_.get()](const std::string& node) { directory->Use(node); };
  listener->service_ = std::make_unique<catalog::PeerService>(std::move(options), parts.view);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(listener->address_, tls ? tls : grpc::InsecureServerCredentials(), &listener->port_);
  builder.SetMaxReceiveMessageSize(catalog::kMaxPeerMessageBytes);
  // Peers ping while a call waits (catalog::NewPeerStub): accept pings that often instead of answering GOAWAY.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, catalog::kPeerKeepaliveTimeMs / 2);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  builder.SetMaxSendMessageSize(catalog::kMaxPeerMessageBytes);
  builder.RegisterService(listener->service_.get());
  listener->tls_ = tls != nullptr;
  listener->server_ = builder.BuildAndStart();
  if (listener->server_ == nullptr || listener->port_ == 0) {
    return Status::Unavailable(
        fmt::format("cannot listen for peers on {} (--peer-listen / --peer-endpoint): "
                    "the address is in use or not this host's",
                    listener->address_));
  }
  if (tls) {
    ORBITKV_LOG_INFO(
        "manager: peer listener on {} (mutual TLS: peers need a certificate from {} naming their "
        "Node ID as subjectAltName URI:{}<node-id>)",
        listener->address_, config.peer_tls_ca, catalog::kNodeUriPrefix);
  } else {
    ORBITKV_LOG_WARN(
        "manager: peer listener on {} serves orbitkv.peer.v1 without TLS: peers are not authenticated beyond "
        "the route check against the member view (give --peer-tls-cert, --peer-tls-key and --peer-tls-ca)",
        listener->address_);
  }
  listener->directory_->Start();
  return listener;
}

PeerListener::~PeerListener() {
  if (directory_) directory_->Stop();  // stops probing before the member view goes
  if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
}

void PeerListener::SetSelf(const catalog::PeerIdentity& self) {
  service_->SetSelf(self);
  directory_->SetSelf(self);
}

}  // namespace orbitkv::server
