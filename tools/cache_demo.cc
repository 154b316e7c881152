// orbitkv-cache-demo: the core cache serving a prefix-reuse workload from several CPU engine
// instances.
//
// Each simulated engine owns a shared-memory KV buffer (memfd) of pages. Requests draw a shared
// document prefix (Zipf-popular system prompts and documents) plus a private tail. For each request
// the engine asks the cache for its longest resident prefix, restores the hit pages into its buffer
// through the CPU copy engine, checks every restored byte against what that page must contain,
// "computes" the missed pages and saves them back through the copy engine. The demo prints
// progress, then hit rates, bytes moved, evictions, W-TinyLFU rejections, and the Prometheus
// metrics the Manager will export. It is what `scripts/run` shows until the Manager lands.
#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "base/clock.h"
#include "base/logging.h"
#include "base/metrics.h"
#include "base/scoped_fd.h"
#include "core/block_cache.h"
#include "core/cpu_copy_engine.h"
#include "state/namespace.h"
#include "state/state_key.h"

namespace orbitkv::tools {
namespace {

struct Options {
  uint64_t pool_mib = 256;
  uint64_t page_kib = 64;
  uint64_t instances = 2;
  uint64_t requests = 2000;
  uint64_t documents = 64;
  uint64_t prefix_pages = 32;
  uint64_t tail_pages = 8;
  bool allow_unpinned = false;
  bool metrics = false;
};

void PrintHelp() {
  fmt::print(
      "orbitkv-cache-demo: the core cache serving a prefix-reuse workload from CPU engine "
      "instances.\n\n"
      "Options:\n"
      "  --pool-mib N        pinned DRAM pool size in MiB (default 256)\n"
      "  --page-kib N        KV page (block) size in KiB (default 64)\n"
      "  --instances N       simulated engine instances, one thread each (default 2)\n"
      "  --requests N        requests per instance (default 2000)\n"
      "  --documents N       distinct shared prefixes, Zipf-popular (default 64)\n"
      "  --prefix-pages N    pages in each shared prefix (default 32)\n"
      "  --tail-pages N      private pages after the prefix, never reused (default 8)\n"
      "  --allow-unpinned    run with an unlocked pool when memory cannot be locked (development "
      "only)\n"
      "  --metrics           print the Prometheus metrics at the end\n"
      "  --help              this text\n");
}

bool ParseArgs(int argc, char** argv, Options* opt) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      PrintHelp();
      std::exit(0);
    }
    if (arg == "--allow-unpinned") {
      opt->allow_unpinned = true;
      continue;
    }
    if (arg == "--metrics") {
      opt->metrics = true;
      continue;
    }
    uint64_t* target = arg == "--pool-mib"       ? &opt->pool_mib
                       : arg == "--page-kib"     ? &opt->page_kib
                       : arg == "--instances"    ? &opt->instances
                       : arg == "--requests"     ? &opt->requests
                       : arg == "--documents"    ? &opt->documents
                       : arg == "--prefix-pages" ? &opt->prefix_pages
                       : arg == "--tail-pages"   ? &opt->tail_pages
                                                 : nullptr;
    if (target == nullptr) {
      fmt::print(stderr, "orbitkv-cache-demo: unknown option {} (see --help)\n", arg);
      return false;
    }
    if (i + 1 >= argc) {
      fmt::print(stderr, "orbitkv-cache-demo: {} needs a value (see --help)\n", arg);
      return false;
    }
    char* end = nullptr;
    *target = std::strtoull(argv[++i], &end, 10);
    if (*end != '\0' || *target == 0) {
      fmt::print(stderr, "orbitkv-cache-demo: {} needs a positive integer, got '{}'\n", arg, argv[i]);
      return false;
    }
  }
  if (opt->page_kib % 4 != 0 || opt->page_kib > 4096) {
    fmt::print(stderr, "orbitkv-cache-demo: --page-kib must be a multiple of 4 up to 4096\n");
    return false;
  }
  return true;
}

// The bytes a page must hold: a function of its key only (content addressing), so any restore can
// be checked.
void FillPage(const state::StateKey& key, uint8_t* data, uint64_t bytes) {
  uint64_t seed = key.Hash64();
  for (uint64_t i = 0; i < bytes; i += 8) {
    const uint64_t v = seed ^ (i * 0x9e3779b97f4a7c15ull);
    std::memcpy(data + i, &v, 8);
  }
}

