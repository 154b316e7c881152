// EtcdProcess and EtcdCluster (test-only): real etcd servers (Debian's etcd-server) on free
// loopback ports, each with its own temp data dir, stopped by PID and cleaned up by the destructor
// even when a test fails.
//
// Thread safety: one owner thread.
#ifndef ORBITKV_CLUSTER_TESTING_ETCD_PROCESS_H_
#define ORBITKV_CLUSTER_TESTING_ETCD_PROCESS_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "base/clock.h"
#include "base/result.h"
#include "cluster/etcd_client.h"
#include "cluster/testing/child_process.h"

namespace orbitkv::cluster::testing {

// Path of the etcd binary found at configure time, or empty when there was none.
std::string EtcdBinary();

// A loopback TCP port that was free a moment ago.
Result<int> PickFreePort();

class EtcdProcess {
 public:
  struct Member {
    std::string name;
    int client_port = 0;
    int peer_port = 0;
  };

  // Starts a single-member etcd and waits until it serves requests; with `also_on` (an address of
  // this host, e.g. on a test bridge) it serves clients there too, on the same port.
  static Result<std::unique_ptr<EtcdProcess>> StartSingle(Deadline deadline, std::string also_on = "");

  // A single-member etcd serving clients over TLS (https://) with the certificates of a TestCertificates
  // directory (server.pem/key, ca.pem; with `client_cert_auth` it requires a client certificate from ca.pem),
  // and `extra_flags` (e.g. --auth-token-ttl). Readiness is probed with the client certificate.
  static Result<std::unique_ptr<EtcdProcess>> StartTls(const std::string& cert_dir, bool client_cert_auth,
                                                       Deadline deadline, std::vector<std::string> extra_flags = {});

  // Client options reaching this etcd (TLS files when it serves TLS; plus `user`/`password` once set with
  // SetClientAuth, also used by readiness probes after a relaunch).
  EtcdClientOptions ClientOptions() const;
  void SetClientAuth(std::string user, std::string password);
  // What docs/cluster.md tells an operator to do: a root user, `user` with a role that may read and write keys
  // under `prefix`, `auth enable`; then SetClientAuth(user, password).
  Status EnableAuth(const std::string& user, const std::string& password, const std::string& prefix = "/orbitkv/");
  // etcdctl against this member with ClientOptions' TLS files and, if set, user (e.g. {"auth", "enable"}); the
  // output, or an error with it.
  Result<std::string> Etcdctl(const std::vector<std::string>& args) const;

  ~EtcdProcess();
  EtcdProcess(const EtcdProcess&) = delete;
  EtcdProcess& operator=(const EtcdProcess&) = delete;

  std::string endpoint() const;                            // "127.0.0.1:<client port>"
  std::string endpoint_on(const std::string& host) const;  // "<host>:<client port>"
  const Member& member() const { return member_; }
  bool running() const { return process_.running(); }

  // SIGTERM and wait for exit.
  Status Stop();
  // SIGKILL and reap.
  void Kill() { process_.Kill(); }
  // Starts again with the same name, ports and data dir (after Stop or Kill), without waiting for
  // health.
  Status Launch();
  // Waits until the member answers a linearizable read.
  Status WaitReady(Deadline deadline);
  // The tail of etcd's log, for failure messages.
  std::string LogTail() const;

 private:
  friend class EtcdCluster;
  EtcdProcess(Member member, std::string initial_cluster, std::string token, std::string dir);
  // A single member on fresh ports, `configure`d before its first launch, ready.
  static Result<std::unique_ptr<EtcdProcess>> StartConfigured(Deadline deadline,
                                                              const std::function<void(EtcdProcess&)>& configure);

  Member member_;
  std::string initial_cluster_;
  std::string token_;                     // --initial-cluster-token, shared by the members of one cluster.
  std::string dir_;                       // Temp dir holding data/ and etcd.log; removed by the destructor.
  std::string also_on_;                   // A second client address (StartSingle's also_on).
  std::vector<std::string> extra_flags_;  // More etcd flags (EtcdCluster::Start's).
  std::string tls_dir_;                   // StartTls's certificates (empty: plaintext)
  bool client_cert_auth_ = false;
  std::string user_;
  std::string password_;
  bool launched_before_ = false;
  // The cluster ID this member answered with when first ready: a relaunched member must answer with
  // it too (anything else is another etcd on its port).
  uint64_t cluster_id_ = 0;
  ChildProcess process_;
};

// A multi-member etcd cluster on loopback (and, with `also_on`, serving clients on that address of this host
// too, e.g. on a test bridge the network namespaces reach). `extra_flags` go to every member (e.g. raft timings
// scaled to a test's short lease TTL).
class EtcdCluster {
 public:
  static Result<std::unique_ptr<EtcdCluster>> Start(int members, Deadline deadline, std::string also_on = "",
                                                    std::vector<std::string> extra_flags = {});

  std::vector<std::string> endpoints() const;
  std::vector<std::string> endpoints_on(const std::string& host) const;
  EtcdProcess& member(size_t i) { return *members_[i]; }
  size_t size() const { return members_.size(); }
  // Index of the current raft leader, asked of every running member.
  Result<size_t> LeaderIndex(Deadline deadline);

 private:
  std::vector<std::unique_ptr<EtcdProcess>> members_;
};

}  // namespace orbitkv::cluster::testing

#endif  // ORBITKV_CLUSTER_TESTING_ETCD_PROCESS_H_
