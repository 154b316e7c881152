// SSD tier: write and read throughput of 256 KiB, 1 MiB and 4 MiB blocks through a real Manager
// against fio (io_uring, O_DIRECT) on the same directory, block size and queue depth.
//
// Write: the engine saves 1 GiB of blocks into a Manager (512 MiB of DRAM) with --ssd-policy
// write-through; GB/s is the payload written to SSD over the time from the first save until the
// tier's writers drained. Read: a restarted Manager (2 GiB of empty DRAM, every block on SSD)
// answers queries of chains (64 MiB, at most 64 blocks) with Loading and reads them into DRAM; GB/s
// is the payload read over the time until every chain was a Hit. 1 MiB is the headline (five
// rounds); 256 KiB and 4 MiB run three rounds each. The baselines run fio's io_uring engine with
// O_DIRECT on the same file system, the same block size and the same queue depth as the tier (its
// writes in flight; its reader threads times the records each reads at once), sequential like the
// tier's first-fit extents. fio runs before the first round and after each, so every round of the tier is
// compared with the mean of the fio runs on either side of it.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "base/check.h"
#include "base/clock.h"
#include "bench_report.h"
#include "manager_fixture.h"

namespace orbitkv::bench {
namespace {

constexpr uint64_t kMiB = 1 << 20;
constexpr uint64_t kTotalBytes = 1024 * kMiB;
constexpr int kWriteDepth = 4;     // SsdTierOptions::writes_in_flight
constexpr int kWriterThreads = 2;  // SsdTierOptions::writer_threads
constexpr int kReaders = 4;
constexpr int kReadBatch = 4;  // records each reader thread reads at once (SsdTier::kReadBatch)

std::string Run(const std::string& command) {
  std::string out;
  FILE* pipe = popen(command.c_str(), "r");
  ORBITKV_CHECK_MSG(pipe != nullptr, "cannot run {}", command);
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) out.append(buffer, n);
  ORBITKV_CHECK_MSG(pclose(pipe) == 0, "{} failed:\n{}", command, out);
  return out;
}

// fio's bandwidth for `rw` (write or read) in GB/s, from its JSON output.
double Fio(const std::string& dir, const std::string& rw, uint64_t block, int depth) {
  const std::string json =
      Run(fmt::format("fio --name=orbitkv --directory={} --filename=fio.data --rw={} --bs={}k --size=1G "
                      "--ioengine=io_uring --iodepth={} --direct=1 --numjobs=1 --end_fsync=0 "
                      "--output-format=json 2>&1",
                      dir, rw, block >> 10, depth));
  const std::string section = "\"" + rw + "\" : {";
  const size_t at = json.find(section);
  ORBITKV_CHECK_MSG(at != std::string::npos, "no {} section in fio output:\n{}", rw, json);
  const size_t bw = json.find("\"bw_bytes\" : ", at);
  return std::stod(json.substr(bw + 13)) / 1e9;
}

uint64_t Stat(client::CacheClient& client, const std::string& field) {
  auto json = client.Stats();
  ORBITKV_CHECK(json.ok());
  const size_t at = json->find("\"" + field + "\": ");
  ORBITKV_CHECK_MSG(at != std::string::npos, "no {} in stats", field);
  return std::stoull(json->substr(at + field.size() + 4));
}

// A string field of the Manager's stats, e.g. "write_staging".
std::string StatText(client::CacheClient& client, const std::string& field) {
  auto json = client.Stats();
  ORBITKV_CHECK(json.ok());
  const std::string prefix = "\"" + field + "\": \"";
  const size_t at = json->find(prefix);
  ORBITKV_CHECK_MSG(at != std::string::npos, "no {} in stats", field);
  const size_t begin = at + prefix.size();
  return json->substr(begin, json->find('"', begin) - begin);
}

std::unique_ptr<client::CacheClient> Connect(const testing::ManagerProcess& manager) {
  client::ClientOptions options;
  options.socket_path = manager.socket();
  options.timeout = std::chrono::seconds(120);
  return *client::CacheClient::Connect(options);
}

std::vector<std::string> Flags(const std::string& dir) {
  return {"--ssd-path",          dir, "--ssd-capacity", "2GiB",   "--ssd-policy",  "write-through",
          "--ssd-min-frequency", "1", "--ssd-queue",    "256MiB", "--ssd-backend", "io_uring"};
}

// One round of the tier: writes kBlocks blocks through a fresh Manager into `tier_dir`, then reads
// them back through a restarted one. Returns {write GB/s, read GB/s, bytes the tier read}.
struct TierFigures {
  double write_gbps = 0, read_gbps = 0;
  uint64_t read_bytes = 0;
  std::string write_staging;
};

TierFigures MeasureTier(const std::string& tier_dir, uint64_t block) {
  TierFigures figures;
  const auto blocks = static_cast<uint32_t>(kTotalBytes / block);
  const auto keys = EngineBuffer::Keys(77, blocks);
  {
    auto manager = StartManager("512MiB", Flags(tier_dir));
    auto client = Connect(*manager);
    EngineBuffer engine(*client, 1, static_cast<uint32_t>(256 * kMiB / block), block);
    for (uint32_t p = 0; p < engine.pages; ++p) std::memset(engine.base + p * block, p, block);
    // Saves of 32 MiB; the write-back queue is kept fed but under its 256 MiB bound, so nothing is
    // dropped and the writers never starve.
    const auto batch = static_cast<uint32_t>(32 * kMiB / block);
    const uint64_t max_pinned = 192 * kMiB / block;
    Stopwatch watch;
    for (uint32_t start = 0; start < blocks; start += batch) {
      while (Stat(*client, "pinned_blocks") > max_pinned) usleep(2000);
      std::vector<client::SaveItem> items;
      for (uint32_t i = start; i < start + batch; ++i) items.push_back({keys[i], i % engine.pages});
      auto saved = client->Save(1, 0, items);
      ORBITKV_CHECK_MSG(saved.ok() && saved->written == batch, "save: {} ({} written)", saved.status().ToString(),
                        saved.ok() ? saved->written : 0);
    }
    while (Stat(*client, "pinned_blocks") > 0) usleep(1000);
    const double seconds = watch.ElapsedSeconds();
    const uint64_t written = Stat(*client, "written_bytes");
    ORBITKV_CHECK_MSG(Stat(*client, "writeback_dropped") == 0, "write-backs were dropped");
    ORBITKV_CHECK_MSG(written == kTotalBytes, "only {} of {} bytes reached SSD", written, kTotalBytes);
    figures.write_gbps = static_cast<double>(written) / seconds / 1e9;
    figures.write_staging = StatText(*client, "write_staging");
    manager->Stop(SIGTERM);
  }

  {
    auto manager = StartManager("2GiB", Flags(tier_dir));
    auto client = Connect(*manager);
    EngineBuffer engine(*client, 2, 1, block);
    ORBITKV_CHECK_MSG(Stat(*client, "recovered_records") == blocks, "the restart found {} blocks",
                      Stat(*client, "recovered_records"));
    // Like an engine with several requests waiting: up to kWindow chains are loading at once (their
    // queries answered Loading), each polled until its Hit.
    constexpr uint32_t kWindow = 4;
    const auto chain_length = static_cast<uint32_t>(std::min<uint64_t>(64, 64 * kMiB / block));
    Stopwatch watch;
    uint32_t next = 0;
    std::vector<uint32_t> loading;
    while (next < blocks || !loading.empty()) {
      while (loading.size() < kWindow && next < blocks) {
        loading.push_back(next);
        next += chain_length;
      }
      for (size_t i = 0; i < loading.size();) {
        const std::span<const state::StateKey> chain(keys.data() + loading[i], chain_length);
        auto result = client->Query(2, 0, chain);
        ORBITKV_CHECK_MSG(result.ok(), "{}", result.status().ToString());
        if (result->hits > 0) {
          ORBITKV_CHECK_MSG(result->hits == chain_length, "hit {} of {}", result->hits, chain_length);
          ORBITKV_CHECK(client->Release(2, result->lease).ok());
          loading.erase(loading.begin() + static_cast<ptrdiff_t>(i));
          continue;
        }
        ORBITKV_CHECK_MSG(result->loading_op != 0, "blocks {}.. are a miss after the restart", loading[i]);
        ++i;
      }
      usleep(500);
    }
    const double seconds = watch.ElapsedSeconds();
    // Every block was read at least once; a block evicted again before its chain's hit is read
    // twice, and only the bytes the engine asked for count.
    figures.read_bytes = Stat(*client, "read_bytes");
    ORBITKV_CHECK_MSG(figures.read_bytes >= kTotalBytes, "only {} bytes read", figures.read_bytes);
    figures.read_gbps = static_cast<double>(kTotalBytes) / seconds / 1e9;
    manager->Stop(SIGTERM);
  }
  std::filesystem::remove_all(tier_dir);
  return figures;
}

// One metric over the rounds: round i's tier figure against the mean of the fio runs just before
// and just after it (brackets the disk's drift), and the round whose ratio is the median is
// reported.
struct Paired {
  double value = 0, baseline = 0;
  std::string detail;  // every round, for the env
};

Paired MedianRound(const std::vector<double>& tier, const std::vector<double>& fio) {
  std::vector<std::pair<double, size_t>> ratios;
  std::string detail;
  for (size_t i = 0; i < tier.size(); ++i) {
    const double baseline = (fio[i] + fio[i + 1]) / 2;
    ratios.emplace_back(tier[i] / baseline, i);
    detail += fmt::format("{}{:.2f}/{:.2f}", i == 0 ? "" : ", ", tier[i], baseline);
  }
  std::sort(ratios.begin(), ratios.end());
  const size_t median = ratios[ratios.size() / 2].second;
  return Paired{tier[median], (fio[median] + fio[median + 1]) / 2, detail};
}

// One record size: fio before the first round and after each, the tier in between.
struct SizeFigures {
  Paired write, read;
  std::string write_staging;
  uint64_t read_bytes = 0;
};

SizeFigures MeasureSize(const std::string& dir, uint64_t block, int rounds) {
  std::vector<double> fio_write, fio_read, tier_write, tier_read;
  SizeFigures figures;
  auto run_fio = [&] {
    const std::string fio_dir = dir + "/fio";
    std::filesystem::create_directories(fio_dir);
    fio_write.push_back(Fio(fio_dir, "write", block, kWriteDepth));
    fio_read.push_back(Fio(fio_dir, "read", block, kReaders * kReadBatch));
    std::filesystem::remove_all(fio_dir);
  };
  run_fio();
  for (int round = 0; round < rounds; ++round) {
    const TierFigures tier = MeasureTier(dir + "/tier", block);
    tier_write.push_back(tier.write_gbps);
    tier_read.push_back(tier.read_gbps);
    figures.read_bytes = tier.read_bytes;
    figures.write_staging = tier.write_staging;
    run_fio();
    fmt::print(stderr,
               "ssd bench: {} KiB round {}/{}: write {:.2f} GB/s (fio {:.2f}), read {:.2f} GB/s "
               "(fio {:.2f})\n",
               block >> 10, round + 1, rounds, tier.write_gbps, fio_write.back(), tier.read_gbps, fio_read.back());
  }
  figures.write = MedianRound(tier_write, fio_write);
  figures.read = MedianRound(tier_read, fio_read);
  return figures;
}

}  // namespace
}  // namespace orbitkv::bench

