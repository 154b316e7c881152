#include "cluster/membership.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <random>

#include "base/check.h"
#include "base/logging.h"
#include "cluster/cluster_keys.h"
#include "cluster/etcd_client.h"
#include "cluster/jitter.h"
#include "cluster/lease_keeper.h"
#include "cluster/view_sync.h"

namespace orbitkv::cluster {
namespace {

// Registration retries only when the epoch key moved between reading it and the transaction
// (another runtime of the same Node ID raced us and then went away); more than a few rounds means
// something is wrong.
constexpr int kMaxRegisterAttempts = 8;

Result<int64_t> ParseEpoch(std::string_view key, std::string_view text) {
  int64_t value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || value < 1) {
    return Status::DataLoss(
        fmt::format("epoch record {} holds '{}', not a positive decimal integer", key, text.substr(0, 32)));
  }
  return value;
}

etcdserverpb::Compare* AddCompare(etcdserverpb::TxnRequest& txn, const std::string& key,
                                  etcdserverpb::Compare::CompareTarget target) {
  etcdserverpb::Compare* compare = txn.add_compare();
  compare->set_key(key);
  compare->set_target(target);
  compare->set_result(etcdserverpb::Compare::EQUAL);
  return compare;
}

}  // namespace

std::string_view MembershipStateName(MembershipState state) {
  switch (state) {
    case MembershipState::kNotJoined:
      return "not-joined";
    case MembershipState::kRegistered:
      return "registered";
    case MembershipState::kExpired:
      return "expired";
    case MembershipState::kFenced:
      return "fenced";
    case MembershipState::kStopped:
      return "stopped";
  }
  return "unknown";
}

Result<std::vector<std::string>> SplitFlagList(std::string_view flag, std::string_view value) {
  std::vector<std::string> items;
  size_t start = 0;
  while (start <= value.size()) {
    size_t comma = value.find(',', start);
    if (comma == std::string_view::npos) comma = value.size();
    std::string_view item = value.substr(start, comma - start);
    while (!item.empty() && item.front() == ' ') item.remove_prefix(1);
    while (!item.empty() && item.back() == ' ') item.remove_suffix(1);
    if (item.empty()) return Status::InvalidArgument(fmt::format("{} has an empty item in '{}'", flag, value));
    items.emplace_back(item);
    start = comma + 1;
  }
  return items;
}

Status ValidateMembershipOptions(const MembershipOptions& options) {
  if (options.etcd_endpoints.empty()) {
    return Status::InvalidArgument("--etcd-endpoints: give at least one etcd endpoint (host:port)");
  }
  ORBITKV_RETURN_IF_ERROR(ValidateName("--cluster-name", options.cluster_name));
  ORBITKV_RETURN_IF_ERROR(ValidateName("--node-id", options.node_id));
  if (options.membership_ttl_secs < kMinMembershipTtlSecs || options.membership_ttl_secs > kMaxMembershipTtlSecs) {
    return Status::InvalidArgument(fmt::format("--membership-ttl-secs {} is outside {}..{}",
                                               options.membership_ttl_secs, kMinMembershipTtlSecs,
                                               kMaxMembershipTtlSecs));
  }
  ORBITKV_RETURN_IF_ERROR(Placement::Create(options.catalog_nodes, options.catalog_replicas).status());
  ORBITKV_RETURN_IF_ERROR(ValidateEndpoint("peer endpoint", options.peer_endpoint));
  if (!options.runtime_uuid.empty() && !IsRuntimeUuid(options.runtime_uuid)) {
    return Status::InvalidArgument(fmt::format("runtime UUID '{}' is not a lower-case UUID", options.runtime_uuid));
  }
  if (options.etcd_call_timeout <= std::chrono::milliseconds::zero()) {
    return Status::InvalidArgument("etcd call timeout must be positive");
  }
  return Status::Ok();
}

