// The hold lifecycle alone: every (phase, event) pair against the table in hold_lifecycle.h.
#include "catalog/hold_lifecycle.h"

#include <gtest/gtest.h>

#include <vector>

namespace orbitkv::catalog {
namespace {

const std::vector<HoldPhase> kPhases = {HoldPhase::kPreparing, HoldPhase::kGranted, HoldPhase::kReleasing,
                                        HoldPhase::kQuarantined, HoldPhase::kPeerRevoked};

TEST(HoldLifecycleTest, APreparationEndsGrantedOnlyWhilePreparing) {
  EXPECT_EQ(Step(HoldPhase::kPreparing, HoldEvent::kPrepared).next, HoldPhase::kGranted);
  EXPECT_FALSE(Step(HoldPhase::kPreparing, HoldEvent::kPrepared).starts_revocation);
  for (HoldPhase phase : kPhases) {
    if (phase == HoldPhase::kPreparing) continue;
    const HoldStep step = Step(phase, HoldEvent::kPrepared);
    EXPECT_FALSE(step.changed) << HoldPhaseName(phase);  // given up while it was read: stays given up
    EXPECT_EQ(step.next, phase);
  }
}

TEST(HoldLifecycleTest, TheFirstReleaseOrRevocationRevokesAndLaterOnesDoNothing) {
  for (HoldPhase live : {HoldPhase::kPreparing, HoldPhase::kGranted}) {
    const HoldStep release = Step(live, HoldEvent::kRelease);
    EXPECT_EQ(release.next, HoldPhase::kReleasing);
    EXPECT_TRUE(release.starts_revocation);
    EXPECT_FALSE(IsQuarantined(release.next));  // a release is no quarantine
    const HoldStep revoke = Step(live, HoldEvent::kRevoke);
    EXPECT_EQ(revoke.next, HoldPhase::kQuarantined);
    EXPECT_TRUE(revoke.starts_revocation);
    EXPECT_TRUE(IsQuarantined(revoke.next));
  }
  for (HoldPhase revoking : {HoldPhase::kReleasing, HoldPhase::kQuarantined, HoldPhase::kPeerRevoked}) {
    EXPECT_TRUE(IsRevoking(revoking));
    for (HoldEvent event : {HoldEvent::kRelease, HoldEvent::kRevoke}) {
      const HoldStep step = Step(revoking, event);
      EXPECT_FALSE(step.changed) << HoldPhaseName(revoking);
      EXPECT_FALSE(step.starts_revocation) << HoldPhaseName(revoking);  // a duplicate: drained by the first
    }
  }
}

TEST(HoldLifecycleTest, AVanishedRequesterQuarantinesEveryHoldOnceAndRevokesOnlyTheLiveOnes) {
  for (HoldPhase phase : kPhases) {
    const HoldStep step = Step(phase, HoldEvent::kRequesterVanished);
    if (phase == HoldPhase::kPeerRevoked) {
      EXPECT_FALSE(step.changed);
      continue;
    }
    EXPECT_EQ(step.next, HoldPhase::kPeerRevoked) << HoldPhaseName(phase);
    EXPECT_TRUE(IsQuarantined(step.next));
    // A hold being revoked already is freed by its own revocation; the others by the transport's.
    EXPECT_EQ(step.starts_revocation, !IsRevoking(phase)) << HoldPhaseName(phase);
  }
}

TEST(HoldLifecycleTest, OnlyTheLivePhasesAreNotRevoking) {
  for (HoldPhase phase : kPhases) {
    const bool live = phase == HoldPhase::kPreparing || phase == HoldPhase::kGranted;
    EXPECT_EQ(IsRevoking(phase), !live) << HoldPhaseName(phase);
    EXPECT_NE(HoldPhaseName(phase), "unknown");
  }
}

}  // namespace
}  // namespace orbitkv::catalog
