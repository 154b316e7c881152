// Manager: the Cache Manager daemon's body, everything but flag parsing and signal handling.
//
// It owns the cache core (pinned pool, block table, leases, budgets), the copy engines, the
// engine-facing listener and every session, and the metrics endpoint. Copy engines: the CPU one for
// shared-memory and process-memory buffers, always; the CUDA one for engines' GPU buffers (CUDA
// IPC), when the build has the gpu module and a GPU is usable at start. Only then is the pool
// registered with CUDA (mapped, so the copy kernels read and write it in place); a Manager without
// a GPU refuses CUDA groups with a clear error and otherwise serves as usual. Threads are created
// in one place, Start():
//   - the dispatcher: one epoll loop over the listener, each session's socket and request doorbell;
//   it decodes
//     and validates requests, answers queries and releases inline, and submits restores and saves
//     to the copy engine;
//   - the copy engines' workers (CPU threads; per GPU and direction a dispatcher and a completer),
//     which complete restores and saves and post their replies;
//   - the cleanup worker, which drains an instance's in-flight copies before unmapping its buffers;
//   - the metrics HTTP server, when --metrics-addr is set.
// A malformed request poisons only its session; a closed session (engine exit or kill -9) releases
// its instances' leases, reservations and mappings with no further message.
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
#include <unordered_map>
#include <vector>

#include "base/clock.h"
#include "base/metrics.h"
#include "base/mutex.h"
#include "base/result.h"
#include "base/scoped_fd.h"
#include "base/thread_annotations.h"
#include "channel/session.h"
#include "channel/wire.h"
#include "core/block_cache.h"
#include "core/cpu_copy_engine.h"
#include "core/ssd_tier.h"
#include "server/config.h"
#include "server/metrics_http.h"
#include "state/namespace.h"

#if ORBITKV_SERVER_HAS_CLUSTER
#include "cluster/membership.h"
#endif

