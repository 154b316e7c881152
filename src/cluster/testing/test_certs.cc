#include "cluster/testing/test_certs.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "cluster/testing/child_process.h"

namespace orbitkv::cluster::testing {
namespace {

std::string SanLine(const std::vector<std::string>& ips, const std::vector<std::string>& uris = {}) {
  std::vector<std::string> names;
  for (const std::string& ip : ips) names.push_back("IP:" + ip);
  for (const std::string& uri : uris) names.push_back("URI:" + uri);
  return fmt::format("subjectAltName={}", fmt::join(names, ","));
}

}  // namespace

Status MakeTestCertificates(const std::string& dir, const std::vector<std::string>& ips) {
  const std::string script = fmt::format(
      "set -e; cd '{0}';"
      "openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=orbitkv-test-ca -keyout ca.key -out ca.pem;"
      "openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=rogue-ca -keyout rogue-ca.key -out rogue-ca.pem;"
      "printf '{1}\\n' > san.ext;"
      "for who in server client; do"
      "  openssl req -newkey rsa:2048 -nodes -subj /CN=$who -keyout $who.key -out $who.csr;"
      "  openssl x509 -req -in $who.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 -extfile san.ext"
      "    -out $who.pem;"
      "done;"
      "openssl req -newkey rsa:2048 -nodes -subj /CN=rogue -keyout rogue.key -out rogue.csr;"
      "printf '{2}\\n' > san-rogue.ext;"
      "openssl x509 -req -in rogue.csr -CA rogue-ca.pem -CAkey rogue-ca.key -CAcreateserial -days 2"
      "  -extfile san-rogue.ext -out rogue.pem;"
      // An expired client certificate: `openssl ca` takes an end date in the past.
      "mkdir -p ca.db; : > ca.db/index.txt; echo 01 > ca.db/serial;"
      "printf '[ca]\\ndefault_ca=test\\n[test]\\ndatabase=./ca.db/index.txt\\nnew_certs_dir=./ca.db\\n"
      "serial=./ca.db/serial\\ndefault_md=sha256\\npolicy=any\\n[any]\\ncommonName=supplied\\n' > ca.cnf;"
      "openssl req -newkey rsa:2048 -nodes -subj /CN=expired -keyout expired.key -out expired.csr;"
      "openssl ca -batch -config ca.cnf -cert ca.pem -keyfile ca.key -startdate 20200101000000Z"
      "  -enddate 20200102000000Z -extfile san.ext -in expired.csr -out expired.pem",
      dir, SanLine(ips), SanLine(ips, {"orbitkv-node:node-r"}));
  return RunShell(script, "openssl").status();
}

Status MakeNodeCertificate(const std::string& dir, const std::string& node, const std::vector<std::string>& ips) {
  return ReissueCertificate(dir, "node-" + node, node, ips, {"orbitkv-node:" + node});
}

Status ReissueCertificate(const std::string& dir, const std::string& name, const std::string& cn,
                          const std::vector<std::string>& ips, const std::vector<std::string>& uris) {
  const std::string script = fmt::format(
      "set -e; cd '{0}'; printf '{3}\\n' > san-{1}.ext;"
      "openssl req -newkey rsa:2048 -nodes -subj /CN={2} -keyout {1}.key.new -out {1}.csr.new;"
      "openssl x509 -req -in {1}.csr.new -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 -extfile san-{1}.ext"
      "  -out {1}.pem.new;"
      "mv {1}.key.new {1}.key; mv {1}.pem.new {1}.pem",
      dir, name, cn, SanLine(ips, uris));
  return RunShell(script, "openssl").status();
}

Result<std::string> PresentedCommonName(const std::string& host_port, const std::string& cert_dir) {
  ORBITKV_ASSIGN_OR_RETURN(
      std::string out,
      RunShell(fmt::format("openssl s_client -connect {0} -CAfile '{1}/ca.pem' -cert '{1}/client.pem' "
                           "-key '{1}/client.key' </dev/null 2>/dev/null | openssl x509 -noout -subject",
                           host_port, cert_dir),
               "openssl s_client"));
  const size_t cn = out.find("CN");
  if (cn == std::string::npos) return Status::NotFound(fmt::format("no certificate subject in: {}", out));
  std::string name = out.substr(cn + 2);
  while (!name.empty() && (name.front() == ' ' || name.front() == '=')) name.erase(name.begin());
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  return name;
}

}  // namespace orbitkv::cluster::testing