int main(int argc, char** argv) {
  using namespace orbitkv;
  using namespace orbitkv::bench;
  const bool json = argc > 1 && std::string(argv[1]) == "--json";
  char pattern[] = "/var/tmp/orbitkv_ssd_bench.XXXXXX";
  ORBITKV_CHECK(mkdtemp(pattern) != nullptr);
  const std::string dir = pattern;
  // The throughput of shared and virtual disks drifts by tens of percent within a minute: fio runs
  // before the first round and after every round, so each round of the tier has a baseline from
  // either side of it.
  struct Size {
    uint64_t block;
    const char* suffix;
    int rounds;
  };
  const Size sizes[] = {{kMiB, "1m", 5}, {256 * 1024, "256k", 3}, {4 * kMiB, "4m", 3}};
  BenchReport report("ssd");
  std::string write_staging;
  uint64_t read_bytes = 0;
  std::vector<std::pair<std::string, std::string>> rounds_env;
  for (const Size& size : sizes) {
    const SizeFigures figures = MeasureSize(dir, size.block, size.rounds);
    report.Add({fmt::format("ssd_write_{}", size.suffix), "GB/s", figures.write.value,
                fmt::format("fio_write_{}", size.suffix), figures.write.baseline});
    report.Add({fmt::format("ssd_read_{}", size.suffix), "GB/s", figures.read.value,
                fmt::format("fio_read_{}", size.suffix), figures.read.baseline});
    rounds_env.emplace_back(fmt::format("write_rounds_{}", size.suffix), "tier/fio GB/s: " + figures.write.detail);
    rounds_env.emplace_back(fmt::format("read_rounds_{}", size.suffix), "tier/fio GB/s: " + figures.read.detail);
    if (size.block == kMiB) read_bytes = figures.read_bytes;
    write_staging = figures.write_staging;
  }
  std::filesystem::remove_all(dir);

  AddStandardEnv(report);
  report.AddEnv("fio", fmt::format("io_uring, O_DIRECT, the record size, iodepth {} (write) / {} "
                                   "(read)",
                                   kWriteDepth, kReaders * kReadBatch));
  report.AddEnv("tier", fmt::format("{} writer threads keeping {} writes in flight ({} writes), {} reader "
                                    "threads reading {} records at once, 1 GiB of blocks",
                                    kWriterThreads, kWriteDepth, write_staging, kReaders, kReadBatch));
  report.AddEnv("rounds",
                "5 (1 MiB) or 3; each figure is the round with the median ratio, its baseline the "
                "mean of the fio runs just before and after it");
  for (auto& [key, value] : rounds_env) report.AddEnv(key, value);
  report.AddEnv("tier_read_bytes_1m", std::to_string(read_bytes));
  report.Print(json);
  return 0;
}
