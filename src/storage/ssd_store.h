// SsdStore: the SSD tier's bytes. One or more preallocated files under a directory, holding
// self-describing records (record.h) at extents handed out by an ExtentAllocator.
//
// The store knows records, not residences: Write() reserves an extent (capacity is reserved before
// a byte is written), writes the record and returns its locator; Read() reads a record back and
// verifies it (magic, version, key, size, checksum) before a byte reaches the caller; Release()
// returns an extent. The SSD tier (core/ssd_tier.h) decides what is written, publishes residences
// and owns the mapping from keys to locators, so it is the only caller of Release().
//
// Restart: Open() scans every file for record headers (one thread per file, bounded memory: a
// record start costs one 4 KiB read, a gap is read in 1 MiB windows), claims the extents of the
// records it keeps and returns them; with `verify_on_open` each record is read whole and its
// checksum checked (eager); otherwise checksums are checked when a record is read (lazy). A record
// of another format version is dropped with a log line; when two records claim the same bytes, the
// first one found is kept and the other dropped (whichever is torn fails its checksum on read and
// becomes a miss). `recover = false` discards every record (the files are kept, their contents
// ignored).
//
// A locator packs (file index, offset / 4096) into 64 bits; it is only meaningful with the payload
// size recorded beside it.
//
// Thread safety: every method may be called from any number of threads at once. Reads and writes of
// different extents run in parallel; a read racing with the reuse of its extent reads another
// record (or a torn one) and fails verification: it never returns wrong bytes.
#ifndef ORBITKV_STORAGE_SSD_STORE_H_
#define ORBITKV_STORAGE_SSD_STORE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/result.h"
#include "base/status.h"
#include "state/state_key.h"
#include "storage/aligned_buffer.h"
#include "storage/device.h"
#include "storage/extent_allocator.h"

namespace orbitkv::storage {

// How records reach the disk (see SsdStore::Write).
enum class WriteStaging : uint8_t {
  kAuto,  // kCopy on a virtio disk with O_DIRECT, kZeroCopy elsewhere
  kCopy,
  kZeroCopy,
};
std::string_view WriteStagingName(WriteStaging staging);  // "auto", "copy", "zero-copy"
std::optional<WriteStaging> ParseWriteStaging(std::string_view text);

struct SsdStoreOptions {
  std::string directory;        // created if missing
  uint64_t capacity_bytes = 0;  // over all files; rounded down to 4 KiB per file
  uint32_t file_count = 0;      // 0: one file per 64 GiB of capacity, 1..16
  DeviceBackend backend = DeviceBackend::kAuto;
  bool recover = true;          // false: start empty (the seeds' behaviour)
  bool verify_on_open = false;  // eager checksums during the scan
  WriteStaging write_staging = WriteStaging::kAuto;
  // Test seam: wraps each file's device (a fault-injecting decorator); null in a Manager.
  std::function<std::unique_ptr<Device>(std::unique_ptr<Device>)> wrap_device;
};

// A record found by the restart scan.
struct RecoveredRecord {
  state::StateKey key;
  uint64_t locator = 0;
  uint64_t payload_bytes = 0;
  uint64_t write_epoch = 0;
};

struct ScanReport {
  uint64_t records = 0;          // kept
  uint64_t payload_bytes = 0;    // of the kept records
  uint64_t dropped_version = 0;  // another format version
  uint64_t dropped_corrupt = 0;  // failed the eager checksum
  uint64_t dropped_overlap = 0;  // claimed bytes another record already claimed
  uint64_t bytes_scanned = 0;
  double seconds = 0;
};

class SsdStore {
 public:
  // Creates or opens the files `<directory>/orbitkv-ssd-<i>.data` and scans them (see above).
  // InvalidArgument for a capacity below 1 MiB per file or an unusable directory; the device's
  // errors (ResourceExhausted when preallocation hits ENOSPC).
  static Result<std::unique_ptr<SsdStore>> Open(const SsdStoreOptions& options, std::vector<RecoveredRecord>* recovered,
                                                ScanReport* report);
  ~SsdStore();
  SsdStore(const SsdStore&) = delete;
  SsdStore& operator=(const SsdStore&) = delete;

