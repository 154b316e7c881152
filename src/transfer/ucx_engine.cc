// UcxTransferEngine: setup, the region table, the public entry points and the progress loop.
#include "transfer/ucx_engine.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <random>

#include "base/check.h"
#include "base/logging.h"
#include "transfer/ucx_engine_internal.h"

namespace orbitkv::transfer {

std::string_view PullModeName(PullMode mode) {
  switch (mode) {
    case PullMode::kAuto:
      return "auto";
    case PullMode::kRma:
      return "rma";
    case PullMode::kActiveMessage:
      return "am";
  }
  return "unknown";
}

Status UcsStatus(std::string_view what, ucs_status_t status) {
  std::string message = fmt::format("{}: {}", what, ucs_status_string(status));
  switch (status) {
    case UCS_OK:
      return Status::Ok();
    case UCS_ERR_CANCELED:
      return Status::Cancelled(message);
    case UCS_ERR_TIMED_OUT:
      return Status::DeadlineExceeded(message);
    case UCS_ERR_ENDPOINT_TIMEOUT:  // What a vanished peer's endpoint reports.
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_REJECTED:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_IO_ERROR:
    case UCS_ERR_BUSY:
    case UCS_ERR_NO_RESOURCE:
      return Status::Unavailable(message);
    case UCS_ERR_INVALID_PARAM:
    case UCS_ERR_INVALID_ADDR:
      return Status::InvalidArgument(message);
    default:
      return Status::Internal(message);
  }
}

namespace {

Result<sockaddr_in> ParseAddress(std::string_view address) {
  size_t colon = address.rfind(':');
  if (colon == std::string_view::npos) {
    return Status::InvalidArgument(fmt::format("address '{}': expected ip:port", address));
  }
  std::string host(address.substr(0, colon));
  std::string_view port_text = address.substr(colon + 1);
  unsigned port = 0;
  auto [end, ec] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
  if (ec != std::errc() || end != port_text.data() + port_text.size() || port > 65535) {
    return Status::InvalidArgument(fmt::format("address '{}': bad port", address));
  }
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host.c_str(), &sa.sin_addr) != 1) {
    return Status::InvalidArgument(fmt::format("address '{}': '{}' is not an IPv4 address", address, host));
  }
  return sa;
}

uint64_t RandomEngineId() {
  std::random_device device;
  uint64_t id = (static_cast<uint64_t>(device()) << 32) ^ device();
  return id == 0 ? 1 : id;
}

}  // namespace

Result<sockaddr_in> ParseInetAddress(std::string_view address) { return ParseAddress(address); }

UcxTransferEngine::Counters::Counters(MetricsRegistry* registry) {
  Counter** slots[] = {&bytes_read,      &bytes_served, &batches_ok,     &batches_failed,       &checksum_failures,
                       &protocol_errors, &revocations,  &grant_refusals, &grant_secret_refusals};
  if (registry == nullptr) {
    for (size_t i = 0; i < std::size(slots); ++i) *slots[i] = &own[i];
    return;
  }
  bytes_read = &registry->GetCounter("orbitkv_transfer_bytes_read_total", "Bytes landed by completed read batches");
  bytes_served = &registry->GetCounter("orbitkv_transfer_bytes_served_total", "Bytes sent to peers' read batches");
  batches_ok = &registry->GetCounter("orbitkv_transfer_batches_total", "Read batches by outcome", {{"result", "ok"}});
  batches_failed =
      &registry->GetCounter("orbitkv_transfer_batches_total", "Read batches by outcome", {{"result", "failed"}});
  checksum_failures = &registry->GetCounter("orbitkv_transfer_checksum_failures_total",
                                            "Batches whose fragments failed their checksum");
  protocol_errors =
      &registry->GetCounter("orbitkv_transfer_protocol_errors_total", "Malformed or unexpected messages dropped");
  revocations = &registry->GetCounter("orbitkv_transfer_endpoint_revocations_total",
                                      "Endpoints closed to revoke transfers of expired operations or "
                                      "revoked grants");
  grant_refusals = &registry->GetCounter("orbitkv_transfer_grant_refusals_total",
                                         "Read requests refused because they named no live grant or read outside it");
  grant_secret_refusals = &registry->GetCounter(
      "orbitkv_transfer_grant_secret_refusals_total",
      "Read requests naming a live grant without its secret (a grant id used by someone but its holder)");
}

