#include "cluster/cluster_keys.h"

#include <fmt/format.h>

namespace orbitkv::cluster {

Status ValidateName(std::string_view what, std::string_view name) {
  if (name.empty()) return Status::InvalidArgument(fmt::format("{} must not be empty", what));
  if (name.size() > kMaxNameBytes) {
    return Status::InvalidArgument(
        fmt::format("{} '{}...' is {} bytes; the limit is {}", what, name.substr(0, 16), name.size(), kMaxNameBytes));
  }
  if (name == "." || name == "..") return Status::InvalidArgument(fmt::format("{} must not be '{}'", what, name));
  for (char c : name) {
    const bool ok =
        (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
    if (!ok) {
      return Status::InvalidArgument(
          fmt::format("{} '{}' contains byte 0x{:02x}; use letters, digits, '.', '_' and '-'", what, name,
                      static_cast<unsigned>(static_cast<unsigned char>(c))));
    }
  }
  return Status::Ok();
}

std::string ClusterPrefix(std::string_view cluster) { return fmt::format("/orbitkv/v1/{}/", cluster); }

std::string MembersPrefix(std::string_view cluster) { return ClusterPrefix(cluster) + "members/"; }

std::string MemberKey(std::string_view cluster, std::string_view node_id) {
  return MembersPrefix(cluster) + std::string(node_id);
}

std::string EpochKey(std::string_view cluster, std::string_view node_id) {
  return ClusterPrefix(cluster) + "epochs/" + std::string(node_id);
}

std::string PlacementKey(std::string_view cluster) { return ClusterPrefix(cluster) + "placement"; }

std::string PlacementTransitionKey(std::string_view cluster) { return ClusterPrefix(cluster) + "placement-transition"; }

std::string PlacementRequestKey(std::string_view cluster) { return ClusterPrefix(cluster) + "placement-request"; }

std::string ReconcilerLeaderKey(std::string_view cluster) { return ClusterPrefix(cluster) + "reconciler/leader"; }

std::string ViewRangeBegin(std::string_view cluster) { return MembersPrefix(cluster); }

std::string ViewRangeEnd(std::string_view cluster) {
  std::string end = ReconcilerLeaderKey(cluster);
  end.push_back('\0');
  return end;
}

std::string PrefixEnd(std::string_view prefix) {
  std::string end(prefix);
  while (!end.empty() && static_cast<unsigned char>(end.back()) == 0xff) end.pop_back();
  if (end.empty()) return std::string(1, '\0');
  end.back() = static_cast<char>(static_cast<unsigned char>(end.back()) + 1);
  return end;
}

}  // namespace orbitkv::cluster
