// Core cache: prefix lookup, pool alloc/free, publish+evict (1 and 2 threads) and the CPU copy
// engine, against std containers, malloc and memcpy.
//
// Google Benchmark runs the microbenchmarks; a capturing reporter turns its runs into one
// BenchReport. Baselines are measured in the same process: 128 finds in a single-threaded
// std::unordered_map keyed by the same StateKeys, malloc/free of the same size, an unordered_map
// insert+erase, and one single-threaded memcpy of the same 1 GiB the copy engine moves in 64 KiB
// fragments.
#include <benchmark/benchmark.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "base/check.h"
#include "base/clock.h"
#include "base/logging.h"
#include "base/metrics.h"
#include "bench_report.h"
#include "core/block_cache.h"
#include "core/cpu_copy_engine.h"
#include "state/namespace.h"
#include "state/state_key.h"

namespace orbitkv::bench {
namespace {

using core::BlockCache;
using core::BlockCacheOptions;
using state::StateKey;

constexpr uint64_t kBlockBytes = 64 << 10;
constexpr size_t kPrefix = 128;
constexpr int kChains = 8;

state::StateNamespace BenchNamespace() {
  state::NamespaceIdentity id;
  id.model_id = "bench/model";
  id.weights_revision = "r1";
  id.tokenizer = "bench/tok";
  id.engine_kind = "vllm";
  return *state::DeriveNamespace(id);
}

StateKey Key(uint64_t chain, uint64_t i) {
  static const state::StateNamespace ns = BenchNamespace();
  uint8_t native[16];
  std::memcpy(native, &chain, 8);
  std::memcpy(native + 8, &i, 8);
  return *StateKey::Create(ns, 0, {i * 16, i * 16 + 16}, std::span<const uint8_t>(native, 16));
}

std::vector<StateKey> Chain(uint64_t chain, size_t n) {
  std::vector<StateKey> keys;
  for (size_t i = 0; i < n; ++i) keys.push_back(Key(chain, i));
  return keys;
}

BlockCacheOptions CacheOptions(uint64_t capacity) {
  BlockCacheOptions options;
  options.pool.capacity_bytes = capacity;
  options.pool.slab_bytes = 4 << 20;
  options.pool.numa_nodes = {-1};
  // Production locks the pool; a benchmark host without CAP_IPC_LOCK still runs (with a warning).
  options.pool.pin_mode = core::PinMode::kAllowUnpinned;
  options.table.expected_blocks = capacity / kBlockBytes;
  return options;
}

// State shared by the microbenchmarks, built once before they run.
struct Fixture {
  MetricsRegistry metrics;
  std::unique_ptr<BlockCache> lookup_cache;  // kChains resident chains of kPrefix blocks
  std::vector<std::vector<StateKey>> chains;
  std::vector<StateKey> missing;  // never published
  std::unordered_map<StateKey, uint32_t, state::StateKeyHash> plain_map;
  std::unique_ptr<BlockCache> churn_cache;        // small: every publish evicts
  std::vector<std::vector<StateKey>> churn_keys;  // per thread
  std::atomic<uint64_t> churn_cursor[2] = {0, 0};
};
Fixture* fixture = nullptr;

void BuildFixture() {
  fixture = new Fixture();
  fixture->lookup_cache = *BlockCache::Create(CacheOptions(256ull << 20), &fixture->metrics);
  for (int c = 0; c < kChains; ++c) {
    fixture->chains.push_back(Chain(c, kPrefix));
    for (const StateKey& key : fixture->chains.back()) {
      auto writer = fixture->lookup_cache->Prepare(key, kBlockBytes);
      ORBITKV_CHECK(writer.ok());
      fixture->lookup_cache->Seal(*writer);
      fixture->plain_map.emplace(key, static_cast<uint32_t>(fixture->plain_map.size()));
    }
  }
  fixture->missing = Chain(1000, kPrefix);
  MetricsRegistry* churn_metrics = new MetricsRegistry();  // separate names space; leaked with the fixture
  fixture->churn_cache = *BlockCache::Create(CacheOptions(32ull << 20), churn_metrics);
  for (int t = 0; t < 2; ++t) fixture->churn_keys.push_back(Chain(2000 + t, 1 << 16));
}

void BM_UnorderedMapLookup128(benchmark::State& state) {
  const auto& keys = fixture->chains[0];
  for (auto _ : state) {
    size_t found = 0;
    for (const StateKey& key : keys) found += fixture->plain_map.count(key);
    benchmark::DoNotOptimize(found);
  }
  state.SetItemsProcessed(state.iterations());
}

void BM_PrefixLookup128(benchmark::State& state) {
  const auto& keys = fixture->chains[state.thread_index() % kChains];
  for (auto _ : state) {
    size_t hits = fixture->lookup_cache->table().LookupPrefix(keys);
    if (hits != kPrefix) state.SkipWithError("prefix lookup lost blocks");
    benchmark::DoNotOptimize(hits);
  }
  state.SetItemsProcessed(state.iterations());
}

void BM_PrefixLookup128Miss(benchmark::State& state) {
  for (auto _ : state) {
    size_t hits = fixture->lookup_cache->table().LookupPrefix(fixture->missing);
    benchmark::DoNotOptimize(hits);
  }
  state.SetItemsProcessed(state.iterations());
}

void BM_UnorderedMapMiss1(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(fixture->plain_map.count(fixture->missing[0]));
  state.SetItemsProcessed(state.iterations());
}

void BM_PoolAllocFree(benchmark::State& state) {
  core::PinnedPool& pool = fixture->lookup_cache->pool();
  for (auto _ : state) {
    auto block = pool.Allocate(kBlockBytes);
    if (!block.ok()) {
      state.SkipWithError("pool allocation failed");
      break;
    }
    benchmark::DoNotOptimize(block->data);
    pool.Free(*block);
  }
  state.SetItemsProcessed(state.iterations());
}

void BM_MallocFree(benchmark::State& state) {
  for (auto _ : state) {
    void* p = std::malloc(kBlockBytes);
    benchmark::DoNotOptimize(p);
    std::free(p);
  }
  state.SetItemsProcessed(state.iterations());
}

void BM_PublishEvict(benchmark::State& state) {
  const auto& keys = fixture->churn_keys[state.thread_index()];
  std::atomic<uint64_t>& cursor = fixture->churn_cursor[state.thread_index()];
  BlockCache& cache = *fixture->churn_cache;
  for (auto _ : state) {
    const StateKey& key = keys[cursor.fetch_add(1, std::memory_order_relaxed) % keys.size()];
    auto writer = cache.Prepare(key, kBlockBytes);
    if (writer.ok()) {
      cache.Seal(*writer);
    } else if (writer.status().code() != StatusCode::kAlreadyExists) {
      state.SkipWithError("publish failed");
      break;
    }
  }
  state.SetItemsProcessed(state.iterations());
}

void BM_UnorderedMapInsertErase(benchmark::State& state) {
  const auto& keys = fixture->churn_keys[0];
  const size_t resident = (32ull << 20) / kBlockBytes;
  std::unordered_map<StateKey, uint32_t, state::StateKeyHash> map;
  std::deque<size_t> order;
  size_t next = 0;
  for (auto _ : state) {
    const size_t index = next++ % keys.size();
    map.emplace(keys[index], static_cast<uint32_t>(index));
    order.push_back(index);
    if (order.size() > resident) {
      map.erase(keys[order.front()]);
      order.pop_front();
    }
  }
  state.SetItemsProcessed(state.iterations());
}

// Keeps the best items/s of each (benchmark, threads) over repetitions.
class CaptureReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& run : runs) {
      if (run.run_type != Run::RT_Iteration || run.error_occurred) {
        if (run.error_occurred) errors.push_back(run.benchmark_name() + ": " + run.error_message);
        continue;
      }
      auto it = run.counters.find("items_per_second");
      if (it == run.counters.end()) continue;
      double& best = rates[{run.run_name.function_name, run.threads}];
      best = std::max(best, static_cast<double>(it->second.value));
    }
  }
  std::map<std::pair<std::string, int>, double> rates;
  std::vector<std::string> errors;
};

