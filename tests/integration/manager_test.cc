// A real orbitkv-manager process and real client processes: save, query, restore byte for byte;
// concurrency; and the faults an operator meets (engine killed mid-restore or mid-save, Manager
// killed, foreign uid, malformed descriptors).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <optional>
#include <thread>

#include "channel/claims.h"
#include "channel/messages.h"
#include "channel/session.h"
#include "client/cache_client.h"
#include "client/kv_memory.h"
#include "engine_kv.h"
#include "manager_process.h"
#include "state/test_util.h"

namespace orbitkv {
namespace {

using client::BufferSpec;
using client::CacheClient;
using client::ClientOptions;
using client::SaveItem;
using state::StateKey;
using testing::Chain;
using testing::Connect;
using testing::EngineKv;
using testing::EventuallyIdle;
using testing::kBlockBytes;
using testing::kLayers;
using testing::kPageBytes;
using testing::ManagerProcess;
using testing::Register;
using testing::SaveChain;
using testing::StatField;

TEST(ManagerIntegrationTest, SaveQueryRestoreIsByteExact) {
  ManagerProcess manager;
  ASSERT_TRUE(manager.running());
  auto client = Connect(manager);
  ASSERT_NE(client, nullptr);
  EngineKv kv(64);
  EXPECT_EQ(Register(*client, 1, kv), kBlockBytes);
  const auto keys = Chain(1, 24);
  client::SaveResult saved;
  ASSERT_TRUE(SaveChain(*client, 1, kv, keys, 0, &saved).ok());
  EXPECT_EQ(saved.written, 24u);
  // Saving again copies nothing: content-addressed blocks are already resident.
  ASSERT_TRUE(SaveChain(*client, 1, kv, keys, 0, &saved).ok());
  EXPECT_EQ(saved.written, 0u);
  EXPECT_EQ(saved.skipped, 24u);

  kv.Poison();
  const auto extended = Chain(1, 28);  // the saved chain and 4 more pages never saved
  auto hit = client->Query(1, 0, extended);
  ASSERT_TRUE(hit.ok()) << hit.status();
  EXPECT_EQ(hit->hits, 24u);
  std::vector<uint32_t> pages;
  for (uint32_t i = 0; i < 24; ++i) pages.push_back(63 - i);  // scattered, reversed destinations
  ASSERT_TRUE(client->Restore(1, 0, hit->lease, pages).ok());
  for (uint32_t i = 0; i < 24; ++i) EXPECT_TRUE(kv.Holds(63 - i, keys[i])) << i;
  // Pages not named stay poisoned.
  EXPECT_EQ(kv.Page(0, 0)[0], 0xee);
  EXPECT_TRUE(EventuallyIdle(*client));
  auto miss = client->Query(1, 0, Chain(3, 4));
  ASSERT_TRUE(miss.ok());
  EXPECT_EQ(miss->hits, 0u);
}

TEST(ManagerIntegrationTest, LeaseErrorsAreRepliesNotCrashes) {
  ManagerProcess manager;
  auto client = Connect(manager);
  ASSERT_NE(client, nullptr);
  EngineKv kv(16);
  Register(*client, 1, kv);
  const auto keys = Chain(4, 8);
  ASSERT_TRUE(SaveChain(*client, 1, kv, keys).ok());
  auto hit = client->Query(1, 0, keys);
  ASSERT_TRUE(hit.ok() && hit->hits == 8);
  ASSERT_TRUE(client->Release(1, hit->lease).ok());
  EXPECT_EQ(client->Release(1, hit->lease).code(), StatusCode::kFailedPrecondition);
  std::vector<uint32_t> pages(8, 0);
  EXPECT_EQ(client->Restore(1, 0, hit->lease, pages).code(), StatusCode::kFailedPrecondition);
  // Out-of-range destination: the lease is consumed, nothing is written, the session continues.
  auto again = client->Query(1, 0, keys);
  ASSERT_TRUE(again.ok() && again->hits == 8);
  std::vector<uint32_t> bad(8, 16);
  EXPECT_EQ(client->Restore(1, 0, again->lease, bad).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(client->Query(99, 0, keys).status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(client->Ping().ok());
  EXPECT_TRUE(EventuallyIdle(*client));
}

TEST(ManagerIntegrationTest, BadGeometryIsRefusedAtRegistration) {
  ManagerProcess manager;
  auto client = Connect(manager);
  ASSERT_NE(client, nullptr);
  EngineKv kv(4);
  ASSERT_TRUE(client->RegisterInstance(5, state::testing::SampleNamespace()).ok());
  auto specs = kv.Specs();
  auto too_many_pages = client->RegisterGroup(5, 0, 1000, specs);
  EXPECT_EQ(too_many_pages.status().code(), StatusCode::kInvalidArgument);
  specs[0].buffer_bytes *= 100;  // claims more than the memfd holds
  EXPECT_EQ(client->RegisterGroup(5, 0, 4, specs).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(client->RegisterGroup(6, 0, 4, kv.Specs()).status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(client->RegisterGroup(5, 0, 4, kv.Specs()).ok());
  EXPECT_EQ(client->RegisterGroup(5, 0, 4, kv.Specs()).status().code(), StatusCode::kAlreadyExists);
  // Another session cannot take over a live instance.
  auto other = Connect(manager);
  EXPECT_EQ(other->RegisterInstance(5, state::testing::SampleNamespace()).code(), StatusCode::kAlreadyExists);
}

// The other buffer kinds, refused with a reason: process memory the Manager cannot read, and GPU
// buffers on a Manager without a usable GPU (CUDA_VISIBLE_DEVICES="" hides any GPU of this host).
TEST(ManagerIntegrationTest, UnusableBufferKindsAreRefusedWithAReason) {
  ::setenv("CUDA_VISIBLE_DEVICES", "", 1);
  ManagerProcess manager;
  ::unsetenv("CUDA_VISIBLE_DEVICES");
  auto client = Connect(manager);
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->RegisterInstance(7, state::testing::SampleNamespace()).ok());
  // An address nothing is mapped at in this process.
  BufferSpec unmapped{-1, 1 << 20, 0, 64 << 10, 64 << 10, /*address=*/0x10000, std::nullopt};
  auto refused = client->RegisterGroup(7, 0, 16, std::span(&unmapped, 1));
  EXPECT_EQ(refused.status().code(), StatusCode::kPermissionDenied) << refused.status();
  EXPECT_NE(refused.status().message().find("cannot read engine process"), std::string::npos);
  // Mixed kinds in one group.
  EngineKv kv(4);
  auto mixed = kv.Specs();
  mixed[1].fd = -1;
  mixed[1].address = reinterpret_cast<uint64_t>(kv.Page(1, 0));
  EXPECT_EQ(client->RegisterGroup(7, 0, 4, mixed).status().code(), StatusCode::kInvalidArgument);
  // A CUDA IPC buffer on a Manager without a GPU.
  BufferSpec gpu{-1, 1 << 20, 0, 64 << 10, 64 << 10, 0, client::CudaIpcSpec{}};
  gpu.cuda_ipc->pci_bus_id = "0000:00:06.0";
  auto no_gpu = client->RegisterGroup(7, 0, 16, std::span(&gpu, 1));
  EXPECT_EQ(no_gpu.status().code(), StatusCode::kFailedPrecondition) << no_gpu.status();
  // The session is still good.
  EXPECT_TRUE(client->RegisterGroup(7, 0, 4, kv.Specs()).ok());
}

// An engine cannot make the Manager fault by resizing the memory it registered: unsealed memfds and
// plain shared-memory files are refused with the fix named, and a sealed buffer cannot be shrunk.
TEST(ManagerIntegrationTest, OnlyMemfdsSealedAgainstResizingAreMapped) {
  ManagerProcess manager;
  auto client = Connect(manager);
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->RegisterInstance(9, state::testing::SampleNamespace()).ok());
  constexpr uint64_t kBytes = 16 * kPageBytes;
  ScopedFd unsealed(memfd_create("unsealed-kv", MFD_CLOEXEC));
  ASSERT_EQ(ftruncate(unsealed.get(), kBytes), 0);
  char shm_path[] = "/dev/shm/orbitkv-kv-XXXXXX";
  ScopedFd plain(mkstemp(shm_path));
  ASSERT_TRUE(plain.valid());
  unlink(shm_path);
  ASSERT_EQ(ftruncate(plain.get(), kBytes), 0);
  for (int fd : {unsealed.get(), plain.get()}) {
    BufferSpec spec{fd, kBytes, 0, kPageBytes, kPageBytes};
    auto refused = client->RegisterGroup(9, 0, 16, std::span(&spec, 1));
    EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition) << refused.status();
    EXPECT_NE(refused.status().message().find("F_SEAL_SHRINK"), std::string::npos) << refused.status();
  }
  Result<ScopedFd> sealed = client::CreateKvMemory("sealed-kv", kBytes);
  ASSERT_TRUE(sealed.ok()) << sealed.status();
  BufferSpec spec{sealed->get(), kBytes, 0, kPageBytes, kPageBytes};
  ASSERT_TRUE(client->RegisterGroup(9, 0, 16, std::span(&spec, 1)).ok());
  // The engine's attempt to shrink it under the Manager fails; the Manager is unharmed.
  EXPECT_NE(ftruncate(sealed->get(), kPageBytes), 0);
  EXPECT_EQ(errno, EPERM);
  EXPECT_TRUE(client->Ping().ok());
}

// Sets /proc/sys/vm/nr_hugepages for the scope (root only); restores the old value after.
class HugePages {
 public:
  explicit HugePages(int count) {
    std::FILE* f = std::fopen("/proc/sys/vm/nr_hugepages", "r");
    if (f == nullptr) return;
    if (std::fscanf(f, "%d", &previous_) != 1) previous_ = -1;
    std::fclose(f);
    ok_ = previous_ >= 0 && Write(count) && Read() == count;
  }
  ~HugePages() {
    if (previous_ >= 0) Write(previous_);
  }
  bool ok() const { return ok_; }

 private:
  static bool Write(int count) {
    std::FILE* f = std::fopen("/proc/sys/vm/nr_hugepages", "w");
    if (f == nullptr) return false;
    const bool written = std::fprintf(f, "%d", count) > 0;
    return std::fclose(f) == 0 && written;
  }
  static int Read() {
    int count = -1;
    std::FILE* f = std::fopen("/proc/sys/vm/nr_hugepages", "r");
    if (f == nullptr) return -1;
    if (std::fscanf(f, "%d", &count) != 1) count = -1;
    std::fclose(f);
    return count;
  }
  int previous_ = -1;
  bool ok_ = false;
};

// Sealing does not cover everything: an engine can punch a hole in a sealed hugetlb memfd, and when no
// huge page is left to fault back in, the Manager's next copy from it raises SIGBUS. That copy fails,
// the engine's sessions are poisoned, and the Manager serves every other engine on.
TEST(ManagerIntegrationTest, AFaultOnAnEnginesSealedMemoryCostsOnlyThatEngine) {
  HugePages huge(1);
  if (!huge.ok()) GTEST_SKIP() << "needs root to reserve one huge page (/proc/sys/vm/nr_hugepages)";
  const uint16_t metrics_port = testing::FreeLoopbackPort();
  ManagerProcess manager({"--metrics-addr", fmt::format("127.0.0.1:{}", metrics_port)});
  auto client = Connect(manager);
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->RegisterInstance(11, state::testing::SampleNamespace()).ok());
  constexpr uint64_t kHuge = 2 << 20;
  constexpr uint64_t kPage = 64 << 10;
  ScopedFd fd(memfd_create("huge-kv", MFD_CLOEXEC | MFD_HUGETLB | MFD_ALLOW_SEALING));
  ASSERT_TRUE(fd.valid()) << std::strerror(errno);
  ASSERT_EQ(ftruncate(fd.get(), kHuge), 0);
  ASSERT_EQ(fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  auto* kv = static_cast<uint8_t*>(mmap(nullptr, kHuge, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0));
  ASSERT_NE(kv, MAP_FAILED);
  std::memset(kv, 0x6b, kHuge);
  BufferSpec spec{fd.get(), kHuge, 0, kPage, kPage};
  ASSERT_TRUE(client->RegisterGroup(11, 0, kHuge / kPage, std::span(&spec, 1)).ok());
  const auto keys = Chain(91, 8);
  std::vector<SaveItem> first, second;
  for (uint32_t i = 0; i < 4; ++i) first.push_back({keys[i], i});
  for (uint32_t i = 4; i < 8; ++i) second.push_back({keys[i], i});
  ASSERT_TRUE(client->Save(11, 0, first).ok());
  // The engine punches its memory out and the only huge page goes elsewhere.
  munmap(kv, kHuge);
  ASSERT_EQ(fallocate(fd.get(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, kHuge), 0);
  void* taken = mmap(nullptr, kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1, 0);
  ASSERT_NE(taken, MAP_FAILED) << std::strerror(errno);
  std::memset(taken, 1, kHuge);
  // The Manager's copy from it faults: this save fails, and then the engine's sessions are closed.
  EXPECT_FALSE(client->Save(11, 0, second).ok());
  bool poisoned = false;
  for (int i = 0; i < 200 && !poisoned; ++i) {
    poisoned = !client->Ping().ok();
    if (!poisoned) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(poisoned);
  // The Manager lives, and serves another engine as before.
  ASSERT_TRUE(manager.running()) << manager.LogText();
  auto other = Connect(manager);
  ASSERT_NE(other, nullptr);
  EngineKv healthy(4);
  Register(*other, 12, healthy);
  EXPECT_TRUE(SaveChain(*other, 12, healthy, Chain(92, 4), 0).ok());
  EXPECT_NE(manager.LogText().find("vanished"), std::string::npos);
  const std::string metrics = testing::MetricsText(metrics_port);
  EXPECT_NE(metrics.find("orbitkv_sessions_poisoned_total{reason=\"engine_memory\"} 2"),
            std::string::npos)  // the engine's control and publish sessions
      << metrics;
  munmap(taken, kHuge);
}

// Layer-wise restore: each part copies some buffers of every leased block with its own completion;
// the lease outlives the earlier parts and ends with the last.
TEST(ManagerIntegrationTest, LayerWiseRestoreCompletesPerLayer) {
  ManagerProcess manager;
  auto client = Connect(manager);
  ASSERT_NE(client, nullptr);
  EngineKv kv(32);
  Register(*client, 8, kv);
  const auto keys = Chain(31, 8);
  ASSERT_TRUE(SaveChain(*client, 8, kv, keys).ok());
  kv.Poison();
  auto hit = client->Query(8, 0, keys);
  ASSERT_TRUE(hit.ok());
  ASSERT_EQ(hit->hits, keys.size());
  std::vector<uint32_t> pages(keys.size());
  for (uint32_t i = 0; i < pages.size(); ++i) pages[i] = 16 + i;
  // Out of range: refused, and the lease is still good.
  auto bad = client->StartRestoreLayers(8, 0, hit->lease, pages, 1, 2, false);
  ASSERT_TRUE(bad.ok());
  EXPECT_EQ(client->WaitRestore(*bad).code(), StatusCode::kInvalidArgument);
  // Layer 0 first: only its buffer is restored.
  auto first = client->StartRestoreLayers(8, 0, hit->lease, pages, 0, 1, false);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(client->WaitRestore(*first).ok());
  std::vector<uint8_t> expected(kPageBytes);
  for (uint32_t i = 0; i < keys.size(); ++i) {
    EXPECT_FALSE(kv.Holds(16 + i, keys[i]));  // layer 1 still poisoned
    EXPECT_NE(*kv.Page(0, 16 + i), 0xee);
    EXPECT_EQ(*kv.Page(1, 16 + i), 0xee);
  }
  EXPECT_EQ(StatField(*client, "leases_active"), 1u);
  // The last part consumes the lease.
  auto last = client->StartRestoreLayers(8, 0, hit->lease, pages, 1, 1, true);
  ASSERT_TRUE(last.ok());
  ASSERT_TRUE(client->WaitRestore(*last).ok());
  for (uint32_t i = 0; i < keys.size(); ++i) EXPECT_TRUE(kv.Holds(16 + i, keys[i])) << i;
  EXPECT_EQ(client->Release(8, hit->lease).code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(EventuallyIdle(*client));
}

// The claim word a GPU stream waits on (CacheClient::RestoreSignalOf, cuStreamWaitValue64 GEQ) passes its
// value only once the pages are written, without the engine polling anything; a refused restore passes
// it at the Manager's reply, an abandoned, guarded or orphaned one once the client settled it, so a
// waiting stream never outlives the engine's own wait.
TEST(ManagerIntegrationTest, ARestoresSignalPassesOnlyOnceItsPagesAreTheEnginesAgain) {
  ManagerProcess manager;
  auto client = Connect(manager);
  ASSERT_NE(client, nullptr);
  EngineKv kv(32);
  Register(*client, 8, kv);
  const auto keys = Chain(41, 8);
  ASSERT_TRUE(SaveChain(*client, 8, kv, keys).ok());
  kv.Poison();
  std::vector<uint32_t> pages(keys.size());
  for (uint32_t i = 0; i < pages.size(); ++i) pages[i] = 16 + i;
  const std::span<uint8_t> region = client->claim_region();
  ASSERT_EQ(reinterpret_cast<uintptr_t>(region.data()) % 4096, 0u);
  ASSERT_TRUE(!region.empty() && region.size() % 4096 == 0);
  auto word = [&](const CacheClient::RestoreSignal& s) {
    return __atomic_load_n(reinterpret_cast<const uint64_t*>(region.data() + s.offset), __ATOMIC_ACQUIRE);
  };
  auto passed = [&](const CacheClient::RestoreSignal& s) { return static_cast<int64_t>(word(s) - s.value) >= 0; };
  auto hit = client->Query(8, 0, keys);
  ASSERT_TRUE(hit.ok() && hit->hits == keys.size()) << hit.status();

  // A restore the Manager runs: the word passes while nobody polls, and by then the pages hold the data.
  ASSERT_TRUE(manager.Pause());
  auto first = client->StartRestoreLayers(8, 0, hit->lease, pages, 0, 1, false);
  ASSERT_TRUE(first.ok()) << first.status();
  auto signal = client->RestoreSignalOf(*first);
  ASSERT_TRUE(signal.ok()) << signal.status();
  ASSERT_LT(signal->offset + 8, region.size() + 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(passed(*signal)) << "the word passed before the stopped Manager copied anything";
  ASSERT_EQ(kill(manager.pid(), SIGCONT), 0);
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!passed(*signal) && std::chrono::steady_clock::now() < give_up) std::this_thread::yield();
  ASSERT_TRUE(passed(*signal));
  for (uint32_t i = 0; i < keys.size(); ++i) EXPECT_NE(*kv.Page(0, 16 + i), 0xee) << i;
  ASSERT_TRUE(client->WaitRestore(*first).ok());
  EXPECT_EQ(client->RestoreSignalOf(*first).status().code(), StatusCode::kNotFound);

  // Refused (buffers out of range): nothing is written; the word passes once the engine has the reply.
  auto bad = client->StartRestoreLayers(8, 0, hit->lease, pages, 1, 2, false);
  ASSERT_TRUE(bad.ok());
  auto bad_signal = client->RestoreSignalOf(*bad);
  ASSERT_TRUE(bad_signal.ok());
  const auto refused_give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!passed(*bad_signal) && std::chrono::steady_clock::now() < refused_give_up) std::this_thread::yield();
  EXPECT_TRUE(passed(*bad_signal)) << "the Manager refused the restore without settling its word";
  EXPECT_EQ(client->WaitRestore(*bad).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(passed(*signal));  // a slot's later uses never take an earlier word back

  // Abandoned before the Manager saw it: passes at once, and the pages stay untouched.
  ASSERT_TRUE(manager.Pause());
  auto abandoned = client->StartRestoreLayers(8, 0, hit->lease, pages, 1, 1, false);
  ASSERT_TRUE(abandoned.ok());
  auto abandoned_signal = client->RestoreSignalOf(*abandoned);
  ASSERT_TRUE(abandoned_signal.ok());
  EXPECT_FALSE(passed(*abandoned_signal));
  auto gave_up = client->AbandonRestore(*abandoned);
  ASSERT_TRUE(gave_up.ok() && *gave_up);
  EXPECT_TRUE(passed(*abandoned_signal));

  // Guarded: the client's own thread abandons it at the deadline while no engine thread calls anything
  // (they may all be blocked on the GPU stream that waits on the word).
  auto guarded = client->StartRestoreLayers(8, 0, hit->lease, pages, 1, 1, false);
  ASSERT_TRUE(guarded.ok());
  auto guarded_signal = client->RestoreSignalOf(*guarded);
  ASSERT_TRUE(guarded_signal.ok());
  ASSERT_TRUE(client->GuardRestore(*guarded, std::chrono::milliseconds(30)).ok());
  EXPECT_FALSE(passed(*guarded_signal));
  const auto guard_give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!passed(*guarded_signal) && std::chrono::steady_clock::now() < guard_give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_TRUE(passed(*guarded_signal)) << "the guard never abandoned the unclaimed restore";
  auto guarded_abandon = client->AbandonRestore(*guarded);
  ASSERT_TRUE(guarded_abandon.ok());
  EXPECT_TRUE(*guarded_abandon);  // the engine's own abandon agrees: never claimed, never written
  EXPECT_EQ(client->GuardRestore(*guarded, std::chrono::milliseconds(1)).code(), StatusCode::kNotFound);

  // Orphaned: started while the Manager is stopped, then the Manager dies. The engine's poll ends it,
  // and lifts the word.
  auto orphan = client->StartRestoreLayers(8, 0, hit->lease, pages, 1, 1, true);
  ASSERT_TRUE(orphan.ok());
  auto orphan_signal = client->RestoreSignalOf(*orphan);
  ASSERT_TRUE(orphan_signal.ok());
  manager.Stop(SIGKILL);
  EXPECT_FALSE(passed(*orphan_signal));
  std::optional<Status> outcome;
  for (int i = 0; i < 2000 && !outcome.has_value(); ++i) {
    auto polled = client->PollRestore(*orphan);
    ASSERT_TRUE(polled.ok()) << polled.status();
    outcome = *polled;
    if (!outcome.has_value()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_TRUE(outcome.has_value());
  EXPECT_FALSE(outcome->ok());
  EXPECT_TRUE(passed(*orphan_signal));
  for (uint32_t i = 0; i < keys.size(); ++i) EXPECT_EQ(*kv.Page(1, 16 + i), 0xee) << i;
}

// A restore the Manager claimed and then died in (SIGSTOP to hold the claim, then SIGKILL): the guard
// thread settles its word once the process is gone, with no engine thread calling anything, so a GPU
// stream waiting on it goes on; while the Manager lives, the claimed word is left alone.
TEST(ManagerIntegrationTest, AGuardSettlesAClaimItsDeadManagerHeld) {
  constexpr uint64_t kPage = 1 << 20;
  constexpr uint32_t kPages = 256;
  bool held = false;
  for (int round = 0; round < 8 && !held; ++round) {
    ManagerProcess manager({"--dram", "512MiB", "--copy-threads", "1"});
    ASSERT_TRUE(manager.running());
    auto client = Connect(manager);
    ASSERT_NE(client, nullptr);
    ASSERT_TRUE(client->RegisterInstance(50, state::testing::SampleNamespace()).ok());
    ScopedFd fd(memfd_create("kv", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    ASSERT_EQ(ftruncate(fd.get(), kPage * kPages), 0);
    ASSERT_EQ(fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
    BufferSpec spec{fd.get(), kPage * kPages, 0, kPage, kPage};
    ASSERT_TRUE(client->RegisterGroup(50, 0, kPages, std::span(&spec, 1)).ok());
    const auto keys = Chain(300 + round, kPages / 2);
    std::vector<SaveItem> items;
    for (uint32_t i = 0; i < kPages / 2; ++i) items.push_back({keys[i], i});
    ASSERT_TRUE(client->Save(50, 0, items).ok());
    auto hit = client->Query(50, 0, keys);
    ASSERT_TRUE(hit.ok() && hit->hits == kPages / 2) << hit.status();
    std::vector<uint32_t> pages;
    for (uint32_t i = 0; i < kPages / 2; ++i) pages.push_back(kPages / 2 + i);
    auto handle = client->StartRestore(50, 0, hit->lease, pages);
    ASSERT_TRUE(handle.ok()) << handle.status();
    auto signal = client->RestoreSignalOf(*handle);
    ASSERT_TRUE(signal.ok());
    auto* word = reinterpret_cast<uint64_t*>(client->claim_region().data() + signal->offset);
    const uint32_t generation = static_cast<uint32_t>(signal->value >> 2);
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (!channel::HeldClaim(word, generation) && std::chrono::steady_clock::now() < until) {
      std::this_thread::yield();
    }
    ASSERT_TRUE(manager.Pause());
    held = channel::HeldClaim(word, generation);
    if (!held) {  // the copy finished before the stop landed: try again with a fresh Manager
      kill(manager.pid(), SIGCONT);
      continue;
    }
    ASSERT_TRUE(client->GuardRestore(*handle, std::chrono::milliseconds(10)).ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    EXPECT_TRUE(channel::HeldClaim(word, generation)) << "a claim the live Manager holds was taken";
    manager.Stop(SIGKILL);
    const auto settle_by = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (static_cast<int64_t>(__atomic_load_n(word, __ATOMIC_SEQ_CST) - signal->value) < 0 &&
           std::chrono::steady_clock::now() < settle_by) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    EXPECT_TRUE(channel::Finished(word, generation)) << "the dead Manager's claim was never settled";
  }
  EXPECT_TRUE(held) << "in no round did the Manager hold the claim when it stopped";
}

TEST(ManagerIntegrationTest, ConcurrentSessionsAndPublishWhileRestoring) {
  ManagerProcess manager;
  const auto shared = Chain(10, 16);
  std::atomic<int> failures{0};
  auto engine = [&](uint64_t instance) {
    auto client = Connect(manager);
    if (client == nullptr) return failures++, void();
    EngineKv kv(96);
    Register(*client, instance, kv);
    const auto own = Chain(100 + instance, 16);
    std::atomic<bool> done{false};
    // A second thread saves continuously on the publish session while this one queries and
    // restores.
    std::thread publisher([&] {
      EngineKv pub(32);
      uint64_t round = 0;
      while (!done.load()) {
        const auto keys = Chain(1000 + instance * 100 + (round++ % 50), 8);
        std::vector<SaveItem> items;
        for (uint32_t i = 0; i < keys.size(); ++i) {
          kv.Fill(64 + i, keys[i]);
          items.push_back(SaveItem{keys[i], 64 + i});
        }
        if (!client->Save(instance, 0, items).ok()) failures++;
      }
    });
    if (!SaveChain(*client, instance, kv, shared).ok() || !SaveChain(*client, instance, kv, own, 16).ok()) failures++;
    for (int round = 0; round < 30; ++round) {
      const auto& keys = round % 2 ? shared : own;
      auto hit = client->Query(instance, 0, keys);
      if (!hit.ok()) {
        failures++;
        continue;
      }
      std::vector<uint32_t> pages;
      for (uint32_t i = 0; i < hit->hits; ++i) pages.push_back(32 + i);
      if (hit->hits == 0) continue;
      for (uint32_t i = 0; i < hit->hits; ++i) std::memset(kv.Page(0, 32 + i), 0, kPageBytes);
      if (!client->Restore(instance, 0, hit->lease, pages).ok()) failures++;
      for (uint32_t i = 0; i < hit->hits; ++i) {
        if (!kv.Holds(32 + i, keys[i])) failures++;
      }
    }
    done.store(true);
    publisher.join();
  };
  std::vector<std::thread> engines;
  for (uint64_t i = 1; i <= 3; ++i) engines.emplace_back(engine, i);
  for (auto& t : engines) t.join();
  EXPECT_EQ(failures.load(), 0);
  auto observer = Connect(manager);
  EXPECT_TRUE(EventuallyIdle(*observer));
}

// Runs `body` in a child process that ends by SIGKILL (from itself); returns after it died.
template <typename Body>
void InKilledChild(Body body) {
  pid_t child = fork();
  if (child == 0) {
    body();
    kill(getpid(), SIGKILL);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
}

TEST(ManagerIntegrationTest, EngineKilledMidRestoreOrMidSaveIsCleanedUp) {
  ManagerProcess manager;
  auto observer = Connect(manager);
  ASSERT_NE(observer, nullptr);
  const auto keys = Chain(20, 400);  // 400 blocks of 32 KiB: a restore takes a while
  InKilledChild([&] {
    auto client = Connect(manager);
    EngineKv kv(800);
    Register(*client, 7, kv);
    if (!SaveChain(*client, 7, kv, keys).ok()) _exit(3);
    auto hit = client->Query(7, 0, keys);
    if (!hit.ok() || hit->hits == 0) _exit(4);
    std::vector<uint32_t> pages;
    for (uint32_t i = 0; i < hit->hits; ++i) pages.push_back(400 + i);
    // Leave a second lease unreleased too, then die with the restore in flight.
    (void)client->Query(7, 0, keys);
    (void)client->StartRestore(7, 0, hit->lease, pages);
  });
  EXPECT_TRUE(EventuallyIdle(*observer));
  InKilledChild([&] {
    auto client = Connect(manager);
    EngineKv kv(800);
    Register(*client, 8, kv);
    std::thread saver([&] { (void)SaveChain(*client, 8, kv, Chain(21, 400)); });
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    kill(getpid(), SIGKILL);
    saver.join();
  });
  EXPECT_TRUE(EventuallyIdle(*observer));
  // The pool is intact and the next engine works.
  EngineKv kv(64);
  Register(*observer, 9, kv);
  kv.Poison();
  auto hit = observer->Query(9, 0, std::vector<StateKey>(keys.begin(), keys.begin() + 32));
  ASSERT_TRUE(hit.ok());
  EXPECT_EQ(hit->hits, 32u);
  std::vector<uint32_t> pages;
  for (uint32_t i = 0; i < 32; ++i) pages.push_back(i);
  ASSERT_TRUE(observer->Restore(9, 0, hit->lease, pages).ok());
  for (uint32_t i = 0; i < 32; ++i) EXPECT_TRUE(kv.Holds(i, keys[i])) << i;
}

// The start addresses of this process's channel arenas (memfd "orbitkv-channel").
std::vector<uintptr_t> ChannelArenas() {
  std::ifstream maps("/proc/self/maps");
  std::vector<uintptr_t> arenas;
  for (std::string line; std::getline(maps, line);) {
    if (line.find("orbitkv-channel") != std::string::npos) {
      arenas.push_back(std::stoull(line.substr(0, line.find('-')), nullptr, 16));
    }
  }
  return arenas;
}

// An engine whose session dies (here: the Manager poisons it) while a restore the Manager claimed
// still writes its pages: the client reports the restore still running until the Manager marks the
// claim done (its copies drained), never "over" while a copy may still land, and nothing writes the
// pages after it said over. The Manager is stopped just after it claimed the restore (so the copy
// is mid-way), the engine's request rings are corrupted (an engine that scribbles on its own
// channel: a fault the client cannot be made to produce), and SIGCONT lets the dispatcher poison
// the sessions while the copy resumes.
TEST(ManagerIntegrationTest, ASessionPoisonedDuringAClaimedRestoreKeepsItsPagesUntilTheCopyIsDone) {
  constexpr uint64_t kPage = 1 << 20;  // one buffer of 1 MiB pages: a 256 MiB restore takes a while
  constexpr uint32_t kPages = 256;
  const uint16_t metrics_port = testing::FreeLoopbackPort();
  ManagerProcess manager(
      {"--dram", "512MiB", "--copy-threads", "1", "--metrics-addr", fmt::format("127.0.0.1:{}", metrics_port)});
  ASSERT_TRUE(manager.running());
  auto observer = Connect(manager);
  ASSERT_NE(observer, nullptr);
  bool observed_window = false;
  for (int round = 0; round < 4 && !observed_window; ++round) {
    const std::vector<uintptr_t> before = ChannelArenas();
    auto client = Connect(manager);
    ASSERT_NE(client, nullptr);
    const uint64_t instance = 40 + round;
    ASSERT_TRUE(client->RegisterInstance(instance, state::testing::SampleNamespace()).ok());
    ScopedFd fd(memfd_create("kv", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    ASSERT_EQ(ftruncate(fd.get(), kPage * kPages), 0);
    ASSERT_EQ(fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
    auto* kv = static_cast<uint8_t*>(mmap(nullptr, kPage * kPages, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0));
    ASSERT_NE(kv, MAP_FAILED);
    BufferSpec spec{fd.get(), kPage * kPages, 0, kPage, kPage};
    ASSERT_TRUE(client->RegisterGroup(instance, 0, kPages, std::span(&spec, 1)).ok());
    const auto keys = Chain(100 + round, kPages / 2);
    std::vector<SaveItem> items;
    for (uint32_t i = 0; i < kPages / 2; ++i) {
      std::memset(kv + i * kPage, 1 + i % 250, kPage);
      items.push_back({keys[i], i});
    }
    ASSERT_TRUE(client->Save(instance, 0, items).ok());
    std::memset(kv + (kPages / 2) * kPage, 0xee, (kPages / 2) * kPage);
    auto hit = client->Query(instance, 0, keys);
    ASSERT_TRUE(hit.ok() && hit->hits == kPages / 2) << hit.status();
    std::vector<uint32_t> pages;
    for (uint32_t i = 0; i < kPages / 2; ++i) pages.push_back(kPages / 2 + i);
    auto handle = client->StartRestore(instance, 0, hit->lease, pages);
    ASSERT_TRUE(handle.ok()) << handle.status();
    std::this_thread::sleep_for(std::chrono::milliseconds(3));
    ASSERT_EQ(kill(manager.pid(), SIGSTOP), 0);
    auto abandoned = client->AbandonRestore(*handle);
    ASSERT_TRUE(abandoned.ok()) << abandoned.status();
    if (!*abandoned) {  // claimed: the copy runs (or ran) and may write the pages
      for (uintptr_t arena : ChannelArenas()) {
        if (std::find(before.begin(), before.end(), arena) != before.end()) continue;
        const auto* header = reinterpret_cast<const channel::ArenaHeader*>(arena);
        auto* ring = reinterpret_cast<channel::RingControl*>(arena + header->request_ring_offset);
        __atomic_store_n(&ring->head, __atomic_load_n(&ring->tail, __ATOMIC_ACQUIRE) + (1u << 20), __ATOMIC_SEQ_CST);
      }
    }
    ASSERT_EQ(kill(manager.pid(), SIGCONT), 0);
    if (*abandoned) {  // unclaimed when stopped: its pages were never written; try again
      EXPECT_EQ(std::memcmp(kv + (kPages / 2) * kPage, std::vector<uint8_t>(kPage, 0xee).data(), kPage), 0);
      munmap(kv, kPage * kPages);
      EXPECT_TRUE(EventuallyIdle(*observer));
      continue;
    }
    ASSERT_TRUE(observer->Ping().ok());  // wakes the dispatcher, which finds the corrupt rings
    std::optional<Status> outcome;
    for (int i = 0; i < 10000 && !outcome.has_value(); ++i) {
      auto polled = client->PollRestore(*handle);
      ASSERT_TRUE(polled.ok()) << polled.status();
      outcome = *polled;
      if (!outcome.has_value() && !observed_window) {
        const std::string metrics = testing::MetricsText(metrics_port);
        observed_window =
            metrics.find("orbitkv_sessions_poisoned_total{reason=\"malformed_request\"} 0") == std::string::npos &&
            metrics.find("orbitkv_sessions_poisoned_total{reason=\"malformed_request\"}") != std::string::npos;
      }
      if (!outcome.has_value()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ASSERT_TRUE(outcome.has_value()) << "a restore whose Manager lives must end";
    // Whether or not the copy beat the poison, nothing writes the pages once the client said over.
    std::vector<uint8_t> snapshot(kv + (kPages / 2) * kPage, kv + kPages * kPage);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    EXPECT_EQ(std::memcmp(snapshot.data(), kv + (kPages / 2) * kPage, snapshot.size()), 0)
        << "a page was written after the client reported the restore over";
    if (observed_window) {
      // Poisoned first: the restore's reply never came, so it ends as an error, after its copy.
      EXPECT_FALSE(outcome->ok());
      EXPECT_FALSE(client->Ping().ok());
    }
    munmap(kv, kPage * kPages);
    EXPECT_TRUE(EventuallyIdle(*observer));  // the lease and its pins went with the session
  }
  EXPECT_TRUE(observed_window) << "in no round was the session poisoned while its claimed restore was still copying";
  ASSERT_TRUE(manager.running()) << manager.LogText();
  EXPECT_TRUE(observer->Ping().ok());
}

TEST(ManagerIntegrationTest, KilledManagerIsUnavailableNotAHang) {
  ManagerProcess manager;
  auto client = Connect(manager, /*timeout_ms=*/30000);
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->Ping().ok());
  manager.Stop(SIGKILL);
  auto ping = client->Ping();
  EXPECT_EQ(ping.status().code(), StatusCode::kUnavailable) << ping.status();
  EXPECT_EQ(client->Query(1, 0, Chain(1, 1)).status().code(), StatusCode::kUnavailable);
  // A new connection explains that no Manager is there.
  ClientOptions options;
  options.socket_path = manager.socket();
  auto fresh = CacheClient::Connect(options);
  EXPECT_EQ(fresh.status().code(), StatusCode::kUnavailable);
}

TEST(ManagerIntegrationTest, SigtermDrainsAndExitsCleanly) {
  ManagerProcess manager;
  auto client = Connect(manager);
  EngineKv kv(16);
  Register(*client, 1, kv);
  ASSERT_TRUE(SaveChain(*client, 1, kv, Chain(30, 8)).ok());
  const int status = manager.Stop(SIGTERM);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_EQ(client->Ping().status().code(), StatusCode::kUnavailable);
}

TEST(ManagerIntegrationTest, OtherUidsAreRefusedUnlessAllowed) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a client as another uid";
  ManagerProcess manager({"--allow-uid", "65534"});
  ASSERT_TRUE(manager.running());
  auto as_uid = [&](uid_t uid) {
    pid_t child = fork();
    if (child == 0) {
      if (setgid(65534) != 0 || setuid(uid) != 0) _exit(10);
      ClientOptions options;
      options.socket_path = manager.socket();
      auto client = CacheClient::Connect(options);
      if (client.ok()) _exit(client.value()->Ping().ok() ? 0 : 11);
      _exit(client.status().code() == StatusCode::kPermissionDenied ? 20 : 21);
    }
    int status = 0;
    waitpid(child, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  EXPECT_EQ(as_uid(65534), 0);   // allowed
  EXPECT_EQ(as_uid(65533), 20);  // refused with PermissionDenied
  auto client = Connect(manager);
  EXPECT_TRUE(client->Ping().ok());
}

TEST(ManagerIntegrationTest, MalformedDescriptorPoisonsOnlyItsSession) {
  ManagerProcess manager;
  auto healthy = Connect(manager);
  ASSERT_NE(healthy, nullptr);
  auto raw = channel::ClientSession::Connect(manager.socket(), {});
  ASSERT_TRUE(raw.ok()) << raw.status();
  // A query whose key bytes are garbage.
  uint32_t slot = *(*raw)->AcquireSlot();
  std::memset((*raw)->slot(slot).data(), 0x5a, channel::kKeyBytes);
  channel::Descriptor d{};
  d.opcode = static_cast<uint16_t>(channel::Opcode::kQuery);
  d.arg0 = 1;
  d.arg1 = 1;  // one key
  auto id = (*raw)->Submit(d, slot, channel::kKeyBytes);
  ASSERT_TRUE(id.ok());
  auto reply = (*raw)->WaitReply(*id, Deadline::After(std::chrono::seconds(10)));
  EXPECT_FALSE(reply.ok());
  EXPECT_NE(reply.status().code(), StatusCode::kDeadlineExceeded) << reply.status();
  EXPECT_NE(reply.status().message().find("native keys"), std::string::npos) << reply.status();
  // A count that does not match the payload, on a second raw session.
  auto raw2 = *channel::ClientSession::Connect(manager.socket(), {});
  uint32_t slot2 = *raw2->AcquireSlot();
  d.arg1 = 5;
  auto id2 = raw2->Submit(d, slot2, channel::kKeyBytes);
  EXPECT_FALSE(raw2->WaitReply(*id2, Deadline::After(std::chrono::seconds(10))).ok());
  // The Manager and the other session are unaffected.
  EXPECT_TRUE(healthy->Ping().ok());
  EXPECT_GE(StatField(*healthy, "incarnation"), 1u);
}

}  // namespace
}  // namespace orbitkv