Result<std::unique_ptr<Membership>> Membership::Create(MembershipOptions options, MetricsRegistry* metrics) {
  ORBITKV_CHECK(metrics != nullptr);
  ORBITKV_RETURN_IF_ERROR(ValidateMembershipOptions(options));
  ORBITKV_ASSIGN_OR_RETURN(Placement placement, Placement::Create(options.catalog_nodes, options.catalog_replicas));
  EtcdClientOptions client_options;
  client_options.endpoints = options.etcd_endpoints;
  client_options.tls_ca_file = options.etcd_tls_ca;
  client_options.tls_cert_file = options.etcd_tls_cert;
  client_options.tls_key_file = options.etcd_tls_key;
  client_options.tls_reload_secs = options.tls_reload_secs;
  client_options.user = options.etcd_user;
  client_options.password = options.etcd_password;
  client_options.call_timeout = options.etcd_call_timeout;
  client_options.metrics = metrics;
  ORBITKV_ASSIGN_OR_RETURN(std::unique_ptr<EtcdClient> client, EtcdClient::Create(std::move(client_options)));
  return std::unique_ptr<Membership>(
      new Membership(std::move(options), metrics, std::move(client), std::move(placement)));
}

Membership::Membership(MembershipOptions options, MetricsRegistry* metrics, std::unique_ptr<EtcdClient> client,
                       Placement placement)
    : options_(std::move(options)),
      metrics_(metrics),
      client_(std::move(client)),
      configured_(placement),
      live_(std::move(placement)),
      view_(options_.member_limit, options_.node_id) {
  registered_gauge_ =
      &metrics_->GetGauge("orbitkv_membership_registered", "1 while this Manager holds a valid registration, else 0");
  epoch_gauge_ = &metrics_->GetGauge("orbitkv_membership_epoch", "Epoch (incarnation) of this Manager's Node ID");
  MutexLock lock(&mu_);
  self_.record.cluster = options_.cluster_name;
  self_.record.node_id = options_.node_id;
  self_.record.endpoint = options_.peer_endpoint;
  self_.record.runtime_uuid = options_.runtime_uuid.empty() ? NewRuntimeUuid() : options_.runtime_uuid;
  self_.record.incarnation = options_.incarnation;
  since_ = MonoNow();
}

Membership::~Membership() { Shutdown(); }

Status Membership::Join(Deadline deadline) {
  Member self;
  {
    MutexLock lock(&mu_);
    ORBITKV_CHECK_MSG(state_ == MembershipState::kNotJoined && !shut_down_ && clocks_.empty(),
                      "Membership::Join called twice");
    self = self_;
  }
  if (options_.refuse_join_when_full) ORBITKV_RETURN_IF_ERROR(RefuseWhenFull(deadline));
  // A placement change that commits between reading the placement and registering fails the registration's
  // compare (Aborted): read it again.
  Result<std::unique_ptr<RegistrationClock>> registered = Status::Aborted("not tried");
  for (int attempt = 0; attempt < 3 && registered.status().code() == StatusCode::kAborted; ++attempt) {
    ORBITKV_ASSIGN_OR_RETURN(int64_t placement_revision, JoinPlacement(*client_, options_.cluster_name, configured_,
                                                                       &live_, /*initial=*/true, deadline));
    registered = Register(placement_revision, deadline, &self);
  }
  ORBITKV_ASSIGN_OR_RETURN(std::unique_ptr<RegistrationClock> clock, std::move(registered));
  RegistrationClock* current = clock.get();
  {
    MutexLock lock(&mu_);
    clocks_.push_back(std::move(clock));
    self_ = self;
    own_uuids_.push_back(self.record.runtime_uuid);
    state_ = MembershipState::kRegistered;
    since_ = MonoNow();
    registrations_ = 1;
  }
  clock_.store(current, std::memory_order_release);
  registered_gauge_->Set(1);
  epoch_gauge_->Set(static_cast<double>(self.record.epoch));
  StartIncarnation(self, current);
  // The supervisor: registers again after a lapse, and joins the incarnations' threads.
  supervisor_thread_ = std::thread([this] { Supervise(); });
  ORBITKV_LOG_INFO("cluster {}: registered node {} epoch {} uuid {} lease {:x} (TTL {} s)", options_.cluster_name,
                   options_.node_id, self.record.epoch, self.record.runtime_uuid, self.lease_id, lease_ttl_secs());
  if (const Placement placement = live_.Get()->committed; placement.reduced_coverage()) {
    ORBITKV_LOG_WARN(
        "cluster {}: reduced failure coverage: each catalog shard has {} cop{} ({} asked for, {} "
        "catalog node{}); give --catalog-nodes at least 3 nodes and --catalog-replicas 3 so that a "
        "lost catalog host loses no shard",
        options_.cluster_name, placement.replicas(), placement.replicas() == 1 ? "y" : "ies",
        placement.requested_replicas(), placement.catalog_nodes().size(),
        placement.catalog_nodes().size() == 1 ? "" : "s");
  }
  return Status::Ok();
}