UcxTransferEngine::UcxTransferEngine(const UcxEngineOptions& options)
    : options_(options),
      engine_id_(options.engine_id != 0 ? options.engine_id : RandomEngineId()),
      counters_(std::make_unique<Counters>(options.metrics)) {}

Result<std::unique_ptr<UcxTransferEngine>> UcxTransferEngine::Create(const UcxEngineOptions& options) {
  if (options.max_regions == 0 || options.max_inflight_bytes == 0 || options.max_served_inflight_bytes == 0) {
    return Status::InvalidArgument(
        "transfer engine: max_regions, max_inflight_bytes and max_served_inflight_bytes must be "
        "positive");
  }
  std::unique_ptr<UcxTransferEngine> engine(new UcxTransferEngine(options));
  ORBITKV_RETURN_IF_ERROR(engine->Init());
  return engine;
}

Status UcxTransferEngine::Init() {
  ORBITKV_ASSIGN_OR_RETURN(sockaddr_in listen_sa, ParseAddress(options_.listen_address));

  ucp_config_t* raw_config = nullptr;
  if (ucs_status_t s = ucp_config_read(nullptr, nullptr, &raw_config); s != UCS_OK) {
    return UcsStatus("ucp_config_read", s);
  }
  UcpConfig config(raw_config);
  if (!options_.transports.empty()) {
    if (ucs_status_t s = ucp_config_modify(config.get(), "TLS", options_.transports.c_str()); s != UCS_OK) {
      return Status::InvalidArgument(fmt::format("transports '{}': {}", options_.transports, ucs_status_string(s)));
    }
  }
  if (!options_.net_devices.empty()) {
    if (ucs_status_t s = ucp_config_modify(config.get(), "NET_DEVICES", options_.net_devices.c_str()); s != UCS_OK) {
      return Status::InvalidArgument(fmt::format("net_devices '{}': {}", options_.net_devices, ucs_status_string(s)));
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
  // Registration runs on callers' threads while the progress thread drives the worker.
  params.mt_workers_shared = 1;
  params.name = "orbitkv-transfer";
  ucp_context_h context = nullptr;
  if (ucs_status_t s = ucp_init(&params, config.get(), &context); s != UCS_OK) {
    return UcsStatus(fmt::format("ucp_init (transports '{}')", options_.transports), s);
  }
  context_.reset(context);

  ucp_worker_params_t worker_params{};
  worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  worker_params.thread_mode = UCS_THREAD_MODE_SINGLE;
  ucp_worker_h worker = nullptr;
  if (ucs_status_t s = ucp_worker_create(context_.get(), &worker_params, &worker); s != UCS_OK) {
    return UcsStatus("ucp_worker_create", s);
  }
  worker_.reset(worker);
  if (ucs_status_t s = ucp_worker_get_efd(worker_.get(), &worker_efd_); s != UCS_OK) {
    return UcsStatus("ucp_worker_get_efd", s);
  }
  wakeup_fd_.Reset(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wakeup_fd_.valid()) return ErrnoStatus("eventfd", errno);

  struct Handler {
    unsigned id;
    ucp_am_recv_callback_t cb;
  };
  for (Handler h : {Handler{wire::kAmReadRequest, &OnAmReadRequest}, Handler{wire::kAmData, &OnAmData},
                    Handler{wire::kAmDone, &OnAmDone}, Handler{wire::kAmCancel, &OnAmCancel}}) {
    ucp_am_handler_param_t hp{};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG;
    hp.id = h.id;
    hp.flags = UCP_AM_FLAG_WHOLE_MSG;
    hp.cb = h.cb;
    hp.arg = this;
    if (ucs_status_t s = ucp_worker_set_am_recv_handler(worker_.get(), &hp); s != UCS_OK) {
      return UcsStatus("ucp_worker_set_am_recv_handler", s);
    }
  }

  ucp_listener_params_t lp{};
  lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&listen_sa);
  lp.sockaddr.addrlen = sizeof(listen_sa);
  lp.conn_handler.cb = &OnConnRequest;
  lp.conn_handler.arg = this;
  ucp_listener_h listener = nullptr;
  if (ucs_status_t s = ucp_listener_create(worker_.get(), &lp, &listener); s != UCS_OK) {
    return Status::Unavailable(fmt::format("listen on {}: {}", options_.listen_address, ucs_status_string(s)));
  }
  listener_.reset(listener);
  ucp_listener_attr_t attr{};
  attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  if (ucs_status_t s = ucp_listener_query(listener_.get(), &attr); s != UCS_OK) {
    return UcsStatus("ucp_listener_query", s);
  }
  const auto* bound = reinterpret_cast<const sockaddr_in*>(&attr.sockaddr);
  char host[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, &listen_sa.sin_addr, host, sizeof(host));
  listen_address_ = fmt::format("{}:{}", host, ntohs(bound->sin_port));

  {
    MutexLock lock(&regions_mu_);
    regions_.resize(options_.max_regions);
  }
  thread_ = std::thread([this] { ProgressLoop(); });
  return Status::Ok();
}

UcxTransferEngine::~UcxTransferEngine() {
  if (thread_.joinable()) {
    {
      MutexLock lock(&queue_mu_);
      stopping_ = true;
      Command stop;
      stop.kind = Command::Kind::kStop;
      commands_.push_back(std::move(stop));
    }
    uint64_t one = 1;
    (void)!write(wakeup_fd_.get(), &one, sizeof(one));
    thread_.join();
  }
  // The loop ended with every endpoint closed and every operation terminal; release UCX in
  // dependency order.
  {
    MutexLock lock(&regions_mu_);
    grants_.clear();  // nothing is in flight any more: the loop drained every serve op
    regions_.clear();
  }
  listener_.reset();
  worker_.reset();
  context_.reset();
}

// ---- Regions
// ----------------------------------------------------------------------------------------------

Result<RegionHandle> UcxTransferEngine::RegisterRegion(void* base, size_t length) {
  if (base == nullptr || length == 0) {
    return Status::InvalidArgument("RegisterRegion: null or empty range");
  }
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  mp.address = base;
  mp.length = length;
  ucp_mem_h memh = nullptr;
  if (ucs_status_t s = ucp_mem_map(context_.get(), &mp, &memh); s != UCS_OK) {
    return UcsStatus(fmt::format("ucp_mem_map of {} bytes", length), s);
  }
  UcpMemory memory(context_.get(), memh);
  void* rkey_buffer = nullptr;
  size_t rkey_size = 0;
  if (ucs_status_t s = ucp_rkey_pack(context_.get(), memh, &rkey_buffer, &rkey_size); s != UCS_OK) {
    return UcsStatus("ucp_rkey_pack", s);
  }
  std::vector<uint8_t> rkey(static_cast<uint8_t*>(rkey_buffer), static_cast<uint8_t*>(rkey_buffer) + rkey_size);
  ucp_rkey_buffer_release(rkey_buffer);
  if (rkey.size() > kMaxRkeyBytes) {
    return Status::Internal(fmt::format("UCX packed a {}-byte rkey (descriptor limit {})", rkey.size(), kMaxRkeyBytes));
  }

  MutexLock lock(&regions_mu_);
  for (uint32_t i = 0; i < regions_.size(); ++i) {
    Region& r = regions_[i];
    if (r.live) continue;
    r.base = static_cast<uint8_t*>(base);
    r.length = length;
    r.generation += 1;
    r.live = true;
    r.pins = 0;
    r.memh = std::move(memory);
    r.rkey = std::move(rkey);
    return RegionHandle{i, r.generation};
  }
  return Status::ResourceExhausted(fmt::format("all {} transfer regions are registered", regions_.size()));
}

Status UcxTransferEngine::UnregisterRegion(RegionHandle handle) {
  UcpMemory released;
  {
    MutexLock lock(&regions_mu_);
    if (handle.index >= regions_.size() || !regions_[handle.index].live ||
        regions_[handle.index].generation != handle.generation) {
      return Status::NotFound(fmt::format("region {}/{} is not registered", handle.index, handle.generation));
    }
    Region& r = regions_[handle.index];
    if (r.pins != 0) {
      return Status::FailedPrecondition(
          fmt::format("region {}/{} is referenced by {} in-flight fragments", handle.index, handle.generation, r.pins));
    }
    r.live = false;
    r.base = nullptr;
    r.length = 0;
    r.rkey.clear();
    released = std::move(r.memh);
  }
  return Status::Ok();  // `released` unmaps outside the lock.
}

Result<RegionDescriptor> UcxTransferEngine::ExportRegion(RegionHandle handle) {
  MutexLock lock(&regions_mu_);
  if (handle.index >= regions_.size() || !regions_[handle.index].live ||
      regions_[handle.index].generation != handle.generation) {
    return Status::NotFound(fmt::format("region {}/{} is not registered", handle.index, handle.generation));
  }
  const Region& r = regions_[handle.index];
  RegionDescriptor d;
  d.engine_id = engine_id_;
  d.region_index = handle.index;
  d.generation = r.generation;
  d.base_address = reinterpret_cast<uintptr_t>(r.base);
  d.length = r.length;
  if (!options_.require_grants) d.rkey = r.rkey;  // with grants, RMA is off: no rkey leaves
  return d;
}

Status UcxTransferEngine::PinLocal(const ReadBatchRequest& request, std::vector<uint8_t*>& dest) {
  MutexLock lock(&regions_mu_);
  for (size_t i = 0; i < request.fragments.size(); ++i) {
    const Fragment& f = request.fragments[i];
    const RegionHandle& h = f.local;
    Status error;
    if (h.index >= regions_.size() || !regions_[h.index].live || regions_[h.index].generation != h.generation) {
      error =
          Status::NotFound(fmt::format("fragment {}: local region {}/{} is not registered", i, h.index, h.generation));
    } else if (f.local_offset > regions_[h.index].length || f.length > regions_[h.index].length - f.local_offset) {
      error = Status::OutOfRange(fmt::format("fragment {}: local [{}, +{}) exceeds region of {} bytes", i,
                                             f.local_offset, f.length, regions_[h.index].length));
    }
    if (!error.ok()) {
      for (size_t j = 0; j < i; ++j) regions_[request.fragments[j].local.index].pins -= 1;
      return error;
    }
    regions_[h.index].pins += 1;
    dest.push_back(regions_[h.index].base + f.local_offset);
  }
  return Status::Ok();
}

void UcxTransferEngine::Unpin(const std::vector<RegionHandle>& pinned) {
  MutexLock lock(&regions_mu_);
  for (const RegionHandle& h : pinned) {
    ORBITKV_CHECK(h.index < regions_.size() && regions_[h.index].live && regions_[h.index].pins > 0);
    regions_[h.index].pins -= 1;
  }
}

// ---- Entry points
// -----------------------------------------------------------------------------------------

Result<uint64_t> UcxTransferEngine::ReadBatch(ReadBatchRequest request, BatchCallback done) {
  const size_t n = request.fragments.size();
  if (n == 0) return Status::InvalidArgument("ReadBatch: no fragments");
  if (n > wire::kMaxFragmentsPerBatch) {
    return Status::InvalidArgument(
        fmt::format("ReadBatch: {} fragments (max {} per batch)", n, wire::kMaxFragmentsPerBatch));
  }
  if (request.deadline.IsInfinite()) return Status::InvalidArgument("ReadBatch: the deadline must be finite");
  if (request.deadline.Expired()) return Status::DeadlineExceeded("ReadBatch: deadline already passed");
  if (request.remotes.empty()) return Status::InvalidArgument("ReadBatch: no remote regions");
  if (!done) return Status::InvalidArgument("ReadBatch: no completion callback");
  for (const RegionDescriptor& r : request.remotes) {
    if (r.engine_id != request.remotes[0].engine_id) {
      return Status::InvalidArgument("ReadBatch: remote regions of different engines in one batch");
    }
  }
  uint64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    const Fragment& f = request.fragments[i];
    if (f.length == 0) return Status::InvalidArgument(fmt::format("fragment {}: zero length", i));
    if (f.remote >= request.remotes.size()) {
      return Status::InvalidArgument(
          fmt::format("fragment {}: remote region {} of {}", i, f.remote, request.remotes.size()));
    }
    const RegionDescriptor& r = request.remotes[f.remote];
    if (f.remote_offset > r.length || f.length > r.length - f.remote_offset) {
      return Status::OutOfRange(fmt::format("fragment {}: remote [{}, +{}) exceeds region of {} bytes", i,
                                            f.remote_offset, f.length, r.length));
    }
    total += f.length;
  }
  ORBITKV_RETURN_IF_ERROR(ParseAddress(request.peer).status());

  auto batch = std::make_unique<Batch>();
  ORBITKV_RETURN_IF_ERROR(PinLocal(request, batch->dest));
  batch->pinned.reserve(n);
  for (const Fragment& f : request.fragments) batch->pinned.push_back(f.local);
  batch->total_bytes = total;
  batch->state.assign(n, 0);
  batch->hashes = BatchChecksum(n);
  batch->request = std::move(request);
  batch->done = std::move(done);

  uint64_t id = 0;
  {
    MutexLock lock(&queue_mu_);
    if (stopping_) {
      // Fall through to unpin below.
    } else {
      id = next_batch_id_++;
      batch->id = id;
      live_batch_ids_.insert(id);
      Command command;
      command.kind = Command::Kind::kStart;
      command.batch = std::move(batch);
      commands_.push_back(std::move(command));
    }
  }
  if (id == 0) {
    Unpin(batch->pinned);
    return Status::Unavailable("transfer engine is shutting down");
  }
  uint64_t one = 1;
  (void)!write(wakeup_fd_.get(), &one, sizeof(one));
  return id;
}

