#include "server/distributed/placement_driver.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "base/logging.h"
#include "cluster/cluster_keys.h"

namespace orbitkv::server {

namespace {

int64_t WallMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

PlacementDriver::PlacementDriver(Options options, cluster::Membership* membership, cluster::CatalogProgress* progress)
    : options_(std::move(options)),
      membership_(membership),
      reconciler_(cluster::PlacementReconciler::Options{.cluster = options_.cluster,
                                                        .max_moving = options_.max_moving,
                                                        .shard_bound = options_.shard_bound,
                                                        .retire_grace = options_.retire_grace,
                                                        .now_ms = WallMs,
                                                        .live_owners =
                                                            [membership] {
                                                              std::map<std::string, uint64_t> live;
                                                              for (const cluster::Member& m :
                                                                   membership->view().Read().members) {
                                                                live[m.record.node_id] = m.record.incarnation;
                                                              }
                                                              return live;
                                                            },
                                                        .progress = progress},
                  &membership->etcd()) {
  const cluster::MemberRecord self = membership->self();
  leadership_ = std::make_shared<cluster::ReconcilerLeadership>(&membership->etcd(), options_.cluster, self.node_id,
                                                                self.runtime_uuid);
}

PlacementDriver::~PlacementDriver() { Stop(); }

void PlacementDriver::Start() {
  MutexLock lock(&mu_);
  if (thread_.joinable() || stop_) return;
  thread_ = std::thread([this] { Run(); });
}

void PlacementDriver::Stop() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void PlacementDriver::OnLapsed() {
  MutexLock lock(&mu_);
  if (leadership_->leading()) {
    ORBITKV_LOG_WARN("cluster {}: this Manager gives up leading the placement reconciler (its registration lapsed)",
                     options_.cluster);
  }
  leadership_->Lapsed();
}

void PlacementDriver::OnRegistered(const cluster::MemberRecord& self) {
  {
    MutexLock lock(&mu_);
    leadership_->Lapsed();
    leadership_ = std::make_shared<cluster::ReconcilerLeadership>(&membership_->etcd(), options_.cluster, self.node_id,
                                                                  self.runtime_uuid);
  }
  wake_.notify_all();
}

void PlacementDriver::Run() {
  while (true) {
    const std::chrono::milliseconds wait = Round();
    MutexLock lock(&mu_);
    const MonoTime until = MonoNow() + wait;
    while (!stop_ && MonoNow() < until) wake_.wait_until(mu_, until);
    if (stop_) return;
  }
}

std::chrono::milliseconds PlacementDriver::Round() {
  std::shared_ptr<cluster::ReconcilerLeadership> leadership;
  {
    MutexLock lock(&mu_);
    leadership = leadership_;
  }
  const std::shared_ptr<const cluster::LivePlacement::State> live = membership_->live_placement().Get();
  // Steady state: nothing asked, nothing moving: no etcd call at all.
  if (!live->request.has_value() && !live->transition.has_value()) return options_.step_interval;
  if (!membership_->CanDoRemoteWork()) return options_.step_interval;  // no current registration or view
  const Deadline deadline = Deadline::After(std::chrono::seconds(5));
  if (!leadership->leading()) {
    // Another start leads (or an older start's key waits for its lease to go); this start's own key is taken back.
    if (!live->leader.empty() && live->leader != leadership->value()) return options_.step_interval;
    const cluster::MembershipStatus status = membership_->GetStatus();
    Result<bool> won = leadership->Campaign(status.lease_id, deadline);
    if (!won.ok()) {
      ORBITKV_LOG_WARN("cluster {}: campaigning for the placement reconciler failed: {}", options_.cluster,
                       won.status().ToString());
      return options_.step_interval;
    }
    if (!*won) return options_.step_interval;
    ORBITKV_LOG_INFO("cluster {}: node {} leads the placement reconciler (term {})", options_.cluster, options_.node_id,
                     leadership->term());
  }
  Result<cluster::PlacementReconciler::Outcome> outcome = reconciler_.Step(*leadership, deadline);
  const cluster::PlacementReconciler::Stats stats = reconciler_.stats();
  std::string line;
  if (!outcome.ok()) {
    line = fmt::format("step failed: {}", outcome.status().ToString());
  } else {
    line = fmt::format("{}{}{}", cluster::ReconcilerDidName(outcome->did), outcome->detail.empty() ? "" : ": ",
                       outcome->detail);
  }
  MutexLock lock(&mu_);
  reconciler_stats_ = stats;
  if (line != last_outcome_) {
    ORBITKV_LOG_INFO("cluster {}: placement reconciler: {}", options_.cluster, line);
    last_outcome_ = line;
  }
  return options_.step_interval;
}

Result<std::vector<std::string>> PlacementDriver::Request(std::string_view verb, std::string_view node,
                                                          Deadline deadline) {
  if (verb != "add" && verb != "remove" && verb != "abort") {
    return Status::InvalidArgument(
        fmt::format("a placement change is 'add NODE', 'remove NODE' or 'abort', not '{}'", verb));
  }
  if (verb != "abort") ORBITKV_RETURN_IF_ERROR(cluster::ValidateName("the node to " + std::string(verb), node));
  const std::shared_ptr<const cluster::LivePlacement::State> live = membership_->live_placement().Get();
  if (verb == "abort") return RequestAbort(*live, deadline);
  if (live->moving()) {
    return Status::FailedPrecondition(fmt::format(
        "a placement change to generation {} is in progress ({} shard(s) moving, {} ready): ask again once it "
        "committed (`orbitkv catalog placement` shows it)",
        live->transition->from_generation + 1, live->transition->CountIn(cluster::ShardMove::State::kMoving),
        live->transition->CountIn(cluster::ShardMove::State::kReady)));
  }
  if (live->request.has_value()) {
    return Status::FailedPrecondition(fmt::format("a placement request ({}) waits for the reconciler already",
                                                  fmt::join(live->request->catalog_nodes, ",")));
  }
  if (!membership_->CanDoRemoteWork()) {
    return Status::Unavailable("this Manager's registration or member view is not current: try again shortly");
  }
  std::vector<std::string> nodes = live->committed.catalog_nodes();
  const bool present = std::find(nodes.begin(), nodes.end(), node) != nodes.end();
  if (verb == "add") {
    if (present) {
      return Status::FailedPrecondition(fmt::format("node '{}' keeps catalog copies already (generation {}: {})", node,
                                                    live->committed.generation(), fmt::join(nodes, ",")));
    }
    if (!membership_->view().Find(std::string(node)).ok()) {
      return Status::FailedPrecondition(
          fmt::format("node '{}' is not a live member of cluster '{}': start its Manager (same --cluster-name and "
                      "--etcd-endpoints) before adding it to the catalog set",
                      node, options_.cluster));
    }
    nodes.emplace_back(node);
  } else {
    if (!present) {
      return Status::FailedPrecondition(fmt::format("node '{}' keeps no catalog copy (generation {}: {})", node,
                                                    live->committed.generation(), fmt::join(nodes, ",")));
    }
    if (nodes.size() == 1) return Status::FailedPrecondition("the catalog set cannot lose its last node");
    nodes.erase(std::find(nodes.begin(), nodes.end(), node));
  }
  cluster::PlacementRequest request;
  request.catalog_nodes = nodes;
  request.replicas = live->committed.requested_replicas();
  request.requested_by = options_.node_id;
  request.requested_ms = WallMs();
  request.base_generation = live->committed.generation();
  ORBITKV_RETURN_IF_ERROR(cluster::Placement::Create(request.catalog_nodes, request.replicas).status());
  ORBITKV_ASSIGN_OR_RETURN(const int64_t revision, CheckBase(live->committed, deadline));
  ORBITKV_ASSIGN_OR_RETURN(bool written, cluster::SubmitPlacementRequest(membership_->etcd(), options_.cluster, request,
                                                                         deadline, revision));
  if (!written) {
    return Status::FailedPrecondition(
        "another placement request, or the next placement, was written just now: look "
        "again (`orbitkv catalog placement`)");
  }
  wake_.notify_all();
  std::sort(request.catalog_nodes.begin(), request.catalog_nodes.end());
  return std::vector<std::string>{
      fmt::format("requested: catalog nodes {} ({} copies a shard), generation {} -> {}",
                  fmt::join(request.catalog_nodes, ","), request.replicas, live->committed.generation(),
                  live->committed.generation() + 1),
      "the elected reconciler moves at most 2 shards at a time; `orbitkv catalog placement` shows the progress"};
}

Result<int64_t> PlacementDriver::CheckBase(const cluster::Placement& base, Deadline deadline) {
  ORBITKV_ASSIGN_OR_RETURN(etcdserverpb::RangeResponse records,
                           cluster::RangePlacementRecords(membership_->etcd(), options_.cluster, deadline));
  for (const mvccpb::KeyValue& kv : records.kvs()) {
    if (kv.key() != cluster::PlacementKey(options_.cluster)) continue;
    ORBITKV_ASSIGN_OR_RETURN(cluster::Placement now, cluster::Placement::Decode(kv.value()));
    if (now.generation() != base.generation()) {
      return Status::FailedPrecondition(fmt::format(
          "this Manager's placement (generation {}) is behind etcd's: generation {} (catalog nodes {}, {} "
          "copies a shard) is committed; a change built on generation {} would undo it: ask again",
          base.generation(), now.generation(), fmt::join(now.catalog_nodes(), ","), now.replicas(), base.generation()));
    }
    return kv.mod_revision();
  }
  return Status::FailedPrecondition(fmt::format("cluster '{}' has no placement record", options_.cluster));
}

Result<std::vector<std::string>> PlacementDriver::RequestAbort(const cluster::LivePlacement::State& live,
                                                               Deadline deadline) {
  if (!live.moving()) {
    return Status::FailedPrecondition(fmt::format(
        "no placement change is moving (generation {}, change: {}): nothing to abort", live.committed.generation(),
        live.transition ? cluster::PlacementPhaseName(live.transition->phase) : std::string_view("none")));
  }
  if (live.request.has_value()) {
    return Status::FailedPrecondition(fmt::format("a placement request ({}{}) waits for the reconciler already",
                                                  live.request->abort ? "abort, " : "",
                                                  fmt::join(live.request->catalog_nodes, ",")));
  }
  if (!membership_->CanDoRemoteWork()) {
    return Status::Unavailable("this Manager's registration or member view is not current: try again shortly");
  }
  cluster::PlacementRequest request;
  request.catalog_nodes = live.committed.catalog_nodes();
  request.replicas = live.committed.requested_replicas();
  request.requested_by = options_.node_id;
  request.requested_ms = WallMs();
  request.base_generation = live.committed.generation();
  request.abort = true;
  ORBITKV_ASSIGN_OR_RETURN(bool written,
                           cluster::SubmitPlacementRequest(membership_->etcd(), options_.cluster, request, deadline));
  if (!written) return Status::FailedPrecondition("another placement request was written just now: look again");
  wake_.notify_all();
  return std::vector<std::string>{
      fmt::format("abort requested: the change to generation {} ends at the reconciler's next step; generation {} "
                  "stays and the new copies are dropped",
                  live.transition->from_generation + 1, live.committed.generation()),
      "`orbitkv catalog placement` shows it (change: aborted)"};
}

std::vector<std::string> PlacementDriver::Lines() const {
  const std::shared_ptr<const cluster::LivePlacement::State> live = membership_->live_placement().Get();
  std::string outcome;
  bool leading = false;
  {
    MutexLock lock(&mu_);
    outcome = last_outcome_;
    leading = leadership_->leading();
  }
  const cluster::Placement& p = live->committed;
  std::vector<std::string> lines;
  lines.push_back(fmt::format("placement generation {}: catalog nodes {}, {} copies a shard, fingerprint {}",
                              p.generation(), fmt::join(p.catalog_nodes(), ","), p.replicas(), p.fingerprint()));
  lines.push_back(fmt::format("reconciler: {}{}", live->leader.empty() ? std::string("none elected") : live->leader,
                              leading ? " (this Manager)" : ""));
  if (leading && !outcome.empty()) lines.push_back(fmt::format("last step: {}", outcome));
  if (live->request.has_value()) {
    lines.push_back(fmt::format("requested by {}: catalog nodes {} ({} copies a shard)", live->request->requested_by,
                                fmt::join(live->request->catalog_nodes, ","), live->request->replicas));
  }
  if (!live->transition.has_value()) {
    lines.push_back("change: none");
    return lines;
  }
  const cluster::PlacementTransition& t = *live->transition;
  const double age = static_cast<double>(WallMs() - t.started_ms) / 1000;
  lines.push_back(fmt::format("change: generation {} -> {} ({}), {} for {:.1f} s (started {:.1f} s ago by {}){}",
                              t.from_generation, t.from_generation + 1, fmt::join(t.to_nodes, ","),
                              cluster::PlacementPhaseName(t.phase), static_cast<double>(WallMs() - t.phase_ms) / 1000,
                              age, t.leader, t.reason.empty() ? "" : fmt::format(": {}", t.reason)));
  if (t.phase != cluster::PlacementTransition::Phase::kMoving) return lines;
  const cluster::Placement to = t.To();
  lines.push_back("shard state since_s copies -> next_copies watermarks");
  for (uint32_t shard = 0; shard < cluster::kNumShards; ++shard) {
    const cluster::ShardMove& m = t.shards[shard];
    std::vector<std::string> marks;
    for (const auto& [owner, seq] : m.watermarks) marks.push_back(fmt::format("{}={}", owner, seq));
    lines.push_back(fmt::format(
        "{} {} {:.1f} {} -> {} {}", shard, cluster::ShardMoveStateName(m.state),
        m.since_ms > 0 ? static_cast<double>(WallMs() - m.since_ms) / 1000 : 0.0,
        fmt::join(p.generation() == t.from_generation ? p.CopiesOf(shard) : std::vector<std::string>{}, ","),
        fmt::join(to.CopiesOf(shard), ","), marks.empty() ? "-" : fmt::format("{}", fmt::join(marks, ","))));
  }
  return lines;
}

void PlacementDriver::VisitStats(StatsVisitor& v) const {
  const std::shared_ptr<const cluster::LivePlacement::State> live = membership_->live_placement().Get();
  bool leading = false;
  cluster::PlacementReconciler::Stats stats;
  {
    MutexLock lock(&mu_);
    leading = leadership_->leading();
    stats = reconciler_stats_;
  }
  const bool moving = live->moving();
  v.Gauge("placement_generation", live->committed.generation());
  v.Text("placement_change",
         live->transition ? cluster::PlacementPhaseName(live->transition->phase) : std::string_view("none"));
  v.Gauge("placement_shards_moving",
          moving ? static_cast<int64_t>(live->transition->CountIn(cluster::ShardMove::State::kMoving)) : 0,
          {"orbitkv_placement_shards_moving", "Catalog shards whose new copies are catching up now (at most 2)"});
  v.Gauge("placement_shards_ready",
          moving ? static_cast<int64_t>(live->transition->CountIn(cluster::ShardMove::State::kReady)) : 0);
  v.Gauge("placement_reconciler_leading", leading ? 1 : 0,
          {"orbitkv_placement_reconciler_leading", "1 while this Manager leads the placement reconciler"});
  v.Counter("", stats.started,
            {"orbitkv_placement_changes_started_total",
             "Catalog placement changes this Manager started as the reconciler leader"});
  v.Counter("placement_changes_committed", stats.committed,
            {"orbitkv_placement_changes_committed_total",
             "Catalog placement generations this Manager committed as the reconciler leader"});
  v.Counter("placement_changes_aborted", stats.aborted,
            {"orbitkv_placement_changes_aborted_total",
             "Catalog placement changes this Manager aborted (a shard did not converge in time)"});
  v.Counter("placement_requests_refused", stats.refused,
            {"orbitkv_placement_requests_refused_total",
             "Placement requests this Manager dropped as the reconciler leader (built on an older generation, or an "
             "abort with no change in progress)"});
  v.Counter("", stats.shard_moves,
            {"orbitkv_placement_shard_moves_total",
             "Shards whose new catalog copies this Manager saw converge as the leader"});
}

}  // namespace orbitkv::server
