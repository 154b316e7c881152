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
    case core::ExactStop::kNone:
      return SourceOutcome::kGranted;
    case core::ExactStop::kNotDram:
      return SourceOutcome::kNotInDram;
    case core::ExactStop::kAbsent:
    case core::ExactStop::kReplaced:
      return SourceOutcome::kStale;
  }
  return SourceOutcome::kStale;
}

}  // namespace

std::string_view SourceOutcomeName(SourceOutcome outcome) {
  switch (outcome) {
    case SourceOutcome::kGranted:
      return "granted";
    case SourceOutcome::kStale:
      return "stale";
    case SourceOutcome::kNotInDram:
      return "not_in_dram";
    case SourceOutcome::kPending:
      return "pending";
    case SourceOutcome::kBackpressure:
      return "backpressure";
    case SourceOutcome::kMissing:
      return "missing";
    case SourceOutcome::kMore:
      return "more";
  }
  return "unknown";
}

SourceHolds::SourceHolds(Options options, core::BlockTable* table, core::PinnedPool* pool, core::Budget* budget,
                         GrantIssuer* issuer)
    : options_(std::move(options)), table_(table), pool_(pool), budget_(budget), issuer_(issuer) {}

SourceHolds::~SourceHolds() {
  MutexLock lock(&mu_);
  holds_.clear();  // the transfer engine is stopped: nothing reads these pins any more
  UpdateGauges();
}

void SourceHolds::Reject(SourceOutcome why) {
  MutexLock lock(&mu_);
  ++stats_.rejected;
  ++(why == SourceOutcome::kNotInDram      ? stats_.rejected_not_in_dram
     : why == SourceOutcome::kStale        ? stats_.rejected_stale
     : why == SourceOutcome::kBackpressure ? stats_.rejected_ssd_backpressure
     : why == SourceOutcome::kMissing      ? stats_.rejected_ssd_missing
                                           : stats_.rejected_exhausted);
}

void SourceHolds::UpdateGauges() {
  uint64_t pinned = 0, quarantined = 0, quarantined_bytes = 0, preparing = 0, staging = 0;
  for (const auto& [key, hold] : holds_) {
    pinned += hold.bytes;
    preparing += hold.phase == HoldPhase::kPreparing ? 1 : 0;
    staging += hold.staging.bytes();
    if (IsQuarantined(hold.phase)) {
      ++quarantined;
      quarantined_bytes += hold.bytes;
    }
  }
  stats_.sessions = holds_.size();
  stats_.pinned_bytes = pinned;
  stats_.quarantined = quarantined;
  stats_.quarantined_bytes = quarantined_bytes;
  stats_.ssd_preparing = preparing;
  stats_.ssd_staging_bytes = staging;
}

Result<SourceGrant> SourceHolds::Authorize(const AuthorizeArgs& args) {
  Result<SourceGrant> answer = AuthorizeNow(args);
  if (!answer.ok() || answer->outcome != SourceOutcome::kPending || options_.pending_wait.count() <= 0) return answer;
  // Held back while the first piece is read (neither lock held but mu_ inside the wait), so the requester
  // neither sleeps nor asks again when the read takes less than pending_wait.
  const MonoTime until = std::min(
      MonoNow() + std::min<std::chrono::milliseconds>(options_.pending_wait, std::chrono::seconds(60)), args.answer_by);
  const HoldKey key{args.peer_runtime, args.request_id};
  MutexLock lock(&mu_);
  for (;;) {
    auto it = holds_.find(key);
    if (it == holds_.end() || IsRevoking(it->second.phase)) return answer;   // released or given up meanwhile
    if (it->second.phase != HoldPhase::kPreparing) return it->second.grant;  // the grant (or kMissing)
    if (MonoNow() >= until) return answer;
    prepared_.wait_until(mu_, until);
  }
}