Status UcxTransferEngine::Cancel(uint64_t batch_id) {
  {
    MutexLock lock(&queue_mu_);
    if (live_batch_ids_.count(batch_id) == 0) {
      return Status::NotFound(fmt::format("batch {} is not live", batch_id));
    }
    Command command;
    command.kind = Command::Kind::kCancel;
    command.batch_id = batch_id;
    commands_.push_back(std::move(command));
  }
  uint64_t one = 1;
  (void)!write(wakeup_fd_.get(), &one, sizeof(one));
  return Status::Ok();
}

Capabilities UcxTransferEngine::GetCapabilities() const {
  Capabilities caps;
  caps.transports = options_.transports;
  caps.default_mode = options_.default_mode;
  caps.checksum = true;
  caps.grants_required = options_.require_grants;
  caps.max_fragments_per_batch = wire::kMaxFragmentsPerBatch;
  caps.max_fragment_bytes = UINT64_MAX;
  return caps;
}

EngineStats UcxTransferEngine::Stats() const {
  EngineStats stats;
  {
    MutexLock lock(&queue_mu_);
    stats.live_batches = live_batch_ids_.size();
  }
  {
    MutexLock lock(&regions_mu_);
    for (const Region& r : regions_) {
      if (!r.live) continue;
      stats.registered_regions += 1;
      if (r.pins > 0) stats.pinned_regions += 1;
    }
  }
  {
    MutexLock lock(&regions_mu_);
    stats.live_grants = grants_.size();
  }
  stats.serving_requests = serving_count_.load(std::memory_order_relaxed);
  stats.peer_endpoints = peer_count_.load(std::memory_order_relaxed);
  stats.grant_secret_refusals = counters_->grant_secret_refusals->Value();
  return stats;
}

