// Test-only helpers for core tests (never included by library code).
#ifndef ORBITKV_CORE_TEST_UTIL_H_
#define ORBITKV_CORE_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "core/block_cache.h"
#include "state/test_util.h"

namespace orbitkv::core::testing {

// Key `i` of a chain (one engine page of 16 tokens each), distinct per `chain`.
inline state::StateKey ChainKey(uint64_t chain, uint64_t i) {
  static const state::StateNamespace ns = state::testing::SampleNamespace();
  uint8_t native[16];
  std::memcpy(native, &chain, 8);
  std::memcpy(native + 8, &i, 8);
  auto key = state::StateKey::Create(ns, 0, {i * 16, i * 16 + 16}, std::span<const uint8_t>(native, 16));
  EXPECT_TRUE(key.ok()) << key.status();
  return *key;
}

inline std::vector<state::StateKey> Chain(uint64_t chain, size_t n) {
  std::vector<state::StateKey> keys;
  keys.reserve(n);
  for (size_t i = 0; i < n; ++i) keys.push_back(ChainKey(chain, i));
  return keys;
}

// A small unlocked pool so tests do not depend on RLIMIT_MEMLOCK.
inline BlockCacheOptions SmallCacheOptions(uint64_t capacity_bytes = 8ull << 20, uint64_t slab_bytes = 1ull << 20) {
  BlockCacheOptions options;
  options.pool.capacity_bytes = capacity_bytes;
  options.pool.slab_bytes = slab_bytes;
  options.pool.numa_nodes = {-1};
  options.pool.pin_mode = PinMode::kAllowUnpinned;
  options.table.shards = 4;
  options.table.expected_blocks = 1024;
  options.incarnation = 7;
  return options;
}

// Fills a block with a pattern derived from (seed, offset) and checks it.
inline void Stamp(uint8_t* data, uint64_t bytes, uint64_t seed) {
  for (uint64_t i = 0; i < bytes; i += 8) {
    uint64_t v = seed * 0x9e3779b97f4a7c15ull + i;
    std::memcpy(data + i, &v, std::min<uint64_t>(8, bytes - i));
  }
}
inline bool CheckStamp(const uint8_t* data, uint64_t bytes, uint64_t seed) {
  for (uint64_t i = 0; i < bytes; i += 8) {
    uint64_t v = seed * 0x9e3779b97f4a7c15ull + i;
    if (std::memcmp(data + i, &v, std::min<uint64_t>(8, bytes - i)) != 0) return false;
  }
  return true;
}

}  // namespace orbitkv::core::testing

#endif  // ORBITKV_CORE_TEST_UTIL_H_
