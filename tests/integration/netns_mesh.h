// NetnsMesh(n): n hosts on one machine for the distributed tests. Each host is a network namespace
// with one veth ("vethN" inside, 10.78.0.(N+1)/24) plugged into a bridge that lives in a hub
// namespace; the test's own (root) namespace is plugged into the same bridge at 10.78.0.254, so the
// test reaches every host (etcd runs there, on that address) and the hosts reach it and each other
// only across the veths. Managers start under `ip netns exec` (launcher()); engines connect from the
// root namespace over the Managers' Unix sockets, which are paths and so reachable from every
// namespace. With UCX_TLS=tcp and UCX_NET_DEVICES=vethN (ManagerFlags) UCX has no shared-memory or
// loopback lane between the hosts: the bytes really cross the bridge.
//
// Names carry the creating process's pid, so concurrent test binaries never collide, and creation
// first deletes what a crashed earlier run left (namespaces whose pid is gone). The destructor
// deletes the namespaces (their veths and the bridge go with them), also when the test failed.
//
// Thread safety: one owner thread.
#ifndef ORBITKV_TESTS_INTEGRATION_NETNS_MESH_H_
#define ORBITKV_TESTS_INTEGRATION_NETNS_MESH_H_

#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "base/result.h"
#include "base/status.h"
#include "fmt/format.h"

namespace orbitkv::testing {

class NetnsMesh {
 public:
  static constexpr const char* kRootAddress = "10.78.0.254";

  // FailedPrecondition when not root or `ip` is missing (the caller skips, outside CI).
  static Result<std::unique_ptr<NetnsMesh>> Create(int hosts) {
    if (geteuid() != 0) return Status::FailedPrecondition("network namespaces need root");
    if (std::system("ip -V >/dev/null 2>&1") != 0) {
      return Status::FailedPrecondition("the ip command (iproute2) is missing");
    }
    SweepStale();
    std::unique_ptr<NetnsMesh> mesh(new NetnsMesh());
    mesh->prefix_ = fmt::format("okvm{}", getpid());
    const std::string hub = mesh->hub();
    std::vector<std::string> commands = {
        fmt::format("ip netns add {}", hub),
        fmt::format("ip -n {} link add br0 type bridge", hub),
        fmt::format("ip -n {} link set br0 up", hub),
        fmt::format("ip -n {} link set lo up", hub),
        // The root namespace's leg: it reaches every host, etcd listens on it.
        fmt::format("ip link add {} type veth peer name root netns {}", mesh->root_veth(), hub),
        fmt::format("ip -n {} link set root master br0 up", hub),
        fmt::format("ip addr add {}/24 dev {}", kRootAddress, mesh->root_veth()),
        fmt::format("ip link set {} up", mesh->root_veth()),
    };
    for (int i = 0; i < hosts; ++i) {
      const std::string ns = mesh->host(i);
      commands.push_back(fmt::format("ip netns add {}", ns));
      commands.push_back(fmt::format("ip -n {} link set lo up", ns));
      commands.push_back(fmt::format("ip -n {} link add veth{} type veth peer name h{} netns {}", ns, i, i, hub));
      commands.push_back(fmt::format("ip -n {} link set h{} master br0 up", hub, i));
      commands.push_back(fmt::format("ip -n {} addr add {}/24 dev veth{}", ns, mesh->address(i), i));
      commands.push_back(fmt::format("ip -n {} link set veth{} up", ns, i));
    }
    mesh->hosts_ = hosts;
    for (const std::string& command : commands) {
      if (std::system((command + " >/dev/null 2>&1").c_str()) != 0) {
        return Status::Internal(fmt::format("building the test mesh: '{}' failed", command));
      }
    }
    return mesh;
  }

  ~NetnsMesh() {
    // The root leg first, explicitly: a deleted namespace's devices go asynchronously, and the next mesh
    // must not meet this one's address on a device that is still there.
    (void)!std::system(fmt::format("ip link delete {} >/dev/null 2>&1", root_veth()).c_str());
    for (int i = 0; i < hosts_; ++i) Delete(host(i));
    Delete(hub());  // the bridge and the root veth's peer go with it, and so the root veth
  }
  NetnsMesh(const NetnsMesh&) = delete;
  NetnsMesh& operator=(const NetnsMesh&) = delete;

