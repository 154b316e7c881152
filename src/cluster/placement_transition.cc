#include "cluster/placement_transition.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>

#include "base/check.h"
#include "cluster/cluster_keys.h"
#include "cluster/flat_json.h"

namespace orbitkv::cluster {
namespace {

constexpr std::string_view kStateNames[] = {"stay", "waiting", "moving", "ready"};
constexpr std::string_view kPhaseNames[] = {"moving", "committed", "aborted"};

Result<uint64_t> ParseNumber(std::string_view text, std::string_view what) {
  uint64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size() || text.empty()) {
    return Status::InvalidArgument(fmt::format("placement transition: {} '{}' is not a number", what, text));
  }
  return value;
}

std::vector<std::string_view> Split(std::string_view text, char separator) {
  std::vector<std::string_view> parts;
  size_t at = 0;
  while (true) {
    const size_t next = text.find(separator, at);
    parts.push_back(text.substr(at, next == std::string_view::npos ? std::string_view::npos : next - at));
    if (next == std::string_view::npos) return parts;
    at = next + 1;
  }
}

}  // namespace

std::string_view ShardMoveStateName(ShardMove::State state) { return kStateNames[static_cast<int>(state)]; }

std::string_view PlacementPhaseName(PlacementTransition::Phase phase) { return kPhaseNames[static_cast<int>(phase)]; }

std::vector<std::string> PlacementTransition::NewCopies(const Placement& from, const Placement& to, uint32_t shard) {
  std::vector<std::string> added;
  for (const std::string& node : to.CopiesOf(shard)) {
    if (!from.Keeps(shard, node)) added.push_back(node);
  }
  return added;
}

PlacementTransition PlacementTransition::Start(const Placement& from, const Placement& to_content, std::string leader,
                                               int64_t now_ms) {
  PlacementTransition t;
  t.phase = Phase::kMoving;
  t.from_generation = from.generation();
  t.to_nodes = to_content.catalog_nodes();
  t.to_replicas = to_content.requested_replicas();
  t.leader = std::move(leader);
  t.started_ms = t.phase_ms = now_ms;
  const Placement to = t.To();
  for (uint32_t shard = 0; shard < kNumShards; ++shard) {
    t.shards[shard].state = NewCopies(from, to, shard).empty() ? ShardMove::State::kStay : ShardMove::State::kWaiting;
    t.shards[shard].since_ms = now_ms;
  }
  return t;
}

Placement PlacementTransition::To() const {
  Result<Placement> to = Placement::Create(to_nodes, to_replicas, from_generation + 1);
  ORBITKV_CHECK_MSG(to.ok(), "a placement transition to an invalid placement: {}", to.status().ToString());
  return std::move(to).value();
}

size_t PlacementTransition::CountIn(ShardMove::State state) const {
  return static_cast<size_t>(
      std::count_if(shards.begin(), shards.end(), [state](const ShardMove& m) { return m.state == state; }));
}

bool PlacementTransition::AllReady() const {
  return std::all_of(shards.begin(), shards.end(), [](const ShardMove& m) {
    return m.state == ShardMove::State::kReady || m.state == ShardMove::State::kStay;
  });
}

std::string PlacementTransition::Encode() const {
  std::vector<std::string> moves;
  for (uint32_t shard = 0; shard < kNumShards; ++shard) {
    const ShardMove& m = shards[shard];
    std::string marks;
    for (const auto& [owner, sequence] : m.watermarks) {
      if (!marks.empty()) marks += ',';
      marks += fmt::format("{}={}", owner, sequence);
    }
    moves.push_back(fmt::format("{}:{}:{}:{}", shard, ShardMoveStateName(m.state), m.since_ms, marks));
  }
  return FlatJsonWriter()
      .Add("v", kPlacementTransitionVersion)
      .Add("phase", PlacementPhaseName(phase))
      .Add("from_generation", from_generation)
      .Add("to_generation", from_generation + 1)
      .Add("replicas", static_cast<int64_t>(to_replicas))
      .Add("catalog_nodes", to_nodes)
      .Add("leader", leader)
      .Add("started_ms", started_ms)
      .Add("phase_ms", phase_ms)
      .Add("reason", reason)
      .Add("shards", moves)
      .Finish();
}

