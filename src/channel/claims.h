// Claim words: who decides a save or a restore, the Manager or the engine, in one compare-and-swap.
//
// Every payload slot of a session's arena has a 64-bit claim word after the slots. Before it
// submits a save or a restore in slot s with generation g, the engine stores Word(g, kPending).
// Exactly one of two compare-and-swaps on that word then succeeds:
//   - the Manager's Claim: Word(g, kPending) -> Word(g, kClaimed);
//   - the engine's Abandon, when its wait runs out: Word(g, kPending) -> Word(g, kAbandoned).
// Save: the Manager claims after its copy out of the engine's pages finished and before it seals.
// A claimed save is sealed; an abandoned one never is, whatever bytes the Manager read, and the
// engine may reuse its pages as soon as its abandon succeeded (the Manager can no longer claim) or
// found the save claimed (the copy is over).
// Restore: the order is reversed, since the Manager writes into the engine's pages: it claims before
// its first write. An abandoned restore is never started and its pages were never touched; a claimed
// one is waited for by its own request until its copies drained (or the Manager is gone).
// The generation makes a stale word (an earlier request of the slot) never match. A word naming
// another generation means the engine did not arm it (a client without claims): the Manager treats
// the operation as claimed, which is that client's contract (it waits for the reply).
// docs/formats/channel.md has the argument why no interleaving seals wrong bytes or writes into a
// page after its restore was abandoned.
#ifndef ORBITKV_CHANNEL_CLAIMS_H_
#define ORBITKV_CHANNEL_CLAIMS_H_

#include <atomic>
#include <cstdint>

namespace orbitkv::channel {

// kDone: the Manager finished a claimed operation (a restore's copies drained, a save sealed or
// dropped), so the engine's pages are its own again even if the reply never arrives (a session the
// Manager poisoned or closed while its copies still ran).
enum class ClaimState : uint64_t { kPending = 0, kClaimed = 1, kAbandoned = 2, kDone = 3 };

constexpr uint64_t ClaimWord(uint32_t generation, ClaimState state) {
  return (uint64_t{generation} << 2) | static_cast<uint64_t>(state);
}

// Engine, before submitting the request of `generation`.
inline void ArmClaim(uint64_t* word, uint32_t generation) {
  std::atomic_ref<uint64_t>(*word).store(ClaimWord(generation, ClaimState::kPending), std::memory_order_seq_cst);
}

// Manager: true when the operation is now the Manager's (claimed by this call, or a word the engine
// did not arm), false when the engine abandoned it first.
inline bool Claim(uint64_t* word, uint32_t generation) {
  uint64_t expected = ClaimWord(generation, ClaimState::kPending);
  std::atomic_ref<uint64_t> ref(*word);
  if (ref.compare_exchange_strong(expected, ClaimWord(generation, ClaimState::kClaimed), std::memory_order_seq_cst)) {
    return true;
  }
  return expected != ClaimWord(generation, ClaimState::kAbandoned);
}

// Manager: the claimed operation is over.
inline void Finish(uint64_t* word, uint32_t generation) {
  uint64_t expected = ClaimWord(generation, ClaimState::kClaimed);
  std::atomic_ref<uint64_t>(*word).compare_exchange_strong(expected, ClaimWord(generation, ClaimState::kDone),
                                                           std::memory_order_seq_cst);
}

// Engine: whether the Manager finished the claimed operation of `generation`.
inline bool Finished(uint64_t* word, uint32_t generation) {
  return std::atomic_ref<uint64_t>(*word).load(std::memory_order_seq_cst) == ClaimWord(generation, ClaimState::kDone);
}

// The least word at which the operation of `generation` no longer writes or reads the engine's
// pages: kAbandoned or kDone of that generation, or any word of a later one (a slot's words only
// grow: states advance pending -> claimed -> done or pending -> abandoned, and each use of a slot
// has a greater generation). A GPU stream that must not read a restore's pages early waits for the
// word to reach it (cuStreamWaitValue64, GEQ) instead of for the reply.
constexpr uint64_t SettledWord(uint32_t generation) { return ClaimWord(generation, ClaimState::kAbandoned); }

// The operation of `generation` is over: the Manager answers it, or the engine got its reply or
// found the Manager gone (ClientSession::ClaimStillRunning). Lifts the word to at least SettledWord,
// so a stream waiting on it goes on. Pending (answered without a claim) becomes kAbandoned, which
// no later Claim can take; claimed becomes kDone. Words of another generation are left alone.
inline void Settle(uint64_t* word, uint32_t generation) {
  std::atomic_ref<uint64_t> ref(*word);
  uint64_t expected = ClaimWord(generation, ClaimState::kPending);
  if (ref.compare_exchange_strong(expected, ClaimWord(generation, ClaimState::kAbandoned), std::memory_order_seq_cst)) {
    return;
  }
  if (expected == ClaimWord(generation, ClaimState::kClaimed)) {
    ref.compare_exchange_strong(expected, ClaimWord(generation, ClaimState::kDone), std::memory_order_seq_cst);
  }
}

// Whether the word says the Manager holds the claim of `generation` now (not finished, not settled).
inline bool HeldClaim(uint64_t* word, uint32_t generation) {
  return std::atomic_ref<uint64_t>(*word).load(std::memory_order_seq_cst) ==
         ClaimWord(generation, ClaimState::kClaimed);
}

// Engine, when its wait ran out: kAbandoned when it took the operation back (the Manager will never
// seal it, or never write its pages), kClaimed when the Manager had claimed it first.
inline ClaimState Abandon(uint64_t* word, uint32_t generation) {
  uint64_t expected = ClaimWord(generation, ClaimState::kPending);
  std::atomic_ref<uint64_t> ref(*word);
  if (ref.compare_exchange_strong(expected, ClaimWord(generation, ClaimState::kAbandoned), std::memory_order_seq_cst)) {
    return ClaimState::kAbandoned;
  }
  return expected == ClaimWord(generation, ClaimState::kAbandoned) ? ClaimState::kAbandoned : ClaimState::kClaimed;
}

}  // namespace orbitkv::channel

#endif  // ORBITKV_CHANNEL_CLAIMS_H_
