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
#include "catalog/route.h"

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
  Result<CatalogReply> Deliver(const std::string& catalog_node, const CatalogMessage& message) override
      EXCLUDES(mu_);
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

// Discovery's LookupTransport over Peer.Lookup: to the catalog host's current start as the member view names it.
class GrpcLookupTransport final : public LookupTransport {
 public:
  GrpcLookupTransport(PeerIdentity self, const cluster::MemberView* members,
                      std::shared_ptr<grpc::ChannelCredentials> credentials);
  Result<std::vector<LookupRow>> Lookup(const std::string& host, std::span<const state::StateKey> keys,
                                        Deadline deadline) override;

 private:
  std::shared_ptr<peer::v1::Peer::Stub> StubFor(const std::string& endpoint) EXCLUDES(mu_);

  const PeerIdentity self_;
  const cluster::MemberView* const members_;
  const std::shared_ptr<grpc::ChannelCredentials> credentials_;
  Mutex mu_;
  // Peer channels, at most kMaxChannels (the least recently used one goes first).
  static constexpr size_t kMaxChannels = 64;
  std::list<std::pair<std::string, std::shared_ptr<peer::v1::Peer::Stub>>> stubs_ GUARDED_BY(mu_);
};

}  // namespace orbitkv::catalog

#endif  // ORBITKV_CATALOG_CATALOG_GRPC_H_
