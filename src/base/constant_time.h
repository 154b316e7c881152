// Comparing secrets (grant secrets) in time that depends on their length only, never on where they
// first differ.
//
// Thread safety: a pure function.
#ifndef ORBITKV_BASE_CONSTANT_TIME_H_
#define ORBITKV_BASE_CONSTANT_TIME_H_

#include <cstddef>
#include <cstdint>

namespace orbitkv {

// Whether [a, a+a_size) equals [b, b+b_size); unequal sizes are unequal at once (sizes are not secret).
inline bool ConstantTimeEqual(const void* a, size_t a_size, const void* b, size_t b_size) {
  if (a_size != b_size) return false;
  const auto* x = static_cast<const uint8_t*>(a);
  const auto* y = static_cast<const uint8_t*>(b);
  volatile uint8_t diff = 0;
  for (size_t i = 0; i < a_size; ++i) diff = static_cast<uint8_t>(diff | (x[i] ^ y[i]));
  return diff == 0;
}

}  // namespace orbitkv

#endif  // ORBITKV_BASE_CONSTANT_TIME_H_