bool CheckPage(const state::StateKey& key, const uint8_t* data, uint64_t bytes) {
  uint64_t seed = key.Hash64();
  for (uint64_t i = 0; i < bytes; i += 8) {
    const uint64_t v = seed ^ (i * 0x9e3779b97f4a7c15ull);
    if (std::memcmp(data + i, &v, 8) != 0) return false;
  }
  return true;
}

// Waits for one copy batch.
class Completion {
 public:
  core::CopyDone Callback() {
    return [this](Status status) {
      std::lock_guard<std::mutex> lock(mu_);
      status_ = std::move(status);
      done_ = true;
      cv_.notify_one();
    };
  }
  Status Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return done_; });
    done_ = false;
    return status_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  Status status_;
};

struct Totals {
  std::atomic<uint64_t> requests{0};
  std::atomic<uint64_t> pages_asked{0};
  std::atomic<uint64_t> pages_hit{0};
  std::atomic<uint64_t> bytes_restored{0};
  std::atomic<uint64_t> bytes_saved{0};
  std::atomic<uint64_t> backpressure{0};
  std::atomic<uint64_t> corrupt{0};
  std::atomic<uint64_t> copy_nanos{0};
};

// One engine instance: its own shared-memory KV buffer and request stream.
Status RunInstance(uint64_t instance, const Options& opt, const state::StateNamespace& ns, core::BlockCache& cache,
                   core::CpuCopyEngine& engine, Totals& totals) {
  const uint64_t page_bytes = opt.page_kib << 10;
  const uint64_t pages = opt.prefix_pages + opt.tail_pages;
  const uint64_t buffer_bytes = pages * page_bytes;
  ScopedFd fd(memfd_create("orbitkv-demo-engine", MFD_CLOEXEC));
  if (!fd.valid() || ftruncate(fd.get(), static_cast<off_t>(buffer_bytes)) != 0) {
    return ErrnoStatus("engine buffer memfd", errno);
  }
  void* mapped = mmap(nullptr, buffer_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (mapped == MAP_FAILED) return ErrnoStatus("mmap engine buffer", errno);
  auto* buffer = static_cast<uint8_t*>(mapped);
  ORBITKV_ASSIGN_OR_RETURN(core::BufferId buffer_id, engine.RegisterBuffer(buffer, buffer_bytes));

  std::mt19937_64 rng(instance * 7919 + 1);
  // Zipf(1.0) over documents by inverse-CDF on precomputed weights.
  std::vector<double> cdf(opt.documents);
  double sum = 0;
  for (uint64_t d = 0; d < opt.documents; ++d) cdf[d] = (sum += 1.0 / static_cast<double>(d + 1));
  std::uniform_real_distribution<double> uniform(0, sum);

  Completion completion;
  Status result = Status::Ok();
  for (uint64_t r = 0; r < opt.requests && result.ok(); ++r) {
    const uint64_t document = std::lower_bound(cdf.begin(), cdf.end(), uniform(rng)) - cdf.begin();
    std::vector<state::StateKey> keys;
    keys.reserve(pages);
    for (uint64_t p = 0; p < pages; ++p) {
      // Prefix pages are shared by every request on the document; tail pages are private to this
      // request.
      uint64_t native[2] = {p < opt.prefix_pages ? document : (instance << 40 | r) + (1ull << 62), p};
      ORBITKV_ASSIGN_OR_RETURN(
          state::StateKey key,
          state::StateKey::Create(ns, 0, {p * 16, p * 16 + 16},
                                  std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(native), 16)));
      keys.push_back(key);
    }
    // Stale data in the engine's pages must never pass for a restore.
    std::memset(buffer, 0xee, buffer_bytes);

    auto query = cache.Query(instance, keys, page_bytes);
    size_t hits = 0;
    if (query.ok() && query->lease.has_value()) {
      ORBITKV_ASSIGN_OR_RETURN(core::LeaseUse use, cache.ConsumeLease(instance, *query->lease));
      hits = use.pins().size();
      core::CopyBatch batch;
      batch.direction = core::CopyDirection::kRestore;
      for (size_t i = 0; i < hits; ++i) {
        batch.fragments.push_back(
            core::CopyFragment{buffer_id, i * page_bytes, const_cast<uint8_t*>(use.pins()[i].data()), page_bytes});
      }
      Stopwatch watch;
      ORBITKV_RETURN_IF_ERROR(engine.Submit(std::move(batch), completion.Callback()));
      ORBITKV_RETURN_IF_ERROR(completion.Wait());
      totals.copy_nanos += static_cast<uint64_t>(watch.ElapsedSeconds() * 1e9);
      use.Reset();  // the copy completed: pins and reservation go back
      for (size_t i = 0; i < hits; ++i) {
        if (!CheckPage(keys[i], buffer + i * page_bytes, page_bytes)) totals.corrupt++;
      }
      totals.bytes_restored += hits * page_bytes;
    } else if (!query.ok()) {
      if (query.status().code() != StatusCode::kResourceExhausted) return query.status();
      totals.backpressure++;  // the engine would retry later; here it recomputes
    }
    // "Compute" the missed pages, then save them.
    core::CopyBatch save;
    save.direction = core::CopyDirection::kSave;
    std::vector<core::BlockWriter> writers;
    for (size_t i = hits; i < pages; ++i) {
      FillPage(keys[i], buffer + i * page_bytes, page_bytes);
      auto writer = cache.Prepare(keys[i], page_bytes);
      if (!writer.ok()) continue;  // already resident, being written by another instance, or no room now
      save.fragments.push_back(core::CopyFragment{buffer_id, i * page_bytes, writer->data(), page_bytes});
      writers.push_back(std::move(*writer));
    }
    if (!save.fragments.empty()) {
      Stopwatch watch;
      ORBITKV_RETURN_IF_ERROR(engine.Submit(std::move(save), completion.Callback()));
      ORBITKV_RETURN_IF_ERROR(completion.Wait());
      totals.copy_nanos += static_cast<uint64_t>(watch.ElapsedSeconds() * 1e9);
      for (core::BlockWriter& writer : writers) {
        totals.bytes_saved += writer.bytes();
        cache.Seal(writer);
      }
    }
    totals.requests++;
    totals.pages_asked += pages;
    totals.pages_hit += hits;
  }
  Status unregistered = engine.UnregisterBuffer(buffer_id);
  munmap(buffer, buffer_bytes);
  cache.CleanupInstance(instance);
  return result.ok() ? unregistered : result;
}

