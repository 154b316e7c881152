#include "storage/extent_allocator.h"

#include <fmt/format.h>

#include <algorithm>
#include <iterator>
#include <memory>

#include "base/check.h"

namespace orbitkv::storage {

Result<std::unique_ptr<ExtentAllocator>> ExtentAllocator::Create(std::vector<uint64_t> file_bytes) {
  if (file_bytes.empty()) return Status::InvalidArgument("the SSD tier needs at least one file");
  std::vector<File> files;
  uint64_t capacity = 0;
  for (size_t i = 0; i < file_bytes.size(); ++i) {
    const uint64_t bytes = file_bytes[i];
    if (bytes == 0 || bytes % kAlignment != 0) {
      return Status::InvalidArgument(
          fmt::format("SSD file {} has {} bytes, not a positive multiple of 4 KiB", i, bytes));
    }
    File file;
    file.bytes = bytes;
    file.free.emplace(0, bytes);
    files.push_back(std::move(file));
    capacity += bytes;
  }
  return std::unique_ptr<ExtentAllocator>(new ExtentAllocator(std::move(files), capacity));
}

ExtentAllocator::ExtentAllocator(std::vector<File> files, uint64_t capacity)
    : capacity_(capacity), file_count_(files.size()), files_(std::move(files)) {}

Result<Extent> ExtentAllocator::Allocate(uint64_t bytes) {
  if (bytes == 0) return Status::InvalidArgument("cannot allocate an empty SSD extent");
  const uint64_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  MutexLock lock(&mu_);
  const uint32_t n = static_cast<uint32_t>(files_.size());
  for (uint32_t k = 0; k < n; ++k) {
    const uint32_t index = (next_file_ + k) % n;
    File& file = files_[index];
    // First fit within the file.
    for (auto it = file.free.begin(); it != file.free.end(); ++it) {
      if (it->second < rounded) continue;
      const Extent extent{index, it->first, rounded};
      const uint64_t rest_offset = it->first + rounded;
      const uint64_t rest_bytes = it->second - rounded;
      file.free.erase(it);
      if (rest_bytes != 0) file.free.emplace(rest_offset, rest_bytes);
      allocated_ += rounded;
      next_file_ = (index + 1) % n;
      return extent;
    }
  }
  return Status::ResourceExhausted(
      fmt::format("no SSD file has {} free contiguous bytes ({} of {} bytes in use)", rounded, allocated_, capacity_));
}

Status ExtentAllocator::Validate(const Extent& extent) const {
  if (extent.bytes == 0 || extent.offset % kAlignment != 0 || extent.bytes % kAlignment != 0) {
    return Status::InvalidArgument(
        fmt::format("SSD extent [{}, +{}) is not 4 KiB aligned", extent.offset, extent.bytes));
  }
  return Status::Ok();
}

void ExtentAllocator::Release(const Extent& extent) {
  ORBITKV_CHECK(Validate(extent).ok());
  MutexLock lock(&mu_);
  ORBITKV_CHECK_MSG(extent.file < files_.size(), "SSD extent names file {}", extent.file);
  File& file = files_[extent.file];
  ORBITKV_CHECK_MSG(extent.offset <= file.bytes && extent.bytes <= file.bytes - extent.offset,
                    "SSD extent [{}, +{}) is beyond file {}", extent.offset, extent.bytes, extent.file);
  // The released range must not overlap free space (that would be a double free).
  auto next = file.free.lower_bound(extent.offset);
  ORBITKV_CHECK_MSG(next == file.free.end() || next->first >= extent.offset + extent.bytes,
                    "SSD extent [{}, +{}) of file {} is already free", extent.offset, extent.bytes, extent.file);
  uint64_t offset = extent.offset;
  uint64_t bytes = extent.bytes;
  if (next != file.free.begin()) {
    auto prev = std::prev(next);
    ORBITKV_CHECK_MSG(prev->first + prev->second <= extent.offset, "SSD extent [{}, +{}) of file {} is already free",
                      extent.offset, extent.bytes, extent.file);
    if (prev->first + prev->second == offset) {  // coalesce with the free run before
      offset = prev->first;
      bytes += prev->second;
      file.free.erase(prev);
    }
  }
  if (next != file.free.end() && next->first == extent.offset + extent.bytes) {  // and the one after
    bytes += next->second;
    file.free.erase(next);
  }
  file.free.emplace(offset, bytes);
  allocated_ -= extent.bytes;
}

Status ExtentAllocator::MarkUsed(const Extent& extent) {
  ORBITKV_RETURN_IF_ERROR(Validate(extent));
  MutexLock lock(&mu_);
  if (extent.file >= files_.size() || extent.offset > files_[extent.file].bytes ||
      extent.bytes > files_[extent.file].bytes - extent.offset) {
    return Status::InvalidArgument(
        fmt::format("SSD extent [{}, +{}) of file {} is out of range", extent.offset, extent.bytes, extent.file));
  }
  File& file = files_[extent.file];
  // The free run containing the extent's start must contain all of it.
  auto it = file.free.upper_bound(extent.offset);
  if (it == file.free.begin()) {
    return Status::FailedPrecondition("SSD extent overlaps space already in use");
  }
  --it;
  const uint64_t run_offset = it->first;
  const uint64_t run_bytes = it->second;
  if (run_offset + run_bytes < extent.offset + extent.bytes) {
    return Status::FailedPrecondition("SSD extent overlaps space already in use");
  }
  file.free.erase(it);
  if (extent.offset > run_offset) file.free.emplace(run_offset, extent.offset - run_offset);
  const uint64_t end = extent.offset + extent.bytes;
  if (run_offset + run_bytes > end) file.free.emplace(end, run_offset + run_bytes - end);
  allocated_ += extent.bytes;
  return Status::Ok();
}

uint64_t ExtentAllocator::allocated_bytes() const {
  MutexLock lock(&mu_);
  return allocated_;
}

uint64_t ExtentAllocator::free_bytes() const {
  MutexLock lock(&mu_);
  return capacity_ - allocated_;
}

uint64_t ExtentAllocator::largest_free_bytes() const {
  MutexLock lock(&mu_);
  uint64_t largest = 0;
  for (const File& file : files_) {
    for (const auto& [offset, bytes] : file.free) largest = std::max(largest, bytes);
  }
  return largest;
}

}  // namespace orbitkv::storage