// ---- Progress loop
// ----------------------------------------------------------------------------------------

void UcxTransferEngine::ProgressLoop() {
  for (;;) {
    bool busy = DrainCommands();
    // A bounded burst, then the queues: progressing until UCX went quiet left a new read request
    // and the completions of finished sends and receives waiting for as long as data streamed. A
    // message (a request, a DONE) ends the burst at once.
    unsigned progressed = 0;
    for (int i = 0; i < kProgressBurst; ++i) {
      const unsigned k = ucp_worker_progress(worker_.get());
      if (k == 0 || !events_.empty()) break;
      progressed += k;
    }
    busy |= progressed > 0;
    busy |= DrainEvents();
    busy |= DrainCompletions();
    std::unordered_set<uint64_t> dirty;
    dirty.swap(dirty_batches_);
    for (uint64_t id : dirty) {
      auto b = batches_.find(id);
      if (b != batches_.end()) MaybeFinish(*b->second);
    }
    CheckDeadlines();
    SweepPeers();
    SweepServerEps();
    if (shutting_down_ && ShutdownComplete()) break;
    if (!busy) WaitForWork();
  }
}

bool UcxTransferEngine::DrainCommands() {
  std::deque<Command> commands;
  {
    MutexLock lock(&queue_mu_);
    commands.swap(commands_);
  }
  for (Command& c : commands) {
    switch (c.kind) {
      case Command::Kind::kStart:
        if (shutting_down_) {
          c.batch->failure = Status::Cancelled("transfer engine is shutting down");
          uint64_t id = c.batch->id;
          batches_.emplace(id, std::move(c.batch));
          FinishBatch(*batches_.at(id), Status::Cancelled("transfer engine is shutting down"));
        } else {
          StartBatch(std::move(c.batch));
        }
        break;
      case Command::Kind::kCancel:
        RequestCancel(c.batch_id);
        break;
      case Command::Kind::kStop:
        BeginShutdown();
        break;
      case Command::Kind::kRevoke:
        HandleRevoke(c.grants, c.close, std::move(c.drained));
        break;
    }
  }
  return !commands.empty();
}

