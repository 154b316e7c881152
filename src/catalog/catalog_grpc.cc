#include "catalog/catalog_grpc.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "catalog/peer_service.h"

namespace orbitkv::catalog {
namespace {

void ToProto(const CatalogRecord& r, peer::v1::CatalogRecord* out) {
  const auto key = r.key.Encode();
  out->set_key(key.data(), key.size());
  out->set_tier(r.tier);
  out->set_present(r.present);
  out->set_version(r.version);
  out->set_generation(r.generation);
  out->set_bytes(r.bytes);
}

template <typename Repeated>
Result<std::vector<CatalogRecord>> FromProto(const Repeated& records) {
  std::vector<CatalogRecord> out;
  out.reserve(records.size());
  for (const peer::v1::CatalogRecord& r : records) {
    Result<state::StateKey> key = state::StateKey::Decode(
        std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(r.key().data()), r.key().size()));
    if (!key.ok()) return key.status().WithContext("a catalog record's key");
    if (r.tier() == 0 || r.tier() > 255) return Status::InvalidArgument("a catalog record's tier is out of range");
    out.push_back(
        CatalogRecord{*key, static_cast<uint8_t>(r.tier()), r.present(), r.version(), r.generation(), r.bytes()});
  }
  return out;
}

}  // namespace

peer::v1::CatalogRequest ToRequest(const CatalogMessage& message) {
  peer::v1::CatalogRequest request;
  std::visit(
      [&](const auto& m) {
        using T = std::decay_t<decltype(m)>;
        request.set_shard(m.stream.shard);
        request.set_owner_incarnation(m.stream.owner_incarnation);
        if constexpr (std::is_same_v<T, DeltaBatch>) {
          auto* d = request.mutable_delta();
          d->set_first_sequence(m.first_sequence);
          d->set_oldest_age_us(m.oldest_age_us);
          for (const CatalogRecord& r : m.records) ToProto(r, d->add_records());
        } else if constexpr (std::is_same_v<T, SnapshotBegin>) {
          auto* b = request.mutable_begin();
          b->set_snapshot_id(m.snapshot_id);
          b->set_start_watermark(m.start_watermark);
          b->set_expected_records(m.expected_records);
        } else if constexpr (std::is_same_v<T, SnapshotPage>) {
          auto* p = request.mutable_page();
          p->set_snapshot_id(m.snapshot_id);
          p->set_interval(m.interval);
          for (const CatalogRecord& r : m.records) ToProto(r, p->add_records());
        } else {
          auto* e = request.mutable_end();
          e->set_snapshot_id(m.snapshot_id);
          e->set_end_watermark(m.end_watermark);
          for (const CatalogRecord& r : m.interval) ToProto(r, e->add_interval());
        }
      },
      message);
  return request;
}

Result<CatalogMessage> FromRequest(const peer::v1::CatalogRequest& request) {
  // The owner is the route's source (CheckRoute proved it a registered member's current start); the catalog
  // start it addresses is this one (CheckRoute proved that too).
  StreamId stream{request.route().source_node_id(),
                  request.route().source_runtime_uuid(),
                  request.shard(),
                  0,
                  request.route().source_epoch(),
                  request.owner_incarnation()};
  switch (request.body_case()) {
    case peer::v1::CatalogRequest::kDelta: {
      ORBITKV_ASSIGN_OR_RETURN(std::vector<CatalogRecord> records, FromProto(request.delta().records()));
      return CatalogMessage(
          DeltaBatch{stream, request.delta().first_sequence(), std::move(records), request.delta().oldest_age_us()});
    }
    case peer::v1::CatalogRequest::kBegin:
      return CatalogMessage(SnapshotBegin{stream, request.begin().snapshot_id(), request.begin().start_watermark(),
                                          request.begin().expected_records()});
    case peer::v1::CatalogRequest::kPage: {
      ORBITKV_ASSIGN_OR_RETURN(std::vector<CatalogRecord> records, FromProto(request.page().records()));
      return CatalogMessage(
          SnapshotPage{stream, request.page().snapshot_id(), std::move(records), request.page().interval()});
    }
    case peer::v1::CatalogRequest::kEnd: {
      ORBITKV_ASSIGN_OR_RETURN(std::vector<CatalogRecord> records, FromProto(request.end().interval()));
      return CatalogMessage(
          SnapshotEnd{stream, request.end().snapshot_id(), request.end().end_watermark(), std::move(records)});
    }
    case peer::v1::CatalogRequest::BODY_NOT_SET:
      break;
  }
  return Status::InvalidArgument("a catalog request without a body");
}

peer::v1::CatalogResponse ToResponse(const CatalogReply& reply) {
  peer::v1::CatalogResponse response;
  response.set_kind(static_cast<peer::v1::CatalogResponse::Kind>(static_cast<int>(reply.kind)));
  response.set_applied_sequence(reply.applied_sequence);
  response.set_catalog_incarnation(reply.catalog_incarnation);
  response.set_reason(reply.reason);
  return response;
}

