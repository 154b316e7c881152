#include "cluster/view_sync.h"

#include <fmt/format.h>

#include <algorithm>
#include <random>
#include <set>

#include "base/check.h"
#include "base/logging.h"
#include "cluster/bidi_stream.h"
#include "cluster/cluster_keys.h"
#include "cluster/etcd_client.h"
#include "cluster/jitter.h"
#include "cluster/live_placement.h"

namespace orbitkv::cluster {
namespace {

constexpr std::chrono::milliseconds kBackoffMin{100};
constexpr std::chrono::milliseconds kBackoffMax{2000};

using WatchStream = BidiStream<etcdserverpb::WatchRequest, etcdserverpb::WatchResponse>;

}  // namespace

ViewSync::ViewSync(EtcdClient* client, MemberView* view, Options options)
    : client_(client),
      view_(view),
      options_(std::move(options)),
      range_begin_(ViewRangeBegin(options_.cluster)),
      range_end_(ViewRangeEnd(options_.cluster)),
      members_prefix_(MembersPrefix(options_.cluster)),
      cluster_prefix_(ClusterPrefix(options_.cluster)),
      metrics_(options_.metrics),
      cluster_id_(options_.etcd_cluster_id) {
  ORBITKV_CHECK(metrics_ != nullptr);
  snapshots_ = &metrics_->GetCounter("orbitkv_membership_snapshots_total", "Member view snapshots installed");
  catch_ups_ = &metrics_->GetCounter("orbitkv_membership_view_catch_ups_total",
                                     "Member views made complete again after a broken watch from the records changed "
                                     "meanwhile, without a snapshot");
  rejected_malformed_ =
      &metrics_->GetCounter("orbitkv_membership_rejected_records_total",
                            "Member records ignored because they were unusable", {{"reason", "malformed"}});
  rejected_oversized_ =
      &metrics_->GetCounter("orbitkv_membership_rejected_records_total",
                            "Member records ignored because they were unusable", {{"reason", "oversized"}});
  complete_gauge_ =
      &metrics_->GetGauge("orbitkv_membership_view_complete", "1 when the cached member view is complete, else 0");
  revision_gauge_ = &metrics_->GetGauge("orbitkv_membership_view_revision", "etcd revision of the member view");
  members_gauge_ = &metrics_->GetGauge("orbitkv_membership_view_members",
                                       "Members in the cached view (the counted ones, at most the member limit)");
  waiting_gauge_ = &metrics_->GetGauge("orbitkv_membership_view_waiting",
                                       "Registrations beyond the member limit, waiting in line to be counted");
}

bool ViewSync::stopping() const {
  MutexLock lock(&mu_);
  return stopping_;
}

void ViewSync::Stop() {
  MutexLock lock(&mu_);
  stopping_ = true;
  // TryCancel only flags the call; it does no I/O and calls back nothing of ours.
  if (cancel_active_) cancel_active_();
  wake_.notify_all();
}

void ViewSync::BreakWatchForTesting() {
  MutexLock lock(&mu_);
  // Between two watches (catching up, or before the next one is open) the break applies to the next watch: a
  // test that saw the view complete may call this before the sync thread has opened its watch again.
  if (cancel_active_) {
    cancel_active_();
  } else {
    break_next_watch_ = true;
  }
}

bool ViewSync::WaitFor(std::chrono::milliseconds delay) {
  const MonoTime until = MonoNow() + delay;
  MutexLock lock(&mu_);
  while (!stopping_ && MonoNow() < until) wake_.wait_until(mu_, until);
  return !stopping_;
}

void ViewSync::Invalidate(const char* reason) {
  view_->Invalidate();
  complete_gauge_->Set(0);
  metrics_
      ->GetCounter("orbitkv_membership_view_invalidations_total", "Member view invalidations, by cause",
                   {{"reason", reason}})
      .Increment();
  ORBITKV_LOG_INFO("cluster {}: member view invalidated ({}); {}", options_.cluster, reason,
                   std::string_view(reason) == "reconnect" ? "catching up from its revision when etcd answers"
                                                           : "taking a fresh snapshot");
}

void ViewSync::Fence(const std::string& reason, bool final) {
  if (fenced_) return;
  fenced_ = true;
  if (options_.on_fence) options_.on_fence(reason, final);
}

bool ViewSync::CheckClusterId(const etcdserverpb::ResponseHeader& header) {
  if (header.cluster_id() == 0) return true;  // E.g. the compaction-cancel reply carries an empty header.
  if (cluster_id_ == 0) {
    cluster_id_ = header.cluster_id();
    return true;
  }
  if (header.cluster_id() == cluster_id_) return true;
  if (options_.self.has_value()) {
    Fence(fmt::format("etcd cluster ID changed from {:x} to {:x}", cluster_id_, header.cluster_id()),
          /*final=*/true);
    return false;
  }
  // An observer follows the new cluster from a fresh snapshot.
  cluster_id_ = header.cluster_id();
  return true;
}

Result<Member> ViewSync::DecodeMember(std::string_view node_id, const std::string& key, const std::string& value,
                                      int64_t lease, int64_t create_revision, int64_t mod_revision) {
  Status status = ValidateName("member key", node_id);
  Result<MemberRecord> record =
      status.ok() ? DecodeMemberRecord(options_.cluster, node_id, value) : Result<MemberRecord>(status);
  if (!record.ok()) {
    (record.status().code() == StatusCode::kOutOfRange ? rejected_oversized_ : rejected_malformed_)->Increment();
    ORBITKV_LOG_WARN("cluster {}: ignoring member record at '{}': {}", options_.cluster, key,
                     record.status().ToString());
    return record.status();
  }
  return Member{std::move(record).value(), lease, create_revision, mod_revision};
}

std::optional<std::string> ViewSync::PlacementRecordName(const std::string& key) const {
  if (!key.starts_with(cluster_prefix_)) return std::nullopt;
  const std::string_view name = std::string_view(key).substr(cluster_prefix_.size());
  if (name == kPlacementRecordName || name == kTransitionRecordName || name == kRequestRecordName ||
      name == kLeaderRecordName) {
    return std::string(name);
  }
  return std::nullopt;
}

bool ViewSync::DeliverPlacement() {
  if (!options_.on_placement) return true;
  const std::string why = options_.on_placement(placement_records_);
  if (why.empty()) return true;
  Fence(why, /*final=*/true);
  return false;
}

Result<int64_t> ViewSync::TakeSnapshot() {
  // Every valid record, but at most 2 x the member limit of them (the youngest beyond that are dropped as they
  // come: they would neither count nor be next in line), and whether the own record was among them.
  const size_t held_limit = 2 * view_->limit();
  std::map<std::string, Member> members;
  std::set<std::pair<int64_t, std::string>> order;
  std::optional<std::pair<int64_t, std::string>> dropped_min;
  std::optional<Member> own;
  std::map<std::string, std::string> placement;
  int64_t revision = 0;
  std::string cursor = range_begin_;
  while (true) {
    etcdserverpb::RangeRequest request;
    request.set_key(cursor);
    request.set_range_end(range_end_);
    request.set_limit(kSnapshotPageSize);
    request.set_revision(revision);
    ORBITKV_ASSIGN_OR_RETURN(etcdserverpb::RangeResponse page,
                             client_->Range(request, Deadline::After(client_->options().call_timeout)));
    if (!CheckClusterId(page.header())) return Status::Aborted("fenced");
    if (revision == 0) revision = page.header().revision();
    for (const mvccpb::KeyValue& kv : page.kvs()) {
      if (std::optional<std::string> name = PlacementRecordName(kv.key())) {
        placement[*name] = kv.value();
        continue;
      }
      if (!kv.key().starts_with(members_prefix_)) continue;  // Nothing else is written in the range.
      const std::string_view node = std::string_view(kv.key()).substr(members_prefix_.size());
      Result<Member> member =
          DecodeMember(node, kv.key(), kv.value(), kv.lease(), kv.create_revision(), kv.mod_revision());
      if (!member.ok()) continue;
      if (options_.self.has_value() && node == options_.self->record.node_id) own = *member;
      order.emplace(member->create_revision, std::string(node));
      members.emplace(std::string(node), std::move(member).value());
      if (members.size() > held_limit) {
        auto youngest = std::prev(order.end());
        if (!dropped_min.has_value() || *youngest < *dropped_min) dropped_min = *youngest;
        members.erase(youngest->second);
        order.erase(youngest);
      }
    }
    if (!page.more() || page.kvs().empty()) break;
    cursor = page.kvs(page.kvs_size() - 1).key();
    cursor.push_back('\0');
  }

  placement_records_ = std::move(placement);
  if (!DeliverPlacement()) return Status::Aborted("fenced");
  if (!CheckOwnRecord(own, revision)) return Status::Aborted("fenced");
  if (dropped_min.has_value()) {
    ORBITKV_LOG_WARN(
        "cluster {}: more than {} member records; the {} oldest count, the {} next wait in line, and "
        "the younger ones are not held",
        options_.cluster, held_limit, view_->limit(), view_->limit());
  }
  snapshots_->Increment();  // before the view is complete again: whoever sees it complete sees it counted
  view_->Install(std::move(members), revision, std::move(dropped_min));
  Installed(revision);
  return revision;
}

void ViewSync::Installed(int64_t revision) {
  complete_gauge_->Set(view_->complete() ? 1 : 0);
  revision_gauge_->Set(static_cast<double>(revision));
  SetMemberGauges();
}

bool ViewSync::CheckOwnRecord(const std::optional<Member>& own, int64_t revision) {
  if (!options_.self.has_value()) return true;
  const Member& self = *options_.self;
  if (!own.has_value()) {
    Fence(fmt::format("own member record is missing at revision {} (its lease expired?)", revision), /*final=*/false);
    return false;
  }
  if (own->record != self.record || own->lease_id != self.lease_id) {
    Fence(fmt::format("own member record was replaced (epoch {}, uuid {}) at revision {}", own->record.epoch,
                      own->record.runtime_uuid, own->mod_revision),
          /*final=*/true);
    return false;
  }
  return true;
}

Result<int64_t> ViewSync::CatchUp(int64_t known) {
  // 1. How many keys the range holds now (revision R), and 2. those changed since `known`, at R. Every key there
  // now is either unchanged since `known` (so held by the view) or changed (so in 2): when the view's records and
  // the placement records, updated by 2, number as many as 1 counted, nothing was deleted meanwhile, and that is
  // the range at R. Otherwise (a deletion, a record the view skipped or did not hold, a key it does not know) the
  // caller takes a snapshot. Both reads are small; neither needs history, so compaction does not matter.
  etcdserverpb::RangeRequest count;
  count.set_key(range_begin_);
  count.set_range_end(range_end_);
  count.set_count_only(true);
  ORBITKV_ASSIGN_OR_RETURN(etcdserverpb::RangeResponse counted,
                           client_->Range(count, Deadline::After(client_->options().call_timeout)));
  if (!CheckClusterId(counted.header())) return Status::Aborted("fenced");
  const int64_t revision = counted.header().revision();
  etcdserverpb::RangeRequest changed;
  changed.set_key(range_begin_);
  changed.set_range_end(range_end_);
  changed.set_revision(revision);
  changed.set_min_mod_revision(known + 1);
  ORBITKV_ASSIGN_OR_RETURN(etcdserverpb::RangeResponse delta,
                           client_->Range(changed, Deadline::After(client_->options().call_timeout)));
  if (!CheckClusterId(delta.header())) return Status::Aborted("fenced");
  std::optional<std::map<std::string, Member>> members = view_->Held();
  if (!members.has_value()) return Status::FailedPrecondition("the view does not hold every record (member limit)");
  std::map<std::string, std::string> placement = placement_records_;
  for (const mvccpb::KeyValue& kv : delta.kvs()) {
    if (std::optional<std::string> name = PlacementRecordName(kv.key())) {
      placement[*name] = kv.value();
      continue;
    }
    if (!kv.key().starts_with(members_prefix_)) return Status::FailedPrecondition("an unknown key in the range");
    const std::string_view node = std::string_view(kv.key()).substr(members_prefix_.size());
    Result<Member> member =
        DecodeMember(node, kv.key(), kv.value(), kv.lease(), kv.create_revision(), kv.mod_revision());
    if (!member.ok()) return Status::FailedPrecondition("a changed record is unusable");
    (*members)[std::string(node)] = std::move(member).value();
  }
  if (members->size() + placement.size() != static_cast<size_t>(counted.count())) {
    return Status::FailedPrecondition(fmt::format("{} keys in the range, {} known: some were deleted", counted.count(),
                                                  members->size() + placement.size()));
  }
  std::optional<Member> own;
  if (options_.self.has_value()) {
    if (auto it = members->find(options_.self->record.node_id); it != members->end()) own = it->second;
  }
  placement_records_ = std::move(placement);
  if (!DeliverPlacement()) return Status::Aborted("fenced");
  if (!CheckOwnRecord(own, revision)) return Status::Aborted("fenced");
  catch_ups_->Increment();  // as for a snapshot: counted before the view is complete again
  view_->Install(std::move(*members), revision);
  Installed(revision);
  return revision;
}

void ViewSync::SetMemberGauges() {
  const MemberView::Snapshot s = view_->Read();
  members_gauge_->Set(static_cast<double>(s.members.size()));
  waiting_gauge_->Set(static_cast<double>(s.waiting));
}

bool ViewSync::ApplyResponse(const etcdserverpb::WatchResponse& response) {
  std::vector<MemberView::Change> changes;
  int64_t revision = 0;
  bool placement_changed = false;
  for (const mvccpb::Event& event : response.events()) {
    const mvccpb::KeyValue& kv = event.kv();
    const bool deleted = event.type() == mvccpb::Event::DELETE;
    revision = std::max(revision, kv.mod_revision());
    if (std::optional<std::string> name = PlacementRecordName(kv.key())) {
      if (deleted) {
        placement_records_.erase(*name);
      } else {
        placement_records_[*name] = kv.value();
      }
      placement_changed = true;
      continue;
    }
    if (!kv.key().starts_with(members_prefix_)) continue;
    const std::string node(std::string_view(kv.key()).substr(members_prefix_.size()));
    std::optional<Member> member;
    if (!deleted) {
      Result<Member> decoded =
          DecodeMember(node, kv.key(), kv.value(), kv.lease(), kv.create_revision(), kv.mod_revision());
      if (!decoded.ok()) {
        Invalidate("malformed");
        return false;
      }
      member = std::move(decoded).value();
    }
    if (options_.self.has_value() && node == options_.self->record.node_id) {
      const Member& self = *options_.self;
      if (!member.has_value()) {
        Fence(fmt::format("own member record was deleted at revision {} (its lease expired or "
                          "was revoked)",
                          kv.mod_revision()),
              /*final=*/false);
        return false;
      }
      if (member->record != self.record || member->lease_id != self.lease_id) {
        Fence(fmt::format("own member record was replaced (epoch {}, uuid {}) at revision {}", member->record.epoch,
                          member->record.runtime_uuid, kv.mod_revision()),
              /*final=*/true);
        return false;
      }
    }
    changes.emplace_back(node, std::move(member));
  }
  if (placement_changed && !DeliverPlacement()) return false;
  if (changes.empty()) return true;
  if (!view_->Apply(changes, revision)) {
    Invalidate("line_unknown");  // a counted member left and the next in line was dropped from a full line
    return false;
  }
  revision_gauge_->Set(static_cast<double>(view_->revision()));
  SetMemberGauges();
  return true;
}

ViewSync::WatchEnd ViewSync::WatchFrom(int64_t start_revision) {
  const size_t endpoint = client_->PreferredEndpoint();
  WatchStream stream;
  const std::string token_sent =
      client_->PrepareStreamContext(stream.context(), EtcdClient::StreamKind::kWatch, endpoint);
  {
    MutexLock lock(&mu_);
    if (stopping_) return WatchEnd::kStopped;
    cancel_active_ = [&stream] { stream.Cancel(); };
    if (break_next_watch_) {
      break_next_watch_ = false;
      stream.Cancel();  // TryCancel before the call starts: the call ends cancelled as soon as it starts
    }
  }
  struct ClearActive {
    ViewSync* self;
    ~ClearActive() {
      MutexLock lock(&self->mu_);
      self->cancel_active_ = nullptr;
    }
  } clear_active{this};

  const auto prepare = [&](grpc::ClientContext* ctx, grpc::CompletionQueue* cq) {
    return client_->WatchStub(endpoint)->PrepareAsyncWatch(ctx, cq);
  };
  bool healthy = stream.Start(prepare, Deadline::After(client_->options().call_timeout));
  if (healthy) {
    etcdserverpb::WatchRequest request;
    etcdserverpb::WatchCreateRequest* create = request.mutable_create_request();
    create->set_key(range_begin_);
    create->set_range_end(range_end_);
    create->set_start_revision(start_revision);
    stream.StartWrite(request);
  }
  etcdserverpb::WatchResponse response;
  if (healthy) stream.StartRead(&response);
  // Until etcd confirms the watch, a silent stream is a dead connection (e.g. accepted by a
  // stopping etcd); afterwards silence is normal and gRPC keepalive pings watch the connection.
  Deadline confirm_by = Deadline::After(client_->options().call_timeout);
  while (healthy) {
    std::optional<WatchStream::Event> event = stream.Next(confirm_by);
    if (!event.has_value() || !event->ok) break;
    if (event->op != WatchStream::Op::kRead) continue;
    confirm_by = Deadline::Infinite();
    if (!CheckClusterId(response.header())) return WatchEnd::kFenced;
    if (response.canceled()) {
      if (response.compact_revision() > 0) {
        Invalidate("compaction");
      } else {
        ORBITKV_LOG_WARN("cluster {}: watch cancelled: {}", options_.cluster, response.cancel_reason());
        Invalidate("canceled");
      }
      return WatchEnd::kInvalidated;
    }
    if (!ApplyResponse(response)) return fenced_ ? WatchEnd::kFenced : WatchEnd::kInvalidated;
    response.Clear();
    stream.StartRead(&response);
  }
  const grpc::Status status = stream.Finish();
  if (stopping()) return WatchEnd::kStopped;
  ORBITKV_LOG_INFO("cluster {}: watch stream to {} ended: {}", options_.cluster, client_->endpoints()[endpoint],
                   status.error_message());
  client_->ReportStreamFailure(endpoint, status, token_sent);
  Invalidate("reconnect");
  return WatchEnd::kBroken;
}

void ViewSync::Run() {
  std::chrono::milliseconds backoff = kBackoffMin;
  std::minstd_rand jitter(std::random_device{}());
  // After a broken watch: the revision the view was complete at, to catch up from instead of a snapshot.
  std::optional<int64_t> resume;
  while (!stopping() && !fenced_) {
    if (resume.has_value() && options_.on_reconnect) options_.on_reconnect();
    Result<int64_t> revision = resume.has_value() ? CatchUp(*resume) : TakeSnapshot();
    if (fenced_) return;
    if (!revision.ok()) {
      if (revision.status().code() == StatusCode::kOutOfRange) continue;  // Compacted while paging: restart now.
      if (revision.status().code() == StatusCode::kFailedPrecondition) {
        ORBITKV_LOG_INFO("cluster {}: catching up after the broken watch needs a snapshot: {}", options_.cluster,
                         revision.status().message());
        resume.reset();
        continue;
      }
      if (view_->complete()) Invalidate("reconnect");
      ORBITKV_LOG_DEBUG("cluster {}: snapshot failed: {}", options_.cluster, revision.status().ToString());
      // Jittered (50-100 %): a fleet that lost etcd together does not come back in step.
      if (!WaitFor(Jittered(backoff, jitter))) return;
      backoff = std::min(backoff * 2, kBackoffMax);
      continue;
    }
    backoff = kBackoffMin;
    resume.reset();
    if (options_.on_installed) options_.on_installed(*revision);
    const WatchEnd end = WatchFrom(*revision + 1);
    if (end == WatchEnd::kStopped || end == WatchEnd::kFenced) return;
    if (end == WatchEnd::kBroken) resume = view_->revision();
  }
}

}  // namespace orbitkv::cluster