bool UcxTransferEngine::DrainCompletions() {
  if (completions_.empty()) return false;
  std::vector<Op*> ops;
  ops.swap(completions_);
  for (Op* op : ops) {
    std::unique_ptr<Op> owned(op);
    switch (op->kind) {
      case Op::Kind::kBatchControl:
      case Op::Kind::kBatchRecv:
      case Op::Kind::kBatchGet: {
        auto it = batches_.find(op->owner);
        ORBITKV_CHECK_MSG(it != batches_.end(), "operation completed for unknown batch {}", op->owner);
        Batch& b = *it->second;
        ORBITKV_CHECK(b.outstanding > 0);
        b.outstanding -= 1;
        if (op->kind == Op::Kind::kBatchGet) b.inflight_bytes -= b.request.fragments[op->index].length;
        if (op->status != UCS_OK) {
          FailBatch(b, UcsStatus(fmt::format("batch {} to {}", b.id, b.request.peer), op->status));
        } else if (op->kind != Op::Kind::kBatchControl) {
          LandFragment(b, op->index);
        }
        if (op->kind == Op::Kind::kBatchGet) PumpGets(b);
        MaybeFinish(b);
        break;
      }
      case Op::Kind::kServeData:
      case Op::Kind::kServeDone: {
        auto it = serve_ops_.find(op->owner);
        ORBITKV_CHECK_MSG(it != serve_ops_.end(), "operation completed for unknown serve op {}", op->owner);
        ServeOp& s = *it->second;
        ORBITKV_CHECK(s.outstanding > 0);
        s.outstanding -= 1;
        if (op->kind == Op::Kind::kServeData) {
          s.inflight_bytes -= s.lengths[op->index];
          if (op->status == UCS_OK) {
            counters_->bytes_served->Increment(s.lengths[op->index]);
          } else if (!s.failure) {
            s.failure = UcsStatus("sending a fragment", op->status);
          }
          PumpServe(s);
        }
        MaybeFinishServe(s);
        break;
      }
      case Op::Kind::kPeerClose: {
        auto it = peers_.find(op->owner);
        if (it != peers_.end()) it->second->close_done = true;
        break;
      }
      case Op::Kind::kServerEpClose: {
        auto it = server_eps_.find(op->owner);
        if (it != server_eps_.end()) it->second->close_done = true;
        break;
      }
    }
  }
  return true;
}

