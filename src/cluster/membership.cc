#include "cluster/membership.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <charconv>

#include "base/check.h"
#include "base/logging.h"
#include "cluster/cluster_keys.h"
#include "cluster/etcd_client.h"
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
    return Status::DataLoss(fmt::format(
        "epoch record {} holds '{}', not a positive decimal integer", key, text.substr(0, 32)));
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
    if (item.empty())
      return Status::InvalidArgument(fmt::format("{} has an empty item in '{}'", flag, value));
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
  if (options.membership_ttl_secs < kMinMembershipTtlSecs ||
      options.membership_ttl_secs > kMaxMembershipTtlSecs) {
    return Status::InvalidArgument(fmt::format("--membership-ttl-secs {} is outside {}..{}",
                                               options.membership_ttl_secs, kMinMembershipTtlSecs,
                                               kMaxMembershipTtlSecs));
  }
  ORBITKV_RETURN_IF_ERROR(Placement::Create(options.catalog_nodes).status());
  ORBITKV_RETURN_IF_ERROR(ValidateEndpoint("peer endpoint", options.peer_endpoint));
  if (!options.runtime_uuid.empty() && !IsRuntimeUuid(options.runtime_uuid)) {
    return Status::InvalidArgument(
        fmt::format("runtime UUID '{}' is not a lower-case UUID", options.runtime_uuid));
  }
  if (options.etcd_call_timeout <= std::chrono::milliseconds::zero()) {
    return Status::InvalidArgument("etcd call timeout must be positive");
  }
  return Status::Ok();
}

Result<std::unique_ptr<Membership>> Membership::Create(MembershipOptions options,
                                                       MetricsRegistry* metrics) {
  ORBITKV_CHECK(metrics != nullptr);
  ORBITKV_RETURN_IF_ERROR(ValidateMembershipOptions(options));
  ORBITKV_ASSIGN_OR_RETURN(Placement placement, Placement::Create(options.catalog_nodes));
  EtcdClientOptions client_options;
  client_options.endpoints = options.etcd_endpoints;
  client_options.call_timeout = options.etcd_call_timeout;
  client_options.metrics = metrics;
  ORBITKV_ASSIGN_OR_RETURN(std::unique_ptr<EtcdClient> client,
                           EtcdClient::Create(std::move(client_options)));
  return std::unique_ptr<Membership>(
      new Membership(std::move(options), metrics, std::move(client), std::move(placement)));
}

Membership::Membership(MembershipOptions options, MetricsRegistry* metrics,
                       std::unique_ptr<EtcdClient> client, Placement placement)
    : options_(std::move(options)),
      metrics_(metrics),
      client_(std::move(client)),
      placement_(std::move(placement)) {
  registered_gauge_ = &metrics_->GetGauge(
      "orbitkv_membership_registered", "1 while this Manager holds a valid registration, else 0");
  epoch_gauge_ = &metrics_->GetGauge("orbitkv_membership_epoch",
                                     "Epoch (incarnation) of this Manager's Node ID");
  self_.record.cluster = options_.cluster_name;
  self_.record.node_id = options_.node_id;
  self_.record.endpoint = options_.peer_endpoint;
  self_.record.runtime_uuid =
      options_.runtime_uuid.empty() ? NewRuntimeUuid() : options_.runtime_uuid;
}

Membership::~Membership() { Shutdown(); }

Status Membership::Join(Deadline deadline) {
  {
    MutexLock lock(&mu_);
    ORBITKV_CHECK_MSG(state_ == MembershipState::kNotJoined && !shut_down_ && clock_ == nullptr,
                      "Membership::Join called twice");
  }
  ORBITKV_ASSIGN_OR_RETURN(
      int64_t placement_revision,
      InstallOrVerifyPlacement(*client_, options_.cluster_name, *placement_, deadline));
  ORBITKV_RETURN_IF_ERROR(Register(placement_revision, deadline));

  LeaseKeeper::Options keeper_options;
  keeper_options.lease_id = self_.lease_id;
  keeper_options.ttl_secs = lease_ttl_secs_;
  keeper_options.etcd_cluster_id = etcd_cluster_id_;
  keeper_options.metrics = metrics_;
  keeper_options.on_lost = [this](const std::string& reason) {
    EndRegistration(MembershipState::kExpired, reason);
  };
  keeper_ = std::make_unique<LeaseKeeper>(client_.get(), clock_.get(), std::move(keeper_options));

  ViewSync::Options view_options;
  view_options.cluster = options_.cluster_name;
  view_options.self = self_;
  view_options.placement = placement_->Encode();
  view_options.etcd_cluster_id = etcd_cluster_id_;
  view_options.metrics = metrics_;
  view_options.on_installed = options_.on_view_installed;
  view_options.on_fence = [this](const std::string& reason) {
    if (clock_->End()) EndRegistration(MembershipState::kFenced, reason);
  };
  view_sync_ = std::make_unique<ViewSync>(client_.get(), &view_, std::move(view_options));

  {
    MutexLock lock(&mu_);
    state_ = MembershipState::kRegistered;
  }
  registered_gauge_->Set(1);
  epoch_gauge_->Set(static_cast<double>(self_.record.epoch));
  // The Manager's two long-lived membership threads; both end promptly on Shutdown().
  keeper_thread_ = std::thread([this] { keeper_->Run(); });
  view_thread_ = std::thread([this] { view_sync_->Run(); });
  ORBITKV_LOG_INFO("cluster {}: registered node {} epoch {} uuid {} lease {:x} (TTL {} s)",
                   options_.cluster_name, options_.node_id, self_.record.epoch,
                   self_.record.runtime_uuid, self_.lease_id, lease_ttl_secs_);
  return Status::Ok();
}

