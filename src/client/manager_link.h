// ManagerLink: an engine's connection to its host's Manager that outlives the Manager's restarts (the C++ twin of
// python/orbitkv/link.py, one failure policy for every engine).
//
// A CacheClient is one session: once its Manager stops, restarts or is killed, every call on it fails with
// Unavailable, and its instances, groups and leases are gone with the session. The link keeps the engine going:
//   - Client() returns the live client, or nullptr at once while the Manager is away (the engine recomputes; a
//     call never waits for a Manager that is not there).
//   - A watcher thread looks at the session every `watch_interval` without a request (CacheClient::SessionAlive):
//     a closed session takes the link down at once, not at the engine's next call. While down it connects every
//     `watch_interval` (a refused connect costs microseconds), replays the engine's registrations on the new
//     session (`on_connect`, on the watcher thread: it must be safe to run beside the engine's calls), and serves
//     it. So the control session comes first, and a save's publish session is opened on the new client only.
//   - Failed(client, status) reports a call's Unavailable: the link goes down if `client` is still the live one
//     (a failure of an older client never takes down the one that replaced it).
// A Manager that answers but refuses the replay is tried again every `refused_retry`.
//
// Thread safety: every method is safe from any thread. The destructor stops the watcher and drops the client
// (the Manager frees what its session held); it waits for a connect or a replay in progress (at most the client
// timeout each), so never destroy the link while holding a lock that on_connect takes, nor from on_connect.
// A stopped Manager (kill -STOP) is not a lost one here: its calls time out (DeadlineExceeded), the session stays.
#ifndef ORBITKV_CLIENT_MANAGER_LINK_H_
#define ORBITKV_CLIENT_MANAGER_LINK_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#include "base/mutex.h"
#include "base/result.h"
#include "base/thread_annotations.h"
#include "client/cache_client.h"

namespace orbitkv::client {

class ManagerLink {
 public:
  struct Options {
    ClientOptions client;
    std::chrono::milliseconds watch_interval{50};
    std::chrono::milliseconds refused_retry{1000};
    // Registers the engine's instances and groups on a new client; an error keeps that client from serving.
    std::function<Status(CacheClient&)> on_connect;
  };
  struct Stats {
    uint64_t connects = 0;  // sessions served (the first included)
    uint64_t losses = 0;    // sessions found closed by the watcher or reported by Failed
    uint64_t refusals = 0;  // replays the Manager refused
  };

  // Connects now if the Manager answers (an on_connect error is returned), else starts down and connects once it
  // listens.
  static Result<std::unique_ptr<ManagerLink>> Start(Options options);
  ~ManagerLink();
  ManagerLink(const ManagerLink&) = delete;
  ManagerLink& operator=(const ManagerLink&) = delete;

  std::shared_ptr<CacheClient> Client() const;
  // Reports a failed call made on `client`; true when it took the link down.
  bool Failed(const std::shared_ptr<CacheClient>& client, const Status& status);
  // Until a client serves or `timeout` passed (for tools and tests; engines call Client()).
  std::shared_ptr<CacheClient> WaitClient(std::chrono::milliseconds timeout) const;
  Stats GetStats() const;

 private:
  explicit ManagerLink(Options options) : options_(std::move(options)) {}
  void Watch();
  // One connect and replay; the new client, or why not (Unavailable: not back yet).
  Result<std::shared_ptr<CacheClient>> Connect();

  const Options options_;
  mutable Mutex mu_;
  mutable std::condition_variable_any changed_;  // client_ set, or stop_
  std::shared_ptr<CacheClient> client_ GUARDED_BY(mu_);
  bool stop_ GUARDED_BY(mu_) = false;
  Stats stats_ GUARDED_BY(mu_);
  std::thread watcher_;
};

}  // namespace orbitkv::client

#endif  // ORBITKV_CLIENT_MANAGER_LINK_H_
