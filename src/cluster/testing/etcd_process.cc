#include "cluster/testing/etcd_process.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "base/scoped_fd.h"

namespace orbitkv::cluster::testing {

std::string EtcdBinary() {
#ifdef ORBITKV_ETCD_BIN
  return ORBITKV_ETCD_BIN;
#else
  return "";
#endif
}

// A free port BELOW the kernel's ephemeral range. A port from that range (what binding port 0
// returns) can be handed to an outgoing connection while its etcd is stopped: a client retrying
// 127.0.0.1:P may then be given local port P and connect to itself (TCP self-connect), so the
// restarted etcd cannot bind P and the client talks to nobody. Ports outside the range are never
// assigned to outgoing connections.
Result<int> PickFreePort() {
  int ephemeral_low = 32768;
  if (std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range"); range) {
    int low = 0, high = 0;
    if (range >> low >> high && low > 2048) ephemeral_low = low;
  }
  constexpr int kLowest = 10000;
  thread_local std::mt19937 rng(std::random_device{}());
  for (int attempt = 0; attempt < 200 && ephemeral_low > kLowest + 1; ++attempt) {
    const int port = std::uniform_int_distribution<int>(kLowest, ephemeral_low - 1)(rng);
    ScopedFd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!fd) return ErrnoStatus("socket", errno);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    if (bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) return port;
  }
  return Status::Unavailable("no free port below the ephemeral range");
}

namespace {

Result<std::string> MakeTempDir() {
  std::string pattern = (std::filesystem::temp_directory_path() / "orbitkv-etcd-XXXXXX").string();
  if (mkdtemp(pattern.data()) == nullptr) return ErrnoStatus("mkdtemp", errno);
  return pattern;
}

// A port free now and not in `taken` (the ports already given to members of the same cluster:
// nothing holds a picked port until its etcd binds it, so the picker could repeat one), added to it.
Result<int> PickPortNotIn(std::set<int>* taken) {
  for (int attempt = 0; attempt < 100; ++attempt) {
    ORBITKV_ASSIGN_OR_RETURN(int port, PickFreePort());
    if (taken->insert(port).second) return port;
  }
  return Status::Unavailable("the port picker kept returning ports already taken");
}

Result<EtcdProcess::Member> NewMember(std::string name, std::set<int>* taken) {
  EtcdProcess::Member member;
  member.name = std::move(name);
  ORBITKV_ASSIGN_OR_RETURN(member.client_port, PickPortNotIn(taken));
  ORBITKV_ASSIGN_OR_RETURN(member.peer_port, PickPortNotIn(taken));
  return member;
}

std::string PeerUrl(const EtcdProcess::Member& m) { return fmt::format("http://127.0.0.1:{}", m.peer_port); }

}  // namespace

EtcdProcess::EtcdProcess(Member member, std::string initial_cluster, std::string token, std::string dir)
    : member_(std::move(member)),
      initial_cluster_(std::move(initial_cluster)),
      token_(std::move(token)),
      dir_(std::move(dir)) {}

EtcdProcess::~EtcdProcess() {
  process_.Kill();
  std::error_code ignored;
  std::filesystem::remove_all(dir_, ignored);
}

std::string EtcdProcess::endpoint() const { return fmt::format("127.0.0.1:{}", member_.client_port); }

std::string EtcdProcess::endpoint_on(const std::string& host) const {
  return fmt::format("{}:{}", host, member_.client_port);
}

Status EtcdProcess::Launch() {
  if (EtcdBinary().empty()) return Status::FailedPrecondition("no etcd binary was found at configure time");
  if (process_.running()) return Status::FailedPrecondition("etcd is already running");
  const char* scheme = tls_dir_.empty() ? "http" : "https";
  std::string client_url = fmt::format("{}://127.0.0.1:{}", scheme, member_.client_port);
  if (!also_on_.empty()) client_url += fmt::format(",{}://{}:{}", scheme, also_on_, member_.client_port);
  ChildProcess::Options options;
  options.argv = {EtcdBinary(),
                  "--name",
                  member_.name,
                  "--data-dir",
                  dir_ + "/data",
                  "--listen-client-urls",
                  client_url,
                  "--advertise-client-urls",
                  client_url,
                  "--listen-peer-urls",
                  PeerUrl(member_),
                  "--initial-advertise-peer-urls",
                  PeerUrl(member_),
                  "--initial-cluster",
                  initial_cluster_,
                  "--initial-cluster-state",
                  "new",
                  "--initial-cluster-token",
                  token_,
                  "--logger",
                  "zap",
                  "--log-outputs",
                  "stderr"};
  if (!tls_dir_.empty()) {
    options.argv.insert(options.argv.end(), {"--cert-file", tls_dir_ + "/server.pem", "--key-file",
                                             tls_dir_ + "/server.key", "--trusted-ca-file", tls_dir_ + "/ca.pem"});
    if (client_cert_auth_) options.argv.push_back("--client-cert-auth");
  }
  options.argv.insert(options.argv.end(), extra_flags_.begin(), extra_flags_.end());
  options.output_path = dir_ + "/etcd.log";
  ORBITKV_ASSIGN_OR_RETURN(process_, ChildProcess::Spawn(options));
  launched_before_ = true;
  return Status::Ok();
}

