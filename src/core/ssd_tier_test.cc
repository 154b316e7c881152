#include "core/ssd_tier.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/falloc.h>
#include <stdlib.h>
#include <sys/mount.h>
#include <unistd.h>

#include <filesystem>
#include <future>
#include <string>
#include <vector>

#include "base/temp_dir.h"
#include "core/test_util.h"

namespace orbitkv::core {
namespace {

using TempDir = ::orbitkv::testing::TempDir;

using testing::Chain;
using testing::CheckStamp;
using testing::SmallCacheOptions;
using testing::Stamp;

constexpr uint64_t kBlock = 256 * 1024;
constexpr uint64_t kMiB = 1 << 20;

class SsdTierTest : public ::testing::Test {
 protected:
  void SetUp() override { OpenAll(); }
  void TearDown() override { CloseAll(); }

  SsdTierOptions TierOptions() {
    SsdTierOptions options;
    options.store.directory = dir_.path();
    options.store.capacity_bytes = ssd_bytes_;
    options.store.file_count = 2;
    options.store.backend = backend_;
    options.store.write_staging = write_staging_;
    options.min_frequency = min_frequency_;
    options.policy = policy_;
    options.queue_bytes = queue_bytes_;
    options.writer_threads = writer_threads_;
    options.writes_in_flight = writes_in_flight_;
    return options;
  }
  void OpenAll() {
    auto cache = BlockCache::Create(SmallCacheOptions(4 * kMiB), &metrics_);
    ASSERT_TRUE(cache.ok()) << cache.status();
    cache_ = std::move(*cache);
    auto tier = SsdTier::Create(TierOptions(), cache_.get(), &metrics_);
    ASSERT_TRUE(tier.ok()) << tier.status();
    tier_ = std::move(*tier);
  }
  void CloseAll() {
    if (tier_) tier_->Shutdown();
    tier_.reset();
    cache_.reset();
  }
  // Saves block `seed` under key, stamped with its seed.
  void Save(const state::StateKey& key, uint64_t seed) {
    auto writer = cache_->Prepare(key, kBlock);
    // Evicted blocks wait in the write-back queue with their memory: let the writers drain it (an
    // engine's save is skipped and retried the same way).
    if (!writer.ok() && writer.status().code() == StatusCode::kResourceExhausted) {
      tier_->Flush();
      writer = cache_->Prepare(key, kBlock);
    }
    ASSERT_TRUE(writer.ok()) << writer.status();
    Stamp(writer->data(), kBlock, seed);
    cache_->Seal(*writer);
    tier_->OnSealed(key);
    if (flush_each_save_) tier_->Flush();
  }
  size_t LoadSync(const std::vector<state::StateKey>& keys) {
    std::promise<size_t> loaded;
    Status started = tier_->Load(keys, [&loaded](std::vector<BlockPin> pins) { loaded.set_value(pins.size()); });
    EXPECT_TRUE(started.ok()) << started;
    return loaded.get_future().get();
  }
  bool InDramWithStamp(const state::StateKey& key, uint64_t seed) {
    auto pin = cache_->table().Pin(key);
    return pin.ok() && pin->bytes() == kBlock && CheckStamp(pin->data(), kBlock, seed);
  }

