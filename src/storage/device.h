// Device: the seam between the SSD tier and the bytes on a disk, in the shape of CacheLib navy's
// Device.
//
// A device is a flat range of `size()` bytes that is read and written at offsets and lengths that
// are multiples of `io_alignment()`, from buffers whose address is aligned the same way (O_DIRECT's
// rules). The public methods validate every request and pass only valid ones to the backend; a
// request that fails validation gets its own error and is never submitted. Submit() runs a batch
// and blocks until every submitted request has completed, with one Status per request: a failed or
// short transfer fails that request only.
//
// Backends: PsyncDevice (pread/pwrite on the caller's thread) and UringDevice (io_uring, bounded
// queue depth). CreateDevice() preallocates the backing file and picks a backend. An IoQueue keeps
// requests in flight asynchronously, for a caller that prepares its next request meanwhile.
//
// Thread safety: every method may be called from any number of threads at once. Requests that
// overlap in the file and run concurrently have no defined order; the caller (the store's slot
// allocator) keeps them apart.
#ifndef ORBITKV_STORAGE_DEVICE_H_
#define ORBITKV_STORAGE_DEVICE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/result.h"
#include "base/status.h"

namespace orbitkv::storage {

struct IoRequest {
  enum class Op : uint8_t { kRead, kWrite };
  Op op = Op::kRead;
  uint64_t offset = 0;
  // Read: filled with the bytes at [offset, offset + size). Write: its bytes are written there (not
  // modified). The caller keeps the memory alive until Submit() returns.
  std::span<uint8_t> buffer;
};

class Device {
 public:
  virtual ~Device() = default;
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  uint64_t size() const { return size_; }
  uint32_t io_alignment() const { return io_alignment_; }
  // "io_uring" or "psync", for logs and the configuration summary.
  virtual std::string_view backend_name() const = 0;
  // Whether the file was opened with O_DIRECT (false where the file system refused it, e.g. tmpfs).
  virtual bool direct_io() const = 0;

  // Runs every request and blocks until all have completed. Returns one Status per request, in
  // order: InvalidArgument for a misaligned offset, length or buffer address or an empty buffer;
  // OutOfRange for a range past size(); DataLoss for a short transfer; the errno-derived Status
  // (ResourceExhausted for ENOSPC, DataLoss for EIO, ...) for a failed one.
  std::vector<Status> Submit(std::span<const IoRequest> requests);

  // Registers long-lived memory that requests will use as buffers (the DRAM pool's arenas), so a
  // backend that can (io_uring: fixed buffers) skips mapping the pages on every request. Requests
  // whose buffer lies inside a registered region use it; others run unregistered. Replaces any
  // earlier registration; the memory must stay valid until the device is destroyed or registers
  // again. OK when the backend has nothing to register (psync) or registration was refused (logged
  // once: requests then run unregistered).
  virtual Status RegisterMemory(std::span<const std::span<uint8_t>> regions) {
    (void)regions;
    return Status::Ok();
  }
  // Requests that ran on registered memory so far (tests, metrics).
  virtual uint64_t registered_requests() const { return 0; }

  // Single-request conveniences over Submit().
  Status Read(uint64_t offset, std::span<uint8_t> out);
  Status Write(uint64_t offset, std::span<const uint8_t> data);

  // The check Submit() applies to each request (see there): OK, InvalidArgument or OutOfRange.
  Status Validate(const IoRequest& request) const;

 protected:
  Device(uint64_t size, uint32_t io_alignment) : size_(size), io_alignment_(io_alignment) {}

  // Runs the requests whose index is in `valid` (all already validated) and stores each one's
  // outcome in `statuses[index]`. Must not return before every submitted request has completed.
  virtual void DoSubmit(std::span<const IoRequest> requests, std::span<const size_t> valid,
                        std::span<Status> statuses) = 0;

