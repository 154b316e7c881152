#include "catalog/source_holds.h"

#include <set>
#include <utility>

#include "base/constant_time.h"
#include "base/logging.h"
#include "fmt/format.h"

namespace orbitkv::catalog {
namespace {

uint64_t PeerOwner(const std::string& runtime) { return std::hash<std::string>{}(runtime) | 1; }

SourceOutcome FromStop(core::ExactStop stop) {
  switch (stop) {
    case core::ExactStop::kNone: return SourceOutcome::kGranted;
    case core::ExactStop::kNotDram: return SourceOutcome::kNotInDram;
    case core::ExactStop::kAbsent:
    case core::ExactStop::kReplaced: return SourceOutcome::kStale;
  }
  return SourceOutcome::kStale;
}

}  // namespace

std::string_view SourceOutcomeName(SourceOutcome outcome) {
  switch (outcome) {
    case SourceOutcome::kGranted: return "granted";
    case SourceOutcome::kStale: return "stale";
    case SourceOutcome::kNotInDram: return "not_in_dram";
  }
  return "unknown";
}

SourceHolds::SourceHolds(Options options, core::BlockTable* table, core::PinnedPool* pool, core::Budget* budget,
                         GrantIssuer* issuer, MetricsRegistry* metrics)
    : options_(std::move(options)), table_(table), pool_(pool), budget_(budget), issuer_(issuer) {
  if (metrics != nullptr) {
    sessions_gauge_ = &metrics->GetGauge("orbitkv_source_sessions",
                                         "Transfer sessions this source holds for peers (quarantined included)");
    pinned_gauge_ = &metrics->GetGauge("orbitkv_source_pinned_bytes",
                                       "Pool bytes this source keeps pinned for peers' transfers");
    quarantined_gauge_ = &metrics->GetGauge(
        "orbitkv_source_quarantined_bytes",
        "Pinned bytes of grants past their deadline or of vanished requesters, kept until the transport drained");
    const std::string help = "Source authorizations refused, by reason";
    stale_ = &metrics->GetCounter("orbitkv_source_rejections_total", help, {{"reason", "stale"}});
    not_dram_ = &metrics->GetCounter("orbitkv_source_rejections_total", help, {{"reason", "not_in_dram"}});
    exhausted_ = &metrics->GetCounter("orbitkv_source_rejections_total", help, {{"reason", "resource_exhausted"}});
  }
}

SourceHolds::~SourceHolds() {
  MutexLock lock(&mu_);
  holds_.clear();  // the transfer engine is stopped: nothing reads these pins any more
  UpdateGauges();
}

void SourceHolds::Reject(SourceOutcome why) {
  Counter* counter = why == SourceOutcome::kNotInDram ? not_dram_ : why == SourceOutcome::kStale ? stale_ : exhausted_;
  if (counter != nullptr) counter->Increment();
  MutexLock lock(&mu_);
  ++stats_.rejected;
}

void SourceHolds::UpdateGauges() {
  uint64_t pinned = 0, quarantined = 0, quarantined_bytes = 0;
  for (const auto& [key, hold] : holds_) {
    pinned += hold.bytes;
    if (hold.quarantined) {
      ++quarantined;
      quarantined_bytes += hold.bytes;
    }
  }
  stats_.sessions = holds_.size();
  stats_.pinned_bytes = pinned;
  stats_.quarantined = quarantined;
  stats_.quarantined_bytes = quarantined_bytes;
  if (sessions_gauge_ != nullptr) {
    sessions_gauge_->Set(static_cast<int64_t>(holds_.size()));
    pinned_gauge_->Set(static_cast<int64_t>(pinned));
    quarantined_gauge_->Set(static_cast<int64_t>(quarantined_bytes));
  }
}

Result<SourceGrant> SourceHolds::Authorize(const AuthorizeArgs& args) {
  if (args.blocks.empty() || args.blocks.size() > kMaxBlocks) {
    return Status::InvalidArgument(
        fmt::format("an authorization names {} blocks (1 to {} allowed)", args.blocks.size(), kMaxBlocks));
  }
  const HoldKey key{args.peer_runtime, args.request_id};
  // One authorization at a time (each is a few microseconds of pinning): a duplicate waits for the first and
  // finds its grant, never a second ticket.
  MutexLock serial(&authorize_mu_);
  if (!accepting_) {  // checked under authorize_mu_: no grant slips in after RevokeAll(stop accepting)
    return Status::FailedPrecondition(
        "this source's registration ended: no new grants until it is registered again (retry later)");
  }
  {
    MutexLock lock(&mu_);
    auto it = holds_.find(key);
    if (it != holds_.end()) {
      if (it->second.revoking) {
        return Status::FailedPrecondition(fmt::format(
            "request {} of {} was already released or expired: ask again with a new request id", args.request_id,
            args.peer_node));
      }
      return it->second.grant;  // a duplicate: the same grant
    }
  }
  std::vector<state::StateKey> keys;
  std::vector<uint64_t> generations, sequences;
  keys.reserve(args.blocks.size());
  for (const SourceBlockVersion& b : args.blocks) {
    keys.push_back(b.key);
    generations.push_back(b.generation);
    sequences.push_back(b.sequence);
  }
  Hold hold;
  hold.peer_node = args.peer_node;
  const core::ExactPins pinned = table_->PinExact(keys, generations, sequences, &hold.pins);
  SourceGrant& grant = hold.grant;
  grant.stop = FromStop(pinned.stop);
  // Within the requester's byte limit.
  size_t take = 0;
  uint64_t payload = 0;
  for (; take < pinned.pinned; ++take) {
    const uint64_t bytes = hold.pins[take].bytes();
    if (args.byte_limit != 0 && payload + bytes > args.byte_limit) break;
    payload += bytes;
    hold.bytes += pool_->ClassBytes(bytes);
  }
  if (take < pinned.pinned) {
    hold.pins.erase(hold.pins.begin() + static_cast<ptrdiff_t>(take), hold.pins.end());
    grant.stop = SourceOutcome::kGranted;  // stopped by the byte limit, not by a version
  }
  grant.granted = take;
  if (take == 0 && pinned.pinned > 0) {
    return Status::OutOfRange(fmt::format("the byte limit {} is smaller than the first block ({} bytes)",
                                          args.byte_limit, hold.pins[0].bytes()));
  }
  if (take == 0) {
    grant.outcome = grant.stop;
    Reject(grant.outcome);
    return grant;  // nothing pinned, no session
  }
  Result<core::BudgetTicket> ticket = budget_->TryReserve(PeerOwner(args.peer_runtime), hold.bytes);
  if (!ticket.ok()) {
    Reject(SourceOutcome::kGranted);
    return Status::ResourceExhausted(fmt::format(
        "this source cannot pin {} more bytes for {} ({}; raise --transfer-budget or --transfer-peer-budget)",
        hold.bytes, args.peer_node, ticket.status().message()));
  }
  hold.ticket = std::move(*ticket);
  // The regions: one descriptor per arena the pins live in.
  std::map<uint32_t, uint32_t> region_of;
  std::vector<GrantIssuer::Range> ranges;
  for (const core::BlockPin& pin : hold.pins) {
    auto [it, added] = region_of.emplace(pin.arena(), static_cast<uint32_t>(grant.regions.size()));
    if (added) {
      Result<std::vector<uint8_t>> descriptor = issuer_->Describe(pin.arena());
      if (!descriptor.ok()) return descriptor.status().WithContext("describing the pool to a peer");
      grant.regions.push_back(std::move(*descriptor));
    }
    grant.blocks.push_back({it->second, pin.arena_offset(), pin.bytes()});
    ranges.push_back({pin.arena(), pin.arena_offset(), pin.bytes()});
  }
  ORBITKV_ASSIGN_OR_RETURN(GrantIssuer::Issued issued, issuer_->Grant(args.peer_runtime, ranges));
  grant.grant_id = issued.id;
  grant.grant_secret = std::move(issued.secret);
  grant.outcome = SourceOutcome::kGranted;
  grant.lifetime = std::min(std::max(args.lifetime, std::chrono::milliseconds(1)), options_.max_lifetime);
  hold.deadline = options_.now() + grant.lifetime;
  SourceGrant reply = grant;
  MutexLock lock(&mu_);
  holds_.emplace(key, std::move(hold));
  ++stats_.granted;
  UpdateGauges();
  return reply;
}

void SourceHolds::Revoke(const HoldKey& key, uint64_t grant) {
  Status revoked = issuer_->Revoke(grant, [this, key] { Drained(key); });
  if (!revoked.ok()) {
    // Unknown to the engine: nothing of it can be in flight.
    ORBITKV_LOG_WARN("source: revoking grant {:x} of {}: {} (freeing its hold)", grant, key.first,
                     revoked.ToString());
    Drained(key);
  }
}

bool SourceHolds::Release(const std::string& peer_runtime, uint64_t request_id) {
  const HoldKey key{peer_runtime, request_id};
  uint64_t grant = 0;
  {
    MutexLock lock(&mu_);
    auto it = holds_.find(key);
    if (it == holds_.end()) return false;
    if (it->second.revoking) return true;  // a duplicate Release: the first one is draining it
    it->second.revoking = true;
    grant = it->second.grant.grant_id;
  }
  Revoke(key, grant);
  return true;
}

void SourceHolds::Drained(const HoldKey& key) {
  Hold gone;
  {
    MutexLock lock(&mu_);
    auto it = holds_.find(key);
    if (it == holds_.end()) return;
    gone = std::move(it->second);
    holds_.erase(it);
    ++stats_.released;
    UpdateGauges();
  }
  core::BlockPin::ReleaseAll(&gone.pins);  // outside the lock (the table's shard locks)
}

bool SourceHolds::ReleaseGrant(const std::string& peer_node, uint64_t grant_id, const std::string& grant_secret) {
  HoldKey key;
  {
    MutexLock lock(&mu_);
    auto it = holds_.begin();
    while (it != holds_.end() && (it->second.grant.grant_id != grant_id || it->second.peer_node != peer_node)) ++it;
    if (it == holds_.end() || grant_id == 0) return false;
    const std::string& expected = it->second.grant.grant_secret;
    if (!ConstantTimeEqual(grant_secret.data(), grant_secret.size(), expected.data(), expected.size())) {
      ++stats_.release_secret_refusals;
      return false;
    }
    if (it->second.revoking) return true;  // a duplicate: the first release is draining it
    it->second.revoking = true;
    key = it->first;
  }
  Revoke(key, grant_id);
  return true;
}

void SourceHolds::Accept() {
  MutexLock serial(&authorize_mu_);
  accepting_ = true;
}

size_t SourceHolds::RevokeAll(std::string_view why, bool stop_accepting) {
  MutexLock serial(&authorize_mu_);  // no authorization lands between the scan and the revocations
  if (stop_accepting) accepting_ = false;
  std::vector<std::pair<HoldKey, uint64_t>> all;
  {
    MutexLock lock(&mu_);
    for (auto& [key, hold] : holds_) {
      if (hold.revoking) continue;
      hold.revoking = true;
      hold.quarantined = true;
      all.emplace_back(key, hold.grant.grant_id);
    }
    if (!all.empty()) UpdateGauges();
  }
  if (!all.empty()) {
    ORBITKV_LOG_WARN("source: revoking all {} grants ({}); their pins stay until each drained", all.size(), why);
  }
  for (const auto& [key, grant] : all) Revoke(key, grant);
  return all.size();
}

size_t SourceHolds::ExpireDue() {
  const MonoTime now = options_.now();
  std::vector<std::pair<HoldKey, uint64_t>> due;
  {
    MutexLock lock(&mu_);
    for (auto& [key, hold] : holds_) {
      if (hold.revoking || now < hold.deadline) continue;
      hold.revoking = true;
      hold.quarantined = true;
      due.emplace_back(key, hold.grant.grant_id);
    }
    if (!due.empty()) UpdateGauges();
  }
  for (const auto& [key, grant] : due) {
    ORBITKV_LOG_WARN("source: grant {:x} of {} passed its deadline: revoking it (its pins stay until it drained)",
                     grant, key.first);
    Revoke(key, grant);
  }
  return due.size();
}

size_t SourceHolds::DropVanished(
    const std::function<bool(const std::string& node, const std::string& runtime)>& alive) {
  // Serialized with Authorize: no hold of a requester found gone is inserted between this scan and the revocation.
  MutexLock serial(&authorize_mu_);
  struct Gone {
    std::vector<HoldKey> free;  // holds this revocation frees once drained
    size_t holds = 0;
  };
  std::map<std::string, Gone> gone;  // runtime -> its holds
  {
    MutexLock lock(&mu_);
    std::set<std::string> checked_alive;
    for (auto& [key, hold] : holds_) {
      if (hold.peer_revoked || checked_alive.count(key.first) != 0) continue;
      if (gone.count(key.first) == 0 && alive(hold.peer_node, key.first)) {
        checked_alive.insert(key.first);
        continue;
      }
      Gone& g = gone[key.first];
      ++g.holds;
      // A hold being revoked already (released or expired) is freed by its own revocation once it drained; the
      // peer's revocation still force-closes the endpoints its sends go out on.
      if (!hold.revoking) g.free.push_back(key);
      hold.peer_revoked = true;
      hold.revoking = true;
      hold.quarantined = true;
    }
    if (!gone.empty()) UpdateGauges();
  }
  for (auto& [runtime, g] : gone) {
    ORBITKV_LOG_WARN("source: requester {} left the cluster holding {} grants: revoking its transport (the pins "
                     "stay until it drained)",
                     runtime, g.holds);
    std::vector<HoldKey> keys = std::move(g.free);
    Status revoked = issuer_->RevokePeer(runtime, [this, keys] {
      for (const HoldKey& key : keys) Drained(key);
    });
    if (!revoked.ok()) {
      for (const HoldKey& key : keys) Drained(key);
    }
  }
  return gone.size();
}

SourceHolds::Stats SourceHolds::GetStats() const {
  MutexLock lock(&mu_);
  return stats_;
}

}  // namespace orbitkv::catalog
