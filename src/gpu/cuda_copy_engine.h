// CudaCopyEngine: the CopyEngine that moves KV bytes between engine-owned GPU memory and the pinned
// host pool, one batch at a time: small fragments through one gather/scatter kernel per batch,
// large ones through the GPU's copy engines (cudaMemcpyBatchAsync), whichever measured faster;
// optionally, restores of small fragments from long runs of pool memory through a device ring.
//
// Engine buffers are GPU memory: imported from another process through a CUDA IPC memory handle
// (RegisterIpcBuffer, the engine adapters' path; the mapping is opened once per registration) or,
// in this process, named by a device pointer (RegisterDeviceBuffer, for tests and benchmarks). The
// pool side of every fragment must lie in host memory registered with the HostMemoryRegistry given
// at Create() (the pool's ArenaRegistrar), which maps the pool into the GPUs' address space: the
// kernel reads (restore) or writes (save) the pool in place across the link, so each byte crosses
// PCIe once. A staged restore also crosses the link once: into the ring, then device to device.
//
// Data path: Submit() validates and resolves the batch (every fragment names a live buffer of one
// device; the pool range is registered), pins its buffers and hands it to the lane of its device
// and direction. Each lane owns streams and two threads. The dispatcher issues each batch on the
// lane's next stream, either as one kernel launch (it cuts the fragments into chunks of at most
// `chunk_bytes`, smaller for a small batch so that every warp of the grid gets work, and writes the
// chunk descriptors to mapped pinned staging memory that the kernel reads in place) or as
// cudaMemcpyBatchAsync calls (Method, below), then records the batch's event. The completer waits
// for the events in launch order and, on its own thread (never on a CUDA callback thread), calls
// the batch's CopyDone, unpins the buffers and frees the in-flight slot. Saves and restores use
// different lanes, so they overlap on the link's two directions.
//
// Invariants: a buffer is pinned once per fragment of every in-flight batch that names it, and a
// pinned buffer stays registered and mapped (UnregisterBuffer waits), so the dispatcher uses the
// addresses resolved at Submit without the registry lock. At most `max_inflight_batches` batches
// are in flight (accepted, CopyDone not yet returned). A staging area (descriptor arrays and event)
// belongs to one launched batch until the completer saw its event.
//
// Errors: a launch or device failure is reported to the batch's CopyDone (Internal, with CUDA's
// error); a device fault is sticky in CUDA, so every later batch on that device fails too.
//
// Thread safety: every public method may be called from any thread. Submit() may also be called
// from a CopyDone; UnregisterBuffer() and Shutdown() must not be (they wait for batches to
// complete; a CHECK catches the call from a lane thread). Threads are created in Create() and
// joined in Shutdown() or the destructor. Register*Buffer() and UnregisterBuffer() change the
// calling thread's current device only for their own duration.
#ifndef ORBITKV_GPU_CUDA_COPY_ENGINE_H_
#define ORBITKV_GPU_CUDA_COPY_ENGINE_H_

#include <cuda_runtime_api.h>

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <thread>
#include <vector>

#include "base/metrics.h"
#include "base/mutex.h"
#include "base/result.h"
#include "base/status.h"
#include "base/thread_annotations.h"
#include "core/copy_engine.h"
#include "gpu/copy_kernels.h"
#include "gpu/host_memory_registry.h"

namespace orbitkv::gpu {

class CudaCopyEngine final : public core::CopyEngine {
 public:
  enum class Method : uint8_t {
    // Per batch: cudaMemcpyBatchAsync when its fragments average at least
    // `dma_min_fragment_bytes` (the copy engines reach the link's peak there, in both directions at
    // once), else the kernel (2-10 times faster than the copy engines on small fragments). The
    // kernel alone on a driver older than CUDA 12.8. See docs/gpu.md.
    kAuto = 0,
    // One gather/scatter kernel per batch over the chunk descriptors.
    kKernel = 1,
    // cudaMemcpyBatchAsync, one copy per fragment, in calls of up to 256 copies (CUDA 12.8 or
    // later).
    kMemcpyBatch = 2,
  };

