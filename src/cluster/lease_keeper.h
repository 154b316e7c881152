// RegistrationClock and LeaseKeeper: how long a Manager may act as a registered member, and the
// thread that keeps extending it.
//
// A registration is valid until half the TTL etcd acknowledged, measured from when the request that
// earned the acknowledgement was *sent* (not received): a slow reply never stretches validity
// beyond what the lease itself guarantees, even if the reply was delayed by up to half the TTL.
// Validity only grows while the registration is live; once it lapses or is ended (fenced, lease
// lost, shutdown) it never comes back, so a delayed acknowledgement cannot revive an expired or
// fenced runtime. A new registration gets a new clock and a new keeper (Membership's supervisor).
//
// LeaseKeeper renews the lease on its own LeaseKeepAlive stream every TTL/6, reopening the stream
// (on the next endpoint) whenever it breaks, and reports the end of the registration once through
// on_lost.
//
// Thread safety: RegistrationClock::Valid() is lock-free and safe from any thread (the
// cache-operation path reads it); OnAck() is called by the keeper thread only; End() from any
// thread. LeaseKeeper::Run() on one thread, Stop() from any thread.
#ifndef ORBITKV_CLUSTER_LEASE_KEEPER_H_
#define ORBITKV_CLUSTER_LEASE_KEEPER_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <string>

#include "base/clock.h"
#include "base/metrics.h"
#include "base/mutex.h"
#include "base/thread_annotations.h"

namespace grpc {
class Status;
}  // namespace grpc

namespace orbitkv::cluster {

class EtcdClient;

class RegistrationClock {
 public:
  explicit RegistrationClock(MonoTime valid_until);

  bool Valid(MonoTime now) const {
    // Acquire pairs with End()'s release: once ended is seen, no later extension matters.
    return !ended_.load(std::memory_order_acquire) && ToNanos(now) < valid_until_ns_.load(std::memory_order_relaxed);
  }
  // Extends validity to send_time + ttl/2 when the registration is still valid at `now`. Returns
  // false, ending the registration for good, when it had already lapsed or ended: the
  // acknowledgement came too late.
  bool OnAck(MonoTime send_time, std::chrono::seconds ttl, MonoTime now);
  // Ends the registration for good. Returns false when it had already ended.
  bool End();
  bool ended() const { return ended_.load(std::memory_order_acquire); }
  MonoTime valid_until() const;

 private:
  static int64_t ToNanos(MonoTime t) {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
  }
  // Relaxed: written only by the keeper thread, and validity never depends on the order of two
  // readings of it.
  std::atomic<int64_t> valid_until_ns_;
  std::atomic<bool> ended_{false};
};

class LeaseKeeper {
 public:
  struct Options {
    int64_t lease_id = 0;
    // The TTL etcd acknowledged at grant time, in seconds.
    int64_t ttl_secs = 0;
    // etcd cluster ID seen at registration; a reply from another cluster ends the registration.
    uint64_t etcd_cluster_id = 0;
    // Called once on the keeper thread when the registration ends for a reason other than Stop().
    std::function<void(const std::string& reason)> on_lost;
    MetricsRegistry* metrics = nullptr;
  };

  LeaseKeeper(EtcdClient* client, RegistrationClock* clock, Options options);
  LeaseKeeper(const LeaseKeeper&) = delete;
  LeaseKeeper& operator=(const LeaseKeeper&) = delete;

  void Run();
  void Stop();

 private:
  enum class StreamEnd { kBroken, kDone };
  // One stream on `endpoint`; when it broke, how it ended and the token it sent.
  StreamEnd RunStream(size_t endpoint, grpc::Status* ended_with, std::string* token_sent);
  void Lost(const std::string& reason);
  bool WaitUntil(MonoTime until);
  bool stopping() const;

  // Immutable after construction.
  EtcdClient* const client_;
  RegistrationClock* const clock_;
  const Options options_;
  Counter* acks_;
  Counter* stream_restarts_;

  // Owned by the Run() thread.
  std::chrono::milliseconds renew_interval_;

  mutable Mutex mu_;
  std::condition_variable_any wake_;
  // Guarded by mu_.
  bool stopping_ GUARDED_BY(mu_) = false;
  std::function<void()> cancel_active_ GUARDED_BY(mu_);
};

}  // namespace orbitkv::cluster

#endif  // ORBITKV_CLUSTER_LEASE_KEEPER_H_
