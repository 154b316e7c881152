#include "server/config.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>

#include "channel/uds.h"
#include "storage/ssd_store.h"

// toml++ header-only and without exceptions, in this translation unit only.
#define TOML_HEADER_ONLY 1
#define TOML_EXCEPTIONS 0
#include <toml++/toml.h>

namespace orbitkv::server {
namespace {

Result<uint64_t> ParseUint(std::string_view text) {
  uint64_t value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || text.empty()) {
    return Status::InvalidArgument(fmt::format("'{}' is not a non-negative integer", text));
  }
  return value;
}

// "N[,N...]": each a ParseUint.
Result<std::vector<uint64_t>> ParseUintList(std::string_view text) {
  std::vector<uint64_t> values;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    ORBITKV_ASSIGN_OR_RETURN(uint64_t value, ParseUint(text.substr(start, comma - start)));
    values.push_back(value);
    start = comma + 1;
  }
  return values;
}

Result<bool> ParseBool(std::string_view text) {
  if (text == "true" || text == "1" || text == "yes" || text == "on") return true;
  if (text == "false" || text == "0" || text == "no" || text == "off") return false;
  return Status::InvalidArgument(fmt::format("'{}' is not true or false", text));
}

using Apply = std::function<Status(ManagerConfig&, std::string_view)>;

struct Option {
  const char* name;
  const char* value_name;  // nullptr: a boolean switch
  const char* help;
  Apply apply;
};

Apply SizeInto(uint64_t ManagerConfig::*field) {
  return [field](ManagerConfig& c, std::string_view v) -> Status {
    ORBITKV_ASSIGN_OR_RETURN(c.*field, ParseSize(v));
    return Status::Ok();
  };
}

Apply Uint32Into(uint32_t ManagerConfig::*field, uint32_t min, uint32_t max) {
  return [field, min, max](ManagerConfig& c, std::string_view v) -> Status {
    ORBITKV_ASSIGN_OR_RETURN(uint64_t value, ParseUint(v));
    if (value < min || value > max) {
      return Status::InvalidArgument(fmt::format("{} is not in [{}, {}]", value, min, max));
    }
    c.*field = static_cast<uint32_t>(value);
    return Status::Ok();
  };
}

Apply StringInto(std::string ManagerConfig::*field) {
  return [field](ManagerConfig& c, std::string_view v) -> Status {
    c.*field = std::string(v);
    return Status::Ok();
  };
}