CatalogReply FromResponse(const peer::v1::CatalogResponse& response) {
  CatalogReply reply;
  const int kind = static_cast<int>(response.kind());
  reply.kind = kind >= 0 && kind <= static_cast<int>(CatalogReply::Kind::kRefused)
                   ? static_cast<CatalogReply::Kind>(kind)
                   : CatalogReply::Kind::kResync;  // an answer this version does not know: start over
  reply.applied_sequence = response.applied_sequence();
  reply.catalog_incarnation = response.catalog_incarnation();
  reply.reason = response.reason();
  return reply;
}

GrpcCatalogTransport::GrpcCatalogTransport(PeerIdentity self, const cluster::MemberView* members,
                                           std::shared_ptr<grpc::ChannelCredentials> credentials, CatalogStore* local)
    : self_(std::move(self)), members_(members), credentials_(std::move(credentials)), local_(local) {}

std::shared_ptr<peer::v1::Peer::Stub> GrpcCatalogTransport::StubFor(const std::string& endpoint) {
  MutexLock lock(&mu_);
  auto& stub = stubs_[endpoint];
  if (stub == nullptr) stub = NewPeerStub(endpoint, credentials_);
  return stub;
}

Result<CatalogReply> GrpcCatalogTransport::Deliver(const std::string& catalog_node, const CatalogMessage& message) {
  if (catalog_node == self_.node_id && local_ != nullptr) return local_->Handle(message);  // its own shards
  ORBITKV_ASSIGN_OR_RETURN(cluster::Member member, members_->Find(catalog_node));
  if (member.record.endpoint.empty()) {
    return Status::Unavailable(fmt::format("catalog host '{}' has no peer endpoint", catalog_node));
  }
  peer::v1::CatalogRequest request = ToRequest(message);
  *request.mutable_route() = MakeRoute(self_, member.record);
  bytes_sent_.fetch_add(request.ByteSizeLong(), std::memory_order_relaxed);
  peer::v1::CatalogResponse response;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  const grpc::Status status = StubFor(member.record.endpoint)->Catalog(&context, request, &response);
  if (!status.ok()) return FromGrpc(status);
  return FromResponse(response);
}

GrpcRequesterTransport::GrpcRequesterTransport(PeerIdentity self, const cluster::MemberView* members,
                                               std::shared_ptr<grpc::ChannelCredentials> credentials)
    : self_(std::move(self)), members_(members), credentials_(std::move(credentials)) {}

std::shared_ptr<peer::v1::Peer::Stub> GrpcRequesterTransport::StubFor(const std::string& endpoint) {
  MutexLock lock(&mu_);
  for (auto it = stubs_.begin(); it != stubs_.end(); ++it) {
    if (it->first == endpoint) {
      stubs_.splice(stubs_.begin(), stubs_, it);
      return stubs_.front().second;
    }
  }
  stubs_.emplace_front(endpoint, NewPeerStub(endpoint, credentials_));
  if (stubs_.size() > kMaxChannels) stubs_.pop_back();
  return stubs_.front().second;
}

Result<std::vector<LookupRow>> GrpcRequesterTransport::Lookup(const std::string& host,
                                                              std::span<const state::StateKey> keys, Deadline deadline,
                                                              CallCancel* cancel) {
  ORBITKV_ASSIGN_OR_RETURN(cluster::Member member, members_->Find(host));
  if (member.record.endpoint.empty()) {
    return Status::Unavailable(fmt::format("catalog host '{}' has no peer endpoint", host));
  }
  peer::v1::LookupRequest request;
  *request.mutable_route() = MakeRoute(self_.Get(), member.record);
  for (const state::StateKey& key : keys) {
    const auto bytes = key.Encode();
    request.add_keys(bytes.data(), bytes.size());
  }
  peer::v1::LookupResponse response;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::duration_cast<std::chrono::system_clock::duration>(deadline.Remaining()));
  std::shared_ptr<peer::v1::Peer::Stub> stub = StubFor(member.record.endpoint);
  if (cancel != nullptr && !cancel->Arm([&context] { context.TryCancel(); })) {
    return Status::Cancelled(fmt::format("lookup at '{}' cancelled", host));
  }
  lookups_.fetch_add(1, std::memory_order_relaxed);
  const grpc::Status status = stub->Lookup(&context, request, &response);
  if (cancel != nullptr) cancel->Disarm();  // before `context` goes
  if (!status.ok()) return FromGrpc(status);
  std::vector<LookupRow> rows;
  rows.reserve(static_cast<size_t>(response.rows_size()));
  for (const peer::v1::LookupRow& r : response.rows()) {
    LookupRow row;
    row.placed_here = r.placed_here();
    row.complete = r.complete();
    for (const peer::v1::LookupCandidate& c : r.candidates()) {
      if (c.tier() == 0 || c.tier() > 255) continue;  // a tier this version does not know: not a candidate
      row.candidates.push_back(Candidate{c.owner_node(), c.owner_runtime_uuid(), static_cast<uint8_t>(c.tier()),
                                         c.generation(), c.sequence(), c.bytes()});
    }
    rows.push_back(std::move(row));
  }
  return rows;
}