int64_t Membership::lease_ttl_secs() const {
  MutexLock lock(&mu_);
  return lease_ttl_secs_;
}

void Membership::StartIncarnation(const Member& self, RegistrationClock* clock) {
  LeaseKeeper::Options keeper_options;
  keeper_options.lease_id = self.lease_id;
  ViewSync::Options view_options;
  {
    MutexLock lock(&mu_);
    keeper_options.ttl_secs = lease_ttl_secs_;
    keeper_options.etcd_cluster_id = etcd_cluster_id_;
    view_options.etcd_cluster_id = etcd_cluster_id_;
  }
  keeper_options.metrics = metrics_;
  keeper_options.on_lost = [this](const std::string& reason) { EndRegistration(MembershipState::kExpired, reason); };
  view_options.cluster = options_.cluster_name;
  view_options.self = self;
  view_options.on_placement = [this](const std::map<std::string, std::string>& records) {
    return live_.Apply(records);
  };
  view_options.metrics = metrics_;
  view_options.on_installed = options_.on_view_installed;
  view_options.on_fence = [this, clock](const std::string& reason, bool final) {
    if (clock->End()) {
      EndRegistration(final ? MembershipState::kFenced : MembershipState::kExpired, reason);
    }
  };
  auto keeper = std::make_unique<LeaseKeeper>(client_.get(), clock, std::move(keeper_options));
  auto view_sync = std::make_unique<ViewSync>(client_.get(), &view_, std::move(view_options));
  LeaseKeeper* k = keeper.get();
  ViewSync* v = view_sync.get();
  {
    MutexLock lock(&mu_);
    keeper_ = std::move(keeper);
    view_sync_ = std::move(view_sync);
    if (shut_down_) {  // Shutdown() ran meanwhile: the threads start and end at once
      k->Stop();
      v->Stop();
    }
  }
  // The registration's two threads; both end promptly on Stop().
  keeper_thread_ = std::thread([k] { k->Run(); });
  view_thread_ = std::thread([v] { v->Run(); });
}

void Membership::StopIncarnation() {
  {
    MutexLock lock(&mu_);
    if (view_sync_) view_sync_->Stop();
    if (keeper_) keeper_->Stop();
  }
  if (view_thread_.joinable()) view_thread_.join();
  if (keeper_thread_.joinable()) keeper_thread_.join();
  MutexLock lock(&mu_);
  view_sync_.reset();
  keeper_.reset();
}

