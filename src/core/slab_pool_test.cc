#include "core/slab_pool.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <atomic>
#include <cstring>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "base/metrics.h"

namespace orbitkv::core {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = kKiB * 1024;

// A pool of unbound arenas that works without CAP_IPC_LOCK: these tests are about the allocator.
PoolOptions SmallOptions(uint64_t capacity_bytes, std::vector<int> numa_nodes = {-1}) {
  return PoolOptions{.capacity_bytes = capacity_bytes,
                     .numa_nodes = std::move(numa_nodes),
                     .pin_mode = PinMode::kAllowUnpinned,
                     .slab_bytes = kMiB};
}

std::unique_ptr<PinnedPool> MakePool(const PoolOptions& options, MetricsRegistry* metrics = nullptr) {
  auto pool = PinnedPool::Create(options, metrics);
  EXPECT_TRUE(pool.ok()) << pool.status();
  return pool.ok() ? std::move(pool).value() : nullptr;
}

void ExpectEmpty(const PinnedPool& pool) {
  PoolStats stats = pool.Stats();
  EXPECT_EQ(stats.blocks_in_use, 0U);
  EXPECT_EQ(stats.requested_bytes, 0U);
  EXPECT_EQ(stats.allocated_bytes, 0U);
  EXPECT_EQ(stats.free_slabs, stats.total_slabs);
  EXPECT_EQ(stats.largest_free_bytes, pool.slab_bytes());
}

TEST(PinnedPoolTest, CreateValidatesOptions) {
  PoolOptions options = SmallOptions(4 * kMiB);
  for (uint64_t slab : {uint64_t{0}, kMiB / 2, 3 * kMiB, 2 * kMiB + 4096, uint64_t{2} << 30}) {
    options.slab_bytes = slab;
    EXPECT_EQ(PinnedPool::Create(options, nullptr).status().code(), StatusCode::kInvalidArgument) << slab;
  }
  options = SmallOptions(0);
  EXPECT_EQ(PinnedPool::Create(options, nullptr).status().code(), StatusCode::kInvalidArgument);
  options = SmallOptions(kMiB, {4000});
  EXPECT_EQ(PinnedPool::Create(options, nullptr).status().code(), StatusCode::kInvalidArgument);
}

TEST(PinnedPoolTest, CapacityIsSplitEvenlyInWholeSlabs) {
  auto pool = MakePool(SmallOptions(3 * kMiB, {-1, -1}));
  ASSERT_NE(pool, nullptr);
  ASSERT_EQ(pool->arena_count(), 2U);
  // 1.5 MiB per arena, rounded up to 2 slabs of 1 MiB.
  EXPECT_EQ(pool->arena(0).size(), 2 * kMiB);
  EXPECT_EQ(pool->arena(1).size(), 2 * kMiB);
  PoolStats stats = pool->Stats();
  EXPECT_EQ(stats.capacity_bytes, 4 * kMiB);
  EXPECT_EQ(stats.total_slabs, 4U);
  ExpectEmpty(*pool);
}

TEST(PinnedPoolTest, DefaultNodesAreTheMemoryNodes) {
  auto nodes = MemoryNumaNodes();
  ASSERT_TRUE(nodes.ok());
  PoolOptions options = SmallOptions(nodes->size() * kMiB, {});
  auto pool = MakePool(options);
  ASSERT_NE(pool, nullptr);
  ASSERT_EQ(pool->arena_count(), nodes->size());
  for (size_t i = 0; i < nodes->size(); ++i) EXPECT_EQ(pool->arena(i).numa_node(), (*nodes)[i]);
}

TEST(PinnedPoolTest, RequireLockedPoolIsLocked) {
  PoolOptions options = SmallOptions(2 * kMiB);
  options.pin_mode = PinMode::kRequireLocked;
  auto pool = PinnedPool::Create(options, nullptr);
  if (!pool.ok() && pool.status().code() == StatusCode::kResourceExhausted) {
    GTEST_SKIP() << "this process may not lock memory: " << pool.status();
  }
  ASSERT_TRUE(pool.ok()) << pool.status();
  EXPECT_TRUE((*pool)->arena(0).locked());
}

TEST(PinnedPoolTest, BlocksAreAlignedAndSizedByClass) {
  auto pool = MakePool(SmallOptions(8 * kMiB));
  ASSERT_NE(pool, nullptr);
  std::vector<PoolBlock> blocks;
  for (uint64_t bytes : {uint64_t{1}, uint64_t{4095}, uint64_t{4096}, uint64_t{4097}, uint64_t{100000}, 256 * kKiB,
                         300 * kKiB + 1, kMiB - 1, kMiB}) {
    auto block = pool->Allocate(bytes);
    ASSERT_TRUE(block.ok()) << bytes << ": " << block.status();
    EXPECT_TRUE(block->valid());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(block->data) % kArenaPageBytes, 0U) << bytes;
    EXPECT_EQ(block->requested_bytes, bytes);
    EXPECT_EQ(block->class_bytes, (bytes + 4095) / 4096 * 4096);
    EXPECT_EQ(block->class_bytes, pool->ClassBytes(bytes));
    const uint8_t* arena_begin = pool->arena(block->arena).data();
    EXPECT_GE(block->data, arena_begin);
    EXPECT_LE(block->data + block->class_bytes, arena_begin + pool->arena(block->arena).size());
    std::memset(block->data, 0x11, block->class_bytes);  // The whole class is writable.
    blocks.push_back(*block);
  }
  EXPECT_EQ(pool->ClassBytes(0), 0U);
  EXPECT_EQ(pool->ClassBytes(kMiB + 1), 0U);
  for (const PoolBlock& block : blocks) pool->Free(block);
  ExpectEmpty(*pool);
}