  static constexpr uint64_t kMinChunkBytes = uint64_t{4} << 10;

  struct Options {
    // The devices this engine serves (buffers on other devices are refused); empty means every
    // visible device.
    std::vector<int> devices;
    // Batches in flight before Submit() returns ResourceExhausted; at least 1.
    uint32_t max_inflight_batches = 64;
    // The most bytes one warp copies as one unit: a power of two in [kMinChunkBytes,
    // kMaxChunkBytes]. Larger fragments are cut into chunks of this size; a batch smaller than
    // chunk_bytes x warps of the grid gets smaller chunks (powers of two, at least kMinChunkBytes),
    // so that every warp gets work and chunks stay aligned as the fragments are.
    uint64_t chunk_bytes = uint64_t{64} << 10;
    // Blocks of the copy kernel per multiprocessor, in [1, kMaxBlocksPerSm]; a batch with fewer
    // chunks launches fewer blocks. Bounds the share of the GPU a copy takes from the model.
    uint32_t blocks_per_sm = 2;
    // Streams per device and direction, in [1, kMaxStreamsPerLane]. Consecutive batches take turns,
    // so one batch's launch and tail overlap the next batch's copy.
    uint32_t streams_per_lane = 2;
    Method method = Method::kAuto;
    // kAuto's threshold (average fragment bytes of a batch) for the copy engines; at least 1.
    uint64_t dma_min_fragment_bytes = uint64_t{64} << 10;
    // kAuto's staged restores: a restore of small fragments whose pool side comes in long runs of
    // adjacent memory (a block holds every layer's pages back to back) goes through a ring of
    // device memory: the copy engines move the runs into the ring at the link's peak, and the
    // kernel scatters them from there into the pages, device to device. The ring's bytes per device
    // (kStagingSlots slots; a multiple of kStagingSlots x 4 KiB; 0: no ring), allocated on the GPU
    // at Create (a device without room for it restores through the kernel alone, with a warning).
    // Each slot's runs go to the copy engines in one cudaMemcpyBatchAsync call (CUDA 12.8; else
    // one cudaMemcpyAsync per run). 64 MiB: 16 MiB slots, where a ring restores whole blocks at
    // 0.99 of the link's peak on the H200 and the kernel stops at 0.93 (docs/gpu.md).
    uint64_t restore_staging_bytes = uint64_t{64} << 20;
    // The average run of adjacent pool bytes from which a restore is staged; at least 1.
    uint64_t staged_min_run_bytes = uint64_t{1} << 20;
    // Restores whose fragments average less than this are staged (when their pool runs qualify)
    // also where dma_min_fragment_bytes would give them to the copy engines fragment by fragment
    // (where the kernel would copy them, they are staged whatever their size):
    // whole blocks of 64 KiB pages (an async restore of a Qwen3-8B-shaped model: 2.25 MiB runs)
    // fill a 16 MiB slot in one call at 0.99 of the link in the ring model, against 0.92-0.93 for
    // 64 KiB copies 256 to a call; from 256 KiB the copy engines reach 0.95-0.96 copy by copy
    // (docs/gpu.md). At least 1.
    uint64_t staged_max_fragment_bytes = uint64_t{256} << 10;
    // A batch of at least this many fragments (and more than kFirstPartFragments) goes to its lane
    // in parts (kFirstPartFragments, then up to kSecondPartEnd, the rest in even parts, of at
    // least kPartFragments each when there are that many, kMaxParts in all), each resolved and queued
    // while the lane copies the ones ahead, so the GPU starts after the first part's Submit work
    // rather than the whole batch's (25-49 ns a fragment on the GPU hosts: 0.1-0.2 ms for 4096,
    // 0.55 ms for an 8K-token Qwen3-8B restore of 18432 fragments); each part is resolved in less
    // time than the parts ahead of it take to copy. One CopyDone and one batch in the metrics
    // still; a bad fragment past the first part fails the batch through its CopyDone (after the
    // parts ahead drained) instead of Submit. 0: batches go whole. On the H200 a 32768-fragment
    // restore moved 52.0 GB/s in parts against 48.0 whole (docs/gpu.md).
    uint64_t split_min_fragments = uint64_t{4096};
    // How the completer waits for a batch's end. 0: it blocks in cudaEventSynchronize (an
    // interrupt, then a thread wake-up). Else, once a batch of 8 MiB or more launched on the idle
    // lane showed the lane's rate (until then it blocks), it sleeps in steps of at most this many
    // microseconds until this long before the earliest the batch should end (its bytes at up to
    // 10% above the fastest rate such batches ran at, from when it could start), then polls the
    // event, yielding, and blocks after polling for 2 ms or a quarter of its expected time. On an
    // H100 (2026-12-05, gpu_bench) a 512 MiB pass of restores ended 0.16-0.17 ms after its last
    // copy when blocking and 0.02 ms when polling (restores 53.0 against 51.8 GB/s at 16 KiB).
    uint32_t completion_poll_us = 200;
    // A dispatcher woken ahead of a batch (Expect(), or Submit before it checks the batch) polls
    // for it this many microseconds before it sleeps again, so that the batch's first launch does
    // not wait for a thread wake-up (70-120 us on the GPU hosts' VMs, docs/gpu.md). 0: no early
    // wake; the dispatcher wakes when the batch is queued. At most kMaxWakeAheadUs.
    uint32_t wake_ahead_us = 1000;
    // Diagnostics (gpu_bench): a restore lane with a ring records CUDA timing events around the
    // fills and scatters of its next this-many slots, read back by TakeRingTimeline(). 0: none; at
    // most kMaxRingTimelineSlots.
    uint32_t ring_timeline_slots = 0;
  };