Result<std::unique_ptr<RegistrationClock>> Membership::Register(int64_t placement_revision, Deadline deadline,
                                                                Member* self) {
  const std::string member_key = MemberKey(options_.cluster_name, options_.node_id);
  const std::string epoch_key = EpochKey(options_.cluster_name, options_.node_id);
  const std::string placement_key = PlacementKey(options_.cluster_name);

  etcdserverpb::LeaseGrantRequest grant;
  grant.set_ttl(options_.membership_ttl_secs);
  const MonoTime grant_sent = MonoNow();
  ORBITKV_ASSIGN_OR_RETURN(etcdserverpb::LeaseGrantResponse granted, client_->LeaseGrant(grant, deadline));
  if (granted.ttl() <= 0) return Status::Unavailable("etcd granted a lease with no TTL");
  uint64_t known_cluster = 0;
  {
    MutexLock lock(&mu_);
    known_cluster = etcd_cluster_id_;
    if (known_cluster == 0 || granted.header().cluster_id() == known_cluster) {
      etcd_cluster_id_ = granted.header().cluster_id();
      lease_ttl_secs_ = granted.ttl();
    }
  }
  if (known_cluster != 0 && granted.header().cluster_id() != known_cluster) {
    // Another etcd cluster answers at these endpoints: nothing registered there is the one we knew.
    (void)RevokeLease(granted.id(), deadline);
    return Status::FailedPrecondition(
        fmt::format("the etcd cluster changed (ID {:x}, registered in {:x}): restart the Manager to join it",
                    granted.header().cluster_id(), known_cluster));
  }
  self->lease_id = granted.id();
  auto clock = std::make_unique<RegistrationClock>(grant_sent + std::chrono::seconds(granted.ttl()) / 2);

  Status status = Status::Aborted("registration did not converge");
  for (int attempt = 0; attempt < kMaxRegisterAttempts; ++attempt) {
    etcdserverpb::RangeRequest read_epoch;
    read_epoch.set_key(epoch_key);
    Result<etcdserverpb::RangeResponse> current = client_->Range(read_epoch, deadline);
    if (!current.ok()) {
      status = current.status();
      break;
    }
    int64_t epoch = 0;
    int64_t epoch_mod_revision = 0;
    if (current->kvs_size() == 1) {
      Result<int64_t> parsed = ParseEpoch(epoch_key, current->kvs(0).value());
      if (!parsed.ok()) {
        status = parsed.status();
        break;
      }
      epoch = *parsed;
      epoch_mod_revision = current->kvs(0).mod_revision();
    }
    self->record.epoch = epoch + 1;

    etcdserverpb::TxnRequest txn;
    AddCompare(txn, member_key, etcdserverpb::Compare::CREATE)->set_create_revision(0);
    AddCompare(txn, epoch_key, etcdserverpb::Compare::MOD)->set_mod_revision(epoch_mod_revision);
    AddCompare(txn, placement_key, etcdserverpb::Compare::MOD)->set_mod_revision(placement_revision);
    etcdserverpb::PutRequest* put_epoch = txn.add_success()->mutable_request_put();
    put_epoch->set_key(epoch_key);
    put_epoch->set_value(std::to_string(self->record.epoch));
    etcdserverpb::PutRequest* put_member = txn.add_success()->mutable_request_put();
    put_member->set_key(member_key);
    put_member->set_value(EncodeMemberRecord(self->record));
    put_member->set_lease(self->lease_id);
    txn.add_failure()->mutable_request_range()->set_key(member_key);
    Result<etcdserverpb::TxnResponse> response = client_->Txn(txn, deadline);
    if (!response.ok()) {
      status = response.status();
      break;
    }
    if (response->succeeded()) {
      self->create_revision = response->header().revision();
      self->mod_revision = response->header().revision();
      return clock;
    }
    const etcdserverpb::RangeResponse& holder = response->responses(0).response_range();
    if (holder.kvs_size() == 1) {
      const mvccpb::KeyValue& kv = holder.kvs(0);
      Result<MemberRecord> record = DecodeMemberRecord(options_.cluster_name, options_.node_id, kv.value());
      if (record.ok() && record->runtime_uuid == self->record.runtime_uuid && kv.lease() == self->lease_id) {
        // An earlier attempt of this very transaction was applied although its reply was lost.
        self->record = *record;
        self->create_revision = kv.create_revision();
        self->mod_revision = kv.mod_revision();
        return clock;
      }
      bool ours = false;
      if (record.ok()) {
        MutexLock lock(&mu_);
        ours = std::find(own_uuids_.begin(), own_uuids_.end(), record->runtime_uuid) != own_uuids_.end();
      }
      if (ours) {
        // One of this Membership's earlier registrations, its lease still alive in etcd (a restart
        // refreshes leases): not a fence. Revoke that lease and register again.
        ORBITKV_LOG_INFO(
            "cluster {}: node {} epoch {} (an earlier registration of this Manager) still "
            "holds the record; revoking its lease {:x}",
            options_.cluster_name, options_.node_id, record->epoch, kv.lease());
        if (Status revoked = RevokeLease(kv.lease(), deadline); !revoked.ok()) {
          status = revoked;
          break;
        }
        continue;
      }
      status =
          Status::AlreadyExists(fmt::format("node '{}' is already registered in cluster '{}' by a live runtime ({}); "
                                            "stop it, or wait up to {} s "
                                            "for its lease to expire",
                                            options_.node_id, options_.cluster_name,
                                            record.ok() ? fmt::format("epoch {}, uuid {}, endpoint {}", record->epoch,
                                                                      record->runtime_uuid, record->endpoint)
                                                        : std::string("unreadable record"),
                                            options_.membership_ttl_secs));
      break;
    }
    // The epoch or the placement moved under us; the placement check repeats only through a new
    // Join().
    etcdserverpb::RangeRequest read_placement;
    read_placement.set_key(placement_key);
    Result<etcdserverpb::RangeResponse> placement = client_->Range(read_placement, deadline);
    if (placement.ok() && (placement->kvs_size() != 1 || placement->kvs(0).mod_revision() != placement_revision)) {
      status = Status::Aborted(fmt::format(
          "placement record of cluster '{}' changed during the registration (a placement change committed); "
          "reading it again",
          options_.cluster_name));
      break;
    }
  }
  (void)RevokeLease(self->lease_id, Deadline::After(options_.etcd_call_timeout));
  self->lease_id = 0;
  return status;
}

