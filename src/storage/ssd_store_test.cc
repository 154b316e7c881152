#include "storage/ssd_store.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "base/temp_dir.h"
#include "storage/record.h"

namespace orbitkv::storage {
namespace {

using TempDir = ::orbitkv::testing::TempDir;

constexpr uint64_t kMiB = uint64_t{1} << 20;

state::StateKey Key(uint64_t i) {
  state::StateNamespace ns(state::Sha256::Of(std::string_view("ssd store test")));
  const std::string native = "block-" + std::to_string(i);
  auto key = state::StateKey::Create(ns, 0, {i * 16, i * 16 + 16}, std::string_view(native));
  EXPECT_TRUE(key.ok()) << key.status();
  return *key;
}

std::vector<uint8_t> Payload(size_t n, uint64_t seed) {
  std::vector<uint8_t> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>((i * 2654435761u + seed * 97) >> 5);
  return out;
}

SsdStoreOptions Options(const std::string& dir, uint64_t capacity, DeviceBackend backend, uint32_t files = 2) {
  SsdStoreOptions options;
  options.directory = dir;
  options.capacity_bytes = capacity;
  options.file_count = files;
  options.backend = backend;
  return options;
}

// Opens a store whose scan the test does not look at.
Result<std::unique_ptr<SsdStore>> OpenStore(const SsdStoreOptions& options) {
  std::vector<RecoveredRecord> recovered;
  ScanReport report;
  return SsdStore::Open(options, &recovered, &report);
}

class SsdStoreTest : public ::testing::TestWithParam<DeviceBackend> {};

TEST_P(SsdStoreTest, WriteReadRoundTripsAcrossFiles) {
  TempDir dir;
  std::vector<RecoveredRecord> recovered;
  ScanReport report;
  auto store = SsdStore::Open(Options(dir.path(), 8 * kMiB, GetParam()), &recovered, &report);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ((*store)->file_count(), 2u);
  EXPECT_TRUE(recovered.empty());
  AlignedBuffer staging;
  std::map<uint64_t, uint64_t> locators;
  std::vector<uint32_t> files_used(2);
  for (uint64_t i = 0; i < 12; ++i) {
    auto payload = Payload(100'000 + i * 1000, i);
    auto locator = (*store)->Write(Key(i), payload, &staging);
    ASSERT_TRUE(locator.ok()) << locator.status();
    locators[i] = *locator;
    ++files_used[SsdStore::LocatorFile(*locator)];
  }
  EXPECT_GT(files_used[0], 0u);
  EXPECT_GT(files_used[1], 0u);
  for (auto [i, locator] : locators) {
    auto payload = Payload(100'000 + i * 1000, i);
    auto read = (*store)->Read(Key(i), locator, payload.size(), &staging);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_TRUE(std::equal(read->begin(), read->end(), payload.begin(), payload.end()));
    // Another key or size at the same place is not this block.
    EXPECT_EQ((*store)->Read(Key(i + 100), locator, payload.size(), &staging).status().code(), StatusCode::kDataLoss);
    EXPECT_EQ((*store)->Read(Key(i), locator, payload.size() - 1, &staging).status().code(), StatusCode::kDataLoss);
  }
}

TEST_P(SsdStoreTest, ZeroCopyWriteAndReadIntoPageAlignedMemory) {
  TempDir dir;
  std::vector<RecoveredRecord> recovered;
  ScanReport report;
  SsdStoreOptions options = Options(dir.path(), 8 * kMiB, GetParam());
  options.write_staging = WriteStaging::kZeroCopy;
  auto store = SsdStore::Open(options, &recovered, &report);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ((*store)->write_staging(), WriteStaging::kZeroCopy);
  // A payload in page-aligned memory with its padding readable (like a DRAM pool block).
  const uint64_t bytes = 3 * 4096 + 123;
  auto block = AlignedBuffer::Create(PaddedPayloadBytes(bytes), 4096);
  ASSERT_TRUE(block.ok());
  const auto payload = Payload(bytes, 5);
  std::memcpy(block->data(), payload.data(), bytes);
  std::memset(block->data() + bytes, 0xAB, block->size() - bytes);  // padding is not data
  AlignedBuffer staging;
  auto locator = (*store)->Write(Key(5), std::span<const uint8_t>(block->data(), bytes), &staging, block->size());
  ASSERT_TRUE(locator.ok()) << locator.status();
  EXPECT_EQ(staging.size(), 64u * 1024);  // only the header page was staged
  // Read straight into aligned memory, and through staging into unaligned memory.
  auto into = AlignedBuffer::Create(PaddedPayloadBytes(bytes), 4096);
  ASSERT_TRUE(into.ok());
  ASSERT_TRUE((*store)->ReadInto(Key(5), *locator, bytes, &staging, into->span()).ok());
  EXPECT_EQ(std::memcmp(into->data(), payload.data(), bytes), 0);
  std::vector<uint8_t> unaligned(bytes + 1);
  ASSERT_TRUE(
      (*store)->ReadInto(Key(5), *locator, bytes, &staging, std::span<uint8_t>(unaligned.data() + 1, bytes)).ok());
  EXPECT_EQ(std::memcmp(unaligned.data() + 1, payload.data(), bytes), 0);
  // The record is the same as a copied write's: a plain Read verifies it too.
  auto read = (*store)->Read(Key(5), *locator, bytes, &staging);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_TRUE(std::equal(read->begin(), read->end(), payload.begin(), payload.end()));
  EXPECT_EQ((*store)->ReadInto(Key(6), *locator, bytes, &staging, into->span()).code(), StatusCode::kDataLoss);
}

// A store that copies assembles the record in huge-page-backed staging, even from a pool-like block
// it could write in place, and the record is the same as a zero-copy write's.
TEST_P(SsdStoreTest, CopyingStoreStagesRecordsInHugePages) {
  TempDir dir;
  std::vector<RecoveredRecord> recovered;
  ScanReport report;
  SsdStoreOptions options = Options(dir.path(), 8 * kMiB, GetParam(), 1);
  options.write_staging = WriteStaging::kCopy;
  auto store = SsdStore::Open(options, &recovered, &report);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ((*store)->write_staging(), WriteStaging::kCopy);
  const uint64_t bytes = 200 * 1024 + 5;
  auto block = AlignedBuffer::Create(PaddedPayloadBytes(bytes), 4096);
  ASSERT_TRUE(block.ok());
  const auto payload = Payload(bytes, 9);
  std::memcpy(block->data(), payload.data(), bytes);
  AlignedBuffer staging;
  auto locator = (*store)->Write(Key(9), std::span<const uint8_t>(block->data(), bytes), &staging, block->size());
  ASSERT_TRUE(locator.ok()) << locator.status();
  EXPECT_TRUE(staging.huge_page_backed());
  EXPECT_EQ(staging.size() % AlignedBuffer::kHugePageBytes, 0u);
  std::memset(block->data(), 0, block->size());  // the record no longer depends on the block
  auto into = AlignedBuffer::Create(PaddedPayloadBytes(bytes), 4096);
  ASSERT_TRUE(into.ok());
  ASSERT_TRUE((*store)->ReadInto(Key(9), *locator, bytes, &staging, into->span()).ok());
  EXPECT_EQ(std::memcmp(into->data(), payload.data(), bytes), 0);

  // The same payload written zero copy to a second store gives the same bytes on disk, but for
  // the epochs in the header (both stores start at epoch 1, so not even those).
  TempDir other_dir;
  SsdStoreOptions zero_copy = Options(other_dir.path(), 8 * kMiB, GetParam(), 1);
  zero_copy.write_staging = WriteStaging::kZeroCopy;
  auto other = SsdStore::Open(zero_copy, &recovered, &report);
  ASSERT_TRUE(other.ok()) << other.status();
  std::memcpy(block->data(), payload.data(), bytes);
  AlignedBuffer other_staging;
  auto other_locator =
      (*other)->Write(Key(9), std::span<const uint8_t>(block->data(), bytes), &other_staging, block->size());
  ASSERT_TRUE(other_locator.ok()) << other_locator.status();
  EXPECT_EQ(*other_locator, *locator);
  auto read_file = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::vector<char>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  };
  const auto copied = read_file(dir.path() + "/orbitkv-ssd-0.data");
  const auto direct = read_file(other_dir.path() + "/orbitkv-ssd-0.data");
  ASSERT_EQ(copied.size(), direct.size());
  EXPECT_TRUE(std::equal(copied.begin(), copied.begin() + RecordBytes(bytes), direct.begin()));
}

// Auto resolves to zero copy off a virtio disk (here tmpfs, where the block device probe names no
// driver, as for a missing path).
TEST(SsdStoreStagingTest, AutoIsZeroCopyOffAVirtioDisk) {
  TempDir dir("/dev/shm");
  std::vector<RecoveredRecord> recovered;
  ScanReport report;
  auto store = SsdStore::Open(Options(dir.path(), 4 * kMiB, DeviceBackend::kPsync, 1), &recovered, &report);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ((*store)->write_staging(), WriteStaging::kZeroCopy);
  EXPECT_EQ(BlockDeviceDriver(dir.path()), "");
  EXPECT_EQ(BlockDeviceDriver(dir.path() + "/missing"), "");
  EXPECT_EQ(ParseWriteStaging("copy"), WriteStaging::kCopy);
  EXPECT_EQ(ParseWriteStaging("zero-copy"), WriteStaging::kZeroCopy);
  EXPECT_EQ(ParseWriteStaging("auto"), WriteStaging::kAuto);
  EXPECT_FALSE(ParseWriteStaging("huge").has_value());
}

TEST_P(SsdStoreTest, BatchReadsAcrossFilesEachGetTheirOwnStatus) {
  TempDir dir;
  std::vector<RecoveredRecord> recovered;
  ScanReport report;
  auto store = SsdStore::Open(Options(dir.path(), 8 * kMiB, GetParam()), &recovered, &report);
  ASSERT_TRUE(store.ok()) << store.status();
  AlignedBuffer staging;
  std::vector<uint64_t> locators;
  std::vector<state::StateKey> keys;
  for (uint64_t i = 0; i < 6; ++i) {
    keys.push_back(Key(i));
    auto locator = (*store)->Write(keys.back(), Payload(40'000, i), &staging);
    ASSERT_TRUE(locator.ok());
    locators.push_back(*locator);
  }
  const uint64_t room = PaddedPayloadBytes(40'000);
  auto memory = AlignedBuffer::Create(7 * room, 4096);
  ASSERT_TRUE(memory.ok());
  std::vector<SsdStore::BatchRead> reads;
  // In reverse order (the batch sorts by file and offset), one with the wrong key, one with a
  // misaligned destination.
  for (int i = 5; i >= 0; --i) {
    reads.push_back({&keys[static_cast<size_t>(i)], locators[static_cast<size_t>(i)], 40'000,
                     memory->span().subspan(static_cast<size_t>(i) * room, room), Status::Ok()});
  }
  const state::StateKey wrong = Key(99);
  reads[1].key = &wrong;
  reads.push_back({&keys[0], locators[0], 40'000, memory->span().subspan(6 * room + 8, room - 8), Status::Ok()});
  (*store)->ReadBatch(reads, &staging);
  for (int i = 5; i >= 0; --i) {
    const SsdStore::BatchRead& read = reads[static_cast<size_t>(5 - i)];
    if (i == 4) {
      EXPECT_EQ(read.status.code(), StatusCode::kDataLoss);
      continue;
    }
    ASSERT_TRUE(read.status.ok()) << i << ": " << read.status;
    const auto payload = Payload(40'000, static_cast<uint64_t>(i));
    EXPECT_EQ(std::memcmp(read.destination.data(), payload.data(), payload.size()), 0) << i;
  }
  EXPECT_EQ(reads.back().status.code(), StatusCode::kInvalidArgument);
}

TEST_P(SsdStoreTest, FullStoreIsResourceExhaustedAndReleaseFreesSpace) {
  TempDir dir;
  auto store = OpenStore(Options(dir.path(), 2 * kMiB, GetParam(), 1));
  ASSERT_TRUE(store.ok()) << store.status();
  AlignedBuffer staging;
  auto payload = Payload(500'000, 1);
  std::vector<uint64_t> written;
  Status last;
  while (last.ok()) {
    Result<uint64_t> locator = (*store)->Write(Key(written.size()), payload, &staging);
    if (locator.ok()) written.push_back(*locator);
    last = locator.status();
  }
  EXPECT_EQ(last.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(written.size(), 4u);  // 4 x (500,000 + header) rounded to 4 KiB fit in 2 MiB
  (*store)->Release(written[1], payload.size());
  EXPECT_TRUE((*store)->Write(Key(99), payload, &staging).ok());
}

// A writer keeps its depth of records at the disk with the next one prepared, in both staging
// modes; every record it hands back reads back intact, and calls out of turn are refused.
TEST_P(SsdStoreTest, WriterKeepsRecordsInFlightAndHandsBackLocators) {
  for (WriteStaging staging : {WriteStaging::kZeroCopy, WriteStaging::kCopy}) {
    TempDir dir;
    SsdStoreOptions options = Options(dir.path(), 16 * kMiB, GetParam());
    options.write_staging = staging;
    auto store = OpenStore(options);
    ASSERT_TRUE(store.ok()) << store.status();
    auto created = (*store)->NewWriter(2);
    ASSERT_TRUE(created.ok()) << created.status();
    SsdStore::Writer& writer = **created;
    EXPECT_EQ(writer.depth(), 2u);
    EXPECT_EQ(writer.Start().code(), StatusCode::kFailedPrecondition);  // nothing prepared
    EXPECT_EQ(writer.Wait().status().code(), StatusCode::kFailedPrecondition);
    // Pool-like blocks: page-aligned with readable padding, so zero copy writes them in place.
    constexpr int kRecords = 7;
    std::vector<AlignedBuffer> blocks;
    std::vector<std::vector<uint8_t>> payloads;
    for (int i = 0; i < kRecords; ++i) {
      payloads.push_back(Payload(100'000 + i * 4099, 20 + i));
      blocks.push_back(std::move(AlignedBuffer::Create(PaddedPayloadBytes(payloads[i].size()), 4096)).value());
      std::memcpy(blocks[i].data(), payloads[i].data(), payloads[i].size());
    }
    std::map<uint64_t, uint64_t> locators;  // tag -> locator
    auto finish = [&] {
      auto done = writer.Wait();
      ASSERT_TRUE(done.ok()) << done.status();
      ASSERT_TRUE(done->locator.ok()) << done->locator.status();
      EXPECT_EQ(done->payload_bytes, payloads[done->tag].size());
      EXPECT_TRUE(locators.emplace(done->tag, *done->locator).second);
    };
    for (int i = 0; i < kRecords; ++i) {
      ASSERT_TRUE(
          writer.Prepare(Key(i), {blocks[i].data(), payloads[i].size()}, blocks[i].size(), static_cast<uint64_t>(i))
              .ok());
      EXPECT_TRUE(writer.has_prepared());
      EXPECT_EQ(writer.Prepare(Key(i), payloads[i], 0, 99).code(), StatusCode::kFailedPrecondition);
      if (writer.in_flight() == writer.depth()) {
        EXPECT_EQ(writer.Start().code(), StatusCode::kFailedPrecondition);  // no room yet
        finish();
      }
      ASSERT_TRUE(writer.Start().ok());
      EXPECT_FALSE(writer.has_prepared());
    }
    while (writer.in_flight() > 0) finish();
    ASSERT_EQ(locators.size(), static_cast<size_t>(kRecords));
    AlignedBuffer read_staging;
    for (const auto& [tag, locator] : locators) {
      auto read = (*store)->Read(Key(tag), locator, payloads[tag].size(), &read_staging);
      ASSERT_TRUE(read.ok()) << read.status();
      EXPECT_TRUE(std::equal(read->begin(), read->end(), payloads[tag].begin(), payloads[tag].end())) << tag;
    }
  }
}

// A writer destroyed with records at the disk and one prepared gives every extent back (nobody
// will publish them), and a full store refuses to prepare.
TEST_P(SsdStoreTest, WriterReleasesWhatItNeverHandedOut) {
  TempDir dir;
  auto store = OpenStore(Options(dir.path(), 2 * kMiB, GetParam(), 1));
  ASSERT_TRUE(store.ok()) << store.status();
  const auto payload = Payload(500'000, 3);
  {
    auto writer = (*store)->NewWriter(2);
    ASSERT_TRUE(writer.ok()) << writer.status();
    for (uint64_t tag = 0; tag < 2; ++tag) {
      ASSERT_TRUE((*writer)->Prepare(Key(tag), payload, 0, tag).ok());
      ASSERT_TRUE((*writer)->Start().ok());
    }
    ASSERT_TRUE((*writer)->Prepare(Key(2), payload, 0, 2).ok());
    ASSERT_TRUE((*writer)->Start().code() == StatusCode::kFailedPrecondition);
    EXPECT_GT((*store)->allocated_bytes(), 0u);
  }
  EXPECT_EQ((*store)->allocated_bytes(), 0u);
  auto writer = (*store)->NewWriter(1);
  ASSERT_TRUE(writer.ok()) << writer.status();
  int written = 0;
  Status prepared;
  for (uint64_t tag = 0; prepared.ok(); ++tag) {
    prepared = (*writer)->Prepare(Key(tag), payload, 0, tag);
    if (!prepared.ok()) break;
    ASSERT_TRUE((*writer)->Start().ok());
    auto done = (*writer)->Wait();
    ASSERT_TRUE(done.ok() && done->locator.ok());
    ++written;
  }
  EXPECT_EQ(prepared.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(written, 4);  // as many as Write() fits (FullStoreIsResourceExhausted...)
  EXPECT_FALSE((*writer)->has_prepared());
}

TEST_P(SsdStoreTest, RestartRecoversRecordsAndContinuesEpochs) {
  TempDir dir;
  std::vector<RecoveredRecord> recovered;
  ScanReport report;
  std::map<uint64_t, uint64_t> locators;
  {
    auto store = SsdStore::Open(Options(dir.path(), 8 * kMiB, GetParam()), &recovered, &report);
    ASSERT_TRUE(store.ok()) << store.status();
    AlignedBuffer staging;
    for (uint64_t i = 0; i < 10; ++i) {
      auto locator = (*store)->Write(Key(i), Payload(300'000, i), &staging);
      ASSERT_TRUE(locator.ok()) << locator.status();
      locators[i] = *locator;
    }
    // A released record stays on disk but its extent is free: it is recovered only if nothing
    // overwrote it, which is fine (records are self-describing and content-addressed).
  }
  for (bool eager : {false, true}) {
    SsdStoreOptions options = Options(dir.path(), 8 * kMiB, GetParam());
    options.verify_on_open = eager;
    auto store = SsdStore::Open(options, &recovered, &report);
    ASSERT_TRUE(store.ok()) << store.status();
    ASSERT_EQ(recovered.size(), 10u);
    EXPECT_EQ(report.records, 10u);
    EXPECT_EQ(report.payload_bytes, 10u * 300'000);
    EXPECT_EQ((*store)->allocated_bytes(), 10 * RecordBytes(300'000));
    AlignedBuffer staging;
    for (const RecoveredRecord& record : recovered) {
      uint64_t i = 0;
      while (!(Key(i) == record.key)) ASSERT_LT(++i, 10u);
      EXPECT_EQ(record.locator, locators[i]);
      auto read = (*store)->Read(record.key, record.locator, record.payload_bytes, &staging);
      ASSERT_TRUE(read.ok()) << read.status();
      auto payload = Payload(300'000, i);
      EXPECT_TRUE(std::equal(read->begin(), read->end(), payload.begin(), payload.end()));
    }
  }
  // recover = false starts empty.
  SsdStoreOptions options = Options(dir.path(), 8 * kMiB, GetParam());
  options.recover = false;
  auto store = SsdStore::Open(options, &recovered, &report);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_TRUE(recovered.empty());
  EXPECT_EQ((*store)->allocated_bytes(), 0u);
}

// Flips a byte in the middle of a record's payload, behind the store's back.
void Corrupt(const std::string& dir, uint64_t locator, uint64_t byte) {
  const std::string path = dir + "/orbitkv-ssd-" + std::to_string(SsdStore::LocatorFile(locator)) + ".data";
  int fd = ::open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  uint8_t value = 0;
  const off_t at = static_cast<off_t>(SsdStore::LocatorOffset(locator) + byte);
  ASSERT_EQ(::pread(fd, &value, 1, at), 1);
  value ^= 0x5a;
  ASSERT_EQ(::pwrite(fd, &value, 1, at), 1);
  ::fsync(fd);
  ::close(fd);
}

TEST_P(SsdStoreTest, CorruptionIsDataLossAndEagerScanDropsIt) {
  TempDir dir;
  std::vector<RecoveredRecord> recovered;
  ScanReport report;
  uint64_t bad = 0;
  {
    auto store = SsdStore::Open(Options(dir.path(), 4 * kMiB, GetParam(), 1), &recovered, &report);
    ASSERT_TRUE(store.ok()) << store.status();
    AlignedBuffer staging;
    for (uint64_t i = 0; i < 4; ++i) {
      auto locator = (*store)->Write(Key(i), Payload(200'000, i), &staging);
      ASSERT_TRUE(locator.ok());
      if (i == 2) bad = *locator;
    }
    Corrupt(dir.path(), bad, kRecordHeaderBytes + 100'000);
    auto read = (*store)->Read(Key(2), bad, 200'000, &staging);
    EXPECT_EQ(read.status().code(), StatusCode::kDataLoss);
    EXPECT_TRUE((*store)->Read(Key(1), bad - (RecordBytes(200'000) / 4096 << 8), 200'000, &staging).ok());
  }
  // Lazy: the header is intact, so the record is claimed, and the read still refuses it.
  auto lazy = SsdStore::Open(Options(dir.path(), 4 * kMiB, GetParam(), 1), &recovered, &report);
  ASSERT_TRUE(lazy.ok());
  EXPECT_EQ(recovered.size(), 4u);
  AlignedBuffer staging;
  EXPECT_EQ((*lazy)->Read(Key(2), bad, 200'000, &staging).status().code(), StatusCode::kDataLoss);
  lazy->reset();
  SsdStoreOptions eager = Options(dir.path(), 4 * kMiB, GetParam(), 1);
  eager.verify_on_open = true;
  auto store = SsdStore::Open(eager, &recovered, &report);
  ASSERT_TRUE(store.ok());
  EXPECT_EQ(recovered.size(), 3u);
  EXPECT_EQ(report.dropped_corrupt, 1u);
}

TEST_P(SsdStoreTest, TornRecordAfterCrashIsNeverServed) {
  TempDir dir;
  std::vector<RecoveredRecord> recovered;
  ScanReport report;
  uint64_t locator = 0;
  {
    auto store = SsdStore::Open(Options(dir.path(), 4 * kMiB, GetParam(), 1), &recovered, &report);
    ASSERT_TRUE(store.ok());
    AlignedBuffer staging;
    auto written = (*store)->Write(Key(7), Payload(1 * kMiB, 7), &staging);
    ASSERT_TRUE(written.ok());
    locator = *written;
  }
  // A crash in the middle of the write: the tail of the payload never reached the disk.
  const std::string path = dir.path() + "/orbitkv-ssd-0.data";
  int fd = ::open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  std::vector<uint8_t> zeros(256 * 1024);
  ASSERT_EQ(::pwrite(fd, zeros.data(), zeros.size(), 768 * 1024), static_cast<ssize_t>(zeros.size()));
  ::close(fd);
  auto store = SsdStore::Open(Options(dir.path(), 4 * kMiB, GetParam(), 1), &recovered, &report);
  ASSERT_TRUE(store.ok());
  ASSERT_EQ(recovered.size(), 1u);
  AlignedBuffer staging;
  EXPECT_EQ((*store)->Read(Key(7), locator, 1 * kMiB, &staging).status().code(), StatusCode::kDataLoss);
}

TEST(SsdStoreOptionsTest, RejectsTinyCapacityAndBadDirectory) {
  std::vector<RecoveredRecord> recovered;
  ScanReport report;
  TempDir dir;
  auto tiny = SsdStore::Open(Options(dir.path(), 512 * 1024, DeviceBackend::kPsync, 1), &recovered, &report);
  EXPECT_EQ(tiny.status().code(), StatusCode::kInvalidArgument);
  auto bad = SsdStore::Open(Options("/proc/orbitkv-no-such/dir", 4 * kMiB, DeviceBackend::kPsync), &recovered, &report);
  EXPECT_FALSE(bad.ok());
}

std::vector<DeviceBackend> Backends() {
  std::vector<DeviceBackend> backends{DeviceBackend::kPsync};
  if (IoUringCompiledIn()) backends.push_back(DeviceBackend::kIoUring);
  return backends;
}

std::string BackendTestName(const ::testing::TestParamInfo<DeviceBackend>& param_info) {
  return std::string(DeviceBackendName(param_info.param));
}

INSTANTIATE_TEST_SUITE_P(Backends, SsdStoreTest, ::testing::ValuesIn(Backends()), BackendTestName);

}  // namespace
}  // namespace orbitkv::storage