int Run(const Options& opt) {
  MetricsRegistry metrics;
  core::BlockCacheOptions cache_options;
  cache_options.pool.capacity_bytes = opt.pool_mib << 20;
  cache_options.pool.slab_bytes = std::max<uint64_t>(std::bit_ceil(opt.page_kib << 13), 1 << 20);
  cache_options.pool.pin_mode = opt.allow_unpinned ? core::PinMode::kAllowUnpinned : core::PinMode::kRequireLocked;
  cache_options.table.expected_blocks = (opt.pool_mib << 10) / opt.page_kib;
  auto cache = core::BlockCache::Create(cache_options, &metrics);
  if (!cache.ok()) {
    fmt::print(stderr, "orbitkv-cache-demo: {}\n", cache.status().ToString());
    return 1;
  }
  core::CpuCopyEngine::Options engine_options;
  engine_options.threads = 2;
  auto engine = core::CpuCopyEngine::Create(engine_options, &metrics);
  if (!engine.ok()) {
    fmt::print(stderr, "orbitkv-cache-demo: {}\n", engine.status().ToString());
    return 1;
  }
  state::NamespaceIdentity id;
  id.model_id = "demo/llama-8b";
  id.weights_revision = "r1";
  id.tokenizer = "demo/llama-8b";
  id.engine_kind = "cpu-demo";
  const state::StateNamespace ns = *state::DeriveNamespace(id);

  fmt::print(
      "OrbitKV core cache demo: {} MiB pool ({}), {} KiB pages, {} instances x {} requests, {} "
      "documents of {} "
      "pages + {} private pages\n",
      opt.pool_mib, (*cache)->pool().arena(0).locked() ? "mlocked" : "NOT locked", opt.page_kib, opt.instances,
      opt.requests, opt.documents, opt.prefix_pages, opt.tail_pages);
  Totals totals;
  std::vector<Status> results(opt.instances);
  std::vector<std::thread> threads;
  std::atomic<uint64_t> finished{0};
  Stopwatch wall;
  for (uint64_t i = 0; i < opt.instances; ++i) {
    threads.emplace_back([&, i] {
      results[i] = RunInstance(i + 1, opt, ns, **cache, **engine, totals);
      finished.fetch_add(1, std::memory_order_release);  // publishes results[i] to the joiner
    });
  }
  // Progress once a second until every instance finished.
  const uint64_t total_requests = opt.instances * opt.requests;
  uint64_t last_print = 0;
  while (finished.load(std::memory_order_acquire) < opt.instances) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const uint64_t now = static_cast<uint64_t>(wall.ElapsedSeconds());
    if (now == last_print) continue;
    last_print = now;
    fmt::print("  {:>4}s  {:>7}/{} requests  hit rate {:5.1f}%\n", now, totals.requests.load(), total_requests,
               100.0 * static_cast<double>(totals.pages_hit.load()) /
                   static_cast<double>(std::max<uint64_t>(totals.pages_asked.load(), 1)));
    std::fflush(stdout);
  }
  for (auto& t : threads) t.join();
  (*engine)->Shutdown();
  for (const Status& s : results) {
    if (!s.ok()) {
      fmt::print(stderr, "orbitkv-cache-demo: an instance failed: {}\n", s.ToString());
      return 1;
    }
  }
  const double seconds = wall.ElapsedSeconds();
  const auto stats = (*cache)->table().Stats();
  auto counter = [&](const char* name, MetricLabels labels = {}) {
    return metrics.GetCounter(name, "", std::move(labels)).Value();
  };
  fmt::print("\nresults after {:.1f} s\n", seconds);
  fmt::print("  requests                 {:>12}\n", totals.requests.load());
  fmt::print("  pages asked / hit        {:>12} / {} ({:.1f}% restored instead of recomputed)\n",
             totals.pages_asked.load(), totals.pages_hit.load(),
             100.0 * static_cast<double>(totals.pages_hit.load()) / static_cast<double>(totals.pages_asked.load()));
  fmt::print("  restored / saved         {:>9.1f} MiB / {:.1f} MiB, {:.2f} GB/s while copying\n",
             static_cast<double>(totals.bytes_restored.load()) / (1 << 20),
             static_cast<double>(totals.bytes_saved.load()) / (1 << 20),
             static_cast<double>(totals.bytes_restored.load() + totals.bytes_saved.load()) /
                 std::max(1.0, static_cast<double>(totals.copy_nanos.load())));
  fmt::print("  resident blocks / bytes  {:>12} / {:.1f} MiB of {} MiB\n", stats.resident_blocks,
             static_cast<double>(stats.resident_bytes) / (1 << 20), opt.pool_mib);
  fmt::print("  evictions                {:>12}\n", counter("orbitkv_cache_evictions_total", {{"tier", "dram"}}));
  fmt::print("  one-hit blocks rejected  {:>12} (W-TinyLFU kept hot prefixes)\n",
             counter("orbitkv_cache_admissions_rejected_total"));
  fmt::print("  budget backpressure      {:>12}\n", totals.backpressure.load());
  fmt::print("  corrupted restores       {:>12}\n", totals.corrupt.load());
  fmt::print("  leases / pinned after    {:>12} / {}\n", (*cache)->leases().active(), stats.pinned_blocks);
  if (opt.metrics) fmt::print("\n{}", metrics.RenderPrometheus());
  if (totals.corrupt.load() != 0 || (*cache)->leases().active() != 0 || stats.pinned_blocks != 0) {
    fmt::print(stderr, "orbitkv-cache-demo: FAILED: corrupted restores or leaked pins\n");
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace orbitkv::tools

int main(int argc, char** argv) {
  orbitkv::tools::Options opt;
  if (!orbitkv::tools::ParseArgs(argc, argv, &opt)) return 2;
  orbitkv::log::Options log_options;
  log_options.level = orbitkv::log::Level::kWarn;
  if (!orbitkv::log::Init(log_options).ok()) return 1;
  return orbitkv::tools::Run(opt);
}