const std::vector<Option>& Options() {
  static const std::vector<Option> options = {
      {"socket", "PATH",
       "Unix socket engines connect to (default $ORBITKV_SOCKET, else "
       "$XDG_RUNTIME_DIR/orbitkv/manager.sock, else /tmp/orbitkv-<uid>/manager.sock)",
       StringInto(&ManagerConfig::socket_path)},
      {"dram", "SIZE",
       "pinned DRAM pool size, e.g. 64GiB (default: a quarter of available memory, 256 MiB to "
       "32 GiB)",
       SizeInto(&ManagerConfig::dram_bytes)},
      {"numa", "auto|none|LIST",
       "NUMA placement of the pool: auto (one arena per node with memory), none (one "
       "unbound arena), or nodes like 0,1 (default auto)",
       [](ManagerConfig& c, std::string_view v) -> Status {
         if (v != "auto" && v != "none" && v.find_first_not_of("0123456789,") != std::string_view::npos) {
           return Status::InvalidArgument(fmt::format("'{}' is not auto, none or a list of node numbers", v));
         }
         c.numa = std::string(v);
         return Status::Ok();
       }},
      {"allow-unpinned", nullptr,
       "run with an unlocked pool when memory cannot be mlocked (development only: "
       "restores may then page-fault)",
       [](ManagerConfig& c, std::string_view v) -> Status {
         ORBITKV_ASSIGN_OR_RETURN(c.allow_unpinned, ParseBool(v));
         return Status::Ok();
       }},
      {"slab", "SIZE", "pool slab size, a power of two >= 1MiB that bounds the largest block (default 32MiB)",
       SizeInto(&ManagerConfig::slab_bytes)},
      {"query-budget", "SIZE", "bytes all pending queries and restores may hold (default 75% of the pool)",
       SizeInto(&ManagerConfig::query_budget_bytes)},
      {"query-instance-budget", "SIZE", "the same limit per engine instance (default: the query budget)",
       SizeInto(&ManagerConfig::query_instance_budget_bytes)},
      {"transfer-budget", "SIZE", "bytes peer transfers may pin as sources (default half the pool)",
       SizeInto(&ManagerConfig::transfer_budget_bytes)},
      {"copy-threads", "N", "threads of the CPU copy engine (default 2)",
       Uint32Into(&ManagerConfig::copy_threads, 1, 256)},
      {"gpu-restore-staging", "SIZE",
       "device memory per GPU for staging restores of whole blocks (copy engines into it, the copy "
       "kernel out to the pages; a multiple of 16KiB; default 64MiB; 0: off, the kernel copies "
       "everything; docs/gpu.md)",
       [](ManagerConfig& c, std::string_view v) -> Status {
         ORBITKV_ASSIGN_OR_RETURN(const uint64_t bytes, ParseSize(v));
         if (bytes % (16 << 10) != 0) {
           return Status::InvalidArgument(
               fmt::format("--gpu-restore-staging must be a multiple of 16KiB (4 slots of 4 KiB pages), not {}", v));
         }
         c.gpu_restore_staging_bytes = bytes;
         return Status::Ok();
       }},
      {"gpus", "all|none|LIST",
       "the GPUs whose engines this Manager serves, as CUDA ordinals after CUDA_VISIBLE_DEVICES "
       "(e.g. 0,1): "
       "all (default: every visible GPU) or none (CPU engines only); each gets its own copy lanes",
       [](ManagerConfig& c, std::string_view v) -> Status {
         ORBITKV_ASSIGN_OR_RETURN(c.gpus, ParseGpus(v));
         return Status::Ok();
       }},
      {"max-operations", "N",
       "outstanding restores and saves over all sessions; more get backpressure (default "
       "1024)",
       Uint32Into(&ManagerConfig::max_operations, 1, 1 << 20)},
      {"metrics-addr", "HOST:PORT",
       "serve Prometheus metrics at http://HOST:PORT/metrics (default off; "
       "127.0.0.1:9091 is a good choice)",
       StringInto(&ManagerConfig::metrics_addr)},
      {"log-level", "LEVEL", "trace, debug, info, warn, error or off (default info)",
       [](ManagerConfig& c, std::string_view v) -> Status {
         std::optional<log::Level> level = log::ParseLevel(v);
         if (!level.has_value()) return Status::InvalidArgument(fmt::format("'{}' is not a log level", v));
         c.log_level = *level;
         return Status::Ok();
       }},
      {"log-file", "PATH", "append logs to PATH instead of stderr", StringInto(&ManagerConfig::log_file)},
      {"allow-uid", "UID[,UID...]", "also admit engines running as these uids (the Manager's own uid always may)",
       [](ManagerConfig& c, std::string_view v) -> Status {
         ORBITKV_ASSIGN_OR_RETURN(std::vector<uint64_t> uids, ParseUintList(v));
         for (const uint64_t uid : uids) c.allowed_uids.push_back(static_cast<uid_t>(uid));
         return Status::Ok();
       }},
      {"ring-entries", "N", "descriptor ring entries per session, a power of two in [16, 4096] (default 256)",
       Uint32Into(&ManagerConfig::ring_entries, 16, 4096)},
      {"payload-slots", "N", "request payload slots per session (default 64)",
       Uint32Into(&ManagerConfig::payload_slots, 1, 1024)},
      {"slot-bytes", "SIZE", "bytes per payload slot, a multiple of 4KiB up to 1MiB (default 64KiB)",
       [](ManagerConfig& c, std::string_view v) -> Status {
         ORBITKV_ASSIGN_OR_RETURN(uint64_t bytes, ParseSize(v));
         if (bytes < 4096 || bytes > (1 << 20) || bytes % 4096 != 0) {
           return Status::InvalidArgument(fmt::format("{} is not a multiple of 4KiB in [4KiB, 1MiB]", bytes));
         }
         c.slot_bytes = static_cast<uint32_t>(bytes);
         return Status::Ok();
       }},
      {"ssd-path", "DIR",
       "enable the SSD tier with its files in DIR (default off); blocks evicted from DRAM are "
       "written there and found again after a restart",
       StringInto(&ManagerConfig::ssd_path)},
      {"ssd-capacity", "SIZE",
       "bytes of SSD space to preallocate under --ssd-path (default 64GiB, at most 90% of the "
       "file system's free space)",
       SizeInto(&ManagerConfig::ssd_capacity_bytes)},
      {"ssd-files", "N", "files the SSD capacity is split over (default one per 64GiB, 1-16)",
       Uint32Into(&ManagerConfig::ssd_files, 0, 255)},
      {"ssd-backend", "auto|io_uring|psync",
       "SSD I/O: io_uring with O_DIRECT, or pread/pwrite threads; auto tries io_uring first "
       "(default auto)",
       [](ManagerConfig& c, std::string_view v) -> Status {
         if (v != "auto" && v != "io_uring" && v != "psync") {
           return Status::InvalidArgument(fmt::format("'{}' is not auto, io_uring or psync", v));
         }
         c.ssd_backend = std::string(v);
         return Status::Ok();
       }},
      {"ssd-write-staging", "auto|copy|zero-copy",
       "how a block goes to SSD: copied into a huge-page buffer and written as one contiguous "
       "segment, or written from its DRAM pages in place (one segment per 4 KiB page); auto copies "
       "on virtio disks, which pay per segment, and writes in place elsewhere (default auto)",
       [](ManagerConfig& c, std::string_view v) -> Status {
         if (!storage::ParseWriteStaging(v).has_value()) {
           return Status::InvalidArgument(fmt::format("'{}' is not auto, copy or zero-copy", v));
         }
         c.ssd_write_staging = std::string(v);
         return Status::Ok();
       }},
      {"ssd-recover", "BOOL", "on start, find the blocks already on SSD (true, default) or discard them (false)",
       [](ManagerConfig& c, std::string_view v) -> Status {
         ORBITKV_ASSIGN_OR_RETURN(c.ssd_recover, ParseBool(v));
         return Status::Ok();
       }},
      {"ssd-verify", "lazy|eager",
       "check record checksums on every read only (lazy, default) or also while scanning at start "
       "(eager: slower start, bad records dropped at once)",
       [](ManagerConfig& c, std::string_view v) -> Status {
         if (v != "lazy" && v != "eager") {
           return Status::InvalidArgument(fmt::format("'{}' is not lazy or eager", v));
         }
         c.ssd_verify = std::string(v);
         return Status::Ok();
       }},
      {"ssd-policy", "write-back|write-through",
       "write blocks to SSD when DRAM evicts them (write-back, default) or as soon as they are "
       "saved (write-through)",
       [](ManagerConfig& c, std::string_view v) -> Status {
         if (v != "write-back" && v != "write-through") {
           return Status::InvalidArgument(fmt::format("'{}' is not write-back or write-through", v));
         }
         c.ssd_policy = std::string(v);
         return Status::Ok();
       }},
      {"ssd-min-frequency", "N",
       "write an evicted block to SSD only if it was used at least N times (1: every block; "
       "default 2, so one-hit blocks do not wear the SSD)",
       Uint32Into(&ManagerConfig::ssd_min_frequency, 1, 16)},
      {"ssd-persist-on-exit", "SECONDS",
       "when stopping gracefully (SIGTERM, SIGINT), write the DRAM blocks not yet on SSD (those "
       "--ssd-min-frequency admits, most used first) for up to SECONDS before exiting, so the "
       "restarted Manager finds them (default 30; 0 exits at once)",
       Uint32Into(&ManagerConfig::ssd_persist_seconds, 0, 86400)},
      {"ssd-write-budget", "SIZE", "SSD write bandwidth the tier may use per second, e.g. 1GiB (default unlimited)",
       SizeInto(&ManagerConfig::ssd_write_budget_bytes)},
      {"ssd-queue", "SIZE",
       "evicted bytes that may wait for an SSD writer; more are not written (default an eighth of "
       "the pool, at most 1GiB)",
       SizeInto(&ManagerConfig::ssd_queue_bytes)},
      {"max-loading", "N", "outstanding Loading operations (SSD reads for queries) per session (default 256)",
       Uint32Into(&ManagerConfig::max_loading, 1, 1 << 16)},
      {"loading-hold", "SECONDS",
       "how long the blocks a completed Loading operation read from SSD stay pinned for the "
       "engine's next query of the chain, if it does not come (default 10)",
       Uint32Into(&ManagerConfig::loading_hold_seconds, 1, 3600)},
      {"ssd-load-deadline", "SECONDS",
       "the longest a Loading operation waits for its SSD reads; it then completes with the "
       "blocks that arrived and the engine gets the shorter hit (default 30)",
       Uint32Into(&ManagerConfig::ssd_load_deadline_seconds, 1, 3600)},
      {"etcd-endpoints", "HOST:PORT[,...]",
       "join the cluster registered in this etcd (distributed mode; default off: a single host)",
       StringInto(&ManagerConfig::etcd_endpoints)},
      {"etcd-tls-ca", "PATH",
       "PEM CA that signed etcd's server certificate: talk to etcd over TLS (https://), verifying etcd's "
       "certificate and that it names the endpoint's host",
       StringInto(&ManagerConfig::etcd_tls_ca)},
      {"etcd-tls-cert", "PATH",
       "PEM client certificate presented to etcd (etcd --client-cert-auth; with --etcd-tls-key)",
       StringInto(&ManagerConfig::etcd_tls_cert)},
      {"etcd-tls-key", "PATH", "PEM private key of --etcd-tls-cert", StringInto(&ManagerConfig::etcd_tls_key)},
      {"etcd-user", "NAME",
       "etcd user to authenticate as (etcd `auth enable`; its role needs readwrite on the /orbitkv/ prefix); "
       "the password comes from --etcd-password-file",
       StringInto(&ManagerConfig::etcd_user)},
      {"etcd-password-file", "PATH",
       "file holding the password of --etcd-user (one line; keep it readable by this Manager only)",
       StringInto(&ManagerConfig::etcd_password_file)},
      {"tls-reload-secs", "N",
       "how often the --etcd-tls-* and --peer-tls-* files are re-read: new connections use rotated "
       "certificates without a restart (default 10)",
       Uint32Into(&ManagerConfig::tls_reload_secs, 1, 3600)},
      {"cluster-name", "NAME", "the cluster to join in etcd (needed with --etcd-endpoints)",
       StringInto(&ManagerConfig::cluster_name)},
      {"node-id", "ID", "this Manager's stable Node ID in the cluster (needed with --etcd-endpoints)",
       StringInto(&ManagerConfig::node_id)},
      {"membership-ttl-secs", "N", "lease TTL of the membership record in seconds (default 10)",
       Uint32Into(&ManagerConfig::membership_ttl_secs, 2, 3600)},
      {"catalog-nodes", "ID[,ID...]", "the 1-16 Node IDs that host catalog shards (the same on every Manager)",
       StringInto(&ManagerConfig::catalog_nodes)},
      {"catalog-replicas", "N",
       "copies of each catalog shard, on distinct catalog nodes (default 3; capped by the number of "
       "--catalog-nodes, and the same on every Manager): with 3, a lost catalog host costs no lookup",
       Uint32Into(&ManagerConfig::catalog_replicas, 1, 5)},
      {"peer-endpoint", "HOST:PORT",
       "where other Managers reach this one (advertised in its member record); starts the peer "
       "listener (orbitkv.peer.v1 over gRPC)",
       StringInto(&ManagerConfig::peer_endpoint)},
      {"peer-listen", "HOST:PORT", "where the peer listener binds (default: the --peer-endpoint)",
       StringInto(&ManagerConfig::peer_listen)},
      {"peer-tls-cert", "PATH",
       "PEM certificate of this Manager for mutual TLS between peers (with --peer-tls-key and "
       "--peer-tls-ca)",
       StringInto(&ManagerConfig::peer_tls_cert)},
      {"peer-tls-key", "PATH", "PEM private key of --peer-tls-cert", StringInto(&ManagerConfig::peer_tls_key)},
      {"peer-tls-ca", "PATH",
       "PEM CA certificates peers' certificates must chain to (a peer without one is refused "
       "before any request is read)",
       StringInto(&ManagerConfig::peer_tls_ca)},
      {"transfer-listen", "HOST[:PORT[-PORT]]",
       "where the UCX transfer engine listens for peers' block reads (started with "
       "--peer-endpoint): a host, optionally a port or a port range to pick from (give one to "
       "open in a firewall; default: the --peer-endpoint's host, any free port)",
       StringInto(&ManagerConfig::transfer_listen)},
      {"catalog-budget", "SIZE",
       "bytes this Manager may hold as a catalog host for the shards placed on it: owners' "
       "evidence, snapshots being built and their reservations (default 256MiB); what does not fit "
       "is reported incomplete, never over budget",
       SizeInto(&ManagerConfig::catalog_budget_bytes)},
      {"inventory-journal-bytes", "SIZE",
       "the residency journal owner streams replay from, over all shards (default 16MiB): a "
       "catalog "
       "host that falls further behind resyncs with a snapshot",
       SizeInto(&ManagerConfig::inventory_journal_bytes)},
      {"ucx-tls", "LIST",
       "UCX transports for peer transfers (UCX_TLS), e.g. tcp, or rc,tcp on RDMA hosts (default: "
       "UCX's choice)",
       StringInto(&ManagerConfig::ucx_tls)},
      {"ucx-net-devices", "LIST",
       "network devices UCX may use for peer transfers (UCX_NET_DEVICES), e.g. eth1 or mlx5_0:1 "
       "(default: all)",
       StringInto(&ManagerConfig::ucx_net_devices)},
      {"discovery-max-hosts", "N",
       "catalog hosts one cold query asks at once when it looks up who holds its blocks (default "
       "4)",
       Uint32Into(&ManagerConfig::discovery_max_hosts, 1, 16)},
      {"discovery-hedge-ms", "MS",
       "how long a lookup waits for a catalog copy before it also asks the shard's next copy (a "
       "hedge; the first answer wins): at least this and 3x the copy's recent answer time (default 5)",
       Uint32Into(&ManagerConfig::discovery_hedge_ms, 1, 3000)},
      {"candidate-ttl-ms", "MS",
       "how long a learnt candidate (who holds a block) is trusted without asking the catalog "
       "again; reads do "
       "not extend it (default 5000)",
       Uint32Into(&ManagerConfig::candidate_ttl_ms, 1, 3600000)},
      {"remote-fetch-deadline-ms", "MS",
       "a Loading operation's remote stage completes with what arrived by then, and the engine "
       "recomputes the "
       "rest (default 10000)",
       Uint32Into(&ManagerConfig::remote_fetch_deadline_ms, 100, 600000)},
      {"remote-fetch-workers", "N",
       "remote stages (fetches of different prefixes from peers) run at once, one thread each; "
       "more help where cores and the network have room (default 4)",
       Uint32Into(&ManagerConfig::remote_fetch_workers, 1, 64)},
      {"remote-ssd-staging-budget", "SIZE",
       "bytes of SSD-resident blocks this Manager may be reading into DRAM for peers' remote hits (and hold until "
       "their transfers drained) at once; past it a peer is told to ask elsewhere (default an eighth of the pool)",
       SizeInto(&ManagerConfig::remote_ssd_staging_budget_bytes)},
      {"placement-shard-bound-ms", "MS",
       "a catalog placement change (`orbitkv catalog placement --add/--remove`) aborts when one moving shard's new "
       "copies have not caught up with their owners by then (default 60000); only time the elected reconciler could "
       "act counts (an etcd outage does not), and `orbitkv catalog placement --abort` ends a change at once",
       Uint32Into(&ManagerConfig::placement_shard_bound_ms, 1000, 3600000)},
      {"placement-retire-grace-ms", "MS",
       "after a placement change commits, the old catalog copies keep answering this long for Managers that have "
       "not seen the commit yet (default 10000)",
       Uint32Into(&ManagerConfig::placement_retire_grace_ms, 0, 3600000)},
      {"remote-staging-budget", "SIZE",
       "pool bytes blocks being fetched from peers may hold before they are sealed (default a "
       "quarter of the "
       "pool)",
       SizeInto(&ManagerConfig::remote_staging_budget_bytes)},
      {"transfer-peer-budget", "SIZE",
       "bytes one requesting peer may keep pinned here as a source (default: all of "
       "--transfer-budget)",
       SizeInto(&ManagerConfig::transfer_peer_budget_bytes)},
  };
  return options;
}