Result<PlacementTransition> PlacementTransition::Decode(std::string_view bytes) {
  ORBITKV_ASSIGN_OR_RETURN(FlatJsonObject json,
                           ParseVersioned(bytes, kPlacementTransitionVersion, "placement transition record"));
  PlacementTransition t;
  ORBITKV_ASSIGN_OR_RETURN(std::string phase, json.GetString("phase"));
  const auto named = std::find(std::begin(kPhaseNames), std::end(kPhaseNames), phase);
  if (named == std::end(kPhaseNames)) {
    return Status::InvalidArgument(fmt::format("placement transition phase '{}' is unknown", phase));
  }
  t.phase = static_cast<Phase>(named - std::begin(kPhaseNames));
  ORBITKV_ASSIGN_OR_RETURN(t.from_generation, json.GetInt("from_generation"));
  ORBITKV_ASSIGN_OR_RETURN(int64_t to_generation, json.GetInt("to_generation"));
  if (t.from_generation < 1 || to_generation != t.from_generation + 1) {
    return Status::InvalidArgument(
        fmt::format("placement transition from generation {} to {}", t.from_generation, to_generation));
  }
  ORBITKV_ASSIGN_OR_RETURN(int64_t replicas, json.GetInt("replicas"));
  ORBITKV_ASSIGN_OR_RETURN(t.to_nodes, json.GetStringArray("catalog_nodes"));
  if (replicas < 1 || replicas > static_cast<int64_t>(kMaxCatalogReplicas)) {
    return Status::InvalidArgument(fmt::format("placement transition asks for {} replicas", replicas));
  }
  t.to_replicas = static_cast<uint32_t>(replicas);
  ORBITKV_RETURN_IF_ERROR(
      Placement::Create(t.to_nodes, t.to_replicas, to_generation).status().WithContext("placement transition"));
  ORBITKV_ASSIGN_OR_RETURN(t.leader, json.GetString("leader"));
  ORBITKV_ASSIGN_OR_RETURN(t.started_ms, json.GetInt("started_ms"));
  ORBITKV_ASSIGN_OR_RETURN(t.phase_ms, json.GetInt("phase_ms"));
  ORBITKV_ASSIGN_OR_RETURN(t.reason, json.GetString("reason"));
  ORBITKV_ASSIGN_OR_RETURN(std::vector<std::string> moves, json.GetStringArray("shards"));
  if (moves.size() != kNumShards) {
    return Status::InvalidArgument(
        fmt::format("placement transition lists {} shards, not {}", moves.size(), kNumShards));
  }
  for (uint32_t shard = 0; shard < kNumShards; ++shard) {
    const std::vector<std::string_view> fields = Split(moves[shard], ':');
    if (fields.size() != 4) {
      return Status::InvalidArgument(fmt::format("placement transition shard entry '{}' is malformed", moves[shard]));
    }
    ORBITKV_ASSIGN_OR_RETURN(uint64_t index, ParseNumber(fields[0], "shard"));
    if (index != shard) {
      return Status::InvalidArgument(fmt::format("placement transition lists shard {} at {}", index, shard));
    }
    const auto state = std::find(std::begin(kStateNames), std::end(kStateNames), fields[1]);
    if (state == std::end(kStateNames)) {
      return Status::InvalidArgument(fmt::format("placement transition shard state '{}' is unknown", fields[1]));
    }
    ShardMove& m = t.shards[shard];
    m.state = static_cast<ShardMove::State>(state - std::begin(kStateNames));
    ORBITKV_ASSIGN_OR_RETURN(uint64_t since, ParseNumber(fields[2], "since"));
    m.since_ms = static_cast<int64_t>(since);
    if (fields[3].empty()) continue;
    for (std::string_view mark : Split(fields[3], ',')) {
      const size_t equals = mark.rfind('=');
      if (equals == std::string_view::npos) {
        return Status::InvalidArgument(fmt::format("placement transition watermark '{}' is malformed", mark));
      }
      const std::string owner(mark.substr(0, equals));
      ORBITKV_RETURN_IF_ERROR(ValidateName("a watermark's owner", owner));
      ORBITKV_ASSIGN_OR_RETURN(m.watermarks[owner], ParseNumber(mark.substr(equals + 1), "watermark"));
    }
  }
  return t;
}

std::string PlacementRequest::Encode() const {
  return FlatJsonWriter()
      .Add("v", int64_t{1})
      .Add("catalog_nodes", catalog_nodes)
      .Add("replicas", static_cast<int64_t>(replicas))
      .Add("requested_by", requested_by)
      .Add("requested_ms", requested_ms)
      .Add("base_generation", base_generation)
      .Add("abort", int64_t{abort ? 1 : 0})
      .Finish();
}

Result<PlacementRequest> PlacementRequest::Decode(std::string_view bytes) {
  ORBITKV_ASSIGN_OR_RETURN(FlatJsonObject json, ParseVersioned(bytes, 1, "placement request"));
  PlacementRequest r;
  ORBITKV_ASSIGN_OR_RETURN(r.catalog_nodes, json.GetStringArray("catalog_nodes"));
  ORBITKV_ASSIGN_OR_RETURN(int64_t replicas, json.GetInt("replicas"));
  if (replicas < 1 || replicas > static_cast<int64_t>(kMaxCatalogReplicas)) {
    return Status::InvalidArgument(fmt::format("placement request asks for {} replicas", replicas));
  }
  r.replicas = static_cast<uint32_t>(replicas);
  ORBITKV_RETURN_IF_ERROR(Placement::Create(r.catalog_nodes, r.replicas).status().WithContext("placement request"));
  ORBITKV_ASSIGN_OR_RETURN(r.requested_by, json.GetString("requested_by"));
  ORBITKV_ASSIGN_OR_RETURN(r.requested_ms, json.GetInt("requested_ms"));
  if (json.Has("base_generation")) {
    ORBITKV_ASSIGN_OR_RETURN(r.base_generation, json.GetInt("base_generation"));
    if (r.base_generation < 0) return Status::InvalidArgument("placement request: a negative base_generation");
  }
  if (json.Has("abort")) {
    ORBITKV_ASSIGN_OR_RETURN(int64_t abort, json.GetInt("abort"));
    if (abort != 0 && abort != 1) return Status::InvalidArgument("placement request: abort is 0 or 1");
    r.abort = abort == 1;
  }
  return r;
}

}  // namespace orbitkv::cluster
