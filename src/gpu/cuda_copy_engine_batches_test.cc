// GPU unit tests of the CUDA copy engine's batches: invalid ones refused whole, large ones in parts,
// mixed devices, backpressure, unregistering and shutting down under load, the dispatcher woken ahead
// (Expect), CopyDone re-entry. Built into gpu_copy_engine_test (cuda_copy_engine_test.cc has main).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <latch>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "base/metrics.h"
#include "gpu/cuda_copy_engine.h"
#include "gpu/cuda_copy_engine_test_util.h"

namespace orbitkv::gpu {
namespace {

using namespace test_util;  // NOLINT(build/namespaces): the tests' helpers

TEST(CudaCopyEngineTest, InvalidBatchesAreRejectedWholeWithoutCopyingOrCallingDone) {
  HostMemoryRegistry registry;
  auto engine = MakeEngine(registry);
  ASSERT_NE(engine, nullptr);
  RegisteredHostMemory pool(registry, 1 << 20);
  FillPattern(pool.data(), 1 << 20, 5);
  DeviceMemory device = MakeDeviceMemory(1 << 20);
  Poison(device);
  auto id = engine->RegisterDeviceBuffer(device.data(), 0, 1 << 20);
  auto retired = engine->RegisterDeviceBuffer(device.data(), 0, 4096);
  ASSERT_TRUE(id.ok() && retired.ok());
  ASSERT_TRUE(engine->UnregisterBuffer(*retired).ok());
  Bytes unregistered_host(4096);
  const CopyFragment good{*id, 0, pool.data(), 4096};
  auto with = [&](CopyFragment bad) { return CopyBatch{CopyDirection::kRestore, {good, bad}}; };
  struct Case {
    const char* name;
    CopyBatch batch;
    StatusCode code;
  };
  const std::vector<Case> cases = {
      {"no fragments", CopyBatch{CopyDirection::kRestore, {}}, StatusCode::kInvalidArgument},
      {"bad direction", CopyBatch{static_cast<CopyDirection>(5), {good}}, StatusCode::kInvalidArgument},
      {"null pool", with({*id, 8192, nullptr, 16}), StatusCode::kInvalidArgument},
      {"zero length", with({*id, 8192, pool.data() + 8192, 0}), StatusCode::kInvalidArgument},
      {"unknown buffer", with({BufferId{77, 1}, 0, pool.data() + 8192, 16}), StatusCode::kNotFound},
      {"stale buffer", with({*retired, 0, pool.data() + 8192, 16}), StatusCode::kNotFound},
      {"default id", with({BufferId{}, 0, pool.data() + 8192, 16}), StatusCode::kNotFound},
      {"past the buffer", with({*id, (1 << 20) - 8, pool.data() + 8192, 16}), StatusCode::kInvalidArgument},
      {"offset overflow", with({*id, UINT64_MAX, pool.data() + 8192, 16}), StatusCode::kInvalidArgument},
      {"pool not registered", with({*id, 8192, unregistered_host.data(), 16}), StatusCode::kInvalidArgument},
      {"pool runs past its range", with({*id, 8192, pool.data() + (1 << 20) - 8, 16}), StatusCode::kInvalidArgument},
  };
  for (const Case& c : cases) {
    DoneProbe probe;
    EXPECT_EQ(engine->Submit(c.batch, probe.Callback()).code(), c.code) << c.name;
    EXPECT_EQ(probe.calls(), 0) << c.name;
  }
  EXPECT_EQ(engine->Submit(CopyBatch{CopyDirection::kRestore, {good}}, nullptr).code(), StatusCode::kInvalidArgument);
  // A valid batch after all of them still completes, and the device saw only its bytes.
  ASSERT_TRUE(RunBatch(*engine, CopyBatch{CopyDirection::kRestore, {good}}).ok());
  const Bytes seen = Download(device);
  EXPECT_TRUE(std::equal(seen.begin(), seen.begin() + 4096, pool.data()));
  EXPECT_TRUE(std::all_of(seen.begin() + 4096, seen.end(), [](uint8_t b) { return b == kPoison; }));
}

// A batch of split_min_fragments or more goes to the lane in parts, each checked while the ones
// ahead copy: still one CopyDone and one batch in the metrics, byte-exact both ways. A bad fragment
// in the first part is Submit's error (nothing copied, no CopyDone); one in a later part is the
// batch's CopyDone error, once, after the parts ahead drained; the parts after it never run; no
// pin is left (the buffer unregisters).
TEST(CudaCopyEngineTest, LargeBatchesGoInPartsWithOneCompletion) {
  constexpr uint64_t kFragment = 1024;
  constexpr size_t kFragments = 12000;
  constexpr uint64_t kDeviceBytes = 16 << 20;  // 16384 slots of kFragment
  constexpr uint64_t kPoolBytes = 2 * kFragments * kFragment;
  HostMemoryRegistry registry;
  MetricsRegistry metrics;
  auto engine = MakeEngine(registry, {.split_min_fragments = 8192}, &metrics);
  ASSERT_NE(engine, nullptr);
  Counter& restores = metrics.GetCounter("orbitkv_copy_batches_total", "",
                                         {{"engine", "cuda"}, {"direction", "restore"}, {"device", "0"}});
  Counter& saves = metrics.GetCounter("orbitkv_copy_batches_total", "",
                                      {{"engine", "cuda"}, {"direction", "save"}, {"device", "0"}});
  Counter& failed = metrics.GetCounter("orbitkv_copy_failed_batches_total", "", {{"engine", "cuda"}});
  Counter& staged = metrics.GetCounter("orbitkv_copy_staged_batches_total", "", {{"engine", "cuda"}});
  Counter& restored_bytes = metrics.GetCounter("orbitkv_copy_bytes_total", "",
                                               {{"engine", "cuda"}, {"direction", "restore"}, {"device", "0"}});
  RegisteredHostMemory pool(registry, kPoolBytes);
  FillPattern(pool.data(), kFragments * kFragment, 21);
  std::memset(pool.data() + kFragments * kFragment, 0, kFragments * kFragment);
  DeviceMemory device = MakeDeviceMemory(kDeviceBytes);
  Poison(device);
  auto id = engine->RegisterDeviceBuffer(device.data(), 0, kDeviceBytes);
  ASSERT_TRUE(id.ok()) << id.status();
  std::vector<uint64_t> slots(kDeviceBytes / kFragment);
  for (uint64_t i = 0; i < slots.size(); ++i) slots[i] = i;
  std::shuffle(slots.begin(), slots.end(), std::mt19937_64(9));
  CopyBatch restore{CopyDirection::kRestore, {}};
  CopyBatch save{CopyDirection::kSave, {}};
  for (size_t i = 0; i < kFragments; ++i) {
    restore.fragments.push_back({*id, slots[i] * kFragment, pool.data() + i * kFragment, kFragment});
    save.fragments.push_back({*id, slots[i] * kFragment, pool.data() + (kFragments + i) * kFragment, kFragment});
  }
  DoneProbe restored;
  ASSERT_TRUE(engine->Submit(restore, restored.Callback()).ok());
  ASSERT_TRUE(restored.Wait().ok()) << restored.Wait();
  ASSERT_TRUE(RunBatch(*engine, save).ok());
  EXPECT_EQ(restored.calls(), 1);
  EXPECT_EQ(restores.Value(), 1u);
  EXPECT_EQ(saves.Value(), 1u);
  EXPECT_EQ(staged.Value(), 1u);  // its parts went through the ring; the batch counts once
  EXPECT_EQ(restored_bytes.Value(), kFragments * kFragment);
  Bytes expected(kDeviceBytes, kPoison);
  for (const CopyFragment& f : restore.fragments) {
    std::memcpy(expected.data() + f.buffer_offset, f.pool, f.length);
  }
  EXPECT_TRUE(Download(device) == expected) << "a restore in parts differs";
  EXPECT_EQ(std::memcmp(pool.data(), pool.data() + kFragments * kFragment, kFragments * kFragment), 0)
      << "a save in parts differs";

  // A bad buffer in the first part: refused whole, as a small batch is.
  CopyBatch early = restore;
  early.fragments[10].buffer = BufferId{77, 1};
  DoneProbe never;
  EXPECT_EQ(engine->Submit(early, never.Callback()).code(), StatusCode::kNotFound);
  EXPECT_EQ(never.calls(), 0);
  // A bad buffer in the second part (fragments 512 to 2048) or the third (2048 on), or a fragment
  // of zero bytes there: the batch fails through its CopyDone, the parts ahead were copied, and
  // nothing from the bad part on ran.
  uint64_t failures = 0;
  for (const auto& [bad, part_start, zero_length] :
       {std::tuple<size_t, size_t, bool>{1000, CudaCopyEngine::kFirstPartFragments, false},
        std::tuple<size_t, size_t, bool>{3000, CudaCopyEngine::kSecondPartEnd, false},
        std::tuple<size_t, size_t, bool>{5000, CudaCopyEngine::kSecondPartEnd, true}}) {
    Poison(device);
    CopyBatch late = restore;
    if (zero_length) {
      late.fragments[bad].length = 0;
    } else {
      late.fragments[bad].buffer = BufferId{77, 1};
    }
    DoneProbe failing;
    ASSERT_TRUE(engine->Submit(late, failing.Callback()).ok());
    const Status status = failing.Wait();
    EXPECT_EQ(status.code(), zero_length ? StatusCode::kInvalidArgument : StatusCode::kNotFound) << status;
    EXPECT_NE(status.message().find(fmt::format("part from fragment {}", part_start)), std::string_view::npos)
        << status;
    EXPECT_EQ(failing.calls(), 1);
    EXPECT_EQ(failed.Value(), ++failures);
    EXPECT_EQ(restores.Value(), 1u);
    EXPECT_EQ(restored_bytes.Value(), kFragments * kFragment);  // a failed batch counts no bytes
    const Bytes after = Download(device);
    for (size_t i = 0; i < kFragments; ++i) {
      const CopyFragment& f = late.fragments[i];
      const bool copied = std::equal(after.begin() + f.buffer_offset, after.begin() + f.buffer_offset + kFragment,
                                     restore.fragments[i].pool);
      const bool poisoned = std::all_of(after.begin() + f.buffer_offset, after.begin() + f.buffer_offset + kFragment,
                                        [](uint8_t b) { return b == kPoison; });
      ASSERT_TRUE(i < part_start ? copied : poisoned)
          << "bad fragment " << bad << ": fragment " << i << (i < part_start ? " was not copied" : " was copied");
    }
  }
  EXPECT_TRUE(engine->UnregisterBuffer(*id).ok());  // every part's pins are gone
}

TEST(CudaCopyEngineTest, MixedDevicesInOneBatchAreRejected) {
  int devices = 0;
  ASSERT_EQ(cudaGetDeviceCount(&devices), cudaSuccess);
  HostMemoryRegistry registry;
  auto engine = MakeEngine(registry, {.devices = {}});
  ASSERT_NE(engine, nullptr);
  RegisteredHostMemory pool(registry, 1 << 20);
  DeviceMemory zero = MakeDeviceMemory(1 << 20);
  auto a = engine->RegisterDeviceBuffer(zero.data(), 0, 1 << 20);
  ASSERT_TRUE(a.ok());
  if (devices < 2) {
    // One device: the engine serves exactly that one and refuses any other.
    EXPECT_EQ(engine->RegisterDeviceBuffer(zero.data(), 1, 4096).status().code(), StatusCode::kInvalidArgument);
    return;
  }
  auto other = DeviceMemory::Allocate(1, 1 << 20);
  ASSERT_TRUE(other.ok());
  auto b = engine->RegisterDeviceBuffer(other->data(), 1, 1 << 20);
  ASSERT_TRUE(b.ok()) << b.status();
  DoneProbe probe;
  EXPECT_EQ(
      engine
          ->Submit(CopyBatch{CopyDirection::kRestore, {{*a, 0, pool.data(), 4096}, {*b, 0, pool.data() + 4096, 4096}}},
                   probe.Callback())
          .code(),
      StatusCode::kInvalidArgument);
  EXPECT_EQ(probe.calls(), 0);
}

// The held batch's CopyDone blocks on a latch, so it stays in flight (and so does every batch
// behind it on the same lane) for as long as the test wants, with no timing involved.
TEST(CudaCopyEngineTest, BackpressureBoundsBatchesInFlight) {
  HostMemoryRegistry registry;
  auto engine = MakeEngine(registry, {.max_inflight_batches = 2});
  ASSERT_NE(engine, nullptr);
  RegisteredHostMemory pool(registry, 1 << 20);
  DeviceMemory device = MakeDeviceMemory(1 << 20);
  auto id = engine->RegisterDeviceBuffer(device.data(), 0, 1 << 20);
  ASSERT_TRUE(id.ok());
  const CopyBatch batch{CopyDirection::kRestore, {{*id, 0, pool.data(), 65536}}};
  std::latch release(1);
  std::atomic<int> completed{0};
  ASSERT_TRUE(engine
                  ->Submit(batch,
                           [&](Status s) {
                             EXPECT_TRUE(s.ok());
                             release.wait();
                             completed.fetch_add(1);
                           })
                  .ok());
  ASSERT_TRUE(engine->Submit(batch, [&](Status) { completed.fetch_add(1); }).ok());
  DoneProbe rejected;
  EXPECT_EQ(engine->Submit(batch, rejected.Callback()).code(), StatusCode::kResourceExhausted);
  // Validation comes before backpressure: an invalid batch is not told to retry.
  EXPECT_EQ(engine->Submit(CopyBatch{CopyDirection::kRestore, {}}, rejected.Callback()).code(),
            StatusCode::kInvalidArgument);
  // A save goes to another lane but counts against the same bound.
  EXPECT_EQ(engine->Submit(CopyBatch{CopyDirection::kSave, batch.fragments}, rejected.Callback()).code(),
            StatusCode::kResourceExhausted);
  release.count_down();
  engine->Shutdown();
  EXPECT_EQ(completed.load(), 2);
  EXPECT_EQ(rejected.calls(), 0);
}

TEST(CudaCopyEngineTest, UnregisterWaitsForBatchesInFlightThenRetiresTheId) {
  HostMemoryRegistry registry;
  auto engine = MakeEngine(registry);
  ASSERT_NE(engine, nullptr);
  RegisteredHostMemory pool(registry, 1 << 20);
  FillPattern(pool.data(), 1 << 20, 9);
  DeviceMemory device = MakeDeviceMemory(1 << 20);
  auto id = engine->RegisterDeviceBuffer(device.data(), 0, 1 << 20);
  ASSERT_TRUE(id.ok());
  const CopyBatch batch{CopyDirection::kRestore, {{*id, 0, pool.data(), 1 << 20}}};
  std::latch entered(1), release(1);
  ASSERT_TRUE(engine
                  ->Submit(batch,
                           [&](Status s) {
                             EXPECT_TRUE(s.ok());
                             entered.count_down();
                             release.wait();
                           })
                  .ok());
  entered.wait();
  std::atomic<bool> unregistered{false};
  Status unregister_status;
  std::thread unregisterer([&] {
    unregister_status = engine->UnregisterBuffer(*id);
    unregistered.store(true);
  });
  // The id turns NotFound for new batches as soon as UnregisterBuffer started.
  DoneProbe probe;
  while (engine->Submit(batch, probe.Callback()).code() != StatusCode::kNotFound) {
    // Accepted before the unregistering began: it completes after the held batch.
    std::this_thread::yield();
  }
  EXPECT_FALSE(unregistered.load()) << "UnregisterBuffer returned while a batch was in flight";
  release.count_down();
  unregisterer.join();
  EXPECT_TRUE(unregister_status.ok()) << unregister_status;
  EXPECT_EQ(engine->UnregisterBuffer(*id).code(), StatusCode::kNotFound);
  const Bytes seen = Download(device);
  EXPECT_TRUE(std::equal(seen.begin(), seen.end(), pool.data()));
}

// Expect() wakes a lane ahead of its batch: the dispatcher wakes without a batch queued (counted),
// and whether the batch comes while it polls for it, after it went back to sleep, or never
// (Shutdown then still returns), every batch is copied once. A hint naming no registered buffer or
// no direction is ignored, and with wake_ahead_us 0 nothing wakes ahead.
TEST(CudaCopyEngineTest, ExpectWakesTheLaneAheadOfItsBatch) {
  HostMemoryRegistry registry;
  MetricsRegistry metrics, late_metrics;
  auto engine = MakeEngine(registry, {.wake_ahead_us = 2000}, &metrics);
  auto late_engine = MakeEngine(registry, {.wake_ahead_us = 0}, &late_metrics);
  ASSERT_NE(engine, nullptr);
  ASSERT_NE(late_engine, nullptr);
  const Counter& wakeups = metrics.GetCounter("orbitkv_copy_wakeups_ahead_total", "", {{"engine", "cuda"}});
  const Counter& late_wakeups = late_metrics.GetCounter("orbitkv_copy_wakeups_ahead_total", "", {{"engine", "cuda"}});
  constexpr uint64_t kBatchBytes = 1 << 20;
  constexpr int kBatches = 3;
  RegisteredHostMemory pool(registry, kBatches * kBatchBytes);
  FillPattern(pool.data(), pool.size(), 12);
  DeviceMemory device = MakeDeviceMemory(kBatches * kBatchBytes);
  Poison(device);
  auto id = engine->RegisterDeviceBuffer(device.data(), 0, device.size());
  auto late_id = late_engine->RegisterDeviceBuffer(device.data(), 0, device.size());
  ASSERT_TRUE(id.ok() && late_id.ok());
  engine->Expect(BufferId{id->index + 7, 1}, CopyDirection::kRestore);  // no such buffer
  engine->Expect(BufferId{id->index, id->generation + 1}, CopyDirection::kSave);
  engine->Expect(*id, static_cast<CopyDirection>(5));  // no such direction (or lane)
  const auto batch = [&](BufferId buffer, int i) {
    CopyBatch b{CopyDirection::kRestore, {}};
    for (uint64_t o = 0; o < kBatchBytes; o += 16384) {
      b.fragments.push_back({buffer, i * kBatchBytes + o, pool.data() + i * kBatchBytes + o, 16384});
    }
    return b;
  };
  // Until the dispatcher has woken for `count` hints in all (a hang guard, not a timing check).
  const auto await_wakeups = [&](uint64_t count) {
    for (int i = 0; i < 10000 && wakeups.Value() < count; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return wakeups.Value() >= count;
  };
  for (int i = 0; i < kBatches; ++i) {
    const uint64_t before = wakeups.Value();
    engine->Expect(*id, CopyDirection::kRestore);
    // 0: the batch comes at once; 1: once the dispatcher woke for it; 2: after it slept again.
    if (i >= 1) {
      ASSERT_TRUE(await_wakeups(before + 1)) << "the dispatcher never woke ahead of batch " << i;
    }
    if (i == 2) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    EXPECT_TRUE(RunBatch(*engine, batch(*id, i)).ok()) << "batch " << i;
  }
  const Bytes seen = Download(device);
  EXPECT_TRUE(std::equal(seen.begin(), seen.end(), pool.data()));
  // Without the wake-ahead, neither Expect nor Submit wakes the dispatcher before a batch.
  Poison(device);
  late_engine->Expect(*late_id, CopyDirection::kRestore);
  EXPECT_TRUE(RunBatch(*late_engine, batch(*late_id, 0)).ok());
  EXPECT_EQ(late_wakeups.Value(), 0u);
  const Bytes late_seen = Download(device);
  EXPECT_TRUE(std::equal(late_seen.begin(), late_seen.begin() + kBatchBytes, pool.data()));
  engine->Expect(*id, CopyDirection::kRestore);  // a batch that never comes
  engine->Expect(*id, CopyDirection::kSave);
  engine->Shutdown();
  DoneProbe late;
  EXPECT_EQ(engine->Submit(batch(*id, 0), late.Callback()).code(), StatusCode::kUnavailable);
  EXPECT_EQ(late.calls(), 0);
}

// Where a batch's parts end: a first of kFirstPartFragments, a second to kSecondPartEnd unless
// the rest would be shorter than the first, then even parts of at least kPartFragments where
// there are that many, kMaxParts at most, the last ending at the batch's end.
TEST(CudaCopyEngineTest, PartEndsCoverTheBatchInAscendingParts) {
  using E = CudaCopyEngine;
  EXPECT_EQ(E::PartEnds(513), (std::vector<size_t>{512, 513}));
  EXPECT_EQ(E::PartEnds(2048), (std::vector<size_t>{512, 2048}));
  EXPECT_EQ(E::PartEnds(2559), (std::vector<size_t>{512, 2559}));
  EXPECT_EQ(E::PartEnds(2560), (std::vector<size_t>{512, 2048, 2560}));
  EXPECT_EQ(E::PartEnds(4096), (std::vector<size_t>{512, 2048, 4096}));
  EXPECT_EQ(E::PartEnds(12000), (std::vector<size_t>{512, 2048, 7024, 12000}));
  for (const size_t n : {size_t{513}, size_t{4097}, size_t{18432}, size_t{36864}, size_t{30720}, size_t{1} << 20}) {
    const std::vector<size_t> ends = E::PartEnds(n);
    ASSERT_GE(ends.size(), 2u) << n;
    EXPECT_LE(ends.size(), E::kMaxParts) << n;
    EXPECT_EQ(ends.front(), E::kFirstPartFragments) << n;
    EXPECT_EQ(ends.back(), n);
    for (size_t k = 1; k < ends.size(); ++k) EXPECT_LT(ends[k - 1], ends[k]) << n;
    for (size_t k = 3; k < ends.size(); ++k) {  // the even parts
      EXPECT_GE(ends[k] - ends[k - 1], E::kPartFragments) << n;
    }
  }
  EXPECT_EQ(E::PartEnds(size_t{1} << 20).size(), E::kMaxParts);
}

TEST(CudaCopyEngineTest, ShutdownDrainsAcceptedBatchesThenRefusesNewOnes) {
  HostMemoryRegistry registry;
  auto engine = MakeEngine(registry);
  ASSERT_NE(engine, nullptr);
  constexpr uint64_t kBatchBytes = 4 << 20;
  constexpr int kBatches = 16;
  RegisteredHostMemory pool(registry, kBatches * kBatchBytes);
  FillPattern(pool.data(), pool.size(), 11);
  DeviceMemory device = MakeDeviceMemory(kBatches * kBatchBytes);
  Poison(device);
  auto id = engine->RegisterDeviceBuffer(device.data(), 0, device.size());
  ASSERT_TRUE(id.ok());
  std::vector<DoneProbe> probes(kBatches);
  for (int i = 0; i < kBatches; ++i) {
    const uint64_t offset = i * kBatchBytes;
    // Fragments of 16 KiB each, so every batch is a real gather.
    CopyBatch batch{CopyDirection::kRestore, {}};
    for (uint64_t o = 0; o < kBatchBytes; o += 16384) {
      batch.fragments.push_back({*id, offset + o, pool.data() + offset + o, 16384});
    }
    ASSERT_TRUE(engine->Submit(std::move(batch), probes[i].Callback()).ok());
  }
  engine->Shutdown();
  for (DoneProbe& probe : probes) {
    EXPECT_EQ(probe.calls(), 1);
    EXPECT_TRUE(probe.Wait().ok());
    EXPECT_NE(probe.thread(), std::this_thread::get_id());
  }
  const Bytes seen = Download(device);
  EXPECT_TRUE(std::equal(seen.begin(), seen.end(), pool.data()));
  DoneProbe late;
  EXPECT_EQ(engine->Submit(CopyBatch{CopyDirection::kRestore, {{*id, 0, pool.data(), 16}}}, late.Callback()).code(),
            StatusCode::kUnavailable);
  engine->Shutdown();  // Idempotent.
  EXPECT_EQ(late.calls(), 0);
}

TEST(CudaCopyEngineTest, CopyDoneMaySubmitAndSavesOverlapRestores) {
  HostMemoryRegistry registry;
  auto engine = MakeEngine(registry);
  ASSERT_NE(engine, nullptr);
  constexpr uint64_t kBytes = 8 << 20;
  RegisteredHostMemory pool(registry, 2 * kBytes);
  FillPattern(pool.data(), kBytes, 12);
  DeviceMemory device = MakeDeviceMemory(2 * kBytes);
  Bytes upper(kBytes);
  FillPattern(upper.data(), kBytes, 13);
  ASSERT_EQ(cudaMemcpy(device.data() + kBytes, upper.data(), kBytes, cudaMemcpyHostToDevice), cudaSuccess);
  auto id = engine->RegisterDeviceBuffer(device.data(), 0, device.size());
  ASSERT_TRUE(id.ok());
  // A restore of the lower half whose CopyDone submits a save of the upper half.
  DoneProbe save_probe;
  DoneProbe restore_probe;
  CopyDone chained = [&, inner = restore_probe.Callback()](Status s) {
    const Status submitted = engine->Submit(
        CopyBatch{CopyDirection::kSave, {{*id, kBytes, pool.data() + kBytes, kBytes}}}, save_probe.Callback());
    EXPECT_TRUE(submitted.ok()) << submitted;
    inner(std::move(s));
  };
  ASSERT_TRUE(engine->Submit(CopyBatch{CopyDirection::kRestore, {{*id, 0, pool.data(), kBytes}}}, chained).ok());
  EXPECT_TRUE(restore_probe.Wait().ok());
  EXPECT_TRUE(save_probe.Wait().ok());
  EXPECT_TRUE(std::equal(upper.begin(), upper.end(), pool.data() + kBytes));
  Bytes lower(kBytes);
  ASSERT_EQ(cudaMemcpy(lower.data(), device.data(), kBytes, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_TRUE(std::equal(lower.begin(), lower.end(), pool.data()));
}

}  // namespace
}  // namespace orbitkv::gpu
