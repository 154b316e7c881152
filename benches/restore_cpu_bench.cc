// Restore and save throughput through a real Manager into a CPU engine's shared memory (16 and 64
// KiB blocks) against single-thread memcpy.
//
// The engine registers one memfd buffer of 4096 pages, saves them all (256 MiB at 64 KiB), then
// repeatedly queries the whole prefix and restores it into the pages in reverse order. GB/s counts
// the bytes of one save or restore call over its wall time, query excluded. The baseline copies the
// same bytes with one memcpy between two buffers of the same size in this process.
#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "base/clock.h"
#include "bench_report.h"
#include "manager_fixture.h"

namespace orbitkv::bench {
namespace {

struct Figures {
  double restore_gbps = 0, save_gbps = 0;
};

Figures Measure(const testing::ManagerProcess& manager, uint64_t instance, uint64_t page_bytes, uint32_t pages) {
  client::ClientOptions options;
  options.socket_path = manager.socket();
  options.timeout = std::chrono::seconds(120);
  auto client = *client::CacheClient::Connect(options);
  EngineBuffer engine(*client, instance, pages, page_bytes);
  const uint64_t total = uint64_t{pages} * page_bytes;
  Figures best;
  for (int round = 0; round < 3; ++round) {
    // Fresh keys each round so every save copies (content-addressed blocks already resident are
    // skipped).
    const auto keys = EngineBuffer::Keys(instance * 100 + round, pages);
    std::vector<client::SaveItem> items;
    for (uint32_t i = 0; i < pages; ++i) items.push_back({keys[i], i});
    Stopwatch save_watch;
    auto saved = client->Save(instance, 0, items);
    const double save_s = save_watch.ElapsedSeconds();
    ORBITKV_CHECK_MSG(saved.ok() && saved->written == pages, "save failed: {}", saved.status().ToString());
    best.save_gbps = std::max(best.save_gbps, static_cast<double>(total) / save_s / 1e9);
    // Queries answer at most max_query_keys keys: restore the prefix in chunks, timing only the
    // restores.
    double restore_s = 0;
    for (size_t start = 0; start < keys.size();) {
      auto hit = client->Query(instance, 0, std::span(keys).subspan(start));
      ORBITKV_CHECK_MSG(hit.ok() && hit->hits > 0, "query failed: {}", hit.status().ToString());
      std::vector<uint32_t> dst(hit->hits);
      for (uint32_t i = 0; i < hit->hits; ++i) dst[i] = pages - 1 - static_cast<uint32_t>(start + i);
      Stopwatch watch;
      ORBITKV_CHECK(client->Restore(instance, 0, hit->lease, dst).ok());
      restore_s += watch.ElapsedSeconds();
      start += hit->hits;
    }
    best.restore_gbps = std::max(best.restore_gbps, static_cast<double>(total) / restore_s / 1e9);
  }
  ORBITKV_CHECK(client->UnregisterInstance(instance).ok());
  return best;
}

void ProfileSaves(const testing::ManagerProcess& manager, uint64_t instance, uint64_t page_bytes, uint32_t pages,
                  int rounds) {
  client::ClientOptions options;
  options.socket_path = manager.socket();
  options.timeout = std::chrono::seconds(120);
  auto client = *client::CacheClient::Connect(options);
  EngineBuffer engine(*client, instance, pages, page_bytes);
  for (int round = 0; round < rounds; ++round) {
    const auto keys = EngineBuffer::Keys(instance * 1000 + round, pages);
    std::vector<client::SaveItem> items;
    for (uint32_t i = 0; i < pages; ++i) items.push_back({keys[i], i});
    Stopwatch watch;
    auto saved = client->Save(instance, 0, items);
    const double seconds = watch.ElapsedSeconds();
    ORBITKV_CHECK_MSG(saved.ok(), "save failed: {}", saved.status().ToString());
    fmt::print(stderr, "round {}: {:.2f} GB/s\n", round,
               static_cast<double>(pages) * static_cast<double>(page_bytes) / seconds / 1e9);
  }
}

double MemcpyGbps(uint64_t bytes) {
  auto* a = static_cast<uint8_t*>(mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  auto* b = static_cast<uint8_t*>(mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  std::memset(a, 1, bytes);
  std::memset(b, 2, bytes);
  double best = 0;
  for (int i = 0; i < 5; ++i) {
    Stopwatch watch;
    std::memcpy(b, a, bytes);
    best = std::max(best, static_cast<double>(bytes) / watch.ElapsedSeconds() / 1e9);
  }
  munmap(a, bytes);
  munmap(b, bytes);
  return best;
}

}  // namespace
}  // namespace orbitkv::bench

int main(int argc, char** argv) {
  using namespace orbitkv::bench;
  const bool json = ParseBenchArgs(argc, argv,
                                   "Restore and save GB/s through a real Manager into engine shared memory with 16 "
                                   "and 64 KiB blocks, vs single-thread memcpy of the same bytes.");
  // Profiling aid: ORBITKV_SAVE_PROFILE_ROUNDS=N only saves 16 KiB blocks, N rounds of fresh keys,
  // so a profiler attached to the Manager (perf record -p) sees the save path alone. Prints each
  // round's GB/s. ORBITKV_SAVE_PROFILE_DRAM sizes the pool (default 6GiB; a smaller one reaches
  // eviction sooner).
  if (const char* rounds = std::getenv("ORBITKV_SAVE_PROFILE_ROUNDS"); rounds != nullptr) {
    const char* dram = std::getenv("ORBITKV_SAVE_PROFILE_DRAM");
    const auto manager = StartManager(dram != nullptr ? dram : "6GiB", {"--slab", "4MiB"});
    ProfileSaves(*manager, 2, 16 << 10, 8192, std::atoi(rounds));
    return 0;
  }
  BenchReport report("restore-cpu");
  AddStandardEnv(report);
  // Large enough that no round evicts another round's blocks (3 x 256 MiB + 3 x 128 MiB).
  const auto manager = StartManager("2GiB", {"--slab", "4MiB"});
  const Figures f64 = Measure(*manager, 1, 64 << 10, 4096);
  const Figures f16 = Measure(*manager, 2, 16 << 10, 8192);
  const double memcpy_gbps = MemcpyGbps(256ull << 20);
  report.Add({"restore_cpu_64k", "GB/s", f64.restore_gbps, "memcpy_1t", memcpy_gbps});
  report.Add({"save_cpu_64k", "GB/s", f64.save_gbps, "memcpy_1t", memcpy_gbps});
  report.Add({"restore_cpu_16k", "GB/s", f16.restore_gbps, "memcpy_1t", memcpy_gbps});
  report.Add({"save_cpu_16k", "GB/s", f16.save_gbps, "memcpy_1t", memcpy_gbps});
  report.Print(json);
  return 0;
}