bool UcxTransferEngine::DrainEvents() {
  if (events_.empty()) return false;
  std::deque<Event> events;
  events.swap(events_);
  for (Event& e : events) {
    switch (e.kind) {
      case Event::Kind::kReadRequest:
        HandleReadRequest(e);
        break;
      case Event::Kind::kDone:
        HandleDone(e);
        break;
      case Event::Kind::kCancel:
        HandleCancel(e);
        break;
      case Event::Kind::kConnRequest: {
        if (shutting_down_) {
          ucp_listener_reject(listener_.get(), e.conn_request);
          break;
        }
        auto server_ep = std::make_unique<ServerEp>();
        server_ep->id = next_local_id_++;
        ucp_ep_params_t ep_params{};
        ep_params.field_mask =
            UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
        ep_params.conn_request = e.conn_request;
        ep_params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
        ep_params.err_handler.cb = &OnServerEpError;
        ep_params.err_handler.arg = this;
        ucp_ep_h ep = nullptr;
        if (ucs_status_t s = ucp_ep_create(worker_.get(), &ep_params, &ep); s != UCS_OK) {
          ORBITKV_LOG_WARN("transfer: accepting a connection failed: {}", ucs_status_string(s));
          break;
        }
        server_ep->ep = ep;
        server_ep_by_handle_[ep] = server_ep->id;
        server_eps_.emplace(server_ep->id, std::move(server_ep));
        break;
      }
      case Event::Kind::kPeerError: {
        for (auto& [id, peer] : peers_) {
          if (peer->ep == e.ep && !peer->failed) {
            FailPeer(*peer, UcsStatus(fmt::format("connection to peer {}", peer->address), e.status));
            break;
          }
        }
        break;
      }
      case Event::Kind::kServerEpError: {
        auto it = server_ep_by_handle_.find(e.ep);
        if (it != server_ep_by_handle_.end()) {
          FailServerEp(*server_eps_.at(it->second), UcsStatus("connection from a peer", e.status));
        }
        break;
      }
    }
  }
  return true;
}