peer::v1::AuthorizeResponse ToResponse(const SourceGrant& grant, const std::string& ucx_address) {
  peer::v1::AuthorizeResponse response;
  response.set_outcome(static_cast<peer::v1::AuthorizeResponse::Outcome>(grant.outcome));
  response.set_granted(static_cast<uint32_t>(grant.granted));
  response.set_stop(static_cast<peer::v1::AuthorizeResponse::Outcome>(grant.stop));
  response.set_grant_id(grant.grant_id);
  response.set_grant_secret(grant.grant_secret);
  for (const auto& region : grant.regions) response.add_regions(region.data(), region.size());
  for (const SourceGrant::Block& b : grant.blocks) {
    peer::v1::GrantedBlock* block = response.add_blocks();
    block->set_region(b.region);
    block->set_offset(b.offset);
    block->set_bytes(b.bytes);
  }
  if (grant.outcome == SourceOutcome::kGranted) response.set_ucx_address(ucx_address);
  response.set_deadline_ms(static_cast<uint32_t>(grant.lifetime.count()));
  response.set_retry_after_ms(static_cast<uint32_t>(grant.retry_after.count()));
  return response;
}

Result<SourceReply> FromResponse(const peer::v1::AuthorizeResponse& response) {
  SourceReply reply;
  SourceGrant& grant = reply.grant;
  const auto outcome = [](int value) -> Result<SourceOutcome> {
    if (value < 0 || value > static_cast<int>(SourceOutcome::kMore)) {
      return Status::InvalidArgument(fmt::format("an authorization outcome {} this version does not know", value));
    }
    return static_cast<SourceOutcome>(value);
  };
  ORBITKV_ASSIGN_OR_RETURN(grant.outcome, outcome(response.outcome()));
  ORBITKV_ASSIGN_OR_RETURN(grant.stop, outcome(response.stop()));
  grant.granted = response.granted();
  grant.grant_id = response.grant_id();
  grant.grant_secret = response.grant_secret();
  grant.lifetime = std::chrono::milliseconds(response.deadline_ms());
  grant.retry_after = std::chrono::milliseconds(std::min<uint32_t>(response.retry_after_ms(), 1000));
  for (const std::string& region : response.regions()) grant.regions.emplace_back(region.begin(), region.end());
  for (const peer::v1::GrantedBlock& b : response.blocks()) {
    if (b.region() >= grant.regions.size()) {
      return Status::InvalidArgument("a granted block names a region the grant does not carry");
    }
    grant.blocks.push_back({b.region(), b.offset(), b.bytes()});
  }
  if (grant.outcome == SourceOutcome::kGranted &&
      (grant.blocks.size() != grant.granted || grant.granted == 0 || grant.grant_id == 0 ||
       grant.grant_secret.size() != kGrantSecretBytes)) {
    return Status::InvalidArgument(fmt::format("a grant of {} blocks carries {} ranges (grant id {:x})", grant.granted,
                                               grant.blocks.size(), grant.grant_id));
  }
  reply.ucx_address = response.ucx_address();
  return reply;
}

namespace {

grpc::ClientContext* WithDeadline(grpc::ClientContext* context, Deadline deadline) {
  context->set_deadline(std::chrono::system_clock::now() +
                        std::chrono::duration_cast<std::chrono::system_clock::duration>(deadline.Remaining()));
  return context;
}

// The source's member record, when it is still the start the lookup named.
Result<cluster::Member> CurrentStart(const cluster::MemberView& members, const std::string& node,
                                     const std::string& runtime) {
  ORBITKV_ASSIGN_OR_RETURN(cluster::Member member, members.Find(node));
  if (member.record.runtime_uuid != runtime) {
    return Status::NotFound(fmt::format("source '{}' restarted since the lookup (runtime {} now, {} then)", node,
                                        member.record.runtime_uuid, runtime));
  }
  if (member.record.endpoint.empty()) return Status::Unavailable(fmt::format("source '{}' has no peer endpoint", node));
  return member;
}

}  // namespace