const Option* FindOption(std::string_view name) {
  for (const Option& option : Options()) {
    if (name == option.name) return &option;
  }
  return nullptr;
}

// A TOML value in the textual form the flag parser takes.
Result<std::string> TomlValueText(const toml::node& node) {
  if (auto s = node.value<std::string>()) return *s;
  if (auto b = node.value<bool>(); b.has_value() && node.is_boolean()) return std::string(*b ? "true" : "false");
  if (auto i = node.value<int64_t>(); i.has_value() && node.is_integer()) {
    if (*i < 0) return Status::InvalidArgument(fmt::format("{} is negative", *i));
    return std::to_string(*i);
  }
  if (const toml::array* array = node.as_array()) {
    std::string joined;
    for (const toml::node& element : *array) {
      ORBITKV_ASSIGN_OR_RETURN(std::string text, TomlValueText(element));
      if (!joined.empty()) joined += ',';
      joined += text;
    }
    return joined;
  }
  return Status::InvalidArgument("values must be strings, integers, booleans or arrays of them");
}

Status ApplyFile(const std::string& path, ManagerConfig* config) {
  toml::parse_result parsed = toml::parse_file(path);
  if (!parsed) {
    const toml::parse_error& error = parsed.error();
    return Status::InvalidArgument(
        fmt::format("config file {} line {}: {}", path, error.source().begin.line, error.description()));
  }
  for (const auto& [key, node] : parsed.table()) {
    const std::string_view name = key.str();
    const Option* option = FindOption(name);
    if (option == nullptr || name == "config") {
      return Status::InvalidArgument(
          fmt::format("config file {}: unknown key '{}' (keys are the flag names of "
                      "orbitkv-manager --help)",
                      path, name));
    }
    Result<std::string> text = TomlValueText(node);
    if (!text.ok()) return text.status().WithContext(fmt::format("config file {}: key '{}'", path, name));
    ORBITKV_RETURN_IF_ERROR(
        option->apply(*config, *text).WithContext(fmt::format("config file {}: key '{}'", path, name)));
  }
  return Status::Ok();
}

}  // namespace

