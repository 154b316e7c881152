// AlignedBuffer: sole owner of a heap buffer whose address and size are multiples of an I/O
// alignment, as O_DIRECT reads and writes require. Move-only; the memory is zero-filled on creation
// and freed on destruction. CreateHugePageBacked() maps it in 2 MiB pages where the kernel grants
// them, so each 2 MiB of it is one physically contiguous segment for a disk's DMA.
//
// Thread safety: a value type; the bytes are the caller's to synchronize.
#ifndef ORBITKV_STORAGE_ALIGNED_BUFFER_H_
#define ORBITKV_STORAGE_ALIGNED_BUFFER_H_

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <utility>

#include "base/result.h"

namespace orbitkv::storage {

class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  // InvalidArgument unless `alignment` is a power of two >= sizeof(void*) and `bytes` a non-zero
  // multiple of it; ResourceExhausted when the allocation fails.
  static Result<AlignedBuffer> Create(size_t bytes, size_t alignment);
  // A buffer of `bytes` rounded up to 2 MiB, 2 MiB-aligned, asked to be backed by transparent huge
  // pages (madvise; where THP is off it is ordinary 4 KiB pages). ResourceExhausted when the
  // mapping fails; InvalidArgument for 0 bytes.
  static Result<AlignedBuffer> CreateHugePageBacked(size_t bytes);
  static constexpr size_t kHugePageBytes = size_t{2} << 20;

  AlignedBuffer(AlignedBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)),
        size_(std::exchange(other.size_, 0)),
        mapped_(std::exchange(other.mapped_, false)) {}
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept {
    if (this != &other) {
      Free();
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
      mapped_ = std::exchange(other.mapped_, false);
    }
    return *this;
  }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer() { Free(); }

  uint8_t* data() { return data_; }
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  std::span<uint8_t> span() { return {data_, size_}; }
  std::span<const uint8_t> span() const { return {data_, size_}; }
  // Made by CreateHugePageBacked().
  bool huge_page_backed() const { return mapped_; }

 private:
  AlignedBuffer(uint8_t* data, size_t size, bool mapped) : data_(data), size_(size), mapped_(mapped) {}
  void Free();

  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  bool mapped_ = false;  // munmap, not free
};

}  // namespace orbitkv::storage

#endif  // ORBITKV_STORAGE_ALIGNED_BUFFER_H_