MonoTime UcxTransferEngine::NextDeadline() const {
  MonoTime next = MonoTime::max();
  for (const auto& [id, b] : batches_) {
    if (b->accepting) next = std::min(next, b->request.deadline.when());
  }
  for (const auto& [id, s] : serve_ops_) {
    if (!s->expired) next = std::min(next, s->deadline);
  }
  return next;
}

void UcxTransferEngine::WaitForWork() {
  if (!completions_.empty() || !events_.empty()) return;
  ucs_status_t armed = ucp_worker_arm(worker_.get());
  if (armed == UCS_ERR_BUSY) return;  // Events arrived meanwhile: progress again.
  ORBITKV_CHECK_MSG(armed == UCS_OK, "ucp_worker_arm: {}", ucs_status_string(armed));
  // Bounded so that deadlines are checked even when the next one moves earlier through a new batch
  // (which also writes the eventfd, so this bound only matters for idle engines).
  int timeout_ms = 100;
  MonoTime next = NextDeadline();
  if (next != MonoTime::max()) {
    auto until = std::chrono::duration_cast<std::chrono::milliseconds>(next - MonoNow()).count() + 1;
    timeout_ms = static_cast<int>(std::clamp<int64_t>(until, 0, timeout_ms));
  }
  pollfd fds[2] = {{worker_efd_, POLLIN, 0}, {wakeup_fd_.get(), POLLIN, 0}};
  int n = poll(fds, 2, timeout_ms);
  if (n > 0 && (fds[1].revents & POLLIN)) {
    uint64_t value = 0;
    (void)!read(wakeup_fd_.get(), &value, sizeof(value));
  }
}

void UcxTransferEngine::CheckDeadlines() {
  MonoTime now = MonoNow();
  std::vector<uint64_t> expired;
  for (const auto& [id, b] : batches_) {
    if (b->accepting && b->request.deadline.when() <= now) expired.push_back(id);
  }
  for (uint64_t id : expired) {
    Batch& b = *batches_.at(id);
    FailBatch(b, Status::DeadlineExceeded(fmt::format("batch {} from {}: deadline passed with {} of {} fragments "
                                                      "landed",
                                                      b.id, b.request.peer, b.landed, b.state.size())));
    if (b.outstanding > 0) {
      // Transfers into the destination are still in flight and only closing the endpoint proves
      // they stopped.
      auto p = peers_.find(b.peer_id);
      if (p != peers_.end() && !p->second->failed) {
        counters_->revocations->Increment();
        FailPeer(*p->second, Status::Unavailable(fmt::format("endpoint to {} closed to revoke the transfers of "
                                                             "expired batch {}",
                                                             b.request.peer, b.id)));
      }
    }
    MaybeFinish(b);
  }
  std::vector<uint64_t> expired_serves;
  for (const auto& [id, s] : serve_ops_) {
    if (!s->expired && s->deadline <= now) expired_serves.push_back(id);
  }
  for (uint64_t id : expired_serves) {
    ServeOp& s = *serve_ops_.at(id);
    s.expired = true;
    if (!s.failure) s.failure = Status::DeadlineExceeded("the requester's deadline passed");
    if (s.outstanding > 0) {
      auto it = server_eps_.find(s.server_ep_id);
      if (it != server_eps_.end() && !it->second->failed) {
        counters_->revocations->Increment();
        FailServerEp(*it->second, Status::DeadlineExceeded("a served request outlived its deadline"));
      }
    }
    MaybeFinishServe(s);
  }
}

