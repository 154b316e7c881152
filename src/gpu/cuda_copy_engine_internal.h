// The CUDA copy engine's private parts, shared by its two source files: cuda_copy_engine.cc
// (options, registration, admission, the lane threads, completion) and cuda_copy_engine_launch.cc
// (how the dispatcher queues a batch's copies: kernel, copy engines or the staging ring). Include
// nowhere else.
#ifndef ORBITKV_GPU_CUDA_COPY_ENGINE_INTERNAL_H_
#define ORBITKV_GPU_CUDA_COPY_ENGINE_INTERNAL_H_

#include <algorithm>
#include <atomic>
#include <bit>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <thread>
#include <vector>

#include "base/mutex.h"
#include "base/status.h"
#include "base/thread_annotations.h"
#include "core/copy_engine.h"
#include "gpu/copy_kernels.h"
#include "gpu/cuda_copy_engine.h"
#include "gpu/cuda_util.h"

namespace orbitkv::gpu {
namespace internal {

// Descriptor capacity a staging area starts with; it grows by powers of two.
inline constexpr uint64_t kInitialStagingChunks = 4096;

constexpr int DirectionIndex(core::CopyDirection direction) { return static_cast<int>(direction); }

constexpr uint64_t CeilDiv(uint64_t a, uint64_t b) { return a / b + (a % b != 0 ? 1 : 0); }

}  // namespace internal

// Descriptor arrays and the completion event of one launched batch. Reused by later batches of the
// same lane once the completer saw the event.
struct CudaCopyEngine::Staging {
  CudaEvent done_event;
  // Kernel batches: chunk descriptors in mapped pinned memory, written by the dispatcher and read
  // by the kernel in place (no upload copy queued ahead of each launch).
  PinnedHostMemory chunks;
  uint64_t capacity = 0;  // CopyChunks that `chunks` holds.
  // Copy-engine batches: the per-copy arrays cudaMemcpyBatchAsync reads at the call.
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;

  // Grows the descriptor array to hold `count` chunks. The staging area is idle (its last batch
  // completed), so the old array may be freed.
  Status Reserve(int device, uint64_t count) {
    if (count <= capacity) return Status::Ok();
    const uint64_t grown = std::bit_ceil(std::max(count, internal::kInitialStagingChunks));
    ORBITKV_ASSIGN_OR_RETURN(chunks, PinnedHostMemory::Allocate(device, grown * sizeof(CopyChunk)));
    capacity = grown;
    return Status::Ok();
  }
};

// An accepted batch. Created by Submit(), deleted by Finish() on its lane's completer.
struct CudaCopyEngine::Batch {
  Batch(core::CopyBatch b, core::CopyDone d, uint64_t total)
      : copy(std::move(b)), done(std::move(d)), total_bytes(total) {}

  // Immutable once queued (published to the lane threads by the lane's mutex).
  core::CopyBatch copy;
  core::CopyDone done;
  uint64_t total_bytes;
  uint32_t lane = 0;
  // Issued to the copy engines (cudaMemcpyBatchAsync) rather than as a kernel.
  bool use_dma = false;
  // A restore through the lane's staging ring (copy engines into the ring, the kernel out of it).
  bool staged = false;
  // Kernel batches: the chunk size for this batch and the number of chunks it makes.
  uint64_t chunk_bytes = 0;
  uint64_t chunks = 0;
  // Device-visible address of each fragment's first source and destination byte.
  std::vector<uint64_t> src;
  std::vector<uint64_t> dst;

  // A part of a split batch: `done` is empty and the joint completes the caller's.
  std::shared_ptr<Joint> joint;
  // A part that failed its checks after earlier parts were queued: never launched, nothing pinned
  // (its fragments cleared); it ends the joint with this error once the parts ahead of it finished.
  Status rejected;

  // Set by the dispatcher before it hands the batch to the completer.
  std::unique_ptr<Staging> staging;
  Status launch_status;
  int64_t launched_ns = 0;  // MonoNanos() before its copies were queued (completion_poll_us only)
};

struct CudaCopyEngine::Lane {
  // Immutable after StartLanes().
  int device = 0;
  core::CopyDirection direction = core::CopyDirection::kRestore;
  uint32_t max_blocks = 1;         // Multiprocessors x blocks_per_sm.
  Counter* bytes_total = nullptr;  // of this device and direction
  Counter* batches_total = nullptr;
  std::vector<CudaStream> streams;
  // The dispatcher's turn among `streams`; only the dispatcher touches it.
  size_t next_stream = 0;
  // Restore lanes with a staging ring (slot_bytes > 0), used by the dispatcher only: kStagingSlots
  // slots of slot_bytes; a slot's H2D copies run on copy_stream and record slot_filled, its scatter
  // waits for that and records slot_free, which the slot's next copies wait for.
  DeviceMemory ring;
  uint64_t slot_bytes = 0;
  CudaStream copy_stream;
  std::vector<CudaEvent> slot_filled, slot_free;
  size_t next_slot = 0;
  // Options::ring_timeline_slots: timing events per recorded slot use; `timeline_used` of them
  // recorded by the dispatcher since the last TakeRingTimeline (which runs while the lane is idle).
  struct SlotMarks {
    CudaEvent fill_start, fill_end, scatter_end;
    uint64_t bytes = 0;
    uint32_t runs = 0;
  };
  std::vector<SlotMarks> timeline;
  size_t timeline_used = 0;
  // The completer's own (Options::completion_poll_us): when its last batch ended, and the fastest
  // rate a batch ran at, from when it could start (its launch, or the end of the batch before it).
  int64_t last_done_ns = 0;
  double fastest_bytes_per_ns = 0;
  // Batches accepted for this lane and not yet finished (the restore lane stages only while its
  // device's save lane has none: copy-engine reads beside the save kernel's writes slow both).
  std::atomic<uint32_t> busy{0};
  std::thread dispatcher;
  std::thread completer;

  Mutex mu;
  std::condition_variable_any pending_cv;   // The dispatcher waits: a batch was queued, or stop.
  std::condition_variable_any launched_cv;  // The completer waits: a batch was launched, or stop.
  std::deque<std::unique_ptr<Batch>> pending GUARDED_BY(mu);
  std::deque<std::unique_ptr<Batch>> launched GUARDED_BY(mu);
  std::vector<std::unique_ptr<Staging>> free_staging GUARDED_BY(mu);
  // Set once nothing is in flight after Shutdown began: both threads exit.
  bool stop GUARDED_BY(mu) = false;
  // Expect(): a batch is coming; the dispatcher polls `queued` (batches ever queued here) for it.
  bool woken_ahead GUARDED_BY(mu) = false;
  std::atomic<uint64_t> queued{0};
};

}  // namespace orbitkv::gpu

#endif  // ORBITKV_GPU_CUDA_COPY_ENGINE_INTERNAL_H_
