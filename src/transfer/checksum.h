// Fragment integrity: the checksum a source computes over the fragments it serves and the requester
// recomputes over what landed (xxh3, libxxhash).
//
// A batch checksum is XXH3-64 over the little-endian array of each fragment's own XXH3-64, in
// fragment order. Hashing fragments independently lets the requester hash each fragment as it
// lands, in any order, and the source hash each one right after queueing its send.
//
// Thread safety: pure functions and a value type.
#ifndef ORBITKV_TRANSFER_CHECKSUM_H_
#define ORBITKV_TRANSFER_CHECKSUM_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace orbitkv::transfer {

uint64_t FragmentHash(const void* data, size_t length);

class BatchChecksum {
 public:
  explicit BatchChecksum(size_t fragments) : hashes_(fragments, 0) {}

  // Records fragment `index`'s hash; index < fragments (CHECKed).
  void Set(size_t index, uint64_t hash);
  uint64_t Finish() const;

 private:
  std::vector<uint64_t> hashes_;
};

}  // namespace orbitkv::transfer

#endif  // ORBITKV_TRANSFER_CHECKSUM_H_
