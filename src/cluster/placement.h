// Placement: which catalog hosts keep the copies of each of the 16 logical catalog shards.
//
// A cluster's placement is the set of catalog Node IDs given by --catalog-nodes (1..16) and the
// number of copies each shard has, --catalog-replicas (default 3, capped by the set's size: a
// two-host set runs 2 copies, "reduced failure coverage"). It is installed once, atomically, at
// /orbitkv/v1/<cluster>/placement (record version 2, generation 1) and never changes at this stage:
// a Manager that joins with a different placement fails, and a Manager that observes a change is
// fenced (membership.h). A StateKey maps to a shard with state::ShardOf (domain-separated SHA-256);
// a shard's copies are the R catalog nodes with the highest equal-weight rendezvous scores
// SHA-256("orbitkv.rendezvous.v1\0" || shard_be32 || node_id), best first (copy 0 is the shard's
// "owner" where one host is meant). The assignment depends only on the configured placement, never
// on liveness: a dead copy leaves its shard to the other copies until it returns. Endpoints and
// runtime UUIDs come from the cached member view, without any etcd call.
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
inline constexpr int64_t kPlacementRecordVersion = 2;
inline constexpr uint32_t kDefaultCatalogReplicas = 3;
inline constexpr uint32_t kMaxCatalogReplicas = 5;

class Placement {
 public:
  // InvalidArgument when the set is empty, larger than kMaxCatalogNodes, names a node twice or has
  // a bad name, or `replicas` is outside 1..kMaxCatalogReplicas. The order of `catalog_nodes` does
  // not matter.
  static Result<Placement> Create(std::vector<std::string> catalog_nodes, uint32_t replicas = kDefaultCatalogReplicas,
                                  int64_t generation = 1);

  // The canonical record:
  // {"v":2,"generation":G,"shards":16,"replicas":R,"catalog_nodes":[sorted ids]}, R as requested; G is 1 as
  // installed and grows by one with every committed placement change.
  std::string Encode() const;
  // InvalidArgument for a malformed record, another record version (a version-1 record names the
  // upgrade) or an unsupported shard count.
  static Result<Placement> Decode(std::string_view bytes);

  // Sorted, unique.
  const std::vector<std::string>& catalog_nodes() const { return nodes_; }
  // First 16 hex digits of SHA-256 over Encode(); equal placements have equal fingerprints.
  const std::string& fingerprint() const { return fingerprint_; }
  int64_t generation() const { return generation_; }
  // Whether two placements keep every shard's copies on the same nodes (whatever their generations).
  bool SameContent(const Placement& other) const {
    return nodes_ == other.nodes_ && requested_replicas_ == other.requested_replicas_;
  }
  // Copies a shard has: the requested count, capped by the number of catalog nodes.
  uint32_t replicas() const { return static_cast<uint32_t>(copies_[0].size()); }
  uint32_t requested_replicas() const { return requested_replicas_; }
  // Fewer copies than the default of 3 (a smaller set or fewer asked for): one lost host more
  // leaves shards without a copy.
  bool reduced_coverage() const { return replicas() < kDefaultCatalogReplicas; }

  // The catalog nodes keeping `shard`'s copies, best rendezvous score first (< kNumShards, else
  // CHECK failure).
  const std::vector<std::string>& CopiesOf(uint32_t shard) const;
  // Whether `node` keeps a copy of `shard`.
  bool Keeps(uint32_t shard, std::string_view node) const;
  // Copy 0 of `shard` (< kNumShards, else CHECK failure).
  const std::string& OwnerOf(uint32_t shard) const;
  static uint32_t ShardOf(const state::StateKey& key) { return state::ShardOf(key, kNumShards); }

  // The owner's live member record from the cached view: Unavailable when the owner is not
  // registered or the view is incomplete. Never calls etcd.
  Result<Member> ResolveOwner(uint32_t shard, const MemberView& view) const;

  friend bool operator==(const Placement& a, const Placement& b) {
    return a.SameContent(b) && a.generation_ == b.generation_;
  }

 private:
  Placement() = default;
  static uint64_t Score(uint32_t shard, std::string_view node_id);

  std::vector<std::string> nodes_;
  uint32_t requested_replicas_ = kDefaultCatalogReplicas;
  int64_t generation_ = 1;
  std::string fingerprint_;
  std::array<std::vector<std::string>, kNumShards> copies_{};
};

// Installs `placement` at the cluster's placement key if none exists (one Txn), or checks that the
// installed one is identical. Returns the record's mod_revision, a fencing token for registration.
// FailedPrecondition naming both sets on a mismatch; DataLoss for an unreadable installed record;
// etcd errors as the client returns them.
Result<int64_t> InstallOrVerifyPlacement(EtcdClient& client, std::string_view cluster, const Placement& placement,
                                         Deadline deadline);

}  // namespace orbitkv::cluster

#endif  // ORBITKV_CLUSTER_PLACEMENT_H_