Status Membership::RevokeLease(int64_t lease_id, Deadline deadline, bool quiet) {
  if (lease_id == 0) return Status::Ok();
  etcdserverpb::LeaseRevokeRequest revoke;
  revoke.set_id(lease_id);
  Result<etcdserverpb::LeaseRevokeResponse> revoked = client_->LeaseRevoke(revoke, deadline);
  if (!revoked.ok() && revoked.status().code() != StatusCode::kNotFound) {
    if (quiet) return revoked.status();
    ORBITKV_LOG_WARN("cluster {}: could not revoke lease {:x}: {}; etcd expires it within {} s", options_.cluster_name,
                     lease_id, revoked.status().ToString(), options_.membership_ttl_secs);
    return revoked.status();
  }
  return Status::Ok();
}

void Membership::EndRegistration(MembershipState state, const std::string& reason) {
  int64_t epoch = 0;
  {
    MutexLock lock(&mu_);
    if (state_ != MembershipState::kRegistered) return;
    state_ = state;
    reason_ = reason;
    last_cause_ = reason;
    since_ = MonoNow();
    attempts_ = 0;
    last_error_.clear();
    epoch = self_.record.epoch;
    // The keeper has nothing left to do once fenced; Stop() only flags and cancels, it does not
    // join (the supervisor joins).
    if (state == MembershipState::kFenced && keeper_) keeper_->Stop();
    wake_.notify_all();
  }
  registered_gauge_->Set(0);
  metrics_
      ->GetCounter("orbitkv_membership_registration_ends_total", "Registrations that ended, by cause",
                   {{"state", std::string(MembershipStateName(state))}})
      .Increment();
  if (state == MembershipState::kFenced || !options_.reregister) {
    ORBITKV_LOG_WARN(
        "cluster {}: node {} epoch {} is {}: {}; remote work stays off until the Manager "
        "restarts",
        options_.cluster_name, options_.node_id, epoch, MembershipStateName(state), reason);
  } else {
    ORBITKV_LOG_WARN(
        "cluster {}: node {} epoch {} is {}: {}; remote work is off while it registers "
        "again (local service goes on)",
        options_.cluster_name, options_.node_id, epoch, MembershipStateName(state), reason);
  }
}

bool Membership::WaitFor(std::chrono::milliseconds delay) {
  const MonoTime until = MonoNow() + delay;
  MutexLock lock(&mu_);
  while (!shut_down_ && MonoNow() < until) wake_.wait_until(mu_, until);
  return !shut_down_;
}

void Membership::Supervise() {
  std::minstd_rand jitter{std::random_device{}()};
  SupervisorPhase phase = SupervisorPhase::kWatching;
  std::string cause;    // why the registration being ended ended
  bool lapsed = false;  // it lapsed (kExpired) rather than being fenced
  std::chrono::milliseconds backoff = options_.reregister_backoff_min;
  bool first_attempt = true;
  while (phase != SupervisorPhase::kStopped) {
    switch (phase) {
      case SupervisorPhase::kWatching: {
        MutexLock lock(&mu_);
        while (!shut_down_ && state_ == MembershipState::kRegistered) wake_.wait(mu_);
        if (shut_down_) {
          phase = Step(phase, {.event = SupervisorEvent::kShutdown});
          break;
        }
        cause = reason_;
        lapsed = state_ == MembershipState::kExpired;
        phase = Step(phase, {.event = SupervisorEvent::kEnded});
        break;
      }
      case SupervisorPhase::kEnding:
        // End the registration's threads and what the Manager built on it (a fenced one too: its grants and owner
        // streams belong to a start peers no longer accept).
        StopIncarnation();
        view_.Invalidate();
        if (options_.on_lapsed) options_.on_lapsed(cause);
        phase =
            Step(phase, {.event = SupervisorEvent::kEndHandled, .lapsed = lapsed, .reregister = options_.reregister});
        backoff = options_.reregister_backoff_min;
        first_attempt = true;
        break;
      case SupervisorPhase::kRegistering:
        phase = Step(phase, AttemptRegistration(jitter, &backoff, &first_attempt));
        break;
      case SupervisorPhase::kIdle: {
        MutexLock lock(&mu_);
        while (!shut_down_) wake_.wait(mu_);
        phase = Step(phase, {.event = SupervisorEvent::kShutdown});
        break;
      }
      case SupervisorPhase::kStopped:
        break;
    }
  }
  StopIncarnation();
}

