#include "storage/device.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "storage/aligned_buffer.h"
#include "storage/psync_device.h"
#ifdef ORBITKV_HAVE_IO_URING
#include "base/temp_dir.h"
#include "storage/uring_device.h"
#endif

namespace orbitkv::storage {
namespace {

using TempDir = ::orbitkv::testing::TempDir;

constexpr uint64_t kDeviceBytes = 4 << 20;

AlignedBuffer Buffer(size_t bytes) {
  auto buffer = AlignedBuffer::Create(bytes, 4096);
  EXPECT_TRUE(buffer.ok()) << buffer.status();
  return std::move(buffer).value();
}

void Fill(AlignedBuffer& buffer, uint32_t seed) {
  for (size_t i = 0; i < buffer.size(); ++i) buffer.data()[i] = static_cast<uint8_t>((i * 2654435761u + seed) >> 7);
}

Result<std::unique_ptr<Device>> Open(const std::string& path, DeviceBackend backend, uint64_t bytes) {
#ifdef ORBITKV_HAVE_IO_URING
  // A small queue depth so batches exercise the refill-as-completions-arrive path.
  if (backend == DeviceBackend::kIoUring) {
    ORBITKV_ASSIGN_OR_RETURN(auto device, UringDevice::Create(path, bytes, 8));
    return std::unique_ptr<Device>(std::move(device));
  }
#endif
  return CreateDevice(path, bytes, backend);
}

std::vector<DeviceBackend> Backends() {
  std::vector<DeviceBackend> out{DeviceBackend::kPsync};
  if (IoUringCompiledIn()) out.push_back(DeviceBackend::kIoUring);
  return out;
}

class DeviceTest : public ::testing::TestWithParam<DeviceBackend> {
 protected:
  void SetUp() override {
    ASSERT_FALSE(dir_.path().empty());
    path_ = dir_.path() + "/ssd0";
    auto device = Open(path_, GetParam(), kDeviceBytes);
    ASSERT_TRUE(device.ok()) << device.status();
    device_ = std::move(device).value();
  }

