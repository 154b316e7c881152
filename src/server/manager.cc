#include "server/manager.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <random>

#include "base/check.h"
#include "base/logging.h"
#include "server/manager_internal.h"

#if ORBITKV_SERVER_HAS_GPU
#include "gpu/cuda_copy_engine.h"
#include "gpu/cuda_util.h"
#include "gpu/host_memory_registry.h"
#endif

namespace orbitkv::server {
namespace {

// epoll data: session id << 2 | kind.
enum EventKind : uint64_t { kListener = 0, kWake = 1, kSocket = 2, kDoorbell = 3 };
uint64_t EventData(uint64_t session_id, EventKind kind) { return session_id << 2 | kind; }

std::vector<int> ParseNumaNodes(const std::string& numa) {
  if (numa == "auto") return {};
  if (numa == "none") return {-1};
  std::vector<int> nodes;
  size_t start = 0;
  while (start < numa.size()) {
    const size_t comma = std::min(numa.find(',', start), numa.size());
    nodes.push_back(std::stoi(numa.substr(start, comma - start)));
    start = comma + 1;
  }
  return nodes;
}

// The SSD tier's options from the flags; the capacity defaults to 64 GiB and never exceeds 90% of
// the free space of the file system holding --ssd-path (preallocation must not fill the disk).
Result<core::SsdTierOptions> SsdOptionsFor(const ManagerConfig& config) {
  core::SsdTierOptions options;
  options.store.directory = config.ssd_path;
  std::error_code error;
  std::filesystem::create_directories(config.ssd_path, error);
  if (error) {
    return Status::InvalidArgument(
        fmt::format("--ssd-path {}: cannot create it: {}", config.ssd_path, error.message()));
  }
  struct statvfs fs {};
  if (statvfs(config.ssd_path.c_str(), &fs) != 0) {
    return ErrnoStatus(fmt::format("--ssd-path {}: statvfs", config.ssd_path), errno);
  }
  // Space the tier's existing files already hold counts as available to it.
  uint64_t existing = 0;
  for (const auto& entry : std::filesystem::directory_iterator(config.ssd_path, error)) {
    if (entry.path().filename().string().starts_with("orbitkv-ssd-")) {
      struct stat st {};
      if (stat(entry.path().c_str(), &st) == 0)
        existing += static_cast<uint64_t>(st.st_blocks) * 512;
    }
  }
  const uint64_t available = static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize + existing;
  const uint64_t limit = available / 10 * 9;
  uint64_t capacity = config.ssd_capacity_bytes != 0 ? config.ssd_capacity_bytes : (64ull << 30);
  if (capacity > limit) {
    if (config.ssd_capacity_bytes != 0) {
      return Status::ResourceExhausted(fmt::format(
          "--ssd-capacity {} MiB does not fit: the file system of {} has {} MiB available (the "
          "tier takes at most 90% of it); give a smaller --ssd-capacity",
          capacity >> 20, config.ssd_path, available >> 20));
    }
    capacity = limit;
  }
  options.store.capacity_bytes = capacity;
  options.store.file_count = config.ssd_files;
  if (options.store.file_count == 0) {
    options.store.file_count =
        static_cast<uint32_t>(std::clamp<uint64_t>(capacity / (64ull << 30), 1, 16));
  }
  options.store.backend = *storage::ParseDeviceBackend(config.ssd_backend);
  options.store.recover = config.ssd_recover;
  options.store.verify_on_open = config.ssd_verify == "eager";
  options.store.write_staging = *storage::ParseWriteStaging(config.ssd_write_staging);
  options.policy = config.ssd_policy == "write-through" ? core::SsdWritePolicy::kWriteThrough
                                                        : core::SsdWritePolicy::kWriteBack;
  options.min_frequency = config.ssd_min_frequency;
  options.write_bytes_per_second = config.ssd_write_budget_bytes;
  options.queue_bytes = config.ssd_queue_bytes != 0
                            ? config.ssd_queue_bytes
                            : std::min<uint64_t>(config.dram_bytes / 8, 1ull << 30);
  return options;
}

}  // namespace

Manager::Group::~Group() {
  for (Buffer& buffer : buffers) {
    if (buffer.base != nullptr) munmap(buffer.base, buffer.bytes);
  }
}

Manager::Manager(const ManagerConfig& config) : config_(config) {}

void Manager::SetUpGpu(core::BlockCacheOptions* options) {
#if ORBITKV_SERVER_HAS_GPU
  Result<int> devices = gpu::UsableDeviceCount();
  if (!devices.ok()) {
    ORBITKV_LOG_WARN("manager: CUDA is not usable ({}); serving CPU engines only",
                     devices.status().ToString());
    return;
  }
  if (*devices == 0) {
    ORBITKV_LOG_INFO("manager: no GPU found; serving CPU engines only");
    return;
  }
  host_memory_ = std::make_unique<gpu::HostMemoryRegistry>();
  options->pool.registrar = host_memory_.get();
  ORBITKV_LOG_INFO("manager: {} GPU(s) usable: the pool is registered with CUDA", *devices);
#else
  (void)options;
#endif
}

bool Manager::gpu_enabled() const {
#if ORBITKV_SERVER_HAS_GPU
  return host_memory_ != nullptr;
#else
  return false;
#endif
}

Result<std::unique_ptr<Manager>> Manager::Create(const ManagerConfig& config) {
  std::unique_ptr<Manager> manager(new Manager(config));
  core::BlockCacheOptions options;
  options.pool.capacity_bytes = config.dram_bytes;
  options.pool.slab_bytes = config.slab_bytes;
  options.pool.numa_nodes = ParseNumaNodes(config.numa);
  options.pool.pin_mode =
      config.allow_unpinned ? core::PinMode::kAllowUnpinned : core::PinMode::kRequireLocked;
  options.query_budget_bytes = config.query_budget_bytes;
  options.query_instance_budget_bytes = config.query_instance_budget_bytes;
  options.transfer_budget_bytes = config.transfer_budget_bytes;
  options.table.expected_blocks = std::max<uint64_t>(config.dram_bytes / (256 << 10), 1024);
  manager->SetUpGpu(&options);  // before the pool: its arenas are registered as they are mapped
  Result<std::unique_ptr<core::BlockCache>> cache =
      core::BlockCache::Create(options, &manager->metrics_);
  if (!cache.ok()) return cache.status().WithContext("creating the DRAM pool");
  manager->cache_ = std::move(*cache);
  if (!config.ssd_path.empty()) {
    ORBITKV_ASSIGN_OR_RETURN(core::SsdTierOptions ssd, SsdOptionsFor(config));
    Result<std::unique_ptr<core::SsdTier>> tier =
        core::SsdTier::Create(ssd, manager->cache_.get(), &manager->metrics_);
    if (!tier.ok()) return tier.status().WithContext("opening the SSD tier (--ssd-path)");
    manager->ssd_ = std::move(*tier);
    const storage::ScanReport& scan = manager->ssd_->scan_report();
    ORBITKV_LOG_INFO(
        "manager: SSD tier at {}: {} GiB in {} file(s), {} backend{}, {} writes; recovered {} "
        "block(s) ({} MiB) in {:.2f} s{}",
        config.ssd_path, manager->ssd_->capacity_bytes() >> 30, ssd.store.file_count,
        manager->ssd_->backend_name(), manager->ssd_->direct_io() ? " with O_DIRECT" : "",
        storage::WriteStagingName(manager->ssd_->write_staging()),
        scan.records, scan.payload_bytes >> 20, scan.seconds,
        scan.dropped_version + scan.dropped_corrupt + scan.dropped_overlap == 0
            ? std::string()
            : fmt::format(" (dropped {} of another format version, {} corrupt, {} overlapping)",
                          scan.dropped_version, scan.dropped_corrupt, scan.dropped_overlap));
  }
  manager->incarnation_ = manager->cache_->incarnation();

  // Admitting other uids needs a socket they can connect to; SO_PEERCRED then decides who stays.
  Result<ScopedFd> listener =
      channel::ListenUnix(config.socket_path, config.allowed_uids.empty() ? 0600 : 0666);
  if (!listener.ok()) return listener.status().WithContext("opening the engine socket");
  manager->listener_ = std::move(*listener);
  manager->wake_ = ScopedFd(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  manager->epoll_ = ScopedFd(epoll_create1(EPOLL_CLOEXEC));
  if (!manager->wake_.valid() || !manager->epoll_.valid())
    return ErrnoStatus("eventfd/epoll", errno);

  MetricsRegistry& m = manager->metrics_;
  manager->sessions_opened_ =
      &m.GetCounter("orbitkv_sessions_opened_total", "Engine sessions accepted");
  manager->sessions_poisoned_ = &m.GetCounter("orbitkv_sessions_poisoned_total",
                                              "Sessions closed for a malformed or invalid request");
  manager->sessions_active_ = &m.GetGauge("orbitkv_sessions_active", "Open engine sessions");
  manager->instances_active_ =
      &m.GetGauge("orbitkv_instances_active", "Registered engine instances");
  manager->operations_active_ =
      &m.GetGauge("orbitkv_operations_active", "Restores and saves in flight");
  manager->requests_total_ =
      &m.GetCounter("orbitkv_requests_total", "Requests received from engines");
  manager->operation_rejections_ =
      &m.GetCounter("orbitkv_operation_rejections_total",
                    "Restores and saves refused because --max-operations were in flight");
  manager->restored_bytes_ =
      &m.GetCounter("orbitkv_restored_bytes_total", "Bytes copied into engine pages");
  manager->saved_bytes_ =
      &m.GetCounter("orbitkv_saved_bytes_total", "Bytes copied from engine pages and sealed");
  manager->save_skipped_ = &m.GetCounter("orbitkv_save_skipped_blocks_total",
                                         "Saved blocks skipped (already resident or in progress)");
  manager->remote_work_enabled_ = &m.GetGauge("orbitkv_membership_remote_work_enabled",
                                              "1 while membership is registered and the member "
                                              "view complete (remote work allowed); 0 otherwise, "
                                              "including single-host mode");
  manager->loading_started_ = &m.GetCounter(
      "orbitkv_loading_started_total", "Queries answered Loading (blocks read from SSD into DRAM)");
  manager->loading_active_ =
      &m.GetGauge("orbitkv_loading_active", "Loading operations not yet complete");
  manager->loading_held_ = &m.GetGauge(
      "orbitkv_loading_held_blocks",
      "DRAM blocks that completed loads keep pinned until the engine's next query leases them");
  manager->query_latency_ =
      &m.GetHistogram("orbitkv_query_seconds", "Time to answer a query in the Manager",
                      Histogram::ExponentialBounds(1e-6, 2, 20));
  return manager;
}

Status Manager::Start() {
  ORBITKV_CHECK(!started_);
  core::CpuCopyEngine::Options engine_options;
  engine_options.threads = static_cast<int>(config_.copy_threads);
  engine_options.max_inflight_batches = config_.max_operations;
  ORBITKV_ASSIGN_OR_RETURN(copy_engine_, core::CpuCopyEngine::Create(engine_options, &metrics_));
#if ORBITKV_SERVER_HAS_GPU
  if (host_memory_) {
    gpu::CudaCopyEngine::Options gpu_options;
    gpu_options.max_inflight_batches = std::max<uint32_t>(config_.max_operations, 1);
    Result<std::unique_ptr<gpu::CudaCopyEngine>> cuda =
        gpu::CudaCopyEngine::Create(gpu_options, host_memory_.get(), &metrics_);
    if (!cuda.ok()) return cuda.status().WithContext("starting the CUDA copy engine");
    cuda_engine_ = std::move(*cuda);
  }
#endif
  if (!config_.metrics_addr.empty()) {
    Result<std::unique_ptr<MetricsHttpServer>> http =
        MetricsHttpServer::Bind(config_.metrics_addr, &metrics_);
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
  ORBITKV_RETURN_IF_ERROR(StartMembership());
  cleaner_ = std::thread([this] { CleanupLoop(); });
  dispatcher_ = std::thread([this] { DispatchLoop(); });
  started_ = true;
  ORBITKV_LOG_INFO("manager: serving engines on {} ({} MiB DRAM pool, {} copy threads{})",
                   config_.socket_path, cache_->pool().Stats().capacity_bytes >> 20,
                   config_.copy_threads,
                   http_ ? fmt::format(", metrics on port {}", http_->port()) : std::string());
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
  copy_engine_->Shutdown();
#if ORBITKV_SERVER_HAS_GPU
  if (cuda_engine_) cuda_engine_->Shutdown();
#endif
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
#if ORBITKV_SERVER_HAS_CLUSTER
  if (membership_)
    membership_->Shutdown();  // revokes the lease: peers see this Manager leave at once
#endif
  if (http_) http_->Stop();
  ORBITKV_LOG_INFO("manager: stopped");
}

void Manager::PersistDramForRestart() {
  const auto seconds = std::chrono::seconds(config_.ssd_persist_seconds);
  const core::SsdTier::PersistReport report = ssd_->PersistDram(
      MonoNow() + seconds, [](const core::SsdTier::PersistReport& progress) {
        ORBITKV_LOG_INFO("manager: writing DRAM blocks to SSD before exit: {} of {} ({} MiB)",
                         progress.written, progress.candidates, progress.written_bytes >> 20);
      });
  if (report.candidates == 0) return;
  ORBITKV_LOG_INFO(
      "manager: wrote {} of {} DRAM-only block(s) ({} MiB) to SSD in {:.1f} s for the restart{}",
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
  {
    MutexLock lock(&instances_mu_);
    instances_.clear();
  }
  copy_engine_.reset();
#if ORBITKV_SERVER_HAS_GPU
  // Closes the IPC mappings still open; the pool (cache_) and then host_memory_, which unregisters
  // nothing the pool did not, go with the members.
  cuda_engine_.reset();
#endif
  ssd_.reset();  // before the cache it writes back from
  unlink(config_.socket_path.c_str());
}

void Manager::DispatchLoop() {
  epoll_event events[64];
  // After serving a request the dispatcher keeps polling the rings for a short while instead of
  // sleeping: a busy engine's next request is then picked up without a doorbell round trip (a
  // wakeup costs several microseconds). An idle Manager sleeps in epoll_wait.
  constexpr auto kSpinAfterWork = std::chrono::microseconds(100);
  MonoTime last_work = MonoNow() - std::chrono::seconds(1);  // not "recent": start asleep
  while (!stopping_.load(std::memory_order_acquire)) {
    const bool spinning = MonoNow() - last_work < kSpinAfterWork;
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
    if (!spinning) UpdateMembershipGauges();
    if (!spinning) {
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
      if (kind != kSocket && kind != kDoorbell) continue;
      auto it = sessions_.find(data >> 2);
      if (it == sessions_.end()) continue;
      if (kind == kDoorbell) {
        it->second->channel->DrainDoorbell();
        continue;
      }
      // Lifecycle frames, or the engine closing the session.
      std::shared_ptr<Session> session = it->second;
      for (;;) {
        Result<std::optional<channel::Frame>> frame = session->channel->ReadFrame();
        if (!frame.ok()) {
          CloseSession(session->id, frame.status());
          break;
        }
        if (!frame->has_value()) break;
        Status handled = HandleFrame(*session, **frame);
        if (!handled.ok()) {
          sessions_poisoned_->Increment();
          session->channel->Poison(handled);
          CloseSession(session->id, handled);
          break;
        }
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
  }
  // Shutdown: refuse new sessions, close the existing ones (their copies drain in Wait).
  std::vector<uint64_t> ids;
  for (auto& [id, session] : sessions_) ids.push_back(id);
  for (uint64_t id : ids) CloseSession(id, Status::Unavailable("the Manager is shutting down"));
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
    Result<std::unique_ptr<channel::ServerSession>> accepted =
        channel::ServerSession::Accept(std::move(conn), options);
    if (!accepted.ok()) {
      ORBITKV_LOG_WARN("manager: refused a session: {}", accepted.status().ToString());
      continue;
    }
    auto session = std::make_shared<Session>();
    session->id = options.session_id;
    session->channel = std::shared_ptr<channel::ServerSession>(std::move(*accepted));
    session->owner_id = session->channel->role() == channel::SessionRole::kPublish
                            ? session->channel->control_session()
                            : session->id;
    if (session->channel->role() == channel::SessionRole::kPublish) {
      auto control = sessions_.find(session->owner_id);
      if (control == sessions_.end() ||
          control->second->channel->role() != channel::SessionRole::kControl ||
          control->second->channel->peer().pid != session->channel->peer().pid) {
        session->channel->Poison(Status::PermissionDenied(
            "a publish session must name a live control session of the same process"));
        continue;
      }
    }
    epoll_event socket_event{EPOLLIN | EPOLLRDHUP, {.u64 = EventData(session->id, kSocket)}};
    epoll_event bell_event{EPOLLIN, {.u64 = EventData(session->id, kDoorbell)}};
    if (epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, session->channel->socket_fd(), &socket_event) != 0 ||
        epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, session->channel->request_doorbell_fd(),
                  &bell_event) != 0) {
      ORBITKV_LOG_ERROR("manager: epoll_ctl for a new session failed: {}", std::strerror(errno));
      continue;
    }
    sessions_opened_->Increment();
    sessions_active_->Add(1);
    ORBITKV_LOG_INFO(
        "manager: session {} ({}) opened by pid {} uid {}", session->id,
        session->channel->role() == channel::SessionRole::kControl ? "control" : "publish",
        session->channel->peer().pid, session->channel->peer().uid);
    sessions_.emplace(session->id, std::move(session));
  }
}

int Manager::ServeSession(const std::shared_ptr<Session>& session) {
  // Bounded per round so one busy session cannot starve the others.
  int served = 0;
  for (; served < 64; ++served) {
    if (session->channel->broken()) {
      const Status why =
          Status::ResourceExhausted("the engine's reply ring overflowed or was corrupted");
      sessions_poisoned_->Increment();
      session->channel->Poison(why);
      CloseSession(session->id, why);
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
      sessions_poisoned_->Increment();
      session->channel->Poison(status);
      CloseSession(session->id, status);
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
  std::vector<std::shared_ptr<Instance>> retired;
  {
    MutexLock lock(&instances_mu_);
    for (auto inst = instances_.begin(); inst != instances_.end();) {
      if (inst->second->owner_session == session->id) {
        retired.push_back(inst->second);
        inst = instances_.erase(inst);
      } else {
        ++inst;
      }
    }
  }
  for (const auto& instance : retired) RetireInstance(instance);
  ORBITKV_LOG_INFO("manager: session {} closed ({}); {} instance(s) cleaned up", session_id,
                   why.ToString(), retired.size());
}

void Manager::RetireInstance(const std::shared_ptr<Instance>& instance) {
  instance->retired.store(true, std::memory_order_release);
  instances_active_->Add(-1);
  DropLoadingOf(instance->id);
  const size_t leases = cache_->CleanupInstance(instance->id);
  if (leases != 0)
    ORBITKV_LOG_INFO("manager: instance {}: released {} lease(s)", instance->id, leases);
  // Unregistering waits for in-flight copies into the instance's buffers: not on the dispatcher.
  PostCleanup([this, instance] {
    std::map<uint32_t, std::shared_ptr<Group>> groups;
    {
      MutexLock lock(&instance->mu);
      groups.swap(instance->groups);
    }
    for (auto& [id, group] : groups) {
      for (Group::Buffer& buffer : group->buffers) {
        Status unregistered = UnregisterGroupBuffer(*group, buffer.id);
        if (!unregistered.ok())
          ORBITKV_LOG_WARN("manager: unregister buffer: {}", unregistered.ToString());
      }
    }
    // Mappings are released when the last in-flight operation drops its reference to the group.
  });
}

Status Manager::UnregisterGroupBuffer(const Group& group, core::BufferId id) {
#if ORBITKV_SERVER_HAS_GPU
  if (group.kind == channel::BufferKind::kCudaIpc) return cuda_engine_->UnregisterBuffer(id);
#else
  (void)group;  // every group is the CPU engine's
#endif
  return copy_engine_->UnregisterBuffer(id);
}

void Manager::PostCleanup(std::function<void()> task) {
  {
    MutexLock lock(&cleanup_mu_);
    cleanup_tasks_.push_back(std::move(task));
  }
  cleanup_cv_.notify_one();
}

void Manager::CleanupLoop() {
  for (;;) {
    std::function<void()> task;
    {
      MutexLock lock(&cleanup_mu_);
      // Woken each second as well: completed loads nobody asked for are let go even on a Manager
      // that gets no queries.
      while (cleanup_tasks_.empty() && !cleanup_stop_) {
        if (cleanup_cv_.wait_for(cleanup_mu_, std::chrono::seconds(1)) == std::cv_status::timeout) {
          break;
        }
      }
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
    std::vector<core::BlockPin> released;  // let go after the lock
    MutexLock lock(&loading_mu_);
    SweepHeldLocked(&released);
  }
}

Status Manager::StartMembership() {
#if ORBITKV_SERVER_HAS_CLUSTER
  if (config_.etcd_endpoints.empty()) return Status::Ok();
  cluster::MembershipOptions options;
  ORBITKV_ASSIGN_OR_RETURN(options.etcd_endpoints,
                           cluster::SplitFlagList("--etcd-endpoints", config_.etcd_endpoints));
  options.cluster_name = config_.cluster_name;
  options.node_id = config_.node_id;
  options.membership_ttl_secs = config_.membership_ttl_secs;
  if (!config_.catalog_nodes.empty()) {
    ORBITKV_ASSIGN_OR_RETURN(options.catalog_nodes,
                             cluster::SplitFlagList("--catalog-nodes", config_.catalog_nodes));
  }
  options.peer_endpoint = config_.peer_endpoint;
  ORBITKV_ASSIGN_OR_RETURN(membership_, cluster::Membership::Create(std::move(options), &metrics_));
  Status joined = membership_->Join(Deadline::After(std::chrono::seconds(30)));
  if (!joined.ok()) {
    membership_.reset();
    return joined.WithContext("joining the cluster");
  }
  ORBITKV_LOG_INFO("manager: joined cluster '{}' as node {}", config_.cluster_name,
                   config_.node_id);
#endif
  return Status::Ok();
}

void Manager::UpdateMembershipGauges() {
#if ORBITKV_SERVER_HAS_CLUSTER
  if (membership_) {
    remote_work_enabled_->Set(membership_->CanDoRemoteWork() ? 1 : 0);
    return;
  }
#endif
  remote_work_enabled_->Set(0);
}

std::string Manager::MembershipJson() const {
#if ORBITKV_SERVER_HAS_CLUSTER
  if (membership_) {
    const cluster::MembershipStatus status = membership_->GetStatus();
    return fmt::format(
        ", \"membership\": \"{}\", \"membership_epoch\": {}, \"remote_work\": {}, "
        "\"view_revision\": {}, "
        "\"members\": {}",
        cluster::MembershipStateName(status.state), status.self.epoch,
        status.remote_work_allowed ? 1 : 0, status.view.revision, status.view.members.size());
  }
#endif
  return ", \"membership\": \"single-host\"";
}

Result<std::shared_ptr<Manager::Instance>> Manager::InstanceFor(const Session& session,
                                                                uint64_t instance_id) {
  MutexLock lock(&instances_mu_);
  auto it = instances_.find(instance_id);
  if (it == instances_.end()) {
    return Status::NotFound(fmt::format("instance {} is not registered", instance_id));
  }
  if (it->second->owner_session != session.owner_id) {
    return Status::PermissionDenied(
        fmt::format("instance {} belongs to another session", instance_id));
  }
  return it->second;
}

}  // namespace orbitkv::server
