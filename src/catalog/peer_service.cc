#include "catalog/peer_service.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <utility>

#include "fmt/ranges.h"

#include "catalog/catalog_grpc.h"
#include "cluster/placement.h"

namespace orbitkv::catalog {

grpc::Status ToGrpc(const Status& status) {
  if (status.ok()) return grpc::Status::OK;
  const auto code = static_cast<grpc::StatusCode>(static_cast<int>(status.code()));
  if (status.reason() == StatusReason::kNone) return grpc::Status(code, std::string(status.message()));
  peer::v1::ErrorDetail detail;
  detail.set_reason(static_cast<peer::v1::ErrorDetail::Reason>(static_cast<int>(status.reason())));
  return grpc::Status(code, std::string(status.message()), detail.SerializeAsString());
}

Status FromGrpc(const grpc::Status& status) {
  if (status.ok()) return Status::Ok();
  Status out(static_cast<StatusCode>(static_cast<int>(status.error_code())), status.error_message());
  peer::v1::ErrorDetail detail;
  if (!status.error_details().empty() && detail.ParseFromString(status.error_details()) &&
      static_cast<int>(detail.reason()) <= kMaxStatusReason) {
    out = out.WithReason(static_cast<StatusReason>(detail.reason()));
  }
  return out;
}

std::shared_ptr<peer::v1::Peer::Stub> NewPeerStub(const std::string& endpoint,
                                                  const std::shared_ptr<grpc::ChannelCredentials>& credentials) {
  grpc::ChannelArguments args;
  // A peer that started a moment after this stub was made, or restarted, is reachable within a
  // second (gRPC's defaults: 1 s, then up to 2 minutes).
  cluster::SetReconnectPolicy(&args);
  // A peer whose connection is up but which answers nothing (a hung process, a half-open connection) is found by
  // HTTP/2 keepalive pings while a call waits on it, not only by each call's deadline (issue 84). Pings only while
  // calls are outstanding: an idle channel costs nothing. The peer listener accepts them (peer_listener.cc).
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, kPeerKeepaliveTimeMs);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kPeerKeepaliveTimeoutMs);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 0);
  args.SetMaxReceiveMessageSize(kMaxPeerMessageBytes);
  args.SetMaxSendMessageSize(kMaxPeerMessageBytes);
  return std::shared_ptr<peer::v1::Peer::Stub>(peer::v1::Peer::NewStub(
      grpc::CreateCustomChannel(endpoint, credentials ? credentials : grpc::InsecureChannelCredentials(), args)));
}

PeerService::PeerService(Options options, const cluster::MemberView* members)
    : options_(std::move(options)), self_(options_.self), members_(members) {}

std::vector<std::string> CertifiedNodes(const grpc::AuthContext& auth) {
  std::vector<std::string> nodes;
  // gRPC lists URI SANs as "peer_uri" and, depending on its version, also among "x509_subject_alternative_name".
  for (const char* property : {GRPC_PEER_URI_PROPERTY_NAME, GRPC_X509_SAN_PROPERTY_NAME}) {
    for (const grpc::string_ref& value : auth.FindPropertyValues(property)) {
      const std::string_view text(value.data(), value.size());
      if (!text.starts_with(kNodeUriPrefix)) continue;
      std::string node(text.substr(kNodeUriPrefix.size()));
      if (std::find(nodes.begin(), nodes.end(), node) == nodes.end()) nodes.push_back(std::move(node));
    }
  }
  return nodes;
}

Status PeerService::CheckCaller(grpc::ServerContext* context, const peer::v1::RouteHeader& route) {
  if (!options_.require_node_certificates) return Status::Ok();
  const std::shared_ptr<const grpc::AuthContext> auth = context->auth_context();
  const std::vector<std::string> nodes = auth ? CertifiedNodes(*auth) : std::vector<std::string>();
  if (nodes.empty()) {
    refused_no_node_.fetch_add(1, std::memory_order_relaxed);
    return Status::PermissionDenied(fmt::format(
        "node '{}' refuses a peer whose certificate names no node: with peer TLS each Manager's certificate must "
        "carry its Node ID as a subjectAltName URI (openssl: subjectAltName=URI:{}<node-id>,IP:<address>; "
        "docs/cluster.md)",
        self_.Get().node_id, kNodeUriPrefix));
  }
  if (std::find(nodes.begin(), nodes.end(), route.source_node_id()) == nodes.end()) {
    refused_other_node_.fetch_add(1, std::memory_order_relaxed);
    return Status::PermissionDenied(fmt::format(
        "node '{}' refuses a request claiming to come from node '{}' over a certificate of node{} '{}'",
        self_.Get().node_id, route.source_node_id(), nodes.size() == 1 ? "" : "s", fmt::join(nodes, "', '")));
  }
  return Status::Ok();
}