  TempDir dir_;
  std::string path_;
  std::unique_ptr<Device> device_;
};

TEST_P(DeviceTest, PreallocatesAndReportsGeometry) {
  EXPECT_EQ(device_->size(), kDeviceBytes);
  EXPECT_EQ(device_->io_alignment(), 4096u);
  EXPECT_EQ(device_->backend_name(), DeviceBackendName(GetParam()));
  struct stat st {};
  ASSERT_EQ(::stat(path_.c_str(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), kDeviceBytes);
  EXPECT_GE(static_cast<uint64_t>(st.st_blocks) * 512,
            kDeviceBytes);  // Space is reserved, not sparse.
}

TEST_P(DeviceTest, WritesAndReadsByteExact) {
  for (uint64_t offset : {uint64_t{0}, uint64_t{4096}, kDeviceBytes - 65536}) {
    AlignedBuffer out = Buffer(65536);
    Fill(out, static_cast<uint32_t>(offset));
    ASSERT_TRUE(device_->Write(offset, out.span()).ok());
    AlignedBuffer in = Buffer(65536);
    ASSERT_TRUE(device_->Read(offset, in.span()).ok());
    EXPECT_EQ(std::memcmp(in.data(), out.data(), out.size()), 0) << offset;
  }
}

// Registered memory (io_uring fixed buffers): requests inside a registered region use it, others
// do not, and both move the right bytes. psync has nothing to register and counts none.
TEST_P(DeviceTest, RegisteredMemoryIsUsedForRequestsInsideIt) {
  AlignedBuffer region = Buffer(256 * 1024);
  const std::span<uint8_t> regions[] = {region.span()};
  ASSERT_TRUE(device_->RegisterMemory(regions).ok());
  Fill(region, 5);
  std::vector<uint8_t> expected(region.data() + 65536, region.data() + 2 * 65536);
  ASSERT_TRUE(device_->Write(8192, region.span().subspan(65536, 65536)).ok());
  AlignedBuffer outside = Buffer(65536);
  ASSERT_TRUE(device_->Read(8192, outside.span()).ok());
  EXPECT_EQ(std::memcmp(outside.data(), expected.data(), expected.size()), 0);
  std::memset(region.data(), 0, region.size());
  ASSERT_TRUE(device_->Read(8192, region.span().subspan(131072, 65536)).ok());
  EXPECT_EQ(std::memcmp(region.data() + 131072, expected.data(), expected.size()), 0);
  if (GetParam() == DeviceBackend::kIoUring) {
    EXPECT_EQ(device_->registered_requests(), 2u);  // the write and the second read
  } else {
    EXPECT_EQ(device_->registered_requests(), 0u);
  }
  // Registering again (another region) replaces the set; the old region no longer counts.
  AlignedBuffer other = Buffer(65536);
  const std::span<uint8_t> others[] = {other.span()};
  ASSERT_TRUE(device_->RegisterMemory(others).ok());
  const uint64_t before = device_->registered_requests();
  ASSERT_TRUE(device_->Read(8192, region.span().subspan(0, 65536)).ok());
  ASSERT_TRUE(device_->Read(8192, other.span()).ok());
  EXPECT_EQ(std::memcmp(other.data(), expected.data(), expected.size()), 0);
  EXPECT_EQ(device_->registered_requests() - before, GetParam() == DeviceBackend::kIoUring ? 1u : 0u);
}

#ifdef ORBITKV_HAVE_IO_URING
// Devices that register the same memory (the files of one store, all given the DRAM pool) pin it
// once, and each one's requests still run on it; other memory is a registration of its own.
TEST(UringDeviceTest, DevicesShareARegistrationOfTheSameMemory) {
  const TempDir dir;
  auto first = UringDevice::Create(dir.path() + "/a", 1 << 20, 8);
  auto second = UringDevice::Create(dir.path() + "/b", 1 << 20, 8);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(second.ok()) << second.status();
  auto region = AlignedBuffer::Create(256 * 1024, 4096);
  ASSERT_TRUE(region.ok());
  const std::span<uint8_t> regions[] = {region->span()};
  const uint64_t before = UringDevice::memory_registrations();
  ASSERT_TRUE((*first)->RegisterMemory(regions).ok());
  ASSERT_TRUE((*second)->RegisterMemory(regions).ok());
  EXPECT_EQ(UringDevice::memory_registrations() - before, 1u);
  std::memset(region->data(), 0x5a, 65536);
  ASSERT_TRUE((*first)->Write(0, region->span().first(65536)).ok());
  ASSERT_TRUE((*second)->Write(0, region->span().first(65536)).ok());
  std::memset(region->data(), 0, 131072);
  ASSERT_TRUE((*first)->Read(0, region->span().first(65536)).ok());
  ASSERT_TRUE((*second)->Read(0, region->span().subspan(65536, 65536)).ok());
  for (size_t i = 0; i < 131072; ++i) ASSERT_EQ(region->data()[i], 0x5a) << i;
  EXPECT_EQ((*first)->registered_requests(), 2u);
  EXPECT_EQ((*second)->registered_requests(), 2u);
  auto other = AlignedBuffer::Create(65536, 4096);
  ASSERT_TRUE(other.ok());
  const std::span<uint8_t> others[] = {other->span()};
  ASSERT_TRUE((*second)->RegisterMemory(others).ok());
  EXPECT_EQ(UringDevice::memory_registrations() - before, 2u);
}
#endif  // ORBITKV_HAVE_IO_URING

// An I/O queue over two devices keeps up to its depth of groups in flight, hands each group back
// once, refuses what does not fit without starting anything, and the bytes land where they were
// sent (read back through the queue itself).
TEST_P(DeviceTest, IoQueueKeepsGroupsInFlightAcrossDevices) {
  auto second = Open(dir_.path() + "/ssd1", GetParam(), kDeviceBytes);
  ASSERT_TRUE(second.ok()) << second.status();
  std::vector<AlignedBuffer> out;
  for (uint32_t i = 0; i < 6; ++i) {
    out.push_back(Buffer(65536));
    Fill(out.back(), 40 + i);
  }
  // The written buffers are registered memory (io_uring: fixed buffers the queue's ring clones);
  // the read buffers are not. They stay alive, as registration requires, until the devices go.
  std::vector<std::span<uint8_t>> regions;
  for (AlignedBuffer& buffer : out) regions.push_back(buffer.span());
  ASSERT_TRUE(device_->RegisterMemory(regions).ok());
  auto queue = CreateIoQueue({device_.get(), second->get()}, 3, 2);
  ASSERT_TRUE(queue.ok()) << queue.status();
  IoQueue& q = **queue;
  EXPECT_EQ(q.Wait().status().code(), StatusCode::kFailedPrecondition);  // nothing in flight
  // Groups of two requests (like a header page and a payload) on alternating devices.
  auto group = [&](uint32_t i, IoRequest::Op op, std::vector<AlignedBuffer>& buffers) {
    return std::vector<IoRequest>{{op, i * 131072, buffers[i].span().first(4096)},
                                  {op, i * 131072 + 4096, buffers[i].span().subspan(4096)}};
  };
  std::set<uint64_t> finished;
  for (uint32_t i = 0; i < 6; ++i) {
    if (q.in_flight() == q.depth()) {
      // A full queue refuses one more group and starts nothing.
      const auto extra = group(i, IoRequest::Op::kWrite, out);
      EXPECT_EQ(q.Start(i % 2, extra, 100).code(), StatusCode::kFailedPrecondition);
      auto done = q.Wait();
      ASSERT_TRUE(done.ok()) << done.status();
      EXPECT_TRUE(done->status.ok()) << done->status;
      EXPECT_TRUE(finished.insert(done->tag).second) << done->tag;
    }
    const auto requests = group(i, IoRequest::Op::kWrite, out);
    ASSERT_TRUE(q.Start(i % 2, requests, i).ok());
  }
  // Refused without starting: a misaligned buffer, an unknown device, an oversized group.
  const IoRequest bad[] = {{IoRequest::Op::kWrite, 1, out[0].span()}};
  EXPECT_EQ(q.Start(0, bad, 200).code(), StatusCode::kInvalidArgument);
  const auto fine = group(0, IoRequest::Op::kWrite, out);
  EXPECT_EQ(q.Start(2, fine, 201).code(), StatusCode::kInvalidArgument);
  const IoRequest three[] = {fine[0], fine[1], fine[0]};
  EXPECT_EQ(q.Start(0, three, 202).code(), StatusCode::kInvalidArgument);
  while (q.in_flight() > 0) {
    auto done = q.Wait();
    ASSERT_TRUE(done.ok()) << done.status();
    EXPECT_TRUE(done->status.ok()) << done->status;
    EXPECT_TRUE(finished.insert(done->tag).second) << done->tag;
  }
  EXPECT_EQ(finished, (std::set<uint64_t>{0, 1, 2, 3, 4, 5}));
  std::vector<AlignedBuffer> in;
  for (uint32_t i = 0; i < 6; ++i) in.push_back(Buffer(65536));
  for (uint32_t i = 0; i < 6; ++i) {
    const auto reads = group(i, IoRequest::Op::kRead, in);
    ASSERT_TRUE(q.Start(i % 2, reads, i).ok());
    if (q.in_flight() == q.depth()) {
      ASSERT_TRUE(q.Wait().ok());
    }
  }
  while (q.in_flight() > 0) ASSERT_TRUE(q.Wait().ok());
  for (uint32_t i = 0; i < 6; ++i) {
    EXPECT_EQ(std::memcmp(in[i].data(), out[i].data(), 65536), 0) << i;
  }
  // Every write ran from a fixed buffer (counted on the device it went to); no read did.
  EXPECT_EQ(device_->registered_requests() + (*second)->registered_requests(),
            GetParam() == DeviceBackend::kIoUring ? 12u : 0u);
  ASSERT_TRUE(device_->RegisterMemory({}).ok());  // before `out` goes
  // Device 1 holds only the odd groups: device 0's bytes there are still zero.
  AlignedBuffer zero = Buffer(65536);
  ASSERT_TRUE(device_->Read(131072, zero.span()).ok());
  EXPECT_TRUE(std::all_of(zero.data(), zero.data() + zero.size(), [](uint8_t b) { return b == 0; }));
}

TEST_P(DeviceTest, DataSurvivesReopen) {
  AlignedBuffer out = Buffer(8192);
  Fill(out, 77);
  ASSERT_TRUE(device_->Write(12288, out.span()).ok());
  device_.reset();
  auto reopened = Open(path_, GetParam(), kDeviceBytes);
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  AlignedBuffer in = Buffer(8192);
  ASSERT_TRUE((*reopened)->Read(12288, in.span()).ok());
  EXPECT_EQ(std::memcmp(in.data(), out.data(), out.size()), 0);
}

TEST_P(DeviceTest, BatchOfManyRequests) {
  constexpr size_t kCount = 200;  // Many times the test queue depth of 8.
  constexpr size_t kBytes = 16384;
  std::vector<AlignedBuffer> outs, ins;
  std::vector<IoRequest> writes, reads;
  for (size_t i = 0; i < kCount; ++i) {
    outs.push_back(Buffer(kBytes));
    Fill(outs.back(), static_cast<uint32_t>(i));
    ins.push_back(Buffer(kBytes));
    writes.push_back({.op = IoRequest::Op::kWrite, .offset = i * kBytes, .buffer = outs.back().span()});
  }
  for (size_t i = 0; i < kCount; ++i) {
    reads.push_back({.op = IoRequest::Op::kRead, .offset = i * kBytes, .buffer = ins[i].span()});
  }
  for (const Status& s : device_->Submit(writes)) ASSERT_TRUE(s.ok()) << s;
  auto statuses = device_->Submit(reads);
  ASSERT_EQ(statuses.size(), kCount);
  for (size_t i = 0; i < kCount; ++i) {
    ASSERT_TRUE(statuses[i].ok()) << i << ": " << statuses[i];
    ASSERT_EQ(std::memcmp(ins[i].data(), outs[i].data(), kBytes), 0) << i;
  }
}

TEST_P(DeviceTest, InvalidRequestsFailAloneAndAreNotSubmitted) {
  AlignedBuffer good = Buffer(8192);
  Fill(good, 5);
  AlignedBuffer victim = Buffer(4096);
  Fill(victim, 6);
  ASSERT_TRUE(device_->Write(kDeviceBytes - 4096, victim.span()).ok());
  AlignedBuffer big = Buffer(8192);
  std::vector<IoRequest> batch{
      {.op = IoRequest::Op::kWrite, .offset = 0, .buffer = good.span()},
      {.op = IoRequest::Op::kWrite, .offset = 100, .buffer = good.span()},                    // Misaligned offset.
      {.op = IoRequest::Op::kWrite, .offset = 4096, .buffer = good.span().first(100)},        // Misaligned size.
      {.op = IoRequest::Op::kWrite, .offset = 4096, .buffer = good.span().subspan(8, 4096)},  // Misaligned address.
      {.op = IoRequest::Op::kWrite, .offset = 4096, .buffer = {}},                            // Empty.
      {.op = IoRequest::Op::kWrite, .offset = kDeviceBytes - 4096, .buffer = big.span()},     // Runs past the end.
      {.op = IoRequest::Op::kRead, .offset = kDeviceBytes, .buffer = big.span()},             // Starts at the end.
      {.op = IoRequest::Op::kRead, .offset = UINT64_MAX - 4095, .buffer = big.span()},        // Overflows.
  };
  auto statuses = device_->Submit(batch);
  ASSERT_EQ(statuses.size(), batch.size());
  EXPECT_TRUE(statuses[0].ok()) << statuses[0];
  for (size_t i = 1; i <= 4; ++i) EXPECT_EQ(statuses[i].code(), StatusCode::kInvalidArgument) << i;
  for (size_t i = 5; i <= 7; ++i) EXPECT_EQ(statuses[i].code(), StatusCode::kOutOfRange) << i;
  // The rejected overrunning write left the last page alone.
  AlignedBuffer in = Buffer(4096);
  ASSERT_TRUE(device_->Read(kDeviceBytes - 4096, in.span()).ok());
  EXPECT_EQ(std::memcmp(in.data(), victim.data(), 4096), 0);
}

TEST_P(DeviceTest, ShortReadOfTruncatedFileIsDataLoss) {
  // Someone truncated the file under the device: a read past the new end transfers nothing.
  ASSERT_EQ(::truncate(path_.c_str(), kDeviceBytes / 2), 0);
  AlignedBuffer in = Buffer(4096);
  EXPECT_EQ(device_->Read(kDeviceBytes - 4096, in.span()).code(), StatusCode::kDataLoss);
  EXPECT_TRUE(device_->Read(0, in.span()).ok());
}

INSTANTIATE_TEST_SUITE_P(Backends, DeviceTest, ::testing::ValuesIn(Backends()),
                         [](const ::testing::TestParamInfo<DeviceBackend>& param_info) {
                           return std::string(DeviceBackendName(param_info.param));
                         });

TEST(DeviceBackendTest, ParsesNames) {
  EXPECT_EQ(ParseDeviceBackend("auto"), DeviceBackend::kAuto);
  EXPECT_EQ(ParseDeviceBackend("io_uring"), DeviceBackend::kIoUring);
  EXPECT_EQ(ParseDeviceBackend("psync"), DeviceBackend::kPsync);
  EXPECT_EQ(ParseDeviceBackend("uring"), std::nullopt);
}

TEST(CreateDeviceTest, AutoPicksIoUringWhenItWorks) {
  TempDir dir;
  auto device = CreateDevice(dir.path() + "/auto", kDeviceBytes, DeviceBackend::kAuto);
  ASSERT_TRUE(device.ok()) << device.status();
  // This machine runs io_uring whenever the build has it (the io_uring suite above would fail
  // otherwise).
  EXPECT_EQ((*device)->backend_name(), IoUringCompiledIn() ? "io_uring" : "psync");
  EXPECT_TRUE((*device)->direct_io());  // /var/tmp is a disk file system.
}

TEST(CreateDeviceTest, RejectsBadSizesAndPaths) {
  TempDir dir;
  EXPECT_EQ(CreateDevice(dir.path() + "/a", 0, DeviceBackend::kPsync).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateDevice(dir.path() + "/a", 4097, DeviceBackend::kAuto).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateDevice(dir.path() + "/missing/dir/f", 4096, DeviceBackend::kPsync).status().code(),
            StatusCode::kNotFound);
  if (!IoUringCompiledIn()) {
    EXPECT_EQ(CreateDevice(dir.path() + "/u", 4096, DeviceBackend::kIoUring).status().code(),
              StatusCode::kUnimplemented);
  }
}

TEST(CreateDeviceTest, WorksOnTmpfsWithOrWithoutODirect) {
  // /dev/shm is tmpfs, which refuses O_DIRECT before Linux 6.6: the device then falls back to
  // buffered I/O.
  TempDir dir("/dev/shm");
  if (dir.path().empty()) GTEST_SKIP() << "no /dev/shm";
  const std::string& pattern = dir.path();
  const std::string path = pattern + "/f";
  const int probe = ::open((pattern + "/probe").c_str(), O_RDWR | O_CREAT | O_DIRECT | O_CLOEXEC, 0600);
  const bool tmpfs_direct = probe >= 0;
  if (probe >= 0) ::close(probe);
  for (DeviceBackend backend : Backends()) {
    auto device = CreateDevice(path, 65536, backend);
    ASSERT_TRUE(device.ok()) << device.status();
    EXPECT_EQ((*device)->direct_io(), tmpfs_direct);
    AlignedBuffer out = Buffer(8192);
    Fill(out, 3);
    AlignedBuffer in = Buffer(8192);
    EXPECT_TRUE((*device)->Write(4096, out.span()).ok());
    EXPECT_TRUE((*device)->Read(4096, in.span()).ok());
    EXPECT_EQ(std::memcmp(in.data(), out.data(), out.size()), 0);
  }
}

TEST(AlignedBufferTest, RejectsBadGeometry) {
  EXPECT_EQ(AlignedBuffer::Create(4096, 3000).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(AlignedBuffer::Create(100, 4096).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(AlignedBuffer::Create(0, 4096).status().code(), StatusCode::kInvalidArgument);
  auto ok = AlignedBuffer::Create(8192, 4096);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(ok->data()) % 4096, 0u);
  EXPECT_EQ(ok->size(), 8192u);
}

}  // namespace
}  // namespace orbitkv::storage
