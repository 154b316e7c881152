// Manager: the Cache Manager daemon's body, everything but flag parsing and signal handling.
//
// It wires the parts (docs/server.md) and owns their threads; the cache logic is CacheService's.
// Create() builds the cache core (allocating and locking the pool), the SSD tier and the service,
// and binds the engine socket; Start() creates every thread, in one place:
//   - the dispatcher: one epoll loop over the listener, each session's socket and request doorbell.
//     It reads lifecycle frames (instance and group registration: mapping engine buffers and
//     registering them with the copy engines) and ring requests, decodes each request
//     (channel/messages), calls CacheService and encodes its result as the reply. Queries,
//     releases and cancels are answered inline; restores, saves and Loading waits reply from the
//     thread that completes them (a copy engine's worker, an SSD reader);
//   - the copy engines' workers (CopyEngines: CPU threads; per GPU and direction a dispatcher and
//     a completer);
//   - the cleaner: drains an instance's in-flight copies before unmapping its buffers, and sweeps
//     Loading deadlines and held blocks;
//   - the metrics HTTP server, when --metrics-addr is set; the cluster link's threads in
//     distributed mode.
// A malformed request poisons only its session; a closed session (engine exit or kill -9) releases
// its instances' leases, Loading operations and mappings with no further message.
//
// Thread safety: RequestStop() is safe from any thread (and from a signal handler); the rest is for
// the thread that created the Manager.
#ifndef ORBITKV_SERVER_MANAGER_H_
#define ORBITKV_SERVER_MANAGER_H_

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <thread>

#include "base/clock.h"
#include "base/metrics.h"
#include "base/mutex.h"
#include "base/result.h"
#include "base/runtime_id.h"
#include "base/scoped_fd.h"
#include "base/thread_annotations.h"
#include "channel/session.h"
#include "channel/wire.h"
#include "core/block_cache.h"
#include "core/ssd_tier.h"
#include "server/cache_service.h"
#include "server/config.h"
#include "server/copy_engines.h"
#include "server/distributed/cluster_link.h"
#include "server/engine_state.h"
#include "server/metrics_http.h"

namespace orbitkv::server {

class Manager {
 public:
  // Builds the cache (allocating and locking the pool) and binds the socket; starts no thread.
  static Result<std::unique_ptr<Manager>> Create(const ManagerConfig& config);
  // Stops (if still running) and releases everything.
  ~Manager();
  Manager(const Manager&) = delete;
  Manager& operator=(const Manager&) = delete;

  Status Start();
  // Asks the dispatcher to stop; async-signal-safe.
  void RequestStop();
  // Blocks until the dispatcher stopped, then drains copies, closes sessions and joins every
  // thread.
  void Wait();

  const ManagerConfig& config() const { return config_; }
  MetricsRegistry& metrics() { return metrics_; }
  CacheService& service() { return *service_; }
  // The metrics endpoint's bound port (0 when off).
  uint16_t metrics_port() const;
  // This run's identity: the inventory's incarnation, the membership record's runtime UUID.
  const RuntimeId& runtime_id() const { return runtime_id_; }

 private:
  // An engine's connection: its channel and the control session it acts for.
  struct Session {
    uint64_t id = 0;
    // Shared with copy completions, which reply after the dispatcher may have closed the session.
    std::shared_ptr<channel::ServerSession> channel;
    // The control session this one acts for (itself for a control session): the owner of the
    // instances it names.
    uint64_t owner_id = 0;
  };

  explicit Manager(const ManagerConfig& config);

  // On a graceful stop: writes the DRAM-only blocks to SSD (--ssd-persist-on-exit), with progress
  // lines.
  void PersistDramForRestart();

