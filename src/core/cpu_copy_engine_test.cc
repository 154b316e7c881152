#include "core/cpu_copy_engine.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <latch>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "base/fault_guard.h"
#include "base/metrics.h"
#include "base/mutex.h"
#include "base/scoped_fd.h"
#include "core/copy_engine_test_util.h"

namespace orbitkv::core {
namespace {

using Bytes = std::vector<uint8_t>;
using testing::DoneProbe;

Bytes RandomBytes(size_t size, std::mt19937_64& rng) {
  Bytes bytes(size);
  for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng());
  return bytes;
}

std::unique_ptr<CpuCopyEngine> MakeEngine(CpuCopyEngine::Options options, MetricsRegistry* metrics = nullptr) {
  auto engine = CpuCopyEngine::Create(options, metrics);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? std::move(engine).value() : nullptr;
}

BufferId Register(CpuCopyEngine& engine, Bytes& buffer) {
  auto id = engine.RegisterBuffer(buffer.data(), buffer.size());
  EXPECT_TRUE(id.ok()) << id.status();
  return id.value_or(BufferId{});
}

// Submits until the engine has room (the caller side of backpressure); returns the first other
// status.
Status SubmitRetrying(CopyEngine& engine, const CopyBatch& batch, const CopyDone& done) {
  for (;;) {
    Status status = engine.Submit(batch, done);
    if (status.code() != StatusCode::kResourceExhausted) return status;
    std::this_thread::yield();
  }
}

TEST(BufferIdTest, PacksIntoOneWordAndBack) {
  const BufferId id{7, 0xdeadbeef};
  EXPECT_EQ(id.Pack(), 0xdeadbeef00000007u);
  EXPECT_EQ(BufferId::Unpack(id.Pack()), id);
  EXPECT_EQ(BufferId::Unpack(0), BufferId{});
  EXPECT_NE((BufferId{1, 2}), (BufferId{1, 3}));
  EXPECT_LT((BufferId{1, 2}), (BufferId{1, 3}));
  EXPECT_LT((BufferId{1, 9}), (BufferId{2, 1}));
}

TEST(CopyDirectionTest, NamesAreTheMetricLabels) {
  EXPECT_EQ(CopyDirectionName(CopyDirection::kSave), "save");
  EXPECT_EQ(CopyDirectionName(CopyDirection::kRestore), "restore");
  EXPECT_EQ(CopyDirectionName(static_cast<CopyDirection>(9)), "invalid");
}

// Engine memory that vanishes under a copy (a file truncated after it was mapped: the Manager only
// maps sealed memfds, so this is the fault injected directly) fails that batch with a clear error,
// in either direction; the process and the engine go on, and other buffers copy as before.
TEST(CpuCopyEngineTest, EngineMemoryThatVanishesFailsOnlyItsBatch) {
  auto engine = MakeEngine({});
  ASSERT_NE(engine, nullptr);
  constexpr size_t kBytes = 4 * 4096;
  ScopedFd fd(memfd_create("vanishing", MFD_CLOEXEC));
  ASSERT_TRUE(fd.valid());
  ASSERT_EQ(ftruncate(fd.get(), kBytes), 0);
  auto* mapped = static_cast<uint8_t*>(mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0));
  ASSERT_NE(mapped, MAP_FAILED);
  std::memset(mapped, 0x3c, kBytes);
  auto vanishing = engine->RegisterBuffer(mapped, kBytes);
  ASSERT_TRUE(vanishing.ok()) << vanishing.status();
  ASSERT_EQ(ftruncate(fd.get(), 0), 0);  // every page of the mapping is gone now
  std::mt19937_64 rng(5);
  Bytes pool = RandomBytes(kBytes, rng);
  const uint64_t recovered_before = FaultGuard::recovered();
  for (CopyDirection direction : {CopyDirection::kSave, CopyDirection::kRestore}) {
    CopyBatch batch;
    batch.direction = direction;
    batch.fragments.push_back(CopyFragment{*vanishing, 4096, pool.data(), 8192});
    DoneProbe done;
    ASSERT_TRUE(engine->Submit(batch, done.Callback()).ok());
    const Status status = done.Wait();
    EXPECT_EQ(status.code(), StatusCode::kDataLoss) << status;
    EXPECT_NE(status.message().find("vanished"), std::string_view::npos) << status;
  }
  EXPECT_EQ(FaultGuard::recovered(), recovered_before + 2);
  // A healthy buffer still copies, on the same workers.
  Bytes engine_side = RandomBytes(kBytes, rng);
  const BufferId healthy = Register(*engine, engine_side);
  CopyBatch batch;
  batch.direction = CopyDirection::kSave;
  batch.fragments.push_back(CopyFragment{healthy, 0, pool.data(), kBytes});
  DoneProbe done;
  ASSERT_TRUE(engine->Submit(batch, done.Callback()).ok());
  EXPECT_TRUE(done.Wait().ok());
  EXPECT_EQ(pool, engine_side);
  engine->Shutdown();
  munmap(mapped, kBytes);
}

