// Helpers of the CUDA copy engine's GPU unit tests (cuda_copy_engine_test.cc,
// cuda_copy_engine_batches_test.cc): patterned host memory registered with a HostMemoryRegistry,
// device memory, a CopyDone probe, engines on device 0.
#ifndef ORBITKV_GPU_CUDA_COPY_ENGINE_TEST_UTIL_H_
#define ORBITKV_GPU_CUDA_COPY_ENGINE_TEST_UTIL_H_

#include <gtest/gtest.h>
#include <sys/mman.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "base/metrics.h"
#include "base/mutex.h"
#include "core/copy_engine_test_util.h"
#include "gpu/cuda_copy_engine.h"
#include "gpu/cuda_util.h"
#include "gpu/host_memory_registry.h"

namespace orbitkv::gpu::test_util {

using core::BufferId;
using core::CopyBatch;
using core::CopyDirection;
using core::CopyDone;
using core::CopyFragment;
using core::testing::DoneProbe;
using Bytes = std::vector<uint8_t>;
using Method = CudaCopyEngine::Method;

inline constexpr uint8_t kPoison = 0xA5;

// The byte at `index` of the pattern `seed` (both processes of the IPC test compute it).
inline uint8_t PatternByte(uint64_t seed, uint64_t index) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + index;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return static_cast<uint8_t>(x);
}

inline void FillPattern(uint8_t* data, uint64_t bytes, uint64_t seed) {
  for (uint64_t i = 0; i < bytes; ++i) data[i] = PatternByte(seed, i);
}

// Host memory from mmap, registered with a HostMemoryRegistry for the object's lifetime.
class RegisteredHostMemory {
 public:
  RegisteredHostMemory(HostMemoryRegistry& registry, uint64_t bytes) : registry_(registry), bytes_(bytes) {
    void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ORBITKV_CHECK(data != MAP_FAILED);
    data_ = static_cast<uint8_t*>(data);
    const Status status = registry_.Register(data_, bytes_, -1);
    ORBITKV_CHECK_MSG(status.ok(), "{}", status.ToString());
  }
  ~RegisteredHostMemory() {
    registry_.Unregister(data_);
    munmap(data_, bytes_);
  }
  RegisteredHostMemory(const RegisteredHostMemory&) = delete;
  RegisteredHostMemory& operator=(const RegisteredHostMemory&) = delete;

  uint8_t* data() const { return data_; }
  uint64_t size() const { return bytes_; }

 private:
  HostMemoryRegistry& registry_;
  uint8_t* data_ = nullptr;
  uint64_t bytes_ = 0;
};

inline DeviceMemory MakeDeviceMemory(uint64_t bytes) {
  auto memory = DeviceMemory::Allocate(0, bytes);
  ORBITKV_CHECK_MSG(memory.ok(), "{}", memory.status().ToString());
  return std::move(memory).value();
}

inline void Upload(const DeviceMemory& dst, const uint8_t* src, uint64_t bytes) {
  ASSERT_EQ(cudaMemcpy(dst.data(), src, bytes, cudaMemcpyHostToDevice), cudaSuccess);
}

inline Bytes Download(const DeviceMemory& src) {
  Bytes out(src.size());
  EXPECT_EQ(cudaMemcpy(out.data(), src.data(), src.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}

inline void Poison(const DeviceMemory& memory) {
  ASSERT_EQ(cudaMemset(memory.data(), kPoison, memory.size()), cudaSuccess);
}

inline std::unique_ptr<CudaCopyEngine> MakeEngine(const HostMemoryRegistry& registry,
                                                  CudaCopyEngine::Options options = {},
                                                  MetricsRegistry* metrics = nullptr) {
  if (options.devices.empty()) options.devices = {0};
  auto engine = CudaCopyEngine::Create(options, &registry, metrics);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? std::move(engine).value() : nullptr;
}

inline Status RunBatch(CudaCopyEngine& engine, CopyBatch batch) {
  DoneProbe probe;
  ORBITKV_RETURN_IF_ERROR(engine.Submit(std::move(batch), probe.Callback()));
  return probe.Wait();
}

// Fragments of many lengths at many alignments, laid out without overlap in an engine buffer of
// `buffer_bytes` and a pool of `pool_bytes` (in a shuffled order on the pool side).
inline std::vector<CopyFragment> MixedFragments(BufferId buffer, uint64_t buffer_bytes, uint8_t* pool,
                                                uint64_t pool_bytes, std::mt19937_64& rng) {
  const std::vector<uint64_t> lengths = {1,        2,
                                         3,        7,
                                         15,       16,
                                         17,       31,
                                         33,       255,
                                         511,      4095,
                                         4096,     4097,
                                         16384,    16389,
                                         65536,    65541,
                                         262144,   262147,
                                         1u << 20, (1u << 20) + 9,
                                         4u << 20, 3 * (4u << 20) / 2};
  std::vector<CopyFragment> fragments;
  uint64_t engine_cursor = 0;
  uint64_t pool_cursor = 0;
  for (const uint64_t length : lengths) {
    // A random misalignment on each side: 16-, 8-, 4-, 2- and 1-byte relative alignments all occur.
    engine_cursor += rng() % 64;
    pool_cursor += rng() % 64;
    fragments.push_back(CopyFragment{buffer, engine_cursor, pool + pool_cursor, length});
    engine_cursor += length;
    pool_cursor += length;
  }
  ORBITKV_CHECK(engine_cursor <= buffer_bytes && pool_cursor <= pool_bytes);
  std::shuffle(fragments.begin(), fragments.end(), rng);
  return fragments;
}

}  // namespace orbitkv::gpu::test_util

#endif  // ORBITKV_GPU_CUDA_COPY_ENGINE_TEST_UTIL_H_
