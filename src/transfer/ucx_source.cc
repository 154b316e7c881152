// UcxTransferEngine, serving side: validating read requests against the region table, pinning
// source bytes, pushing fragments, answering with a done message, and releasing pins only once
// every send is terminal.
#include <algorithm>
#include <cstring>

#include "base/check.h"
#include "base/logging.h"
#include "transfer/ucx_engine_internal.h"

namespace orbitkv::transfer {

ucs_status_t UcxTransferEngine::OnAmReadRequest(void* arg, const void* header, size_t header_length,
                                                void* data, size_t length,
                                                const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxTransferEngine*>(arg);
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  if (rndv || header_length != sizeof(wire::ReadRequest) ||
      (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) == 0 ||
      length > size_t{wire::kMaxFragmentsPerBatch} * sizeof(wire::WireFragment)) {
    self->counters_->protocol_errors->Increment();
    return rndv ? UCS_ERR_INVALID_PARAM : UCS_OK;
  }
  Event e;
  e.kind = Event::Kind::kReadRequest;
  e.ep = param->reply_ep;
  e.header.assign(static_cast<const uint8_t*>(header),
                  static_cast<const uint8_t*>(header) + header_length);
  e.data.assign(static_cast<const uint8_t*>(data), static_cast<const uint8_t*>(data) + length);
  self->events_.push_back(std::move(e));
  return UCS_OK;
}

ucs_status_t UcxTransferEngine::OnAmCancel(void* arg, const void* header, size_t header_length,
                                           void* /*data*/, size_t /*length*/,
                                           const ucp_am_recv_param_t* param) {
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
  e.header.assign(static_cast<const uint8_t*>(header),
                  static_cast<const uint8_t*>(header) + header_length);
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
    counters_->protocol_errors
        ->Increment();  // A duplicate request id from one requester: ignore it.
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
  op->deadline =
      MonoNow() + std::chrono::milliseconds(h.deadline_ms) + options_.serve_deadline_slack;

  const size_t n = h.fragment_count;
  if (h.version != wire::kProtocolVersion) {
    op->failure = Status::InvalidArgument(fmt::format("protocol version {} (this engine speaks {})",
                                                      h.version, wire::kProtocolVersion));
  } else if (n == 0 || n > wire::kMaxFragmentsPerBatch ||
             e.data.size() != n * sizeof(wire::WireFragment)) {
    op->failure = Status::InvalidArgument(
        fmt::format("read request with {} fragments in {} bytes", n, e.data.size()));
  } else if (h.engine_id != engine_id_) {
    op->failure = Status::NotFound(fmt::format(
        "descriptors name engine incarnation {:016x}; this engine is {:016x} (restarted?)",
        h.engine_id, engine_id_));
  } else {
    std::vector<wire::WireFragment> fragments(n);
    std::memcpy(fragments.data(), e.data.data(), e.data.size());
    MutexLock lock(&regions_mu_);
    for (size_t i = 0; i < n && !op->failure; ++i) {
      const wire::WireFragment& f = fragments[i];
      if (f.region_index >= regions_.size() || !regions_[f.region_index].live ||
          regions_[f.region_index].generation != f.generation) {
        op->failure = Status::NotFound(fmt::format(
            "fragment {}: region {}/{} is not registered here", i, f.region_index, f.generation));
      } else if (const Region& r = regions_[f.region_index];
                 f.length == 0 || f.offset > r.length || f.length > r.length - f.offset) {
        op->failure = Status::OutOfRange(fmt::format(
            "fragment {}: [{}, +{}) outside region of {} bytes", i, f.offset, f.length, r.length));
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
    }
  }
  op->headers.resize(op->src.size());
  op->hashes = BatchChecksum(op->src.size());
  if (!op->failure && (op->flags & wire::kFlagChecksumOnly) != 0) {
    // RMA mode: the requester already fetched the bytes; hash what it read.
    for (size_t i = 0; i < op->src.size(); ++i)
      op->hashes.Set(i, FragmentHash(op->src[i], op->lengths[i]));
    op->next = static_cast<uint32_t>(op->src.size());
  }
  ServeOp& s = *op;
  sep.serve_by_batch[s.batch_id] = s.id;
  serve_ops_.emplace(s.id, std::move(op));
  serving_count_.fetch_add(1, std::memory_order_relaxed);
  PumpServe(s);
  MaybeFinishServe(s);
}

void UcxTransferEngine::PumpServe(ServeOp& s) {
  if (s.cancelled || s.failure || s.ep_failed || s.expired) return;
  const uint32_t n = static_cast<uint32_t>(s.src.size());
  const bool checksum = (s.flags & wire::kFlagChecksum) != 0;
  while (s.next < n && s.inflight_bytes < options_.max_inflight_bytes) {
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
      Status status = s.failure ? *s.failure
                      : s.cancelled
                          ? Status::Cancelled(fmt::format("cancelled after {} fragments", s.sent))
                          : Status::Ok();
      const bool with_checksum = status.ok() && (s.flags & wire::kFlagChecksum) != 0;
      SendDone(s, status, with_checksum, with_checksum ? s.hashes.Finish() : 0);
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
  serve_ops_.erase(s.id);  // Destroys `s`.
}

void UcxTransferEngine::SendDone(ServeOp& s, const Status& status, bool has_checksum,
                                 uint64_t checksum) {
  s.done_sent = true;
  s.done_header = wire::DoneHeader{s.batch_id,
                                   s.sent,
                                   static_cast<uint8_t>(status.code()),
                                   static_cast<uint8_t>(has_checksum ? 1 : 0),
                                   0,
                                   checksum};
  s.done_text = std::string(status.message().substr(0, wire::kMaxErrorTextBytes));
  s.outstanding += 1;
  SendAm(s.ep, wire::kAmDone, &s.done_header, sizeof(s.done_header), s.done_text.data(),
         s.done_text.size(), UCP_AM_SEND_FLAG_EAGER,
         new Op{this, Op::Kind::kServeDone, s.id, 0, UCS_OK});
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
