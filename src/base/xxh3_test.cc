#include "base/xxh3.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <thread>
#include <vector>

namespace orbitkv {
namespace {

// SSD records written by an earlier build, and a peer running another build, hashed with plain
// XXH3_64bits: the dispatched hash must equal it at every length (the vector paths differ above
// 240 bytes, and again per 1 KiB stripe and 64-byte tail) and alignment.
TEST(Xxh3Test, EqualsThePlainHashAtEveryLengthAndAlignment) {
  std::vector<uint8_t> data((3u << 20) + 64);
  std::mt19937_64 rng(7);
  for (auto& b : data) b = static_cast<uint8_t>(rng());
  std::vector<size_t> lengths;
  for (size_t n = 0; n <= 2100; ++n) lengths.push_back(n);
  for (size_t n : {4095u, 4096u, 65536u, 1u << 20, (1u << 20) + 17, 2359296u, 3u << 20}) lengths.push_back(n);
  for (size_t offset : {0u, 1u, 13u, 64u}) {
    for (size_t n : lengths) {
      ASSERT_EQ(Xxh3(data.data() + offset, n), XXH3_64bits(data.data() + offset, n))
          << "length " << n << " offset " << offset;
    }
  }
}

TEST(Xxh3Test, StreamingEqualsThePlainStreamingHashInAnySplit) {
  std::vector<uint8_t> data(2359296 + 64);
  std::mt19937_64 rng(11);
  for (auto& b : data) b = static_cast<uint8_t>(rng());
  for (size_t head : {0u, 1u, 64u, 255u, 4096u, 1u << 20}) {
    XXH3_state_t* ours = XXH3_createState();
    XXH3_state_t* plain = XXH3_createState();
    XXH3_64bits_reset(ours);
    XXH3_64bits_reset(plain);
    Xxh3Update(ours, data.data(), head);
    Xxh3Update(ours, data.data() + head, data.size() - head);
    XXH3_64bits_update(plain, data.data(), data.size());
    EXPECT_EQ(XXH3_64bits_digest(ours), XXH3_64bits_digest(plain)) << "split at " << head;
    EXPECT_EQ(XXH3_64bits_digest(ours), Xxh3(data.data(), data.size()));
    XXH3_freeState(ours);
    XXH3_freeState(plain);
  }
}

// Threads hashing from the first call on agree (the dispatch table is chosen once).
TEST(Xxh3Test, ConcurrentFirstCallsAgree) {
  std::vector<uint8_t> data(1 << 20, 0x5a);
  const uint64_t want = XXH3_64bits(data.data(), data.size());
  std::vector<uint64_t> got(4);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < got.size(); ++t) threads.emplace_back([&, t] { got[t] = Xxh3(data.data(), data.size()); });
  for (auto& t : threads) t.join();
  for (uint64_t h : got) EXPECT_EQ(h, want);
}

}  // namespace
}  // namespace orbitkv
