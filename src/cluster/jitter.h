// Jitter for the cluster module's retries: a fleet that lost etcd together must not come back in step.
//
// Thread safety: a pure function of its arguments; the generator belongs to the caller's thread.
#ifndef ORBITKV_CLUSTER_JITTER_H_
#define ORBITKV_CLUSTER_JITTER_H_

#include <chrono>
#include <random>

namespace orbitkv::cluster {

// A pause drawn uniformly from 50-100 % of `backoff`.
inline std::chrono::milliseconds Jittered(std::chrono::milliseconds backoff, std::minstd_rand& rng) {
  std::uniform_int_distribution<int64_t> spread(backoff.count() / 2, backoff.count());
  return std::chrono::milliseconds(spread(rng));
}

}  // namespace orbitkv::cluster

#endif  // ORBITKV_CLUSTER_JITTER_H_