  // Dispatcher (manager.cc).
  void DispatchLoop();
  void AcceptSessions();
  Status AdmitPublishSession(const Session& session) const;
  // Serves up to 64 queued requests of `session`; returns how many.
  int ServeSession(const std::shared_ptr<Session>& session);
  void ServeFrames(const std::shared_ptr<Session>& session);
  // Why a session was poisoned: the label of orbitkv_sessions_poisoned_total.
  enum class PoisonReason { kMalformedRequest, kBadFrame, kReplyRing, kEngineMemory };
  void PoisonSession(const Session& session, const Status& why, PoisonReason reason);
  void CloseSession(uint64_t session_id, const Status& why);
  // Requests (requests.cc): decode, call the service, encode the reply. A returned error poisons
  // the session; per-request failures are error replies.
  Status HandleRequest(const std::shared_ptr<Session>& session, channel::InboundRequest& request);
  Status HandleStats(Session& session, const channel::InboundRequest& request);
  Status HandleDump(Session& session, const channel::InboundRequest& request);

  // Lifecycle frames (lifecycle.cc).
  Status HandleFrame(Session& session, channel::Frame& frame);
  Status RegisterInstance(Session& session, const channel::Frame& frame);
  Result<uint64_t> RegisterGroup(Session& session, channel::Frame& frame);
  // Registers buffer `index` of `group` with its copy engine and appends it, or returns why not.
  Status AddBuffer(KvGroup* group, uint32_t index, const channel::BufferDescriptor& layout, const channel::Frame& frame,
                   size_t trailer_offset, pid_t engine_pid);
  Status AddSharedMemoryBuffer(KvGroup* group, uint32_t index, const channel::BufferDescriptor& layout, int fd);
  Status AddProcessBuffer(KvGroup* group, uint32_t index, const channel::BufferDescriptor& layout, pid_t engine_pid,
                          uint64_t address);
  void UnregisterBuffers(KvGroup& group);
  Status UnregisterInstance(Session& session, uint64_t instance_id);
  void RetireInstance(const std::shared_ptr<EngineInstance>& instance);

  void CleanupLoop();
  void PostCleanup(std::function<void()> task);
  void RegisterMetrics();

  // Immutable after Create.
  const ManagerConfig config_;
  const RuntimeId runtime_id_ = RuntimeId::New();
  MetricsRegistry metrics_;
  // Declared before cache_: the CUDA host registry it may hold goes after the pool (its engines
  // are closed in the destructor, before the pool).
  CopyEngines engines_;
  std::unique_ptr<core::BlockCache> cache_;
  // The SSD tier (--ssd-path), created with the cache: its scan finds the blocks of the last run.
  std::unique_ptr<core::SsdTier> ssd_;
  std::unique_ptr<CacheService> service_;
  ScopedFd listener_;
  ScopedFd wake_;  // eventfd: RequestStop rings it
  ScopedFd epoll_;
  uint64_t incarnation_ = 0;

  // Created by Start.
  std::unique_ptr<MetricsHttpServer> http_;
  std::unique_ptr<ClusterLink> cluster_;  // distributed mode only (--etcd-endpoints)
  std::thread dispatcher_;
  std::thread cleaner_;
  bool started_ = false;
  bool waited_ = false;

  // Dispatcher thread only.
  std::map<uint64_t, std::shared_ptr<Session>> sessions_;
  uint64_t next_session_id_ = 1;

  // Release/acquire: RequestStop's store is seen by the dispatcher after its wakeup.
  std::atomic<bool> stopping_{false};

  // Owners whose engine memory faulted under a copy (any thread adds; the dispatcher poisons their
  // sessions).
  Mutex faulted_mu_;
  std::vector<std::pair<uint64_t, Status>> faulted_owners_ GUARDED_BY(faulted_mu_);
  void PoisonFaultedOwners();

  Mutex cleanup_mu_;
  std::condition_variable_any cleanup_cv_;
  std::deque<std::function<void()>> cleanup_tasks_ GUARDED_BY(cleanup_mu_);
  bool cleanup_stop_ GUARDED_BY(cleanup_mu_) = false;
  bool sweep_due_ GUARDED_BY(cleanup_mu_) = false;  // a Loading deadline moved earlier

  Counter* sessions_opened_ = nullptr;
  Counter* sessions_poisoned_[4] = {};  // by PoisonReason
  Gauge* sessions_active_ = nullptr;
  Gauge* instances_active_ = nullptr;
  Counter* requests_total_ = nullptr;
  Gauge* remote_work_enabled_ = nullptr;
};

}  // namespace orbitkv::server

#endif  // ORBITKV_SERVER_MANAGER_H_
