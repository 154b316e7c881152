// UcxTransferEngine, serving side: validating read requests against the region table, pinning
// source bytes, pushing fragments, answering with a done message, and releasing pins only once
// every send is terminal.
#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "base/check.h"
#include "base/constant_time.h"
#include "base/logging.h"
#include "transfer/ucx_engine_internal.h"

namespace orbitkv::transfer {
namespace {

// A grant id is a capability: unguessable, from the kernel's generator.
uint64_t SecureRandomU64() {
  uint64_t value = 0;
  auto* bytes = reinterpret_cast<uint8_t*>(&value);
  size_t filled = 0;
  while (filled < sizeof(value)) {
    const ssize_t n = getrandom(bytes + filled, sizeof(value) - filled, 0);
    if (n < 0 && errno == EINTR) continue;
    ORBITKV_CHECK_MSG(n > 0, "getrandom failed: errno {}", errno);
    filled += static_cast<size_t>(n);
  }
  return value;
}

}  // namespace

ucs_status_t UcxTransferEngine::OnAmReadRequest(void* arg, const void* header, size_t header_length, void* data,
                                                size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxTransferEngine*>(arg);
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  if (rndv || header_length != sizeof(wire::ReadRequest) || (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) == 0 ||
      length > size_t{wire::kMaxFragmentsPerBatch} * sizeof(wire::WireFragment)) {
    self->counters_->protocol_errors->Increment();
    return rndv ? UCS_ERR_INVALID_PARAM : UCS_OK;
  }
  Event e;
  e.kind = Event::Kind::kReadRequest;
  e.ep = param->reply_ep;
  e.header.assign(static_cast<const uint8_t*>(header), static_cast<const uint8_t*>(header) + header_length);
  e.data.assign(static_cast<const uint8_t*>(data), static_cast<const uint8_t*>(data) + length);
  self->events_.push_back(std::move(e));
  return UCS_OK;
}

ucs_status_t UcxTransferEngine::OnAmCancel(void* arg, const void* header, size_t header_length, void* /*data*/,
                                           size_t /*length*/, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxTransferEngine*>(arg);
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  if (rndv || header_length != sizeof(wire::CancelHeader) ||
      (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) == 0) {
    self->counters_->protocol_errors->Increment();
    return rndv ? UCS_ERR_INVALID_PARAM : UCS_OK;
  }
  Event e;
  e.kind = Event::Kind::kCancel;
  e.ep = param->reply_ep;
  e.header.assign(static_cast<const uint8_t*>(header), static_cast<const uint8_t*>(header) + header_length);
  self->events_.push_back(std::move(e));
  return UCS_OK;
}

void UcxTransferEngine::HandleReadRequest(const Event& e) {
  auto sit = server_ep_by_handle_.find(e.ep);
  if (sit == server_ep_by_handle_.end()) {
    counters_->protocol_errors->Increment();
    return;
  }
  ServerEp& sep = *server_eps_.at(sit->second);
  wire::ReadRequest h;
  std::memcpy(&h, e.header.data(), sizeof(h));
  if (sep.serve_by_batch.count(h.batch_id) != 0) {
    counters_->protocol_errors->Increment();  // A duplicate request id from one requester: ignore it.
    return;
  }

  auto op = std::make_unique<ServeOp>();
  if (auto early = std::find(sep.early_cancels.begin(), sep.early_cancels.end(), h.batch_id);
      early != sep.early_cancels.end()) {
    sep.early_cancels.erase(early);
    op->cancelled = true;
  }
  op->id = next_local_id_++;
  op->server_ep_id = sep.id;
  op->ep = sep.ep;
  op->batch_id = h.batch_id;
  op->flags = h.flags;
  op->deadline = MonoNow() + std::chrono::milliseconds(h.deadline_ms) + options_.serve_deadline_slack;

  const size_t n = h.fragment_count;
  if (h.version != wire::kProtocolVersion) {
    op->failure = Status::InvalidArgument(
        fmt::format("protocol version {} (this engine speaks {})", h.version, wire::kProtocolVersion));
  } else if (n == 0 || n > wire::kMaxFragmentsPerBatch || e.data.size() != n * sizeof(wire::WireFragment)) {
    op->failure = Status::InvalidArgument(fmt::format("read request with {} fragments in {} bytes", n, e.data.size()));
  } else if (h.engine_id != engine_id_) {
    op->failure = Status::NotFound(fmt::format(
        "descriptors name engine incarnation {:016x}; this engine is {:016x} (restarted?)", h.engine_id, engine_id_));
  } else {
    std::vector<wire::WireFragment> fragments(n);
    std::memcpy(fragments.data(), e.data.data(), e.data.size());
    MutexLock lock(&regions_mu_);
    GrantSecret secret;
    std::memcpy(secret.data(), h.grant_secret, secret.size());
    if (Status granted = CheckGrant(h.grant_id, secret, fragments); !granted.ok()) {
      counters_->grant_refusals->Increment();
      op->failure = granted;
    }
    for (size_t i = 0; i < n && !op->failure; ++i) {
      const wire::WireFragment& f = fragments[i];
      if (f.region_index >= regions_.size() || !regions_[f.region_index].live ||
          regions_[f.region_index].generation != f.generation) {
        op->failure = Status::NotFound(
            fmt::format("fragment {}: region {}/{} is not registered here", i, f.region_index, f.generation));
      } else if (const Region& r = regions_[f.region_index];
                 f.length == 0 || f.offset > r.length || f.length > r.length - f.offset) {
        op->failure = Status::OutOfRange(
            fmt::format("fragment {}: [{}, +{}) outside region of {} bytes", i, f.offset, f.length, r.length));
      } else {
        regions_[f.region_index].pins += 1;
        op->pinned.push_back(RegionHandle{f.region_index, f.generation});
        op->src.push_back(r.base + f.offset);
        op->lengths.push_back(f.length);
      }
    }
    if (op->failure) {
      for (const RegionHandle& p : op->pinned) regions_[p.index].pins -= 1;
      op->pinned.clear();
      op->src.clear();
      op->lengths.clear();
    } else if (h.grant_id != 0) {
      grants_.at(h.grant_id).serving += 1;
      op->grant = h.grant_id;
      sep.grants.insert(h.grant_id);
      sep.posting_by_grant[h.grant_id].push_back(op->id);
    }
  }
  op->headers.resize(op->src.size());
  op->hashes = BatchChecksum(op->src.size());
  if (!op->failure && (op->flags & wire::kFlagChecksumOnly) != 0) {
    // RMA mode: the requester already fetched the bytes; hash what it read.
    for (size_t i = 0; i < op->src.size(); ++i) op->hashes.Set(i, FragmentHash(op->src[i], op->lengths[i]));
    op->next = static_cast<uint32_t>(op->src.size());
  }
  ServeOp& s = *op;
  sep.serve_by_batch[s.batch_id] = s.id;
  serve_ops_.emplace(s.id, std::move(op));
  serving_count_.fetch_add(1, std::memory_order_relaxed);
  PumpServe(s);
  MaybeFinishServe(s);
}

std::deque<uint64_t>* UcxTransferEngine::PostingOrder(const ServeOp& s) {
  if (s.grant == 0) return nullptr;
  auto sep = server_eps_.find(s.server_ep_id);
  if (sep == server_eps_.end()) return nullptr;
  auto order = sep->second->posting_by_grant.find(s.grant);
  return order == sep->second->posting_by_grant.end() ? nullptr : &order->second;
}

void UcxTransferEngine::EndPostingTurn(ServeOp& s) {
  std::deque<uint64_t>* order = PostingOrder(s);
  if (order == nullptr) return;
  auto at = std::find(order->begin(), order->end(), s.id);
  if (at == order->end()) return;
  const bool was_first = at == order->begin();
  order->erase(at);
  if (order->empty()) {
    server_eps_.at(s.server_ep_id)->posting_by_grant.erase(s.grant);  // `order` goes
    return;
  }
  if (!was_first) return;
  if (auto next = serve_ops_.find(order->front()); next != serve_ops_.end()) PumpServe(*next->second);
}

void UcxTransferEngine::PumpServe(ServeOp& s) {
  if (s.cancelled || s.failure || s.ep_failed || s.expired) {
    EndPostingTurn(s);
    return;
  }
  // An earlier request of the same grant is still being sent: this one waits for its turn.
  if (const std::deque<uint64_t>* order = PostingOrder(s); order != nullptr && order->front() != s.id) return;
  const uint32_t n = static_cast<uint32_t>(s.src.size());
  const bool checksum = (s.flags & wire::kFlagChecksum) != 0;
  while (s.next < n && s.inflight_bytes < options_.max_served_inflight_bytes) {
    const uint32_t i = s.next++;
    s.headers[i] = wire::DataHeader{s.batch_id, i, 0};
    s.outstanding += 1;
    s.inflight_bytes += s.lengths[i];
    s.sent += 1;
    // No flags: UCX picks eager or rendezvous by size, so large fragments land without a copy.
    SendAm(s.ep, wire::kAmData, &s.headers[i], sizeof(wire::DataHeader), s.src[i], s.lengths[i], 0,
           new Op{this, Op::Kind::kServeData, s.id, i, UCS_OK});
    // Hash while UCX moves the bytes; the source bytes are pinned and stable until the send is
    // terminal.
    if (checksum) s.hashes.Set(i, FragmentHash(s.src[i], s.lengths[i]));
  }
}

void UcxTransferEngine::MaybeFinishServe(ServeOp& s) {
  if (s.outstanding > 0) return;
  const bool stopped = s.cancelled || s.failure || s.ep_failed || s.expired;
  if (!s.done_sent) {
    if (!stopped && s.next < s.src.size()) return;  // PumpServe continues.
    if (!s.unpinned) {
      Unpin(s.pinned);
      s.unpinned = true;
    }
    if (!s.ep_failed) {
      Status status = s.failure     ? *s.failure
                      : s.cancelled ? Status::Cancelled(fmt::format("cancelled after {} fragments", s.sent))
                                    : Status::Ok();
      const bool with_checksum = status.ok() && (s.flags & wire::kFlagChecksum) != 0;
      SendDone(s, status, with_checksum, with_checksum ? s.hashes.Finish() : 0);
      // Every fragment is sent and DONE is posted ahead of the grant's next request.
      EndPostingTurn(s);
      if (s.outstanding > 0) return;
    }
  }
  if (!s.unpinned) {
    Unpin(s.pinned);
    s.unpinned = true;
  }
  if (auto it = server_eps_.find(s.server_ep_id); it != server_eps_.end()) {
    it->second->serve_by_batch.erase(s.batch_id);
  }
  serving_count_.fetch_sub(1, std::memory_order_relaxed);
  EndPostingTurn(s);
  const uint64_t grant = s.grant;
  serve_ops_.erase(s.id);  // Destroys `s`.
  if (grant != 0) GrantOpEnded(grant);
}

// ---- Grants
// ------------------------------------------------------------------------------------------------

Status UcxTransferEngine::CheckGrant(uint64_t grant_id, const GrantSecret& secret,
                                     const std::vector<wire::WireFragment>& fragments) {
  if (grant_id == 0) {
    if (!options_.require_grants) return Status::Ok();
    return Status::PermissionDenied("this source serves reads only inside a grant (the request names none)");
  }
  auto it = grants_.find(grant_id);
  if (it == grants_.end() || it->second.revoked) {
    return Status::PermissionDenied(
        fmt::format("grant {:016x} is not live here (revoked, drained or never issued)", grant_id));
  }
  if (!ConstantTimeEqual(secret.data(), secret.size(), it->second.secret.data(), it->second.secret.size())) {
    counters_->grant_secret_refusals->Increment();
    return Status::PermissionDenied(fmt::format(
        "grant {:016x} is not this requester's: the request does not present the grant's secret", grant_id));
  }
  const std::vector<GrantRange>& ranges = it->second.ranges;
  for (size_t i = 0; i < fragments.size(); ++i) {
    const wire::WireFragment& f = fragments[i];
    // The last range starting at or before the fragment, in (region, offset) order.
    auto after =
        std::upper_bound(ranges.begin(), ranges.end(), f, [](const wire::WireFragment& x, const GrantRange& r) {
          return std::make_pair(x.region_index, x.offset) < std::make_pair(r.region.index, r.offset);
        });
    const GrantRange* r = after == ranges.begin() ? nullptr : &*std::prev(after);
    if (r == nullptr || r->region.index != f.region_index || r->region.generation != f.generation || f.length == 0 ||
        f.offset - r->offset > r->length || f.length > r->length - (f.offset - r->offset)) {
      return Status::PermissionDenied(fmt::format("fragment {}: region {}/{} [{}, +{}) is outside grant {:016x}", i,
                                                  f.region_index, f.generation, f.offset, f.length, grant_id));
    }
  }
  return Status::Ok();
}

Result<IssuedGrant> UcxTransferEngine::CreateGrant(GrantRequest request) {
  if (request.ranges.empty()) return Status::InvalidArgument("CreateGrant: no ranges");
  std::sort(request.ranges.begin(), request.ranges.end(), [](const GrantRange& a, const GrantRange& b) {
    return std::make_pair(a.region.index, a.offset) < std::make_pair(b.region.index, b.offset);
  });
  MutexLock lock(&regions_mu_);
  for (size_t i = 0; i < request.ranges.size(); ++i) {
    const GrantRange& g = request.ranges[i];
    if (g.region.index >= regions_.size() || !regions_[g.region.index].live ||
        regions_[g.region.index].generation != g.region.generation) {
      return Status::NotFound(
          fmt::format("CreateGrant: range {}: region {}/{} is not registered", i, g.region.index, g.region.generation));
    }
    const Region& r = regions_[g.region.index];
    if (g.length == 0 || g.offset > r.length || g.length > r.length - g.offset) {
      return Status::OutOfRange(
          fmt::format("CreateGrant: range {}: [{}, +{}) outside region of {} bytes", i, g.offset, g.length, r.length));
    }
    if (i > 0 && request.ranges[i - 1].region.index == g.region.index &&
        request.ranges[i - 1].offset + request.ranges[i - 1].length > g.offset) {
      return Status::InvalidArgument(fmt::format("CreateGrant: range {} overlaps the one before", i));
    }
  }
  uint64_t id = 0;
  while (id == 0 || grants_.count(id) != 0) id = SecureRandomU64();
  for (const GrantRange& g : request.ranges) regions_[g.region.index].pins += 1;
  Grant& grant = grants_[id];
  grant.peer = std::move(request.peer);
  grant.ranges = std::move(request.ranges);
  IssuedGrant issued;
  issued.id = id;
  for (size_t i = 0; i < issued.secret.size(); i += sizeof(uint64_t)) {
    const uint64_t word = SecureRandomU64();
    std::memcpy(issued.secret.data() + i, &word, sizeof(word));
  }
  grant.secret = issued.secret;
  return issued;
}

Status UcxTransferEngine::RevokeGrant(uint64_t grant, DrainedCallback drained) {
  {
    MutexLock lock(&regions_mu_);
    auto it = grants_.find(grant);
    if (it == grants_.end() || it->second.revoked) {
      return Status::NotFound(fmt::format("grant {:016x} is not live", grant));
    }
    it->second.revoked = true;  // From here on nothing new is served under it.
  }
  Command command;
  command.kind = Command::Kind::kRevoke;
  command.grants = {grant};
  command.drained = std::move(drained);
  {
    MutexLock lock(&queue_mu_);
    commands_.push_back(std::move(command));
  }
  uint64_t one = 1;
  (void)!write(wakeup_fd_.get(), &one, sizeof(one));
  return Status::Ok();
}

Status UcxTransferEngine::RevokePeer(const std::string& peer, DrainedCallback drained) {
  Command command;
  command.kind = Command::Kind::kRevoke;
  command.close = true;
  command.drained = std::move(drained);
  {
    MutexLock lock(&regions_mu_);
    for (auto& [id, grant] : grants_) {
      if (grant.peer != peer || grant.revoked) continue;
      grant.revoked = true;
      command.grants.push_back(id);
    }
  }
  {
    MutexLock lock(&queue_mu_);
    commands_.push_back(std::move(command));
  }
  uint64_t one = 1;
  (void)!write(wakeup_fd_.get(), &one, sizeof(one));
  return Status::Ok();
}

void UcxTransferEngine::HandleRevoke(const std::vector<uint64_t>& grants, bool close, DrainedCallback drained) {
  auto waiter = std::make_shared<DrainWaiter>();
  waiter->callback = std::move(drained);
  {
    MutexLock lock(&regions_mu_);
    for (uint64_t id : grants) {
      if (auto it = grants_.find(id); it != grants_.end()) {
        it->second.waiters.push_back(waiter);
        waiter->remaining += 1;
      }
    }
  }
  if (waiter->remaining == 0) {  // nothing of these grants is left (or there were none): drained now
    if (waiter->callback) waiter->callback();
    return;
  }
  const std::set<uint64_t> revoked(grants.begin(), grants.end());
  if (close) {
    counters_->revocations->Increment();
    std::vector<uint64_t> eps;
    for (const auto& [id, sep] : server_eps_) {
      if (sep->failed) continue;
      for (uint64_t g : sep->grants) {
        if (revoked.count(g) != 0) {
          eps.push_back(id);
          break;
        }
      }
    }
    for (uint64_t id : eps) {
      FailServerEp(*server_eps_.at(id), Status::PermissionDenied("the source revoked this peer's grants"));
    }
  }
  std::vector<uint64_t> stopped;
  for (const auto& [id, op] : serve_ops_) {
    if (op->grant != 0 && revoked.count(op->grant) != 0) stopped.push_back(id);
  }
  for (uint64_t id : stopped) {
    auto it = serve_ops_.find(id);
    if (it == serve_ops_.end()) continue;
    ServeOp& s = *it->second;
    if (!s.cancelled && !s.failure) {
      s.failure = Status::PermissionDenied(fmt::format("grant {:016x} was revoked", s.grant));
    }
    s.cancelled = true;
    MaybeFinishServe(s);
  }
  // Those with nothing in flight drain now; the others when their last serve op ends (GrantOpEnded).
  // The waiter fires exactly once, when its last grant drained, wherever that happens.
  MaybeDrainGrants(grants);
}

void UcxTransferEngine::GrantOpEnded(uint64_t grant) {
  {
    MutexLock lock(&regions_mu_);
    auto it = grants_.find(grant);
    if (it == grants_.end()) return;
    it->second.serving -= 1;
    if (!it->second.revoked || it->second.serving != 0) return;
  }
  MaybeDrainGrants({grant});
}

void UcxTransferEngine::MaybeDrainGrants(const std::vector<uint64_t>& grants) {
  std::vector<std::shared_ptr<DrainWaiter>> waiters;
  {
    MutexLock lock(&regions_mu_);
    for (uint64_t id : grants) {
      auto it = grants_.find(id);
      // Drained once revoked with nothing in flight, and only once its revocation was handled
      // (waiters attached): a revoke racing the last op's end drains here or in HandleRevoke.
      if (it == grants_.end() || !it->second.revoked || it->second.serving != 0 || it->second.waiters.empty()) {
        continue;
      }
      for (const GrantRange& g : it->second.ranges) {
        ORBITKV_CHECK(regions_[g.region.index].pins > 0);
        regions_[g.region.index].pins -= 1;
      }
      for (auto& w : it->second.waiters) waiters.push_back(std::move(w));
      grants_.erase(it);
    }
  }
  for (auto& w : waiters) {
    if (--w->remaining == 0 && w->callback) w->callback();
  }
}

void UcxTransferEngine::SendDone(ServeOp& s, const Status& status, bool has_checksum, uint64_t checksum) {
  s.done_sent = true;
  s.done_header = wire::DoneHeader{
      s.batch_id, s.sent, static_cast<uint8_t>(status.code()), static_cast<uint8_t>(has_checksum ? 1 : 0), 0, checksum};
  s.done_text = std::string(status.message().substr(0, wire::kMaxErrorTextBytes));
  s.outstanding += 1;
  SendAm(s.ep, wire::kAmDone, &s.done_header, sizeof(s.done_header), s.done_text.data(), s.done_text.size(),
         UCP_AM_SEND_FLAG_EAGER, new Op{this, Op::Kind::kServeDone, s.id, 0, UCS_OK});
}

void UcxTransferEngine::HandleCancel(const Event& e) {
  auto sit = server_ep_by_handle_.find(e.ep);
  if (sit == server_ep_by_handle_.end()) return;
  ServerEp& sep = *server_eps_.at(sit->second);
  wire::CancelHeader h;
  std::memcpy(&h, e.header.data(), sizeof(h));
  auto it = sep.serve_by_batch.find(h.batch_id);
  if (it == sep.serve_by_batch.end()) {
    // Messages may overtake each other across lanes: a cancel can arrive before its request (a
    // large one, still being assembled). Remember it, boundedly; a cancel for an answered request
    // is simply stale.
    sep.early_cancels.push_back(h.batch_id);
    if (sep.early_cancels.size() > kMaxEarlyCancels) sep.early_cancels.pop_front();
    return;
  }
  ServeOp& s = *serve_ops_.at(it->second);
  s.cancelled = true;
  MaybeFinishServe(s);
}

void UcxTransferEngine::FailServerEp(ServerEp& sep, Status status) {
  if (sep.failed) return;
  sep.failed = true;
  server_ep_by_handle_.erase(sep.ep);
  std::vector<uint64_t> ops;
  for (const auto& [batch_id, op_id] : sep.serve_by_batch) ops.push_back(op_id);
  for (uint64_t id : ops) {
    ServeOp& s = *serve_ops_.at(id);
    s.ep_failed = true;
    if (!s.failure) s.failure = status;
  }
  CloseEndpoint(sep.ep, sep.id, /*peer_side=*/false);
  for (uint64_t id : ops) {
    if (auto it = serve_ops_.find(id); it != serve_ops_.end()) MaybeFinishServe(*it->second);
  }
}

void UcxTransferEngine::SweepServerEps() {
  for (auto it = server_eps_.begin(); it != server_eps_.end();) {
    ServerEp& sep = *it->second;
    if (sep.failed && sep.close_done && sep.serve_by_batch.empty()) {
      it = server_eps_.erase(it);
    } else {
      ++it;
    }
  }
}

}  // namespace orbitkv::transfer
