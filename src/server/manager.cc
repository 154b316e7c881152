#include "server/manager.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <random>

#include "base/check.h"
#include "base/logging.h"
#include "server/options.h"

namespace orbitkv::server {
namespace {

// epoll data: session id << 2 | kind.
enum EventKind : uint64_t { kListener = 0, kWake = 1, kSocket = 2, kDoorbell = 3 };
uint64_t EventData(uint64_t session_id, EventKind kind) { return session_id << 2 | kind; }

void LogSsdTier(const ManagerConfig& config, const core::SsdTier& ssd, uint32_t files) {
  const storage::ScanReport& scan = ssd.scan_report();
  ORBITKV_LOG_INFO(
      "manager: SSD tier at {}: {} GiB in {} file(s), {} backend{}, {} writes; recovered {} "
      "block(s) ({} MiB) in {:.2f} s{}",
      config.ssd_path, ssd.capacity_bytes() >> 30, files, ssd.backend_name(), ssd.direct_io() ? " with O_DIRECT" : "",
      storage::WriteStagingName(ssd.write_staging()), scan.records, scan.payload_bytes >> 20, scan.seconds,
      scan.dropped_version + scan.dropped_corrupt + scan.dropped_overlap == 0
          ? std::string()
          : fmt::format(" (dropped {} of another format version, {} corrupt, {} overlapping)", scan.dropped_version,
                        scan.dropped_corrupt, scan.dropped_overlap));
}

}  // namespace

Manager::Manager(const ManagerConfig& config) : config_(config) {}

Result<std::unique_ptr<Manager>> Manager::Create(const ManagerConfig& config) {
  std::unique_ptr<Manager> manager(new Manager(config));
  core::BlockCacheOptions options = CacheOptionsFor(config);
  options.incarnation = manager->runtime_id_.incarnation();  // one identity for the whole run
  // Before the pool: its arenas are registered as mapped.
  ORBITKV_RETURN_IF_ERROR(manager->engines_.PreparePool(&options, config.gpus));
  Result<std::unique_ptr<core::BlockCache>> cache = core::BlockCache::Create(options, &manager->metrics_);
  if (!cache.ok()) return cache.status().WithContext("creating the DRAM pool");
  manager->cache_ = std::move(*cache);
  if (!config.ssd_path.empty()) {
    ORBITKV_ASSIGN_OR_RETURN(core::SsdTierOptions ssd, SsdOptionsFor(config));
    Result<std::unique_ptr<core::SsdTier>> tier = core::SsdTier::Create(ssd, manager->cache_.get(), &manager->metrics_);
    if (!tier.ok()) return tier.status().WithContext("opening the SSD tier (--ssd-path)");
    manager->ssd_ = std::move(*tier);
    LogSsdTier(config, *manager->ssd_, ssd.store.file_count);
  }
  manager->incarnation_ = manager->cache_->incarnation();
  CacheServiceOptions service = ServiceOptionsFor(config);
  service.wake_sweeper = [m = manager.get()] {
    MutexLock lock(&m->cleanup_mu_);
    m->sweep_due_ = true;
    m->cleanup_cv_.notify_one();
  };
  service.on_engine_fault = [m = manager.get()](uint64_t owner, const Status& why) {
    {
      MutexLock lock(&m->faulted_mu_);
      m->faulted_owners_.emplace_back(owner, why);
    }
    const uint64_t one = 1;
    (void)!write(m->wake_.get(), &one, sizeof(one));  // the dispatcher poisons the sessions
  };
  manager->service_ =
      std::make_unique<CacheService>(service, manager->cache_.get(), manager->ssd_.get(), &manager->metrics_);

  // Admitting other uids needs a socket they can connect to; SO_PEERCRED then decides who stays.
  Result<ScopedFd> listener = channel::ListenUnix(config.socket_path, config.allowed_uids.empty() ? 0600 : 0666);
  if (!listener.ok()) return listener.status().WithContext("opening the engine socket");
  manager->listener_ = std::move(*listener);
  manager->wake_ = ScopedFd(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  manager->epoll_ = ScopedFd(epoll_create1(EPOLL_CLOEXEC));
  if (!manager->wake_.valid() || !manager->epoll_.valid()) return ErrnoStatus("eventfd/epoll", errno);
  manager->RegisterMetrics();
  return manager;
}

void Manager::RegisterMetrics() {
  MetricsRegistry& m = metrics_;
  sessions_opened_ = &m.GetCounter("orbitkv_sessions_opened_total", "Engine sessions accepted");
  const char* reasons[] = {"malformed_request", "bad_frame", "reply_ring", "engine_memory"};
  for (int i = 0; i < 4; ++i) {
    sessions_poisoned_[i] = &m.GetCounter("orbitkv_sessions_poisoned_total",
                                          "Sessions closed by the Manager, by reason: a malformed request or lifecycle "
                                          "frame, a reply ring the engine overflowed or corrupted, engine memory that "
                                          "faulted under a copy",
                                          {{"reason", reasons[i]}});
  }
  sessions_active_ = &m.GetGauge("orbitkv_sessions_active", "Open engine sessions");
  instances_active_ = &m.GetGauge("orbitkv_instances_active", "Registered engine instances");
  requests_total_ = &m.GetCounter("orbitkv_requests_total", "Requests received from engines");
  m.GetGauge("orbitkv_runtime_info",
             "1, labelled with this run's identity (new at every start: a peer or a dashboard "
             "that sees it change knows the Manager restarted)",
             {{"runtime_uuid", runtime_id_.ToString()}})
      .Set(1);
  remote_work_enabled_ = &m.GetGauge("orbitkv_membership_remote_work_enabled",
                                     "1 while membership is registered and the member view "
                                     "complete (remote work allowed); 0 otherwise, including "
                                     "single-host mode");
}

Status Manager::Start() {
  ORBITKV_CHECK(!started_);
  // A whole restore of many pages goes to the copy engine as two batches (CacheService::Restore).
  ORBITKV_RETURN_IF_ERROR(
      engines_.Start(config_.copy_threads, 2 * config_.max_operations, config_.gpu_restore_staging_bytes, &metrics_));
  if (!config_.metrics_addr.empty()) {
    Result<std::unique_ptr<MetricsHttpServer>> http = MetricsHttpServer::Bind(config_.metrics_addr, &metrics_);
    if (!http.ok()) return http.status().WithContext("--metrics-addr");
    http_ = std::move(*http);
    http_->Start();
  }
  epoll_event listener_event{EPOLLIN, {.u64 = EventData(0, kListener)}};
  epoll_event wake_event{EPOLLIN, {.u64 = EventData(0, kWake)}};
  if (epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, listener_.get(), &listener_event) != 0 ||
      epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, wake_.get(), &wake_event) != 0) {
    return ErrnoStatus("epoll_ctl", errno);
  }
  ORBITKV_ASSIGN_OR_RETURN(cluster_, ClusterLink::Start(config_, runtime_id_, cache_.get(), ssd_.get(), &metrics_));
  if (cluster_) {
    service_->SetRemoteStage(
        [link = cluster_.get()](std::vector<state::StateKey> keys) { return link->RemoteStage(std::move(keys)); });
  }
  cleaner_ = std::thread([this] { CleanupLoop(); });
  dispatcher_ = std::thread([this] { DispatchLoop(); });
  started_ = true;
  ORBITKV_LOG_INFO("manager: serving engines on {} ({} MiB DRAM pool, {} copy threads, runtime {}{})",
                   config_.socket_path, cache_->pool().Stats().capacity_bytes >> 20, config_.copy_threads,
                   runtime_id_.ToString(), http_ ? fmt::format(", metrics on port {}", http_->port()) : std::string());
  return Status::Ok();
}

