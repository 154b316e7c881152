// Several threads submit batches to one device at once (the io_uring backend then runs one ring per
// concurrent caller); every thread must read back exactly what it wrote to its own region.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "base/temp_dir.h"
#include "storage/aligned_buffer.h"
#include "storage/device.h"

namespace orbitkv::storage {
namespace {

// Both backends where io_uring is compiled in.
std::vector<DeviceBackend> Backends() {
  std::vector<DeviceBackend> backends{DeviceBackend::kPsync};
  if (IoUringCompiledIn()) backends.push_back(DeviceBackend::kIoUring);
  return backends;
}

TEST(DeviceConcurrencyTest, ConcurrentBatchesOnDisjointRegions) {
  const testing::TempDir dir;
  constexpr size_t kThreads = 4;
  constexpr size_t kRequests = 32;
  constexpr size_t kBytes = 8192;
  constexpr size_t kRounds = 5;
  for (DeviceBackend backend : Backends()) {
    auto device = CreateDevice(dir.path() + "/" + std::string(DeviceBackendName(backend)),
                               kThreads * kRequests * kBytes, backend);
    ASSERT_TRUE(device.ok()) << device.status();
    std::vector<size_t> mismatches(kThreads, 0);
    std::vector<std::thread> threads;
    for (size_t t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        for (size_t round = 0; round < kRounds; ++round) {
          std::vector<AlignedBuffer> outs, ins;
          std::vector<IoRequest> writes, reads;
          for (size_t i = 0; i < kRequests; ++i) {
            outs.push_back(std::move(AlignedBuffer::Create(kBytes, 4096)).value());
            ins.push_back(std::move(AlignedBuffer::Create(kBytes, 4096)).value());
            std::memset(outs.back().data(), static_cast<int>(t * 31 + round * 7 + i), kBytes);
            const uint64_t offset = (t * kRequests + i) * kBytes;
            writes.push_back({.op = IoRequest::Op::kWrite, .offset = offset, .buffer = outs.back().span()});
            reads.push_back({.op = IoRequest::Op::kRead, .offset = offset, .buffer = ins.back().span()});
          }
          for (const Status& s : (*device)->Submit(writes)) mismatches[t] += s.ok() ? 0 : 1;
          for (const Status& s : (*device)->Submit(reads)) mismatches[t] += s.ok() ? 0 : 1;
          for (size_t i = 0; i < kRequests; ++i) {
            mismatches[t] += std::memcmp(ins[i].data(), outs[i].data(), kBytes) == 0 ? 0 : 1;
          }
        }
      });
    }
    for (auto& thread : threads) thread.join();
    for (size_t t = 0; t < kThreads; ++t) EXPECT_EQ(mismatches[t], 0u) << DeviceBackendName(backend) << " " << t;
  }
}

// Requests run from registered memory while another thread keeps replacing the registration with
// sets whose fixed-buffer indices differ: a ring must address its requests with the indices of the
// set it registered, never a newer set's (which points the kernel at another buffer: EFAULT or the
// wrong bytes).
TEST(DeviceConcurrencyTest, RegistrationReplacedWhileRequestsRun) {
  const testing::TempDir dir;
  constexpr size_t kThreads = 3;
  constexpr size_t kRequests = 8;
  constexpr size_t kBytes = 16384;
  constexpr size_t kRounds = 40;
  for (DeviceBackend backend : Backends()) {
    auto device = CreateDevice(dir.path() + "/" + std::string(DeviceBackendName(backend)),
                               kThreads * kRequests * kBytes, backend);
    ASSERT_TRUE(device.ok()) << device.status();
    // Each thread writes from the first half of its region and reads into the second.
    std::vector<AlignedBuffer> regions;
    for (size_t t = 0; t < kThreads; ++t) {
      regions.push_back(std::move(AlignedBuffer::Create(2 * kRequests * kBytes, 4096)).value());
    }
    // Fixed buffers are indexed in address order: leaving out the lowest region moves every other
    // one down an index, and leaving out the highest moves none.
    std::vector<std::span<uint8_t>> all;
    for (size_t t = 0; t < kThreads; ++t) all.push_back(regions[t].span());
    std::sort(all.begin(), all.end(), [](auto a, auto b) { return a.data() < b.data(); });
    const std::vector<std::span<uint8_t>> shifted(all.begin() + 1, all.end());
    const std::vector<std::span<uint8_t>> kept(all.begin(), all.end() - 1);
    ASSERT_TRUE((*device)->RegisterMemory(all).ok());
    std::atomic<bool> done{false};
    std::thread registrar([&] {
      for (size_t i = 0; !done.load(); ++i) {
        const auto& set = i % 3 == 0 ? shifted : i % 3 == 1 ? kept : all;
        EXPECT_TRUE((*device)->RegisterMemory(set).ok());
      }
    });
    std::vector<size_t> failures(kThreads, 0);
    std::vector<std::thread> threads;
    for (size_t t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        uint8_t* out = regions[t].data();
        uint8_t* in = out + kRequests * kBytes;
        for (size_t round = 0; round < kRounds; ++round) {
          std::vector<IoRequest> writes, reads;
          for (size_t i = 0; i < kRequests; ++i) {
            std::memset(out + i * kBytes, static_cast<int>(t * 31 + round * 7 + i + 1), kBytes);
            std::memset(in + i * kBytes, 0, kBytes);
            const uint64_t offset = (t * kRequests + i) * kBytes;
            writes.push_back({.op = IoRequest::Op::kWrite,
                              .offset = offset,
                              .buffer = std::span<uint8_t>(out + i * kBytes, kBytes)});
            reads.push_back(
                {.op = IoRequest::Op::kRead, .offset = offset, .buffer = std::span<uint8_t>(in + i * kBytes, kBytes)});
          }
          for (const Status& s : (*device)->Submit(writes)) failures[t] += s.ok() ? 0 : 1;
          for (const Status& s : (*device)->Submit(reads)) failures[t] += s.ok() ? 0 : 1;
          failures[t] += std::memcmp(in, out, kRequests * kBytes) == 0 ? 0 : 1;
        }
      });
    }
    for (auto& thread : threads) thread.join();
    done.store(true);
    registrar.join();
    ASSERT_TRUE((*device)->RegisterMemory({}).ok());  // before the regions go
    for (size_t t = 0; t < kThreads; ++t) {
      EXPECT_EQ(failures[t], 0u) << DeviceBackendName(backend) << " " << t;
    }
    if (backend == DeviceBackend::kIoUring) {
      EXPECT_GT((*device)->registered_requests(), 0u);
    }
  }
}

}  // namespace
}  // namespace orbitkv::storage