  // One staging slot's use, from the timeline (Options::ring_timeline_slots): milliseconds since
  // the first recorded fill began (or since TakeRingTimeline's origin event). fill_start is when the copy stream
  // reached the slot's copies (its previous scatter done, the copies ahead of it done, the dispatcher had queued them).
  struct RingSlotTiming {
    double fill_start_ms = 0;
    double fill_end_ms = 0;
    double scatter_end_ms = 0;
    uint64_t bytes = 0;
    uint32_t runs = 0;  // pool runs copied into the slot
  };
  static constexpr size_t kFirstPartFragments = 512;
  static constexpr size_t kSecondPartEnd = 2048;
  static constexpr size_t kPartFragments = 4096;
  static constexpr size_t kMaxParts = 8;
  static_assert(kMaxParts >= 3 && kFirstPartFragments < kSecondPartEnd);
  // Where the parts of a batch of `n` fragments end (n > kFirstPartFragments; see
  // Options::split_min_fragments): ascending, the last n, at most kMaxParts of them.
  static std::vector<size_t> PartEnds(size_t n);
  // Slots of the staging ring: one filling while another is scattered, two more queued.
  static constexpr uint32_t kStagingSlots = 4;
  static constexpr uint64_t kMaxChunkBytes = uint64_t{64} << 20;
  static constexpr uint32_t kMaxBlocksPerSm = 8;
  static constexpr uint32_t kMaxStreamsPerLane = 8;
  static constexpr uint32_t kMaxRingTimelineSlots = 1 << 16;
  static constexpr uint32_t kMaxWakeAheadUs = 100000;
  // Size of a cudaIpcMemHandle_t as it travels between processes.
  static constexpr size_t kIpcHandleBytes = 64;

