// Mutex and MutexLock: std::mutex with the capability annotations clang's -Wthread-safety checks, so that
// "Guarded by mu_" members are verified at compile time (libstdc++'s std::mutex carries no annotations).
#ifndef ORBITKV_BASE_MUTEX_H_
#define ORBITKV_BASE_MUTEX_H_

#include <sched.h>

#include <mutex>

#include "base/thread_annotations.h"

namespace orbitkv {

class CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ACQUIRE() { mu_.lock(); }
  // Tries `spins` times (SpinPause between tries) before it blocks: for locks whose holders keep them for well under
  // a microsecond, where a sleeping waiter's wake-up costs ten times the wait.
  void LockSpinning(int spins) ACQUIRE();
  void Unlock() RELEASE() { mu_.unlock(); }
  // For std::condition_variable_any and friends.
  void lock() ACQUIRE() { mu_.lock(); }
  void unlock() RELEASE() { mu_.unlock(); }

 private:
  std::mutex mu_;
};

// Holds a Mutex for the lifetime of the scope.
class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ACQUIRE(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() RELEASE() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

// One iteration of a spin-wait: a pause that is polite to the sibling hyperthread and, every 256th,
// a yield (on an oversubscribed machine the thread being waited for may need this very core).
inline void SpinPause(int iteration) {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
  if ((iteration & 255) == 255) sched_yield();
}

inline void Mutex::LockSpinning(int spins) NO_THREAD_SAFETY_ANALYSIS {
  for (int i = 0; i < spins; ++i) {
    if (mu_.try_lock()) return;
    SpinPause(i);
  }
  mu_.lock();
}

// MutexLock that spins briefly before it blocks (Mutex::LockSpinning).
class SCOPED_CAPABILITY SpinningMutexLock {
 public:
  explicit SpinningMutexLock(Mutex* mu, int spins = 512) ACQUIRE(mu) : mu_(mu) { mu_->LockSpinning(spins); }
  ~SpinningMutexLock() RELEASE() { mu_->Unlock(); }
  SpinningMutexLock(const SpinningMutexLock&) = delete;
  SpinningMutexLock& operator=(const SpinningMutexLock&) = delete;

 private:
  Mutex* const mu_;
};

}  // namespace orbitkv

#endif  // ORBITKV_BASE_MUTEX_H_