double NsPerOp(const CaptureReporter& reporter, const std::string& name, int threads) {
  auto it = reporter.rates.find({name, threads});
  ORBITKV_CHECK_MSG(it != reporter.rates.end() && it->second > 0, "no result for {} threads={}", name, threads);
  return 1e9 / it->second;
}

// ---- CPU copy engine vs memcpy ----

struct CopyFigures {
  double restore_gbps = 0;
  double save_gbps = 0;
  double memcpy_gbps = 0;
};

CopyFigures MeasureCopy(int repeats) {
  constexpr uint64_t kTotal = 1ull << 30;
  constexpr uint64_t kFragment = 64 << 10;
  MetricsRegistry metrics;
  // The pool side: a 1 GiB pool carved into 64 KiB blocks. The engine side: a shared-memory buffer
  // (memfd).
  BlockCacheOptions options = CacheOptions(kTotal);
  options.pool.slab_bytes = 32 << 20;
  auto cache = *BlockCache::Create(options, &metrics);
  int fd = memfd_create("orbitkv-bench-engine", MFD_CLOEXEC);
  ORBITKV_CHECK(fd >= 0 && ftruncate(fd, kTotal) == 0);
  auto* buffer = static_cast<uint8_t*>(mmap(nullptr, kTotal, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  ORBITKV_CHECK(buffer != MAP_FAILED);
  std::memset(buffer, 0x5a, kTotal);
  std::vector<core::PoolBlock> blocks;
  for (uint64_t off = 0; off < kTotal; off += kFragment) {
    auto block = cache->pool().Allocate(kFragment);
    ORBITKV_CHECK(block.ok());
    std::memset(block->data, 0x33, kFragment);
    blocks.push_back(*block);
  }

  core::CpuCopyEngine::Options engine_options;
  engine_options.threads = 2;
  auto engine = *core::CpuCopyEngine::Create(engine_options, &metrics);
  const core::BufferId id = *engine->RegisterBuffer(buffer, kTotal);

  auto run = [&](core::CopyDirection direction) {
    core::CopyBatch batch;
    batch.direction = direction;
    batch.fragments.reserve(blocks.size());
    for (size_t i = 0; i < blocks.size(); ++i) {
      batch.fragments.push_back(core::CopyFragment{id, i * kFragment, blocks[i].data, kFragment});
    }
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    Stopwatch watch;
    Status submitted = engine->Submit(std::move(batch), [&](Status status) {
      ORBITKV_CHECK_MSG(status.ok(), "copy failed: {}", status.ToString());
      std::lock_guard<std::mutex> lock(mu);
      done = true;
      cv.notify_one();
    });
    ORBITKV_CHECK_MSG(submitted.ok(), "submit failed: {}", submitted.ToString());
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done; });
    return static_cast<double>(kTotal) / watch.ElapsedSeconds() / 1e9;
  };

  CopyFigures figures;
  uint8_t* contiguous = cache->pool().arena(0).data();  // the same pool pages, as one range
  for (int r = 0; r < repeats; ++r) {
    figures.restore_gbps = std::max(figures.restore_gbps, run(core::CopyDirection::kRestore));
    figures.save_gbps = std::max(figures.save_gbps, run(core::CopyDirection::kSave));
    Stopwatch watch;
    std::memcpy(buffer, contiguous, kTotal);
    benchmark::ClobberMemory();
    figures.memcpy_gbps = std::max(figures.memcpy_gbps, static_cast<double>(kTotal) / watch.ElapsedSeconds() / 1e9);
  }
  engine->Shutdown();
  ORBITKV_CHECK(engine->UnregisterBuffer(id).ok());
  for (const auto& block : blocks) cache->pool().Free(block);
  munmap(buffer, kTotal);
  close(fd);
  return figures;
}

}  // namespace
}  // namespace orbitkv::bench