  // Starts two threads and creates 2 x streams_per_lane streams per device. `host_memory` (not
  // owned) must outlive the engine. InvalidArgument for options out of range, a null registry or a
  // device that does not exist; Unavailable when no CUDA device or driver is usable; Unimplemented
  // for kMemcpyBatch on a driver older than CUDA 12.8. Metrics go to `metrics` (which must outlive
  // the engine) or, when it is null, to a registry the engine owns:
  //   orbitkv_copy_bytes_total{engine="cuda",direction="save|restore"}: bytes of completed batches
  //   orbitkv_copy_batches_total{engine="cuda",direction="save|restore"}: completed batches
  //   orbitkv_copy_failed_batches_total{engine="cuda"}: batches completed with an error
  //   orbitkv_copy_inflight_batches{engine="cuda"}: batches accepted and not yet completed
  //   orbitkv_copy_dma_batches_total{engine="cuda"}: batches issued as cudaMemcpyBatchAsync
  //   orbitkv_copy_staged_batches_total{engine="cuda"}: restores staged through the device ring
  //   orbitkv_copy_wakeups_ahead_total{engine="cuda"}: dispatcher wake-ups ahead of a batch
  //     (Expect; Options::wake_ahead_us)
  static Result<std::unique_ptr<CudaCopyEngine>> Create(Options options, const HostMemoryRegistry* host_memory,
                                                        MetricsRegistry* metrics);

  CudaCopyEngine(const CudaCopyEngine&) = delete;
  CudaCopyEngine& operator=(const CudaCopyEngine&) = delete;

  // Shutdown(); then closes the IPC mappings of buffers still registered.
  ~CudaCopyEngine() override;

  // Imports the GPU allocation exported by another process as the kIpcHandleBytes raw bytes of a
  // cudaIpcMemHandle_t, opened on `device`, and registers [offset, offset + bytes) of it (a tensor
  // usually starts inside a larger allocation of the engine's caching allocator, and several
  // tensors, e.g. every layer's K and V, inside the same one). CUDA opens a handle once per
  // process: buffers of the same handle and device share one mapping (cudaIpcOpenMemHandle at the
  // first, cudaIpcCloseMemHandle when the last of them is unregistered). InvalidArgument for a
  // handle of the wrong size, zero bytes, a device this engine does not serve, a handle CUDA
  // refuses, or a range beyond the allocation (the mapping is closed again); ResourceExhausted when
  // 2^32 slots are in use.
  Result<core::BufferId> RegisterIpcBuffer(std::span<const uint8_t> ipc_handle, int device, uint64_t bytes,
                                           uint64_t offset = 0);

  // Registers [device_ptr, device_ptr + bytes) of memory allocated on `device` in this process (not
  // owned: the caller frees it after UnregisterBuffer()). InvalidArgument for a null pointer, zero
  // bytes, a device this engine does not serve, or a range that is not inside one allocation of
  // that device.
  Result<core::BufferId> RegisterDeviceBuffer(void* device_ptr, int device, uint64_t bytes);

  // Makes `id` unknown to new batches at once (they get NotFound), waits until every in-flight
  // batch that names it has completed (its CopyDone returned), then releases its IPC mapping (if it
  // has one; closed with its last buffer) and retires the id: after OK the memory is no longer
  // touched, and `id` stays NotFound forever. NotFound for an unknown, stale or already
  // unregistering id.
  Status UnregisterBuffer(core::BufferId id);

  // CopyEngine. Submit() follows the contract in core/copy_engine.h, and also refuses
  // (InvalidArgument) a batch whose fragments name buffers on different devices or whose pool
  // range is not inside memory registered with the HostMemoryRegistry.
  Status Submit(core::CopyBatch batch, core::CopyDone done) override;
  // Wakes the lane of `buffer`'s device and `direction` when its dispatcher sleeps with nothing
  // queued (Options::wake_ahead_us); Submit does the same for its own batch before checking it.
  void Expect(core::BufferId buffer, core::CopyDirection direction) override EXCLUDES(registry_mu_);
  void Shutdown() override;
  std::string_view name() const override { return "cuda"; }

  const Options& options() const { return options_; }

