#include "cluster/live_placement.h"

#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "base/logging.h"
#include "cluster/cluster_keys.h"
#include "cluster/etcd_client.h"
#include "cluster/placement_reconciler.h"

namespace orbitkv::cluster {

namespace {

void AddUnique(std::vector<std::string>& to, const std::vector<std::string>& from) {
  for (const std::string& node : from) {
    if (std::find(to.begin(), to.end(), node) == to.end()) to.push_back(node);
  }
}

}  // namespace

// ---- State -------------------------------------------------------------------------------------------------------

std::vector<std::string> LivePlacement::State::PublishCopies(uint32_t shard) const {
  std::vector<std::string> copies = committed.CopiesOf(shard);
  if (moving() && next.has_value()) {
    const ShardMove::State s = transition->shards[shard].state;
    if (s == ShardMove::State::kMoving || s == ShardMove::State::kReady) {
      AddUnique(copies, PlacementTransition::NewCopies(committed, *next, shard));
    }
  }
  return copies;
}

std::vector<std::string> LivePlacement::State::QueryCopies(uint32_t shard) const {
  // The same set: the new copies of a moving or ready shard come after the committed ones, so they are asked only
  // when those fail, are slow or incomplete.
  return PublishCopies(shard);
}

bool LivePlacement::State::Hosts(uint32_t shard, std::string_view node) const {
  if (committed.Keeps(shard, node)) return true;
  if (moving() && next.has_value() && next->Keeps(shard, node)) return true;
  return previous.has_value() && previous->Keeps(shard, node);
}

bool LivePlacement::State::Accepts(std::string_view fingerprint) const {
  if (fingerprint == committed.fingerprint()) return true;
  if (moving() && next.has_value() && fingerprint == next->fingerprint()) return true;
  return previous.has_value() && fingerprint == previous->fingerprint();
}

bool LivePlacement::State::Serves(int64_t generation) const {
  return generation == committed.generation() || (moving() && next.has_value() && generation == next->generation());
}

// ---- LivePlacement -----------------------------------------------------------------------------------------------

LivePlacement::LivePlacement(Placement committed) {
  auto state = std::make_shared<State>(State{.committed = std::move(committed)});
  MutexLock lock(&mu_);
  state_ = std::move(state);
}

std::shared_ptr<const LivePlacement::State> LivePlacement::Get() const {
  MutexLock lock(&mu_);
  return state_;
}

std::string LivePlacement::Regression(const Placement& current, const Placement& incoming) {
  if (incoming.generation() < current.generation()) {
    return fmt::format("placement record went back from generation {} to {} ({})", current.generation(),
                       incoming.generation(), incoming.Encode());
  }
  if (incoming.generation() == current.generation() && !incoming.SameContent(current)) {
    return fmt::format("placement record of generation {} changed in place to {}", incoming.generation(),
                       incoming.Encode());
  }
  return std::string();
}

void LivePlacement::Publish(std::shared_ptr<State> next) {
  // The next placement only while the transition moves from the committed generation.
  next->next.reset();
  if (next->transition.has_value() && next->transition->from_generation == next->committed.generation() &&
      next->transition->phase == PlacementTransition::Phase::kMoving) {
    next->next = next->transition->To();
  }
  if (!next->transition.has_value()) next->previous.reset();
  const State& now = *state_;
  const bool same = now.committed == next->committed && now.transition.has_value() == next->transition.has_value() &&
                    (!now.transition || now.transition->Encode() == next->transition->Encode()) &&
                    now.previous.has_value() == next->previous.has_value() &&
                    (!now.previous || *now.previous == *next->previous) &&
                    now.request.has_value() == next->request.has_value() &&
                    (!now.request || now.request->Encode() == next->request->Encode()) && now.leader == next->leader;
  if (same) return;
  state_ = std::move(next);
  version_.fetch_add(1, std::memory_order_acq_rel);
}

void LivePlacement::LogIgnored(std::string_view what, const Status& status) {
  const std::string line = fmt::format("{}: {}", what, status.message());
  if (line != last_ignored_) {
    ORBITKV_LOG_WARN("cluster: ignoring the {} record: {}", what, status.message());
    last_ignored_ = line;
  }
}

std::string LivePlacement::Apply(const std::map<std::string, std::string>& records) {
  MutexLock lock(&mu_);
  auto next = std::make_shared<State>(*state_);
  const auto placement = records.find(std::string(kPlacementRecordName));
  if (placement == records.end()) return "placement record was removed";
  Result<Placement> committed = Placement::Decode(placement->second);
  if (!committed.ok()) return fmt::format("placement record is unreadable: {}", committed.status().message());
  if (std::string why = Regression(next->committed, *committed); !why.empty()) return why;
  if (committed->generation() > next->committed.generation()) {
    ORBITKV_LOG_INFO("cluster: catalog placement generation {} adopted ({}, {} copies a shard; was generation {})",
                     committed->generation(), fmt::join(committed->catalog_nodes(), ","), committed->replicas(),
                     next->committed.generation());
    // The copies of the generation just before stay until the transition record goes; an older one is gone.
    if (committed->generation() == next->committed.generation() + 1) {
      next->previous = std::move(next->committed);
    } else {
      next->previous.reset();
    }
    next->committed = *std::move(committed);
  }
  const auto ignore = [this](std::string_view what, const Status& status) NO_THREAD_SAFETY_ANALYSIS {
    LogIgnored(what, status);  // under `lock` (the analysis does not follow it into lambdas)
  };
  // The record `name` into `out` (none when absent or malformed).
  const auto decode = [&]<typename T>(std::string_view name, std::optional<T>* out) {
    out->reset();
    const auto found = records.find(std::string(name));
    if (found == records.end()) return;
    Result<T> decoded = T::Decode(found->second);
    if (decoded.ok()) {
      *out = *std::move(decoded);
    } else {
      ignore(name, decoded.status());
    }
  };
  decode(kTransitionRecordName, &next->transition);
  decode(kRequestRecordName, &next->request);
  const auto leader = records.find(std::string(kLeaderRecordName));
  next->leader = leader == records.end() ? std::string() : leader->second;
  Publish(std::move(next));
  return std::string();
}

Status LivePlacement::Adopt(const Placement& committed, const std::optional<PlacementTransition>& transition,
                            bool initial) {
  MutexLock lock(&mu_);
  auto next = std::make_shared<State>(*state_);
  if (initial) {
    next->committed = committed;
    next->previous.reset();
  } else if (std::string why = Regression(state_->committed, committed); !why.empty()) {
    return Status::FailedPrecondition(why);
  } else if (committed.generation() > next->committed.generation()) {
    if (committed.generation() == next->committed.generation() + 1) {
      next->previous = next->committed;
    } else {
      next->previous.reset();
    }
    next->committed = committed;
  }
  next->transition = transition;
  Publish(std::move(next));
  return Status::Ok();
}

Result<int64_t> JoinPlacement(EtcdClient& client, std::string_view cluster, const Placement& configured,
                              LivePlacement* live, bool initial, Deadline deadline) {
  ORBITKV_ASSIGN_OR_RETURN(etcdserverpb::RangeResponse response, RangePlacementRecords(client, cluster, deadline));
  const mvccpb::KeyValue* placement = nullptr;
  std::optional<PlacementTransition> transition;
  for (const mvccpb::KeyValue& kv : response.kvs()) {
    if (kv.key() == PlacementKey(cluster)) placement = &kv;
    if (kv.key() == PlacementTransitionKey(cluster)) {
      Result<PlacementTransition> t = PlacementTransition::Decode(kv.value());
      if (t.ok()) transition = *std::move(t);
    }
  }
  if (placement == nullptr) {
    if (!initial && live->Get()->committed.generation() > 1) {
      return Status::FailedPrecondition(
          fmt::format("the placement record of cluster '{}' was removed (this Manager routes by generation {})",
                      cluster, live->Get()->committed.generation()));
    }
    return InstallOrVerifyPlacement(client, cluster, configured, deadline);
  }
  Result<Placement> installed = Placement::Decode(placement->value());
  if (!installed.ok()) {
    return Status::DataLoss(
        fmt::format("placement record at {} is unreadable: {}", PlacementKey(cluster), installed.status().message()));
  }
  const bool changing_to_configured = transition.has_value() &&
                                      transition->phase == PlacementTransition::Phase::kMoving &&
                                      transition->To().SameContent(configured);
  if (initial && !installed->SameContent(configured)) {
    if (installed->generation() == 1 && !changing_to_configured) {
      // The mismatch error, naming both sets.
      return InstallOrVerifyPlacement(client, cluster, configured, deadline);
    }
    ORBITKV_LOG_INFO(
        "cluster {}: the catalog placement is generation {} ({}, {} copies a shard), not --catalog-nodes "
        "{}: it was changed online (`orbitkv catalog placement`), and the installed one is followed",
        cluster, installed->generation(), fmt::join(installed->catalog_nodes(), ","), installed->replicas(),
        fmt::join(configured.catalog_nodes(), ","));
  }
  ORBITKV_RETURN_IF_ERROR(live->Adopt(*installed, transition, initial));
  return placement->mod_revision();
}

}  // namespace orbitkv::cluster
