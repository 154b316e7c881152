#include "base/stream_copy.h"

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace orbitkv {

void StreamCopy(void* dst, const void* src, size_t n) {
#if defined(__x86_64__)
  if (n < kStreamCopyMinBytes) {
    std::memcpy(dst, src, n);
    return;
  }
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
  // Non-temporal stores need an aligned destination; the source may be anywhere.
  const size_t head = (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15;
  std::memcpy(d, s, head);
  d += head;
  s += head;
  n -= head;
  auto* out = reinterpret_cast<__m128i*>(d);
  const auto* in = reinterpret_cast<const __m128i*>(s);
  // 64 bytes (a cache line when the destination is line-aligned) per round.
  for (size_t rounds = n / 64; rounds > 0; --rounds) {
    const __m128i a = _mm_loadu_si128(in + 0);
    const __m128i b = _mm_loadu_si128(in + 1);
    const __m128i c = _mm_loadu_si128(in + 2);
    const __m128i e = _mm_loadu_si128(in + 3);
    _mm_stream_si128(out + 0, a);
    _mm_stream_si128(out + 1, b);
    _mm_stream_si128(out + 2, c);
    _mm_stream_si128(out + 3, e);
    in += 4;
    out += 4;
  }
  const size_t done = n / 64 * 64;
  std::memcpy(d + done, s + done, n - done);
  _mm_sfence();
#else
  std::memcpy(dst, src, n);
#endif
}

void CopyBytes(void* dst, const void* src, size_t n, CopyStores stores) {
  if (stores == CopyStores::kStreaming) {
    StreamCopy(dst, src, n);
  } else {
    std::memcpy(dst, src, n);
  }
}

void StreamCopyFence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

}  // namespace orbitkv
