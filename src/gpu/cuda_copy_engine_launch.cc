// CudaCopyEngine, the dispatcher's side: how a batch's copies are queued on its lane (one kernel
// launch, cudaMemcpyBatchAsync calls, or the staging ring's fills and scatters), and the ring
// itself (its memory, events and timeline). The rest of the engine is in cuda_copy_engine.cc.
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "base/check.h"
#include "base/logging.h"
#include "gpu/copy_kernels.h"
#include "gpu/cuda_copy_engine.h"
#include "gpu/cuda_copy_engine_internal.h"
#include "gpu/cuda_util.h"

namespace orbitkv::gpu {

using core::CopyDirection;
using core::CopyFragment;
using internal::CeilDiv;
using internal::DirectionIndex;

namespace {

// The most copies one cudaMemcpyBatchAsync call carries.
constexpr size_t kCopiesPerMemcpyBatch = 256;

}  // namespace

// The ring's memory, stream and events, and the timeline's events (Options::ring_timeline_slots).
// A device without room for the ring keeps its lane without one (restores go through the kernel)
// and says so.
Status CudaCopyEngine::StartStagingRing(Lane& lane, uint64_t bytes, uint32_t timeline_slots) {
  Result<DeviceMemory> ring = DeviceMemory::Allocate(lane.device, bytes);
  if (!ring.ok()) {
    cudaGetLastError();  // out of memory is not sticky: later calls on this thread must not see it
    ORBITKV_LOG_WARN(
        "GPU {}: no room for the {} MiB restore staging ring ({}); restores of small pages go "
        "through the copy kernel alone",
        lane.device, bytes >> 20, ring.status().ToString());
    return Status::Ok();
  }
  ORBITKV_ASSIGN_OR_RETURN(lane.copy_stream, CudaStream::Create(lane.device));
  for (uint32_t i = 0; i < kStagingSlots; ++i) {
    ORBITKV_ASSIGN_OR_RETURN(CudaEvent filled, CudaEvent::Create(lane.device, false));
    ORBITKV_ASSIGN_OR_RETURN(CudaEvent free, CudaEvent::Create(lane.device, false));
    lane.slot_filled.push_back(std::move(filled));
    lane.slot_free.push_back(std::move(free));
  }
  for (uint32_t i = 0; i < timeline_slots; ++i) {
    Lane::SlotMarks marks;
    for (CudaEvent* event : {&marks.fill_start, &marks.fill_end, &marks.scatter_end}) {
      ORBITKV_ASSIGN_OR_RETURN(*event, CudaEvent::Create(lane.device, false, /*timing=*/true));
    }
    lane.timeline.push_back(std::move(marks));
  }
  lane.ring = std::move(ring).value();
  lane.slot_bytes = bytes / kStagingSlots;
  return Status::Ok();
}

Result<std::vector<CudaCopyEngine::RingSlotTiming>> CudaCopyEngine::TakeRingTimeline(int device,
                                                                                     cudaEvent_t origin_event) {
  ORBITKV_ASSIGN_OR_RETURN(const uint32_t index, DeviceIndex(device));
  Lane& lane = *lanes_[2 * index + DirectionIndex(CopyDirection::kRestore)];
  if (lane.timeline.empty()) {
    return Status::FailedPrecondition(
        fmt::format("device {} records no ring timeline (ring_timeline_slots {}, ring {} bytes)", device,
                    options_.ring_timeline_slots, lane.ring.size()));
  }
  // Milliseconds from the origin (the first recorded fill's start unless given) to `event`.
  const cudaEvent_t origin = origin_event != nullptr ? origin_event : lane.timeline[0].fill_start.get();
  const auto since_origin = [origin](const CudaEvent& event) -> Result<double> {
    float ms = 0;
    ORBITKV_RETURN_IF_ERROR(CudaStatus(cudaEventElapsedTime(&ms, origin, event.get()), "cudaEventElapsedTime"));
    return ms;
  };
  std::vector<RingSlotTiming> out;
  const size_t used = std::exchange(lane.timeline_used, 0);
  for (size_t i = 0; i < used; ++i) {
    const Lane::SlotMarks& marks = lane.timeline[i];
    // The scatter waited for the slot's fill, so this covers all three marks.
    ORBITKV_RETURN_IF_ERROR(CudaStatus(cudaEventSynchronize(marks.scatter_end.get()), "timeline event"));
    RingSlotTiming timing{.bytes = marks.bytes, .runs = marks.runs};
    ORBITKV_ASSIGN_OR_RETURN(timing.fill_start_ms, since_origin(marks.fill_start));
    ORBITKV_ASSIGN_OR_RETURN(timing.fill_end_ms, since_origin(marks.fill_end));
    ORBITKV_ASSIGN_OR_RETURN(timing.scatter_end_ms, since_origin(marks.scatter_end));
    out.push_back(timing);
  }
  return out;
}

Status CudaCopyEngine::Launch(Lane* lane, Batch* batch) {
  cudaStream_t stream = lane->streams[lane->next_stream].get();
  lane->next_stream = (lane->next_stream + 1) % lane->streams.size();
  Status status = batch->use_dma  ? LaunchMemcpyBatch(stream, batch)
                  : batch->staged ? LaunchStaged(lane, stream, batch)
                                  : LaunchKernel(lane, stream, batch);
  if (status.ok()) {
    status = CudaStatus(cudaEventRecord(batch->staging->done_event.get(), stream), "cudaEventRecord");
  }
  if (!status.ok()) {
    // Part of the batch may be queued: let it drain before its staging area is reused.
    if (batch->staged) cudaStreamSynchronize(lane->copy_stream.get());
    cudaStreamSynchronize(stream);
  } else {
    CountLaunch(*batch);
  }
  return status;
}

Status CudaCopyEngine::LaunchKernel(Lane* lane, cudaStream_t stream, Batch* batch) {
  Staging& staging = *batch->staging;
  const std::vector<CopyFragment>& fragments = batch->copy.fragments;
  ORBITKV_RETURN_IF_ERROR(staging.Reserve(lane->device, batch->chunks));
  auto* chunks = reinterpret_cast<CopyChunk*>(staging.chunks.data());
  const uint64_t chunk_bytes = batch->chunk_bytes;
  uint64_t n = 0;
  for (size_t i = 0; i < fragments.size(); ++i) {
    const uint64_t length = fragments[i].length;
    for (uint64_t offset = 0; offset < length; offset += chunk_bytes) {
      chunks[n++] =
          CopyChunk{batch->src[i] + offset, batch->dst[i] + offset, std::min(chunk_bytes, length - offset), 0};
    }
  }
  ORBITKV_CHECK(n == batch->chunks);
  const uint64_t blocks = std::min<uint64_t>(CeilDiv(n, kCopyWarpsPerBlock), lane->max_blocks);
  // The kernel reads the descriptors in place: uploading them first (a copy queued ahead of every
  // launch) measured 3-5% slower.
  return CudaStatus(LaunchCopyChunks(reinterpret_cast<const CopyChunk*>(staging.chunks.device_data()),
                                     static_cast<uint32_t>(n), static_cast<uint32_t>(blocks), stream),
                    "launch of the copy kernel");
}

Status CudaCopyEngine::LaunchStaged(Lane* lane, cudaStream_t stream, Batch* batch) {
  Staging& staging = *batch->staging;
  const std::vector<CopyFragment>& fragments = batch->copy.fragments;
  const uint64_t slot_bytes = lane->slot_bytes;
  const uint64_t chunk_bytes = batch->chunk_bytes;
  // A fragment cut by a slot's end makes one chunk more, at most once per slot.
  ORBITKV_RETURN_IF_ERROR(staging.Reserve(lane->device, batch->chunks + CeilDiv(batch->total_bytes, slot_bytes) + 1));
  auto* chunks = reinterpret_cast<CopyChunk*>(staging.chunks.data());
  const auto* device_chunks = reinterpret_cast<const CopyChunk*>(staging.chunks.device_data());
  cudaStream_t copies = lane->copy_stream.get();
  size_t i = 0;         // the next byte to stage: fragment i,
  uint64_t offset = 0;  // `offset` bytes into it
  uint64_t n = 0;       // chunks written
  while (i < fragments.size()) {
    const size_t k = lane->next_slot;
    lane->next_slot = (lane->next_slot + 1) % kStagingSlots;
    uint8_t* slot = lane->ring.data() + k * slot_bytes;
    // The slot's previous scatter (any batch's) reads it until its free event.
    ORBITKV_RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(copies, lane->slot_free[k].get(), 0),
                                       "cudaStreamWaitEvent (staging slot free)"));
    const uint64_t first_chunk = n;
    uint64_t filled = 0;
    // The pool run being gathered into the slot: adjacent fragments make one copy. The slot's
    // copies go out together (FillSlot) once its runs are known.
    const uint8_t* run = nullptr;
    uint64_t run_at = 0, run_bytes = 0;
    staging.dsts.clear();
    staging.srcs.clear();
    staging.sizes.clear();
    const auto copy_run = [&]() -> Status {
      if (run_bytes == 0) return Status::Ok();
      staging.dsts.push_back(slot + run_at);
      staging.srcs.push_back(run);
      staging.sizes.push_back(run_bytes);
      return Status::Ok();
    };
    while (i < fragments.size() && filled < slot_bytes) {
      const CopyFragment& f = fragments[i];
      const uint64_t take = std::min(f.length - offset, slot_bytes - filled);
      const uint8_t* from = f.pool + offset;
      if (run_bytes > 0 && run + run_bytes == from) {
        run_bytes += take;
      } else {
        ORBITKV_RETURN_IF_ERROR(copy_run());
        run = from;
        run_at = filled;
        run_bytes = take;
      }
      for (uint64_t at = 0; at < take; at += chunk_bytes) {
        chunks[n++] = CopyChunk{reinterpret_cast<uintptr_t>(slot) + filled + at, batch->dst[i] + offset + at,
                                std::min(chunk_bytes, take - at), 0};
      }
      filled += take;
      offset += take;
      if (offset == f.length) {
        ++i;
        offset = 0;
      }
    }
    ORBITKV_RETURN_IF_ERROR(copy_run());
    // Counted once its last mark is recorded: a slot whose copies failed to queue is left out.
    Lane::SlotMarks* marks =
        lane->timeline_used < lane->timeline.size() ? &lane->timeline[lane->timeline_used] : nullptr;
    if (marks != nullptr) {
      marks->bytes = filled;
      marks->runs = static_cast<uint32_t>(staging.dsts.size());
      ORBITKV_RETURN_IF_ERROR(
          CudaStatus(cudaEventRecord(marks->fill_start.get(), copies), "cudaEventRecord (timeline)"));
    }
    ORBITKV_RETURN_IF_ERROR(FillSlot(copies, &staging));
    if (marks != nullptr) {
      ORBITKV_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(marks->fill_end.get(), copies), "cudaEventRecord (timeline)"));
    }
    ORBITKV_RETURN_IF_ERROR(
        CudaStatus(cudaEventRecord(lane->slot_filled[k].get(), copies), "cudaEventRecord (staging slot filled)"));
    ORBITKV_RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(stream, lane->slot_filled[k].get(), 0),
                                       "cudaStreamWaitEvent (staging slot filled)"));
    const uint64_t count = n - first_chunk;
    const uint64_t blocks = std::min<uint64_t>(CeilDiv(count, kCopyWarpsPerBlock), lane->max_blocks);
    ORBITKV_RETURN_IF_ERROR(CudaStatus(LaunchCopyChunks(device_chunks + first_chunk, static_cast<uint32_t>(count),
                                                        static_cast<uint32_t>(blocks), stream),
                                       "launch of the copy kernel (staged scatter)"));
    ORBITKV_RETURN_IF_ERROR(
        CudaStatus(cudaEventRecord(lane->slot_free[k].get(), stream), "cudaEventRecord (staging slot free)"));
    if (marks != nullptr) {
      ORBITKV_RETURN_IF_ERROR(
          CudaStatus(cudaEventRecord(marks->scatter_end.get(), stream), "cudaEventRecord (timeline)"));
      ++lane->timeline_used;
    }
  }
  ORBITKV_CHECK(n <= staging.capacity);
  return Status::Ok();
}

