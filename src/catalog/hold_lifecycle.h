// The lifecycle of one hold at a source (source_holds.h), as one phase and a transition function with no threads,
// locks or clocks: SourceHolds keeps a phase per hold, steps it under its lock, and does what the step says (revoke
// the grant, revoke the requester's transport) outside it.
//
//   kPreparing --prepared--> kGranted                (the span is in DRAM and granted, or found missing)
//   kPreparing, kGranted --release--> kReleasing     (the requester is done: revoked, freed once drained)
//   kPreparing, kGranted --revoke--> kQuarantined    (deadline passed or registration ended: still pinned and
//                                                     charged until drained, counted apart)
//   any but kPeerRevoked --requester vanished--> kPeerRevoked
//                                                    (quarantined, and the requester's transport revoked, which
//                                                     force-closes the endpoints its sends go out on)
// A hold leaves the map only when its revocation drained. Any other (phase, event) pair changes nothing: a duplicate
// release, an expiry of a hold being released, a preparation ending after the hold was given up.
//
// Thread safety: pure functions.
#ifndef ORBITKV_CATALOG_HOLD_LIFECYCLE_H_
#define ORBITKV_CATALOG_HOLD_LIFECYCLE_H_

#include <cstdint>
#include <string_view>

namespace orbitkv::catalog {

enum class HoldPhase : uint8_t {
  kPreparing,    // its SSD blocks are being read into DRAM: no grant yet
  kGranted,      // granted (or answered missing): kept for duplicates until released, expired or its requester left
  kReleasing,    // released: its grant is revoked, freed once drained
  kQuarantined,  // revoked without a release (its deadline passed, or the registration ended)
  kPeerRevoked,  // quarantined, its requester gone and that requester's transport revoked
};

enum class HoldEvent : uint8_t {
  kPrepared,           // the preparation ended (granted or missing)
  kRelease,            // the requester released it (by request id or grant id)
  kRevoke,             // its deadline passed, or every grant is revoked (the registration ended)
  kRequesterVanished,  // the member view no longer shows its requester's start
};

struct HoldStep {
  HoldPhase next;
  // This event started the hold's revocation: the caller revokes its grant (or, for kRequesterVanished, counts on
  // the requester's transport revocation to drain it). False when an earlier event already revoked it.
  bool starts_revocation = false;
  bool changed = false;
};

constexpr bool IsRevoking(HoldPhase phase) {
  return phase == HoldPhase::kReleasing || phase == HoldPhase::kQuarantined || phase == HoldPhase::kPeerRevoked;
}
constexpr bool IsQuarantined(HoldPhase phase) {
  return phase == HoldPhase::kQuarantined || phase == HoldPhase::kPeerRevoked;
}

constexpr HoldStep Step(HoldPhase phase, HoldEvent event) {
  switch (event) {
    case HoldEvent::kPrepared:
      if (phase == HoldPhase::kPreparing) return {HoldPhase::kGranted, false, true};
      break;
    case HoldEvent::kRelease:
      if (!IsRevoking(phase)) return {HoldPhase::kReleasing, true, true};
      break;
    case HoldEvent::kRevoke:
      if (!IsRevoking(phase)) return {HoldPhase::kQuarantined, true, true};
      break;
    case HoldEvent::kRequesterVanished:
      if (phase != HoldPhase::kPeerRevoked) return {HoldPhase::kPeerRevoked, !IsRevoking(phase), true};
      break;
  }
  return {phase, false, false};
}

constexpr std::string_view HoldPhaseName(HoldPhase phase) {
  switch (phase) {
    case HoldPhase::kPreparing:
      return "preparing";
    case HoldPhase::kGranted:
      return "granted";
    case HoldPhase::kReleasing:
      return "releasing";
    case HoldPhase::kQuarantined:
      return "quarantined";
    case HoldPhase::kPeerRevoked:
      return "peer-revoked";
  }
  return "unknown";
}

}  // namespace orbitkv::catalog

#endif  // ORBITKV_CATALOG_HOLD_LIFECYCLE_H_