TEST(PinnedPoolTest, InvalidSizesAreRejectedWithoutCountingAsFailures) {
  auto pool = MakePool(SmallOptions(kMiB));
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(pool->Allocate(0).status().code(), StatusCode::kInvalidArgument);
  auto too_big = pool->Allocate(kMiB + 1);
  EXPECT_EQ(too_big.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(too_big.status().message()), HasSubstr("1048577"));
  EXPECT_EQ(pool->Stats().allocation_failures, 0U);
  EXPECT_EQ(pool->class_count(), 0U);
}

// Random allocations and frees of several classes over two arenas; after every step the pool's
// accounting must equal a reference computed from the live blocks, and no two live blocks may
// overlap.
TEST(PinnedPoolTest, AccountingIsExactAfterRandomAllocAndFree) {
  auto pool = MakePool(SmallOptions(6 * kMiB, {-1, -1}));
  ASSERT_NE(pool, nullptr);
  std::mt19937_64 rng(12345);
  const std::vector<uint64_t> sizes = {1, 4096, 5000, 12 * kKiB, 64 * kKiB - 7, 200 * kKiB, 333 * kKiB, kMiB};
  std::vector<PoolBlock> live;
  uint64_t requested = 0, allocated = 0, failures = 0;
  for (int step = 0; step < 4000; ++step) {
    const bool allocate = live.empty() || rng() % 100 < 55;
    if (allocate) {
      const uint64_t bytes = sizes[rng() % sizes.size()];
      auto block = pool->Allocate(bytes, static_cast<int>(rng() % 3) - 1);
      if (!block.ok()) {
        ASSERT_EQ(block.status().code(), StatusCode::kResourceExhausted) << block.status();
        ++failures;
      } else {
        requested += block->requested_bytes;
        allocated += block->class_bytes;
        live.push_back(*block);
      }
    } else {
      const size_t victim = rng() % live.size();
      pool->Free(live[victim]);
      requested -= live[victim].requested_bytes;
      allocated -= live[victim].class_bytes;
      live[victim] = live.back();
      live.pop_back();
    }
    const PoolStats stats = pool->Stats();
    ASSERT_EQ(stats.requested_bytes, requested) << "step " << step;
    ASSERT_EQ(stats.allocated_bytes, allocated) << "step " << step;
    ASSERT_EQ(stats.blocks_in_use, live.size()) << "step " << step;
    ASSERT_EQ(stats.allocation_failures, failures) << "step " << step;
    ASSERT_LE(stats.allocated_bytes, (stats.total_slabs - stats.free_slabs) * kMiB) << "step " << step;
    if (step % 500 == 0) {
      // Non-overlap: sorted by address, each block ends before the next begins.
      std::vector<std::pair<const uint8_t*, uint64_t>> spans;
      for (const PoolBlock& b : live) spans.emplace_back(b.data, b.class_bytes);
      std::sort(spans.begin(), spans.end());
      for (size_t i = 1; i < spans.size(); ++i) ASSERT_LE(spans[i - 1].first + spans[i - 1].second, spans[i].first);
    }
  }
  EXPECT_GT(failures, 0U) << "the sequence should have filled the pool at least once";
  for (const PoolBlock& block : live) pool->Free(block);
  ExpectEmpty(*pool);
}

