#include "server/distributed/node_config.h"

#include <algorithm>
#include <fstream>
#include <string_view>
#include <vector>

#include "catalog/peer_service.h"
#include "fmt/format.h"
#include "fmt/ranges.h"

namespace orbitkv::server {

Result<std::optional<cluster::TlsFiles>> PeerTlsFiles(const ManagerConfig& config) {
  const int given = !config.peer_tls_cert.empty() + !config.peer_tls_key.empty() + !config.peer_tls_ca.empty();
  if (given == 0) return std::optional<cluster::TlsFiles>();
  if (given != 3) {
    return Status::InvalidArgument(
        "mutual TLS between peers needs all of --peer-tls-cert, --peer-tls-key and --peer-tls-ca");
  }
  return std::optional<cluster::TlsFiles>(cluster::TlsFiles{config.peer_tls_ca, config.peer_tls_cert,
                                                            config.peer_tls_key, "--peer-tls-ca", "--peer-tls-cert",
                                                            "--peer-tls-key", config.tls_reload_secs});
}

Result<std::shared_ptr<grpc::ServerCredentials>> PeerServerCredentials(const ManagerConfig& config) {
  ORBITKV_ASSIGN_OR_RETURN(std::optional<cluster::TlsFiles> files, PeerTlsFiles(config));
  if (!files.has_value()) return std::shared_ptr<grpc::ServerCredentials>();
  // The credentials first: they check that every file is readable PEM, naming its flag.
  ORBITKV_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                           cluster::WatchedServerCredentials(*files));
  const std::string wanted = fmt::format("{}{}", catalog::kNodeUriPrefix, config.node_id);
  const std::vector<std::string> uris = cluster::CertificateUris(files->cert);
  if (std::find(uris.begin(), uris.end(), wanted) == uris.end()) {
    return Status::InvalidArgument(fmt::format(
        "--peer-tls-cert {} does not name this node: peers accept a certificate only for the Node ID it carries as "
        "a subjectAltName URI; issue it with subjectAltName=URI:{},IP:<its address> (it names {})",
        files->cert, wanted, uris.empty() ? std::string("no URI") : fmt::format("{}", fmt::join(uris, ", "))));
  }
  return credentials;
}

Result<std::shared_ptr<grpc::ChannelCredentials>> PeerClientCredentials(const ManagerConfig& config) {
  ORBITKV_ASSIGN_OR_RETURN(std::optional<cluster::TlsFiles> files, PeerTlsFiles(config));
  if (!files.has_value()) return std::shared_ptr<grpc::ChannelCredentials>();
  return cluster::WatchedChannelCredentials(*files);
}

Result<TransferListen> ParseTransferListen(const ManagerConfig& config) {
  std::string spec = config.transfer_listen;
  if (spec.empty()) spec = config.peer_endpoint.substr(0, config.peer_endpoint.rfind(':'));
  TransferListen out;
  const size_t colon = spec.rfind(':');
  out.host = spec.substr(0, colon);
  const auto bad = [&](std::string_view why) {
    return Status::InvalidArgument(fmt::format(
        "--transfer-listen '{}': {} (give HOST, HOST:PORT or HOST:FIRST-LAST, e.g. 10.0.0.5:7400-7409)", spec, why));
  };
  if (out.host.empty()) return bad("no host");
  if (colon == std::string::npos) return out;
  const std::string ports = spec.substr(colon + 1);
  const size_t dash = ports.find('-');
  const auto port = [](const std::string& text, uint32_t* value) {
    if (text.empty() || text.size() > 5 || text.find_first_not_of("0123456789") != std::string::npos) return false;
    *value = static_cast<uint32_t>(std::stoul(text));
    return *value <= 65535;
  };
  if (!port(ports.substr(0, dash), &out.first_port)) return bad("not a port");
  out.last_port = out.first_port;
  if (dash != std::string::npos && !port(ports.substr(dash + 1), &out.last_port)) return bad("not a port range");
  if (out.last_port < out.first_port || (out.first_port == 0 && out.last_port != 0)) return bad("an empty range");
  return out;
}

Result<std::string> EtcdPassword(const ManagerConfig& config) {
  if (config.etcd_user.empty()) {
    if (!config.etcd_password_file.empty()) {
      return Status::InvalidArgument("--etcd-password-file needs --etcd-user (the user whose password it holds)");
    }
    return std::string();
  }
  if (config.etcd_password_file.empty()) {
    return Status::InvalidArgument(
        "--etcd-user needs --etcd-password-file (a file holding the password; it is never taken on the command "
        "line)");
  }
  std::ifstream in(config.etcd_password_file, std::ios::binary);
  if (!in) {
    return Status::NotFound(fmt::format("--etcd-password-file {}: cannot read the file", config.etcd_password_file));
  }
  std::string password;
  std::getline(in, password);
  while (!password.empty() && (password.back() == '\r' || password.back() == ' ')) password.pop_back();
  if (password.empty()) {
    return Status::InvalidArgument(
        fmt::format("--etcd-password-file {}: the first line (the password) is empty", config.etcd_password_file));
  }
  return password;
}

Result<cluster::MembershipOptions> MembershipOptionsOf(const ManagerConfig& config, const RuntimeId& runtime) {
  cluster::MembershipOptions options;
  ORBITKV_ASSIGN_OR_RETURN(options.etcd_endpoints, cluster::SplitFlagList("--etcd-endpoints", config.etcd_endpoints));
  options.etcd_tls_ca = config.etcd_tls_ca;
  options.etcd_tls_cert = config.etcd_tls_cert;
  options.etcd_tls_key = config.etcd_tls_key;
  options.tls_reload_secs = config.tls_reload_secs;
  options.etcd_user = config.etcd_user;
  ORBITKV_ASSIGN_OR_RETURN(options.etcd_password, EtcdPassword(config));
  options.cluster_name = config.cluster_name;
  options.node_id = config.node_id;
  options.membership_ttl_secs = config.membership_ttl_secs;
  options.catalog_replicas = config.catalog_replicas;
  if (!config.catalog_nodes.empty()) {
    ORBITKV_ASSIGN_OR_RETURN(options.catalog_nodes, cluster::SplitFlagList("--catalog-nodes", config.catalog_nodes));
  }
  options.peer_endpoint = config.peer_endpoint;
  options.runtime_uuid = runtime.ToString();
  options.incarnation = runtime.incarnation();  // the inventory's (Manager::Create): the owner's start
  return options;
}

}  // namespace orbitkv::server
