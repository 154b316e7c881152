// The distributed flags of a ManagerConfig, checked and turned into what the wing's parts take: the membership's
// options, the peer TLS files and credentials, the transfer listener's ports and the etcd password. Each error
// names the flag at fault and how to fix it.
//
// Thread safety: pure functions (they read files named by the config).
#ifndef ORBITKV_SERVER_DISTRIBUTED_NODE_CONFIG_H_
#define ORBITKV_SERVER_DISTRIBUTED_NODE_CONFIG_H_

#include "cluster/grpc.h"  // first: it brings gRPC in

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "base/result.h"
#include "base/runtime_id.h"
#include "cluster/membership.h"
#include "cluster/tls_files.h"
#include "server/config.h"

namespace orbitkv::server {

// --peer-tls-cert/key/ca: all three, or none (null).
Result<std::optional<cluster::TlsFiles>> PeerTlsFiles(const ManagerConfig& config);

// The peer listener's side of mutual TLS, or null (no TLS files: an unauthenticated listener). The certificate must
// name this Manager's Node ID as a subjectAltName URI, or every peer would refuse it.
Result<std::shared_ptr<grpc::ServerCredentials>> PeerServerCredentials(const ManagerConfig& config);

// This Manager's client side of mutual TLS (the same three files), or null (insecure channels) without them.
Result<std::shared_ptr<grpc::ChannelCredentials>> PeerClientCredentials(const ManagerConfig& config);

// --transfer-listen HOST[:PORT[-PORT]]; without it the --peer-endpoint's host and any port (0-0).
struct TransferListen {
  std::string host;
  uint32_t first_port = 0;
  uint32_t last_port = 0;
};
Result<TransferListen> ParseTransferListen(const ManagerConfig& config);

// The password of --etcd-user, the first line of --etcd-password-file ("" without --etcd-user).
Result<std::string> EtcdPassword(const ManagerConfig& config);

// The membership's options from the --etcd-*, --cluster-name, --node-id, --catalog-* and --peer-endpoint flags,
// registering `runtime`. The hooks (on_lapsed, on_registered) are left for the caller.
Result<cluster::MembershipOptions> MembershipOptionsOf(const ManagerConfig& config, const RuntimeId& runtime);

}  // namespace orbitkv::server

#endif  // ORBITKV_SERVER_DISTRIBUTED_NODE_CONFIG_H_
