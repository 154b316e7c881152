// Test-only: certificates made with the openssl CLI for the TLS tests (etcd over TLS, peer mutual TLS).
//
// MakeTestCertificates(dir, ips) writes, as PEM files in `dir`:
//   ca.pem/.key            the test CA
//   server.pem/.key        signed by it, subjectAltName = every IP of `ips` (CN=server)
//   client.pem/.key        signed by it, the same SANs (CN=client)
//   rogue-ca.pem, rogue.pem/.key   another CA and a certificate it signed (naming node-r)
//   expired.pem/.key       signed by ca.pem with `openssl ca`, valid 2020-01-01 .. 2020-01-02 only
// MakeNodeCertificate(dir, node, ips) writes node-<node>.pem/.key: a Manager's peer certificate, signed by ca.pem,
// naming the node as subjectAltName URI:orbitkv-node:<node> beside the IPs (issue 52).
// ReissueCertificate(dir, name, cn, ips, uris) signs a new <name>.pem/.key with ca.pem and swaps it in by rename
// (what an operator's rotation does), so a reader never sees a half-written file.
#ifndef ORBITKV_CLUSTER_TESTING_TEST_CERTS_H_
#define ORBITKV_CLUSTER_TESTING_TEST_CERTS_H_

#include <string>
#include <vector>

#include "base/result.h"

namespace orbitkv::cluster::testing {

Status MakeTestCertificates(const std::string& dir, const std::vector<std::string>& ips = {"127.0.0.1"});
Status MakeNodeCertificate(const std::string& dir, const std::string& node,
                           const std::vector<std::string>& ips = {"127.0.0.1"});
Status ReissueCertificate(const std::string& dir, const std::string& name, const std::string& cn,
                          const std::vector<std::string>& ips = {"127.0.0.1"},
                          const std::vector<std::string>& uris = {});
// The subject CN of the certificate a TLS server at host:port presents (openssl s_client), or an error.
Result<std::string> PresentedCommonName(const std::string& host_port, const std::string& cert_dir);

}  // namespace orbitkv::cluster::testing

#endif  // ORBITKV_CLUSTER_TESTING_TEST_CERTS_H_
