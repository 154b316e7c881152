// The membership supervisor's machine alone: the table in supervisor_step.h, and the final-or-retry verdict from the
// status's code and reason (never its message).
#include "cluster/supervisor_step.h"

#include <gtest/gtest.h>

namespace orbitkv::cluster {
namespace {

constexpr SupervisorPhase kAll[] = {SupervisorPhase::kWatching, SupervisorPhase::kEnding, SupervisorPhase::kRegistering,
                                    SupervisorPhase::kIdle, SupervisorPhase::kStopped};

TEST(SupervisorStepTest, ALapseIsEndedThenRegisteredAgainUntilAnAttemptSucceeds) {
  SupervisorPhase phase = SupervisorPhase::kWatching;
  phase = Step(phase, {.event = SupervisorEvent::kEnded});
  EXPECT_EQ(phase, SupervisorPhase::kEnding);
  phase = Step(phase, {.event = SupervisorEvent::kEndHandled, .lapsed = true, .reregister = true});
  EXPECT_EQ(phase, SupervisorPhase::kRegistering);
  for (int i = 0; i < 3; ++i) {
    phase = Step(phase, {.event = SupervisorEvent::kAttemptFailed, .verdict = AttemptVerdict::kRetry});
    EXPECT_EQ(phase, SupervisorPhase::kRegistering);
  }
  phase = Step(phase, {.event = SupervisorEvent::kAttemptSucceeded});
  EXPECT_EQ(phase, SupervisorPhase::kWatching);
}

TEST(SupervisorStepTest, AFenceOrRegisteringAgainOffEndsInIdleForGood) {
  EXPECT_EQ(Step(SupervisorPhase::kEnding, {.event = SupervisorEvent::kEndHandled, .lapsed = false}),
            SupervisorPhase::kIdle);  // fenced
  EXPECT_EQ(
      Step(SupervisorPhase::kEnding, {.event = SupervisorEvent::kEndHandled, .lapsed = true, .reregister = false}),
      SupervisorPhase::kIdle);
  EXPECT_EQ(Step(SupervisorPhase::kRegistering,
                 {.event = SupervisorEvent::kAttemptFailed, .verdict = AttemptVerdict::kFence}),
            SupervisorPhase::kIdle);
  for (SupervisorEvent event : {SupervisorEvent::kEnded, SupervisorEvent::kEndHandled,
                                SupervisorEvent::kAttemptSucceeded, SupervisorEvent::kAttemptFailed}) {
    EXPECT_EQ(Step(SupervisorPhase::kIdle, {.event = event, .lapsed = true}), SupervisorPhase::kIdle);
  }
}

TEST(SupervisorStepTest, ShutdownStopsFromEveryPhaseAndNothingLeavesStopped) {
  for (SupervisorPhase phase : kAll) {
    EXPECT_EQ(Step(phase, {.event = SupervisorEvent::kShutdown}), SupervisorPhase::kStopped)
        << SupervisorPhaseName(phase);
    EXPECT_NE(SupervisorPhaseName(phase), "unknown");
  }
  for (SupervisorEvent event : {SupervisorEvent::kEnded, SupervisorEvent::kEndHandled,
                                SupervisorEvent::kAttemptSucceeded, SupervisorEvent::kAttemptFailed}) {
    EXPECT_EQ(Step(SupervisorPhase::kStopped, {.event = event, .lapsed = true}), SupervisorPhase::kStopped);
  }
}

TEST(SupervisorStepTest, EventsOutOfTurnChangeNothing) {
  EXPECT_EQ(Step(SupervisorPhase::kWatching, {.event = SupervisorEvent::kAttemptSucceeded}),
            SupervisorPhase::kWatching);
  EXPECT_EQ(Step(SupervisorPhase::kWatching, {.event = SupervisorEvent::kEndHandled, .lapsed = true}),
            SupervisorPhase::kWatching);
  EXPECT_EQ(Step(SupervisorPhase::kEnding, {.event = SupervisorEvent::kAttemptFailed}), SupervisorPhase::kEnding);
  EXPECT_EQ(Step(SupervisorPhase::kRegistering, {.event = SupervisorEvent::kEnded}), SupervisorPhase::kRegistering);
}

TEST(SupervisorStepTest, EtcdsOwnErrorsAreRetriedWhateverTheirCodeAndTheMessageDecidesNothing) {
  // etcd answers FAILED_PRECONDITION ("not leader", "not capable") right after a restart: retried.
  EXPECT_EQ(JudgeAttempt(Status::FailedPrecondition("not leader").WithReason(StatusReason::kEtcd)),
            AttemptVerdict::kRetry);
  EXPECT_EQ(JudgeAttempt(Status::AlreadyExists("x").WithReason(StatusReason::kEtcd)), AttemptVerdict::kRetry);
  // This Membership's verdicts fence, even when their text starts with "etcd ".
  EXPECT_EQ(JudgeAttempt(Status::AlreadyExists("node n0 is held by another runtime")), AttemptVerdict::kFence);
  EXPECT_EQ(JudgeAttempt(Status::FailedPrecondition("etcd cluster ID changed from 1 to 2")), AttemptVerdict::kFence);
  // And a message that only looks like etcd's is not etcd's.
  EXPECT_EQ(JudgeAttempt(Status::FailedPrecondition("etcd Txn at a:1: placement regressed")), AttemptVerdict::kFence);
  for (StatusCode transient : {StatusCode::kUnavailable, StatusCode::kDeadlineExceeded, StatusCode::kCancelled,
                               StatusCode::kAborted, StatusCode::kDataLoss}) {
    EXPECT_EQ(JudgeAttempt(Status(transient, "x")), AttemptVerdict::kRetry) << transient;
  }
}

}  // namespace
}  // namespace orbitkv::cluster