#if ORBITKV_SERVER_HAS_GPU
namespace orbitkv::gpu {
class CudaCopyEngine;
class HostMemoryRegistry;
}  // namespace orbitkv::gpu
#endif

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
  core::BlockCache& cache() { return *cache_; }
  // The metrics endpoint's bound port (0 when off).
  uint16_t metrics_port() const;
  // Whether engines may register GPU buffers (CUDA IPC): the gpu module is built and a GPU was
  // usable at Create.
  bool gpu_enabled() const;

  // Per-session, per-instance and per-group state; defined in manager_internal.h for the Manager's
  // own files.
  struct Group;
  struct Instance;
  struct Session;

 private:
  explicit Manager(const ManagerConfig& config);

  // When the build has the gpu module and a GPU is usable, creates host_memory_ and makes it the
  // pool's registrar; otherwise leaves the Manager CPU-only (and says so in the log).
  void SetUpGpu(core::BlockCacheOptions* options);
  // On a graceful stop: writes the DRAM-only blocks to SSD (--ssd-persist-on-exit), with progress
  // lines.
  void PersistDramForRestart();

  void DispatchLoop();
  void AcceptSessions();
  // Serves up to 64 queued requests of `session`; returns how many.
  int ServeSession(const std::shared_ptr<Session>& session);
  void CloseSession(uint64_t session_id, const Status& why);
  Status HandleFrame(Session& session, channel::Frame& frame);
  Status RegisterInstance(Session& session, const channel::Frame& frame);
  Result<uint64_t> RegisterGroup(Session& session, channel::Frame& frame);
  // RegisterGroup's per-buffer steps (lifecycle.cc): each registers buffer `index` of `group` with
  // the group's copy engine and appends it to group->buffers, or returns why not.
  Status AddSharedMemoryBuffer(Group* group, uint32_t index,
                               const channel::BufferDescriptor& layout, int fd);
  Status AddProcessBuffer(Group* group, uint32_t index, const channel::BufferDescriptor& layout,
                          pid_t engine_pid, uint64_t address);
  Status AddCudaIpcBuffer(Group* group, uint32_t index, const channel::BufferDescriptor& layout,
                          const channel::CudaIpcBuffer& cuda);
  // Unregisters one of `group`'s buffers from the engine it was registered with; waits for its
  // in-flight copies (never on the dispatcher).
  Status UnregisterGroupBuffer(const Group& group, core::BufferId id);
  Status UnregisterInstance(Session& session, uint64_t instance_id);
  void RetireInstance(const std::shared_ptr<Instance>& instance);
  Result<std::shared_ptr<Instance>> InstanceFor(const Session& session, uint64_t instance_id);

  // Hot operations (operations.cc). A returned error poisons the session; per-request failures are
  // replies.
  Status HandleRequest(const std::shared_ptr<Session>& session, channel::InboundRequest& request);
  Status HandleQuery(Session& session, const channel::InboundRequest& request);
  Status HandleRestore(const std::shared_ptr<Session>& session,
                       const channel::InboundRequest& request);
  Status HandleSave(const std::shared_ptr<Session>& session,
                    const channel::InboundRequest& request);
  Status HandleRelease(Session& session, const channel::InboundRequest& request);
  Status HandleStats(Session& session, const channel::InboundRequest& request);
  Status HandleCancel(Session& session, const channel::InboundRequest& request);
  struct LoadingKey;
  // Starts (or finds) the Loading operation that brings `keys` (the chain `chain`) from SSD into
  // DRAM; returns its id. ResourceExhausted when the session has --max-loading operations
  // outstanding.
  Result<uint64_t> StartLoading(const Session& session, const LoadingKey& chain,
                                std::vector<state::StateKey> keys);
  // Forgets every Loading operation of `instance` (its reads still drain).
  void DropLoadingOf(uint64_t instance);
  bool TryBeginOperation();
  void EndOperation();

  Status StartMembership();
  void UpdateMembershipGauges();
  std::string MembershipJson() const;
  std::string SsdJson() const;
  void CleanupLoop();
  void PostCleanup(std::function<void()> task);

  // Immutable after Create.
  const ManagerConfig config_;
  MetricsRegistry metrics_;
#if ORBITKV_SERVER_HAS_GPU
  // Set in Create when a GPU is usable: the pool's arenas are registered through it. Declared
  // before cache_ so that it is destroyed after the pool (and after cuda_engine_, reset in the
  // destructor), as its contract asks.
  std::unique_ptr<gpu::HostMemoryRegistry> host_memory_;
#endif
  std::unique_ptr<core::BlockCache> cache_;
  ScopedFd listener_;
  ScopedFd wake_;  // eventfd: RequestStop rings it
  ScopedFd epoll_;
  uint64_t incarnation_ = 0;

  // The SSD tier (--ssd-path), created with the cache: its scan finds the blocks of the last run.
  std::unique_ptr<core::SsdTier> ssd_;

  // Created by Start.
  std::unique_ptr<core::CpuCopyEngine> copy_engine_;
#if ORBITKV_SERVER_HAS_GPU
  // Created by Start when host_memory_ is set; shut down (drained) in Wait, destroyed (IPC mappings
  // closed) in the destructor before the pool.
  std::unique_ptr<gpu::CudaCopyEngine> cuda_engine_;
#endif
  std::unique_ptr<MetricsHttpServer> http_;
#if ORBITKV_SERVER_HAS_CLUSTER
  // Distributed mode only (--etcd-endpoints). Its own keepalive and view threads start in Join,
  // called from Start; cache operations read it without any etcd call.
  std::unique_ptr<cluster::Membership> membership_;