uint16_t Manager::metrics_port() const { return http_ ? http_->port() : 0; }

void Manager::RequestStop() {
  stopping_.store(true, std::memory_order_release);
  const uint64_t one = 1;
  (void)!write(wake_.get(), &one, sizeof(one));  // async-signal-safe
}

void Manager::Wait() {
  if (!started_ || waited_) return;
  waited_ = true;
  dispatcher_.join();
  // The dispatcher stopped accepting and closed every session; drain the copies they left running.
  engines_.Shutdown();
  // Then the SSD tier: DRAM-only blocks are written for the restart (no engine can touch them
  // now), then the rest of the queue is dropped and writes and reads in flight finish.
  if (ssd_ && config_.ssd_persist_seconds > 0) PersistDramForRestart();
  if (ssd_) ssd_->Shutdown();
  {
    MutexLock lock(&cleanup_mu_);
    cleanup_stop_ = true;
  }
  cleanup_cv_.notify_all();
  cleaner_.join();
  if (cluster_) cluster_->Shutdown();  // revokes the lease: peers see this Manager leave at once
  if (http_) http_->Stop();
  ORBITKV_LOG_INFO("manager: stopped");
}

void Manager::PersistDramForRestart() {
  const auto seconds = std::chrono::seconds(config_.ssd_persist_seconds);
  const core::SsdTier::PersistReport report =
      ssd_->PersistDram(MonoNow() + seconds, [](const core::SsdTier::PersistReport& progress) {
        ORBITKV_LOG_INFO("manager: writing DRAM blocks to SSD before exit: {} of {} ({} MiB)", progress.written,
                         progress.candidates, progress.written_bytes >> 20);
      });
  if (report.candidates == 0) return;
  ORBITKV_LOG_INFO("manager: wrote {} of {} DRAM-only block(s) ({} MiB) to SSD in {:.1f} s for the restart{}",
                   report.written, report.candidates, report.written_bytes >> 20, report.seconds,
                   report.timed_out ? fmt::format("; --ssd-persist-on-exit {} s passed, the rest is dropped",
                                                  config_.ssd_persist_seconds)
                                    : std::string());
}

