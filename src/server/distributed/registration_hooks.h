// What the membership's supervisor calls when a registration lapses and when one is made again: set once the
// Manager's distributed parts exist, cleared before they stop. The hooks run under `mu`, so clearing waits for one
// that runs, and none runs afterwards.
//
// Thread safety: Set, Clear, Lapsed and Registered are safe from any thread.
#ifndef ORBITKV_SERVER_DISTRIBUTED_REGISTRATION_HOOKS_H_
#define ORBITKV_SERVER_DISTRIBUTED_REGISTRATION_HOOKS_H_

#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "base/mutex.h"
#include "base/thread_annotations.h"
#include "cluster/member_record.h"

namespace orbitkv::server {

class RegistrationHooks {
 public:
  using LapsedHook = std::function<void(const std::string& cause)>;
  using RegisteredHook = std::function<void(const cluster::MemberRecord& self)>;

  void Set(LapsedHook lapsed, RegisteredHook registered) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    lapsed_ = std::move(lapsed);
    registered_ = std::move(registered);
  }
  void Clear() EXCLUDES(mu_) { Set(nullptr, nullptr); }
  // Run the hook if one is set (no-op otherwise).
  void Lapsed(const std::string& cause) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    if (lapsed_) lapsed_(cause);
  }
  void Registered(const cluster::MemberRecord& self) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    if (registered_) registered_(self);
  }

  // Clears the hooks when it goes (declared last among the parts, so it goes first).
  class ClearOnExit {
   public:
    explicit ClearOnExit(std::shared_ptr<RegistrationHooks> hooks) : hooks_(std::move(hooks)) {}
    ClearOnExit(const ClearOnExit&) = delete;
    ClearOnExit& operator=(const ClearOnExit&) = delete;
    ~ClearOnExit() {
      if (hooks_) hooks_->Clear();
    }

   private:
    std::shared_ptr<RegistrationHooks> hooks_;
  };

 private:
  Mutex mu_;
  LapsedHook lapsed_ GUARDED_BY(mu_);
  RegisteredHook registered_ GUARDED_BY(mu_);
};

}  // namespace orbitkv::server

#endif  // ORBITKV_SERVER_DISTRIBUTED_REGISTRATION_HOOKS_H_