int main(int argc, char** argv) {
  using namespace orbitkv;
  using namespace orbitkv::bench;
  const bool json = ParseBenchArgs(argc, argv,
                                   "Core cache: 128-key prefix lookup (hit/miss) vs "
                                   "std::unordered_map, pool alloc/free vs malloc, "
                                   "publish+evict vs unordered_map insert+erase, at 1 and 2 "
                                   "threads; CPU copy engine moving 1 GiB in 64 KiB "
                                   "fragments vs single-thread memcpy.");
  log::Options log_options;
  log_options.level = log::Level::kWarn;
  Status logged = log::Init(log_options);
  ORBITKV_CHECK(logged.ok());

  BuildFixture();
  BenchReport report("core");
  AddStandardEnv(report);

  benchmark::RegisterBenchmark("unordered_map_lookup_128", BM_UnorderedMapLookup128)->UseRealTime();
  benchmark::RegisterBenchmark("prefix_lookup_128", BM_PrefixLookup128)->Threads(1)->Threads(2)->UseRealTime();
  benchmark::RegisterBenchmark("unordered_map_miss_1", BM_UnorderedMapMiss1)->UseRealTime();
  benchmark::RegisterBenchmark("prefix_lookup_128_miss", BM_PrefixLookup128Miss)->Threads(1)->Threads(2)->UseRealTime();
  benchmark::RegisterBenchmark("malloc_free_64k", BM_MallocFree)->UseRealTime();
  benchmark::RegisterBenchmark("pool_alloc_free", BM_PoolAllocFree)->Threads(1)->Threads(2)->UseRealTime();
  benchmark::RegisterBenchmark("unordered_map_insert_erase", BM_UnorderedMapInsertErase)->UseRealTime();
  benchmark::RegisterBenchmark("publish_evict", BM_PublishEvict)->Threads(1)->Threads(2)->UseRealTime();

  std::string min_time = "--benchmark_min_time=0.2";
  std::string repetitions = "--benchmark_repetitions=3";
  char* bench_argv[] = {argv[0], min_time.data(), repetitions.data(), nullptr};
  int bench_argc = 3;
  benchmark::Initialize(&bench_argc, bench_argv);
  CaptureReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  for (const std::string& error : reporter.errors) std::fprintf(stderr, "core_bench: %s\n", error.c_str());
  if (!reporter.errors.empty()) return 1;

  const double map128 = NsPerOp(reporter, "unordered_map_lookup_128", 1);
  report.Add(
      {"prefix_lookup_128", "ns", NsPerOp(reporter, "prefix_lookup_128", 1), "unordered_map_lookup_128", map128});
  report.Add(
      {"prefix_lookup_128_t2", "ns", NsPerOp(reporter, "prefix_lookup_128", 2), "unordered_map_lookup_128", map128});
  const double miss1 = NsPerOp(reporter, "unordered_map_miss_1", 1);
  report.Add(
      {"prefix_lookup_128_miss", "ns", NsPerOp(reporter, "prefix_lookup_128_miss", 1), "unordered_map_miss_1", miss1});
  report.Add({"prefix_lookup_128_miss_t2", "ns", NsPerOp(reporter, "prefix_lookup_128_miss", 2), "unordered_map_miss_1",
              miss1});
  const double malloc_ns = NsPerOp(reporter, "malloc_free_64k", 1);
  report.Add({"pool_alloc_free", "ns", NsPerOp(reporter, "pool_alloc_free", 1), "malloc_free_64k", malloc_ns});
  report.Add({"pool_alloc_free_t2", "ns", NsPerOp(reporter, "pool_alloc_free", 2), "malloc_free_64k", malloc_ns});
  const double map_churn = NsPerOp(reporter, "unordered_map_insert_erase", 1);
  report.Add({"publish_evict", "ns", NsPerOp(reporter, "publish_evict", 1), "unordered_map_insert_erase", map_churn});
  report.Add(
      {"publish_evict_t2", "ns", NsPerOp(reporter, "publish_evict", 2), "unordered_map_insert_erase", map_churn});

  const CopyFigures copy = MeasureCopy(5);
  report.Add({"cpu_copy_64k", "GB/s", copy.restore_gbps, "memcpy_1t", copy.memcpy_gbps});
  report.Add({"cpu_copy_64k_save", "GB/s", copy.save_gbps, "memcpy_1t", copy.memcpy_gbps});
  report.AddEnv("note", "ns metrics at t2 are wall time per operation with 2 threads running (aggregate rate)");
  report.Print(json);
  return 0;
}