Result<SourceGrant> SourceHolds::AuthorizeNow(const AuthorizeArgs& args) {
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
      if (IsRevoking(it->second.phase)) {
        return Status::FailedPrecondition(
            fmt::format("request {} of {} was already released or expired: ask again with a new request id",
                        args.request_id, args.peer_node));
      }
      if (it->second.phase == HoldPhase::kPreparing) {  // asked again while its SSD blocks are being read
        SourceGrant pending;
        pending.outcome = SourceOutcome::kPending;
        pending.retry_after = options_.retry_after;
        return pending;
      }
      return it->second.grant;  // a duplicate: the same grant (or the preparation's kMissing)
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
  if (options_.load_ssd && pinned.pinned < args.blocks.size() && args.blocks[pinned.pinned].tier == kSourceSsd) {
    // The span goes on with blocks named on SSD (their DRAM residences, if any, have other versions): the
    // whole of it is prepared (its DRAM blocks pinned exactly, its SSD ones checked against their SSD residences and
    // read into DRAM, or taken from DRAM where a local query brought them in meanwhile) and granted at once.
    core::BlockPin::ReleaseAll(&hold.pins);
    // A first block already in DRAM in another version is one an earlier preparation read (the requester asks for the
    // rest of a span piece by piece): that preparation reads the later pieces already.
    const bool read_ahead = !(pinned.pinned == 0 && pinned.stop == core::ExactStop::kReplaced);
    return Prepare(args, key, read_ahead);
  }
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
  ORBITKV_RETURN_IF_ERROR(Issue(args.peer_runtime, hold.pins, &grant));
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

Status SourceHolds::Issue(const std::string& peer_runtime, const std::vector<core::BlockPin>& pins,
                          SourceGrant* grant) {
  // The regions: one descriptor per arena the pins live in.
  std::map<uint32_t, uint32_t> region_of;
  std::vector<GrantIssuer::Range> ranges;
  for (const core::BlockPin& pin : pins) {
    auto [it, added] = region_of.emplace(pin.arena(), static_cast<uint32_t>(grant->regions.size()));
    if (added) {
      Result<std::vector<uint8_t>> descriptor = issuer_->Describe(pin.arena());
      if (!descriptor.ok()) return descriptor.status().WithContext("describing the pool to a peer");
      grant->regions.push_back(std::move(*descriptor));
    }
    grant->blocks.push_back({it->second, pin.arena_offset(), pin.bytes()});
    ranges.push_back({pin.arena(), pin.arena_offset(), pin.bytes()});
  }
  ORBITKV_ASSIGN_OR_RETURN(GrantIssuer::Issued issued, issuer_->Grant(peer_runtime, ranges));
  grant->grant_id = issued.id;
  grant->grant_secret = std::move(issued.secret);
  return Status::Ok();
}

Result<SourceGrant> SourceHolds::Prepare(const AuthorizeArgs& args, const HoldKey& key, bool read_ahead) {
  // The span: each block held here in the version named, on SSD (its residence generation) or, after the first,
  // in DRAM (pinned exactly, kept pinned while the others are read), within the byte limit.
  Hold hold;
  hold.peer_node = args.peer_node;
  hold.phase = HoldPhase::kPreparing;
  std::vector<state::StateKey> keys;
  std::vector<size_t> pieces;     // where each piece ends
  std::vector<uint64_t> charges;  // what each piece costs the staging budget
  uint64_t payload = 0, charge = 0, piece = 0;
  if (read_ahead) {
    // The span starts inside the reads of an earlier preparation (the requester asks for the rest piece by piece
    // faster than they land): that preparation reads the later pieces already.
    MutexLock lock(&mu_);
    read_ahead = !reading_.contains(args.blocks[0].key);
  }
  // A new preparation starts with a small piece (the requester's first read waits for it alone), each next one twice
  // the last up to prepare_piece_bytes; a follow-up (the rest of a span being read already) takes whole pieces.
  uint64_t piece_limit =
      std::max<uint64_t>(1, read_ahead ? std::min(options_.first_piece_bytes, options_.prepare_piece_bytes)
                                       : options_.prepare_piece_bytes);
  SourceOutcome stop = SourceOutcome::kGranted;
  for (const SourceBlockVersion& b : args.blocks) {
    uint64_t bytes = 0;
    if (b.tier == kSourceSsd) {
      const std::optional<core::SsdResidence> ssd = table_->FindSsd(b.key);
      if (!ssd.has_value() || ssd->generation != b.generation) {
        stop = SourceOutcome::kStale;
        break;
      }
      bytes = ssd->bytes;
    } else {
      std::vector<core::BlockPin> one;
      const core::ExactPins pinned =
          table_->PinExact(std::span(&b.key, 1), std::span(&b.generation, 1), std::span(&b.sequence, 1), &one);
      if (pinned.pinned != 1) {
        stop = FromStop(pinned.stop);
        break;
      }
      bytes = one[0].bytes();
      hold.pins.push_back(std::move(one[0]));
    }
    if (args.byte_limit != 0 && payload + bytes > args.byte_limit) break;
    if (piece > 0 && piece + bytes > piece_limit) {
      pieces.push_back(keys.size());
      charges.push_back(charge);
      piece = charge = 0;
      piece_limit = std::min(piece_limit * 2, options_.prepare_piece_bytes);
    }
    piece += bytes;
    payload += bytes;
    charge += pool_->ClassBytes(bytes);
    keys.push_back(b.key);
  }
  if (keys.empty()) {
    SourceGrant refused;
    refused.outcome = stop == SourceOutcome::kGranted ? SourceOutcome::kStale : stop;
    Reject(refused.outcome);
    return refused;
  }
  pieces.push_back(keys.size());
  charges.push_back(charge);
  // The first piece's charge is the hold's (until its grant drained); a later piece's only while it is read.
  Result<core::BudgetTicket> staging = options_.ssd_staging->TryReserve(PeerOwner(args.peer_runtime), charges[0]);
  if (!staging.ok()) {
    SourceGrant busy;
    busy.outcome = SourceOutcome::kBackpressure;
    busy.retry_after = options_.retry_after;
    Reject(busy.outcome);
    MutexLock lock(&mu_);
    ++stats_.ssd_backpressure;
    return busy;
  }
  hold.staging = std::move(*staging);
  hold.grant.lifetime = std::min(std::max(args.lifetime, std::chrono::milliseconds(1)), options_.max_lifetime);
  // A preparation that outlives its grant's lifetime is given up as a grant would be (ExpireDue).
  hold.deadline = options_.now() + hold.grant.lifetime;
  {
    MutexLock lock(&mu_);
    holds_.emplace(key, std::move(hold));
    ++stats_.ssd_preparations;
    UpdateGauges();
  }
  // The pieces are read at once (the SSD tier's readers take them in order): the first is granted when it is in
  // DRAM; the later ones land in DRAM as restored residents meanwhile, for the requester's next request.
  const bool more = pieces.size() > 1;
  std::vector<state::StateKey> first(keys.begin(), keys.begin() + static_cast<ptrdiff_t>(pieces[0]));
  std::vector<bool> counted = StartReading(first);
  Status started = options_.load_ssd(first, [this, key, more, first, counted](std::vector<core::BlockPin> pins) {
    UnmarkReading(first);
    // Why the grant stops where it does: a block that could not be read, the rest still being read, or the end.
    const SourceOutcome ends = pins.size() < first.size() ? SourceOutcome::kMissing
                               : more                     ? SourceOutcome::kMore
                                                          : SourceOutcome::kGranted;
    Prepared(key, std::move(pins), ends, counted);
  });
  if (!started.ok()) {
    UnmarkReading(first);
    Drained(key);  // nothing was started: the hold and its charge go
    return started.WithContext("preparing SSD blocks for a peer");
  }
  for (size_t p = 1; read_ahead && p < pieces.size(); ++p) {
    Result<core::BudgetTicket> room = options_.ssd_staging->TryReserve(PeerOwner(args.peer_runtime), charges[p]);
    if (!room.ok()) break;  // the requester asks for the rest later (stop kMore): read then
    std::vector<state::StateKey> rest(keys.begin() + static_cast<ptrdiff_t>(pieces[p - 1]),
                                      keys.begin() + static_cast<ptrdiff_t>(pieces[p]));
    auto ticket = std::make_shared<core::BudgetTicket>(std::move(*room));
    std::vector<bool> fresh = StartReading(rest);
    Status later = options_.load_ssd(rest, [this, ticket, rest, fresh](std::vector<core::BlockPin> pins) {
      UnmarkReading(rest);
      ticket->Reset();
      CountPrepared(pins, fresh);
      core::BlockPin::ReleaseAll(&pins);  // resident now (the admission decides how long): the next request pins them
    });
    if (!later.ok()) {
      UnmarkReading(rest);
      break;  // the first piece is granted alone
    }
  }
  {
    // Its blocks were all in DRAM already (a follow-up for the rest of a span): granted inline, answered at once.
    MutexLock lock(&mu_);
    auto it = holds_.find(key);
    if (it != holds_.end() && it->second.phase == HoldPhase::kGranted) return it->second.grant;
  }
  SourceGrant pending;
  pending.outcome = SourceOutcome::kPending;
  pending.retry_after = options_.retry_after;
  return pending;
}

std::vector<bool> SourceHolds::StartReading(const std::vector<state::StateKey>& keys) {
  std::vector<bool> fresh(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) fresh[i] = table_->LookupPrefix(std::span(&keys[i], 1)) == 0;
  MutexLock lock(&mu_);
  for (size_t i = 0; i < keys.size(); ++i) {
    fresh[i] = fresh[i] && !reading_.contains(keys[i]);
    ++reading_[keys[i]];
  }
  return fresh;
}

void SourceHolds::CountPrepared(const std::vector<core::BlockPin>& pins, const std::vector<bool>& fresh) {
  uint64_t blocks = 0, bytes = 0;
  for (size_t i = 0; i < pins.size() && i < fresh.size(); ++i) {
    if (!fresh[i]) continue;
    ++blocks;
    bytes += pins[i].bytes();
  }
  MutexLock lock(&mu_);
  stats_.ssd_prepared_blocks += blocks;
  stats_.ssd_prepared_bytes += bytes;
}

void SourceHolds::UnmarkReading(const std::vector<state::StateKey>& keys) {
  MutexLock lock(&mu_);
  for (const state::StateKey& k : keys) {
    auto it = reading_.find(k);
    if (it != reading_.end() && --it->second == 0) reading_.erase(it);
  }
}

void SourceHolds::Prepared(const HoldKey& key, std::vector<core::BlockPin> pins, SourceOutcome stop,
                           const std::vector<bool>& counted) {
  bool gone = false;
  {
    MutexLock lock(&mu_);
    auto it = holds_.find(key);
    gone = it == holds_.end() || IsRevoking(it->second.phase);
  }
  if (gone) {
    core::BlockPin::ReleaseAll(&pins);  // released, expired or its requester gone meanwhile
    return;
  }
  CountPrepared(pins, counted);
  SourceGrant grant;
  // Nothing in DRAM: a read error, a record that failed its checksum, an extent evicted meanwhile, or no room.
  const Status issued =
      pins.empty() ? Status::NotFound("no block of the span could be read from SSD") : Issue(key.first, pins, &grant);
  std::vector<core::BlockPin> release;  // released outside the lock
  bool revoke = false;
  bool missing = false;
  {
    MutexLock lock(&mu_);
    auto it = holds_.find(key);
    if (it == holds_.end() || IsRevoking(it->second.phase)) {
      revoke = issued.ok();  // gone while the grant was issued: it is revoked before anyone reads under it
      release = std::move(pins);
    } else {
      Hold& hold = it->second;
      release = std::move(hold.pins);  // the exact pins taken at the start; `pins` hold the same blocks now
      hold.phase = Step(hold.phase, HoldEvent::kPrepared).next;
      if (!issued.ok()) {
        // kMissing, kept for a duplicate until the hold's deadline or release.
        missing = true;
        hold.grant.outcome = SourceOutcome::kMissing;
        hold.staging.Reset();
        ++stats_.ssd_missing;
        for (core::BlockPin& pin : pins) release.push_back(std::move(pin));
      } else {
        grant.outcome = SourceOutcome::kGranted;
        grant.granted = pins.size();
        grant.stop = stop;
        grant.lifetime = hold.grant.lifetime;
        for (const core::BlockPin& pin : pins) hold.bytes += pool_->ClassBytes(pin.bytes());
        hold.grant = std::move(grant);
        hold.pins = std::move(pins);
        ++stats_.granted;
        ++stats_.ssd_granted;
      }
      UpdateGauges();
    }
  }
  prepared_.notify_all();
  if (revoke) {
    auto keep = std::make_shared<std::vector<core::BlockPin>>(std::move(release));
    if (!issuer_->Revoke(grant.grant_id, [keep] { core::BlockPin::ReleaseAll(keep.get()); }).ok()) {
      core::BlockPin::ReleaseAll(keep.get());
    }
    return;
  }
  core::BlockPin::ReleaseAll(&release);
  if (missing) {
    ORBITKV_LOG_WARN("source: SSD blocks prepared for {} not granted: {}", key.first, issued.ToString());
    Reject(SourceOutcome::kMissing);
  }
}

void SourceHolds::Revoke(const HoldKey& key, uint64_t grant) {
  if (grant == 0) {  // a preparation not granted yet, or one found missing: nothing of it can be in flight
    Drained(key);
    return;
  }
  Status revoked = issuer_->Revoke(grant, [this, key] { Drained(key); });
  if (!revoked.ok()) {
    // Unknown to the engine: nothing of it can be in flight.
    ORBITKV_LOG_WARN("source: revoking grant {:x} of {}: {} (freeing its hold)", grant, key.first, revoked.ToString());
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
    const HoldStep step = Step(it->second.phase, HoldEvent::kRelease);
    if (!step.starts_revocation) return true;  // a duplicate Release: the first one is draining it
    it->second.phase = step.next;
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
  prepared_.notify_all();                  // an authorization waiting on this preparation answers now
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
    const HoldStep step = Step(it->second.phase, HoldEvent::kRelease);
    if (!step.starts_revocation) return true;  // a duplicate: the first release is draining it
    it->second.phase = step.next;
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
      const HoldStep step = Step(hold.phase, HoldEvent::kRevoke);
      if (!step.starts_revocation) continue;
      hold.phase = step.next;
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
      if (IsRevoking(hold.phase) || now < hold.deadline) continue;
      hold.phase = Step(hold.phase, HoldEvent::kRevoke).next;
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
      if (hold.phase == HoldPhase::kPeerRevoked || checked_alive.count(key.first) != 0) continue;
      if (gone.count(key.first) == 0 && alive(hold.peer_node, key.first)) {
        checked_alive.insert(key.first);
        continue;
      }
      Gone& g = gone[key.first];
      ++g.holds;
      // A hold being revoked already (released or expired) is freed by its own revocation once it drained; the
      // peer's revocation still force-closes the endpoints its sends go out on.
      const HoldStep step = Step(hold.phase, HoldEvent::kRequesterVanished);
      if (step.starts_revocation) g.free.push_back(key);
      hold.phase = step.next;
    }
    if (!gone.empty()) UpdateGauges();
  }
  for (auto& [runtime, g] : gone) {
    ORBITKV_LOG_WARN(
        "source: requester {} left the cluster holding {} grants: revoking its transport (the pins "
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

void SourceHolds::VisitStats(StatsVisitor& v) const {
  const Stats h = GetStats();
  v.Gauge("source_sessions", static_cast<int64_t>(h.sessions),
          {"orbitkv_source_sessions", "Transfer sessions this source holds for peers (quarantined included)"});
  v.Gauge("source_pinned_bytes", static_cast<int64_t>(h.pinned_bytes),
          {"orbitkv_source_pinned_bytes", "Pool bytes this source keeps pinned for peers' transfers"});
  v.Gauge("source_quarantined_bytes", static_cast<int64_t>(h.quarantined_bytes),
          {"orbitkv_source_quarantined_bytes",
           "Pinned bytes of grants past their deadline or of vanished requesters, kept until the transport drained"});
  v.Counter("source_grants", h.granted);
  v.Counter("source_rejections", h.rejected);
  constexpr std::string_view kRejections = "orbitkv_source_rejections_total";
  constexpr std::string_view kRejectionsHelp = "Source authorizations refused, by reason";
  v.Counter("", h.rejected_stale, {kRejections, kRejectionsHelp, "reason", "stale"});
  v.Counter("", h.rejected_not_in_dram, {kRejections, kRejectionsHelp, "reason", "not_in_dram"});
  v.Counter("", h.rejected_exhausted, {kRejections, kRejectionsHelp, "reason", "resource_exhausted"});
  v.Counter("", h.rejected_ssd_backpressure, {kRejections, kRejectionsHelp, "reason", "ssd_backpressure"});
  v.Counter("", h.rejected_ssd_missing, {kRejections, kRejectionsHelp, "reason", "ssd_missing"});
  v.Counter("source_release_secret_refusals", h.release_secret_refusals);
  v.Counter("source_ssd_preparations", h.ssd_preparations);
  v.Gauge("source_ssd_preparing", static_cast<int64_t>(h.ssd_preparing));
  v.Counter("source_ssd_granted", h.ssd_granted);
  v.Counter("source_ssd_backpressure", h.ssd_backpressure);
  v.Counter("source_ssd_missing", h.ssd_missing);
  v.Counter("source_ssd_prepared_blocks", h.ssd_prepared_blocks);
  v.Counter("source_ssd_prepared_bytes", h.ssd_prepared_bytes,
            {"orbitkv_source_ssd_prepared_bytes_total", "Bytes this source read from its SSD into DRAM for peers"});
  v.Gauge("source_ssd_staging_bytes", static_cast<int64_t>(h.ssd_staging_bytes));
}

}  // namespace orbitkv::catalog
