// UcxTransferEngine, requester side: batches, pooled peer endpoints, landing fragments, completion.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <regex>
#include <sstream>

#include "base/check.h"
#include "base/logging.h"
#include "transfer/ucx_engine_internal.h"

namespace orbitkv::transfer {

void UcxTransferEngine::StartBatch(std::unique_ptr<Batch> owned) {
  const uint64_t id = owned->id;
  Batch& b = *owned;
  batches_.emplace(id, std::move(owned));

  Result<Peer*> peer = PeerFor(b.request.peer);
  if (!peer.ok()) {
    FailBatch(b, peer.status());
    MaybeFinish(b);
    return;
  }
  Peer& p = **peer;
  b.peer_id = p.id;
  p.batches.insert(id);

  PullMode mode = b.request.mode != PullMode::kAuto ? b.request.mode : options_.default_mode;
  // A source that serves only inside grants exports no rkeys: its regions are read by requests it
  // checks, never by one-sided gets.
  const bool rkeys = std::all_of(b.request.remotes.begin(), b.request.remotes.end(),
                                 [](const RegionDescriptor& r) { return !r.rkey.empty(); });
  if (mode == PullMode::kAuto) {
    mode = p.native_rma.value_or(false) && rkeys ? PullMode::kRma : PullMode::kActiveMessage;
  }
  b.mode = mode;
  if (mode == PullMode::kRma && !rkeys) {
    FailBatch(b, Status::InvalidArgument("RMA read of regions exported without an rkey (the source serves reads "
                                         "only inside grants; use active messages)"));
    MaybeFinish(b);
    return;
  }

  if (mode == PullMode::kActiveMessage) {
    SendReadRequest(b, b.request.verify_checksum ? wire::kFlagChecksum : 0);
  } else {
    for (const RegionDescriptor& r : b.request.remotes) {
      auto key = std::make_tuple(r.engine_id, r.region_index, r.generation);
      if (p.rkeys.count(key) != 0) continue;
      ucp_rkey_h rkey = nullptr;
      if (ucs_status_t s = ucp_ep_rkey_unpack(p.ep, r.rkey.data(), &rkey); s != UCS_OK) {
        FailBatch(b, Status::InvalidArgument(fmt::format("unpacking the rkey of remote region {}/{}: {}",
                                                         r.region_index, r.generation, ucs_status_string(s))));
        break;
      }
      p.rkeys.emplace(key, UcpRkey(rkey));
    }
    PumpGets(b);
  }
  MaybeFinish(b);
}

Result<UcxTransferEngine::Peer*> UcxTransferEngine::PeerFor(const std::string& address) {
  if (auto it = peer_by_address_.find(address); it != peer_by_address_.end()) {
    return peers_.at(it->second).get();
  }
  ORBITKV_ASSIGN_OR_RETURN(sockaddr_in sa, ParseInetAddress(address));
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&sa);
  params.sockaddr.addrlen = sizeof(sa);
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = &OnPeerError;
  params.err_handler.arg = this;
  ucp_ep_h ep = nullptr;
  if (ucs_status_t s = ucp_ep_create(worker_.get(), &params, &ep); s != UCS_OK) {
    return Status::Unavailable(fmt::format("connecting to peer {}: {}", address, ucs_status_string(s)));
  }
  auto peer = std::make_unique<Peer>();
  peer->id = next_local_id_++;
  peer->address = address;
  peer->ep = ep;
  Peer* raw = peer.get();
  peer_by_address_[address] = peer->id;
  peers_.emplace(peer->id, std::move(peer));
  peer_count_.fetch_add(1, std::memory_order_relaxed);
  return raw;
}