  // The timeline recorded since the last call on `device`'s restore lane, oldest first, and starts
  // a new one. Call only while that lane is idle (no restore in flight): it waits for the events.
  // FailedPrecondition without Options::ring_timeline_slots or a ring on that device. `origin`: a
  // completed timing event of that device to count from instead of the first fill's start (a
  // caller's mark on its own stream before its first Submit gives the pass's start on the GPU).
  Result<std::vector<RingSlotTiming>> TakeRingTimeline(int device, cudaEvent_t origin = nullptr);

 private:
  struct Batch;    // An accepted batch.
  struct Joint;    // The parts of a batch queued in parts.
  struct Lane;     // One device and direction: a stream, a dispatcher and a completer thread.
  struct Staging;  // Descriptor arrays and the completion event of one launched batch.

  // A registered buffer. `pins` counts fragments of in-flight batches that name it.
  struct Slot {
    uint8_t* base = nullptr;  // Device address of the registered range.
    uint64_t bytes = 0;
    uint32_t device_index = 0;    // Index into options_.devices.
    void* ipc_mapping = nullptr;  // What cudaIpcOpenMemHandle returned; null if not imported.
    uint32_t generation = 1;
    bool live = false;
    uint64_t pins = 0;
  };

  // An opened IPC handle, shared by the buffers registered from it.
  struct IpcMapping {
    uint32_t device_index = 0;
    cudaIpcMemHandle_t handle{};
    void* mapping = nullptr;
    uint32_t buffers = 0;  // registered buffers using it
  };

  CudaCopyEngine(Options options, const HostMemoryRegistry* host_memory, MetricsRegistry* metrics, bool dma_available);

  // The mapping of `handle` on the device, opened unless another buffer already did; each OK
  // result is released once with CloseIpcMapping. Holds ipc_mu_ across cudaIpcOpenMemHandle (a
  // registration, never a copy, waits on it) so that two registrations cannot open it twice.
  Result<void*> OpenIpcMapping(const cudaIpcMemHandle_t& handle, uint32_t device_index) EXCLUDES(ipc_mu_);
  void CloseIpcMapping(void* mapping) EXCLUDES(ipc_mu_);

  // Starts the lanes of every device; on error the lanes started so far are stopped by the caller's
  // destructor.
  Status StartLanes();
  // Gives a restore lane its staging ring (memory, copy stream, slot events); a device without room
  // for the ring keeps the lane without one and logs why.
  // Gives it `timeline_slots` timeline marks too (Options::ring_timeline_slots).
  static Status StartStagingRing(Lane& lane, uint64_t bytes, uint32_t timeline_slots);
  // The index of `device` in options_.devices, or InvalidArgument.
  Result<uint32_t> DeviceIndex(int device) const;
  Result<core::BufferId> AddSlot(uint8_t* base, uint64_t bytes, uint32_t device_index, void* ipc_mapping)
      EXCLUDES(registry_mu_);
  Slot* FindLiveSlot(core::BufferId id) REQUIRES(registry_mu_);

  // A batch of Options::split_min_fragments or more: queued in parts, the first checked before
  // Submit returns (its fragments' shape checked by Submit: `first_part_bytes`), each later one
  // while the lane copies those ahead.
  Status SubmitInParts(core::CopyBatch batch, core::CopyDone done, uint64_t first_part_bytes)
      EXCLUDES(registry_mu_, inflight_mu_);
  // Resolves, plans and pins a batch and takes its in-flight slot; or leaves nothing pinned or
  // taken and returns why (Submit's errors).
  Status Admit(Batch* batch) EXCLUDES(registry_mu_, inflight_mu_);
  // The copy method, chunking and staging of a resolved batch; unpins it on error.
  Status Plan(Batch* batch) EXCLUDES(registry_mu_);
  // Hands an accepted, planned batch to its lane's dispatcher.
  void Enqueue(std::unique_ptr<Batch> batch);
  Status ReserveInflight() EXCLUDES(inflight_mu_);
  void ReleaseInflight() EXCLUDES(inflight_mu_);
  // Resolves every fragment to device-visible source and destination addresses and the lane of
  // the batch, and pins the buffers; or pins nothing and returns the first fragment's error.
  Status ResolveAndPin(Batch* batch) EXCLUDES(registry_mu_);
  void Unpin(const core::CopyBatch& batch) EXCLUDES(registry_mu_);