std::string DefaultSocketPath() { return channel::DefaultManagerSocketPath(); }

uint64_t DefaultDramBytes() {
  uint64_t available_kib = 0;
  std::ifstream meminfo("/proc/meminfo");
  std::string line;
  while (std::getline(meminfo, line)) {
    if (line.rfind("MemAvailable:", 0) == 0) {
      std::istringstream(line.substr(13)) >> available_kib;
      break;
    }
  }
  const uint64_t quarter = available_kib * 1024 / 4;
  const uint64_t clamped = std::clamp<uint64_t>(quarter, 256ull << 20, 32ull << 30);
  return clamped / (32ull << 20) * (32ull << 20);
}

Result<uint64_t> ParseSize(std::string_view text) {
  size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) ++digits;
  if (digits == 0) return Status::InvalidArgument(fmt::format("'{}' is not a size like 4GiB or 1048576", text));
  ORBITKV_ASSIGN_OR_RETURN(uint64_t value, ParseUint(text.substr(0, digits)));
  std::string suffix(text.substr(digits));
  std::transform(suffix.begin(), suffix.end(), suffix.begin(), [](unsigned char c) { return std::tolower(c); });
  int shift = 0;
  if (suffix.empty() || suffix == "b") {
    shift = 0;
  } else if (suffix == "k" || suffix == "kib" || suffix == "kb") {
    shift = 10;
  } else if (suffix == "m" || suffix == "mib" || suffix == "mb") {
    shift = 20;
  } else if (suffix == "g" || suffix == "gib" || suffix == "gb") {
    shift = 30;
  } else if (suffix == "t" || suffix == "tib" || suffix == "tb") {
    shift = 40;
  } else {
    return Status::InvalidArgument(fmt::format("'{}' has an unknown size suffix (use K, M, G or T)", text));
  }
  if (shift != 0 && value > (UINT64_MAX >> shift)) {
    return Status::InvalidArgument(fmt::format("'{}' is too large", text));
  }
  return value << shift;
}