TEST(PinnedPoolTest, EmptySlabReturnsToTheArenaAndServesAnotherClass) {
  auto pool = MakePool(SmallOptions(2 * kMiB));
  ASSERT_NE(pool, nullptr);
  // 256 objects of 4 KiB fill exactly one 1 MiB slab.
  std::vector<PoolBlock> small;
  for (int i = 0; i < 256; ++i) {
    auto block = pool->Allocate(4096);
    ASSERT_TRUE(block.ok()) << block.status();
    small.push_back(*block);
  }
  EXPECT_EQ(pool->Stats().free_slabs, 1U);
  const uint32_t small_slab = small[0].slab;
  for (const PoolBlock& b : small) EXPECT_EQ(b.slab, small_slab);
  // The other slab goes to a 512 KiB class; then nothing is left for either class.
  auto half1 = pool->Allocate(512 * kKiB);
  auto half2 = pool->Allocate(512 * kKiB);
  ASSERT_TRUE(half1.ok() && half2.ok());
  EXPECT_EQ(pool->Stats().free_slabs, 0U);
  EXPECT_EQ(pool->Allocate(512 * kKiB).status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(pool->Allocate(4096).status().code(), StatusCode::kResourceExhausted);
  // Freeing all but one small block keeps the slab with its class.
  for (size_t i = 1; i < small.size(); ++i) pool->Free(small[i]);
  EXPECT_EQ(pool->Stats().free_slabs, 0U);
  EXPECT_EQ(pool->Stats().largest_free_bytes, 4096U);
  EXPECT_EQ(pool->Allocate(512 * kKiB).status().code(), StatusCode::kResourceExhausted);
  // The last one returns the slab to the arena, and the 512 KiB class takes it.
  pool->Free(small[0]);
  EXPECT_EQ(pool->Stats().free_slabs, 1U);
  auto half3 = pool->Allocate(512 * kKiB);
  ASSERT_TRUE(half3.ok()) << half3.status();
  EXPECT_EQ(half3->slab, small_slab);
  EXPECT_EQ(half3->data, small[0].data);  // Same memory, another class.
  pool->Free(*half1);
  pool->Free(*half2);
  pool->Free(*half3);
  ExpectEmpty(*pool);
}

TEST(PinnedPoolTest, FreedObjectsAreReusedBeforeNewOnes) {
  auto pool = MakePool(SmallOptions(kMiB));
  ASSERT_NE(pool, nullptr);
  auto a = pool->Allocate(64 * kKiB);
  auto b = pool->Allocate(64 * kKiB);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(a->data, b->data);
  pool->Free(*a);
  auto c = pool->Allocate(64 * kKiB - 100);  // Same 64 KiB class.
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->data, a->data);
  EXPECT_EQ(c->class_bytes, 64 * kKiB);
  pool->Free(*b);
  pool->Free(*c);
  ExpectEmpty(*pool);
}