SupervisorInput Membership::AttemptRegistration(std::minstd_rand& jitter, std::chrono::milliseconds* backoff,
                                                bool* first) {
  if (!*first) {
    if (!WaitFor(Jittered(*backoff, jitter))) return {.event = SupervisorEvent::kShutdown};
    *backoff = std::min(*backoff * 2, options_.reregister_backoff_max);
  }
  *first = false;
  {
    MutexLock lock(&mu_);
    if (shut_down_) return {.event = SupervisorEvent::kShutdown};
    ++attempts_;
  }
  const Status status =
      Reregister(Deadline::After(std::min(options_.etcd_call_timeout, std::chrono::milliseconds(2000))));
  if (status.ok()) return {.event = SupervisorEvent::kAttemptSucceeded};
  const AttemptVerdict verdict = JudgeAttempt(status);
  const bool final = verdict == AttemptVerdict::kFence;
  int64_t attempt = 0;
  {
    MutexLock lock(&mu_);
    last_error_ = status.ToString();
    attempt = attempts_;
    if (final) {
      state_ = MembershipState::kFenced;
      reason_ = fmt::format("registering again: {}", status.message());
      last_cause_ = reason_;
      since_ = MonoNow();
    }
  }
  if (!final && status.code() != StatusCode::kCancelled && (attempt == 1 || attempt % 20 == 0)) {
    ORBITKV_LOG_WARN("cluster {}: registering node {} again, attempt {}: {}; trying again every {} ms at most",
                     options_.cluster_name, options_.node_id, attempt, status.ToString(),
                     options_.reregister_backoff_max.count());
  }
  if (final) {
    metrics_
        ->GetCounter("orbitkv_membership_registration_ends_total", "Registrations that ended, by cause",
                     {{"state", "fenced"}})
        .Increment();
    ORBITKV_LOG_WARN("cluster {}: node {} is fenced: {}; remote work stays off until the Manager restarts",
                     options_.cluster_name, options_.node_id, status.ToString());
  }
  return {.event = SupervisorEvent::kAttemptFailed, .verdict = verdict};
}

Status Membership::Reregister(Deadline deadline) {
  Member self;
  int64_t old_lease = 0;
  {
    MutexLock lock(&mu_);
    self = self_;
    old_lease = self_.lease_id;
  }
  // The old lease first: etcd refreshes leases when it restarts, so the old record may still be
  // there, and the create-only registration would find it.
  ORBITKV_RETURN_IF_ERROR(RevokeLease(old_lease, deadline, /*quiet=*/true));
  {
    MutexLock lock(&mu_);
    self_.lease_id = 0;
  }
  ORBITKV_ASSIGN_OR_RETURN(int64_t placement_revision, JoinPlacement(*client_, options_.cluster_name, configured_,
                                                                     &live_, /*initial=*/false, deadline));
  self.lease_id = 0;
  {
    // One candidate UUID for every attempt until one registers it (own_uuids_ does not grow with each retry).
    MutexLock lock(&mu_);
    if (candidate_uuid_.empty()) {
      candidate_uuid_ = NewRuntimeUuid();
      own_uuids_.push_back(candidate_uuid_);
    }
    self.record.runtime_uuid = candidate_uuid_;
  }
  ORBITKV_ASSIGN_OR_RETURN(std::unique_ptr<RegistrationClock> clock, Register(placement_revision, deadline, &self));
  RegistrationClock* current = clock.get();
  std::string cause;
  bool stopping = false;
  {
    MutexLock lock(&mu_);
    stopping = shut_down_;
  }
  if (stopping) {
    (void)RevokeLease(self.lease_id, Deadline::After(options_.etcd_call_timeout));
    return Status::Cancelled("shutting down");
  }
  {
    MutexLock lock(&mu_);
    candidate_uuid_.clear();
    clocks_.push_back(std::move(clock));
    self_ = self;
    state_ = MembershipState::kRegistered;
    reason_.clear();
    since_ = MonoNow();
    ++registrations_;
    cause = last_cause_;
  }
  clock_.store(current, std::memory_order_release);
  registered_gauge_->Set(1);
  epoch_gauge_->Set(static_cast<double>(self.record.epoch));
  metrics_
      ->GetCounter("orbitkv_membership_reregistrations_total",
                   "Registrations made again after a lapse, without a restart")
      .Increment();
  ORBITKV_LOG_INFO(
      "cluster {}: registered node {} again: epoch {} uuid {} lease {:x} (the last one "
      "ended: {})",
      options_.cluster_name, options_.node_id, self.record.epoch, self.record.runtime_uuid, self.lease_id, cause);
  // The identity goes to the Manager's parts before the view is taken: remote work stays off
  // until the new view is complete.
  if (options_.on_registered) options_.on_registered(self.record);
  StartIncarnation(self, current);
  return Status::Ok();
}

