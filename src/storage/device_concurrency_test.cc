// Several threads submit batches to one device at once (the io_uring backend then runs one ring per
// concurrent caller); every thread must read back exactly what it wrote to its own region.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "storage/aligned_buffer.h"
#include "storage/device.h"

namespace orbitkv::storage {
namespace {

// Removes the directory tree when the test ends, whether it passed or not.
struct DirRemover {
  std::string path;
  ~DirRemover() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

TEST(DeviceConcurrencyTest, ConcurrentBatchesOnDisjointRegions) {
  std::string dir = "/var/tmp/orbitkv_storage_ctest.XXXXXX";
  ASSERT_NE(::mkdtemp(dir.data()), nullptr);
  const DirRemover remover{dir};
  constexpr size_t kThreads = 4;
  constexpr size_t kRequests = 32;
  constexpr size_t kBytes = 8192;
  constexpr size_t kRounds = 5;
  std::vector<DeviceBackend> backends{DeviceBackend::kPsync};
  if (IoUringCompiledIn()) backends.push_back(DeviceBackend::kIoUring);
  for (DeviceBackend backend : backends) {
    auto device = CreateDevice(dir + "/" + std::string(DeviceBackendName(backend)),
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
            writes.push_back(
                {.op = IoRequest::Op::kWrite, .offset = offset, .buffer = outs.back().span()});
            reads.push_back(
                {.op = IoRequest::Op::kRead, .offset = offset, .buffer = ins.back().span()});
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
    for (size_t t = 0; t < kThreads; ++t)
      EXPECT_EQ(mismatches[t], 0u) << DeviceBackendName(backend) << " " << t;
  }
}

}  // namespace
}  // namespace orbitkv::storage