TEST(CpuCopyEngineTest, CreateRejectsOptionsOutOfRange) {
  EXPECT_EQ(CpuCopyEngine::Create({.threads = 0}, nullptr).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(CpuCopyEngine::Create({.threads = CpuCopyEngine::kMaxThreads + 1}, nullptr).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(CpuCopyEngine::Create({.max_inflight_batches = 0}, nullptr).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(CpuCopyEngine::Create({.chunk_bytes = 0}, nullptr).status().code(), StatusCode::kInvalidArgument);
  auto engine = CpuCopyEngine::Create({.threads = 1}, nullptr);
  ASSERT_TRUE(engine.ok());
  EXPECT_EQ((*engine)->name(), "cpu");
}

TEST(CpuCopyEngineTest, RegisterBufferValidatesAndIssuesDistinctIds) {
  auto engine = MakeEngine({.threads = 1});
  ASSERT_NE(engine, nullptr);
  Bytes a(64), b(64);
  EXPECT_EQ(engine->RegisterBuffer(nullptr, 64).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(engine->RegisterBuffer(a.data(), 0).status().code(), StatusCode::kInvalidArgument);
  // NOLINTNEXTLINE(performance-no-int-to-ptr): an address near the top, never dereferenced.
  auto* near_end = reinterpret_cast<uint8_t*>(std::numeric_limits<uintptr_t>::max() - 15);
  EXPECT_EQ(engine->RegisterBuffer(near_end, 32).status().code(), StatusCode::kInvalidArgument);
  BufferId ia = Register(*engine, a);
  BufferId ib = Register(*engine, b);
  EXPECT_NE(ia, ib);
  EXPECT_NE(ia.generation, 0u);
  EXPECT_EQ(engine->UnregisterBuffer(BufferId{99, 1}).code(), StatusCode::kNotFound);
  EXPECT_EQ(engine->UnregisterBuffer(BufferId{}).code(), StatusCode::kNotFound);
  EXPECT_TRUE(engine->UnregisterBuffer(ia).ok());
  EXPECT_EQ(engine->UnregisterBuffer(ia).code(), StatusCode::kNotFound);
  EXPECT_TRUE(engine->UnregisterBuffer(ib).ok());
}

TEST(CpuCopyEngineTest, ReusedSlotGetsANewGenerationAndTheOldIdStaysStale) {
  auto engine = MakeEngine({.threads = 1});
  ASSERT_NE(engine, nullptr);
  Bytes a(64, 0x11), b(64, 0x22), pool(64, 0);
  BufferId old_id = Register(*engine, a);
  ASSERT_TRUE(engine->UnregisterBuffer(old_id).ok());
  BufferId new_id = Register(*engine, b);
  EXPECT_EQ(new_id.index, old_id.index);
  EXPECT_NE(new_id.generation, old_id.generation);
  DoneProbe stale_probe;
  EXPECT_EQ(engine->Submit({CopyDirection::kSave, {{old_id, 0, pool.data(), 64}}}, stale_probe.Callback()).code(),
            StatusCode::kNotFound);
  DoneProbe probe;
  ASSERT_TRUE(engine->Submit({CopyDirection::kSave, {{new_id, 0, pool.data(), 64}}}, probe.Callback()).ok());
  EXPECT_TRUE(probe.Wait().ok());
  engine->Shutdown();
  EXPECT_EQ(pool, b);
  EXPECT_EQ(stale_probe.calls(), 0);
}

// A buffer of another process: copied with process_vm_readv/writev. This test's own process stands
// in for the engine (the kernel takes the same path for any pid of the same uid), and a child that
// exited stands for an engine that is gone.
TEST(CpuCopyEngineTest, ProcessBuffersAreCopiedAndAGoneProcessFailsTheBatch) {
  auto engine = MakeEngine({.threads = 2});
  ASSERT_NE(engine, nullptr);
  Bytes engine_memory(3 * 4096 + 100), pool(3 * 4096 + 100, 0);
  for (size_t i = 0; i < engine_memory.size(); ++i) engine_memory[i] = static_cast<uint8_t>(i * 7);
  auto id =
      engine->RegisterProcessBuffer(getpid(), reinterpret_cast<uint64_t>(engine_memory.data()), engine_memory.size());
  ASSERT_TRUE(id.ok()) << id.status();
  DoneProbe saved;
  ASSERT_TRUE(
      engine
          ->Submit({CopyDirection::kSave,
                    {{*id, 0, pool.data(), 4096}, {*id, 4096, pool.data() + 4096, engine_memory.size() - 4096}}},
                   saved.Callback())
          .ok());
  ASSERT_TRUE(saved.Wait().ok());
  EXPECT_EQ(pool, engine_memory);
  Bytes restored_into(engine_memory.size(), 0);
  auto target =
      engine->RegisterProcessBuffer(getpid(), reinterpret_cast<uint64_t>(restored_into.data()), restored_into.size());
  ASSERT_TRUE(target.ok());
  DoneProbe restored;
  ASSERT_TRUE(
      engine->Submit({CopyDirection::kRestore, {{*target, 0, pool.data(), pool.size()}}}, restored.Callback()).ok());
  ASSERT_TRUE(restored.Wait().ok());
  EXPECT_EQ(restored_into, engine_memory);

  // A process that goes away after its buffer was registered: the batches fail, in both
  // directions, and nothing ever reaches a process that was given its pid later (writes go through
  // the memory the registration bound; reads are checked against the process it bound).
  int hold[2];
  ASSERT_EQ(pipe(hold), 0);
  const pid_t child = fork();
  if (child == 0) {
    char byte;
    close(hold[1]);
    (void)!read(hold[0], &byte, 1);  // until the parent lets go
    _exit(0);
  }
  ASSERT_GT(child, 0);
  close(hold[0]);
  auto gone =
      engine->RegisterProcessBuffer(child, reinterpret_cast<uint64_t>(restored_into.data()), restored_into.size());
  ASSERT_TRUE(gone.ok()) << gone.status();
  close(hold[1]);
  ASSERT_EQ(waitpid(child, nullptr, 0), child);
  for (CopyDirection direction : {CopyDirection::kRestore, CopyDirection::kSave}) {
    DoneProbe failed;
    ASSERT_TRUE(engine->Submit({direction, {{*gone, 0, pool.data(), 4096}}}, failed.Callback()).ok());
    EXPECT_EQ(failed.Wait().code(), StatusCode::kUnavailable);
    EXPECT_EQ(failed.calls(), 1);
  }
  // A process already gone cannot be registered at all.
  EXPECT_EQ(engine->RegisterProcessBuffer(child, 4096, 4096).status().code() == StatusCode::kOk, false);
  EXPECT_FALSE(engine->RegisterProcessBuffer(0, 4096, 4096).ok());
  engine->Shutdown();
}

// One engine range and the pool range it pairs with.
struct Piece {
  size_t buffer;
  uint64_t offset;
  uint64_t length;
  uint64_t pool_offset;
};

struct RoundTripParam {
  int threads;
  uint64_t chunk_bytes;
  uint64_t max_piece;  // Pieces are 1..max_piece bytes, skewed toward small.
  uint64_t buffer_scale;
};

class CpuCopyEngineRoundTripTest : public ::testing::TestWithParam<RoundTripParam> {};

// Saves random disjoint ranges of three buffers into a shuffled pool layout, checks every byte,
// wipes the buffers and restores them from the pool: covered bytes come back, uncovered bytes and
// pool gaps stay untouched.
TEST_P(CpuCopyEngineRoundTripTest, SaveThenRestoreIsByteExact) {
  const RoundTripParam& param = GetParam();
  std::mt19937_64 rng(param.chunk_bytes * 31 + static_cast<uint64_t>(param.threads));
  auto engine = MakeEngine({.threads = param.threads, .chunk_bytes = param.chunk_bytes});
  ASSERT_NE(engine, nullptr);

  std::vector<Bytes> originals;
  for (uint64_t size : {3 * param.buffer_scale + 17, 5 * param.buffer_scale, 2 * param.buffer_scale + 1}) {
    originals.push_back(RandomBytes(size, rng));
  }
  std::vector<Bytes> buffers = originals;
  std::vector<BufferId> ids;
  ids.reserve(buffers.size());
  for (Bytes& buffer : buffers) ids.push_back(Register(*engine, buffer));

  // Cut each buffer into consecutive pieces; keep most of them (the rest are holes that must stay
  // untouched).
  std::vector<Piece> pieces;
  for (size_t b = 0; b < buffers.size(); ++b) {
    uint64_t offset = 0;
    while (offset < buffers[b].size()) {
      const uint64_t cap = std::uniform_int_distribution<int>(0, 3)(rng) == 0 ? param.max_piece : 64;
      const uint64_t length =
          std::min<uint64_t>(std::uniform_int_distribution<uint64_t>(1, cap)(rng), buffers[b].size() - offset);
      if (std::uniform_int_distribution<int>(0, 4)(rng) != 0) {
        pieces.push_back({b, offset, length, 0});
      }
      offset += length;
    }
  }
  std::shuffle(pieces.begin(), pieces.end(), rng);
  uint64_t pool_size = 0;
  for (Piece& piece : pieces) {
    pool_size += std::uniform_int_distribution<uint64_t>(0, 9)(rng);  // Gaps that must stay untouched.
    piece.pool_offset = pool_size;
    pool_size += piece.length;
  }
  constexpr uint8_t kUntouched = 0xEE;
  Bytes pool(pool_size, kUntouched);
  Bytes pool_expected(pool_size, kUntouched);
  CopyBatch save{CopyDirection::kSave, {}};
  for (const Piece& piece : pieces) {
    save.fragments.push_back({ids[piece.buffer], piece.offset, pool.data() + piece.pool_offset, piece.length});
    std::copy_n(originals[piece.buffer].begin() + static_cast<ptrdiff_t>(piece.offset), piece.length,
                pool_expected.begin() + static_cast<ptrdiff_t>(piece.pool_offset));
  }
  CopyBatch restore = save;
  restore.direction = CopyDirection::kRestore;

  DoneProbe saved;
  ASSERT_TRUE(engine->Submit(std::move(save), saved.Callback()).ok());
  EXPECT_TRUE(saved.Wait().ok());
  EXPECT_TRUE(pool == pool_expected);
  EXPECT_EQ(buffers, originals);  // Saving reads the buffers only.

  std::vector<Bytes> expected;
  for (Bytes& buffer : buffers) {
    std::fill(buffer.begin(), buffer.end(), 0);
    expected.emplace_back(buffer.size(), 0);
  }
  for (const Piece& piece : pieces) {
    std::copy_n(originals[piece.buffer].begin() + static_cast<ptrdiff_t>(piece.offset), piece.length,
                expected[piece.buffer].begin() + static_cast<ptrdiff_t>(piece.offset));
  }
  DoneProbe restored;
  ASSERT_TRUE(engine->Submit(std::move(restore), restored.Callback()).ok());
  EXPECT_TRUE(restored.Wait().ok());
  for (size_t b = 0; b < buffers.size(); ++b) {
    EXPECT_TRUE(buffers[b] == expected[b]) << "buffer " << b;
  }
  engine->Shutdown();
  EXPECT_EQ(saved.calls(), 1);
  EXPECT_EQ(restored.calls(), 1);
}

INSTANTIATE_TEST_SUITE_P(
    Splits, CpuCopyEngineRoundTripTest,
    ::testing::Values(
        // One thread, chunks far larger than any piece: small pieces grouped, nothing split.
        RoundTripParam{.threads = 1, .chunk_bytes = 1 << 20, .max_piece = 20000, .buffer_scale = 100000},
        // Pieces both below and far above the chunk: grouping and splitting across three threads.
        RoundTripParam{.threads = 3, .chunk_bytes = 4096, .max_piece = 50000, .buffer_scale = 100000},
        // A chunk smaller than most pieces, not a power of two: almost every piece is split
        // unevenly.
        RoundTripParam{.threads = 2, .chunk_bytes = 7, .max_piece = 300, .buffer_scale = 4000},
        // About 24 MiB each way, pieces up to 96 KiB at every alignment: the restore, larger than
        // the caches, streams its stores like the save (base/stream_copy.h).
        RoundTripParam{.threads = 2, .chunk_bytes = 1 << 20, .max_piece = 96 << 10, .buffer_scale = 3 << 20}),
    [](const ::testing::TestParamInfo<RoundTripParam>& test) {
      return "Threads" + std::to_string(test.param.threads) + "Chunk" + std::to_string(test.param.chunk_bytes);
    });

// Every way a fragment can be invalid, placed after valid fragments of the same batch: the batch is
// rejected whole, with no byte copied and no callback.
TEST(CpuCopyEngineTest, InvalidFragmentsRejectTheWholeBatch) {
  MetricsRegistry metrics;
  auto engine = MakeEngine({.threads = 2, .chunk_bytes = 64}, &metrics);
  ASSERT_NE(engine, nullptr);
  std::mt19937_64 rng(7);
  Bytes a = RandomBytes(4096, rng), b = RandomBytes(4096, rng), c = RandomBytes(64, rng);
  const Bytes a_before = a, b_before = b;
  BufferId ia = Register(*engine, a);
  BufferId ib = Register(*engine, b);
  BufferId stale = Register(*engine, c);
  ASSERT_TRUE(engine->UnregisterBuffer(stale).ok());
  Bytes pool = RandomBytes(1024, rng);
  const Bytes pool_before = pool;
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  // NOLINTNEXTLINE(performance-no-int-to-ptr): an address near the top, never dereferenced.
  auto* wrapping_pool = reinterpret_cast<uint8_t*>(std::numeric_limits<uintptr_t>::max() - 15);

  struct Case {
    std::string name;
    CopyFragment bad;
    StatusCode code;
  };
  const std::vector<Case> cases = {
      {"past the end", {ia, 4000, pool.data() + 200, 97}, StatusCode::kInvalidArgument},
      {"starts at the end", {ia, 4096, pool.data() + 200, 1}, StatusCode::kInvalidArgument},
      {"starts past the end", {ia, 5000, pool.data() + 200, 1}, StatusCode::kInvalidArgument},
      // offset + length wraps to 9, which a naive bound check would accept.
      {"offset overflows", {ia, kMax - 10, pool.data() + 200, 20}, StatusCode::kInvalidArgument},
      {"length overflows", {ia, 8, pool.data() + 200, kMax}, StatusCode::kInvalidArgument},
      {"null pool", {ia, 0, nullptr, 16}, StatusCode::kInvalidArgument},
      {"zero length", {ia, 0, pool.data() + 200, 0}, StatusCode::kInvalidArgument},
      {"pool range wraps", {ia, 0, wrapping_pool, 32}, StatusCode::kInvalidArgument},
      {"unknown index", {BufferId{77, 1}, 0, pool.data() + 200, 16}, StatusCode::kNotFound},
      {"default id", {BufferId{}, 0, pool.data() + 200, 16}, StatusCode::kNotFound},
      {"wrong generation", {BufferId{ia.index, ia.generation + 1}, 0, pool.data() + 200, 16}, StatusCode::kNotFound},
      {"stale after unregister", {stale, 0, pool.data() + 200, 16}, StatusCode::kNotFound},
  };
  std::vector<std::unique_ptr<DoneProbe>> probes;
  for (const Case& test_case : cases) {
    for (CopyDirection direction : {CopyDirection::kSave, CopyDirection::kRestore}) {
      SCOPED_TRACE(test_case.name + " " + std::string(CopyDirectionName(direction)));
      CopyBatch batch{direction, {{ia, 0, pool.data(), 100}, {ib, 100, pool.data() + 100, 100}, test_case.bad}};
      probes.push_back(std::make_unique<DoneProbe>());
      EXPECT_EQ(engine->Submit(std::move(batch), probes.back()->Callback()).code(), test_case.code);
    }
  }
  // Whole-batch checks.
  probes.push_back(std::make_unique<DoneProbe>());
  EXPECT_EQ(engine->Submit({CopyDirection::kSave, {}}, probes.back()->Callback()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(engine->Submit({CopyDirection::kSave, {{ia, 0, pool.data(), 8}}}, nullptr).code(),
            StatusCode::kInvalidArgument);
  probes.push_back(std::make_unique<DoneProbe>());
  EXPECT_EQ(
      engine->Submit({static_cast<CopyDirection>(2), {{ia, 0, pool.data(), 8}}}, probes.back()->Callback()).code(),
      StatusCode::kInvalidArgument);

  engine->Shutdown();  // Any callback that was going to run has run.
  for (const auto& probe : probes) EXPECT_EQ(probe->calls(), 0);
  EXPECT_TRUE(a == a_before);
  EXPECT_TRUE(b == b_before);
  EXPECT_TRUE(pool == pool_before);
  for (CopyDirection direction : {CopyDirection::kSave, CopyDirection::kRestore}) {
    const MetricLabels labels = {
        {"engine", "cpu"}, {"direction", std::string(CopyDirectionName(direction))}, {"device", "host"}};
    EXPECT_EQ(metrics.GetCounter("orbitkv_copy_batches_total", "", labels).Value(), 0u);
  }
  EXPECT_EQ(metrics.GetGauge("orbitkv_copy_inflight_batches", "", {{"engine", "cpu"}}).Value(), 0.0);
}

TEST(CpuCopyEngineTest, EveryAcceptedBatchCallsDoneOnceOnAnEngineThread) {
  auto engine = MakeEngine({.threads = 2, .chunk_bytes = 256});
  ASSERT_NE(engine, nullptr);
  std::mt19937_64 rng(11);
  Bytes buffer = RandomBytes(1 << 16, rng);
  Bytes pool(1 << 16, 0);
  BufferId id = Register(*engine, buffer);
  constexpr int kBatches = 64;
  std::vector<DoneProbe> probes(kBatches);
  for (int i = 0; i < kBatches; ++i) {
    const uint64_t offset = uint64_t{1024} * static_cast<uint64_t>(i);
    CopyBatch batch{CopyDirection::kSave,
                    {{id, offset, pool.data() + offset, 1000}, {id, offset + 1000, pool.data() + offset + 1000, 24}}};
    ASSERT_TRUE(engine->Submit(std::move(batch), probes[static_cast<size_t>(i)].Callback()).ok());
  }
  engine->Shutdown();
  for (DoneProbe& probe : probes) {
    EXPECT_EQ(probe.calls(), 1);
    EXPECT_TRUE(probe.Wait().ok());
    EXPECT_NE(probe.thread(), std::this_thread::get_id());
  }
  EXPECT_TRUE(pool == buffer);
}

TEST(CpuCopyEngineTest, MetricsCountCompletedBatchesByDirection) {
  MetricsRegistry metrics;
  auto engine = MakeEngine({.threads = 2}, &metrics);
  ASSERT_NE(engine, nullptr);
  Bytes buffer(1000, 1), pool(1000, 0);
  BufferId id = Register(*engine, buffer);
  CopyEngine& base = *engine;  // Through the interface the block cache uses.
  DoneProbe p1, p2, p3;
  ASSERT_TRUE(base.Submit({CopyDirection::kSave, {{id, 0, pool.data(), 600}}}, p1.Callback()).ok());
  ASSERT_TRUE(base.Submit({CopyDirection::kSave, {{id, 600, pool.data() + 600, 400}}}, p2.Callback()).ok());
  EXPECT_TRUE(p1.Wait().ok());
  EXPECT_TRUE(p2.Wait().ok());
  ASSERT_TRUE(
      base.Submit({CopyDirection::kRestore, {{id, 0, pool.data(), 10}, {id, 10, pool.data() + 10, 5}}}, p3.Callback())
          .ok());
  base.Shutdown();
  auto counter = [&metrics](std::string_view name, std::string_view direction) {
    return metrics.GetCounter(name, "", {{"engine", "cpu"}, {"direction", std::string(direction)}, {"device", "host"}})
        .Value();
  };
  EXPECT_EQ(counter("orbitkv_copy_bytes_total", "save"), 1000u);
  EXPECT_EQ(counter("orbitkv_copy_batches_total", "save"), 2u);
  EXPECT_EQ(counter("orbitkv_copy_bytes_total", "restore"), 15u);
  EXPECT_EQ(counter("orbitkv_copy_batches_total", "restore"), 1u);
  EXPECT_EQ(metrics.GetGauge("orbitkv_copy_inflight_batches", "", {{"engine", "cpu"}}).Value(), 0.0);
}

// Batches whose CopyDone blocks stay in flight; one more is refused until they return, then
// accepted.
TEST(CpuCopyEngineTest, BackpressureWhenMaxInflightBatchesIsReached) {
  MetricsRegistry metrics;
  constexpr uint32_t kMaxInflight = 3;
  auto engine = MakeEngine({.threads = 2, .max_inflight_batches = kMaxInflight}, &metrics);
  ASSERT_NE(engine, nullptr);
  Bytes buffer(256, 0x5A), pool(256, 0);
  BufferId id = Register(*engine, buffer);
  std::latch release(1);
  std::atomic<int> held_calls{0};
  auto held = [&](const Status&) {
    held_calls.fetch_add(1, std::memory_order_relaxed);
    release.wait();
  };
  for (uint32_t i = 0; i < kMaxInflight; ++i) {
    ASSERT_TRUE(
        engine->Submit({CopyDirection::kSave, {{id, uint64_t{i} * 16, pool.data() + uint64_t{i} * 16, 16}}}, held)
            .ok());
  }
  EXPECT_EQ(metrics.GetGauge("orbitkv_copy_inflight_batches", "", {{"engine", "cpu"}}).Value(),
            static_cast<double>(kMaxInflight));

  const CopyBatch extra{CopyDirection::kSave, {{id, 128, pool.data() + 128, 16}}};
  DoneProbe refused;
  EXPECT_EQ(engine->Submit(extra, refused.Callback()).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(engine->Submit(extra, refused.Callback()).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(pool[128], 0);  // A refused batch copies nothing.

  release.count_down();
  DoneProbe accepted;
  EXPECT_TRUE(SubmitRetrying(*engine, extra, accepted.Callback()).ok());
  EXPECT_TRUE(accepted.Wait().ok());
  EXPECT_EQ(pool[128], 0x5A);
  engine->Shutdown();
  EXPECT_EQ(held_calls.load(), static_cast<int>(kMaxInflight));
  EXPECT_EQ(refused.calls(), 0);
  EXPECT_EQ(accepted.calls(), 1);
}

// UnregisterBuffer() must not return while a batch that names the buffer is in flight, i.e. before
// its CopyDone returned. The held batch's CopyDone blocks on a latch; probe submissions tell when
// UnregisterBuffer() has started (the buffer turns NotFound), and only then is the latch released.
TEST(CpuCopyEngineTest, UnregisterWaitsForInflightBatches) {
  auto engine = MakeEngine({.threads = 2});
  ASSERT_NE(engine, nullptr);
  Bytes buffer(4096, 0x33), pool(4096, 0);
  BufferId id = Register(*engine, buffer);

  std::latch entered(1), release(1);
  std::atomic<bool> held_done_returned{false};
  ASSERT_TRUE(engine
                  ->Submit({CopyDirection::kSave, {{id, 0, pool.data(), 4096}}},
                           [&](const Status&) {
                             entered.count_down();
                             release.wait();
                             held_done_returned.store(true, std::memory_order_release);
                           })
                  .ok());
  entered.wait();
  EXPECT_EQ(pool, buffer);  // Copies complete before CopyDone runs.

  std::atomic<bool> unregister_returned{false};
  bool done_had_returned = false;
  Status unregister_status = Status::Unknown("not run");
  std::thread unregisterer([&] {
    unregister_status = engine->UnregisterBuffer(id);
    done_had_returned = held_done_returned.load(std::memory_order_acquire);
    unregister_returned.store(true, std::memory_order_release);
  });
  // Probes: each accepted one is another in-flight batch on the buffer (it completes on the free
  // worker).
  std::vector<std::unique_ptr<DoneProbe>> accepted;
  DoneProbe refused;
  for (;;) {
    auto probe = std::make_unique<DoneProbe>();
    Status status = engine->Submit({CopyDirection::kRestore, {{id, 0, pool.data(), 8}}}, probe->Callback());
    if (status.code() == StatusCode::kNotFound) break;
    if (status.ok()) {
      accepted.push_back(std::move(probe));
    } else {
      ASSERT_EQ(status.code(), StatusCode::kResourceExhausted) << status;
    }
    std::this_thread::yield();
  }
  EXPECT_EQ(engine->Submit({CopyDirection::kRestore, {{id, 0, pool.data(), 8}}}, refused.Callback()).code(),
            StatusCode::kNotFound);
  EXPECT_FALSE(unregister_returned.load(std::memory_order_acquire));
  release.count_down();
  unregisterer.join();
  EXPECT_TRUE(unregister_status.ok()) << unregister_status;
  EXPECT_TRUE(done_had_returned);
  // Every batch accepted on the buffer completed before UnregisterBuffer() returned.
  for (size_t i = 0; i < accepted.size(); ++i) EXPECT_EQ(accepted[i]->calls(), 1) << "probe " << i;
  engine->Shutdown();
  EXPECT_EQ(refused.calls(), 0);
}

TEST(CpuCopyEngineTest, ShutdownDrainsAcceptedBatchesThenRefuses) {
  auto engine = MakeEngine({.threads = 1, .chunk_bytes = 4096});
  ASSERT_NE(engine, nullptr);
  std::mt19937_64 rng(5);
  constexpr int kBatches = 32;
  constexpr uint64_t kBatchBytes = uint64_t{64} * 1024;
  Bytes buffer(kBatches * kBatchBytes, 0);
  Bytes pool = RandomBytes(buffer.size(), rng);
  BufferId id = Register(*engine, buffer);
  std::vector<DoneProbe> probes(kBatches);
  for (int i = 0; i < kBatches; ++i) {
    const uint64_t offset = static_cast<uint64_t>(i) * kBatchBytes;
    ASSERT_TRUE(engine
                    ->Submit({CopyDirection::kRestore, {{id, offset, pool.data() + offset, kBatchBytes}}},
                             probes[static_cast<size_t>(i)].Callback())
                    .ok());
  }
  engine->Shutdown();
  // No waiting on the probes: Shutdown() returned only after every accepted batch completed.
  for (DoneProbe& probe : probes) EXPECT_EQ(probe.calls(), 1);
  EXPECT_TRUE(buffer == pool);

  DoneProbe late;
  EXPECT_EQ(engine->Submit({CopyDirection::kRestore, {{id, 0, pool.data(), 1}}}, late.Callback()).code(),
            StatusCode::kUnavailable);
  engine->Shutdown();  // Idempotent.
  EXPECT_TRUE(engine->UnregisterBuffer(id).ok());
  engine.reset();
  EXPECT_EQ(late.calls(), 0);
}

TEST(CpuCopyEngineTest, DoneMaySubmitTheNextBatch) {
  auto engine = MakeEngine({.threads = 1, .max_inflight_batches = 2});
  ASSERT_NE(engine, nullptr);
  Bytes buffer(64, 0x7E), pool(64, 0);
  BufferId id = Register(*engine, buffer);
  DoneProbe second;
  Status chained = Status::Unknown("not run");
  ASSERT_TRUE(
      engine
          ->Submit(
              {CopyDirection::kSave, {{id, 0, pool.data(), 32}}},
              [&](const Status&) {
                chained = engine->Submit({CopyDirection::kSave, {{id, 32, pool.data() + 32, 32}}}, second.Callback());
              })
          .ok());
  EXPECT_TRUE(second.Wait().ok());
  engine->Shutdown();
  EXPECT_TRUE(chained.ok()) << chained;
  EXPECT_EQ(pool, buffer);
}

// Several submitters, each with its own buffer and pool, keep a few batches outstanding against a
// small in-flight bound (so they hit backpressure and retry), while another thread registers
// buffers, submits on them and unregisters them at once. Run under TSan in CI.
TEST(CpuCopyEngineConcurrencyTest, SubmittersAndRegistrationChurn) {
  MetricsRegistry metrics;
  auto engine = MakeEngine({.threads = 2, .max_inflight_batches = 4, .chunk_bytes = 4096}, &metrics);
  ASSERT_NE(engine, nullptr);
  constexpr int kSubmitters = 4;
  constexpr int kRounds = 60;
  constexpr size_t kBytes = size_t{32} * 1024;
  constexpr int kOutstanding = 3;

  auto submitter = [&](int t) {
    std::mt19937_64 rng(static_cast<uint64_t>(t) + 100);
    Bytes buffer = RandomBytes(kBytes, rng);
    Bytes pool(kBytes, 0);
    BufferId id = Register(*engine, buffer);
    for (int round = 0; round < kRounds; ++round) {
      const CopyDirection direction = round % 2 == 0 ? CopyDirection::kSave : CopyDirection::kRestore;
      if (direction == CopyDirection::kRestore) pool = RandomBytes(kBytes, rng);
      // The pool mirrors the buffer's layout; cut it into pieces dealt round-robin to the
      // outstanding batches.
      std::vector<CopyBatch> batches(kOutstanding, CopyBatch{direction, {}});
      uint64_t offset = 0;
      for (int piece = 0; offset < kBytes; ++piece) {
        const uint64_t length =
            std::min<uint64_t>(std::uniform_int_distribution<uint64_t>(1, 9000)(rng), kBytes - offset);
        batches[static_cast<size_t>(piece % kOutstanding)].fragments.push_back(
            {id, offset, pool.data() + offset, length});
        offset += length;
      }
      std::vector<DoneProbe> probes(kOutstanding);
      for (int i = 0; i < kOutstanding; ++i) {
        const CopyBatch& batch = batches[static_cast<size_t>(i)];
        if (batch.fragments.empty()) continue;
        EXPECT_TRUE(SubmitRetrying(*engine, batch, probes[static_cast<size_t>(i)].Callback()).ok());
      }
      for (int i = 0; i < kOutstanding; ++i) {
        if (!batches[static_cast<size_t>(i)].fragments.empty()) {
          EXPECT_TRUE(probes[static_cast<size_t>(i)].Wait().ok());
        }
      }
      EXPECT_TRUE(pool == buffer) << "submitter " << t << " round " << round;
    }
    EXPECT_TRUE(engine->UnregisterBuffer(id).ok());
  };

  std::atomic<bool> stop_churn{false};
  std::thread churn([&] {
    Bytes scratch(512, 0x42), pool(512, 0);
    while (!stop_churn.load(std::memory_order_relaxed)) {
      BufferId id = Register(*engine, scratch);
      DoneProbe probe;
      Status status = engine->Submit({CopyDirection::kSave, {{id, 0, pool.data(), 512}}}, probe.Callback());
      EXPECT_TRUE(status.ok() || status.code() == StatusCode::kResourceExhausted) << status;
      ASSERT_TRUE(engine->UnregisterBuffer(id).ok());
      // UnregisterBuffer() returned, so a batch accepted on the buffer has completed.
      EXPECT_EQ(probe.calls(), status.ok() ? 1 : 0);
      EXPECT_EQ(engine->Submit({CopyDirection::kSave, {{id, 0, pool.data(), 512}}}, probe.Callback()).code(),
                StatusCode::kNotFound);
    }
  });
  std::vector<std::thread> submitters;
  submitters.reserve(kSubmitters);
  for (int t = 0; t < kSubmitters; ++t) submitters.emplace_back(submitter, t);
  for (std::thread& thread : submitters) thread.join();
  stop_churn.store(true, std::memory_order_relaxed);
  churn.join();
  engine->Shutdown();
  EXPECT_EQ(metrics.GetGauge("orbitkv_copy_inflight_batches", "", {{"engine", "cpu"}}).Value(), 0.0);
  EXPECT_EQ(
      metrics
          .GetCounter("orbitkv_copy_bytes_total", "", {{"engine", "cpu"}, {"direction", "restore"}, {"device", "host"}})
          .Value(),
      uint64_t{kSubmitters} * (kRounds / 2) * kBytes);
}

}  // namespace
}  // namespace orbitkv::core