Manager::~Manager() {
  if (started_) {
    RequestStop();
    Wait();
  }
  // The cluster link goes first: its owner streams read the inventory and its UCX engine has the
  // pool's arenas registered.
  cluster_.reset();
  if (ssd_) ssd_->Shutdown();  // its load callbacks reach the service
  if (service_) service_->instances().Clear();
  service_.reset();
  engines_.Close();  // IPC mappings closed before the pool
  ssd_.reset();      // before the cache it writes back from
  cache_.reset();
  unlink(config_.socket_path.c_str());
}

void Manager::DispatchLoop() {
  epoll_event events[64];
  // After serving a request the dispatcher keeps polling the rings for a short while instead of
  // sleeping: a busy engine's next request is then picked up without a doorbell round trip (a
  // wakeup costs several microseconds). Not while copies are in flight: their workers need the
  // cores more (on a small host a spinning dispatcher halved save throughput), and the engine
  // waits for those copies anyway. An idle Manager sleeps in epoll_wait.
  constexpr auto kSpinAfterWork = std::chrono::microseconds(100);
  MonoTime last_work = MonoNow() - std::chrono::seconds(1);  // not "recent": start asleep
  while (!stopping_.load(std::memory_order_acquire)) {
    const bool spinning = MonoNow() - last_work < kSpinAfterWork && service_->operations_active() == 0;
    bool pending = spinning;
    if (!spinning) {
      // Announce sleep on every session's request ring; a request that raced in means no sleep this
      // round.
      for (auto& [id, session] : sessions_) {
        Result<bool> arrived = session->channel->PrepareToWait();
        pending = pending || !arrived.ok() || *arrived || session->channel->broken();
      }
    }
    const int n = epoll_wait(epoll_.get(), events, 64, pending ? 0 : 1000);
    if (!spinning) {
      remote_work_enabled_->Set(cluster_ && cluster_->CanDoRemoteWork() ? 1 : 0);
      for (auto& [id, session] : sessions_) session->channel->ClearWaiting();
    }
    if (n < 0 && errno != EINTR) {
      ORBITKV_LOG_ERROR("manager: epoll_wait failed: {}", std::strerror(errno));
      break;
    }
    for (int i = 0; i < n; ++i) {
      const uint64_t data = events[i].data.u64;
      const auto kind = static_cast<EventKind>(data & 3);
      if (kind == kListener) AcceptSessions();
      if (kind == kWake) {
        uint64_t rings = 0;
        (void)!read(wake_.get(), &rings, sizeof(rings));  // a stop, or faulted owners to poison
      }
      if (kind != kSocket && kind != kDoorbell) continue;
      auto it = sessions_.find(data >> 2);
      if (it == sessions_.end()) continue;
      if (kind == kDoorbell) {
        it->second->channel->DrainDoorbell();
      } else {
        ServeFrames(it->second);
      }
    }
    // Serve every session's ring (cheap when empty): doorbells are only rung for sleeping
    // consumers.
    std::vector<std::shared_ptr<Session>> live;
    live.reserve(sessions_.size());
    for (auto& [id, session] : sessions_) live.push_back(session);
    int served = 0;
    for (const auto& session : live) served += ServeSession(session);
    if (served > 0) last_work = MonoNow();
    PoisonFaultedOwners();
  }
  // Shutdown: refuse new sessions, close the existing ones (their copies drain in Wait).
  std::vector<uint64_t> ids;
  for (auto& [id, session] : sessions_) ids.push_back(id);
  for (uint64_t id : ids) CloseSession(id, Status::Unavailable("the Manager is shutting down"));
}

