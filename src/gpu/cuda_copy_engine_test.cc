// GPU unit tests of the CUDA copy engine and the host memory registry (the batch tests are in
// cuda_copy_engine_batches_test.cc). They need a CUDA device: the
// binary is built everywhere nvcc is found but is not registered with ctest; tests/gpu/run_gate.sh
// runs it on the GPU machine. Without a device every test fails (none is skipped).
//
// The binary doubles as the exporting process of the IPC test: run with --ipc-exporter it
// allocates device memory, fills it, prints the IPC handle and checks what the parent wrote.
#include "gpu/cuda_copy_engine.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <latch>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "base/metrics.h"
#include "base/mutex.h"
#include "core/slab_pool.h"
#include "gpu/cuda_copy_engine_test_util.h"
#include "gpu/cuda_util.h"

extern char** environ;

namespace orbitkv::gpu {
namespace {

using namespace test_util;  // NOLINT(build/namespaces): the tests' helpers

// ---------------------------------------------------------------------------------------------

TEST(HostMemoryRegistryTest, RegistersAndTranslatesRanges) {
  HostMemoryRegistry registry;
  RegisteredHostMemory memory(registry, 1 << 20);
  uint8_t* const base = memory.data();
  uint8_t* const device = registry.Translate(base, 1);
  ASSERT_NE(device, nullptr);
  EXPECT_EQ(registry.Translate(base + 100, 50), device + 100);
  EXPECT_EQ(registry.Translate(base, 1 << 20), device);
  EXPECT_EQ(registry.Translate(base + (1 << 20) - 1, 1), device + (1 << 20) - 1);
  EXPECT_EQ(registry.Translate(base + (1 << 20) - 1, 2), nullptr);  // Runs past the end.
  EXPECT_EQ(registry.Translate(base - 1, 1), nullptr);
  EXPECT_EQ(registry.Translate(base + (1 << 20), 1), nullptr);
  EXPECT_EQ(registry.Translate(base + 8, UINT64_MAX), nullptr);
  ASSERT_EQ(registry.Snapshot().size(), 1u);
  // Overlapping, null, empty and wrapping ranges are refused.
  EXPECT_EQ(registry.Register(base + 4096, 4096, -1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.Register(nullptr, 4096, -1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.Register(base, 0, -1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.Register(base, UINT64_MAX, -1).code(), StatusCode::kInvalidArgument);
  // The device can read the range: a copy through the mapped address sees the host bytes.
  FillPattern(base, 4096, 7);
  Bytes seen(4096);
  ASSERT_EQ(cudaMemcpy(seen.data(), device, 4096, cudaMemcpyDefault), cudaSuccess);
  EXPECT_TRUE(std::equal(seen.begin(), seen.end(), base));
}

TEST(HostMemoryRegistryTest, RegistersPoolArenasThroughTheArenaRegistrarSeam) {
  HostMemoryRegistry registry;
  core::PoolOptions options;
  options.capacity_bytes = 8 << 20;
  options.numa_nodes = {-1};
  options.slab_bytes = 1 << 20;
  options.pin_mode = core::PinMode::kAllowUnpinned;
  options.registrar = &registry;
  {
    auto pool = core::PinnedPool::Create(options, nullptr);
    ASSERT_TRUE(pool.ok()) << pool.status();
    const core::PinnedArena& arena = (*pool)->arena(0);
    ASSERT_EQ(registry.Snapshot().size(), 1u);
    EXPECT_NE(registry.Translate(arena.data(), arena.size()), nullptr);
  }
  // The pool unregistered its arena when it was destroyed.
  EXPECT_TRUE(registry.Snapshot().empty());
}

TEST(CudaCopyEngineTest, CreateRejectsOptionsOutOfRange) {
  HostMemoryRegistry registry;
  int devices = 0;
  ASSERT_EQ(cudaGetDeviceCount(&devices), cudaSuccess);
  ASSERT_GE(devices, 1);
  auto code = [&](CudaCopyEngine::Options options, const HostMemoryRegistry* r) {
    return CudaCopyEngine::Create(std::move(options), r, nullptr).status().code();
  };
  EXPECT_EQ(code({}, nullptr), StatusCode::kInvalidArgument);
  EXPECT_EQ(code({.max_inflight_batches = 0}, &registry), StatusCode::kInvalidArgument);
  EXPECT_EQ(code({.chunk_bytes = 0}, &registry), StatusCode::kInvalidArgument);
  EXPECT_EQ(code({.chunk_bytes = 4095}, &registry), StatusCode::kInvalidArgument);
  EXPECT_EQ(code({.chunk_bytes = 4096 + 16}, &registry), StatusCode::kInvalidArgument);
  EXPECT_EQ(code({.chunk_bytes = CudaCopyEngine::kMaxChunkBytes * 2}, &registry), StatusCode::kInvalidArgument);
  EXPECT_EQ(code({.blocks_per_sm = 0}, &registry), StatusCode::kInvalidArgument);
  EXPECT_EQ(code({.blocks_per_sm = CudaCopyEngine::kMaxBlocksPerSm + 1}, &registry), StatusCode::kInvalidArgument);
  EXPECT_EQ(code({.devices = {-1}}, &registry), StatusCode::kInvalidArgument);
  EXPECT_EQ(code({.devices = {devices}}, &registry), StatusCode::kInvalidArgument);
  EXPECT_EQ(code({.devices = {0, 0}}, &registry), StatusCode::kInvalidArgument);
  EXPECT_EQ(code({.streams_per_lane = 0}, &registry), StatusCode::kInvalidArgument);
  EXPECT_EQ(code({.streams_per_lane = CudaCopyEngine::kMaxStreamsPerLane + 1}, &registry),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(code({.method = static_cast<Method>(7)}, &registry), StatusCode::kInvalidArgument);
  EXPECT_EQ(code({.dma_min_fragment_bytes = 0}, &registry), StatusCode::kInvalidArgument);
  EXPECT_EQ(code({.restore_staging_bytes = 4096}, &registry), StatusCode::kInvalidArgument);
  EXPECT_EQ(code({.staged_min_run_bytes = 0}, &registry), StatusCode::kInvalidArgument);
  EXPECT_EQ(code({.staged_max_fragment_bytes = 0}, &registry), StatusCode::kInvalidArgument);
  EXPECT_EQ(code({.ring_timeline_slots = CudaCopyEngine::kMaxRingTimelineSlots + 1}, &registry),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(code({.wake_ahead_us = CudaCopyEngine::kMaxWakeAheadUs + 1}, &registry), StatusCode::kInvalidArgument);
  auto engine = CudaCopyEngine::Create({}, &registry, nullptr);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ((*engine)->name(), "cuda");
  EXPECT_EQ((*engine)->options().devices.size(), static_cast<size_t>(devices));
}

TEST(CudaCopyEngineTest, RegisterDeviceBufferValidatesAndIssuesDistinctIds) {
  HostMemoryRegistry registry;
  auto engine = MakeEngine(registry);
  ASSERT_NE(engine, nullptr);
  DeviceMemory a = MakeDeviceMemory(1 << 20);
  Bytes host(4096);
  EXPECT_EQ(engine->RegisterDeviceBuffer(nullptr, 0, 64).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(engine->RegisterDeviceBuffer(a.data(), 0, 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(engine->RegisterDeviceBuffer(a.data(), 99, 64).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(engine->RegisterDeviceBuffer(host.data(), 0, 64).status().code(), StatusCode::kInvalidArgument);
  // Past the end of the allocation, from its start and from inside it.
  EXPECT_EQ(engine->RegisterDeviceBuffer(a.data(), 0, (1 << 20) + 1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(engine->RegisterDeviceBuffer(a.data() + 4096, 0, 1 << 20).status().code(), StatusCode::kInvalidArgument);
  auto first = engine->RegisterDeviceBuffer(a.data(), 0, 1 << 20);
  auto second = engine->RegisterDeviceBuffer(a.data() + 4096, 0, (1 << 20) - 4096);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_NE(*first, *second);
  EXPECT_NE(first->generation, 0u);
  ASSERT_TRUE(engine->UnregisterBuffer(*first).ok());
  EXPECT_EQ(engine->UnregisterBuffer(*first).code(), StatusCode::kNotFound);
  // The slot is reused under a new generation; the old id stays unknown.
  auto third = engine->RegisterDeviceBuffer(a.data(), 0, 4096);
  ASSERT_TRUE(third.ok());
  EXPECT_EQ(third->index, first->index);
  EXPECT_NE(third->generation, first->generation);
  EXPECT_EQ(engine->UnregisterBuffer(*first).code(), StatusCode::kNotFound);
}

TEST(CudaCopyEngineTest, RegisterIpcBufferRefusesBadHandles) {
  HostMemoryRegistry registry;
  auto engine = MakeEngine(registry);
  ASSERT_NE(engine, nullptr);
  Bytes short_handle(CudaCopyEngine::kIpcHandleBytes - 1, 0);
  EXPECT_EQ(engine->RegisterIpcBuffer(short_handle, 0, 4096).status().code(), StatusCode::kInvalidArgument);
  Bytes garbage(CudaCopyEngine::kIpcHandleBytes);
  FillPattern(garbage.data(), garbage.size(), 3);
  EXPECT_EQ(engine->RegisterIpcBuffer(garbage, 0, 4096).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(engine->RegisterIpcBuffer(garbage, 0, 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(engine->RegisterIpcBuffer(garbage, 99, 4096).status().code(), StatusCode::kInvalidArgument);
  // A handle of this process's own memory cannot be opened here.
  DeviceMemory own = MakeDeviceMemory(1 << 20);
  cudaIpcMemHandle_t handle;
  ASSERT_EQ(cudaIpcGetMemHandle(&handle, own.data()), cudaSuccess);
  EXPECT_EQ(
      engine->RegisterIpcBuffer({reinterpret_cast<const uint8_t*>(&handle), sizeof(handle)}, 0, 4096).status().code(),
      StatusCode::kInvalidArgument);
}

// Byte-exact restore and save of fragments of 1 byte to 6 MiB at every relative alignment: by the
// kernel alone (at two chunk sizes: 4 KiB splits every large fragment into many warps' work), by
// cudaMemcpyBatchAsync alone, and by kAuto's choice (the copy engines for these large fragments, or
// the kernel when the threshold is raised).
struct MethodCase {
  const char* name;
  CudaCopyEngine::Options options;
};

class CudaCopyEngineMethodTest : public ::testing::TestWithParam<MethodCase> {};

std::string MethodCaseName(const ::testing::TestParamInfo<MethodCase>& info) { return info.param.name; }

TEST_P(CudaCopyEngineMethodTest, RestoreAndSaveAreByteExact) {
  const CudaCopyEngine::Options& options = GetParam().options;
  HostMemoryRegistry registry;
  MetricsRegistry metrics;
  auto engine = MakeEngine(registry, options, &metrics);
  ASSERT_NE(engine, nullptr);
  constexpr uint64_t kBytes = 24 << 20;
  RegisteredHostMemory pool(registry, kBytes);
  DeviceMemory device = MakeDeviceMemory(kBytes);
  auto id = engine->RegisterDeviceBuffer(device.data(), 0, kBytes);
  ASSERT_TRUE(id.ok()) << id.status();
  std::mt19937_64 rng(42 + static_cast<int>(options.method) + options.chunk_bytes + options.dma_min_fragment_bytes);
  const std::vector<CopyFragment> fragments = MixedFragments(*id, kBytes, pool.data(), kBytes, rng);
  uint64_t total = 0;
  for (const CopyFragment& f : fragments) total += f.length;

  // Restore: pool (random) -> device (poisoned).
  FillPattern(pool.data(), kBytes, 1);
  Poison(device);
  ASSERT_TRUE(RunBatch(*engine, CopyBatch{CopyDirection::kRestore, fragments}).ok());
  Bytes expected(kBytes, kPoison);
  for (const CopyFragment& f : fragments) {
    std::memcpy(expected.data() + f.buffer_offset, f.pool, f.length);
  }
  EXPECT_TRUE(Download(device) == expected) << "restored bytes differ";

  // Save: device (random) -> pool (poisoned).
  Bytes source(kBytes);
  FillPattern(source.data(), kBytes, 2);
  Upload(device, source.data(), kBytes);
  std::memset(pool.data(), kPoison, kBytes);
  ASSERT_TRUE(RunBatch(*engine, CopyBatch{CopyDirection::kSave, fragments}).ok());
  Bytes pool_expected(kBytes, kPoison);
  for (const CopyFragment& f : fragments) {
    std::memcpy(pool_expected.data() + (f.pool - pool.data()), source.data() + f.buffer_offset, f.length);
  }
  EXPECT_TRUE(std::equal(pool_expected.begin(), pool_expected.end(), pool.data())) << "saved bytes differ";

  auto counter = [&](const char* direction) {
    return metrics
        .GetCounter("orbitkv_copy_bytes_total", "", {{"engine", "cuda"}, {"direction", direction}, {"device", "0"}})
        .Value();
  };
  EXPECT_EQ(counter("restore"), total);
  EXPECT_EQ(counter("save"), total);
  EXPECT_EQ(metrics.GetGauge("orbitkv_copy_inflight_batches", "", {{"engine", "cuda"}}).Value(), 0.0);
}

INSTANTIATE_TEST_SUITE_P(
    Methods, CudaCopyEngineMethodTest,
    ::testing::Values(MethodCase{"Kernel", {.chunk_bytes = 64 << 10, .method = Method::kKernel}},
                      MethodCase{"KernelChunk4k", {.chunk_bytes = 4 << 10, .method = Method::kKernel}},
                      MethodCase{"MemcpyBatch", {.method = Method::kMemcpyBatch}},
                      MethodCase{"AutoCopyEngines", {.method = Method::kAuto}},
                      MethodCase{"AutoKernel", {.method = Method::kAuto, .dma_min_fragment_bytes = 64 << 20}},
                      // The completer polling near each batch's end (the default), and blocking in
                      // cudaEventSynchronize instead.
                      MethodCase{"AutoPollingCompletion", {.method = Method::kAuto, .completion_poll_us = 200}},
                      MethodCase{"KernelPollingCompletion", {.method = Method::kKernel, .completion_poll_us = 200}},
                      MethodCase{"AutoBlockingCompletion", {.method = Method::kAuto, .completion_poll_us = 0}},
                      MethodCase{"KernelBlockingCompletion", {.method = Method::kKernel, .completion_poll_us = 0}},
                      // The dispatcher woken only when a batch is queued, not ahead of it.
                      MethodCase{"AutoNoWakeAhead", {.method = Method::kAuto, .wake_ahead_us = 0}}),
    MethodCaseName);

// kAuto sends batches of large fragments to the copy engines and small ones to the kernel; both
// paths copy the same bytes, both ways.
TEST(CudaCopyEngineTest, AutoChoosesThePathByFragmentSize) {
  constexpr uint64_t kBytes = 8 << 20;
  struct Case {
    uint64_t fragment;
    bool copy_engines;
  };
  for (const Case c : {Case{16 << 10, false}, Case{256 << 10, true}}) {
    SCOPED_TRACE(fmt::format("fragment {}", c.fragment));
    HostMemoryRegistry registry;
    MetricsRegistry metrics;
    auto engine = MakeEngine(registry, {.dma_min_fragment_bytes = 64 << 10}, &metrics);
    ASSERT_NE(engine, nullptr);
    Counter& dma = metrics.GetCounter("orbitkv_copy_dma_batches_total", "", {{"engine", "cuda"}});
    RegisteredHostMemory pool(registry, kBytes);
    DeviceMemory device = MakeDeviceMemory(kBytes);
    auto id = engine->RegisterDeviceBuffer(device.data(), 0, kBytes);
    ASSERT_TRUE(id.ok());
    FillPattern(pool.data(), kBytes, c.fragment);
    Poison(device);
    CopyBatch batch{CopyDirection::kRestore, {}};
    // Every other fragment slot, reversed, so the copies really scatter.
    for (uint64_t o = 0; o + 2 * c.fragment <= kBytes; o += 2 * c.fragment) {
      batch.fragments.push_back({*id, kBytes - 2 * c.fragment - o, pool.data() + o, c.fragment});
    }
    ASSERT_TRUE(RunBatch(*engine, batch).ok());
    EXPECT_EQ(dma.Value(), c.copy_engines ? 1u : 0u);  // The save below is counted later.
    const Bytes seen = Download(device);
    Bytes expected(kBytes, kPoison);
    for (const CopyFragment& f : batch.fragments) {
      std::memcpy(expected.data() + f.buffer_offset, f.pool, f.length);
    }
    EXPECT_TRUE(seen == expected);
    // And back: save the restored pages into the poisoned pool.
    std::memset(pool.data(), kPoison, kBytes);
    ASSERT_TRUE(RunBatch(*engine, CopyBatch{CopyDirection::kSave, batch.fragments}).ok());
    for (const CopyFragment& f : batch.fragments) {
      EXPECT_EQ(std::memcmp(f.pool, expected.data() + f.buffer_offset, f.length), 0);
    }
  }
}

// A restore whose pool side is one long run (as a block's pages are) goes through the staging ring:
// fragments of many sizes, some larger than a slot and most cut by a slot's end, land byte-exact
// in shuffled pages; two such batches in a row share the ring's slots; a batch whose pool side is
// scattered is not staged and lands byte-exact too.
TEST(CudaCopyEngineTest, RestoresOfLongPoolRunsAreStagedThroughTheRing) {
  constexpr uint64_t kSlot = 64 << 10;
  HostMemoryRegistry registry;
  MetricsRegistry metrics;
  auto engine = MakeEngine(
      registry, {.restore_staging_bytes = CudaCopyEngine::kStagingSlots * kSlot, .staged_min_run_bytes = 4096},
      &metrics);
  ASSERT_NE(engine, nullptr);
  Counter& staged = metrics.GetCounter("orbitkv_copy_staged_batches_total", "", {{"engine", "cuda"}});
  constexpr uint64_t kBytes = 4 << 20;
  RegisteredHostMemory pool(registry, kBytes);
  DeviceMemory device = MakeDeviceMemory(kBytes);
  auto id = engine->RegisterDeviceBuffer(device.data(), 0, kBytes);
  ASSERT_TRUE(id.ok()) << id.status();
  FillPattern(pool.data(), kBytes, 7);
  Poison(device);

  // Fragments back to back in the pool (one run), each given its own page of kPage bytes on the
  // device, pages in a shuffled order.
  const std::vector<uint64_t> lengths = {16384, 5000, 3 * kSlot / 2, 4097, 1, 16384, kSlot, 777};
  constexpr uint64_t kPage = 128 << 10;
  std::mt19937_64 rng(11);
  std::vector<uint64_t> pages(kBytes / kPage);
  for (uint64_t p = 0; p < pages.size(); ++p) pages[p] = p;
  std::shuffle(pages.begin(), pages.end(), rng);
  auto make_batch = [&](uint64_t pool_at, size_t first_page, size_t count, uint64_t gap, uint64_t fixed_length = 0) {
    CopyBatch batch{CopyDirection::kRestore, {}};
    for (size_t j = 0; j < count; ++j) {
      const uint64_t length = fixed_length != 0 ? fixed_length : lengths[j % lengths.size()];
      batch.fragments.push_back({*id, pages[first_page + j] * kPage, pool.data() + pool_at, length});
      pool_at += length + gap;
    }
    ORBITKV_CHECK(pool_at <= kBytes);
    return batch;
  };
  const CopyBatch first = make_batch(0, 0, 12, 0);
  const CopyBatch second = make_batch(1 << 20, 12, 9, 0);
  DoneProbe a, b;
  ASSERT_TRUE(engine->Submit(first, a.Callback()).ok());
  ASSERT_TRUE(engine->Submit(second, b.Callback()).ok());
  ASSERT_TRUE(a.Wait().ok());
  ASSERT_TRUE(b.Wait().ok());
  EXPECT_EQ(staged.Value(), 2u);
  Bytes expected(kBytes, kPoison);
  for (const CopyBatch* batch : {&first, &second}) {
    for (const CopyFragment& f : batch->fragments) {
      std::memcpy(expected.data() + f.buffer_offset, f.pool, f.length);
    }
  }
  EXPECT_TRUE(Download(device) == expected) << "staged restores differ";

  // 1000-byte fragments: with a gap after each, every run is one fragment, below
  // staged_min_run_bytes (the kernel copies them); back to back, one run (staged).
  const CopyBatch scattered = make_batch(2 << 20, 21, 6, 24, 1000);
  ASSERT_TRUE(RunBatch(*engine, scattered).ok());
  EXPECT_EQ(staged.Value(), 2u);
  const CopyBatch adjacent = make_batch(3 << 20, 27, 5, 0, 1000);
  ASSERT_TRUE(RunBatch(*engine, adjacent).ok());
  EXPECT_EQ(staged.Value(), 3u);
  for (const CopyBatch* batch : {&scattered, &adjacent}) {
    for (const CopyFragment& f : batch->fragments) {
      std::memcpy(expected.data() + f.buffer_offset, f.pool, f.length);
    }
  }
  EXPECT_TRUE(Download(device) == expected) << "restores of 1000-byte fragments differ";
}

// Whole blocks of 64 KiB pages (every layer's page of a block back to back in its slab, as an
// async restore of a Qwen3-8B-shaped model reads them) average 64 KiB a fragment, which kAuto
// would give the copy engines copy by copy; from long pool runs they are staged instead, land
// byte-exact, and the ring's timeline accounts for every byte. With staged_max_fragment_bytes at
// 64 KiB the same batch goes to the copy engines, byte-exact too.
TEST(CudaCopyEngineTest, BlocksOf64KiBPagesAreStagedBeforeTheCopyEngines) {
  constexpr uint64_t kPage = 64 << 10;
  constexpr uint64_t kPagesPerBlock = 36;  // 2.25 MiB blocks
  constexpr uint64_t kStride = 4 << 20;    // one block per 4 MiB slab
  constexpr uint64_t kBlocks = 6;
  constexpr uint64_t kSlot = 1 << 20;
  constexpr uint64_t kPoolBytes = kBlocks * kStride;
  constexpr uint64_t kDeviceBytes = 2 * kBlocks * kPagesPerBlock * kPage;
  HostMemoryRegistry registry;
  RegisteredHostMemory pool(registry, kPoolBytes);
  FillPattern(pool.data(), kPoolBytes, 31);
  DeviceMemory device = MakeDeviceMemory(kDeviceBytes);
  std::mt19937_64 rng(17);
  std::vector<uint64_t> pages(kDeviceBytes / kPage);
  for (uint64_t p = 0; p < pages.size(); ++p) pages[p] = p;
  std::shuffle(pages.begin(), pages.end(), rng);
  auto make_batch = [&](BufferId id) {
    CopyBatch batch{CopyDirection::kRestore, {}};
    for (uint64_t b = 0; b < kBlocks; ++b) {
      for (uint64_t l = 0; l < kPagesPerBlock; ++l) {
        batch.fragments.push_back(
            {id, pages[b * kPagesPerBlock + l] * kPage, pool.data() + b * kStride + l * kPage, kPage});
      }
    }
    return batch;
  };
  for (const bool staged_first : {true, false}) {
    SCOPED_TRACE(staged_first ? "staged" : "copy engines");
    MetricsRegistry metrics;
    CudaCopyEngine::Options options{.restore_staging_bytes = CudaCopyEngine::kStagingSlots * kSlot,
                                    .ring_timeline_slots = 64};
    if (!staged_first) options.staged_max_fragment_bytes = kPage;
    auto engine = MakeEngine(registry, options, &metrics);
    ASSERT_NE(engine, nullptr);
    Counter& staged = metrics.GetCounter("orbitkv_copy_staged_batches_total", "", {{"engine", "cuda"}});
    Counter& dma = metrics.GetCounter("orbitkv_copy_dma_batches_total", "", {{"engine", "cuda"}});
    auto id = engine->RegisterDeviceBuffer(device.data(), 0, kDeviceBytes);
    ASSERT_TRUE(id.ok()) << id.status();
    Poison(device);
    const CopyBatch batch = make_batch(*id);
    ASSERT_TRUE(RunBatch(*engine, batch).ok());
    EXPECT_EQ(staged.Value(), staged_first ? 1u : 0u);
    EXPECT_EQ(dma.Value(), staged_first ? 0u : 1u);
    Bytes expected(kDeviceBytes, kPoison);
    for (const CopyFragment& f : batch.fragments) {
      std::memcpy(expected.data() + f.buffer_offset, f.pool, f.length);
    }
    EXPECT_TRUE(Download(device) == expected) << "restored pages differ";
    auto timeline = engine->TakeRingTimeline(0);
    ASSERT_TRUE(timeline.ok()) << timeline.status();
    uint64_t bytes = 0;
    double last_start = 0;
    for (const CudaCopyEngine::RingSlotTiming& t : *timeline) {
      bytes += t.bytes;
      EXPECT_GE(t.runs, 1u);
      EXPECT_LE(t.runs, 2u);  // a 1 MiB slot holds pieces of at most two 2.25 MiB blocks
      EXPECT_GE(t.fill_start_ms, last_start);
      EXPECT_GE(t.fill_end_ms, t.fill_start_ms);
      EXPECT_GE(t.scatter_end_ms, t.fill_end_ms);
      last_start = t.fill_start_ms;
    }
    EXPECT_EQ(bytes, staged_first ? kBlocks * kPagesPerBlock * kPage : 0u);
    EXPECT_EQ(timeline->size(), staged_first ? (kBlocks * kPagesPerBlock * kPage + kSlot - 1) / kSlot : 0u);
    // Taken: the next call starts empty.
    auto again = engine->TakeRingTimeline(0);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_TRUE(again->empty());
    ASSERT_TRUE(engine->UnregisterBuffer(*id).ok());
  }
  // No timeline asked for, or a device the engine does not serve.
  auto plain = MakeEngine(registry, {}, nullptr);
  ASSERT_NE(plain, nullptr);
  EXPECT_EQ(plain->TakeRingTimeline(0).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(plain->TakeRingTimeline(1 << 20).status().code(), StatusCode::kInvalidArgument);
}

// Block runs with gaps between them (a slab's blocks, each holding its pages back to back): a slot
// gathers many runs, more than one cudaMemcpyBatchAsync call takes (256), some runs cut by a slot's
// end; every byte lands in its shuffled page and nothing outside the pages is written.
TEST(CudaCopyEngineTest, StagedSlotsGatherManyRunsEach) {
  constexpr uint64_t kSlot = 2 << 20;
  HostMemoryRegistry registry;
  MetricsRegistry metrics;
  auto engine = MakeEngine(registry,
                           {.restore_staging_bytes = CudaCopyEngine::kStagingSlots * kSlot,
                            .staged_min_run_bytes = 4000},  // the runs average 4093.5 bytes
                           &metrics);
  ASSERT_NE(engine, nullptr);
  Counter& staged = metrics.GetCounter("orbitkv_copy_staged_batches_total", "", {{"engine", "cuda"}});
  constexpr uint64_t kBytes = 8 << 20;
  constexpr uint64_t kDeviceBytes = 16 << 20;  // a page of kPage for each of the 2401 fragments
  constexpr uint64_t kPage = 4096;
  RegisteredHostMemory pool(registry, kBytes);
  DeviceMemory device = MakeDeviceMemory(kDeviceBytes);
  auto id = engine->RegisterDeviceBuffer(device.data(), 0, kDeviceBytes);
  ASSERT_TRUE(id.ok()) << id.status();
  FillPattern(pool.data(), kBytes, 13);
  Poison(device);
  std::mt19937_64 rng(5);
  std::vector<uint64_t> pages(kDeviceBytes / kPage);
  for (uint64_t p = 0; p < pages.size(); ++p) pages[p] = p;
  std::shuffle(pages.begin(), pages.end(), rng);
  // A 1000-byte run first, so that later runs straddle the slots' ends; then runs of two adjacent
  // fragments (3000 + 1096 bytes) with 2 KiB gaps between them.
  CopyBatch batch{CopyDirection::kRestore, {}};
  size_t page = 0;
  batch.fragments.push_back({*id, pages[page++] * kPage, pool.data(), 1000});
  uint64_t pool_at = 1000 + 2048;
  for (int run = 0; run < 1200; ++run) {
    batch.fragments.push_back({*id, pages[page++] * kPage, pool.data() + pool_at, 3000});
    batch.fragments.push_back({*id, pages[page++] * kPage, pool.data() + pool_at + 3000, 1096});
    pool_at += 4096 + 2048;
  }
  ASSERT_LE(pool_at, kBytes);
  const Status status = RunBatch(*engine, batch);
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(staged.Value(), 1u);
  Bytes expected(kDeviceBytes, kPoison);
  for (const CopyFragment& f : batch.fragments) {
    std::memcpy(expected.data() + f.buffer_offset, f.pool, f.length);
  }
  EXPECT_TRUE(Download(device) == expected) << "staged restores of block runs differ";
}

// Engine KV layouts are fragment lists: vLLM-style split K/V (per layer, a K region and a V region
// of `pages` pages each) and MLA (one latent region per layer). Pages are restored from pool
// blocks into scattered pages across several registered buffers, saved back into fresh blocks, and
// both directions are compared byte for byte.
TEST(CudaCopyEngineTest, SplitKvAndMlaLayoutsRoundTrip) {
  HostMemoryRegistry registry;
  auto engine = MakeEngine(registry);
  ASSERT_NE(engine, nullptr);
  constexpr uint32_t kLayers = 4, kPages = 64, kRestored = 40;
  constexpr uint64_t kPageBytes = 16 << 10;  // One layer's K (or V, or latent) of one page.
  for (const int parts : {2, 1}) {           // 2: split K/V, 1: MLA.
    SCOPED_TRACE(parts == 2 ? "split K/V" : "MLA");
    const uint64_t layer_bytes = parts * kPages * kPageBytes;
    const uint64_t block_bytes = kLayers * parts * kPageBytes;
    std::vector<DeviceMemory> layers;
    std::vector<BufferId> ids;
    for (uint32_t l = 0; l < kLayers; ++l) {
      layers.push_back(MakeDeviceMemory(layer_bytes));
      Poison(layers.back());
      auto id = engine->RegisterDeviceBuffer(layers.back().data(), 0, layer_bytes);
      ASSERT_TRUE(id.ok()) << id.status();
      ids.push_back(*id);
    }
    RegisteredHostMemory pool(registry, 2 * kRestored * block_bytes);
    FillPattern(pool.data(), kRestored * block_bytes, 10 + parts);
    std::mt19937_64 rng(parts);
    std::vector<uint32_t> pages(kPages);
    for (uint32_t p = 0; p < kPages; ++p) pages[p] = p;
    std::shuffle(pages.begin(), pages.end(), rng);
    // The fragments of block b (pool block b <-> engine page pages[b]) in pool order: layer, part.
    auto block_fragments = [&](uint32_t b, uint8_t* block) {
      std::vector<CopyFragment> out;
      for (uint32_t l = 0; l < kLayers; ++l) {
        for (int part = 0; part < parts; ++part) {
          const uint64_t engine_offset = (part * kPages + pages[b]) * kPageBytes;
          out.push_back(CopyFragment{ids[l], engine_offset, block + (l * parts + part) * kPageBytes, kPageBytes});
        }
      }
      return out;
    };
    CopyBatch restore{CopyDirection::kRestore, {}};
    CopyBatch save{CopyDirection::kSave, {}};
    for (uint32_t b = 0; b < kRestored; ++b) {
      for (const CopyFragment& f : block_fragments(b, pool.data() + b * block_bytes)) {
        restore.fragments.push_back(f);
      }
      uint8_t* fresh = pool.data() + (kRestored + b) * block_bytes;
      for (const CopyFragment& f : block_fragments(b, fresh)) save.fragments.push_back(f);
    }
    ASSERT_TRUE(RunBatch(*engine, restore).ok());
    // Every restored page holds its block's bytes; every other page is still poison.
    for (uint32_t l = 0; l < kLayers; ++l) {
      const Bytes seen = Download(layers[l]);
      Bytes expected(layer_bytes, kPoison);
      for (const CopyFragment& f : restore.fragments) {
        if (f.buffer == ids[l]) std::memcpy(expected.data() + f.buffer_offset, f.pool, f.length);
      }
      EXPECT_TRUE(seen == expected) << "layer " << l;
    }
    std::memset(pool.data() + kRestored * block_bytes, kPoison, kRestored * block_bytes);
    ASSERT_TRUE(RunBatch(*engine, save).ok());
    EXPECT_EQ(std::memcmp(pool.data(), pool.data() + kRestored * block_bytes, kRestored * block_bytes), 0);
    for (const BufferId id : ids) ASSERT_TRUE(engine->UnregisterBuffer(id).ok());
  }
}

// --- The IPC test: a child process exports device memory; this process imports it. ---

constexpr char kExporterFlag[] = "--ipc-exporter";
constexpr uint64_t kIpcBytes = 8 << 20;
constexpr uint64_t kIpcSeed = 21, kIpcRestoreSeed = 22;

// The exporter: allocates kIpcBytes on device 0, fills them with pattern kIpcSeed, writes the
// handle as hex on one line, then waits for a line on stdin and checks that the parent restored
// pattern kIpcRestoreSeed into [kIpcBytes / 2, kIpcBytes). Exit 0 when it did.
int RunIpcExporter() {
  void* memory = nullptr;
  if (cudaMalloc(&memory, kIpcBytes) != cudaSuccess) return 2;
  Bytes bytes(kIpcBytes);
  FillPattern(bytes.data(), kIpcBytes, kIpcSeed);
  if (cudaMemcpy(memory, bytes.data(), kIpcBytes, cudaMemcpyHostToDevice) != cudaSuccess) return 3;
  cudaIpcMemHandle_t handle;
  if (cudaIpcGetMemHandle(&handle, memory) != cudaSuccess) return 4;
  const auto* raw = reinterpret_cast<const uint8_t*>(&handle);
  for (size_t i = 0; i < sizeof(handle); ++i) std::printf("%02x", raw[i]);
  std::printf("\n");
  std::fflush(stdout);
  char line[16];
  if (std::fgets(line, sizeof(line), stdin) == nullptr) return 5;
  if (cudaMemcpy(bytes.data(), memory, kIpcBytes, cudaMemcpyDeviceToHost) != cudaSuccess) return 6;
  for (uint64_t i = 0; i < kIpcBytes / 2; ++i) {
    if (bytes[i] != PatternByte(kIpcSeed, i)) return 7;
    if (bytes[kIpcBytes / 2 + i] != PatternByte(kIpcRestoreSeed, i)) return 8;
  }
  cudaFree(memory);
  return 0;
}

TEST(CudaCopyEngineTest, ImportsAnotherProcessesBufferThroughIpc) {
  int to_child[2], from_child[2];
  ASSERT_EQ(pipe(to_child), 0);
  ASSERT_EQ(pipe(from_child), 0);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, to_child[0], STDIN_FILENO);
  posix_spawn_file_actions_adddup2(&actions, from_child[1], STDOUT_FILENO);
  posix_spawn_file_actions_addclose(&actions, to_child[1]);
  posix_spawn_file_actions_addclose(&actions, from_child[0]);
  std::string self = "/proc/self/exe";
  std::string flag = kExporterFlag;
  char* argv[] = {self.data(), flag.data(), nullptr};
  pid_t child = -1;
  ASSERT_EQ(posix_spawn(&child, self.c_str(), &actions, nullptr, argv, environ), 0);
  posix_spawn_file_actions_destroy(&actions);
  close(to_child[0]);
  close(from_child[1]);
  FILE* child_out = fdopen(from_child[0], "r");
  char hex[2 * CudaCopyEngine::kIpcHandleBytes + 2] = {};
  ASSERT_NE(std::fgets(hex, sizeof(hex), child_out), nullptr);
  Bytes handle(CudaCopyEngine::kIpcHandleBytes);
  for (size_t i = 0; i < handle.size(); ++i) {
    unsigned value = 0;
    ASSERT_EQ(std::sscanf(hex + 2 * i, "%2x", &value), 1);
    handle[i] = static_cast<uint8_t>(value);
  }

  {
    HostMemoryRegistry registry;
    auto engine = MakeEngine(registry);
    ASSERT_NE(engine, nullptr);
    RegisteredHostMemory pool(registry, kIpcBytes);
    // A range past the exported allocation is refused (and its mapping closed again).
    EXPECT_EQ(engine->RegisterIpcBuffer(handle, 0, kIpcBytes, 4096).status().code(), StatusCode::kInvalidArgument);
    // The lower half, and the upper half as a second registration of the same handle at an
    // offset while the first is live (CUDA opens a handle once per process: they share it).
    auto lower = engine->RegisterIpcBuffer(handle, 0, kIpcBytes / 2, 0);
    ASSERT_TRUE(lower.ok()) << lower.status();
    auto upper = engine->RegisterIpcBuffer(handle, 0, kIpcBytes / 2, kIpcBytes / 2);
    ASSERT_TRUE(upper.ok()) << upper.status();
    std::memset(pool.data(), kPoison, kIpcBytes);
    ASSERT_TRUE(RunBatch(*engine, CopyBatch{CopyDirection::kSave, {{*lower, 0, pool.data(), kIpcBytes / 2}}}).ok());
    bool same = true;
    for (uint64_t i = 0; i < kIpcBytes / 2 && same; ++i) {
      same = pool.data()[i] == PatternByte(kIpcSeed, i);
    }
    EXPECT_TRUE(same) << "saved bytes differ from what the exporter wrote";
    // Unregistering the lower half leaves the shared mapping open for the upper one.
    ASSERT_TRUE(engine->UnregisterBuffer(*lower).ok());
    FillPattern(pool.data(), kIpcBytes / 2, kIpcRestoreSeed);
    ASSERT_TRUE(RunBatch(*engine, CopyBatch{CopyDirection::kRestore, {{*upper, 0, pool.data(), kIpcBytes / 2}}}).ok());
    ASSERT_TRUE(engine->UnregisterBuffer(*upper).ok());
  }
  // The exporter checks the restored half in its own memory.
  ASSERT_EQ(write(to_child[1], "done\n", 5), 5);
  close(to_child[1]);
  int wstatus = 0;
  ASSERT_EQ(waitpid(child, &wstatus, 0), child);
  fclose(child_out);
  ASSERT_TRUE(WIFEXITED(wstatus));
  EXPECT_EQ(WEXITSTATUS(wstatus), 0) << "the exporter saw wrong bytes (see RunIpcExporter)";
}

}  // namespace
}  // namespace orbitkv::gpu

int main(int argc, char** argv) {
  if (argc == 2 && std::strcmp(argv[1], orbitkv::gpu::kExporterFlag) == 0) {
    return orbitkv::gpu::RunIpcExporter();
  }
  ::testing::InitGoogleTest(&argc, argv);
  // Without a device every test would fail on its first CUDA call: say why once instead.
  int devices = 0;
  if (const cudaError_t error = cudaGetDeviceCount(&devices); error != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "gpu_copy_engine_test: no usable CUDA device (%s); run it on a GPU machine\n",
                 cudaGetErrorString(error));
    return 1;
  }
  return RUN_ALL_TESTS();
}