Status Membership::Register(int64_t placement_revision, Deadline deadline) {
  const std::string member_key = MemberKey(options_.cluster_name, options_.node_id);
  const std::string epoch_key = EpochKey(options_.cluster_name, options_.node_id);
  const std::string placement_key = PlacementKey(options_.cluster_name);

  etcdserverpb::LeaseGrantRequest grant;
  grant.set_ttl(options_.membership_ttl_secs);
  const MonoTime grant_sent = MonoNow();
  ORBITKV_ASSIGN_OR_RETURN(etcdserverpb::LeaseGrantResponse granted,
                           client_->LeaseGrant(grant, deadline));
  if (granted.ttl() <= 0) return Status::Unavailable("etcd granted a lease with no TTL");
  self_.lease_id = granted.id();
  lease_ttl_secs_ = granted.ttl();
  etcd_cluster_id_ = granted.header().cluster_id();
  clock_ =
      std::make_unique<RegistrationClock>(grant_sent + std::chrono::seconds(lease_ttl_secs_) / 2);

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
    self_.record.epoch = epoch + 1;

    etcdserverpb::TxnRequest txn;
    AddCompare(txn, member_key, etcdserverpb::Compare::CREATE)->set_create_revision(0);
    AddCompare(txn, epoch_key, etcdserverpb::Compare::MOD)->set_mod_revision(epoch_mod_revision);
    AddCompare(txn, placement_key, etcdserverpb::Compare::MOD)
        ->set_mod_revision(placement_revision);
    etcdserverpb::PutRequest* put_epoch = txn.add_success()->mutable_request_put();
    put_epoch->set_key(epoch_key);
    put_epoch->set_value(std::to_string(self_.record.epoch));
    etcdserverpb::PutRequest* put_member = txn.add_success()->mutable_request_put();
    put_member->set_key(member_key);
    put_member->set_value(EncodeMemberRecord(self_.record));
    put_member->set_lease(self_.lease_id);
    txn.add_failure()->mutable_request_range()->set_key(member_key);
    Result<etcdserverpb::TxnResponse> response = client_->Txn(txn, deadline);
    if (!response.ok()) {
      status = response.status();
      break;
    }
    if (response->succeeded()) {
      self_.create_revision = response->header().revision();
      self_.mod_revision = response->header().revision();
      return Status::Ok();
    }
    const etcdserverpb::RangeResponse& holder = response->responses(0).response_range();
    if (holder.kvs_size() == 1) {
      const mvccpb::KeyValue& kv = holder.kvs(0);
      Result<MemberRecord> record =
          DecodeMemberRecord(options_.cluster_name, options_.node_id, kv.value());
      if (record.ok() && record->runtime_uuid == self_.record.runtime_uuid &&
          kv.lease() == self_.lease_id) {
        // An earlier attempt of this very transaction was applied although its reply was lost.
        self_.record = *record;
        self_.create_revision = kv.create_revision();
        self_.mod_revision = kv.mod_revision();
        return Status::Ok();
      }
      status = Status::AlreadyExists(
          fmt::format("node '{}' is already registered in cluster '{}' by a live runtime ({}); "
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
    if (placement.ok() &&
        (placement->kvs_size() != 1 || placement->kvs(0).mod_revision() != placement_revision)) {
      status = Status::FailedPrecondition(fmt::format(
          "placement record of cluster '{}' changed during join", options_.cluster_name));
      break;
    }
  }
  RevokeLease();
  clock_->End();
  return status;
}

void Membership::RevokeLease() {
  if (self_.lease_id == 0) return;
  etcdserverpb::LeaseRevokeRequest revoke;
  revoke.set_id(self_.lease_id);
  Result<etcdserverpb::LeaseRevokeResponse> revoked =
      client_->LeaseRevoke(revoke, Deadline::After(options_.etcd_call_timeout));
  if (!revoked.ok() && revoked.status().code() != StatusCode::kNotFound) {
    ORBITKV_LOG_WARN("cluster {}: could not revoke lease {:x}: {}; etcd expires it within {} s",
                     options_.cluster_name, self_.lease_id, revoked.status().ToString(),
                     lease_ttl_secs_);
  }
}

void Membership::EndRegistration(MembershipState state, const std::string& reason) {
  {
    MutexLock lock(&mu_);
    if (state_ != MembershipState::kRegistered) return;
    state_ = state;
    reason_ = reason;
  }
  registered_gauge_->Set(0);
  metrics_
      ->GetCounter("orbitkv_membership_registration_ends_total",
                   "Registrations that ended, by cause",
                   {{"state", std::string(MembershipStateName(state))}})
      .Increment();
  ORBITKV_LOG_WARN(
      "cluster {}: node {} epoch {} is {}: {}; new remote work is disabled until the Manager "
      "restarts",
      options_.cluster_name, options_.node_id, self_.record.epoch, MembershipStateName(state),
      reason);
  // The other thread has nothing left to do; Stop() only flags and cancels, it does not join.
  if (state == MembershipState::kFenced && keeper_) keeper_->Stop();
}

void Membership::Shutdown() {
  {
    MutexLock lock(&mu_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  if (view_sync_) view_sync_->Stop();
  if (keeper_) keeper_->Stop();
  if (view_thread_.joinable()) view_thread_.join();
  if (keeper_thread_.joinable()) keeper_thread_.join();
  bool was_joined = false;
  {
    MutexLock lock(&mu_);
    was_joined = state_ != MembershipState::kNotJoined;
    if (state_ == MembershipState::kRegistered) reason_ = "shut down";
    state_ = MembershipState::kStopped;
  }
  if (clock_) clock_->End();
  registered_gauge_->Set(0);
  if (was_joined) RevokeLease();
}

bool Membership::RegistrationValid() const { return clock_ != nullptr && clock_->Valid(MonoNow()); }

bool Membership::CanDoRemoteWork() const { return RegistrationValid() && view_.complete(); }

Result<Member> Membership::ResolveShardOwner(uint32_t shard) const {
  if (!RegistrationValid()) {
    return Status::Unavailable(
        fmt::format("remote work is disabled: membership is {}", MembershipStateName(state())));
  }
  return placement_->ResolveOwner(shard, view_);
}

MembershipState Membership::state() const {
  MutexLock lock(&mu_);
  return state_;
}

MembershipStatus Membership::GetStatus() const {
  MembershipStatus status;
  {
    MutexLock lock(&mu_);
    status.state = state_;
    status.reason = reason_;
  }
  const MonoTime now = MonoNow();
  status.registration_valid = clock_ != nullptr && clock_->Valid(now);
  status.self = self_.record;
  status.lease_id = self_.lease_id;
  status.lease_ttl_secs = lease_ttl_secs_;
  if (status.registration_valid) {
    status.registration_remaining =
        std::chrono::duration_cast<std::chrono::milliseconds>(clock_->valid_until() - now);
  }
  status.placement_fingerprint = placement_->fingerprint();
  status.view = view_.Read();
  status.remote_work_allowed = status.registration_valid && status.view.complete;
  return status;
}

std::string Membership::StatusText() const {
  const MembershipStatus s = GetStatus();
  std::string out = fmt::format(
      "membership: {}{}\n  cluster {} node {} epoch {} uuid {}\n  endpoint {} lease {:x} ttl {} s, "
      "valid for "
      "{} ms\n  placement {} catalog nodes {}\n  view: {} at revision {}, {} members, remote work "
      "{}\n",
      MembershipStateName(s.state), s.reason.empty() ? "" : fmt::format(" ({})", s.reason),
      s.self.cluster, s.self.node_id, s.self.epoch, s.self.runtime_uuid, s.self.endpoint,
      s.lease_id, s.lease_ttl_secs, s.registration_remaining.count(), s.placement_fingerprint,
      fmt::join(placement_->catalog_nodes(), ","), s.view.complete ? "complete" : "incomplete",
      s.view.revision, s.view.members.size(), s.remote_work_allowed ? "allowed" : "disabled");
  for (const Member& m : s.view.members) {
    out += fmt::format("    {} epoch {} {} uuid {}\n", m.record.node_id, m.record.epoch,
                       m.record.endpoint, m.record.runtime_uuid);
  }
  return out;
}

}  // namespace orbitkv::cluster
