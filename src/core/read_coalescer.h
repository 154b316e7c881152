// ReadCoalescer: shares one backing read (SSD, peer) among every request that needs the same key at
// once.
//
// The first request to Join() a key becomes the leader and starts the read; later requests for the
// same key attach a waiter instead of issuing their own. Each request keeps its own ticket (budget
// reservation, lease, cancellation): the coalescer shares only the read. Complete() ends the read
// and calls every waiter, the leader's included, exactly once with the read's status, with no lock
// held. A waiter that is no longer interested (its request was cancelled) simply ignores the call:
// the read still drains for the others.
//
// Thread safety: all methods are safe from any thread.
#ifndef ORBITKV_CORE_READ_COALESCER_H_
#define ORBITKV_CORE_READ_COALESCER_H_

#include <cstddef>
#include <functional>
#include <unordered_map>
#include <vector>

#include "base/metrics.h"
#include "base/mutex.h"
#include "base/status.h"
#include "base/thread_annotations.h"
#include "state/state_key.h"

namespace orbitkv::core {

class ReadCoalescer {
 public:
  using Waiter = std::function<void(const Status&)>;

  explicit ReadCoalescer(MetricsRegistry* metrics);
  // Every started read must have completed (CHECK): waiters would otherwise never be called.
  ~ReadCoalescer();
  ReadCoalescer(const ReadCoalescer&) = delete;
  ReadCoalescer& operator=(const ReadCoalescer&) = delete;

  // Registers `waiter` for `key`. Returns true when the caller is the leader and must start the
  // read (and later call Complete); false when a read is already in flight and the waiter will be
  // called when it completes.
  bool Join(const state::StateKey& key, Waiter waiter);

  // Ends the read of `key`: calls every waiter with `status`, outside the lock. CHECK: a read is in
  // flight.
  void Complete(const state::StateKey& key, const Status& status);

  size_t in_flight() const;

 private:
  // Immutable after construction.
  Counter* shared_total_ = nullptr;

  mutable Mutex mu_;
  std::unordered_map<state::StateKey, std::vector<Waiter>, state::StateKeyHash> reads_ GUARDED_BY(mu_);
};

}  // namespace orbitkv::core

#endif  // ORBITKV_CORE_READ_COALESCER_H_
