// ExtentAllocator: hands out 4 KiB-aligned extents of the SSD files, so capacity is reserved before
// a record is admitted and written.
//
// Each file is one address space of `file_bytes`. Free space is kept as ordered extents per file,
// coalesced with their neighbours on release, and allocation is first-fit in a rotating file order
// (spreading writes over files). A restart rebuilds the allocator from the records it finds:
// MarkUsed claims an extent that a scanned record occupies. Byte accounting is exact: allocated +
// free == capacity at all times.
//
// Thread safety: all methods are safe from any thread (one mutex; every operation is O(log
// extents)).
#ifndef ORBITKV_STORAGE_EXTENT_ALLOCATOR_H_
#define ORBITKV_STORAGE_EXTENT_ALLOCATOR_H_

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "base/mutex.h"
#include "base/result.h"
#include "base/thread_annotations.h"

namespace orbitkv::storage {

struct Extent {
  uint32_t file = 0;
  uint64_t offset = 0;  // bytes, 4 KiB aligned
  uint64_t bytes = 0;   // a multiple of 4 KiB, > 0
  friend bool operator==(const Extent&, const Extent&) = default;
};

class ExtentAllocator {
 public:
  static constexpr uint64_t kAlignment = 4096;

  // `file_bytes`: one entry per file, each a positive multiple of 4 KiB. InvalidArgument otherwise.
  static Result<std::unique_ptr<ExtentAllocator>> Create(std::vector<uint64_t> file_bytes);

  // Reserves `bytes` rounded up to 4 KiB. ResourceExhausted when no file has a free run that large
  // (the caller may evict SSD residences and retry, or skip the write); InvalidArgument for 0.
  Result<Extent> Allocate(uint64_t bytes);
  // Returns an extent from Allocate or MarkUsed. Releasing space that is not allocated (double
  // free, overlap, out of range) is a programming error: CHECK.
  void Release(const Extent& extent);
  // Restart: claims the extent a recovered record occupies. FailedPrecondition when any part of it
  // is already used (two records claiming the same bytes: the caller drops the older one),
  // InvalidArgument when it is misaligned or out of range.
  Status MarkUsed(const Extent& extent);

  uint64_t capacity_bytes() const { return capacity_; }
  uint64_t allocated_bytes() const;
  uint64_t free_bytes() const;
  // The largest extent Allocate could return now.
  uint64_t largest_free_bytes() const;
  size_t file_count() const { return file_count_; }

 private:
  struct File {
    uint64_t bytes = 0;
    std::map<uint64_t, uint64_t> free;  // offset -> length, non-overlapping, never adjacent (coalesced)
  };

  explicit ExtentAllocator(std::vector<File> files, uint64_t capacity);
  Status Validate(const Extent& extent) const;

  // Immutable after construction.
  const uint64_t capacity_;
  const size_t file_count_;

  mutable Mutex mu_;
  std::vector<File> files_ GUARDED_BY(mu_);
  uint64_t allocated_ GUARDED_BY(mu_) = 0;
  uint32_t next_file_ GUARDED_BY(mu_) = 0;
};

}  // namespace orbitkv::storage

#endif  // ORBITKV_STORAGE_EXTENT_ALLOCATOR_H_
