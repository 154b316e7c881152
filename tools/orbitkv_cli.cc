// orbitkv: the operator's command line for a host's Cache Manager.
//   orbitkv status [--socket PATH]          is the Manager up, and how full is it
//   orbitkv stats [--socket PATH] [--json]  its counters, as a table or as JSON
//   orbitkv catalog status [--socket PATH]  the catalog shards placed on it (distributed mode)
//   orbitkv catalog dump --shard N          the evidence it holds for shard N, one record a line
//   orbitkv inventory dump --shard N        its own replicas of shard N, one record a line
//   orbitkv catalog placement [--add NODE | --remove NODE | --abort]
//                                           the catalog placement and any change in progress; asks for a change
// Exit status: 0 when the Manager answered, 1 when it did not (the message says why), 2 for bad
// usage.
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "client/cache_client.h"

namespace {

constexpr const char* kUsage =
    "usage: orbitkv status [--socket PATH]\n"
    "       orbitkv stats [--socket PATH] [--json]\n"
    "       orbitkv catalog status [--socket PATH]\n"
    "       orbitkv catalog dump --shard N [--socket PATH]\n"
    "       orbitkv inventory dump --shard N [--socket PATH]\n"
    "       orbitkv catalog placement [--add NODE | --remove NODE | --abort] [--socket PATH]\n"
    "catalog placement shows which nodes keep the catalog's copies (the placement generation), the elected\n"
    "reconciler and any change in progress, shard by shard; --add/--remove asks for the next set (the node to add\n"
    "must run a Manager in the cluster already). The reconciler moves at most 2 shards at a time and commits the\n"
    "next generation when every moved shard's new copies caught up; Managers follow without a restart. --abort\n"
    "ends the change in progress at the reconciler's next step (the current generation stays); a change also aborts\n"
    "by itself when a moving shard does not converge within --placement-shard-bound-ms.\n"
    "Dumps print one record a line: [OWNER] KEY(hex of its 128-byte encoding) TIER VERSION "
    "GENERATION BYTES\n"
    "(a catalog's lines start with the owner's node id), so a catalog can be compared with its "
    "owners'\n"
    "inventories with sort and diff.\n"
    "Talks to the OrbitKV Manager on this host (default socket: the Manager's default; see "
    "orbitkv-manager "
    "--help).\n";

// The flat {"name": number, ...} object the Manager's stats reply carries.
std::map<std::string, std::string> ParseFlatJson(const std::string& json) {
  std::map<std::string, std::string> fields;
  size_t at = 0;
  while ((at = json.find('"', at)) != std::string::npos) {
    const size_t end = json.find('"', at + 1);
    const size_t colon = json.find(':', end);
    if (end == std::string::npos || colon == std::string::npos) break;
    // A quoted value ends at its closing quote (it may hold commas); others at the next , or }.
    const size_t first = json.find_first_not_of(' ', colon + 1);
    size_t value_end = json.find_first_of(",}", colon);
    if (first != std::string::npos && json[first] == '"') {
      value_end = first + 1;
      while (value_end < json.size() && json[value_end] != '"') value_end += json[value_end] == '\\' ? 2 : 1;
      if (value_end >= json.size()) value_end = std::string::npos;
    }
    if (value_end == std::string::npos) break;
    if (json[value_end] == '"') ++value_end;
    std::string value = json.substr(colon + 1, value_end - colon - 1);
    value.erase(0, value.find_first_not_of(' '));
    fields[json.substr(at + 1, end - at - 1)] = value;
    at = value_end;
  }
  return fields;
}

// The "identity" strings of the stats' "instances" array, with their instance ids.
std::vector<std::pair<std::string, std::string>> Instances(const std::string& json) {
  std::vector<std::pair<std::string, std::string>> out;
  size_t at = json.find("\"instances\": [");
  while (at != std::string::npos) {
    const size_t id = json.find("{\"instance\": ", at);
    if (id == std::string::npos) break;
    const size_t id_end = json.find(',', id);
    const size_t label = json.find("\"identity\": \"", id);
    if (id_end == std::string::npos || label == std::string::npos) break;
    std::string text;
    size_t i = label + 13;
    for (; i < json.size() && json[i] != '"'; ++i) {
      if (json[i] == '\\' && i + 1 < json.size()) ++i;
      text += json[i];
    }
    out.emplace_back(json.substr(id + 13, id_end - id - 13), text);
    at = i;
  }
  return out;
}

std::string Mib(const std::string& bytes) {
  return fmt::format("{:.1f} MiB", static_cast<double>(std::stoull(bytes)) / (1 << 20));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h") {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  std::string command = argv[1];
  int first_flag = 2;
  if ((command == "catalog" || command == "inventory") && argc > 2) {
    command += std::string(" ") + argv[2];  // "catalog status", "catalog dump", "catalog placement", "inventory dump"
    first_flag = 3;
  }
  orbitkv::client::ClientOptions options;
  options.timeout = std::chrono::milliseconds(3000);
  bool json = false;
  long shard = -1;
  std::string change;  // "add NODE" or "remove NODE" (catalog placement)
  for (int i = first_flag; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--json") {
      json = true;
    } else if ((arg == "--add" || arg == "--remove" || arg == "--abort") && (arg == "--abort" || i + 1 < argc) &&
               command == "catalog placement") {
      if (!change.empty()) {
        fmt::print(stderr, "orbitkv: catalog placement takes one --add, --remove or --abort at a time\n");
        return 2;
      }
      change = arg == "--abort" ? std::string("abort") : arg.substr(2) + " " + argv[++i];
    } else if (arg == "--socket" && i + 1 < argc) {
      options.socket_path = argv[++i];
    } else if (arg == "--shard" && i + 1 < argc) {
      char* end = nullptr;
      shard = std::strtol(argv[++i], &end, 10);
      if (*end != '\0' || shard < 0 || shard > 65535) {
        fmt::print(stderr, "orbitkv: --shard takes a shard number (0-15 in distributed mode)\n");
        return 2;
      }
    } else {
      fmt::print(stderr, "orbitkv: unexpected argument '{}'\n{}", arg, kUsage);
      return 2;
    }
  }
  const bool dump = command == "catalog dump" || command == "inventory dump";
  if (command != "status" && command != "stats" && command != "catalog status" && command != "catalog placement" &&
      !dump) {
    fmt::print(stderr, "orbitkv: unknown command '{}'\n{}", command, kUsage);
    return 2;
  }
  if (dump && shard < 0) {
    fmt::print(stderr, "orbitkv: {} needs --shard N\n", command);
    return 2;
  }
  auto client = orbitkv::client::CacheClient::Connect(options);
  if (!client.ok()) {
    fmt::print(stderr, "orbitkv: {}\n", client.status().message());
    return 1;
  }
  if (dump || command == "catalog status" || command == "catalog placement") {
    using orbitkv::channel::DumpKind;
    const DumpKind kind = command == "inventory dump" ? DumpKind::kInventory
                          : command == "catalog dump" ? DumpKind::kCatalog
                          : command == "catalog placement"
                              ? (change.empty() ? DumpKind::kPlacement : DumpKind::kPlacementChange)
                              : DumpKind::kCatalogStatus;
    if (kind == DumpKind::kCatalogStatus) {
      fmt::print("shard owners records bytes coverage lag_ms last_repair_s_ago\n");
    }
    uint64_t first = 0;
    do {  // page by page: a reply slot holds 64 KiB
      auto page = (*client)->Dump(kind, static_cast<uint32_t>(std::max(shard, 0L)), first, change);
      if (!page.ok()) {
        fmt::print(stderr, "orbitkv: {}\n", page.status().message());
        return 1;
      }
      std::fputs(page->text.c_str(), stdout);
      first = page->next;
    } while (first != 0);
    return 0;
  }
  auto stats = (*client)->Stats();
  if (!stats.ok()) {
    fmt::print(stderr, "orbitkv: the Manager did not answer: {}\n", stats.status().message());
    return 1;
  }
  if (json) {
    fmt::print("{}\n", *stats);
    return 0;
  }
  // The instances array (the last field) is listed on its own; the flat fields are everything
  // before it.
  std::string flat = *stats;
  if (const size_t cut = flat.find(", \"instances\": ["); cut != std::string::npos) {
    flat = flat.substr(0, cut) + "}";
  }
  auto f = ParseFlatJson(flat);
  if (command == "status") {
    std::string membership = f["membership"];
    membership.erase(std::remove(membership.begin(), membership.end(), '"'), membership.end());
    std::string runtime = f["runtime_uuid"];
    runtime.erase(std::remove(runtime.begin(), runtime.end(), '"'), runtime.end());
    fmt::print(
        "Manager on {}: up (runtime {}, incarnation {}), {} of {} pool in use, {} blocks resident, "
        "{} leases, {} copies in flight; membership {}\n",
        (*client)->socket_path(), runtime, f["incarnation"], Mib(f["pool_allocated_bytes"]),
        Mib(f["pool_capacity_bytes"]), f["resident_blocks"], f["leases_active"], f["operations_active"],
        membership.empty() ? "unknown" : membership);
    auto unquoted = [&](const std::string& key) {
      std::string v = f[key];
      v.erase(std::remove(v.begin(), v.end(), '"'), v.end());
      return v;
    };
    if (!unquoted("pool_numa_nodes").empty()) {
      const std::string nodes = unquoted("pool_numa_nodes");
      fmt::print("pool arenas on NUMA node(s) {}; GPUs served: {}\n", nodes == "-1" ? "(unbound)" : nodes,
                 unquoted("gpus").empty() ? "none" : unquoted("gpus"));
    }
    if (!membership.empty() && membership != "single-host") {
      // A quoted field's text: the quotes off, \" and \\ back to " and \.
      auto text = [&](const std::string& key) {
        std::string v = f[key];
        if (v.size() >= 2 && v.front() == '"' && v.back() == '"') v = v.substr(1, v.size() - 2);
        std::string out;
        for (size_t i = 0; i < v.size(); ++i) {
          if (v[i] == '\\' && i + 1 < v.size()) ++i;
          out += v[i];
        }
        return out;
      };
      // The registration (issue 51): its state and for how long, why the last one ended, what is being done.
      const std::string state = text("membership");
      std::string registration = fmt::format(
          "registration: {} for {} s (epoch {}, cluster runtime {}, {} "
          "registration{})",
          state, f["membership_for_s"], f["membership_epoch"], text("cluster_runtime_uuid"),
          f["membership_registrations"], f["membership_registrations"] == "1" ? "" : "s");
      if (state == "expired") {
        registration += fmt::format(
            "; registering again, attempt {}{}", f["membership_attempts"],
            text("membership_last_error").empty() ? std::string() : "; last error: " + text("membership_last_error"));
      } else if (state == "fenced") {
        registration += "; stays fenced until the Manager restarts";
      }
      if (!text("membership_last_cause").empty()) {
        registration += "; the last registration ended: " + text("membership_last_cause");
      }
      fmt::print("{}\n", registration);
      // Issue 53: how etcd is reached.
      if (!f["etcd_tls"].empty()) {
        const std::string tls = f["etcd_tls"] == "2"   ? "over TLS (etcd's certificate verified; client certificate)"
                                : f["etcd_tls"] == "1" ? "over TLS (etcd's certificate verified)"
                                                       : "without TLS (plaintext)";
        fmt::print("etcd: {}; {}\n", tls,
                   text("etcd_user").empty()
                       ? std::string("no user auth")
                       : fmt::format("authenticated as user '{}' ({} token{} obtained)", text("etcd_user"),
                                     f["etcd_auth_tokens"], f["etcd_auth_tokens"] == "1" ? "" : "s"));
      }
      // Issue 54: the catalog copies a shard has, and whether a lost catalog host may cost lookups.
      if (!f["catalog_replicas"].empty()) {
        fmt::print("catalog: {} cop{} of each shard{}\n", f["catalog_replicas"],
                   f["catalog_replicas"] == "1" ? "y" : "ies",
                   f["catalog_reduced_coverage"] == "1"
                       ? " (reduced failure coverage: give at least 3 --catalog-nodes and --catalog-replicas 3)"
                       : "");
      }
      std::string reason = text("membership_off_reason");
      if (reason.empty()) reason = text("remote_work_off_reason");
      fmt::print("remote work {}; peers: {} healthy, {} unreachable, {} incompatible; transfers on {}\n",
                 f["remote_work"] == "1" ? std::string("on")
                 : reason.empty()        ? std::string("off (membership not registered or view incomplete)")
                                         : "off: " + reason,
                 f["peers_healthy"].empty() ? "0" : f["peers_healthy"],
                 f["peers_unreachable"].empty() ? "0" : f["peers_unreachable"],
                 f["peers_incompatible"].empty() ? "0" : f["peers_incompatible"],
                 text("transfer_listen").empty() ? std::string("(none)") : text("transfer_listen"));
      // Issue 52: who a peer is, and whom a grant serves.
      if (!f["peer_tls"].empty()) {
        const auto count = [&](const char* key) { return f[key].empty() ? std::string("0") : f[key]; };
        fmt::print(
            "peer security: {}; grants bound to their holder (refused without the grant's secret: {} read{}, "
            "{} release{})\n",
            f["peer_tls"] == "1"
                ? fmt::format("mutual TLS, each certificate naming its node (refused: {} naming no node, {} "
                              "naming another)",
                              count("peer_refused_certificate_without_node"),
                              count("peer_refused_certificate_of_another_node"))
                : std::string("no TLS: peers are trusted by the member view alone (give --peer-tls-cert, "
                              "--peer-tls-key and --peer-tls-ca)"),
            count("transfer_grant_secret_refusals"), count("transfer_grant_secret_refusals") == "1" ? "" : "s",
            count("source_release_secret_refusals"), count("source_release_secret_refusals") == "1" ? "" : "s");
      }
    }
    const auto instances = Instances(*stats);
    fmt::print("{} engine instance{} registered\n", instances.size(), instances.size() == 1 ? "" : "s");
    for (const auto& [id, identity] : instances) {
      fmt::print("  instance {}: {}\n", id, identity.empty() ? "(no identity given)" : identity);
    }
    return 0;
  }
  fmt::print("{:<24} {:>20}\n", "metric", "value");
  for (const auto& [name, value] : f) fmt::print("{:<24} {:>20}\n", name, value);
  for (const auto& [id, identity] : Instances(*stats)) {
    fmt::print("instance {}: {}\n", id, identity.empty() ? "(no identity given)" : identity);
  }
  return 0;
}