void Membership::Shutdown() {
  {
    MutexLock lock(&mu_);
    if (shut_down_) return;
    shut_down_ = true;
    if (view_sync_) view_sync_->Stop();
    if (keeper_) keeper_->Stop();
    wake_.notify_all();
  }
  if (supervisor_thread_.joinable()) supervisor_thread_.join();
  StopIncarnation();  // without a supervisor (Join failed or never ran) nothing is left, or this joins
  bool was_joined = false;
  int64_t lease = 0;
  {
    MutexLock lock(&mu_);
    was_joined = state_ != MembershipState::kNotJoined;
    if (state_ == MembershipState::kRegistered) reason_ = "shut down";
    state_ = MembershipState::kStopped;
    since_ = MonoNow();
    lease = self_.lease_id;
  }
  if (RegistrationClock* clock = clock_.load(std::memory_order_acquire)) clock->End();
  registered_gauge_->Set(0);
  if (was_joined) (void)RevokeLease(lease, Deadline::After(options_.etcd_call_timeout));
}

bool Membership::RegistrationValid() const {
  const RegistrationClock* clock = clock_.load(std::memory_order_acquire);
  return clock != nullptr && clock->Valid(MonoNow());
}

bool Membership::CanDoRemoteWork() const { return RegistrationValid() && view_.complete() && view_.SelfCounted(); }

Status Membership::RefuseWhenFull(Deadline deadline) {
  etcdserverpb::RangeRequest count;
  const std::string prefix = MembersPrefix(options_.cluster_name);
  count.set_key(prefix);
  count.set_range_end(PrefixEnd(prefix));
  count.set_count_only(true);
  ORBITKV_ASSIGN_OR_RETURN(etcdserverpb::RangeResponse counted, client_->Range(count, deadline));
  if (static_cast<size_t>(counted.count()) < options_.member_limit) return Status::Ok();
  return Status::ResourceExhausted(fmt::format(
      "cluster '{}' has {} registered Managers, its member limit is {} (the {} oldest registrations count): this "
      "Manager would wait in line with remote work off. Stop a Manager of the cluster, or run this one in another "
      "cluster (--cluster-name)",
      options_.cluster_name, counted.count(), options_.member_limit, options_.member_limit));
}

Result<Member> Membership::ResolveShardOwner(uint32_t shard) const {
  if (!RegistrationValid()) {
    return Status::Unavailable(fmt::format("remote work is disabled: membership is {}", MembershipStateName(state())));
  }
  return live_.Get()->committed.ResolveOwner(shard, view_);
}

MembershipState Membership::state() const {
  MutexLock lock(&mu_);
  return state_;
}

MemberRecord Membership::self() const {
  MutexLock lock(&mu_);
  return self_.record;
}

