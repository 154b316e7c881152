// AlignedBuffer: sole owner of a heap buffer whose address and size are multiples of an I/O
// alignment, as O_DIRECT reads and writes require. Move-only; the memory is zero-filled on creation
// and freed on destruction.
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

  AlignedBuffer(AlignedBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept {
    if (this != &other) {
      std::free(data_);
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
    }
    return *this;
  }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer() { std::free(data_); }

  uint8_t* data() { return data_; }
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  std::span<uint8_t> span() { return {data_, size_}; }
  std::span<const uint8_t> span() const { return {data_, size_}; }

 private:
  AlignedBuffer(uint8_t* data, size_t size) : data_(data), size_(size) {}

  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace orbitkv::storage

#endif  // ORBITKV_STORAGE_ALIGNED_BUFFER_H_