  void DispatchLoop(Lane* lane);
  void CompleteLoop(Lane* lane);
  // Enqueues the batch's copies and its event on the lane's stream.
  Status Launch(Lane* lane, Batch* batch);
  // A launched batch in orbitkv_copy_dma_batches_total or _staged_batches_total: a batch queued
  // in parts counts once in each, with its first part that went that way.
  void CountLaunch(const Batch& batch);
  Status LaunchKernel(Lane* lane, cudaStream_t stream, Batch* batch);
  Status LaunchMemcpyBatch(cudaStream_t stream, Batch* batch);
  // A staged restore: per ring slot, the copy engines fill it from the pool runs (the lane's copy
  // stream) and the kernel scatters it into the pages (`stream`).
  Status LaunchStaged(Lane* lane, cudaStream_t stream, Batch* batch);
  // Queues the copies of one staging slot (staging->dsts/srcs/sizes) on `copies`.
  Status FillSlot(cudaStream_t copies, Staging* staging) const;
  // staging->dsts/srcs/sizes as cudaMemcpyBatchAsync calls on `stream`; `what` names them in
  // errors.
  static Status IssueMemcpyBatches(Staging* staging, cudaStream_t stream, const char* what);
  // Whether kAuto stages this restore on its lane (the lane has a ring; long pool runs).
  bool ShouldStage(const Lane& lane, const Batch& batch) const;
  // Waits on the completer until the lane's oldest launched batch ended (completion_poll_us).
  Status WaitForBatch(Lane* lane, const Batch& batch) const;
  // Runs on the completer: CopyDone, metrics, unpin, staging back to the lane, in-flight slot.
  void Finish(Lane* lane, std::unique_ptr<Batch> batch, const Status& status);

  // Immutable after construction.
  const Options options_;
  const HostMemoryRegistry* const host_memory_;
  const std::unique_ptr<MetricsRegistry> owned_metrics_;  // Set only when Create() got no registry.
  MetricsRegistry* const metrics_;                        // The given registry, or owned_metrics_.
  Counter* const failed_total_;
  Counter* const dma_total_;
  Counter* const staged_total_;
  Counter* const wakeups_ahead_total_;
  // Whether the driver has cudaMemcpyBatchAsync (CUDA 12.8).
  const bool dma_available_;
  Gauge* const inflight_gauge_;
  // Two per device (index 2 * device_index + direction); created in StartLanes() before any
  // Submit.
  std::vector<std::unique_ptr<Lane>> lanes_;

  // Serializes Shutdown(); true once the lane threads were joined.
  Mutex shutdown_mu_;
  bool shut_down_ GUARDED_BY(shutdown_mu_) = false;

  // The buffer registry. Never held together with inflight_mu_ or a lane's mutex.
  Mutex registry_mu_;
  std::condition_variable_any unpinned_cv_;  // A retired slot dropped its last pin.
  std::vector<Slot> slots_ GUARDED_BY(registry_mu_);
  std::vector<uint32_t> free_slots_ GUARDED_BY(registry_mu_);

  // Opened IPC handles. Taken after registry_mu_ (the destructor), never before it.
  Mutex ipc_mu_;
  std::vector<IpcMapping> ipc_mappings_ GUARDED_BY(ipc_mu_);

  // Admission.
  Mutex inflight_mu_;
  std::condition_variable_any drained_cv_;  // inflight_ reached 0.
  uint32_t inflight_ GUARDED_BY(inflight_mu_) = 0;
  bool accepting_ GUARDED_BY(inflight_mu_) = true;  // False once Shutdown began.
};

}  // namespace orbitkv::gpu

#endif  // ORBITKV_GPU_CUDA_COPY_ENGINE_H_