Result<std::optional<std::vector<int>>> ParseGpus(std::string_view text) {
  if (text == "all") return std::optional<std::vector<int>>();
  if (text == "none") return std::optional<std::vector<int>>(std::vector<int>());
  Result<std::vector<uint64_t>> ordinals = ParseUintList(text);
  if (!ordinals.ok()) {
    return Status::InvalidArgument(
        fmt::format("'{}' is not a GPU list: give all, none, or CUDA ordinals like 0,1", text));
  }
  std::vector<int> devices;
  for (const uint64_t ordinal : *ordinals) {
    const int device = static_cast<int>(std::min<uint64_t>(ordinal, std::numeric_limits<int>::max()));
    if (std::find(devices.begin(), devices.end(), device) != devices.end()) {
      return Status::InvalidArgument(fmt::format("GPU {} is named twice in '{}'", device, text));
    }
    devices.push_back(device);
  }
  return std::optional<std::vector<int>>(std::move(devices));
}

Result<ParsedArgs> ParseManagerArgs(int argc, const char* const* argv) {
  ParsedArgs parsed;
  // The config file applies first, whatever its position among the flags.
  std::vector<std::pair<const Option*, std::string>> flags;
  for (int i = 1; i < argc; ++i) {
    std::string_view arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      parsed.help = true;
      return parsed;
    }
    if (arg == "--version") {
      parsed.version = true;
      return parsed;
    }
    if (arg == "--check-config") {
      parsed.check_config = true;
      continue;
    }
    if (arg.substr(0, 2) != "--") {
      return Status::InvalidArgument(fmt::format("unexpected argument '{}' (see --help)", arg));
    }
    arg.remove_prefix(2);
    std::optional<std::string> value;
    if (const size_t eq = arg.find('='); eq != std::string_view::npos) {
      value = std::string(arg.substr(eq + 1));
      arg = arg.substr(0, eq);
    }
    if (arg == "config") {
      if (!value.has_value()) {
        if (i + 1 >= argc) return Status::InvalidArgument("--config needs a file (see --help)");
        value = argv[++i];
      }
      parsed.config.config_file = *value;
      continue;
    }
    const Option* option = FindOption(arg);
    if (option == nullptr) return Status::InvalidArgument(fmt::format("unknown flag --{} (see --help)", arg));
    if (!value.has_value()) {
      if (option->value_name == nullptr) {
        value = "true";
      } else if (i + 1 < argc) {
        value = argv[++i];
      } else {
        return Status::InvalidArgument(fmt::format("--{} needs a value {} (see --help)", arg, option->value_name));
      }
    }
    flags.emplace_back(option, *value);
  }
  if (!parsed.config.config_file.empty()) ORBITKV_RETURN_IF_ERROR(ApplyFile(parsed.config.config_file, &parsed.config));
  for (const auto& [option, value] : flags) {
    ORBITKV_RETURN_IF_ERROR(option->apply(parsed.config, value).WithContext(fmt::format("--{}", option->name)));
  }
  if (parsed.config.socket_path.empty()) parsed.config.socket_path = DefaultSocketPath();
  if (parsed.config.dram_bytes == 0) parsed.config.dram_bytes = DefaultDramBytes();
  return parsed;
}

