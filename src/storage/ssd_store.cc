#include "storage/ssd_store.h"

#include <sys/stat.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <thread>

#include "base/check.h"
#include "base/clock.h"
#include "base/logging.h"
#include "storage/record.h"

namespace orbitkv::storage {
namespace {

constexpr uint64_t kGiB = uint64_t{1} << 30;
constexpr uint64_t kMinFileBytes = uint64_t{1} << 20;
constexpr uint64_t kScanWindowBytes = uint64_t{1} << 20;

// `huge`: the buffer must be huge-page backed (a heap buffer of enough bytes is replaced).
Status EnsureCapacity(AlignedBuffer* buffer, uint64_t bytes, bool huge = false) {
  if (buffer->size() >= bytes && (!huge || buffer->huge_page_backed())) return Status::Ok();
  // Grow in powers of two so a stream of slightly larger records does not reallocate each time.
  uint64_t size = std::max<uint64_t>(bytes, 64 * 1024);
  size = std::bit_ceil(size);
  ORBITKV_ASSIGN_OR_RETURN(AlignedBuffer grown, huge ? AlignedBuffer::CreateHugePageBacked(size)
                                                     : AlignedBuffer::Create(size, kRecordAlignment));
  *buffer = std::move(grown);
  return Status::Ok();
}

struct FileScan {
  std::vector<RecoveredRecord> records;
  std::vector<Extent> extents;
  ScanReport report;
  Status status;
};

// Walks one file: at each candidate offset, decodes a header from a 4 KiB read; a valid header
// skips to the end of its record, anything else moves on 4 KiB (gaps are read a window at a time).
FileScan ScanFile(Device& device, uint32_t file, bool verify) {
  FileScan scan;
  Result<AlignedBuffer> window = AlignedBuffer::Create(kScanWindowBytes, kRecordAlignment);
  if (!window.ok()) {
    scan.status = window.status();
    return scan;
  }
  AlignedBuffer record_buffer;
  uint64_t window_start = UINT64_MAX;  // file offset of window[0]
  uint64_t window_bytes = 0;
  uint64_t offset = 0;
  const uint64_t size = device.size();
  while (offset + kRecordAlignment <= size) {
    if (offset < window_start || offset + kRecordAlignment > window_start + window_bytes) {
      window_bytes = std::min(kScanWindowBytes, size - offset);
      Status read = device.Read(offset, window->span().first(window_bytes));
      if (!read.ok()) {
        scan.status =
            Status(read.code(), fmt::format("scanning file {} at offset {}: {}", file, offset, read.message()));
        return scan;
      }
      window_start = offset;
      scan.report.bytes_scanned += window_bytes;
    }
    const uint8_t* at = window->data() + (offset - window_start);
    uint32_t magic;
    std::memcpy(&magic, at, sizeof(magic));
    if (magic != kRecordMagic) {
      offset += kRecordAlignment;
      continue;
    }
    Result<RecordHeader> header = DecodeRecordHeader(std::span(at, kRecordHeaderBytes));
    if (!header.ok()) {
      if (header.status().code() == StatusCode::kFailedPrecondition) {
        ++scan.report.dropped_version;
        ORBITKV_LOG_INFO("ssd: dropping a record of another format version in file {} at {}: {}", file, offset,
                         header.status().message());
      }
      offset += kRecordAlignment;
      continue;
    }
    const uint64_t record_bytes = RecordBytes(header->payload_bytes);
    if (offset + record_bytes > size) {  // a header whose record cannot fit: stale or torn
      offset += kRecordAlignment;
      continue;
    }
    if (verify) {
      Status grown = EnsureCapacity(&record_buffer, record_bytes);
      Status read = grown.ok() ? device.Read(offset, record_buffer.span().first(record_bytes)) : grown;
      if (!read.ok()) {
        scan.status = read;
        return scan;
      }
      scan.report.bytes_scanned += record_bytes;
      if (!VerifyRecord(record_buffer.span().first(record_bytes)).ok()) {
        ++scan.report.dropped_corrupt;
        offset += kRecordAlignment;
        continue;
      }
    }
    scan.records.push_back(
        RecoveredRecord{header->key, SsdStore::PackLocator(file, offset), header->payload_bytes, header->write_epoch});
    scan.extents.push_back(Extent{file, offset, record_bytes});
    offset += record_bytes;
  }
  return scan;
}

}  // namespace

Result<std::unique_ptr<SsdStore>> SsdStore::Open(const SsdStoreOptions& options,
                                                 std::vector<RecoveredRecord>* recovered, ScanReport* report) {
  Stopwatch watch;
  recovered->clear();
  *report = ScanReport{};
  if (options.directory.empty()) return Status::InvalidArgument("the SSD tier needs a directory");
  uint32_t files = options.file_count;
  if (files == 0) {
    files = static_cast<uint32_t>(std::clamp<uint64_t>(options.capacity_bytes / (64 * kGiB), 1, 16));
  }
  if (files > 255) return Status::InvalidArgument("the SSD tier takes at most 255 files");
  const uint64_t per_file = options.capacity_bytes / files / 4096 * 4096;
  if (per_file < kMinFileBytes) {
    return Status::InvalidArgument(fmt::format("SSD capacity {} bytes over {} file(s) leaves less than 1 MiB per file",
                                               options.capacity_bytes, files));
  }
  std::error_code error;
  std::filesystem::create_directories(options.directory, error);
  if (error) {
    return Status::InvalidArgument(
        fmt::format("cannot create the SSD directory {}: {}", options.directory, error.message()));
  }
  std::vector<std::unique_ptr<Device>> devices;
  for (uint32_t i = 0; i < files; ++i) {
    const std::string path = fmt::format("{}/orbitkv-ssd-{}.data", options.directory, i);
    Result<std::unique_ptr<Device>> device = CreateDevice(path, per_file, options.backend);
    if (!device.ok()) {
      return Status(device.status().code(), fmt::format("SSD file {}: {}", path, device.status().message()));
    }
    if (options.wrap_device) device = options.wrap_device(std::move(*device));
    devices.push_back(std::move(device).value());
  }
  ORBITKV_ASSIGN_OR_RETURN(std::unique_ptr<ExtentAllocator> allocator,
                           ExtentAllocator::Create(std::vector<uint64_t>(files, per_file)));
  uint64_t max_epoch = 0;
  if (options.recover) {
    std::vector<FileScan> scans(files);
    std::vector<std::thread> threads;
    // One thread per file, at most 8 at a time; each holds one 1 MiB window (plus one record when
    // verifying).
    for (uint32_t begin = 0; begin < files; begin += 8) {
      threads.clear();
      for (uint32_t i = begin; i < std::min(files, begin + 8); ++i) {
        threads.emplace_back(
            [&scans, &devices, &options, i] { scans[i] = ScanFile(*devices[i], i, options.verify_on_open); });
      }
      for (std::thread& thread : threads) thread.join();
    }
    for (FileScan& scan : scans) {
      if (!scan.status.ok()) return scan.status;
      report->bytes_scanned += scan.report.bytes_scanned;
      report->dropped_version += scan.report.dropped_version;
      report->dropped_corrupt += scan.report.dropped_corrupt;
      for (size_t i = 0; i < scan.records.size(); ++i) {
        if (!allocator->MarkUsed(scan.extents[i]).ok()) {
          ++report->dropped_overlap;
          continue;
        }
        max_epoch = std::max(max_epoch, scan.records[i].write_epoch);
        report->payload_bytes += scan.records[i].payload_bytes;
        recovered->push_back(std::move(scan.records[i]));
      }
    }
    report->records = recovered->size();
  }
  report->seconds = watch.ElapsedSeconds();
  WriteStaging staging = options.write_staging;
  if (staging == WriteStaging::kAuto) {
    // Zero copy hands the disk each 4 KiB page of a pool block as its own segment (the pool's pages
    // are physically scattered). An NVMe drive walks such lists at full speed; a virtio disk's host
    // pays per segment, and copying into huge pages wins there. Without O_DIRECT the page cache
    // copies anyway.
    staging = devices.front()->direct_io() && BlockDeviceDriver(options.directory) == "virtio_blk"
                  ? WriteStaging::kCopy
                  : WriteStaging::kZeroCopy;
  }
  return std::unique_ptr<SsdStore>(new SsdStore(std::move(devices), std::move(allocator), max_epoch + 1, staging));
}

std::string_view WriteStagingName(WriteStaging staging) {
  switch (staging) {
    case WriteStaging::kAuto:
      return "auto";
    case WriteStaging::kCopy:
      return "copy";
    case WriteStaging::kZeroCopy:
      return "zero-copy";
  }
  return "?";
}

std::optional<WriteStaging> ParseWriteStaging(std::string_view text) {
  for (WriteStaging staging : {WriteStaging::kAuto, WriteStaging::kCopy, WriteStaging::kZeroCopy}) {
    if (text == WriteStagingName(staging)) return staging;
  }
  return std::nullopt;
}

SsdStore::~SsdStore() = default;

Result<SsdStore::Assembled> SsdStore::Assemble(const state::StateKey& key, std::span<const uint8_t> payload,
                                               AlignedBuffer* staging, uint64_t payload_capacity) {
  if (payload.empty() || payload.size() > kMaxRecordPayloadBytes) {
    return Status::InvalidArgument(fmt::format("an SSD record holds 1 byte to 1 GiB, not {}", payload.size()));
  }
  Assembled assembled;
  assembled.record_bytes = RecordBytes(payload.size());
  // In place when the payload's pages can go to the device as they are: aligned, and readable up
  // to the next 4 KiB boundary.
  assembled.in_place = write_staging_ == WriteStaging::kZeroCopy &&
                       reinterpret_cast<uintptr_t>(payload.data()) % kRecordAlignment == 0 &&
                       payload_capacity >= PaddedPayloadBytes(payload.size());
  ORBITKV_RETURN_IF_ERROR(EnsureCapacity(staging, assembled.in_place ? kRecordPayloadOffset : assembled.record_bytes,
                                         /*huge=*/write_staging_ == WriteStaging::kCopy));
  const uint64_t epoch = epoch_.fetch_add(1, std::memory_order_relaxed);
  const RecordHeader header{
      .key = key, .payload_bytes = payload.size(), .residence_generation = epoch, .write_epoch = epoch};
  if (assembled.in_place) {
    std::memset(staging->data(), 0, kRecordPayloadOffset);
    ORBITKV_RETURN_IF_ERROR(EncodeRecordHeader(header, payload, staging->span().first<kRecordHeaderBytes>()));
  } else {
    ORBITKV_RETURN_IF_ERROR(EncodeRecord(header, payload, staging->span().first(assembled.record_bytes)));
  }
  return assembled;
}

size_t SsdStore::WriteRequests(const Assembled& assembled, const Extent& extent, std::span<const uint8_t> payload,
                               AlignedBuffer* staging, IoRequest requests[2]) {
  if (!assembled.in_place) {
    requests[0] = {IoRequest::Op::kWrite, extent.offset, staging->span().first(assembled.record_bytes)};
    return 1;
  }
  // The device only reads write buffers.
  requests[0] = {IoRequest::Op::kWrite, extent.offset, staging->span().first(kRecordPayloadOffset)};
  requests[1] = {IoRequest::Op::kWrite, extent.offset + kRecordPayloadOffset,
                 std::span<uint8_t>(const_cast<uint8_t*>(payload.data()), PaddedPayloadBytes(payload.size()))};
  return 2;
}

Status SsdStore::WriteFailed(const Extent& extent, uint64_t record_bytes, const Status& status) {
  // Unavailable, not the device's code: a full file system (ENOSPC) must not read as "the store is
  // full, evict and retry".
  return Status::Unavailable(fmt::format("SSD write of {} bytes to file {} at {} failed: {}", record_bytes, extent.file,
                                         extent.offset, status.ToString()));
}

Result<uint64_t> SsdStore::Write(const state::StateKey& key, std::span<const uint8_t> payload, AlignedBuffer* staging,
                                 uint64_t payload_capacity) {
  ORBITKV_ASSIGN_OR_RETURN(const Assembled assembled, Assemble(key, payload, staging, payload_capacity));
  ORBITKV_ASSIGN_OR_RETURN(Extent extent, allocator_->Allocate(assembled.record_bytes));
  IoRequest requests[2];
  const size_t count = WriteRequests(assembled, extent, payload, staging, requests);
  Status written;
  for (Status& status : devices_[extent.file]->Submit({requests, count})) {
    if (!status.ok() && written.ok()) written = std::move(status);
  }
  if (!written.ok()) {
    allocator_->Release(extent);
    return WriteFailed(extent, assembled.record_bytes, written);
  }
  return PackLocator(extent.file, extent.offset);
}

Result<std::unique_ptr<SsdStore::Writer>> SsdStore::NewWriter(uint32_t depth) {
  std::vector<Device*> devices;
  for (const auto& device : devices_) devices.push_back(device.get());
  ORBITKV_ASSIGN_OR_RETURN(std::unique_ptr<IoQueue> queue,
                           CreateIoQueue(std::move(devices), depth, /*max_group_requests=*/2));
  return std::unique_ptr<Writer>(new Writer(this, std::move(queue), depth));
}

SsdStore::Writer::Writer(SsdStore* store, std::unique_ptr<IoQueue> queue, uint32_t depth)
    : store_(store), queue_(std::move(queue)), staging_(depth + 1) {
  for (size_t i = 0; i < staging_.size(); ++i) free_buffers_.push_back(i);
}

SsdStore::Writer::~Writer() {
  while (queue_->in_flight() > 0) {
    Result<Done> done = Wait();
    // Written but never handed out: nobody will publish it.
    if (done.ok() && done->locator.ok()) store_->Release(*done->locator, done->payload_bytes);
  }
  if (prepared_.has_value()) store_->allocator_->Release(prepared_->extent);
}

Status SsdStore::Writer::Prepare(const state::StateKey& key, std::span<const uint8_t> payload,
                                 uint64_t payload_capacity, uint64_t tag) {
  if (prepared_.has_value()) return Status::FailedPrecondition("a record is prepared already");
  // depth + 1 buffers: at most depth records in flight, and this one.
  ORBITKV_CHECK(!free_buffers_.empty());
  const size_t buffer = free_buffers_.back();
  AlignedBuffer* staging = &staging_[buffer];
  // The extent first: a full store is refused before the record is copied and checksummed.
  if (payload.empty() || payload.size() > kMaxRecordPayloadBytes) {
    return Status::InvalidArgument(fmt::format("an SSD record holds 1 byte to 1 GiB, not {}", payload.size()));
  }
  ORBITKV_ASSIGN_OR_RETURN(Extent extent, store_->allocator_->Allocate(RecordBytes(payload.size())));
  Result<Assembled> assembled = store_->Assemble(key, payload, staging, payload_capacity);
  if (!assembled.ok()) {
    store_->allocator_->Release(extent);
    return assembled.status();
  }
  free_buffers_.pop_back();
  Record record{.tag = tag, .extent = extent, .payload_bytes = payload.size(), .buffer = buffer};
  record.request_count = WriteRequests(*assembled, extent, payload, staging, record.requests);
  prepared_ = record;
  return Status::Ok();
}

Status SsdStore::Writer::Start() {
  if (!prepared_.has_value()) return Status::FailedPrecondition("no record is prepared");
  ORBITKV_RETURN_IF_ERROR(
      queue_->Start(prepared_->extent.file, {prepared_->requests, prepared_->request_count}, prepared_->tag));
  started_.push_back(*prepared_);
  prepared_.reset();
  return Status::Ok();
}

Result<SsdStore::Writer::Done> SsdStore::Writer::Wait() {
  ORBITKV_ASSIGN_OR_RETURN(const IoQueue::Completion completion, queue_->Wait());
  auto it = std::find_if(started_.begin(), started_.end(),
                         [&](const Record& record) { return record.tag == completion.tag; });
  ORBITKV_CHECK_MSG(it != started_.end(), "completion of unknown record {}", completion.tag);
  const Record record = *it;
  started_.erase(it);
  free_buffers_.push_back(record.buffer);
  Done done{.tag = record.tag,
            .payload_bytes = record.payload_bytes,
            .locator = PackLocator(record.extent.file, record.extent.offset)};
  if (!completion.status.ok()) {
    store_->allocator_->Release(record.extent);
    done.locator = WriteFailed(record.extent, RecordBytes(record.payload_bytes), completion.status);
  }
  return done;
}

Status SsdStore::ReadInto(const state::StateKey& key, uint64_t locator, uint64_t payload_bytes, AlignedBuffer* staging,
                          std::span<uint8_t> destination) {
  const uint32_t file = LocatorFile(locator);
  if (file >= devices_.size() || payload_bytes == 0 || payload_bytes > kMaxRecordPayloadBytes) {
    return Status::InvalidArgument("not a locator of this store");
  }
  const uint64_t padded = PaddedPayloadBytes(payload_bytes);
  if (reinterpret_cast<uintptr_t>(destination.data()) % kRecordAlignment != 0 || destination.size() < padded) {
    // Not page-aligned memory: read through the staging buffer and copy.
    ORBITKV_ASSIGN_OR_RETURN(std::span<const uint8_t> payload, Read(key, locator, payload_bytes, staging));
    if (destination.size() < payload_bytes) {
      return Status::InvalidArgument("the destination is smaller than the payload");
    }
    std::memcpy(destination.data(), payload.data(), payload_bytes);
    return Status::Ok();
  }
  ORBITKV_RETURN_IF_ERROR(EnsureCapacity(staging, kRecordPayloadOffset));
  const uint64_t offset = LocatorOffset(locator);
  const IoRequest requests[2] = {{IoRequest::Op::kRead, offset, staging->span().first(kRecordPayloadOffset)},
                                 {IoRequest::Op::kRead, offset + kRecordPayloadOffset, destination.first(padded)}};
  for (const Status& status : devices_[file]->Submit(requests)) {
    ORBITKV_RETURN_IF_ERROR(status);
  }
  Result<RecordHeader> header =
      VerifyRecordParts(staging->span().first(kRecordPayloadOffset), destination.first(payload_bytes));
  if (!header.ok()) {
    return Status::DataLoss(
        fmt::format("SSD record in file {} at {} is not intact: {}", file, offset, header.status().message()));
  }
  if (header->key != key || header->payload_bytes != payload_bytes) {
    return Status::DataLoss(
        fmt::format("SSD record in file {} at {} belongs to another block (the extent was reused)", file, offset));
  }
  return Status::Ok();
}

Result<std::span<const uint8_t>> SsdStore::Read(const state::StateKey& key, uint64_t locator, uint64_t payload_bytes,
                                                AlignedBuffer* staging) {
  const uint32_t file = LocatorFile(locator);
  if (file >= devices_.size() || payload_bytes == 0 || payload_bytes > kMaxRecordPayloadBytes) {
    return Status::InvalidArgument("not a locator of this store");
  }
  const uint64_t record_bytes = RecordBytes(payload_bytes);
  ORBITKV_RETURN_IF_ERROR(EnsureCapacity(staging, record_bytes));
  std::span<uint8_t> record = staging->span().first(record_bytes);
  ORBITKV_RETURN_IF_ERROR(devices_[file]->Read(LocatorOffset(locator), record));
  Result<RecordHeader> header = VerifyRecord(record);
  if (!header.ok()) {
    return Status::DataLoss(fmt::format("SSD record in file {} at {} is not intact: {}", file, LocatorOffset(locator),
                                        header.status().message()));
  }
  if (header->key != key || header->payload_bytes != payload_bytes) {
    return Status::DataLoss(fmt::format("SSD record in file {} at {} belongs to another block (the extent was reused)",
                                        file, LocatorOffset(locator)));
  }
  return std::span<const uint8_t>(record.data() + kRecordPayloadOffset, payload_bytes);
}

void SsdStore::ReadBatch(std::span<BatchRead> reads, AlignedBuffer* staging) {
  if (reads.empty()) return;
  Status grown = EnsureCapacity(staging, reads.size() * kRecordPayloadOffset);
  std::vector<size_t> order;
  for (size_t i = 0; i < reads.size(); ++i) {
    BatchRead& read = reads[i];
    const uint32_t file = LocatorFile(read.locator);
    if (!grown.ok()) {
      read.status = grown;
    } else if (file >= devices_.size() || read.payload_bytes == 0 || read.payload_bytes > kMaxRecordPayloadBytes) {
      read.status = Status::InvalidArgument("not a locator of this store");
    } else if (reinterpret_cast<uintptr_t>(read.destination.data()) % kRecordAlignment != 0 ||
               read.destination.size() < PaddedPayloadBytes(read.payload_bytes)) {
      read.status = Status::InvalidArgument("a batch read needs page-aligned room for the payload");
    } else {
      read.status = Status::Ok();
      order.push_back(i);
    }
  }
  // By file, then offset.
  std::sort(order.begin(), order.end(), [&reads](size_t a, size_t b) {
    return std::pair(LocatorFile(reads[a].locator), LocatorOffset(reads[a].locator)) <
           std::pair(LocatorFile(reads[b].locator), LocatorOffset(reads[b].locator));
  });
  std::vector<IoRequest> requests;
  for (size_t begin = 0; begin < order.size();) {
    const uint32_t file = LocatorFile(reads[order[begin]].locator);
    size_t end = begin;
    requests.clear();
    while (end < order.size() && LocatorFile(reads[order[end]].locator) == file) {
      BatchRead& read = reads[order[end]];
      const uint64_t offset = LocatorOffset(read.locator);
      requests.push_back({IoRequest::Op::kRead, offset,
                          staging->span().subspan(order[end] * kRecordPayloadOffset, kRecordPayloadOffset)});
      requests.push_back({IoRequest::Op::kRead, offset + kRecordPayloadOffset,
                          read.destination.first(PaddedPayloadBytes(read.payload_bytes))});
      ++end;
    }
    const std::vector<Status> done = devices_[file]->Submit(requests);
    for (size_t k = begin; k < end; ++k) {
      BatchRead& read = reads[order[k]];
      const size_t r = 2 * (k - begin);
      if (!done[r].ok() || !done[r + 1].ok()) {
        read.status = done[r].ok() ? done[r + 1] : done[r];
        continue;
      }
      Result<RecordHeader> header =
          VerifyRecordParts(staging->span().subspan(order[k] * kRecordPayloadOffset, kRecordPayloadOffset),
                            read.destination.first(read.payload_bytes));
      const uint64_t offset = LocatorOffset(read.locator);
      if (!header.ok()) {
        read.status = Status::DataLoss(
            fmt::format("SSD record in file {} at {} is not intact: {}", file, offset, header.status().message()));
      } else if (header->key != *read.key || header->payload_bytes != read.payload_bytes) {
        read.status = Status::DataLoss(
            fmt::format("SSD record in file {} at {} belongs to another block (the extent was reused)", file, offset));
      }
    }
    begin = end;
  }
}

Status SsdStore::RegisterMemory(std::span<const std::span<uint8_t>> regions) {
  for (const std::unique_ptr<Device>& device : devices_) {
    ORBITKV_RETURN_IF_ERROR(device->RegisterMemory(regions));
  }
  return Status::Ok();
}

uint64_t SsdStore::registered_requests() const {
  uint64_t total = 0;
  for (const std::unique_ptr<Device>& device : devices_) total += device->registered_requests();
  return total;
}

void SsdStore::Release(uint64_t locator, uint64_t payload_bytes) {
  allocator_->Release(Extent{LocatorFile(locator), LocatorOffset(locator), RecordBytes(payload_bytes)});
}

}  // namespace orbitkv::storage
