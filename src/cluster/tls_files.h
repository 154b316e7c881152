// TLS credentials from PEM files that are watched: gRPC's FileWatcherCertificateProvider re-reads the
// files every `reload_secs`, so a rotated certificate, key or CA is used by every connection made afterwards,
// without a restart. Connections already open keep the certificates they were made with.
//
// Used for the Manager's connections to etcd (--etcd-tls-*) and between peers (--peer-tls-*). The files are read
// once here first, so a missing or non-PEM file is an error naming its flag at startup rather than a handshake
// that fails later.
//
// Thread safety: the functions are; the returned credentials are gRPC's (thread-safe).
#ifndef ORBITKV_CLUSTER_TLS_FILES_H_
#define ORBITKV_CLUSTER_TLS_FILES_H_

#include "cluster/grpc.h"  // first: it brings gRPC in

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "base/result.h"

namespace orbitkv::cluster {

// A CA and optionally a certificate and key, as file paths, with the flags that named them (for errors).
struct TlsFiles {
  std::string ca;
  std::string cert;
  std::string key;
  std::string ca_flag = "--tls-ca";
  std::string cert_flag = "--tls-cert";
  std::string key_flag = "--tls-key";
  // How often the files are re-read, in seconds (at least 1).
  unsigned reload_secs = 10;
};

// Reads a PEM file: NotFound or InvalidArgument naming `flag` and `path`.
Result<std::string> ReadPemFile(std::string_view flag, const std::string& path);

// Why the PEM certificate at `path` is not valid now ("expired on 2020-01-02 00:00:00 UTC", "not valid before
// ..."), or "" when it is (or cannot be read: the handshake's own error says so).
std::string CertificateValidityProblem(const std::string& path);

// The URI subjectAltNames of the PEM certificate at `path` (empty when it has none or cannot be read).
std::vector<std::string> CertificateUris(const std::string& path);

// Checks that files.ca is given and readable PEM, and that cert and key are both given or both absent (and PEM).
Status ValidateTlsFiles(const TlsFiles& files);

// Client credentials: the server's certificate must chain to files.ca and name the host the channel targets;
// with cert and key the client presents that certificate.
Result<std::shared_ptr<grpc::ChannelCredentials>> WatchedChannelCredentials(const TlsFiles& files);

// Server credentials presenting cert/key (both required) and requiring a client certificate that chains to ca.
Result<std::shared_ptr<grpc::ServerCredentials>> WatchedServerCredentials(const TlsFiles& files);

}  // namespace orbitkv::cluster

#endif  // ORBITKV_CLUSTER_TLS_FILES_H_