std::string ManagerHelp() {
  std::string out =
      "orbitkv-manager: the OrbitKV Cache Manager for one host. Engines (vLLM, SGLang, or the "
      "orbitkv client)\n"
      "connect over a Unix socket and shared memory; the Manager keeps their KV blocks in a pinned "
      "DRAM pool and\n"
      "copies them to and from the engines' pages. With no flags it serves this host with embedded "
      "defaults.\n\n"
      "Usage: orbitkv-manager [--config FILE] [flags]\n\n"
      "Flags (each can also be a key of the TOML file given by --config; flags win):\n";
  out += fmt::format("  {:<34} {}\n", "--config FILE", "read settings from a TOML file, keys named like the flags");
  for (const Option& option : Options()) {
    const std::string left = option.value_name == nullptr ? fmt::format("--{}", option.name)
                                                          : fmt::format("--{} {}", option.name, option.value_name);
    out += fmt::format("  {:<34} {}\n", left, option.help);
  }
  out += fmt::format("  {:<34} {}\n", "--check-config",
                     "check the flags and the --config file, print the main settings and exit (0: valid)");
  out += fmt::format("  {:<34} {}\n", "--version", "print the version and exit");
  out += fmt::format("  {:<34} {}\n", "--help", "this text");
  out +=
      "\nSizes take K, M, G or T suffixes (powers of 1024). SIGTERM or SIGINT stops the Manager "
      "gracefully:\n"
      "new work is refused, in-flight copies drain, then sessions close.\n";
  return out;
}

}  // namespace orbitkv::server
