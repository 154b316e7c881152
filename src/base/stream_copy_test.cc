#include "base/stream_copy.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace orbitkv {
namespace {

// Every length around the streamed body's boundaries, every source and destination misalignment:
// the destination holds exactly the source's bytes, and nothing outside [dst, dst + n) changes.
TEST(StreamCopyTest, CopiesExactlyAtEveryAlignmentAndLength) {
  constexpr size_t kGuard = 64;
  std::vector<uint8_t> source(8192 + 2 * kGuard);
  for (size_t i = 0; i < source.size(); ++i) source[i] = static_cast<uint8_t>(i * 131 + 7);
  const std::vector<size_t> lengths = {0,    1,    15,   16,   63,   64,   1023, 1024,
                                       1025, 1039, 1087, 4096, 4097, 4159, 8191, 8192};
  for (CopyStores stores : {CopyStores::kCached, CopyStores::kStreaming}) {
    for (size_t n : lengths) {
      for (size_t src_shift = 0; src_shift < 17; src_shift += 3) {
        for (size_t dst_shift = 0; dst_shift < 33; dst_shift += 5) {
          std::vector<uint8_t> dest(source.size(), 0xEE);
          CopyBytes(dest.data() + kGuard + dst_shift, source.data() + src_shift, n, stores);
          for (size_t i = 0; i < dest.size(); ++i) {
            const bool inside = i >= kGuard + dst_shift && i < kGuard + dst_shift + n;
            const uint8_t want = inside ? source[i - kGuard - dst_shift + src_shift] : 0xEE;
            ASSERT_EQ(dest[i], want) << "byte " << i << " of a " << n << "-byte copy, source +" << src_shift
                                     << ", destination +" << dst_shift
                                     << (stores == CopyStores::kStreaming ? ", streamed" : "");
          }
        }
      }
    }
  }
}

TEST(StreamCopyTest, LargeCopyMatches) {
  std::vector<uint8_t> source(3 << 20), dest(3 << 20);
  for (size_t i = 0; i < source.size(); ++i) source[i] = static_cast<uint8_t>(i ^ (i >> 9));
  StreamCopy(dest.data(), source.data(), source.size());
  StreamCopyFence();
  EXPECT_EQ(std::memcmp(dest.data(), source.data(), source.size()), 0);
}

}  // namespace
}  // namespace orbitkv
