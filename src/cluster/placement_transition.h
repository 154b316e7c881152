// PlacementTransition: the explicit state of a catalog placement change in progress, kept at
// /orbitkv/v1/<cluster>/placement-transition by the elected reconciler (placement_reconciler.h) and read by every
// Manager.
//
// A change goes from the committed placement of generation G to the placement `to` of generation G+1. Each shard
// whose copies in `to` include a node that does not keep it in G must move: its new copies catch up from the
// owners (who publish to both generations while the change lasts) until every owner that was live when the move
// started has a baseline there past the sequence it had then (its watermark). At most `max_moving` shards move at
// once. A shard that gets no new copy is ready at once. When every shard is ready the reconciler commits G+1 (one
// etcd transaction writing the placement and the transition's committed phase); the old copies retire after a
// grace period, and the transition record goes. A shard that does not converge within its bound aborts the whole
// change (phase kAborted, counted): G stays, and the new copies are dropped.
//
// The record (FlatJson, docs/formats/cluster_records.md):
//   {"v":1,"phase":"moving|committed|aborted","from_generation":G,"to_generation":G+1,"replicas":R,
//    "catalog_nodes":[...],"leader":"node","started_ms":T,"phase_ms":T,"reason":"...",
//    "shards":["<shard>:<state>:<since_ms>:<owner>=<seq>,<owner>=<seq>", ...16 entries]}
// with state one of stay (no new copy), waiting, moving, ready; owners and sequences the watermarks recorded
// when the shard started moving.
//
// Thread safety: values.
#ifndef ORBITKV_CLUSTER_PLACEMENT_TRANSITION_H_
#define ORBITKV_CLUSTER_PLACEMENT_TRANSITION_H_

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "base/result.h"
#include "cluster/placement.h"

namespace orbitkv::cluster {

inline constexpr int64_t kPlacementTransitionVersion = 1;

struct ShardMove {
  enum class State { kStay, kWaiting, kMoving, kReady };
  State state = State::kStay;
  int64_t since_ms = 0;  // when it entered its state (wall clock, ms since the epoch)
  // Owner Node ID -> the sequence it had published to the shard when the move started.
  std::map<std::string, uint64_t> watermarks;

  friend bool operator==(const ShardMove&, const ShardMove&) = default;
};

std::string_view ShardMoveStateName(ShardMove::State state);

struct PlacementTransition {
  enum class Phase { kMoving, kCommitted, kAborted };
  Phase phase = Phase::kMoving;
  int64_t from_generation = 0;
  // The next placement (generation from_generation + 1): its catalog nodes and requested copies.
  std::vector<std::string> to_nodes;
  uint32_t to_replicas = kDefaultCatalogReplicas;
  std::string leader;  // the reconciler that started it
  int64_t started_ms = 0;
  int64_t phase_ms = 0;  // when the phase began
  std::string reason;    // why it aborted (empty otherwise)
  std::array<ShardMove, kNumShards> shards;

  // The new copies of `shard`: the nodes of `to` that `from` does not have for it.
  static std::vector<std::string> NewCopies(const Placement& from, const Placement& to, uint32_t shard);
  // A transition from `from` to `to` (generation from + 1), every shard waiting or staying.
  static PlacementTransition Start(const Placement& from, const Placement& to_content, std::string leader,
                                   int64_t now_ms);

  // The next placement (valid: Start and Decode check it).
  Placement To() const;
  size_t CountIn(ShardMove::State state) const;
  // Every shard is ready or stays: the change may commit.
  bool AllReady() const;

  std::string Encode() const;
  // InvalidArgument for a malformed record or another version.
  static Result<PlacementTransition> Decode(std::string_view bytes);
};

std::string_view PlacementPhaseName(PlacementTransition::Phase phase);

// The operator's request for a change (what `orbitkv catalog placement --add/--remove` writes):
// {"v":1,"catalog_nodes":[...],"replicas":R,"requested_by":"node","requested_ms":T,"base_generation":G}: the whole
// next set, built from committed generation G (absent from older writers: 0, not checked). With "abort":1 (what
// `--abort` writes, with the committed set) it asks to abort the change in progress instead.
struct PlacementRequest {
  std::vector<std::string> catalog_nodes;
  uint32_t replicas = kDefaultCatalogReplicas;
  std::string requested_by;
  int64_t requested_ms = 0;
  int64_t base_generation = 0;
  bool abort = false;

  std::string Encode() const;
  static Result<PlacementRequest> Decode(std::string_view bytes);
};

}  // namespace orbitkv::cluster

#endif  // ORBITKV_CLUSTER_PLACEMENT_TRANSITION_H_