void UcxTransferEngine::SendReadRequest(Batch& b, uint16_t flags) {
  Peer& p = *peers_.at(b.peer_id);
  const size_t n = b.request.fragments.size();
  auto remaining = std::chrono::duration_cast<std::chrono::milliseconds>(b.request.deadline.Remaining()).count();
  b.request_header = wire::ReadRequest{wire::kProtocolVersion,
                                       flags,
                                       static_cast<uint32_t>(n),
                                       b.id,
                                       b.request.remotes[0].engine_id,
                                       static_cast<uint32_t>(std::clamp<int64_t>(remaining, 1, UINT32_MAX)),
                                       0,
                                       b.request.grant,
                                       {}};
  std::memcpy(b.request_header.grant_secret, b.request.grant_secret.data(), b.request.grant_secret.size());
  b.wire_fragments.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const Fragment& f = b.request.fragments[i];
    const RegionDescriptor& r = b.request.remotes[f.remote];
    b.wire_fragments[i] = wire::WireFragment{r.region_index, r.generation, f.remote_offset, f.length};
  }
  b.outstanding += 1;
  b.request_sent = true;
  // REPLY: the source answers on the endpoint the request came in on. EAGER: a control message is
  // small, and the source must see it whole inside its callback.
  SendAm(p.ep, wire::kAmReadRequest, &b.request_header, sizeof(b.request_header), b.wire_fragments.data(),
         n * sizeof(wire::WireFragment), UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER,
         new Op{this, Op::Kind::kBatchControl, b.id, 0, UCS_OK});
}

void UcxTransferEngine::PumpGets(Batch& b) {
  if (b.mode != PullMode::kRma) return;
  auto pit = peers_.find(b.peer_id);
  if (pit == peers_.end() || pit->second->failed) return;
  Peer& p = *pit->second;
  const uint32_t n = static_cast<uint32_t>(b.request.fragments.size());
  while (b.accepting && !b.cancel_requested && b.next_get < n && b.inflight_bytes < options_.max_inflight_bytes) {
    const uint32_t i = b.next_get++;
    const Fragment& f = b.request.fragments[i];
    const RegionDescriptor& r = b.request.remotes[f.remote];
    ucp_rkey_h rkey = p.rkeys.at(std::make_tuple(r.engine_id, r.region_index, r.generation)).get();
    auto* op = new Op{this, Op::Kind::kBatchGet, b.id, i, UCS_OK};
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.send = &OnSendComplete;
    param.user_data = op;
    b.outstanding += 1;
    b.inflight_bytes += f.length;
    b.state[i] = 1;
    Track(ucp_get_nbx(p.ep, b.dest[i], f.length, r.base_address + f.remote_offset, rkey, &param), op);
  }
}

ucs_status_t UcxTransferEngine::OnAmData(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                         const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxTransferEngine*>(arg);
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  if (header_length != sizeof(wire::DataHeader)) {
    self->counters_->protocol_errors->Increment();
    return rndv ? UCS_ERR_INVALID_PARAM : UCS_OK;
  }
  wire::DataHeader h;
  std::memcpy(&h, header, sizeof(h));
  return self->HandleData(h, data, length, param);
}

ucs_status_t UcxTransferEngine::HandleData(const wire::DataHeader& h, void* data, size_t length,
                                           const ucp_am_recv_param_t* param) {
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  // Declining a rendezvous with an error completes the source's send with that error, so it stops
  // pinning.
  const ucs_status_t decline = rndv ? UCS_ERR_CANCELED : UCS_OK;
  auto it = batches_.find(h.batch_id);
  if (it == batches_.end() || !it->second->accepting || it->second->mode != PullMode::kActiveMessage) {
    return decline;  // Late data for a batch that ended, failed or was cancelled: never lands.
  }
  Batch& b = *it->second;
  const uint32_t i = h.fragment_index;
  if (i >= b.state.size() || b.state[i] != 0 || length != b.request.fragments[i].length) {
    counters_->protocol_errors->Increment();
    FailBatch(b, Status::Internal(fmt::format("peer {} sent fragment {} ({} bytes) that batch {} does not expect",
                                              b.request.peer, i, length, b.id)));
    dirty_batches_.insert(b.id);
    return decline;
  }
  if (rndv) {
    b.state[i] = 1;
    auto* op = new Op{this, Op::Kind::kBatchRecv, b.id, i, UCS_OK};
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.recv_am = &OnRecvComplete;
    p.user_data = op;
    b.outstanding += 1;
    Track(ucp_am_recv_data_nbx(worker_.get(), data, b.dest[i], length, &p), op);
    return UCS_INPROGRESS;  // UCX owns the descriptor now.
  }
  std::memcpy(b.dest[i], data, length);
  LandFragment(b, i);
  dirty_batches_.insert(b.id);
  return UCS_OK;
}

