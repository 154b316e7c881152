// PeerService: the receiving half of orbitkv.peer.v1 in a distributed Manager. Every method checks the route
// header first (CheckRoute) and answers a refusal with the gRPC status of the same meaning: Health (who this start
// is: node, runtime UUID, epoch, incarnation, UCX worker address, capabilities), the catalog stream and Lookup on
// catalog hosts, and Authorize/Release on every source (SourceHolds).
#ifndef ORBITKV_CATALOG_PEER_SERVICE_H_
#define ORBITKV_CATALOG_PEER_SERVICE_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "catalog/catalog_store.h"
#include "catalog/peer_grpc.h"
#include "catalog/route.h"
#include "catalog/source_holds.h"

namespace orbitkv::catalog {

// The gRPC status of an OrbitKV status (same code, same message, the reason as a serialized ErrorDetail in the
// error details), and back (a reason this side does not know is dropped).
grpc::Status ToGrpc(const Status& status);
Status FromGrpc(const grpc::Status& status);
// A stub for the peer at `endpoint` with the protocol's message limits (insecure when `credentials` is null).
std::shared_ptr<peer::v1::Peer::Stub> NewPeerStub(const std::string& endpoint,
                                                  const std::shared_ptr<grpc::ChannelCredentials>& credentials);

class PeerService final : public peer::v1::Peer::Service {
 public:
  struct Options {
    PeerIdentity self;
    uint64_t incarnation = 0;
    std::string ucx_worker_address;  // empty: no UCX engine
    std::vector<std::string> capabilities;
    // The catalog shards placed on this Manager are kept here (null: it hosts none).
    CatalogStore* catalog = nullptr;
    std::function<bool(uint32_t shard)> hosts_shard;
    // Whether this Manager serves the copies of placement generation `generation` now (CatalogStatus answers about
    // those only: the committed generation, and the next one while a change is in progress). Null: generation 1.
    std::function<bool(int64_t generation)> serves_generation;
    // The source side of remote fetches (null: this Manager grants nothing).
    SourceHolds* source = nullptr;
    // Why remote work is off here now (empty: it is on). New grants are refused while it is off; releases are not.
    std::function<std::string()> remote_off;
    // Peer mutual TLS is on: every request's claimed source node must be named by the caller's
    // certificate, as a subjectAltName URI "orbitkv-node:<node-id>" (kNodeUriPrefix).
    bool require_node_certificates = false;
    // Called with the caller's node for every admitted request but Health (a peer that streams to, looks up at,
    // authorizes from or releases at this Manager is one it talks to: the peer directory probes it).
    std::function<void(const std::string& node)> on_admitted;
  };
  PeerService(Options options, const cluster::MemberView* members);

  grpc::Status Health(grpc::ServerContext* context, const peer::v1::HealthRequest* request,
                      peer::v1::HealthResponse* response) override;
  // Who holds the request's keys, row by row (INVALID_ARGUMENT past kMaxLookupKeys or kMaxLookupKeyBytes, or
  // for a key that does not decode).
  grpc::Status Lookup(grpc::ServerContext* context, const peer::v1::LookupRequest* request,
                      peer::v1::LookupResponse* response) override;
  // Pins the exact versions named and grants reads of them (the requester is the route's source).
  // FAILED_PRECONDITION while remote work is off here, RESOURCE_EXHAUSTED past the budgets, INVALID_ARGUMENT for a
  // malformed request.
  grpc::Status Authorize(grpc::ServerContext* context, const peer::v1::AuthorizeRequest* request,
                         peer::v1::AuthorizeResponse* response) override;
  // Ends a grant of the route's source (idempotent): by request id from the granted start, or by grant id alone
  // (CheckReleaseRoute: neither side's member view is needed).
  grpc::Status Release(grpc::ServerContext* context, const peer::v1::ReleaseRequest* request,
                       peer::v1::ReleaseResponse* response) override;
  // One message of an owner's stream for a shard placed here (FAILED_PRECONDITION for another shard).
  grpc::Status Catalog(grpc::ServerContext* context, const peer::v1::CatalogRequest* request,
                       peer::v1::CatalogResponse* response) override;
  // What the copy of a shard placed here holds, owner by owner (FAILED_PRECONDITION for another shard or a
  // placement generation this Manager does not serve now).
  grpc::Status CatalogStatus(grpc::ServerContext* context, const peer::v1::CatalogStatusRequest* request,
                             peer::v1::CatalogStatusResponse* response) override;

  // This Manager's identity changed (it registered again): requests must address the new start.
  void SetSelf(PeerIdentity self) { self_.Set(std::move(self)); }
  PeerIdentity self() const { return self_.Get(); }

  // Requests refused, for status and metrics: in all, and by the caller's certificate (one naming no node; one
  // naming other nodes than the request claims).
  uint64_t refused() const { return refused_.load(std::memory_order_relaxed); }
  uint64_t refused_certificate_without_node() const { return refused_no_node_.load(std::memory_order_relaxed); }
  uint64_t refused_certificate_of_another_node() const { return refused_other_node_.load(std::memory_order_relaxed); }

 private:
  // The checks every method runs first: the caller's certificate names the route's source node (with peer TLS),
  // then the route check; a refusal is counted.
  Status Admit(grpc::ServerContext* context, const peer::v1::RouteHeader& route);
  Status CheckCaller(grpc::ServerContext* context, const peer::v1::RouteHeader& route);

  const Options options_;  // options_.self is the first identity; self_ the current one
  SelfIdentity self_;
  const cluster::MemberView* const members_;
  std::atomic<uint64_t> refused_{0};
  std::atomic<uint64_t> refused_no_node_{0};
  std::atomic<uint64_t> refused_other_node_{0};
};

// The subjectAltName URI prefix that names a Manager's Node ID in its peer certificate.
inline constexpr std::string_view kNodeUriPrefix = "orbitkv-node:";

// The Node IDs a peer certificate names (its "orbitkv-node:" URIs), from gRPC's auth context properties.
std::vector<std::string> CertifiedNodes(const grpc::AuthContext& auth);

}  // namespace orbitkv::catalog

#endif  // ORBITKV_CATALOG_PEER_SERVICE_H_