void Manager::PoisonFaultedOwners() {
  std::vector<std::pair<uint64_t, Status>> faulted;
  {
    MutexLock lock(&faulted_mu_);
    if (faulted_owners_.empty()) return;
    faulted.swap(faulted_owners_);
  }
  for (const auto& [owner, why] : faulted) {
    std::vector<uint64_t> ids;  // the owner's control session and its publish sessions
    for (const auto& [id, session] : sessions_) {
      if (session->owner_id == owner) ids.push_back(id);
    }
    for (uint64_t id : ids) {
      auto it = sessions_.find(id);
      if (it == sessions_.end()) continue;
      ORBITKV_LOG_WARN("manager: poisoning session {}: {}", id, why.ToString());
      PoisonSession(*it->second, why, PoisonReason::kEngineMemory);
    }
  }
}

// Lifecycle frames, or the engine closing the session.
void Manager::ServeFrames(const std::shared_ptr<Session>& session) {
  for (;;) {
    Result<std::optional<channel::Frame>> frame = session->channel->ReadFrame();
    if (!frame.ok()) {
      CloseSession(session->id, frame.status());
      return;
    }
    if (!frame->has_value()) return;
    Status handled = HandleFrame(*session, **frame);
    if (!handled.ok()) {
      PoisonSession(*session, handled, PoisonReason::kBadFrame);
      return;
    }
  }
}

void Manager::PoisonSession(const Session& session, const Status& why, PoisonReason reason) {
  sessions_poisoned_[static_cast<int>(reason)]->Increment();
  session.channel->Poison(why);
  CloseSession(session.id, why);
}

Status Manager::AdmitPublishSession(const Session& session) const {
  auto control = sessions_.find(session.owner_id);
  if (control == sessions_.end() || control->second->channel->role() != channel::SessionRole::kControl ||
      control->second->channel->peer().pid != session.channel->peer().pid) {
    return Status::PermissionDenied("a publish session must name a live control session of the same process");
  }
  return Status::Ok();
}

void Manager::AcceptSessions() {
  for (;;) {
    ScopedFd conn(accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!conn.valid()) return;
    channel::AcceptOptions options;
    options.allowed_uids = config_.allowed_uids;
    options.session_id = next_session_id_++;
    std::random_device random;
    options.session_epoch = (static_cast<uint64_t>(random()) << 32 | random()) | 1;
    options.manager_incarnation = incarnation_;
    options.default_layout.ring_entries = config_.ring_entries;
    options.default_layout.payload_slots = config_.payload_slots;
    options.default_layout.slot_bytes = config_.slot_bytes;
    options.deadline = Deadline::After(std::chrono::seconds(2));
    Result<std::unique_ptr<channel::ServerSession>> accepted = channel::ServerSession::Accept(std::move(conn), options);
    if (!accepted.ok()) {
      ORBITKV_LOG_WARN("manager: refused a session: {}", accepted.status().ToString());
      continue;
    }
    auto session = std::make_shared<Session>();
    session->id = options.session_id;
    session->channel = std::shared_ptr<channel::ServerSession>(std::move(*accepted));
    const bool publish = session->channel->role() == channel::SessionRole::kPublish;
    session->owner_id = publish ? session->channel->control_session() : session->id;
    if (publish) {
      Status admitted = AdmitPublishSession(*session);
      if (!admitted.ok()) {
        session->channel->Poison(admitted);
        continue;
      }
    }
    epoll_event socket_event{EPOLLIN | EPOLLRDHUP, {.u64 = EventData(session->id, kSocket)}};
    epoll_event bell_event{EPOLLIN, {.u64 = EventData(session->id, kDoorbell)}};
    if (epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, session->channel->socket_fd(), &socket_event) != 0 ||
        epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, session->channel->request_doorbell_fd(), &bell_event) != 0) {
      ORBITKV_LOG_ERROR("manager: epoll_ctl for a new session failed: {}", std::strerror(errno));
      continue;
    }
    sessions_opened_->Increment();
    sessions_active_->Add(1);
    ORBITKV_LOG_INFO("manager: session {} ({}) opened by pid {} uid {}", session->id, publish ? "publish" : "control",
                     session->channel->peer().pid, session->channel->peer().uid);
    sessions_.emplace(session->id, std::move(session));
  }
}