Status PeerService::Admit(grpc::ServerContext* context, const peer::v1::RouteHeader& route) {
  Status checked = CheckCaller(context, route);
  if (checked.ok()) checked = CheckRoute(route, self_.Get(), *members_);
  if (!checked.ok()) {
    refused_.fetch_add(1, std::memory_order_relaxed);
  } else if (options_.on_admitted) {
    options_.on_admitted(route.source_node_id());
  }
  return checked;
}

grpc::Status PeerService::Health(grpc::ServerContext* context, const peer::v1::HealthRequest* request,
                                 peer::v1::HealthResponse* response) {
  Status routed = CheckCaller(context, request->route());
  if (routed.ok()) routed = CheckRoute(request->route(), self_.Get(), *members_);
  if (!routed.ok()) {
    refused_.fetch_add(1, std::memory_order_relaxed);
    return ToGrpc(routed);
  }
  response->set_protocol_version(kPeerProtocolVersion);
  const PeerIdentity self = self_.Get();
  response->set_node_id(self.node_id);
  response->set_runtime_uuid(self.runtime_uuid);
  response->set_epoch(self.epoch);
  response->set_incarnation(options_.incarnation);
  response->set_ucx_worker_address(options_.ucx_worker_address);
  for (const std::string& c : options_.capabilities) response->add_capabilities(c);
  return grpc::Status::OK;
}

grpc::Status PeerService::Catalog(grpc::ServerContext* context, const peer::v1::CatalogRequest* request,
                                  peer::v1::CatalogResponse* response) {
  if (Status routed = Admit(context, request->route()); !routed.ok()) return ToGrpc(routed);
  if (options_.catalog == nullptr || !options_.hosts_shard || !options_.hosts_shard(request->shard())) {
    return ToGrpc(Status::FailedPrecondition(
        fmt::format("catalog shard {} is not placed on node '{}'", request->shard(), self_.Get().node_id)));
  }
  Result<CatalogMessage> message = FromRequest(*request);
  if (!message.ok()) return ToGrpc(message.status());
  *response = ToResponse(options_.catalog->Handle(*message));
  return grpc::Status::OK;
}

grpc::Status PeerService::CatalogStatus(grpc::ServerContext* context, const peer::v1::CatalogStatusRequest* request,
                                        peer::v1::CatalogStatusResponse* response) {
  if (Status routed = Admit(context, request->route()); !routed.ok()) return ToGrpc(routed);
  const uint32_t shard = request->shard();
  if (options_.catalog == nullptr || !options_.hosts_shard || shard >= cluster::kNumShards ||
      !options_.hosts_shard(shard)) {
    return ToGrpc(Status::FailedPrecondition(
        fmt::format("catalog shard {} is not placed on node '{}'", shard, self_.Get().node_id)));
  }
  const bool serves =
      options_.serves_generation ? options_.serves_generation(request->generation()) : request->generation() == 1;
  if (!serves) {
    return ToGrpc(Status::FailedPrecondition(fmt::format("node '{}' does not serve placement generation {} now",
                                                         self_.Get().node_id, request->generation())));
  }
  for (const CatalogStore::OwnerSlice& slice : options_.catalog->Slices(shard)) {
    peer::v1::OwnerSliceStatus* owner = response->add_owners();
    owner->set_owner_node(slice.owner_node);
    owner->set_owner_runtime_uuid(slice.owner_runtime);
    owner->set_baseline(slice.baseline);
    owner->set_sequence(slice.applied);
    owner->set_owner_incarnation(slice.owner_incarnation);
  }
  response->set_complete(options_.catalog->Complete(shard));
  return grpc::Status::OK;
}

grpc::Status PeerService::Lookup(grpc::ServerContext* context, const peer::v1::LookupRequest* request,
                                 peer::v1::LookupResponse* response) {
  if (Status routed = Admit(context, request->route()); !routed.ok()) return ToGrpc(routed);
  size_t key_bytes = 0;
  for (const std::string& key : request->keys()) key_bytes += key.size();
  if (request->keys_size() > kMaxLookupKeys || key_bytes > kMaxLookupKeyBytes) {
    return ToGrpc(
        Status::InvalidArgument(fmt::format("a lookup of {} keys in {} bytes (at most {} keys and {} bytes a request)",
                                            request->keys_size(), key_bytes, kMaxLookupKeys, kMaxLookupKeyBytes)));
  }
  std::map<uint32_t, bool> complete_by_shard;
  for (const std::string& bytes : request->keys()) {
    Result<state::StateKey> key =
        state::StateKey::Decode(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()));
    if (!key.ok()) return ToGrpc(key.status().WithContext("a lookup key"));
    peer::v1::LookupRow* row = response->add_rows();
    const uint32_t shard = state::ShardOf(*key, cluster::kNumShards);
    const bool here = options_.catalog != nullptr && options_.hosts_shard && options_.hosts_shard(shard);
    row->set_placed_here(here);
    if (!here) continue;
    // Completeness once per shard of the request (it reads the member view), not once per key.
    auto known = complete_by_shard.find(shard);
    if (known == complete_by_shard.end()) {
      known = complete_by_shard.emplace(shard, options_.catalog->Complete(shard)).first;
    }
    const bool complete = known->second;
    for (const CatalogStore::Holder& h :
         options_.catalog->Lookup(shard, *key, nullptr, request->route().source_node_id())) {
      peer::v1::LookupCandidate* c = row->add_candidates();
      c->set_owner_node(h.owner_node);
      c->set_owner_runtime_uuid(h.owner_runtime);
      c->set_tier(h.record.tier);
      c->set_generation(h.record.generation);
      c->set_sequence(h.record.version);
      c->set_bytes(h.record.bytes);
    }
    row->set_complete(complete);
  }
  return grpc::Status::OK;
}