MembershipStatus Membership::GetStatus() const {
  MembershipStatus status;
  const MonoTime now = MonoNow();
  {
    MutexLock lock(&mu_);
    status.state = state_;
    status.reason = reason_;
    status.last_cause = last_cause_;
    status.since = std::chrono::duration_cast<std::chrono::milliseconds>(now - since_);
    status.registrations = registrations_;
    status.attempts = attempts_;
    status.last_error = last_error_;
    status.self = self_.record;
    status.lease_id = self_.lease_id;
    status.lease_ttl_secs = lease_ttl_secs_;
  }
  const RegistrationClock* clock = clock_.load(std::memory_order_acquire);
  status.registration_valid = clock != nullptr && clock->Valid(now);
  if (status.registration_valid) {
    status.registration_remaining = std::chrono::duration_cast<std::chrono::milliseconds>(clock->valid_until() - now);
  }
  status.placement_fingerprint = live_.Get()->committed.fingerprint();
  status.view = view_.Read();
  status.place = view_.PlaceOf(options_.node_id);
  status.remote_work_allowed =
      status.registration_valid && status.view.complete && status.place.standing == MemberView::Standing::kCounted;
  return status;
}

namespace {

// ", changing to generation G+1 (...): N shard(s) moving, M ready" and the like, or "".
std::string PlacementChangeLine(const LivePlacement::State& live) {
  std::string line;
  if (live.transition.has_value()) {
    const PlacementTransition& t = *live.transition;
    line = fmt::format(", change to generation {} ({}) {}", t.from_generation + 1, fmt::join(t.to_nodes, ","),
                       PlacementPhaseName(t.phase));
    if (t.phase == PlacementTransition::Phase::kMoving) {
      line += fmt::format(": {} shard(s) moving, {} ready, {} waiting", t.CountIn(ShardMove::State::kMoving),
                          t.CountIn(ShardMove::State::kReady), t.CountIn(ShardMove::State::kWaiting));
    } else if (!t.reason.empty()) {
      line += fmt::format(" ({})", t.reason);
    }
  }
  if (live.request.has_value()) {
    line += fmt::format("; requested: {}", fmt::join(live.request->catalog_nodes, ","));
  }
  if (!live.leader.empty()) line += fmt::format("; reconciler {}", live.leader);
  return line;
}

}  // namespace

std::string Membership::StatusText() const {
  const MembershipStatus s = GetStatus();
  const std::shared_ptr<const LivePlacement::State> live = live_.Get();
  const Placement& placement = live->committed;
  std::string out = fmt::format(
      "membership: {}{} for {:.1f} s\n  cluster {} node {} epoch {} uuid {}\n  endpoint {} lease {:x} "
      "ttl {} s, valid for {} ms\n  placement {} catalog nodes {}, {} copies a shard{}\n  view: {} at "
      "revision {}, {} members, remote work {}\n",
      MembershipStateName(s.state), s.reason.empty() ? "" : fmt::format(" ({})", s.reason),
      static_cast<double>(s.since.count()) / 1000, s.self.cluster, s.self.node_id, s.self.epoch, s.self.runtime_uuid,
      s.self.endpoint, s.lease_id, s.lease_ttl_secs, s.registration_remaining.count(), s.placement_fingerprint,
      fmt::join(placement.catalog_nodes(), ","), placement.replicas(),
      placement.reduced_coverage() ? " (reduced failure coverage)" : "", s.view.complete ? "complete" : "incomplete",
      s.view.revision, s.view.members.size(), s.remote_work_allowed ? "allowed" : "disabled");
  out += fmt::format("  placement generation {}{}\n", placement.generation(), PlacementChangeLine(*live));
  if (s.view.waiting > 0 || s.view.waiting_dropped) {
    out += fmt::format("  member limit {}: {} registration(s) beyond it wait in line{}{}\n", s.view.limit,
                       s.view.waiting, s.view.waiting_dropped ? " (and more, not held)" : "",
                       s.place.standing == MemberView::Standing::kWaiting
                           ? fmt::format("; this Manager is number {} in line", s.place.position)
                           : "");
  }
  if (s.state == MembershipState::kExpired && options_.reregister) {
    out += fmt::format("  registering again: attempt {}{}\n", s.attempts,
                       s.last_error.empty() ? "" : fmt::format(", last error: {}", s.last_error));
  }
  if (!s.last_cause.empty()) {
    out += fmt::format("  registrations: {}; the last one ended: {}\n", s.registrations, s.last_cause);
  }
  for (const Member& m : s.view.members) {
    out += fmt::format("    {} epoch {} {} uuid {}\n", m.record.node_id, m.record.epoch, m.record.endpoint,
                       m.record.runtime_uuid);
  }
  return out;
}

}  // namespace orbitkv::cluster