int Manager::ServeSession(const std::shared_ptr<Session>& session) {
  // Bounded per round so one busy session cannot starve the others.
  int served = 0;
  for (; served < 64; ++served) {
    if (session->channel->broken()) {
      PoisonSession(*session, Status::ResourceExhausted("the engine's reply ring overflowed or was corrupted"),
                    PoisonReason::kReplyRing);
      return served;
    }
    Result<std::optional<channel::InboundRequest>> request = session->channel->NextRequest();
    Status status = request.ok() ? Status::Ok() : request.status();
    if (status.ok() && !request->has_value()) return served;
    if (status.ok()) {
      requests_total_->Increment();
      status = HandleRequest(session, **request);
    }
    if (!status.ok()) {
      ORBITKV_LOG_WARN("manager: poisoning session {}: {}", session->id, status.ToString());
      PoisonSession(*session, status, PoisonReason::kMalformedRequest);
      return served;
    }
  }
  return served;
}

void Manager::CloseSession(uint64_t session_id, const Status& why) {
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) return;
  std::shared_ptr<Session> session = it->second;
  sessions_.erase(it);
  epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, session->channel->socket_fd(), nullptr);
  epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, session->channel->request_doorbell_fd(), nullptr);
  sessions_active_->Add(-1);
  // A control session's instances go with it; a superseded session cannot touch its replacement's.
  std::vector<std::shared_ptr<EngineInstance>> retired = service_->instances().RemoveOwner(session->id);
  for (const auto& instance : retired) RetireInstance(instance);
  ORBITKV_LOG_INFO("manager: session {} closed ({}); {} instance(s) cleaned up", session_id, why.ToString(),
                   retired.size());
}

void Manager::RetireInstance(const std::shared_ptr<EngineInstance>& instance) {
  instances_active_->Add(-1);
  const size_t leases = service_->RetireInstance(*instance);
  if (leases != 0) ORBITKV_LOG_INFO("manager: instance {}: released {} lease(s)", instance->id, leases);
  // Unregistering waits for in-flight copies into the instance's buffers: not on the dispatcher.
  // Mappings are released when the last in-flight operation drops its reference to the group.
  PostCleanup([this, instance] {
    for (auto& [id, group] : instance->TakeGroups()) UnregisterBuffers(*group);
  });
}

void Manager::PostCleanup(std::function<void()> task) {
  {
    MutexLock lock(&cleanup_mu_);
    cleanup_tasks_.push_back(std::move(task));
  }
  cleanup_cv_.notify_one();
}

void Manager::CleanupLoop() {
  MonoTime next_sweep = MonoNow();
  for (;;) {
    std::function<void()> task;
    {
      MutexLock lock(&cleanup_mu_);
      // Woken for Loading deadlines and held-block expiry too, even on a Manager that gets no
      // queries.
      while (cleanup_tasks_.empty() && !cleanup_stop_ && !sweep_due_ && MonoNow() < next_sweep) {
        cleanup_cv_.wait_until(cleanup_mu_, next_sweep);
      }
      if (sweep_due_) next_sweep = MonoNow();  // after the task, if there is one
      sweep_due_ = false;
      if (cleanup_tasks_.empty() && cleanup_stop_) return;
      if (!cleanup_tasks_.empty()) {
        task = std::move(cleanup_tasks_.front());
        cleanup_tasks_.pop_front();
      }
    }
    if (task) {
      task();
      continue;
    }
    next_sweep = std::min(service_->Sweep(), MonoNow() + std::chrono::seconds(1));
  }
}

}  // namespace orbitkv::server
