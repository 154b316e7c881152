// Placement: which catalog host serves each of the 16 logical catalog shards.
//
// A cluster's placement is the set of catalog Node IDs given by --catalog-nodes (1..16). It is
// installed once, atomically, at /orbitkv/v1/<cluster>/placement and never changes at this stage: a
// Manager that joins with a different set fails, and a Manager that observes a change is fenced
// (membership.h). A StateKey maps to a shard with state::ShardOf (domain-separated SHA-256); each
// shard goes to the catalog node with the highest equal-weight rendezvous score
// SHA-256("orbitkv.rendezvous.v1\0" || shard_be32 || node_id). The assignment depends only on the
// configured set, never on liveness: a dead owner leaves its shard unavailable until it returns.
// Endpoints and runtime UUIDs of owners come from the cached member view, without any etcd call.
//
// Thread safety: immutable after Create(); safe to share.
#ifndef ORBITKV_CLUSTER_PLACEMENT_H_
#define ORBITKV_CLUSTER_PLACEMENT_H_

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "base/clock.h"
#include "base/result.h"
#include "cluster/member_record.h"
#include "state/state_key.h"

namespace orbitkv::cluster {

class EtcdClient;
class MemberView;

inline constexpr uint32_t kNumShards = 16;
inline constexpr size_t kMaxCatalogNodes = 16;
inline constexpr int64_t kPlacementRecordVersion = 1;

class Placement {
 public:
  // InvalidArgument when the set is empty, larger than kMaxCatalogNodes, names a node twice or has
  // a bad name. The order of `catalog_nodes` does not matter.
  static Result<Placement> Create(std::vector<std::string> catalog_nodes);

  // The canonical record: {"v":1,"shards":16,"catalog_nodes":[sorted ids]}.
  std::string Encode() const;
  // InvalidArgument for a malformed record or an unsupported shard count.
  static Result<Placement> Decode(std::string_view bytes);

  // Sorted, unique.
  const std::vector<std::string>& catalog_nodes() const { return nodes_; }
  // First 16 hex digits of SHA-256 over Encode(); equal sets have equal fingerprints.
  const std::string& fingerprint() const { return fingerprint_; }

  // The configured catalog node for `shard` (< kNumShards, else CHECK failure).
  const std::string& OwnerOf(uint32_t shard) const;
  static uint32_t ShardOf(const state::StateKey& key) { return state::ShardOf(key, kNumShards); }

  // The owner's live member record from the cached view: Unavailable when the owner is not
  // registered or the view is incomplete. Never calls etcd.
  Result<Member> ResolveOwner(uint32_t shard, const MemberView& view) const;

  friend bool operator==(const Placement& a, const Placement& b) { return a.nodes_ == b.nodes_; }

 private:
  Placement() = default;
  static uint64_t Score(uint32_t shard, std::string_view node_id);

  std::vector<std::string> nodes_;
  std::string fingerprint_;
  std::array<uint32_t, kNumShards> owner_index_{};
};

// Installs `placement` at the cluster's placement key if none exists (one Txn), or checks that the
// installed one is identical. Returns the record's mod_revision, a fencing token for registration.
// FailedPrecondition naming both sets on a mismatch; DataLoss for an unreadable installed record;
// etcd errors as the client returns them.
Result<int64_t> InstallOrVerifyPlacement(EtcdClient& client, std::string_view cluster,
                                         const Placement& placement, Deadline deadline);

}  // namespace orbitkv::cluster

#endif  // ORBITKV_CLUSTER_PLACEMENT_H_
