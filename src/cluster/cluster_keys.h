// The etcd key layout of one OrbitKV cluster, and the names that appear in it.
//
// Every key lives under /orbitkv/v1/<cluster>/ (docs/formats/cluster_records.md):
//   epochs/<node>   persistent incarnation counter of a Node ID (decimal text, never leased, never
//   deleted) members/<node>  the live member record (JSON, attached to the member's lease)
//   placement       the catalog placement record (JSON, no lease), changed only by the elected reconciler
//   placement-request, placement-transition, reconciler/leader   placement changes (placement_reconciler.h)
// The member view reads the one contiguous range [members/, reconciler/leader + "\0"), which holds exactly the member
// records and the four placement records (so every Manager follows a placement change through its watch, without
// polling) because "members/" < "placement" < "placement-request" < "placement-transition" < "reconciler/leader" and
// nothing else is written between them.
//
// Thread safety: pure functions.
#ifndef ORBITKV_CLUSTER_CLUSTER_KEYS_H_
#define ORBITKV_CLUSTER_CLUSTER_KEYS_H_

#include <string>
#include <string_view>

#include "base/status.h"

namespace orbitkv::cluster {

inline constexpr size_t kMaxNameBytes = 64;

// Cluster names and Node IDs: 1..64 bytes of [A-Za-z0-9._-], not "." or "..". InvalidArgument
// naming `what` (e.g. "--node-id") otherwise.
Status ValidateName(std::string_view what, std::string_view name);

std::string ClusterPrefix(std::string_view cluster);  // "/orbitkv/v1/<cluster>/"
std::string MembersPrefix(std::string_view cluster);  // ".../members/"
std::string MemberKey(std::string_view cluster, std::string_view node_id);
std::string EpochKey(std::string_view cluster, std::string_view node_id);
std::string PlacementKey(std::string_view cluster);
// Inside the member view's range: a placement change in progress, the operator's request for one, and the
// elected reconciler's leader key.
std::string PlacementTransitionKey(std::string_view cluster);  // ".../placement-transition"
std::string PlacementRequestKey(std::string_view cluster);     // ".../placement-request"
std::string ReconcilerLeaderKey(std::string_view cluster);     // ".../reconciler/leader"

// [begin, end) of the member view's Range and Watch: all member records plus the placement records.
std::string ViewRangeBegin(std::string_view cluster);
std::string ViewRangeEnd(std::string_view cluster);

// The smallest key greater than every key that starts with `prefix` (etcd's range_end for a prefix
// scan): trailing 0xff bytes dropped, the last remaining byte incremented; "\0" (all keys) when
// nothing remains.
std::string PrefixEnd(std::string_view prefix);

}  // namespace orbitkv::cluster

#endif  // ORBITKV_CLUSTER_CLUSTER_KEYS_H_