grpc::Status PeerService::Authorize(grpc::ServerContext* context, const peer::v1::AuthorizeRequest* request,
                                    peer::v1::AuthorizeResponse* response) {
  if (Status routed = Admit(context, request->route()); !routed.ok()) return ToGrpc(routed);
  if (options_.source == nullptr) {
    return ToGrpc(
        Status::FailedPrecondition(fmt::format("node '{}' serves no transfers (no UCX engine)", self_.Get().node_id)));
  }
  if (options_.remote_off) {
    if (std::string why = options_.remote_off(); !why.empty()) {
      return ToGrpc(Status::FailedPrecondition(
          fmt::format("remote work is off on node '{}' ({}): no new grants", self_.Get().node_id, why)));
    }
  }
  AuthorizeArgs args;
  args.peer_node = request->route().source_node_id();
  args.peer_runtime = request->route().source_runtime_uuid();
  args.request_id = request->request_id();
  args.byte_limit = request->byte_limit();
  args.lifetime = std::chrono::milliseconds(request->deadline_ms() == 0 ? 10000 : request->deadline_ms());
  // A pending answer held back at the source still reaches the requester inside its RPC deadline: a
  // quarter of what is left stays for the way back.
  if (const auto left = context->deadline() - std::chrono::system_clock::now(); left < std::chrono::hours(1)) {
    args.answer_by = MonoNow() + std::chrono::duration_cast<MonoClock::duration>(left * 3 / 4);
  }
  args.blocks.reserve(static_cast<size_t>(request->blocks_size()));
  for (const peer::v1::AuthorizeBlock& block : request->blocks()) {
    Result<state::StateKey> key = state::StateKey::Decode(
        std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(block.key().data()), block.key().size()));
    if (!key.ok()) return ToGrpc(key.status().WithContext("an authorization's key"));
    const uint32_t tier = block.tier() == 0 ? kSourceDram : block.tier();
    if (tier != kSourceDram && tier != kSourceSsd) {
      return ToGrpc(Status::InvalidArgument(fmt::format("an authorization names tier {} (1 DRAM, 2 SSD)", tier)));
    }
    args.blocks.push_back({*key, block.generation(), block.sequence(), static_cast<uint8_t>(tier)});
  }
  Result<SourceGrant> grant = options_.source->Authorize(args);
  if (!grant.ok()) return ToGrpc(grant.status());
  if ((grant->outcome == SourceOutcome::kGranted || grant->outcome == SourceOutcome::kPending) &&
      context->IsCancelled()) {
    // The requester gave up before it could hear of the grant: it never reads under it.
    options_.source->Release(args.peer_runtime, args.request_id);
    return grpc::Status(grpc::StatusCode::CANCELLED, "the requester cancelled the authorization");
  }
  *response = ToResponse(*grant, options_.ucx_worker_address);
  return grpc::Status::OK;
}

grpc::Status PeerService::Release(grpc::ServerContext* context, const peer::v1::ReleaseRequest* request,
                                  peer::v1::ReleaseResponse* response) {
  if (request->grant_id() != 0) {
    Status routed = CheckCaller(context, request->route());
    if (routed.ok()) routed = CheckReleaseRoute(request->route(), self_.Get());
    if (!routed.ok()) {
      refused_.fetch_add(1, std::memory_order_relaxed);
      return ToGrpc(routed);
    }
    response->set_released(
        options_.source != nullptr &&
        options_.source->ReleaseGrant(request->route().source_node_id(), request->grant_id(), request->grant_secret()));
    return grpc::Status::OK;
  }
  if (Status routed = Admit(context, request->route()); !routed.ok()) return ToGrpc(routed);
  response->set_released(options_.source != nullptr &&
                         options_.source->Release(request->route().source_runtime_uuid(), request->request_id()));
  return grpc::Status::OK;
}

}  // namespace orbitkv::catalog