  // Writes `payload` as the record of `key` and returns its locator. `staging` is the caller's
  // scratch buffer (grown as needed; reusing one per thread avoids an allocation per write).
  // ResourceExhausted when the store is full (the caller may free space and retry); Unavailable
  // when the device failed the write (EIO, ENOSPC of the file system), and the extent is released
  // again.
  // When `payload` starts on a 4 KiB boundary and `payload_capacity` (the bytes readable there)
  // covers it rounded up to 4 KiB, and the store writes zero copy, the payload goes to the device as
  // it is (the DRAM pool's blocks qualify) and `staging` holds only the header page. Otherwise the
  // record is assembled in `staging` and checksummed there; a store that copies makes `staging`
  // huge-page backed, so the record is one physically contiguous DMA segment rather than one per
  // 4 KiB page of the pool (a virtio disk pays per segment: about 20% of its write throughput).
  Result<uint64_t> Write(const state::StateKey& key, std::span<const uint8_t> payload, AlignedBuffer* staging,
                         uint64_t payload_capacity = 0);

  // Writes records asynchronously for one thread: a record is prepared (its extent reserved, the
  // record assembled and checksummed as Write() does, in one of the writer's own staging buffers),
  // then started, and its locator comes back from Wait(). With a record prepared while `depth`
  // others are at the disk, the disk never waits for the CPU (see Start()).
  //
  // Thread safety: one thread at a time; the store outlives its writers. Payloads written in place
  // must stay valid until Wait() returns their record.
  class Writer {
   public:
    struct Done {
      uint64_t tag = 0;
      uint64_t payload_bytes = 0;
      // The locator, or Unavailable with the extent released again (as Write()).
      Result<uint64_t> locator;
    };
    // Waits for the writes in flight and releases every extent not handed out by Wait().
    ~Writer();
    Writer(const Writer&) = delete;
    Writer& operator=(const Writer&) = delete;

    uint32_t depth() const { return queue_->depth(); }
    size_t in_flight() const { return queue_->in_flight(); }
    bool has_prepared() const { return prepared_.has_value(); }

    // Prepares `payload`'s record under `tag`, which no other record of this writer in flight may
    // carry (see Write() for `payload_capacity` and the errors
    // before the device: InvalidArgument; ResourceExhausted when the store is full).
    // FailedPrecondition when a record is prepared already.
    Status Prepare(const state::StateKey& key, std::span<const uint8_t> payload, uint64_t payload_capacity,
                   uint64_t tag);
    // Starts the prepared record's write. FailedPrecondition without a prepared record or with
    // depth() writes in flight.
    Status Start();
    // Blocks until a started write finished and returns it; FailedPrecondition when none is in
    // flight.
    Result<Done> Wait();

   private:
    friend class SsdStore;
    struct Record {
      uint64_t tag = 0;
      Extent extent;
      uint64_t payload_bytes = 0;
      size_t buffer = 0;  // staging_ index
      IoRequest requests[2];
      size_t request_count = 0;
    };
    Writer(SsdStore* store, std::unique_ptr<IoQueue> queue, uint32_t depth);

    SsdStore* const store_;
    const std::unique_ptr<IoQueue> queue_;
    std::vector<AlignedBuffer> staging_;  // depth + 1: one per write in flight and the prepared one
    std::vector<size_t> free_buffers_;
    std::optional<Record> prepared_;
    std::vector<Record> started_;
  };
  // A writer keeping up to `depth` records at the disk. The io_uring ring's setup error.
  Result<std::unique_ptr<Writer>> NewWriter(uint32_t depth);

  // Reads the record at `locator` into `staging` and returns its payload (a view into `staging`,
  // valid until the next use of it). DataLoss when the bytes there are not an intact record of
  // `key` with `payload_bytes` bytes (torn, corrupted, or the extent was reused); the device's
  // error for a failed read.
  Result<std::span<const uint8_t>> Read(const state::StateKey& key, uint64_t locator, uint64_t payload_bytes,
                                        AlignedBuffer* staging);