void UcxTransferEngine::Track(ucs_status_ptr_t request, Op* op) {
  if (request == nullptr) {
    op->status = UCS_OK;
    completions_.push_back(op);
  } else if (UCS_PTR_IS_ERR(request)) {
    op->status = UCS_PTR_STATUS(request);
    completions_.push_back(op);
  }
  // Otherwise UCX calls OnSendComplete / OnRecvComplete later, from ucp_worker_progress.
}

void UcxTransferEngine::SendAm(ucp_ep_h ep, unsigned id, const void* header, size_t header_bytes, const void* payload,
                               size_t payload_bytes, uint32_t flags, Op* op) {
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  param.cb.send = &OnSendComplete;
  param.user_data = op;
  param.flags = flags;
  Track(ucp_am_send_nbx(ep, id, header, header_bytes, payload, payload_bytes, &param), op);
}

void UcxTransferEngine::OnSendComplete(void* request, ucs_status_t status, void* user_data) {
  auto* op = static_cast<Op*>(user_data);
  op->status = status;
  ucp_request_free(request);
  op->engine->completions_.push_back(op);
}

void UcxTransferEngine::OnRecvComplete(void* request, ucs_status_t status, size_t /*length*/, void* user_data) {
  auto* op = static_cast<Op*>(user_data);
  op->status = status;
  ucp_request_free(request);
  op->engine->completions_.push_back(op);
}

void UcxTransferEngine::CloseEndpoint(ucp_ep_h ep, uint64_t owner_id, bool peer_side) {
  auto* op = new Op{this, peer_side ? Op::Kind::kPeerClose : Op::Kind::kServerEpClose, owner_id, 0, UCS_OK};
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  param.cb.send = &OnSendComplete;
  param.user_data = op;
  // Forced: every outstanding operation on the endpoint completes with UCS_ERR_CANCELED, which is
  // the proof the lifetime rules need before memory is released.
  param.flags = UCP_EP_CLOSE_FLAG_FORCE;
  Track(ucp_ep_close_nbx(ep, &param), op);
}

void UcxTransferEngine::OnConnRequest(ucp_conn_request_h request, void* arg) {
  auto* self = static_cast<UcxTransferEngine*>(arg);
  Event e;
  e.kind = Event::Kind::kConnRequest;
  e.conn_request = request;
  self->events_.push_back(std::move(e));
}

void UcxTransferEngine::OnPeerError(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto* self = static_cast<UcxTransferEngine*>(arg);
  Event e;
  e.kind = Event::Kind::kPeerError;
  e.ep = ep;
  e.status = status;
  self->events_.push_back(std::move(e));
}

void UcxTransferEngine::OnServerEpError(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto* self = static_cast<UcxTransferEngine*>(arg);
  Event e;
  e.kind = Event::Kind::kServerEpError;
  e.ep = ep;
  e.status = status;
  self->events_.push_back(std::move(e));
}

void UcxTransferEngine::BeginShutdown() {
  shutting_down_ = true;
  for (auto& [id, b] : batches_) {
    FailBatch(*b, Status::Cancelled("transfer engine is shutting down"));
    dirty_batches_.insert(id);
  }
  for (auto& [id, peer] : peers_) {
    if (!peer->failed) FailPeer(*peer, Status::Cancelled("transfer engine is shutting down"));
  }
  for (auto& [id, server_ep] : server_eps_) {
    if (!server_ep->failed) FailServerEp(*server_ep, Status::Cancelled("transfer engine is shutting down"));
  }
}

bool UcxTransferEngine::ShutdownComplete() const {
  return batches_.empty() && serve_ops_.empty() && peers_.empty() && server_eps_.empty() && completions_.empty();
}

}  // namespace orbitkv::transfer
