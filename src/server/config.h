// ManagerConfig: every setting of orbitkv-manager, from embedded defaults, an optional TOML file
// and flags.
//
// Precedence: defaults < the file named by --config < command-line flags. The TOML file uses the
// flag names as keys (without the leading dashes), e.g. `dram = "8GiB"` or `allow-uid = [1001,
// 1002]`. Sizes accept plain bytes or a K/M/G/T suffix with or without "iB" (powers of 1024). Every
// error names the flag or key and the value.
#ifndef ORBITKV_SERVER_CONFIG_H_
#define ORBITKV_SERVER_CONFIG_H_

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "base/logging.h"
#include "base/result.h"

namespace orbitkv::server {

struct ManagerConfig {
  std::string socket_path;    // default: DefaultSocketPath()
  uint64_t dram_bytes = 0;    // 0: DefaultDramBytes()
  std::string numa = "auto";  // "auto" (every node with memory), "none" (one unbound arena), or "0,1"
  bool allow_unpinned = false;
  uint64_t slab_bytes = 32ull << 20;
  uint64_t query_budget_bytes = 0;           // 0: 75% of the pool
  uint64_t query_instance_budget_bytes = 0;  // 0: the global query budget
  uint64_t transfer_budget_bytes = 0;        // 0: half the pool
  uint32_t copy_threads = 2;
  // The CUDA copy engine's restore staging ring per GPU; 0: none (docs/gpu.md).
  uint64_t gpu_restore_staging_bytes = uint64_t{64} << 20;
  // --gpus: the GPUs (CUDA ordinals, as CUDA_VISIBLE_DEVICES numbers them) whose engines' buffers
  // this Manager copies. nullopt: every visible GPU; empty: none (CPU engines only).
  std::optional<std::vector<int>> gpus;
  uint32_t max_operations = 1024;  // outstanding restores and saves over all sessions
  std::string metrics_addr;        // "" (off) or HOST:PORT, e.g. 127.0.0.1:9091
  log::Level log_level = log::Level::kInfo;
  std::string log_file;
  std::vector<uid_t> allowed_uids;
  uint32_t ring_entries = 256;
  uint32_t payload_slots = 64;
  uint32_t slot_bytes = 64 * 1024;
  std::string config_file;
  // SSD tier: off unless ssd_path is set.
  std::string ssd_path;              // directory holding the tier's files
  uint64_t ssd_capacity_bytes = 0;   // 0: 64 GiB, capped at 90% of the file system's free space
  uint32_t ssd_files = 0;            // 0: one per 64 GiB (1..16)
  std::string ssd_backend = "auto";  // auto | io_uring | psync
  bool ssd_recover = true;
  std::string ssd_verify = "lazy";         // lazy | eager
  std::string ssd_write_staging = "auto";  // auto | copy | zero-copy
  std::string ssd_policy = "write-back";   // write-back | write-through
  uint32_t ssd_min_frequency = 2;
  uint32_t ssd_persist_seconds = 30;        // on a graceful stop, DRAM-only blocks to SSD (0: off)
  uint64_t ssd_write_budget_bytes = 0;      // per second; 0: unlimited
  uint64_t ssd_queue_bytes = 0;             // 0: an eighth of the pool, at most 1 GiB
  uint32_t max_loading = 256;               // outstanding Loading operations per session
  uint32_t loading_hold_seconds = 10;       // a completed load's pins wait this long for the engine
  uint32_t ssd_load_deadline_seconds = 30;  // a Loading op's SSD stage completes with what arrived