TEST(PinnedPoolTest, ExhaustionThenRecovery) {
  auto pool = MakePool(SmallOptions(4 * kMiB));
  ASSERT_NE(pool, nullptr);
  std::vector<PoolBlock> blocks;
  for (int i = 0; i < 4; ++i) {
    auto block = pool->Allocate(kMiB);
    ASSERT_TRUE(block.ok()) << block.status();
    blocks.push_back(*block);
  }
  auto full = pool->Allocate(kMiB);
  EXPECT_EQ(full.status().code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(full.status().message()), HasSubstr("full"));
  PoolStats stats = pool->Stats();
  EXPECT_EQ(stats.allocation_failures, 1U);
  EXPECT_EQ(stats.largest_free_bytes, 0U);
  EXPECT_EQ(stats.free_slabs, 0U);
  EXPECT_EQ(pool->Allocate(4096).status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(pool->Stats().allocation_failures, 2U);

  // Evict one block: a small class takes the slab, which leaves no room for a whole slab.
  pool->Free(blocks.back());
  blocks.pop_back();
  EXPECT_EQ(pool->Stats().largest_free_bytes, kMiB);
  auto small = pool->Allocate(4096);
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ(pool->Stats().largest_free_bytes, 4096U);
  EXPECT_EQ(pool->Allocate(kMiB).status().code(), StatusCode::kResourceExhausted);
  pool->Free(*small);
  auto big = pool->Allocate(kMiB);
  ASSERT_TRUE(big.ok()) << big.status();
  blocks.push_back(*big);
  EXPECT_EQ(pool->Stats().allocation_failures, 3U);
  for (const PoolBlock& block : blocks) pool->Free(block);
  ExpectEmpty(*pool);
}

TEST(PinnedPoolTest, SizeClassLimitIsAConfigurationError) {
  auto pool = MakePool(SmallOptions(kMiB));
  ASSERT_NE(pool, nullptr);
  for (uint64_t pages = 1; pages <= kMaxSizeClasses; ++pages) {
    auto block = pool->Allocate(pages * 4096);
    ASSERT_TRUE(block.ok()) << pages << ": " << block.status();
    pool->Free(*block);
  }
  EXPECT_EQ(pool->class_count(), kMaxSizeClasses);
  auto extra = pool->Allocate((kMaxSizeClasses + 1) * 4096);
  EXPECT_EQ(extra.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(extra.status().message()), HasSubstr("size classes"));
  EXPECT_THAT(std::string(extra.status().message()), HasSubstr("configuration"));
  EXPECT_EQ(pool->Stats().allocation_failures, 0U);  // Not a full pool.
  // Sizes that round to existing classes still work.
  auto existing = pool->Allocate(3 * 4096 - 5);
  ASSERT_TRUE(existing.ok()) << existing.status();
  EXPECT_EQ(existing->class_bytes, 3 * 4096U);
  pool->Free(*existing);
  EXPECT_EQ(pool->class_count(), kMaxSizeClasses);
  ExpectEmpty(*pool);
}

TEST(PinnedPoolTest, PreferredNodeFirstThenOtherArenas) {
  auto nodes = MemoryNumaNodes();
  ASSERT_TRUE(nodes.ok());
  const int node = (*nodes)[0];
  // Arena 0 is unbound, arena 1 is on `node`; one slab each.
  auto pool = MakePool(SmallOptions(2 * kMiB, {-1, node}));
  ASSERT_NE(pool, nullptr);
  auto first = pool->Allocate(kMiB, node);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(first->arena, 1U);
  auto second = pool->Allocate(kMiB, node);  // The preferred arena is full: fall back.
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(second->arena, 0U);
  EXPECT_EQ(pool->Allocate(kMiB, node).status().code(), StatusCode::kResourceExhausted);
  pool->Free(*first);
  pool->Free(*second);
  // Without a preference the arenas take turns.
  auto a = pool->Allocate(4096);
  auto b = pool->Allocate(4096);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(a->arena, b->arena);
  pool->Free(*a);
  pool->Free(*b);
  ExpectEmpty(*pool);
}

class RecordingRegistrar : public ArenaRegistrar {
 public:
  explicit RecordingRegistrar(int fail_on_call = -1) : fail_on_call_(fail_on_call) {}

  Status Register(uint8_t* base, uint64_t bytes, int numa_node) override {
    if (static_cast<int>(registered.size()) == fail_on_call_) return Status::Internal("device said no");
    registered.push_back({base, bytes, numa_node});
    return Status::Ok();
  }
  void Unregister(uint8_t* base) override {
    unregistered.push_back(base);
    // The arena must still be mapped when it is unregistered.
    still_mapped.push_back(msync(base, 4096, MS_ASYNC) == 0);
  }

  struct Call {
    uint8_t* base;
    uint64_t bytes;
    int numa_node;
  };
  std::vector<Call> registered;
  std::vector<uint8_t*> unregistered;
  std::vector<bool> still_mapped;

 private:
  const int fail_on_call_;
};

TEST(PinnedPoolTest, RegistrarSeesEveryArenaAndUnregistersBeforeUnmap) {
  RecordingRegistrar registrar;
  PoolOptions options = SmallOptions(2 * kMiB, {-1, -1});
  options.registrar = &registrar;
  auto pool = MakePool(options);
  ASSERT_NE(pool, nullptr);
  ASSERT_EQ(registrar.registered.size(), 2U);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(registrar.registered[i].base, pool->arena(i).data());
    EXPECT_EQ(registrar.registered[i].bytes, pool->arena(i).size());
    EXPECT_EQ(registrar.registered[i].numa_node, -1);
  }
  EXPECT_TRUE(registrar.unregistered.empty());
  std::set<uint8_t*> bases = {pool->arena(0).data(), pool->arena(1).data()};
  pool.reset();
  EXPECT_EQ(std::set<uint8_t*>(registrar.unregistered.begin(), registrar.unregistered.end()), bases);
  EXPECT_EQ(registrar.unregistered.size(), 2U);
  EXPECT_EQ(registrar.still_mapped, std::vector<bool>({true, true}));
}