  // Reads the record's payload straight into `destination` (zero copy when it starts on a 4 KiB
  // boundary and holds the payload rounded up to 4 KiB, else through `staging`) and verifies it.
  // The errors of Read(); on an error `destination` holds unspecified bytes.
  Status ReadInto(const state::StateKey& key, uint64_t locator, uint64_t payload_bytes, AlignedBuffer* staging,
                  std::span<uint8_t> destination);

  // One record to read by ReadBatch.
  struct BatchRead {
    const state::StateKey* key = nullptr;
    uint64_t locator = 0;
    uint64_t payload_bytes = 0;
    std::span<uint8_t> destination;  // page-aligned, at least the payload rounded up to 4 KiB
    Status status;                   // set by ReadBatch
  };
  // Reads several records at once, like ReadInto each: the reads of one file go to its device as
  // one batch in offset order, so adjacent records are read back to back (and merged by the block
  // layer) rather than one round trip each. Each read gets its own status; a destination that is
  // not page-aligned or too small is InvalidArgument for that read alone.
  void ReadBatch(std::span<BatchRead> reads, AlignedBuffer* staging);

  // Registers memory that payloads are written from and read into (the DRAM pool's arenas) with
  // every file's device (io_uring fixed buffers; see Device::RegisterMemory).
  Status RegisterMemory(std::span<const std::span<uint8_t>> regions);
  // Requests that ran on registered memory, over all files.
  uint64_t registered_requests() const;

  // Returns the extent of the record at `locator` (payload size as written).
  void Release(uint64_t locator, uint64_t payload_bytes);

  uint64_t capacity_bytes() const { return allocator_->capacity_bytes(); }
  uint64_t allocated_bytes() const { return allocator_->allocated_bytes(); }
  size_t file_count() const { return devices_.size(); }
  std::string_view backend_name() const { return devices_.front()->backend_name(); }
  // kCopy or kZeroCopy: what kAuto resolved to.
  WriteStaging write_staging() const { return write_staging_; }
  bool direct_io() const { return devices_.front()->direct_io(); }

  static uint64_t PackLocator(uint32_t file, uint64_t offset) { return (offset / 4096) << 8 | file; }
  static uint32_t LocatorFile(uint64_t locator) { return static_cast<uint32_t>(locator & 0xff); }
  static uint64_t LocatorOffset(uint64_t locator) { return (locator >> 8) * 4096; }

 private:
  SsdStore(std::vector<std::unique_ptr<Device>> devices, std::unique_ptr<ExtentAllocator> allocator,
           uint64_t first_epoch, WriteStaging write_staging)
      : devices_(std::move(devices)),
        allocator_(std::move(allocator)),
        write_staging_(write_staging),
        epoch_(first_epoch) {}

  // A record assembled in `staging` for `payload`, and the requests that write it once an extent
  // is reserved.
  struct Assembled {
    uint64_t record_bytes = 0;
    bool in_place = false;  // the payload goes to the device from where it is
  };
  Result<Assembled> Assemble(const state::StateKey& key, std::span<const uint8_t> payload, AlignedBuffer* staging,
                             uint64_t payload_capacity);
  // Fills `requests` (two in place: header page, payload; else one) and returns how many.
  static size_t WriteRequests(const Assembled& assembled, const Extent& extent, std::span<const uint8_t> payload,
                              AlignedBuffer* staging, IoRequest requests[2]);
  static Status WriteFailed(const Extent& extent, uint64_t record_bytes, const Status& status);

  // Immutable after Open.
  const std::vector<std::unique_ptr<Device>> devices_;
  const std::unique_ptr<ExtentAllocator> allocator_;
  const WriteStaging write_staging_;  // kCopy or kZeroCopy

  // Relaxed: only uniqueness and monotonicity per store matter, not ordering with other memory.
  std::atomic<uint64_t> epoch_;
};

}  // namespace orbitkv::storage

#endif  // ORBITKV_STORAGE_SSD_STORE_H_
