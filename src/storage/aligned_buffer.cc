#include "storage/aligned_buffer.h"

#include <fmt/format.h>

#include <cstring>

namespace orbitkv::storage {

Result<AlignedBuffer> AlignedBuffer::Create(size_t bytes, size_t alignment) {
  if (alignment < sizeof(void*) || (alignment & (alignment - 1)) != 0) {
    return Status::InvalidArgument(
        fmt::format("alignment {} is not a power of two >= {}", alignment, sizeof(void*)));
  }
  if (bytes == 0 || bytes % alignment != 0) {
    return Status::InvalidArgument(
        fmt::format("buffer of {} bytes is not a non-zero multiple of {}", bytes, alignment));
  }
  void* memory = std::aligned_alloc(alignment, bytes);
  if (memory == nullptr)
    return Status::ResourceExhausted(fmt::format("cannot allocate {} aligned bytes", bytes));
  std::memset(memory, 0, bytes);
  return AlignedBuffer(static_cast<uint8_t*>(memory), bytes);
}

}  // namespace orbitkv::storage
