// The membership supervisor's decisions (membership.h), as one phase and a transition function with no threads,
// locks, clocks or etcd: the supervisor thread waits, calls etcd and runs the hooks, and steps this machine with
// what it saw.
//
//   kWatching    --ended-->             kEnding       a registration lapsed or was fenced: end its incarnation
//   kEnding      --end handled-->       kRegistering  after a lapse, when registering again is on
//                                       kIdle         after a fence, or with registering again off
//   kRegistering --attempt succeeded--> kWatching
//                --attempt failed-->    kRegistering  etcd's own errors and anything transient (backoff, again)
//                                       kIdle         this Membership's verdict (JudgeAttempt): fenced for good
//   any          --shutdown-->          kStopped
// kIdle waits for the shutdown only: nothing makes a fenced Membership register again.
//
// Thread safety: pure functions.
#ifndef ORBITKV_CLUSTER_SUPERVISOR_STEP_H_
#define ORBITKV_CLUSTER_SUPERVISOR_STEP_H_

#include <cstdint>
#include <string_view>

#include "base/status.h"

namespace orbitkv::cluster {

enum class SupervisorPhase : uint8_t { kWatching, kEnding, kRegistering, kIdle, kStopped };

enum class SupervisorEvent : uint8_t {
  kEnded,             // the registration left kRegistered (lapsed or fenced)
  kEndHandled,        // its incarnation's threads stopped and the hooks ran
  kAttemptSucceeded,  // a registration made again
  kAttemptFailed,     // a registration attempt failed (judged by JudgeAttempt)
  kShutdown,
};

// What a failed registration attempt means.
enum class AttemptVerdict : uint8_t {
  kRetry,  // etcd's own errors (StatusReason::kEtcd), whatever their code, and anything transient
  kFence,  // this Membership's verdicts: another runtime holds the Node ID (ALREADY_EXISTS), the placement
           // regressed or the etcd cluster changed (FAILED_PRECONDITION)
};

inline AttemptVerdict JudgeAttempt(const Status& status) {
  if (status.reason() == StatusReason::kEtcd) return AttemptVerdict::kRetry;
  return status.code() == StatusCode::kAlreadyExists || status.code() == StatusCode::kFailedPrecondition
             ? AttemptVerdict::kFence
             : AttemptVerdict::kRetry;
}

struct SupervisorInput {
  SupervisorEvent event;
  bool lapsed = false;     // kEndHandled: the registration lapsed (kExpired), rather than being fenced
  bool reregister = true;  // kEndHandled: registering again after a lapse is on
  AttemptVerdict verdict = AttemptVerdict::kRetry;  // kAttemptFailed
};

constexpr SupervisorPhase Step(SupervisorPhase phase, const SupervisorInput& input) {
  if (input.event == SupervisorEvent::kShutdown) return SupervisorPhase::kStopped;
  switch (phase) {
    case SupervisorPhase::kWatching:
      if (input.event == SupervisorEvent::kEnded) return SupervisorPhase::kEnding;
      break;
    case SupervisorPhase::kEnding:
      if (input.event == SupervisorEvent::kEndHandled) {
        return input.lapsed && input.reregister ? SupervisorPhase::kRegistering : SupervisorPhase::kIdle;
      }
      break;
    case SupervisorPhase::kRegistering:
      if (input.event == SupervisorEvent::kAttemptSucceeded) return SupervisorPhase::kWatching;
      if (input.event == SupervisorEvent::kAttemptFailed) {
        return input.verdict == AttemptVerdict::kFence ? SupervisorPhase::kIdle : SupervisorPhase::kRegistering;
      }
      break;
    case SupervisorPhase::kIdle:
    case SupervisorPhase::kStopped:
      break;
  }
  return phase;
}

constexpr std::string_view SupervisorPhaseName(SupervisorPhase phase) {
  switch (phase) {
    case SupervisorPhase::kWatching:
      return "watching";
    case SupervisorPhase::kEnding:
      return "ending";
    case SupervisorPhase::kRegistering:
      return "registering";
    case SupervisorPhase::kIdle:
      return "idle";
    case SupervisorPhase::kStopped:
      return "stopped";
  }
  return "unknown";
}

}  // namespace orbitkv::cluster

#endif  // ORBITKV_CLUSTER_SUPERVISOR_STEP_H_