#endif
  Gauge* remote_work_enabled_ = nullptr;
  std::thread dispatcher_;
  std::thread cleaner_;
  bool started_ = false;
  bool waited_ = false;

  // Dispatcher thread only.
  std::map<uint64_t, std::shared_ptr<Session>> sessions_;
  uint64_t next_session_id_ = 1;

  // Instances are looked up by the dispatcher and pinned (shared_ptr) by in-flight copies.
  mutable Mutex instances_mu_;
  std::unordered_map<uint64_t, std::shared_ptr<Instance>> instances_ GUARDED_BY(instances_mu_);

  // Relaxed: an admission counter, exactness under races is not needed beyond never going negative.
  std::atomic<uint32_t> operations_{0};
  // Release/acquire: RequestStop's store is seen by the dispatcher after its wakeup.
  std::atomic<bool> stopping_{false};

  // Loading operations: a query whose prefix continues on SSD starts one, and the engine asks again
  // (same instance, group and chain) until the blocks are in DRAM; cancel or cleanup forgets it.
  // Each is bound to the control session that started it, its instance, group and chain. A
  // completed op holds pins on the blocks it loaded until the engine's next query of the chain
  // leases them (so other loads and saves cannot evict them first), a cancel or cleanup, or
  // --loading-hold seconds without that query.
  struct LoadingOp {
    uint64_t session = 0;
    uint64_t instance = 0;
    uint32_t group = 0;
    uint64_t chain = 0;  // the chain's identity: hash of its last key and length
    bool completed = false;
    MonoTime completed_at;
    std::vector<core::BlockPin> held;  // the loaded prefix, once completed
  };
  struct LoadingKey {
    uint64_t instance;
    uint32_t group;
    uint64_t chain;
    friend auto operator<=>(const LoadingKey&, const LoadingKey&) = default;
  };
  Mutex loading_mu_;
  using LoadingMap = std::unordered_map<uint64_t, LoadingOp>;
  // Removes the op and its index, session count and gauges; its held pins move to `released`, to be
  // let go outside the lock. Returns the next entry.
  LoadingMap::iterator ForgetLoadingLocked(LoadingMap::iterator it,
                                           std::vector<core::BlockPin>* released)
      REQUIRES(loading_mu_);
  // Whether the chain has a completed op (its loaded blocks held).
  bool LoadCompletedLocked(const LoadingKey& chain) REQUIRES(loading_mu_);
  // Forgets the chain's op, running or completed, handing its pins to `released`.
  void ForgetChainLocked(const LoadingKey& chain, std::vector<core::BlockPin>* released)
      REQUIRES(loading_mu_);
  // At most once a second (from queries and the cleaner thread): forgets the completed ops nobody
  // asked for within --loading-hold.
  void SweepHeldLocked(std::vector<core::BlockPin>* released) REQUIRES(loading_mu_);
  MonoTime last_hold_sweep_ GUARDED_BY(loading_mu_);
  LoadingMap loading_ GUARDED_BY(loading_mu_);
  std::map<LoadingKey, uint64_t> loading_index_ GUARDED_BY(loading_mu_);
  std::unordered_map<uint64_t, uint32_t> loading_per_session_ GUARDED_BY(loading_mu_);
  uint64_t next_loading_id_ GUARDED_BY(loading_mu_) = 1;

  Mutex cleanup_mu_;
  std::condition_variable_any cleanup_cv_;
  std::deque<std::function<void()>> cleanup_tasks_ GUARDED_BY(cleanup_mu_);
  bool cleanup_stop_ GUARDED_BY(cleanup_mu_) = false;

  Counter* sessions_opened_ = nullptr;
  Counter* sessions_poisoned_ = nullptr;
  Gauge* sessions_active_ = nullptr;
  Gauge* instances_active_ = nullptr;
  Gauge* operations_active_ = nullptr;
  Counter* requests_total_ = nullptr;
  Counter* operation_rejections_ = nullptr;
  Counter* restored_bytes_ = nullptr;
  Counter* saved_bytes_ = nullptr;
  Counter* save_skipped_ = nullptr;
  Histogram* query_latency_ = nullptr;
  Counter* loading_started_ = nullptr;
  Gauge* loading_active_ = nullptr;
  Gauge* loading_held_ = nullptr;
};

}  // namespace orbitkv::server

#endif  // ORBITKV_SERVER_MANAGER_H_
