#include "storage/aligned_buffer.h"

#include <fmt/format.h>
#include <sys/mman.h>

#include <cerrno>
#include <cstring>

namespace orbitkv::storage {

Result<AlignedBuffer> AlignedBuffer::Create(size_t bytes, size_t alignment) {
  if (alignment < sizeof(void*) || (alignment & (alignment - 1)) != 0) {
    return Status::InvalidArgument(fmt::format("alignment {} is not a power of two >= {}", alignment, sizeof(void*)));
  }
  if (bytes == 0 || bytes % alignment != 0) {
    return Status::InvalidArgument(
        fmt::format("buffer of {} bytes is not a non-zero multiple of {}", bytes, alignment));
  }
  void* memory = std::aligned_alloc(alignment, bytes);
  if (memory == nullptr) return Status::ResourceExhausted(fmt::format("cannot allocate {} aligned bytes", bytes));
  std::memset(memory, 0, bytes);
  return AlignedBuffer(static_cast<uint8_t*>(memory), bytes, /*mapped=*/false);
}

Result<AlignedBuffer> AlignedBuffer::CreateHugePageBacked(size_t bytes) {
  if (bytes == 0) return Status::InvalidArgument("a buffer of 0 bytes");
  const size_t size = (bytes + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  // Over-map by one huge page and trim, so the buffer starts on a 2 MiB boundary (THP needs it).
  const size_t mapped = size + kHugePageBytes;
  void* memory = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (memory == MAP_FAILED) {
    return Status::ResourceExhausted(fmt::format("cannot map {} bytes: {}", mapped, std::strerror(errno)));
  }
  const uintptr_t start = reinterpret_cast<uintptr_t>(memory);
  const uintptr_t aligned = (start + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  if (aligned > start) munmap(memory, aligned - start);
  const uintptr_t end = start + mapped;
  if (end > aligned + size) munmap(reinterpret_cast<void*>(aligned + size), end - aligned - size);
  auto* data = reinterpret_cast<uint8_t*>(aligned);
  // Advice only: refused (THP compiled out), the buffer is ordinary pages.
  (void)madvise(data, size, MADV_HUGEPAGE);
  std::memset(data, 0, size);  // faults the pages in now, not on the first record
  return AlignedBuffer(data, size, /*mapped=*/true);
}

void AlignedBuffer::Free() {
  if (data_ == nullptr) return;
  if (mapped_) {
    munmap(data_, size_);
  } else {
    std::free(data_);
  }
  data_ = nullptr;
}

}  // namespace orbitkv::storage
