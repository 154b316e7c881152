#include "transfer/checksum.h"

#include <bit>

#include "base/check.h"
#include "base/xxh3.h"

namespace orbitkv::transfer {

uint64_t FragmentHash(const void* data, size_t length) { return Xxh3(data, length); }

void BatchChecksum::Set(size_t index, uint64_t hash) {
  ORBITKV_CHECK_MSG(index < hashes_.size(), "fragment {} of {}", index, hashes_.size());
  hashes_[index] = hash;
}

uint64_t BatchChecksum::Finish() const {
  static_assert(std::endian::native == std::endian::little, "the hash array is hashed as little-endian");
  return Xxh3(hashes_.data(), hashes_.size() * sizeof(uint64_t));
}

}  // namespace orbitkv::transfer
