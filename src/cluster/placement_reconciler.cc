#include "cluster/placement_reconciler.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "base/logging.h"
#include "cluster/cluster_keys.h"

namespace orbitkv::cluster {
namespace {

etcdserverpb::Compare* AddCompare(etcdserverpb::TxnRequest* txn, const std::string& key,
                                  etcdserverpb::Compare::CompareTarget target) {
  etcdserverpb::Compare* compare = txn->add_compare();
  compare->set_key(key);
  compare->set_target(target);
  compare->set_result(etcdserverpb::Compare::EQUAL);
  return compare;
}

void Put(etcdserverpb::TxnRequest* txn, const std::string& key, const std::string& value) {
  etcdserverpb::PutRequest* put = txn->add_success()->mutable_request_put();
  put->set_key(key);
  put->set_value(value);
}

void Delete(etcdserverpb::TxnRequest* txn, const std::string& key) {
  txn->add_success()->mutable_request_delete_range()->set_key(key);
}

constexpr std::string_view kDidNames[] = {"nothing", "not leader", "started", "advanced",
                                          "waiting", "committed",  "aborted", "retired"};

}  // namespace

std::string_view ReconcilerDidName(PlacementReconciler::Did did) { return kDidNames[static_cast<int>(did)]; }

Result<etcdserverpb::RangeResponse> RangePlacementRecords(EtcdClient& etcd, std::string_view cluster,
                                                          Deadline deadline) {
  etcdserverpb::RangeRequest range;
  range.set_key(PlacementKey(cluster));
  std::string end = PlacementTransitionKey(cluster);
  end.push_back('\0');
  range.set_range_end(end);
  return etcd.Range(range, deadline);
}

Result<bool> SubmitPlacementRequest(EtcdClient& etcd, std::string_view cluster, const PlacementRequest& request,
                                    Deadline deadline, int64_t placement_revision) {
  const std::string key = PlacementRequestKey(cluster);
  etcdserverpb::TxnRequest txn;
  AddCompare(&txn, key, etcdserverpb::Compare::CREATE)->set_create_revision(0);
  if (placement_revision != 0) {
    AddCompare(&txn, PlacementKey(cluster), etcdserverpb::Compare::MOD)->set_mod_revision(placement_revision);
  }
  Put(&txn, key, request.Encode());
  ORBITKV_ASSIGN_OR_RETURN(etcdserverpb::TxnResponse response, etcd.Txn(txn, deadline));
  return response.succeeded();
}

// ---- Leadership -----------------------------------------------------------------------------------------------

ReconcilerLeadership::ReconcilerLeadership(EtcdClient* etcd, std::string cluster, std::string self, std::string runtime)
    : etcd_(etcd), key_(ReconcilerLeaderKey(cluster)), value_(fmt::format("{}/{}", self, runtime)) {}

Result<bool> ReconcilerLeadership::Campaign(int64_t lease, Deadline deadline) {
  etcdserverpb::TxnRequest txn;
  AddCompare(&txn, key_, etcdserverpb::Compare::CREATE)->set_create_revision(0);
  etcdserverpb::PutRequest* put = txn.add_success()->mutable_request_put();
  put->set_key(key_);
  put->set_value(value_);
  put->set_lease(lease);
  txn.add_failure()->mutable_request_range()->set_key(key_);
  ORBITKV_ASSIGN_OR_RETURN(etcdserverpb::TxnResponse response, etcd_->Txn(txn, deadline));
  MutexLock lock(&mu_);
  if (response.succeeded()) {
    leading_ = true;
    term_ = response.header().revision();
    return true;
  }
  const auto& kvs = response.responses(0).response_range().kvs();
  // Already this start's (a campaign repeated after an answer that was lost).
  leading_ = kvs.size() == 1 && kvs[0].value() == value_;
  term_ = leading_ ? kvs[0].create_revision() : 0;
  return leading_;
}

bool ReconcilerLeadership::leading() const {
  MutexLock lock(&mu_);
  return leading_;
}

int64_t ReconcilerLeadership::term() const {
  MutexLock lock(&mu_);
  return term_;
}

Result<std::string> ReconcilerLeadership::Leader(Deadline deadline) const {
  etcdserverpb::RangeRequest range;
  range.set_key(key_);
  ORBITKV_ASSIGN_OR_RETURN(etcdserverpb::RangeResponse response, etcd_->Range(range, deadline));
  return response.kvs_size() == 1 ? response.kvs(0).value() : std::string();
}

void ReconcilerLeadership::Lapsed() {
  MutexLock lock(&mu_);
  leading_ = false;
}

bool ReconcilerLeadership::Guard(etcdserverpb::TxnRequest* txn) const {
  MutexLock lock(&mu_);
  if (!leading_) return false;
  AddCompare(txn, key_, etcdserverpb::Compare::CREATE)->set_create_revision(term_);
  AddCompare(txn, key_, etcdserverpb::Compare::VALUE)->set_value(value_);
  return true;
}

bool ReconcilerLeadership::CheckDeposed(Deadline deadline) {
  etcdserverpb::RangeRequest range;
  range.set_key(key_);
  Result<etcdserverpb::RangeResponse> response = etcd_->Range(range, deadline);
  if (!response.ok()) return false;  // unknown: the next pass asks again
  MutexLock lock(&mu_);
  const bool ours =
      response->kvs_size() == 1 && response->kvs(0).create_revision() == term_ && response->kvs(0).value() == value_;
  if (!ours) leading_ = false;
  return !ours;
}

// ---- Reconciler -------------------------------------------------------------------------------------------------

PlacementReconciler::PlacementReconciler(Options options, EtcdClient* etcd)
    : options_(std::move(options)), etcd_(etcd) {}

Result<PlacementReconciler::Snapshot> PlacementReconciler::Read(Deadline deadline) const {
  Snapshot s;
  ORBITKV_ASSIGN_OR_RETURN(etcdserverpb::RangeResponse response,
                           RangePlacementRecords(*etcd_, options_.cluster, deadline));
  for (const mvccpb::KeyValue& kv : response.kvs()) {
    if (kv.key() == PlacementKey(options_.cluster)) {
      ORBITKV_ASSIGN_OR_RETURN(Placement p, Placement::Decode(kv.value()));
      s.placement = std::move(p);
      s.placement_revision = kv.mod_revision();
    } else if (kv.key() == PlacementTransitionKey(options_.cluster)) {
      ORBITKV_ASSIGN_OR_RETURN(PlacementTransition t, PlacementTransition::Decode(kv.value()));
      s.transition = std::move(t);
      s.transition_revision = kv.mod_revision();
    } else if (kv.key() == PlacementRequestKey(options_.cluster)) {
      Result<PlacementRequest> r = PlacementRequest::Decode(kv.value());
      if (!r.ok()) {
        ORBITKV_LOG_WARN("cluster {}: ignoring a malformed placement request: {}", options_.cluster,
                         r.status().ToString());
        continue;
      }
      s.request = std::move(r).value();
      s.request_revision = kv.mod_revision();
    }
  }
  return s;
}

Result<bool> PlacementReconciler::Commit(ReconcilerLeadership& leadership, etcdserverpb::TxnRequest txn,
                                         Outcome* lost) {
  if (!leadership.Guard(&txn)) {
    *lost = Outcome{Did::kNotLeader, "not the reconciler leader"};
    return false;
  }
  for (const etcdserverpb::RequestOp& op : txn.success()) {
    if (op.has_request_put() && op.request_put().value().size() > options_.max_record_bytes) {
      return Status::ResourceExhausted(
          fmt::format("the placement record {} would be {} bytes, more than the {} a record may have: not written",
                      op.request_put().key(), op.request_put().value().size(), options_.max_record_bytes));
    }
  }
  // A fresh deadline: whatever the pass spent before (status calls to slow copies) cannot make the write fail.
  const Deadline deadline = Deadline::After(options_.etcd_call);
  ORBITKV_ASSIGN_OR_RETURN(etcdserverpb::TxnResponse response, etcd_->Txn(txn, deadline));
  if (response.succeeded()) return true;
  *lost = leadership.CheckDeposed(deadline)
              ? Outcome{Did::kNotLeader, "deposed: another reconciler leads now; the write changed nothing"}
              : Outcome{Did::kWaiting, "the placement records changed under this pass; reading them again"};
  return false;
}

Result<PlacementReconciler::Outcome> PlacementReconciler::Step(ReconcilerLeadership& leadership, Deadline deadline) {
  if (!leadership.leading()) return Outcome{Did::kNotLeader, "not the reconciler leader"};
  ORBITKV_ASSIGN_OR_RETURN(Snapshot s, Read(deadline));
  CountUnconfirmed(s);
  if (!s.placement.has_value()) return Outcome{Did::kNothing, "no placement installed yet"};
  return Advance(leadership, s);
}

void PlacementReconciler::CountUnconfirmed(const Snapshot& s) {
  if (!unconfirmed_.has_value()) return;
  const Unconfirmed u = *unconfirmed_;
  if (s.transition.has_value() && s.transition->from_generation == u.from_generation &&
      s.transition->started_ms == u.started_ms) {
    // Still moving: that write did not take effect (this read follows it); the pass writes again and counts that.
    if (s.transition->phase == u.phase) {
      ++(u.phase == PlacementTransition::Phase::kAborted ? stats_.aborted : stats_.committed);
      ORBITKV_LOG_INFO("cluster {}: the placement change's {} (whose write answered an error) took effect",
                       options_.cluster, PlacementPhaseName(u.phase));
    }
  }
  unconfirmed_.reset();
}

void PlacementReconciler::Credit(const PlacementTransition& t, int64_t now) {
  const std::pair<int64_t, int64_t> change{t.from_generation, t.started_ms};
  if (change != credited_change_) {
    credited_change_ = change;
    waited_ms_.fill(0);
    last_read_ms_ = 0;
    for (auto& marks : marks_) marks.clear();
    marked_.fill(false);
  }
  const int64_t credit =
      last_read_ms_ == 0 ? 0 : std::clamp<int64_t>(now - last_read_ms_, 0, options_.max_step_credit.count());
  last_read_ms_ = now;
  for (uint32_t shard = 0; shard < kNumShards; ++shard) {
    if (t.shards[shard].state == ShardMove::State::kMoving) waited_ms_[shard] += credit;
  }
}

void PlacementReconciler::TakeWatermarks(const Placement& from, uint32_t shard,
                                         const std::map<std::string, uint64_t>& live) {
  std::map<std::string, Watermark>& marks = marks_[shard];
  marks.clear();
  for (const auto& [owner, start] : live) marks[owner] = Watermark{start, 0};
  for (const std::string& copy : from.CopiesOf(shard)) {
    // Each call with its own deadline: a copy that never answers costs one call, not the pass.
    Result<std::map<std::string, OwnerProgress>> status =
        options_.progress->ShardStatus(copy, shard, from.generation(), Deadline::After(options_.status_call));
    if (!status.ok()) continue;  // another copy knows; a sequence nobody reports starts at 0
    for (const auto& [owner, p] : *status) {
      auto mark = marks.find(owner);
      if (mark == marks.end()) continue;
      // Only the live start's sequences: a slice of an earlier start (not dropped yet) says nothing of this one.
      if (mark->second.incarnation != 0 && p.incarnation != 0 && p.incarnation != mark->second.incarnation) continue;
      mark->second.sequence = std::max(mark->second.sequence, p.sequence);
    }
  }
  marked_[shard] = true;
}

std::string PlacementReconciler::Behind(const Placement& from, const Placement& to, uint32_t shard,
                                        const std::map<std::string, uint64_t>& live) {
  for (const std::string& copy : PlacementTransition::NewCopies(from, to, shard)) {
    Result<std::map<std::string, OwnerProgress>> status =
        options_.progress->ShardStatus(copy, shard, to.generation(), Deadline::After(options_.status_call));
    if (!status.ok()) return fmt::format("copy '{}' did not answer ({})", copy, status.status().message());
    for (const auto& [owner, mark] : marks_[shard]) {
      auto now = live.find(owner);
      if (now == live.end()) continue;  // gone since: nothing more of it to wait for
      // The start the copy must hold: the live one (it may have started again since the watermark was taken).
      const uint64_t start = now->second != 0 ? now->second : mark.incarnation;
      auto p = status->find(owner);
      std::string holds;
      if (p == status->end()) {
        holds = "nothing";
      } else if (start != 0 && p->second.incarnation != 0 && p->second.incarnation != start) {
        holds = fmt::format("a start ({:016x}) that is not its live one ({:016x})", p->second.incarnation, start);
      } else if (!p->second.baseline) {
        holds = "no baseline";
      } else if (mark.incarnation == start && p->second.sequence < mark.sequence) {
        // (A live start other than the one the watermark was taken of, 0 "not said" included: the owner started
        // again since, and its new start's baseline suffices.)
        holds = std::to_string(p->second.sequence);
      }
      if (!holds.empty())
        return fmt::format("copy '{}' holds owner '{}' at {} of {}", copy, owner, holds, mark.sequence);
    }
  }
  return "";
}

Result<PlacementReconciler::Outcome> PlacementReconciler::Advance(ReconcilerLeadership& leadership, const Snapshot& s) {
  const std::string cluster = options_.cluster;
  const Placement& from = *s.placement;
  const int64_t now = options_.now_ms();
  Outcome lost;
  if (!s.transition.has_value()) {
    if (!s.request.has_value()) return Outcome{Did::kNothing, ""};
    etcdserverpb::TxnRequest txn;
    AddCompare(&txn, PlacementKey(cluster), etcdserverpb::Compare::MOD)->set_mod_revision(s.placement_revision);
    AddCompare(&txn, PlacementTransitionKey(cluster), etcdserverpb::Compare::CREATE)->set_create_revision(0);
    AddCompare(&txn, PlacementRequestKey(cluster), etcdserverpb::Compare::MOD)->set_mod_revision(s.request_revision);
    Delete(&txn, PlacementRequestKey(cluster));
    // Requests that change nothing: an abort with no change moving, and one built on another generation (it would
    // undo what that generation changed). Dropped, and said.
    std::string refused;
    if (s.request->abort) {
      refused = fmt::format("an abort asked on node {} found no change in progress", s.request->requested_by);
    } else if (s.request->base_generation != 0 && s.request->base_generation != from.generation()) {
      refused = fmt::format(
          "a request from node {} was built on placement generation {}, and the placement is at generation {} "
          "(catalog nodes {}): refused; ask again",
          s.request->requested_by, s.request->base_generation, from.generation(), fmt::join(from.catalog_nodes(), ","));
    }
    if (!refused.empty()) {
      ORBITKV_ASSIGN_OR_RETURN(bool done, Commit(leadership, std::move(txn), &lost));
      if (!done) return lost;
      ++stats_.refused;
      ORBITKV_LOG_WARN("cluster {}: placement request dropped: {}", cluster, refused);
      return Outcome{Did::kNothing, refused};
    }
    ORBITKV_ASSIGN_OR_RETURN(Placement wanted, Placement::Create(s.request->catalog_nodes, s.request->replicas));
    if (wanted.SameContent(from)) {
      ORBITKV_ASSIGN_OR_RETURN(bool done, Commit(leadership, std::move(txn), &lost));
      return done ? Outcome{Did::kNothing, "the requested placement is the current one"} : lost;
    }
    const PlacementTransition t = PlacementTransition::Start(from, wanted, leadership.value(), now);
    Put(&txn, PlacementTransitionKey(cluster), t.Encode());
    ORBITKV_ASSIGN_OR_RETURN(bool done, Commit(leadership, std::move(txn), &lost));
    if (!done) return lost;
    ++stats_.started;
    ORBITKV_LOG_INFO("cluster {}: placement change started: generation {} -> {} ({}), {} shard(s) to move", cluster,
                     from.generation(), from.generation() + 1, fmt::join(wanted.catalog_nodes(), ","),
                     t.CountIn(ShardMove::State::kWaiting));
    return Outcome{Did::kStarted, fmt::format("{} shard(s) to move", t.CountIn(ShardMove::State::kWaiting))};
  }

  PlacementTransition t = *s.transition;
  etcdserverpb::TxnRequest txn;
  AddCompare(&txn, PlacementKey(cluster), etcdserverpb::Compare::MOD)->set_mod_revision(s.placement_revision);
  AddCompare(&txn, PlacementTransitionKey(cluster), etcdserverpb::Compare::MOD)
      ->set_mod_revision(s.transition_revision);
  if (t.phase != PlacementTransition::Phase::kMoving) {
    if (now - t.phase_ms < options_.retire_grace.count()) {
      return Outcome{Did::kWaiting,
                     fmt::format("{}: the old copies retire after the grace period", PlacementPhaseName(t.phase))};
    }
    Delete(&txn, PlacementTransitionKey(cluster));
    ORBITKV_ASSIGN_OR_RETURN(bool done, Commit(leadership, std::move(txn), &lost));
    return done ? Outcome{Did::kRetired, std::string(PlacementPhaseName(t.phase))} : lost;
  }
  Credit(t, now);
  if (t.from_generation != from.generation()) {
    // Cannot happen through this code (the commit writes both records at once); a hand-edited etcd can.
    t.phase = PlacementTransition::Phase::kAborted;
    t.reason = fmt::format("the placement is at generation {}, the transition started from {}", from.generation(),
                           t.from_generation);
  }
  const Placement to = t.To();
  const std::map<std::string, uint64_t> live =
      options_.live_owners ? options_.live_owners() : std::map<std::string, uint64_t>();
  // The operator's abort ends the change now (its request goes in the same write).
  if (t.phase == PlacementTransition::Phase::kMoving && s.request.has_value() && s.request->abort) {
    t.phase = PlacementTransition::Phase::kAborted;
    t.reason = fmt::format("aborted by the operator (asked on node {})", s.request->requested_by);
    AddCompare(&txn, PlacementRequestKey(cluster), etcdserverpb::Compare::MOD)->set_mod_revision(s.request_revision);
    Delete(&txn, PlacementRequestKey(cluster));
  }
  bool changed = t.phase != PlacementTransition::Phase::kMoving;
  // Moving shards: ready once every new copy has each live watermarked owner's baseline past its watermark.
  for (uint32_t shard = 0; shard < kNumShards && t.phase == PlacementTransition::Phase::kMoving; ++shard) {
    ShardMove& m = t.shards[shard];
    if (m.state != ShardMove::State::kMoving) continue;
    // A move this leader did not start (another leader's, or its own before a restart): the watermarks again, now
    // (the current copies' sequences: at least what the earlier leader waited for, of the same start).
    if (!marked_[shard]) TakeWatermarks(from, shard, live);
    const std::string behind = Behind(from, to, shard, live);
    if (behind.empty()) {
      m.state = ShardMove::State::kReady;
      m.since_ms = now;
      m.watermarks.clear();
      changed = true;
      ++stats_.shard_moves;
    } else if (waited_ms_[shard] > options_.shard_bound.count()) {
      t.phase = PlacementTransition::Phase::kAborted;
      t.reason =
          fmt::format("shard {} did not converge within {} s: {}", shard, options_.shard_bound.count() / 1000, behind);
      changed = true;
    }
  }
  // Watermarks an older leader wrote into the record go with this write: the record stays bounded (they were taken
  // again above, from the current copies).
  for (ShardMove& m : t.shards) {
    if (!m.watermarks.empty()) {
      m.watermarks.clear();
      changed = true;
    }
  }
  // Start waiting shards while fewer than max_moving move, each with its owners' watermarks now.
  for (uint32_t shard = 0; shard < kNumShards && t.phase == PlacementTransition::Phase::kMoving &&
                           t.CountIn(ShardMove::State::kMoving) < options_.max_moving;
       ++shard) {
    ShardMove& m = t.shards[shard];
    if (m.state != ShardMove::State::kWaiting) continue;
    TakeWatermarks(from, shard, live);
    m.watermarks.clear();  // kept here, not in the record (bounded whatever the member count)
    m.state = ShardMove::State::kMoving;
    m.since_ms = now;
    waited_ms_[shard] = 0;
    changed = true;
  }
  if (t.phase == PlacementTransition::Phase::kMoving && t.AllReady()) {
    t.phase = PlacementTransition::Phase::kCommitted;
    t.phase_ms = now;
    Put(&txn, PlacementKey(cluster), to.Encode());
    Put(&txn, PlacementTransitionKey(cluster), t.Encode());
    Result<bool> done = Commit(leadership, std::move(txn), &lost);
    if (!done.ok()) {
      // Sent, and perhaps applied (a refusal before sending is ResourceExhausted): a later read tells.
      if (done.status().code() != StatusCode::kResourceExhausted) {
        unconfirmed_ = Unconfirmed{t.from_generation, t.started_ms, t.phase};
      }
      return done.status();
    }
    if (!*done) return lost;
    ++stats_.committed;
    ORBITKV_LOG_INFO("cluster {}: placement generation {} committed ({})", cluster, to.generation(),
                     fmt::join(to.catalog_nodes(), ","));
    return Outcome{Did::kCommitted, fmt::format("generation {}", to.generation())};
  }
  if (!changed) {
    return Outcome{Did::kWaiting, fmt::format("{} shard(s) moving", t.CountIn(ShardMove::State::kMoving))};
  }
  if (t.phase == PlacementTransition::Phase::kAborted) t.phase_ms = now;
  Put(&txn, PlacementTransitionKey(cluster), t.Encode());
  Result<bool> done = Commit(leadership, std::move(txn), &lost);
  if (!done.ok()) {
    if (t.phase == PlacementTransition::Phase::kAborted && done.status().code() != StatusCode::kResourceExhausted) {
      unconfirmed_ = Unconfirmed{t.from_generation, t.started_ms, t.phase};
    }
    return done.status();
  }
  if (!*done) return lost;
  if (t.phase == PlacementTransition::Phase::kAborted) {
    ++stats_.aborted;
    ORBITKV_LOG_WARN("cluster {}: placement change to generation {} aborted: {}", cluster, to.generation(), t.reason);
    return Outcome{Did::kAborted, t.reason};
  }
  return Outcome{Did::kAdvanced, fmt::format("{} shard(s) moving, {} ready", t.CountIn(ShardMove::State::kMoving),
                                             t.CountIn(ShardMove::State::kReady))};
}

}  // namespace orbitkv::cluster
