#include "catalog/peer_service.h"

#include <utility>

#include "catalog/catalog_grpc.h"

namespace orbitkv::catalog {

grpc::Status ToGrpc(const Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(static_cast<int>(status.code())), std::string(status.message()));
}

Status FromGrpc(const grpc::Status& status) {
  if (status.ok()) return Status::Ok();
  return Status(static_cast<StatusCode>(static_cast<int>(status.error_code())), status.error_message());
}

std::shared_ptr<peer::v1::Peer::Stub> NewPeerStub(const std::string& endpoint,
                                                  const std::shared_ptr<grpc::ChannelCredentials>& credentials) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxPeerMessageBytes);
  args.SetMaxSendMessageSize(kMaxPeerMessageBytes);
  return std::shared_ptr<peer::v1::Peer::Stub>(peer::v1::Peer::NewStub(
      grpc::CreateCustomChannel(endpoint, credentials ? credentials : grpc::InsecureChannelCredentials(), args)));
}

PeerService::PeerService(Options options, const cluster::MemberView* members)
    : options_(std::move(options)), members_(members) {}

grpc::Status PeerService::Health(grpc::ServerContext* /*context*/, const peer::v1::HealthRequest* request,
                                 peer::v1::HealthResponse* response) {
  Status routed = CheckRoute(request->route(), options_.self, *members_);
  if (!routed.ok()) {
    refused_.fetch_add(1, std::memory_order_relaxed);
    return ToGrpc(routed);
  }
  response->set_protocol_version(kPeerProtocolVersion);
  response->set_node_id(options_.self.node_id);
  response->set_runtime_uuid(options_.self.runtime_uuid);
  response->set_epoch(options_.self.epoch);
  response->set_incarnation(options_.incarnation);
  response->set_ucx_worker_address(options_.ucx_worker_address);
  for (const std::string& c : options_.capabilities) response->add_capabilities(c);
  return grpc::Status::OK;
}

grpc::Status PeerService::Catalog(grpc::ServerContext* /*context*/, const peer::v1::CatalogRequest* request,
                                  peer::v1::CatalogResponse* response) {
  Status routed = CheckRoute(request->route(), options_.self, *members_);
  if (!routed.ok()) {
    refused_.fetch_add(1, std::memory_order_relaxed);
    return ToGrpc(routed);
  }
  if (options_.catalog == nullptr || !options_.hosts_shard || !options_.hosts_shard(request->shard())) {
    return ToGrpc(Status::FailedPrecondition(
        fmt::format("catalog shard {} is not placed on node '{}'", request->shard(), options_.self.node_id)));
  }
  Result<CatalogMessage> message = FromRequest(*request);
  if (!message.ok()) return ToGrpc(message.status());
  *response = ToResponse(DeliverTo(*options_.catalog, *message));
  return grpc::Status::OK;
}

}  // namespace orbitkv::catalog