Status EtcdProcess::Stop() {
  ORBITKV_RETURN_IF_ERROR(process_.Signal(SIGTERM));
  return process_.Wait(Deadline::After(std::chrono::seconds(30))).status();
}

std::string EtcdProcess::LogTail() const {
  std::ifstream in(dir_ + "/etcd.log");
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string all = ss.str();
  return all.size() > 4000 ? all.substr(all.size() - 4000) : all;
}

Status EtcdProcess::WaitReady(Deadline deadline) {
  Status last = Status::Unavailable("etcd exited");
  while (!deadline.Expired() && process_.running()) {
    // A fresh channel per probe: a channel that first met a port nobody listened on can sit in
    // reconnect backoff well after etcd started serving, which would only slow the test down.
    EtcdClientOptions options = ClientOptions();
    options.call_timeout = std::chrono::milliseconds(1000);
    ORBITKV_ASSIGN_OR_RETURN(std::unique_ptr<EtcdClient> client, EtcdClient::Create(options));
    etcdserverpb::RangeRequest request;
    request.set_key("/orbitkv/test-ready");  // under the prefix an auth-enabled etcd grants OrbitKV
    Result<etcdserverpb::RangeResponse> response = client->Range(request, deadline);
    if (response.ok() && process_.running()) {
      const uint64_t cluster_id = response->header().cluster_id();
      if (cluster_id_ == 0) cluster_id_ = cluster_id;
      if (cluster_id == cluster_id_) return Status::Ok();
      return Status::FailedPrecondition(
          fmt::format("another etcd (cluster {:x}, not {:x}) answers on {}'s port; log tail:\n{}", cluster_id,
                      cluster_id_, member_.name, LogTail()));
    }
    if (response.ok()) break;  // an answer, but this member's process is gone
    last = response.status();
    // Readiness has no notification; poll it.
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return Status::Unavailable(
      fmt::format("etcd {} did not become ready ({}); log tail:\n{}", member_.name, last.ToString(), LogTail()));
}

EtcdClientOptions EtcdProcess::ClientOptions() const {
  EtcdClientOptions options;
  options.endpoints = {endpoint()};
  if (!tls_dir_.empty()) {
    options.tls_ca_file = tls_dir_ + "/ca.pem";
    options.tls_cert_file = tls_dir_ + "/client.pem";
    options.tls_key_file = tls_dir_ + "/client.key";
  }
  options.user = user_;
  options.password = password_;
  return options;
}

void EtcdProcess::SetClientAuth(std::string user, std::string password) {
  user_ = std::move(user);
  password_ = std::move(password);
}

Status EtcdProcess::EnableAuth(const std::string& user, const std::string& password, const std::string& prefix) {
  const std::vector<std::vector<std::string>> steps = {
      {"user", "add", "root:root-" + password},
      {"user", "grant-role", "root", "root"},
      {"role", "add", "orbitkv"},
      {"role", "grant-permission", "orbitkv", "--prefix=true", "readwrite", prefix},
      {"user", "add", user + ":" + password},
      {"user", "grant-role", user, "orbitkv"},
      {"auth", "enable"}};
  for (const std::vector<std::string>& step : steps) ORBITKV_RETURN_IF_ERROR(Etcdctl(step).status());
  SetClientAuth(user, password);
  return Status::Ok();
}

Result<std::string> EtcdProcess::Etcdctl(const std::vector<std::string>& args) const {
  std::string command = "ETCDCTL_API=3 etcdctl --command-timeout=10s --endpoints ";
  command += fmt::format("{}://{}", tls_dir_.empty() ? "http" : "https", endpoint());
  if (!tls_dir_.empty()) {
    command += fmt::format(" --cacert '{0}/ca.pem' --cert '{0}/client.pem' --key '{0}/client.key'", tls_dir_);
  }
  if (!user_.empty()) command += fmt::format(" --user '{}:{}'", user_, password_);
  for (const std::string& arg : args) command += " '" + arg + "'";
  return RunShell(command, fmt::format("etcdctl {}", fmt::join(args, " ")));
}

Result<std::unique_ptr<EtcdProcess>> EtcdProcess::StartConfigured(Deadline deadline,
                                                                  const std::function<void(EtcdProcess&)>& configure) {
  Status last;
  // A port picked free can be taken before etcd binds it; try a few fresh pairs.
  for (int attempt = 0; attempt < 3; ++attempt) {
    std::set<int> taken;
    ORBITKV_ASSIGN_OR_RETURN(Member member, NewMember("orbitkv-test", &taken));
    ORBITKV_ASSIGN_OR_RETURN(std::string dir, MakeTempDir());
    const std::string initial = fmt::format("{}={}", member.name, PeerUrl(member));
    std::unique_ptr<EtcdProcess> etcd(
        new EtcdProcess(member, initial, fmt::format("orbitkv-{}", member.peer_port), dir));
    configure(*etcd);
    ORBITKV_RETURN_IF_ERROR(etcd->Launch());
    last = etcd->WaitReady(deadline);
    if (last.ok()) return etcd;
  }
  return last;
}

Result<std::unique_ptr<EtcdProcess>> EtcdProcess::StartSingle(Deadline deadline, std::string also_on) {
  return StartConfigured(deadline, [&](EtcdProcess& etcd) { etcd.also_on_ = also_on; });
}

Result<std::unique_ptr<EtcdProcess>> EtcdProcess::StartTls(const std::string& cert_dir, bool client_cert_auth,
                                                           Deadline deadline, std::vector<std::string> extra_flags) {
  return StartConfigured(deadline, [&](EtcdProcess& etcd) {
    etcd.tls_dir_ = cert_dir;
    etcd.client_cert_auth_ = client_cert_auth;
    etcd.extra_flags_ = extra_flags;
  });
}

Result<std::unique_ptr<EtcdCluster>> EtcdCluster::Start(int members, Deadline deadline, std::string also_on,
                                                        std::vector<std::string> extra_flags) {
  auto cluster = std::make_unique<EtcdCluster>();
  std::vector<EtcdProcess::Member> specs;
  std::string initial;
  std::set<int> taken;
  for (int i = 0; i < members; ++i) {
    ORBITKV_ASSIGN_OR_RETURN(EtcdProcess::Member m, NewMember(fmt::format("orbitkv-test-{}", i), &taken));
    if (!initial.empty()) initial += ",";
    initial += fmt::format("{}={}", m.name, PeerUrl(m));
    specs.push_back(std::move(m));
  }
  for (const EtcdProcess::Member& m : specs) {
    ORBITKV_ASSIGN_OR_RETURN(std::string dir, MakeTempDir());
    cluster->members_.push_back(
        std::unique_ptr<EtcdProcess>(new EtcdProcess(m, initial, fmt::format("orbitkv-{}", specs[0].peer_port), dir)));
    cluster->members_.back()->also_on_ = also_on;
    cluster->members_.back()->extra_flags_ = extra_flags;
  }
  for (auto& member : cluster->members_) ORBITKV_RETURN_IF_ERROR(member->Launch());
  for (auto& member : cluster->members_) ORBITKV_RETURN_IF_ERROR(member->WaitReady(deadline));
  return cluster;
}

std::vector<std::string> EtcdCluster::endpoints() const {
  std::vector<std::string> out;
  for (const auto& m : members_) out.push_back(m->endpoint());
  return out;
}

std::vector<std::string> EtcdCluster::endpoints_on(const std::string& host) const {
  std::vector<std::string> out;
  for (const auto& m : members_) out.push_back(m->endpoint_on(host));
  return out;
}

Result<size_t> EtcdCluster::LeaderIndex(Deadline deadline) {
  EtcdClientOptions options;
  options.endpoints = endpoints();
  options.call_timeout = std::chrono::milliseconds(2000);
  ORBITKV_ASSIGN_OR_RETURN(std::unique_ptr<EtcdClient> client, EtcdClient::Create(options));
  while (!deadline.Expired()) {
    for (size_t i = 0; i < members_.size(); ++i) {
      if (!members_[i]->running()) continue;
      Result<etcdserverpb::StatusResponse> status = client->EndpointStatus(i, deadline);
      if (status.ok() && status->leader() != 0 && status->leader() == status->header().member_id()) return i;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return Status::DeadlineExceeded("no etcd member reported itself leader");
}

}  // namespace orbitkv::cluster::testing
