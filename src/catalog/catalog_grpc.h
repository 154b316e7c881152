// The catalog stream over orbitkv.peer.v1 (`Peer.Catalog`): the conversions between the logic's messages
// (catalog_messages.h) and the protocol's, and GrpcCatalogTransport, the CatalogTransport a distributed Manager's
// owner streamers use: to another Manager through its peer endpoint (routed by the member view, over the peer
// credentials), to this Manager's own CatalogStore directly.
//
// Thread safety: GrpcCatalogTransport::Deliver is safe from any thread.
#ifndef ORBITKV_CATALOG_CATALOG_GRPC_H_
#define ORBITKV_CATALOG_CATALOG_GRPC_H_

#include <atomic>
#include <list>
#include <map>
#include <memory>
#include <string>

#include "base/mutex.h"
#include "base/thread_annotations.h"
#include "catalog/catalog_store.h"
#include "catalog/discovery.h"
#include "catalog/owner_streamer.h"
#include "catalog/peer_grpc.h"
#include "catalog/remote_plan.h"
#include "catalog/route.h"
#include "cluster/placement_reconciler.h"

namespace orbitkv::catalog {

// The request for `message` (its stream's shard; the route is the caller's).
peer::v1::CatalogRequest ToRequest(const CatalogMessage& message);
// The message a request carries, with the owner taken from the route's source; InvalidArgument for a
// request without a body or with a key that does not decode.
Result<CatalogMessage> FromRequest(const peer::v1::CatalogRequest& request);
peer::v1::CatalogResponse ToResponse(const CatalogReply& reply);
CatalogReply FromResponse(const peer::v1::CatalogResponse& response);

class GrpcCatalogTransport final : public CatalogTransport {
 public:
  // `local` (may be null) is this Manager's store, for the shards it hosts itself.
  GrpcCatalogTransport(PeerIdentity self, const cluster::MemberView* members,
                       std::shared_ptr<grpc::ChannelCredentials> credentials, CatalogStore* local);
  Result<CatalogReply> Deliver(const std::string& catalog_node, const CatalogMessage& message) override EXCLUDES(mu_);
  // Bytes of the requests sent to other Managers so far (the catalog's metadata traffic).
  uint64_t bytes_sent() const { return bytes_sent_.load(std::memory_order_relaxed); }

 private:
  std::shared_ptr<peer::v1::Peer::Stub> StubFor(const std::string& endpoint) EXCLUDES(mu_);

  const PeerIdentity self_;
  const cluster::MemberView* const members_;
  const std::shared_ptr<grpc::ChannelCredentials> credentials_;
  CatalogStore* const local_;
  Mutex mu_;
  std::map<std::string, std::shared_ptr<peer::v1::Peer::Stub>> stubs_ GUARDED_BY(mu_);
  std::atomic<uint64_t> bytes_sent_{0};
};

// The requester's side of orbitkv.peer.v1: Discovery's LookupTransport over Peer.Lookup (to the catalog host's
// current start as the member view names it) and the planner's SourceTransport over Peer.Authorize/Release (to
// the candidate's start: a source that restarted since the lookup is refused here, NotFound, without an RPC).
// Peer channels are shared, in an LRU of at most 64.
class GrpcRequesterTransport final : public LookupTransport, public SourceTransport, public cluster::CatalogProgress {
 public:
  GrpcRequesterTransport(PeerIdentity self, const cluster::MemberView* members,
                         std::shared_ptr<grpc::ChannelCredentials> credentials);
  Result<std::vector<LookupRow>> Lookup(const std::string& host, std::span<const state::StateKey> keys,
                                        Deadline deadline, CallCancel* cancel) override;
  Result<SourceReply> Authorize(const std::string& node, const std::string& runtime, uint64_t request_id,
                                std::span<const SourceBlockVersion> blocks, uint64_t byte_limit,
                                std::chrono::milliseconds lifetime, Deadline deadline) override;
  // With a grant id, a source the member view does not show now (incomplete, or it registered again) is reached
  // at the endpoint its grant came from.
  Result<bool> Release(const std::string& node, const std::string& runtime, uint64_t request_id, uint64_t grant_id,
                       const std::string& grant_secret, Deadline deadline) override;
  // What the copy of `shard` on catalog host `node` holds, owner by owner (Peer.CatalogStatus: the
  // placement reconciler's view of the copies). Unavailable when `node` is not in the member view.
  Result<std::map<std::string, cluster::OwnerProgress>> ShardStatus(const std::string& node, uint32_t shard,
                                                                    int64_t generation, Deadline deadline) override;
  // This Manager registered again: requests name its new start.
  void SetSelf(PeerIdentity self) { self_.Set(std::move(self)); }
  // Lookup RPCs sent.
  uint64_t lookups() const { return lookups_.load(std::memory_order_relaxed); }

 private:
  std::shared_ptr<peer::v1::Peer::Stub> StubFor(const std::string& endpoint) EXCLUDES(mu_);

  SelfIdentity self_;
  const cluster::MemberView* const members_;
  const std::shared_ptr<grpc::ChannelCredentials> credentials_;
  Mutex mu_;
  // The member records grants came from, by (node, runtime): where a release by grant id goes when the view does
  // not show that start any more. At most kMaxGrantOrigins (one source start each; one goes to make room).
  static constexpr size_t kMaxGrantOrigins = 1024;
  std::map<std::pair<std::string, std::string>, cluster::MemberRecord> granted_by_ GUARDED_BY(mu_);
  // Peer channels, at most kMaxChannels (the least recently used one goes first).
  static constexpr size_t kMaxChannels = 64;
  std::list<std::pair<std::string, std::shared_ptr<peer::v1::Peer::Stub>>> stubs_ GUARDED_BY(mu_);
  std::atomic<uint64_t> lookups_{0};
};

// The wire forms of an authorization.
peer::v1::AuthorizeResponse ToResponse(const SourceGrant& grant, const std::string& ucx_address);
Result<SourceReply> FromResponse(const peer::v1::AuthorizeResponse& response);

// Wires a catalog store to the member view as a catalog host does: each owner's registration (whether a stream's
// runtime is live, and which start it is) and the live owners every shard must cover to be complete; both unknown
// while the view is incomplete. `view` must outlive the store.
void FollowMemberView(const cluster::MemberView* view, CatalogStore::Options* options);

}  // namespace orbitkv::catalog

#endif  // ORBITKV_CATALOG_CATALOG_GRPC_H_