ucs_status_t UcxTransferEngine::OnAmDone(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                         const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxTransferEngine*>(arg);
  if (header_length != sizeof(wire::DoneHeader) || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) {
    self->counters_->protocol_errors->Increment();
    return (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0 ? UCS_ERR_INVALID_PARAM : UCS_OK;
  }
  Event e;
  e.kind = Event::Kind::kDone;
  e.header.assign(static_cast<const uint8_t*>(header), static_cast<const uint8_t*>(header) + header_length);
  size_t text = std::min(length, wire::kMaxErrorTextBytes);
  e.data.assign(static_cast<const uint8_t*>(data), static_cast<const uint8_t*>(data) + text);
  self->events_.push_back(std::move(e));
  return UCS_OK;
}

void UcxTransferEngine::HandleDone(const Event& e) {
  wire::DoneHeader h;
  std::memcpy(&h, e.header.data(), sizeof(h));
  auto it = batches_.find(h.batch_id);
  if (it == batches_.end()) return;  // The batch ended already (expired or revoked).
  Batch& b = *it->second;
  if (b.done_received) {
    counters_->protocol_errors->Increment();
    return;
  }
  b.done_received = true;
  StatusCode code = StatusCodeFromByte(h.status_code);
  std::string text(e.data.begin(), e.data.end());
  b.done_status =
      code == StatusCode::kOk ? Status::Ok() : Status(code, fmt::format("peer {}: {}", b.request.peer, text));
  b.done_fragments_sent = h.fragments_sent;
  b.done_has_checksum = h.has_checksum != 0;
  b.done_checksum = h.checksum;
  MaybeFinish(b);
}

void UcxTransferEngine::LandFragment(Batch& b, uint32_t i) {
  ORBITKV_CHECK(b.state[i] != 2);
  b.state[i] = 2;
  b.landed += 1;
  if (b.request.verify_checksum) b.hashes.Set(i, FragmentHash(b.dest[i], b.request.fragments[i].length));
}

void UcxTransferEngine::FailBatch(Batch& b, Status status) {
  if (!b.failure) b.failure = std::move(status);
  b.accepting = false;
}

void UcxTransferEngine::RequestCancel(uint64_t batch_id) {
  auto it = batches_.find(batch_id);
  if (it == batches_.end()) return;
  Batch& b = *it->second;
  if (b.cancel_requested || !b.accepting) return;
  b.cancel_requested = true;
  auto pit = peers_.find(b.peer_id);
  if (b.mode == PullMode::kActiveMessage && b.request_sent && pit != peers_.end() && !pit->second->failed &&
      !b.done_received) {
    // The source stops sending and answers with a done message once its submitted sends are
    // terminal; data it already sent keeps landing (the destination stays owned until then).
    b.cancel_header.batch_id = b.id;
    b.outstanding += 1;
    b.cancel_sent = true;
    SendAm(pit->second->ep, wire::kAmCancel, &b.cancel_header, sizeof(b.cancel_header), nullptr, 0,
           UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER, new Op{this, Op::Kind::kBatchControl, b.id, 0, UCS_OK});
  }
  MaybeFinish(b);
}

void UcxTransferEngine::MaybeFinish(Batch& b) {
  if (b.outstanding > 0) return;
  const size_t n = b.state.size();
  if (b.failure) {
    FinishBatch(b, *b.failure);
    return;
  }
  if (b.mode == PullMode::kRma) {
    if (b.cancel_requested) {
      FinishBatch(
          b, Status::Cancelled(fmt::format("batch {} cancelled with {} of {} fragments landed", b.id, b.landed, n)));
      return;
    }
    if (b.landed < n) return;  // PumpGets keeps going.
    if (b.request.verify_checksum && !b.checksum_requested) {
      b.checksum_requested = true;
      SendReadRequest(b, wire::kFlagChecksum | wire::kFlagChecksumOnly);
      return;
    }
    if (b.request.verify_checksum && !b.done_received) return;
  } else {
    if (!b.done_received) {
      if (b.cancel_requested && !b.cancel_sent) {
        FinishBatch(b, Status::Cancelled(fmt::format("batch {} cancelled before it was sent", b.id)));
      }
      return;
    }
    if (!b.done_status.ok()) {
      FinishBatch(b, b.done_status);
      return;
    }
    if (b.landed < b.done_fragments_sent) return;  // Data the source sent before its done is still arriving.
    if (b.landed < n) {
      FinishBatch(b, Status::Internal(fmt::format("peer {} reported batch {} done with {} of {} fragments",
                                                  b.request.peer, b.id, b.landed, n)));
      return;
    }
  }
  if (b.request.verify_checksum) {
    if (!b.done_status.ok()) {
      FinishBatch(b, b.done_status);
      return;
    }
    if (!b.done_has_checksum) {
      FinishBatch(b, Status::Internal(fmt::format("peer {} sent no checksum for batch {}", b.request.peer, b.id)));
      return;
    }
    uint64_t local = b.hashes.Finish();
    if (local != b.done_checksum) {
      counters_->checksum_failures->Increment();
      FinishBatch(b, Status::DataLoss(fmt::format("batch {} from {}: checksum {:016x} of the landed bytes differs "
                                                  "from the source's {:016x}",
                                                  b.id, b.request.peer, local, b.done_checksum)));
      return;
    }
  }
  FinishBatch(b, Status::Ok());
}

void UcxTransferEngine::FinishBatch(Batch& b, Status status) {
  ORBITKV_CHECK(b.outstanding == 0);
  std::unique_ptr<Batch> owned = std::move(batches_.at(b.id));
  batches_.erase(b.id);
  dirty_batches_.erase(b.id);
  if (auto pit = peers_.find(owned->peer_id); pit != peers_.end()) {
    Peer& p = *pit->second;
    p.batches.erase(owned->id);
    if (status.ok() && !p.native_rma && !p.failed) ResolvePeerMode(p);
  }
  Unpin(owned->pinned);
  {
    MutexLock lock(&queue_mu_);
    live_batch_ids_.erase(owned->id);
  }
  BatchResult result;
  result.batch_id = owned->id;
  result.bytes = owned->total_bytes;
  result.mode = owned->mode;
  result.source_checksum = owned->done_checksum;
  result.checksum_verified = status.ok() && owned->request.verify_checksum;
  result.status = std::move(status);
  if (result.status.ok()) {
    counters_->batches_ok->Increment();
    counters_->bytes_read->Increment(owned->total_bytes);
  } else {
    counters_->batches_failed->Increment();
  }
  // No lock is held and the batch is gone from every map: the callback may re-enter the engine.
  owned->done(result);
}

void UcxTransferEngine::FailPeer(Peer& p, Status status) {
  if (p.failed) return;
  p.failed = true;
  peer_by_address_.erase(p.address);
  for (uint64_t id : p.batches) {
    auto it = batches_.find(id);
    if (it == batches_.end()) continue;
    FailBatch(*it->second, status);
    dirty_batches_.insert(id);
  }
  // Forced close completes every outstanding operation on the endpoint (UCS_ERR_CANCELED); rkeys go
  // with the peer once it is swept, after those completions.
  CloseEndpoint(p.ep, p.id, /*peer_side=*/true);
}

void UcxTransferEngine::SweepPeers() {
  for (auto it = peers_.begin(); it != peers_.end();) {
    Peer& p = *it->second;
    if (p.failed && p.close_done && p.batches.empty()) {
      it = peers_.erase(it);
      peer_count_.fetch_sub(1, std::memory_order_relaxed);
    } else {
      ++it;
    }
  }
}

void UcxTransferEngine::ResolvePeerMode(Peer& p) {
  // The endpoint's lane table after wire-up, one line per lane, e.g.
  //   lane[1]:  0:tcp/lo.0 md[0] -> md[0]/tcp/sysdev[255] rma_bw#0 am am_bw#0 wireup
  // A lane marked rma_bw whose transport is not tcp does RMA natively (rc/dc verbs, cma, ...);
  // tcp's RMA lanes move bytes through the socket with the remote CPU's help (measured at 0.07 GB/s
  // for 4 MiB gets).
  char* text = nullptr;
  size_t size = 0;
  FILE* stream = open_memstream(&text, &size);
  if (stream == nullptr) return;
  ucp_ep_print_info(p.ep, stream);
  fclose(stream);
  std::string info(text, size);
  free(text);
  static const std::regex kLane(R"(lane\[\d+\]:\s+\d+:([A-Za-z0-9_]+)/.*rma_bw#)");
  bool native = false;
  std::istringstream lines(info);
  for (std::string line; std::getline(lines, line);) {
    std::smatch match;
    if (std::regex_search(line, match, kLane) && match[1].str() != "tcp") native = true;
  }
  p.native_rma = native;
}

}  // namespace orbitkv::transfer