TEST(PinnedPoolTest, RegistrationFailureUndoesEarlierRegistrations) {
  RecordingRegistrar registrar(/*fail_on_call=*/1);
  PoolOptions options = SmallOptions(3 * kMiB, {-1, -1, -1});
  options.registrar = &registrar;
  auto pool = PinnedPool::Create(options, nullptr);
  EXPECT_EQ(pool.status().code(), StatusCode::kInternal);
  EXPECT_THAT(std::string(pool.status().message()), HasSubstr("device said no"));
  EXPECT_THAT(std::string(pool.status().message()), HasSubstr("orbitkv-pool-1"));
  ASSERT_EQ(registrar.registered.size(), 1U);
  EXPECT_EQ(registrar.unregistered, std::vector<uint8_t*>({registrar.registered[0].base}));
  EXPECT_EQ(registrar.still_mapped, std::vector<bool>({true}));
}

TEST(PinnedPoolTest, MetricsFollowTheStats) {
  MetricsRegistry metrics;
  auto pool = MakePool(SmallOptions(2 * kMiB), &metrics);
  ASSERT_NE(pool, nullptr);
  auto gauge = [&metrics](const char* name) { return metrics.GetGauge(name, "").Value(); };
  EXPECT_EQ(gauge("orbitkv_pool_capacity_bytes"), 2.0 * kMiB);
  EXPECT_EQ(gauge("orbitkv_pool_free_slabs"), 2.0);
  auto a = pool->Allocate(kMiB);
  auto b = pool->Allocate(5000);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(gauge("orbitkv_pool_allocated_bytes"), static_cast<double>(kMiB + 8192));
  EXPECT_EQ(gauge("orbitkv_pool_requested_bytes"), static_cast<double>(kMiB + 5000));
  EXPECT_EQ(gauge("orbitkv_pool_free_slabs"), 0.0);
  EXPECT_FALSE(pool->Allocate(kMiB).ok());
  EXPECT_EQ(metrics.GetCounter("orbitkv_pool_allocation_failures_total", "").Value(), 1U);
  pool->Free(*b);
  EXPECT_EQ(gauge("orbitkv_pool_allocated_bytes"), static_cast<double>(kMiB));
  EXPECT_EQ(gauge("orbitkv_pool_free_slabs"), 1.0);
  EXPECT_THAT(metrics.RenderPrometheus(), HasSubstr("orbitkv_pool_requested_bytes 1048576"));
  pool->Free(*a);
  EXPECT_EQ(gauge("orbitkv_pool_free_slabs"), 2.0);
  pool.reset();  // A destroyed pool takes its share back.
  EXPECT_EQ(gauge("orbitkv_pool_capacity_bytes"), 0.0);
  EXPECT_EQ(gauge("orbitkv_pool_free_slabs"), 0.0);
}

TEST(PinnedPoolDeathTest, DoubleFreeIsCaught) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto pool = MakePool(SmallOptions(kMiB));
  ASSERT_NE(pool, nullptr);
  auto block = pool->Allocate(8192);
  ASSERT_TRUE(block.ok());
  auto other = pool->Allocate(8192);  // Keeps the slab assigned after the first Free.
  ASSERT_TRUE(other.ok());
  pool->Free(*block);
  EXPECT_DEATH(pool->Free(*block), "double free or foreign block");
}