  TempDir dir_;
  uint64_t ssd_bytes_ = 32 * kMiB;
  uint32_t min_frequency_ = 1;
  SsdWritePolicy policy_ = SsdWritePolicy::kWriteBack;
  bool flush_each_save_ = true;
  uint64_t queue_bytes_ = 64 * kMiB;
  storage::DeviceBackend backend_ = storage::DeviceBackend::kPsync;
  storage::WriteStaging write_staging_ = storage::WriteStaging::kAuto;
  uint32_t writer_threads_ = SsdTierOptions{}.writer_threads;
  uint32_t writes_in_flight_ = SsdTierOptions{}.writes_in_flight;
  MetricsRegistry metrics_;
  std::unique_ptr<BlockCache> cache_;
  std::unique_ptr<SsdTier> tier_;
};

TEST_F(SsdTierTest, EvictedBlocksGoToSsdAndLoadBackByteExact) {
  // 4 MiB of DRAM holds about 15 blocks of 256 KiB; save 40 so most are evicted.
  const auto keys = Chain(1, 40);
  for (size_t i = 0; i < keys.size(); ++i) Save(keys[i], i);
  tier_->Flush();
  EXPECT_GT(tier_->Stats().writes, 20u);  // evicted while saving
  cache_->table().EvictBytes(64 * kMiB);  // and the rest
  tier_->Flush();
  const SsdTierStats stats = tier_->Stats();
  EXPECT_EQ(stats.writes, keys.size());
  EXPECT_EQ(stats.records, stats.writes);
  EXPECT_EQ(stats.written_bytes, stats.writes * kBlock);
  std::vector<Residence> tiers;
  EXPECT_EQ(cache_->table().LookupPrefixTiers(keys, &tiers), keys.size());
  EXPECT_EQ(tiers[0], Residence::kSsd);
  // Load the first 8 (SSD-only) back.
  const std::vector<state::StateKey> first(keys.begin(), keys.begin() + 8);
  EXPECT_EQ(LoadSync(first), 8u);
  for (size_t i = 0; i < 8; ++i) EXPECT_TRUE(InDramWithStamp(keys[i], i)) << i;
  EXPECT_EQ(tier_->Stats().reads, 8u);
  // Both residences now: evicting the DRAM one again does not rewrite it.
  const uint64_t writes = tier_->Stats().writes;
  cache_->table().EvictBytes(64 * kMiB);
  tier_->Flush();
  EXPECT_EQ(tier_->Stats().writes, writes);
  EXPECT_EQ(LoadSync(first), 8u);
}

TEST_F(SsdTierTest, IoUringUsesThePoolAsRegisteredBuffers) {
  if (!storage::IoUringCompiledIn()) GTEST_SKIP() << "built without liburing";
  for (storage::WriteStaging staging : {storage::WriteStaging::kZeroCopy, storage::WriteStaging::kCopy}) {
    CloseAll();
    backend_ = storage::DeviceBackend::kIoUring;
    write_staging_ = staging;
    OpenAll();
    ASSERT_EQ(tier_->write_staging(), staging);
    const SsdTierStats before = tier_->Stats();                        // the counters outlive a tier; registered_io not
    const auto keys = Chain(12 + static_cast<uint32_t>(staging), 12);  // 3 MiB: fit the pool
    for (size_t i = 0; i < keys.size(); ++i) Save(keys[i], 300 + i);
    cache_->table().EvictBytes(64 * kMiB);
    tier_->Flush();
    EXPECT_EQ(LoadSync(keys), keys.size());
    for (size_t i = 0; i < keys.size(); ++i) EXPECT_TRUE(InDramWithStamp(keys[i], 300 + i)) << i;
    // Every payload read ran on registered pool memory, and so did every write in place (headers
    // are staged: not counted); copied writes run from the writer's staging.
    const SsdTierStats stats = tier_->Stats();
    EXPECT_EQ(
        stats.registered_io,
        stats.reads - before.reads + (staging == storage::WriteStaging::kZeroCopy ? stats.writes - before.writes : 0));
  }
}

TEST_F(SsdTierTest, RestartFindsTheBlocksAgain) {
  const auto keys = Chain(2, 30);
  for (size_t i = 0; i < keys.size(); ++i) Save(keys[i], 100 + i);
  cache_->table().EvictBytes(64 * kMiB);  // everything to SSD
  tier_->Flush();
  const uint64_t records = tier_->Stats().records;
  EXPECT_EQ(records, keys.size());
  CloseAll();
  OpenAll();
  EXPECT_EQ(tier_->Stats().recovered_records, records);
  EXPECT_EQ(tier_->scan_report().records, records);
  EXPECT_EQ(LoadSync(std::vector<state::StateKey>(keys.begin(), keys.begin() + 12)), 12u);
  for (size_t i = 0; i < 12; ++i) EXPECT_TRUE(InDramWithStamp(keys[i], 100 + i)) << i;
}

TEST_F(SsdTierTest, CorruptRecordIsAMissAndIsDropped) {
  const auto keys = Chain(3, 4);
  for (size_t i = 0; i < keys.size(); ++i) Save(keys[i], 7 + i);
  cache_->table().EvictBytes(64 * kMiB);
  tier_->Flush();
  auto residence = cache_->table().FindSsd(keys[1]);
  ASSERT_TRUE(residence.has_value());
  // Flip a payload byte of block 1 on disk.
  const std::string path =
      dir_.path() + "/orbitkv-ssd-" + std::to_string(storage::SsdStore::LocatorFile(residence->locator)) + ".data";
  int fd = ::open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  const off_t at = static_cast<off_t>(storage::SsdStore::LocatorOffset(residence->locator) + 4096 + 77);
  uint8_t byte = 0;
  ASSERT_EQ(::pread(fd, &byte, 1, at), 1);
  byte ^= 0xff;
  ASSERT_EQ(::pwrite(fd, &byte, 1, at), 1);
  ::close(fd);
  EXPECT_EQ(LoadSync(keys), 1u);  // block 0 loads; block 1 fails verification and stops the prefix
  EXPECT_TRUE(InDramWithStamp(keys[0], 7));
  EXPECT_FALSE(cache_->table().Pin(keys[1]).ok());
  EXPECT_FALSE(cache_->table().FindSsd(keys[1]).has_value());
  EXPECT_EQ(tier_->Stats().verify_failures, 1u);
  EXPECT_EQ(tier_->Stats().records, 3u);
}

TEST_F(SsdTierTest, FullStoreEvictsItsOldestRecords) {
  CloseAll();
  ssd_bytes_ = 4 * kMiB;  // two files of 2 MiB: 6 records of 256 KiB + header each
  // One write at a time, so records are published in eviction order and "newest" is well defined
  // (with several in flight, the final burst of evictions completes in any order).
  writer_threads_ = 1;
  writes_in_flight_ = 1;
  OpenAll();
  const auto keys = Chain(4, 40);
  for (size_t i = 0; i < keys.size(); ++i) {
    Save(keys[i], i);
    // Each block goes to SSD before the next is saved, so records are written in key order and
    // keys[39] is the newest whatever DRAM's replacement order (which depends on how fast the
    // writer frees evicted blocks).
    cache_->table().EvictBytes(64 * kMiB);
    tier_->Flush();
  }
  const SsdTierStats stats = tier_->Stats();
  EXPECT_GT(stats.writes, stats.records);
  EXPECT_LE(stats.used_bytes, stats.capacity_bytes);
  EXPECT_FALSE(cache_->table().FindSsd(keys[0]).has_value());  // oldest went
  EXPECT_TRUE(cache_->table().FindSsd(keys[39]).has_value());  // newest stayed
  EXPECT_EQ(LoadSync({keys[39]}), 1u);
  EXPECT_TRUE(InDramWithStamp(keys[39], 39));
}

// Before a graceful stop, the blocks only DRAM holds are written (the ones the admission filter
// admits), so the restarted tier finds them; a deadline already passed writes nothing.
TEST_F(SsdTierTest, PersistDramWritesDramOnlyBlocksForTheRestart) {
  CloseAll();
  min_frequency_ = 2;
  queue_bytes_ = 1 * kMiB;  // smaller than the blocks to persist: PersistDram waits for room
  OpenAll();
  const auto hot = Chain(21, 10);
  const auto cold = Chain(22, 3);
  for (size_t i = 0; i < hot.size(); ++i) Save(hot[i], 500 + i);
  for (size_t i = 0; i < cold.size(); ++i) Save(cold[i], 600 + i);
  EXPECT_EQ(cache_->table().LookupPrefix(hot), hot.size());  // a second use: admitted
  EXPECT_EQ(tier_->Stats().writes, 0u);                      // nothing was evicted

  const SsdTier::PersistReport expired = tier_->PersistDram(MonoNow());
  EXPECT_EQ(expired.candidates, hot.size());
  EXPECT_EQ(expired.queued, 0u);
  EXPECT_TRUE(expired.timed_out);

  const SsdTier::PersistReport report = tier_->PersistDram(MonoNow() + std::chrono::seconds(60));
  EXPECT_EQ(report.candidates, hot.size());
  EXPECT_EQ(report.queued, hot.size());
  EXPECT_EQ(report.written, hot.size());
  EXPECT_EQ(report.written_bytes, hot.size() * kBlock);
  EXPECT_FALSE(report.timed_out);
  for (const auto& key : hot) EXPECT_TRUE(cache_->table().FindSsd(key).has_value());
  for (const auto& key : cold) EXPECT_FALSE(cache_->table().FindSsd(key).has_value());
  // Everything admitted is on SSD now: nothing left to do.
  EXPECT_EQ(tier_->PersistDram(MonoNow() + std::chrono::seconds(60)).candidates, 0u);

  CloseAll();
  OpenAll();
  EXPECT_EQ(tier_->Stats().recovered_records, hot.size());
  EXPECT_EQ(LoadSync(hot), hot.size());
  for (size_t i = 0; i < hot.size(); ++i) EXPECT_TRUE(InDramWithStamp(hot[i], 500 + i)) << i;
}

TEST_F(SsdTierTest, FullWriteBackQueueDropsInsteadOfHoldingDram) {
  CloseAll();
  queue_bytes_ = 1 * kMiB;
  OpenAll();
  flush_each_save_ = false;
  const auto keys = Chain(11, 60);
  for (size_t i = 0; i < keys.size(); ++i) Save(keys[i], i);
  tier_->Flush();
  const SsdTierStats stats = tier_->Stats();
  // Saves never waited on the disk: whatever did not fit the 1 MiB queue was dropped and counted.
  EXPECT_GT(stats.queue_drops, 0u);
  EXPECT_EQ(stats.records + stats.queue_drops + cache_->table().Stats().resident_blocks, keys.size());
}

TEST_F(SsdTierTest, AdmissionFilterSkipsOneHitBlocks) {
  CloseAll();
  min_frequency_ = 3;
  OpenAll();
  const auto cold = Chain(5, 10);
  const auto hot = Chain(6, 4);
  for (size_t i = 0; i < hot.size(); ++i) Save(hot[i], i);
  for (int round = 0; round < 4; ++round) cache_->table().LookupPrefix(hot);
  for (size_t i = 0; i < cold.size(); ++i) Save(cold[i], 50 + i);
  cache_->table().EvictBytes(64 * kMiB);
  tier_->Flush();
  for (const auto& key : hot) EXPECT_TRUE(cache_->table().FindSsd(key).has_value());
  for (const auto& key : cold) EXPECT_FALSE(cache_->table().FindSsd(key).has_value());
  EXPECT_EQ(tier_->Stats().filtered, cold.size());
}

TEST_F(SsdTierTest, WriteThroughWritesOnSeal) {
  CloseAll();
  policy_ = SsdWritePolicy::kWriteThrough;
  OpenAll();
  const auto keys = Chain(7, 3);
  for (size_t i = 0; i < keys.size(); ++i) Save(keys[i], i);
  tier_->Flush();
  for (const auto& key : keys) {
    EXPECT_TRUE(cache_->table().FindSsd(key).has_value());
    EXPECT_TRUE(cache_->table().Pin(key).ok());  // and still in DRAM
  }
}

TEST_F(SsdTierTest, LoadOfMissingAndDramKeys) {
  const auto keys = Chain(8, 3);
  Save(keys[0], 1);
  // keys[0] in DRAM, keys[1] nowhere: the prefix is 1 and nothing is read.
  EXPECT_EQ(LoadSync(keys), 1u);
  EXPECT_EQ(tier_->Stats().reads, 0u);
  EXPECT_EQ(LoadSync({keys[2]}), 0u);
}

TEST_F(SsdTierTest, ConcurrentLoadsOfTheSameKeysShareReads) {
  const auto keys = Chain(9, 12);
  for (size_t i = 0; i < keys.size(); ++i) Save(keys[i], i);
  cache_->table().EvictBytes(64 * kMiB);
  tier_->Flush();
  std::vector<std::promise<size_t>> done(6);
  for (auto& promise : done) {
    ASSERT_TRUE(tier_->Load(keys, [&promise](std::vector<BlockPin> pins) { promise.set_value(pins.size()); }).ok());
  }
  for (auto& promise : done) EXPECT_EQ(promise.get_future().get(), keys.size());
  // Each key read at most a few times (reads that start after an earlier one finished find DRAM).
  EXPECT_LE(tier_->Stats().reads, keys.size() * 6);
  EXPECT_GE(tier_->Stats().reads, keys.size());
  for (size_t i = 0; i < keys.size(); ++i) EXPECT_TRUE(InDramWithStamp(keys[i], i));
}

// A real ENOSPC: the store's file lives on a small tmpfs; part of it is punched out (a hole no
// longer backed by the preallocation) and the file system is filled, so the next write there fails.
void ExpectWriteErrorDisablesAdmissions(storage::DeviceBackend backend) {
  TempDir mount_point;
  ASSERT_EQ(::mount("tmpfs", mount_point.path().c_str(), "tmpfs", 0, "size=6m"), 0)
      << "mounting a tmpfs needs root (CI runs as root): " << std::strerror(errno);
  struct Unmount {
    std::string path;
    ~Unmount() { ::umount2(path.c_str(), MNT_DETACH); }
  } unmount{mount_point.path()};
  MetricsRegistry metrics;
  auto cache = BlockCache::Create(SmallCacheOptions(4 * kMiB), &metrics);
  ASSERT_TRUE(cache.ok());
  SsdTierOptions options;
  options.store.directory = mount_point.path() + "/ssd";
  options.store.capacity_bytes = 4 * kMiB;
  options.store.file_count = 1;
  options.store.backend = backend;
  options.min_frequency = 1;
  options.queue_bytes = 1 * kMiB;
  auto tier = SsdTier::Create(options, cache->get(), &metrics);
  ASSERT_TRUE(tier.ok()) << tier.status();
  const std::string data = options.store.directory + "/orbitkv-ssd-0.data";
  int fd = ::open(data.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, 4 * kMiB), 0);
  ::close(fd);
  // Fill the file system.
  const std::string filler = mount_point.path() + "/filler";
  int filler_fd = ::open(filler.c_str(), O_CREAT | O_WRONLY, 0600);
  ASSERT_GE(filler_fd, 0);
  std::vector<uint8_t> chunk(64 * 1024, 1);
  while (::write(filler_fd, chunk.data(), chunk.size()) > 0) {
  }
  ::close(filler_fd);
  const auto keys = Chain(10, 30);
  for (size_t i = 0; i < keys.size(); ++i) {
    auto writer = (*cache)->Prepare(keys[i], kBlock);
    if (!writer.ok()) {
      (*tier)->Flush();
      writer = (*cache)->Prepare(keys[i], kBlock);
    }
    ASSERT_TRUE(writer.ok()) << writer.status();  // DRAM service continues throughout
    Stamp(writer->data(), kBlock, i);
    (*cache)->Seal(*writer);
  }
  (*tier)->Flush();
  const SsdTierStats stats = (*tier)->Stats();
  EXPECT_FALSE(stats.admissions_enabled);
  EXPECT_GE(stats.write_errors, 1u);
  EXPECT_EQ(stats.records, 0u);
  EXPECT_EQ(metrics.GetGauge("orbitkv_ssd_admissions_enabled", "").Value(), 0);
  EXPECT_TRUE(CheckStamp((*cache)->table().Pin(keys[29]).value().data(), kBlock, 29));
  (*tier)->Shutdown();
}

TEST(SsdTierFaultTest, DeviceWriteErrorDisablesAdmissionsAndDramContinues) {
  ExpectWriteErrorDisablesAdmissions(storage::DeviceBackend::kPsync);
}

#ifdef ORBITKV_HAVE_IO_URING
// The same through io_uring: the failed completion reaches the writer's queue as the record's
// error.
TEST(SsdTierFaultTest, DeviceWriteErrorThroughIoUringDisablesAdmissions) {
  ExpectWriteErrorDisablesAdmissions(storage::DeviceBackend::kIoUring);
}
#endif

}  // namespace
}  // namespace orbitkv::core