 private:
  // Immutable after construction.
  const uint64_t size_;
  const uint32_t io_alignment_;
};

// IoQueue: requests kept in flight from one thread, so its caller can prepare the next request while
// earlier ones run (fio's model: the disk always has `depth` requests). Requests are started in
// groups (a record's header page and payload) on any of the queue's devices; a group completes when
// all its requests have, with the first failure as its status (as Device::Submit reports it).
//
// Over io_uring devices the queue is one ring of its own, using the devices' registered memory as
// it was when the queue was created; otherwise Start() runs the group before returning.
//
// Thread safety: one thread at a time. The destructor waits for the groups still in flight (their
// buffers are in use until then).
class IoQueue {
 public:
  struct Completion {
    uint64_t tag = 0;
    Status status;
  };
  virtual ~IoQueue() = default;
  IoQueue(const IoQueue&) = delete;
  IoQueue& operator=(const IoQueue&) = delete;

  uint32_t depth() const { return depth_; }
  uint32_t max_group_requests() const { return max_group_requests_; }
  size_t in_flight() const { return in_flight_; }

  // Starts `requests` on devices[device] as one group carrying `tag`; their buffers must stay valid
  // until Wait() returns the group. Nothing is started on an error: InvalidArgument or OutOfRange
  // for a request Device::Validate refuses, an unknown device, or an empty or too large group;
  // FailedPrecondition when depth() groups are in flight.
  Status Start(size_t device, std::span<const IoRequest> requests, uint64_t tag);
  // Blocks until a started group has completed and returns it (in completion order);
  // FailedPrecondition when none is in flight.
  Result<Completion> Wait();

 protected:
  IoQueue(std::vector<Device*> devices, uint32_t depth, uint32_t max_group_requests)
      : devices_(std::move(devices)), depth_(depth), max_group_requests_(max_group_requests) {}
  // `requests` are valid and fit; the group is not in flight yet.
  virtual void DoStart(size_t device, std::span<const IoRequest> requests, uint64_t tag) = 0;
  // Called only with a group in flight.
  virtual Completion DoWait() = 0;

  // Immutable after construction.
  const std::vector<Device*> devices_;
  const uint32_t depth_;
  const uint32_t max_group_requests_;

 private:
  size_t in_flight_ = 0;
};

// A queue over `devices` (one store's files, all kept alive longer than the queue) for at most
// `depth` groups of at most `max_group_requests` requests each. InvalidArgument for no devices or a
// zero depth or group size; the ring's setup error.
Result<std::unique_ptr<IoQueue>> CreateIoQueue(std::vector<Device*> devices, uint32_t depth,
                                               uint32_t max_group_requests);

enum class DeviceBackend : uint8_t { kAuto, kIoUring, kPsync };
std::string_view DeviceBackendName(DeviceBackend backend);  // "auto", "io_uring", "psync"
std::optional<DeviceBackend> ParseDeviceBackend(std::string_view text);

// Whether this build has the io_uring backend (liburing found at configure time).
bool IoUringCompiledIn();

// Opens (creating if needed) the file at `path`, preallocates `bytes` bytes, and wraps it in a
// device. kAuto picks io_uring when a ring can be set up and completes a probe read, otherwise
// psync with a log line; kIoUring fails (Unimplemented when not compiled in, or the setup error)
// instead of falling back. InvalidArgument unless `bytes` is a non-zero multiple of 4096;
// ResourceExhausted when the preallocation hits ENOSPC; the errno-derived Status when the file
// cannot be opened.
Result<std::unique_ptr<Device>> CreateDevice(const std::string& path, uint64_t bytes, DeviceBackend backend);

// The kernel driver of the block device holding `path` ("virtio_blk", "sd", ...; the whole disk's
// when the file system sits on a partition), or "" where there is none to name: tmpfs, overlay,
// device-mapper, or a layout sysfs does not show.
std::string BlockDeviceDriver(const std::string& path);

}  // namespace orbitkv::storage

#endif  // ORBITKV_STORAGE_DEVICE_H_