Result<SourceReply> GrpcRequesterTransport::Authorize(const std::string& node, const std::string& runtime,
                                                      uint64_t request_id, std::span<const SourceBlockVersion> blocks,
                                                      uint64_t byte_limit, std::chrono::milliseconds lifetime,
                                                      Deadline deadline) {
  ORBITKV_ASSIGN_OR_RETURN(cluster::Member member, CurrentStart(*members_, node, runtime));
  peer::v1::AuthorizeRequest request;
  *request.mutable_route() = MakeRoute(self_.Get(), member.record);
  request.set_request_id(request_id);
  request.set_byte_limit(byte_limit);
  request.set_deadline_ms(static_cast<uint32_t>(lifetime.count()));
  for (const SourceBlockVersion& v : blocks) {
    peer::v1::AuthorizeBlock* block = request.add_blocks();
    const auto bytes = v.key.Encode();
    block->set_key(bytes.data(), bytes.size());
    block->set_generation(v.generation);
    block->set_sequence(v.sequence);
    block->set_tier(v.tier);
  }
  {
    MutexLock lock(&mu_);
    if (granted_by_.size() >= kMaxGrantOrigins) granted_by_.erase(granted_by_.begin());  // make room for one
    granted_by_[{node, runtime}] = member.record;
  }
  peer::v1::AuthorizeResponse response;
  grpc::ClientContext context;
  const grpc::Status status =
      StubFor(member.record.endpoint)->Authorize(WithDeadline(&context, deadline), request, &response);
  if (!status.ok()) return FromGrpc(status);
  return FromResponse(response);
}

Result<std::map<std::string, cluster::OwnerProgress>> GrpcRequesterTransport::ShardStatus(const std::string& node,
                                                                                          uint32_t shard,
                                                                                          int64_t generation,
                                                                                          Deadline deadline) {
  ORBITKV_ASSIGN_OR_RETURN(cluster::Member member, members_->Find(node));
  peer::v1::CatalogStatusRequest request;
  *request.mutable_route() = MakeRoute(self_.Get(), member.record);
  request.set_shard(shard);
  request.set_generation(generation);
  peer::v1::CatalogStatusResponse response;
  grpc::ClientContext context;
  const grpc::Status status =
      StubFor(member.record.endpoint)->CatalogStatus(WithDeadline(&context, deadline), request, &response);
  if (!status.ok()) return FromGrpc(status);
  std::map<std::string, cluster::OwnerProgress> owners;
  for (const peer::v1::OwnerSliceStatus& o : response.owners()) {
    owners[o.owner_node()] = cluster::OwnerProgress{o.baseline(), o.sequence(), o.owner_incarnation()};
  }
  return owners;
}

Result<bool> GrpcRequesterTransport::Release(const std::string& node, const std::string& runtime, uint64_t request_id,
                                             uint64_t grant_id, const std::string& grant_secret, Deadline deadline) {
  Result<cluster::Member> member = CurrentStart(*members_, node, runtime);
  if (!member.ok() && grant_id != 0) {
    MutexLock lock(&mu_);
    if (auto it = granted_by_.find({node, runtime}); it != granted_by_.end()) {
      member = cluster::Member{};
      member->record = it->second;
    }
  }
  if (!member.ok()) return member.status();
  peer::v1::ReleaseRequest request;
  *request.mutable_route() = MakeRoute(self_.Get(), member->record);
  request.set_request_id(request_id);
  request.set_grant_id(grant_id);
  request.set_grant_secret(grant_secret);
  peer::v1::ReleaseResponse response;
  grpc::ClientContext context;
  const grpc::Status status =
      StubFor(member->record.endpoint)->Release(WithDeadline(&context, deadline), request, &response);
  if (!status.ok()) return FromGrpc(status);
  return response.released();
}

void FollowMemberView(const cluster::MemberView* view, CatalogStore::Options* options) {
  options->owner_registration = [view](const std::string& node) -> std::optional<CatalogStore::OwnerRegistration> {
    Result<cluster::Member> member = view->Find(node);
    if (member.status().code() == StatusCode::kUnavailable) return std::nullopt;  // view incomplete: unknown
    if (!member.ok()) return CatalogStore::OwnerRegistration{};                   // no member now
    return CatalogStore::OwnerRegistration{member->record.runtime_uuid, member->record.epoch,
                                           member->record.incarnation};
  };
  // A shard is complete only when every live member's owner stream has a baseline in it. The store reads the members
  // again only when the view's generation moved.
  options->live_owners_generation = [view] { return view->generation(); };
  options->live_owners = [view]() -> std::optional<std::vector<std::pair<std::string, std::string>>> {
    const cluster::MemberView::Snapshot snapshot = view->Read();
    if (!snapshot.complete) return std::nullopt;
    std::vector<std::pair<std::string, std::string>> owners;
    for (const cluster::Member& m : snapshot.members) owners.emplace_back(m.record.node_id, m.record.runtime_uuid);
    return owners;
  };
}

}  // namespace orbitkv::catalog