// staging's copies (dsts, srcs, sizes) as cudaMemcpyBatchAsync calls of at most
// kCopiesPerMemcpyBatch copies, back to back on the stream: one call of 4096 64 KiB copies measured
// 0.70 of the link's peak, 256 per call 0.95 (docs/gpu.md).
Status CudaCopyEngine::IssueMemcpyBatches(Staging* staging, cudaStream_t stream, const char* what) {
  cudaMemcpyAttributes attributes{};
  attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attributes.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  size_t first_copy = 0;
  const size_t n = staging->dsts.size();
  for (size_t begin = 0; begin < n; begin += kCopiesPerMemcpyBatch) {
    const size_t count = std::min(kCopiesPerMemcpyBatch, n - begin);
    ORBITKV_RETURN_IF_ERROR(
        CudaStatus(cudaMemcpyBatchAsync(staging->dsts.data() + begin, staging->srcs.data() + begin,
                                        staging->sizes.data() + begin, count, &attributes, &first_copy, 1, stream),
                   what));
  }
  return Status::Ok();
}

Status CudaCopyEngine::FillSlot(cudaStream_t copies, Staging* staging) const {
  const size_t n = staging->dsts.size();
  if (!dma_available_) {
    for (size_t i = 0; i < n; ++i) {
      ORBITKV_RETURN_IF_ERROR(CudaStatus(
          cudaMemcpyAsync(staging->dsts[i], staging->srcs[i], staging->sizes[i], cudaMemcpyHostToDevice, copies),
          "cudaMemcpyAsync into the staging ring"));
    }
    return Status::Ok();
  }
  // One call for the slot's runs rather than one cudaMemcpyAsync each: a 16 MiB slot of 2.25 MiB
  // block runs filled at 0.99 of the link's peak this way and at 0.94 run by run (ring_model_* in
  // gpu_bench, docs/gpu.md).
  return IssueMemcpyBatches(staging, copies, "cudaMemcpyBatchAsync into the staging ring");
}

Status CudaCopyEngine::LaunchMemcpyBatch(cudaStream_t stream, Batch* batch) {
  Staging& staging = *batch->staging;
  const std::vector<CopyFragment>& fragments = batch->copy.fragments;
  const size_t n = fragments.size();
  staging.dsts.resize(n);
  staging.srcs.resize(n);
  staging.sizes.resize(n);
  for (size_t i = 0; i < n; ++i) {
    staging.dsts[i] = reinterpret_cast<void*>(batch->dst[i]);
    staging.srcs[i] = reinterpret_cast<const void*>(batch->src[i]);
    staging.sizes[i] = fragments[i].length;
  }
  return IssueMemcpyBatches(&staging, stream, "cudaMemcpyBatchAsync");
}

}  // namespace orbitkv::gpu
