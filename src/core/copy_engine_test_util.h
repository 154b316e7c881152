// Test-only helpers shared by the copy engines' tests (the CPU engine's, and the CUDA engine's GPU
// unit tests); never included by library code.
#ifndef ORBITKV_CORE_COPY_ENGINE_TEST_UTIL_H_
#define ORBITKV_CORE_COPY_ENGINE_TEST_UTIL_H_

#include <condition_variable>
#include <thread>

#include "base/mutex.h"
#include "base/status.h"
#include "core/copy_engine.h"

namespace orbitkv::core::testing {

// Records the calls of one batch's CopyDone. Must outlive the engine's threads (tests shut the
// engine down, or wait for the call, before a probe goes out of scope).
class DoneProbe {
 public:
  CopyDone Callback() {
    return [this](Status status) {
      MutexLock lock(&mu_);
      ++calls_;
      status_ = std::move(status);
      thread_ = std::this_thread::get_id();
      cv_.notify_all();
    };
  }

  Status Wait() {
    MutexLock lock(&mu_);
    while (calls_ == 0) cv_.wait(mu_);
    return status_;
  }

  int calls() {
    MutexLock lock(&mu_);
    return calls_;
  }

  std::thread::id thread() {
    MutexLock lock(&mu_);
    return thread_;
  }

 private:
  Mutex mu_;
  std::condition_variable_any cv_;
  int calls_ GUARDED_BY(mu_) = 0;
  Status status_ GUARDED_BY(mu_);
  std::thread::id thread_ GUARDED_BY(mu_);
};

}  // namespace orbitkv::core::testing

#endif  // ORBITKV_CORE_COPY_ENGINE_TEST_UTIL_H_
