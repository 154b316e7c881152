// The peer listener: this Manager's only gRPC server, serving orbitkv.peer.v1 (PeerService) on --peer-listen
// (default --peer-endpoint), with mutual TLS when the --peer-tls-* files are given, and the sending side's
// PeerDirectory (a channel to each member and its Health). The service answers lookups from the catalog host's store
// and authorizations from the source's holds, so both must outlive the listener.
//
// Lifetime: Start binds and starts serving and probing; the destructor stops probing first (before the member view
// goes), then shuts the server down (calls in flight get 2 s).
//
// Thread safety: every method is safe from any thread.
#ifndef ORBITKV_SERVER_DISTRIBUTED_PEER_LISTENER_H_
#define ORBITKV_SERVER_DISTRIBUTED_PEER_LISTENER_H_

#include "catalog/peer_service.h"  // first: it brings gRPC in

#include <functional>
#include <memory>
#include <string>

#include "base/result.h"
#include "catalog/catalog_store.h"
#include "catalog/peer_directory.h"
#include "catalog/source_holds.h"
#include "cluster/live_placement.h"
#include "cluster/member_view.h"
#include "server/config.h"

namespace orbitkv::server {

class PeerListener {
 public:
  // What the service serves and routes by; each must outlive the listener.
  struct Parts {
    catalog::PeerIdentity self;
    uint64_t incarnation = 0;
    std::string ucx_worker_address;  // the transfer engine's listen address
    const cluster::MemberView* view = nullptr;
    const cluster::LivePlacement* live = nullptr;
    catalog::CatalogStore* catalog = nullptr;
    catalog::SourceHolds* source = nullptr;
    std::function<std::string()> remote_off;                // why remote work is off now ("": on)
    std::shared_ptr<grpc::ChannelCredentials> credentials;  // the directory's channels' (null: insecure)
  };

  // Binds --peer-listen (Unavailable naming the flags when the address is taken or not this host's), starts serving
  // and starts probing the members. InvalidArgument for TLS files that are incomplete or name another node.
  static Result<std::unique_ptr<PeerListener>> Start(const ManagerConfig& config, Parts parts);
  ~PeerListener();
  PeerListener(const PeerListener&) = delete;
  PeerListener& operator=(const PeerListener&) = delete;

  // A new registration: the service checks routes against it and the directory's requests name it.
  void SetSelf(const catalog::PeerIdentity& self);

  const std::string& address() const { return address_; }
  // The port bound (the one chosen for a :0 address).
  int port() const { return port_; }
  bool tls() const { return tls_; }
  const catalog::PeerService& service() const { return *service_; }
  const catalog::PeerDirectory& directory() const { return *directory_; }

 private:
  PeerListener() = default;

  std::string address_;
  int port_ = 0;
  bool tls_ = false;  // mutual TLS, certificates naming their node
  std::unique_ptr<catalog::PeerService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<catalog::PeerDirectory> directory_;
};

}  // namespace orbitkv::server

#endif  // ORBITKV_SERVER_DISTRIBUTED_PEER_LISTENER_H_
