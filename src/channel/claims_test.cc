// The claim/abandon protocol (claims.h) under random interleavings: an "engine" and a "Manager" side
// in two processes (fork, over a shared mapping, as in a real session) and in two threads (so that
// ThreadSanitizer sees the same code), thousands of rounds each.
//
// Save rounds: the engine fills its page with the round's pattern, arms the claim, and at a random
// moment abandons; once its abandon succeeded or found the save claimed, it overwrites the page at
// once (reuse). The Manager copies the page at a random moment (the copy can be torn by that reuse),
// then claims; only a claimed copy is "sealed". Never may a sealed block differ from the pattern
// the engine had when it armed.
// Restore rounds: the Manager claims at a random moment and then writes the round's pattern into the
// page; the engine abandons at a random moment, and after a successful abandon writes its own marker
// and checks, once the Manager finished the round, that the marker is intact (no write after the
// abandon); after a claimed restore it waits for the Manager and must find the pattern.
#include "channel/claims.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <random>
#include <thread>

#include "base/mutex.h"

namespace orbitkv::channel {
namespace {

constexpr size_t kPageBytes = 4096;
constexpr uint32_t kRounds = 4000;

struct Shared {
  alignas(64) uint64_t claim;
  alignas(64) std::atomic<uint32_t> round;         // published by the engine: the round in play
  alignas(64) std::atomic<uint32_t> manager_done;  // the last round the Manager finished
  alignas(64) std::atomic<uint32_t> engine_done;   // the last round the engine finished
  std::atomic<uint64_t> sealed;                    // Manager: rounds whose save it sealed
  std::atomic<uint64_t> abandoned;                 // engine: rounds it abandoned
  std::atomic<uint64_t> violations;
  alignas(64) uint8_t page[kPageBytes];
  uint8_t block[kPageBytes];
};

uint8_t Pattern(uint32_t round, size_t i) { return static_cast<uint8_t>(round * 131 + i * 7 + 1); }
uint8_t Marker(uint32_t round, size_t i) { return static_cast<uint8_t>(~Pattern(round, i)); }

// Relaxed byte copies: the two sides really do race on the page (that is the point), so they go
// through atomic_ref and the test stays free of undefined behaviour (and TSan reports).
void Fill(uint8_t* page, uint32_t round, bool marker) {
  for (size_t i = 0; i < kPageBytes; ++i) {
    std::atomic_ref<uint8_t>(page[i]).store(marker ? Marker(round, i) : Pattern(round, i), std::memory_order_relaxed);
  }
}
void CopyPage(uint8_t* to, uint8_t* from) {
  for (size_t i = 0; i < kPageBytes; ++i) {
    to[i] = std::atomic_ref<uint8_t>(from[i]).load(std::memory_order_relaxed);
  }
}
bool Holds(uint8_t* page, uint32_t round, bool marker) {
  for (size_t i = 0; i < kPageBytes; ++i) {
    const uint8_t want = marker ? Marker(round, i) : Pattern(round, i);
    if (std::atomic_ref<uint8_t>(page[i]).load(std::memory_order_relaxed) != want) return false;
  }
  return true;
}

void Delay(std::mt19937& rng) {
  const uint32_t spins = rng() % 3000;
  for (uint32_t i = 0; i < spins; ++i) SpinPause(static_cast<int>(i));
}

void WaitFor(const std::atomic<uint32_t>& counter, uint32_t value) {
  for (int i = 0; counter.load(std::memory_order_acquire) < value; ++i) SpinPause(i);
}

uint32_t Generation(uint32_t round) { return 2 * round + 1; }

void EngineSaves(Shared* s, uint32_t seed) {
  std::mt19937 rng(seed);
  for (uint32_t r = 1; r <= kRounds; ++r) {
    WaitFor(s->manager_done, r - 1);
    Fill(s->page, r, /*marker=*/false);
    ArmClaim(&s->claim, Generation(r));
    s->round.store(r, std::memory_order_release);
    Delay(rng);
    if (Abandon(&s->claim, Generation(r)) == ClaimState::kAbandoned) s->abandoned.fetch_add(1);
    Fill(s->page, r, /*marker=*/true);  // reuse the page at once: the save is decided either way
    s->engine_done.store(r, std::memory_order_release);
  }
}

void ManagerSaves(Shared* s, uint32_t seed) {
  std::mt19937 rng(seed);
  for (uint32_t r = 1; r <= kRounds; ++r) {
    WaitFor(s->round, r);
    Delay(rng);
    CopyPage(s->block, s->page);
    if (Claim(&s->claim, Generation(r))) {  // seal
      s->sealed.fetch_add(1);
      if (!Holds(s->block, r, /*marker=*/false)) s->violations.fetch_add(1);
    }
    s->manager_done.store(r, std::memory_order_release);
  }
}

void EngineRestores(Shared* s, uint32_t seed) {
  std::mt19937 rng(seed);
  for (uint32_t r = 1; r <= kRounds; ++r) {
    WaitFor(s->manager_done, r - 1);
    ArmClaim(&s->claim, Generation(r));
    s->round.store(r, std::memory_order_release);
    Delay(rng);
    if (Abandon(&s->claim, Generation(r)) == ClaimState::kAbandoned) {
      s->abandoned.fetch_add(1);
      Fill(s->page, r, /*marker=*/true);  // the page is the engine's again
      WaitFor(s->manager_done, r);
      if (!Holds(s->page, r, /*marker=*/true)) s->violations.fetch_add(1);
    } else {
      WaitFor(s->manager_done, r);  // a claimed restore is waited for
      if (!Holds(s->page, r, /*marker=*/false)) s->violations.fetch_add(1);
    }
    s->engine_done.store(r, std::memory_order_release);
  }
}

void ManagerRestores(Shared* s, uint32_t seed) {
  std::mt19937 rng(seed);
  for (uint32_t r = 1; r <= kRounds; ++r) {
    WaitFor(s->round, r);
    Delay(rng);
    if (Claim(&s->claim, Generation(r))) Fill(s->page, r, /*marker=*/false);
    s->manager_done.store(r, std::memory_order_release);
  }
}

Shared* MapShared() {
  void* mapped = mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  EXPECT_NE(mapped, MAP_FAILED);
  return new (mapped) Shared{};
}

using Side = void (*)(Shared*, uint32_t);

void InTwoProcesses(Shared* s, Side engine, Side manager) {
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    manager(s, 7);
    _exit(0);
  }
  engine(s, 11);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

void InTwoThreads(Shared* s, Side engine, Side manager) {
  std::thread m(manager, s, 3);
  engine(s, 5);
  m.join();
}

void ExpectSafe(Shared* s, bool save) {
  EXPECT_EQ(s->violations.load(), 0u) << (save ? "a sealed block differs from what the engine had "
                                                 "when the Manager copied"
                                               : "a page was written after its restore was "
                                                 "abandoned");
  // Both outcomes happened, so the interleavings really varied.
  EXPECT_GT(s->abandoned.load(), 0u);
  EXPECT_LT(s->abandoned.load(), kRounds);
  if (save) {
    EXPECT_EQ(s->sealed.load() + s->abandoned.load(), kRounds);
  }
  munmap(s, sizeof(Shared));
}

TEST(ClaimsTest, SavesAcrossTwoProcessesNeverSealWhatTheEngineReused) {
  Shared* s = MapShared();
  InTwoProcesses(s, EngineSaves, ManagerSaves);
  ExpectSafe(s, /*save=*/true);
}

TEST(ClaimsTest, RestoresAcrossTwoProcessesNeverWriteAfterAnAbandon) {
  Shared* s = MapShared();
  InTwoProcesses(s, EngineRestores, ManagerRestores);
  ExpectSafe(s, /*save=*/false);
}

TEST(ClaimsTest, SavesAcrossTwoThreadsNeverSealWhatTheEngineReused) {
  Shared* s = MapShared();
  InTwoThreads(s, EngineSaves, ManagerSaves);
  ExpectSafe(s, /*save=*/true);
}

TEST(ClaimsTest, RestoresAcrossTwoThreadsNeverWriteAfterAnAbandon) {
  Shared* s = MapShared();
  InTwoThreads(s, EngineRestores, ManagerRestores);
  ExpectSafe(s, /*save=*/false);
}

TEST(ClaimsTest, AStaleOrUnarmedWordDecidesNothingWrong) {
  uint64_t word = 0;
  ArmClaim(&word, 5);
  EXPECT_EQ(Abandon(&word, 5), ClaimState::kAbandoned);
  EXPECT_FALSE(Claim(&word, 5));                         // abandoned stays abandoned
  EXPECT_EQ(Abandon(&word, 5), ClaimState::kAbandoned);  // and says so again
  ArmClaim(&word, 7);                                    // the slot's next request
  EXPECT_TRUE(Claim(&word, 7));
  EXPECT_EQ(Abandon(&word, 7), ClaimState::kClaimed);
  // The Manager marks a claimed operation done; the engine then knows its pages are free even when no
  // reply comes (a session closed while the copies ran). Done is never mistaken for abandoned.
  EXPECT_FALSE(Finished(&word, 7));
  Finish(&word, 7);
  EXPECT_TRUE(Finished(&word, 7));
  EXPECT_EQ(Abandon(&word, 7), ClaimState::kClaimed);
  EXPECT_FALSE(Finished(&word, 9));  // another generation's word says nothing
  uint64_t abandoned = 0;
  ArmClaim(&abandoned, 11);
  ASSERT_EQ(Abandon(&abandoned, 11), ClaimState::kAbandoned);
  Finish(&abandoned, 11);  // only a claimed operation can be finished
  EXPECT_FALSE(Finished(&abandoned, 11));
  // A client that never arms words (older): the Manager owns the operation, as that client expects.
  uint64_t unarmed = ClaimWord(3, ClaimState::kClaimed);
  EXPECT_TRUE(Claim(&unarmed, 9));
}

// What a GPU stream waiting with GEQ on SettledWord sees: the word passes it exactly when the operation no
// longer touches the pages (abandoned or done), and never falls back below it, through every later use
// of the slot.
TEST(ClaimsTest, AWordPassesItsSettledValueOnlyOnceThePagesAreFreeAndNeverFallsBack) {
  auto passed = [](uint64_t word, uint32_t generation) {
    return static_cast<int64_t>(word - SettledWord(generation)) >= 0;  // CU_STREAM_WAIT_VALUE_GEQ
  };
  uint64_t word = 0;
  uint64_t last = 0;
  auto grows = [&] {
    EXPECT_GE(word, last);
    last = word;
  };
  ArmClaim(&word, 5);
  grows();
  EXPECT_FALSE(passed(word, 5));  // pending: the Manager may still claim it
  ASSERT_TRUE(Claim(&word, 5));
  grows();
  EXPECT_FALSE(passed(word, 5));  // claimed: the copies write the pages
  Finish(&word, 5);
  grows();
  EXPECT_TRUE(passed(word, 5));
  Settle(&word, 5);  // the engine polls the reply: nothing changes
  EXPECT_EQ(word, ClaimWord(5, ClaimState::kDone));

  ArmClaim(&word, 7);
  grows();
  EXPECT_TRUE(passed(word, 5));  // the earlier use stays passed
  EXPECT_FALSE(passed(word, 7));
  Settle(&word, 7);  // the Manager answered without claiming (a refused restore): abandoned, for good
  grows();
  EXPECT_TRUE(passed(word, 7));
  EXPECT_FALSE(Claim(&word, 7));
  EXPECT_EQ(word, ClaimWord(7, ClaimState::kAbandoned));

  ArmClaim(&word, 9);
  ASSERT_TRUE(Claim(&word, 9));
  Settle(&word, 9);  // the Manager died while it held the claim: the engine finishes it itself
  grows();
  EXPECT_TRUE(passed(word, 9));
  EXPECT_TRUE(Finished(&word, 9));

  ArmClaim(&word, 11);
  ASSERT_EQ(Abandon(&word, 11), ClaimState::kAbandoned);
  grows();
  EXPECT_TRUE(passed(word, 11));
  Settle(&word, 9);  // a stale generation's settle leaves the word alone
  EXPECT_EQ(word, ClaimWord(11, ClaimState::kAbandoned));
}

}  // namespace
}  // namespace orbitkv::channel