  // Distributed mode (membership on etcd): off unless etcd_endpoints is set.
  std::string etcd_endpoints;  // host:port[,host:port...]
  // etcd over TLS (a CA turns it on; a client certificate and key for etcd --client-cert-auth) and user auth
  // (the password is read from a file, never given on the command line).
  std::string etcd_tls_ca;
  std::string etcd_tls_cert;
  std::string etcd_tls_key;
  std::string etcd_user;
  std::string etcd_password_file;
  // How often the etcd and peer TLS files are re-read (rotation without a restart).
  uint32_t tls_reload_secs = 10;
  std::string cluster_name;
  std::string node_id;
  uint32_t membership_ttl_secs = 10;
  std::string catalog_nodes;      // id[,id...]
  uint32_t catalog_replicas = 3;  // copies of each catalog shard (capped by the catalog nodes)
  std::string peer_endpoint;      // host:port peers reach this Manager at (advertised in its member record)
  std::string peer_listen;        // host:port the peer listener binds; empty: peer_endpoint
  // Mutual TLS between peers: all three PEM files, or none (peers then unauthenticated).
  std::string peer_tls_cert;
  std::string peer_tls_key;
  std::string peer_tls_ca;
  // The UCX transfer engine (started with the peer listener): where it listens (host from
  // transfer_listen or the peer endpoint, a port from the range), UCX_TLS and UCX_NET_DEVICES.
  std::string transfer_listen;  // HOST[:PORT[-PORT]]; empty: the peer endpoint's host, any port
  std::string ucx_tls;
  std::string ucx_net_devices;
  // The catalog (distributed mode): bytes a catalog host may hold for the shards placed on it, and
  // the residency inventory's journal (over all shards) that owner streams replay from.
  uint64_t catalog_budget_bytes = 256ull << 20;
  uint64_t inventory_journal_bytes = 16ull << 20;
  // Remote fetches (distributed mode): the requester's discovery fan-out and candidate index TTL,
  // the remote stage's deadline and staging budget, and the source's per-peer pin limit.
  uint32_t discovery_max_hosts = 4;
  uint32_t discovery_hedge_ms = 5;  // --discovery-hedge-ms
  uint32_t candidate_ttl_ms = 5000;
  uint32_t remote_fetch_deadline_ms = 10000;
  uint32_t remote_fetch_workers = 4;         // threads running remote stages (fetches) at once
  uint64_t remote_staging_budget_bytes = 0;  // 0: a quarter of the pool
  uint64_t transfer_peer_budget_bytes = 0;   // 0: the transfer budget
  // Bytes of SSD blocks this source may be reading into DRAM for peers (and hold until their grants
  // drained) at once; 0: an eighth of the pool.
  uint64_t remote_ssd_staging_budget_bytes = 0;
  // Online placement changes: how long a moving shard may take to converge before the change aborts, and
  // how long the old catalog copies stay after a commit.
  uint32_t placement_shard_bound_ms = 60000;
  uint32_t placement_retire_grace_ms = 10000;
};

// `$XDG_RUNTIME_DIR/orbitkv/manager.sock` when XDG_RUNTIME_DIR is set, else
// `/tmp/orbitkv-<uid>/manager.sock`.
std::string DefaultSocketPath();
// A quarter of MemAvailable, at least 256 MiB and at most 32 GiB, rounded down to 32 MiB.
uint64_t DefaultDramBytes();

// "4GiB", "512M", "1073741824" -> bytes. InvalidArgument otherwise.
Result<uint64_t> ParseSize(std::string_view text);

// What Parse found: a config, or a request for help or the version (already printed by the caller).
struct ParsedArgs {
  ManagerConfig config;
  bool help = false;
  bool version = false;
  bool check_config = false;  // --check-config: validate the settings, print them, exit
};

// "all" (nullopt), "none" (empty) or CUDA ordinals like "0,1" (InvalidArgument naming the value).
Result<std::optional<std::vector<int>>> ParseGpus(std::string_view text);

// Applies defaults, then --config's file, then the flags.
Result<ParsedArgs> ParseManagerArgs(int argc, const char* const* argv);
std::string ManagerHelp();

}  // namespace orbitkv::server

#endif  // ORBITKV_SERVER_CONFIG_H_