TEST(PinnedPoolDeathTest, ForeignOrAlteredBlocksAreCaught) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto pool = MakePool(SmallOptions(kMiB));
  ASSERT_NE(pool, nullptr);
  auto block = pool->Allocate(8192);
  ASSERT_TRUE(block.ok());
  PoolBlock moved = *block;
  moved.data += 4096;
  EXPECT_DEATH(pool->Free(moved), "not allocated from this pool");
  PoolBlock wrong_class = *block;
  wrong_class.class_bytes = 4096;
  wrong_class.requested_bytes = 4096;
  EXPECT_DEATH(pool->Free(wrong_class), "not allocated from this pool|never had");
  PoolBlock wrong_arena = *block;
  wrong_arena.arena = 3;
  EXPECT_DEATH(pool->Free(wrong_arena), "not from this pool");
  PoolBlock never = *block;
  never.index = 5;  // Never handed out.
  never.data = block->data + 5 * 8192;
  EXPECT_DEATH(pool->Free(never), "not allocated from this pool");
  pool->Free(*block);
}

// Threads allocate and free blocks of several classes concurrently. Each live block carries a stamp
// unique to its allocation at the start of every 4 KiB page it covers; since blocks are page
// aligned, two overlapping live blocks would share a stamped page and one owner would find the
// other's stamp before freeing.
TEST(PinnedPoolConcurrencyTest, ConcurrentAllocAndFreeNeverOverlap) {
  constexpr int kThreads = 4;
  constexpr int kOpsPerThread = 3000;
  constexpr size_t kMaxLive = 24;
  auto pool = MakePool(SmallOptions(24 * kMiB, {-1, -1}));
  ASSERT_NE(pool, nullptr);
  const std::vector<uint64_t> sizes = {4096, 10000, 64 * kKiB, 200 * kKiB, 512 * kKiB, kMiB};
  std::atomic<bool> done{false};
  std::atomic<uint64_t> stats_violations{0};
  // A reader takes Stats() while the pool changes: every snapshot must be self-consistent.
  std::thread reader([&] {
    while (!done.load(std::memory_order_acquire)) {
      PoolStats stats = pool->Stats();
      if (stats.requested_bytes > stats.allocated_bytes || stats.free_slabs > stats.total_slabs ||
          stats.allocated_bytes > (stats.total_slabs - stats.free_slabs) * kMiB) {
        stats_violations.fetch_add(1, std::memory_order_relaxed);
      }
    }
  });
  std::vector<uint64_t> corrupted(kThreads, 0), successes(kThreads, 0), failures(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(1000 + t);
      std::vector<std::pair<PoolBlock, uint64_t>> live;
      auto free_one = [&](size_t i) {
        const auto& [block, stamp] = live[i];
        for (uint64_t offset = 0; offset < block.requested_bytes; offset += kArenaPageBytes) {
          uint64_t seen;
          std::memcpy(&seen, block.data + offset, sizeof(seen));
          corrupted[t] += seen != stamp + offset;
        }
        pool->Free(block);
        live[i] = live.back();
        live.pop_back();
      };
      for (int op = 0; op < kOpsPerThread; ++op) {
        if (live.size() == kMaxLive || (!live.empty() && rng() % 2 == 0)) {
          free_one(rng() % live.size());
          continue;
        }
        auto block = pool->Allocate(sizes[rng() % sizes.size()], static_cast<int>(rng() % 2) - 1);
        if (!block.ok()) {
          ++failures[t];
          if (!live.empty()) free_one(rng() % live.size());
          continue;
        }
        ++successes[t];
        const uint64_t stamp = (uint64_t{1} + t) << 56 | uint64_t(op) << 24;
        for (uint64_t offset = 0; offset < block->requested_bytes; offset += kArenaPageBytes) {
          const uint64_t value = stamp + offset;
          std::memcpy(block->data + offset, &value, sizeof(value));
        }
        live.emplace_back(*block, stamp);
      }
      while (!live.empty()) free_one(live.size() - 1);
    });
  }
  for (std::thread& thread : threads) thread.join();
  done.store(true, std::memory_order_release);
  reader.join();
  uint64_t total_failures = 0;
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(corrupted[t], 0U) << "thread " << t;
    EXPECT_GT(successes[t], 0U) << "thread " << t;
    total_failures += failures[t];
  }
  EXPECT_EQ(stats_violations.load(), 0U);
  EXPECT_EQ(pool->Stats().allocation_failures, total_failures);
  ExpectEmpty(*pool);
}

}  // namespace
}  // namespace orbitkv::core