  int hosts() const { return hosts_; }
  std::string host(int i) const { return fmt::format("{}-{}", prefix_, i); }
  std::string address(int i) const { return fmt::format("10.78.0.{}", i + 1); }
  std::string device(int i) const { return fmt::format("veth{}", i); }
  std::string root_veth() const { return fmt::format("okvr{}", getpid()); }
  // The command prefix that runs a process on host i.
  std::vector<std::string> launcher(int i) const { return {"ip", "netns", "exec", host(i)}; }
  // Drops `percent` % of host i's packets each way (nftables in its namespace; the table goes with it).
  Status Loss(int i, int percent) const {
    const std::string command = fmt::format(
        "ip netns exec {} nft -f - >/dev/null 2>&1 <<'EOF'\n"
        "table inet okv_loss {{\n"
        "  chain in {{ type filter hook input priority 0; numgen random mod 100 < {} drop; }}\n"
        "  chain out {{ type filter hook output priority 0; numgen random mod 100 < {} drop; }}\n"
        "}}\nEOF",
        host(i), percent, percent);
    if (std::system(command.c_str()) != 0) return Status::Internal("nft could not add the loss rules");
    return Status::Ok();
  }
  Status NoLoss(int i) const {
    if (std::system(fmt::format("ip netns exec {} nft delete table inet okv_loss >/dev/null 2>&1", host(i)).c_str()) !=
        0) {
      return Status::Internal("nft could not delete the loss rules");
    }
    return Status::Ok();
  }
  // Drops host i's packets matching the nftables expression `match` each way (e.g. "tcp dport 7400" with its
  // reverse "tcp sport 7400" in `reverse`), in a table of its own (`table`: several blocks can stand side by side);
  // Unblock removes it.
  Status Block(int i, const std::string& match, const std::string& reverse,
               const std::string& table = "okv_block") const {
    const std::string command = fmt::format(
        "ip netns exec {} nft -f - >/dev/null 2>&1 <<'EOF'\n"
        "table inet {} {{\n"
        "  chain in {{ type filter hook input priority 0; {} drop; {} drop; }}\n"
        "  chain out {{ type filter hook output priority 0; {} drop; {} drop; }}\n"
        "}}\nEOF",
        host(i), table, match, reverse, match, reverse);
    if (std::system(command.c_str()) != 0) return Status::Internal("nft could not add the block rules");
    return Status::Ok();
  }
  // Host i's TCP traffic to and from `port` (on either side) is dropped.
  Status BlockPort(int i, int port, const std::string& table = "okv_block") const {
    return Block(i, fmt::format("tcp dport {}", port), fmt::format("tcp sport {}", port), table);
  }
  // Everything between host i and host j is dropped (etcd and the other hosts still reach it).
  Status Partition(int i, int j) const {
    return Block(i, fmt::format("ip daddr {}", address(j)), fmt::format("ip saddr {}", address(j)));
  }
  Status Unblock(int i, const std::string& table = "okv_block") const {
    if (std::system(fmt::format("ip netns exec {} nft delete table inet {} >/dev/null 2>&1", host(i), table).c_str()) !=
        0) {
      return Status::Internal("nft could not delete the block rules");
    }
    return Status::Ok();
  }
  // The transfer flags that keep UCX on host i's veth.
  std::vector<std::string> TransferFlags(int i) const {
    return {"--transfer-listen", address(i), "--ucx-tls", "tcp", "--ucx-net-devices", device(i)};
  }

 private:
  NetnsMesh() = default;
  std::string hub() const { return prefix_ + "-hub"; }

  static void Delete(const std::string& ns) {
    (void)!std::system(fmt::format("ip netns delete {} >/dev/null 2>&1", ns).c_str());
  }
  // Namespaces "okvm<pid>-*" whose process is gone: a crashed run's leftovers.
  static void SweepStale() {
    std::FILE* list = popen("ip netns list 2>/dev/null", "r");
    if (list == nullptr) return;
    char line[256];
    std::vector<std::string> stale;
    while (std::fgets(line, sizeof(line), list) != nullptr) {
      const std::string name(line, std::string(line).find_first_of(" \n"));
      if (name.rfind("okvm", 0) != 0) continue;
      const int pid = std::atoi(name.c_str() + 4);
      if (pid > 0 && kill(pid, 0) != 0) stale.push_back(name);
    }
    pclose(list);
    for (const std::string& name : stale) Delete(name);
    // And root legs "okvr<pid>" of processes that are gone.
    std::FILE* links = popen("ip -o link show 2>/dev/null", "r");
    if (links == nullptr) return;
    std::vector<std::string> legs;
    while (std::fgets(line, sizeof(line), links) != nullptr) {
      const std::string text(line);
      const size_t at = text.find(": okvr");
      if (at == std::string::npos) continue;
      const std::string name = text.substr(at + 2, text.find_first_of("@:", at + 2) - at - 2);
      const int pid = std::atoi(name.c_str() + 4);
      if (pid > 0 && kill(pid, 0) != 0) legs.push_back(name);
    }
    pclose(links);
    for (const std::string& name : legs) {
      (void)!std::system(fmt::format("ip link delete {} >/dev/null 2>&1", name).c_str());
    }
  }

  std::string prefix_;
  int hosts_ = 0;
};

}  // namespace orbitkv::testing

#endif  // ORBITKV_TESTS_INTEGRATION_NETNS_MESH_H_
