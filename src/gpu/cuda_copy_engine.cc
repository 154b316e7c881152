#include "gpu/cuda_copy_engine.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstring>
#include <deque>
#include <limits>
#include <string>
#include <utility>

#include "base/check.h"
#include "base/clock.h"
#include "base/logging.h"
#include "gpu/copy_kernels.h"
#include "gpu/cuda_copy_engine_internal.h"
#include "gpu/cuda_util.h"

namespace orbitkv::gpu {

using core::BufferId;
using core::CopyBatch;
using core::CopyDirection;
using core::CopyDirectionName;
using core::CopyDone;
using core::CopyFragment;
using internal::CeilDiv;
using internal::DirectionIndex;

namespace {

// The engine whose lane thread runs on this thread, if any: UnregisterBuffer() and Shutdown()
// CHECK against being called from their own engine's CopyDone, which would wait for itself.
thread_local const CudaCopyEngine* t_lane_of = nullptr;

MetricsRegistry& PickRegistry(MetricsRegistry* given, const std::unique_ptr<MetricsRegistry>& owned) {
  return given != nullptr ? *given : *owned;
}

// Per device (its CUDA ordinal) and direction: an operator sees each GPU's restore and save
// traffic.
Counter& BytesCounter(MetricsRegistry& registry, CopyDirection direction, int device) {
  return registry.GetCounter("orbitkv_copy_bytes_total", "Bytes copied by completed copy batches.",
                             {{"engine", "cuda"},
                              {"direction", std::string(CopyDirectionName(direction))},
                              {"device", std::to_string(device)}});
}

Counter& BatchesCounter(MetricsRegistry& registry, CopyDirection direction, int device) {
  return registry.GetCounter("orbitkv_copy_batches_total", "Copy batches completed.",
                             {{"engine", "cuda"},
                              {"direction", std::string(CopyDirectionName(direction))},
                              {"device", std::to_string(device)}});
}

// The batch's checks that need no fragment: a `done`, a direction, a fragment at least.
Status CheckShape(const CopyBatch& batch, const CopyDone& done) {
  if (!done) return Status::InvalidArgument("copy batch has no done callback");
  if (batch.direction != CopyDirection::kSave && batch.direction != CopyDirection::kRestore) {
    return Status::InvalidArgument(
        fmt::format("copy direction {} is not save or restore", static_cast<int>(batch.direction)));
  }
  if (batch.fragments.empty()) return Status::InvalidArgument("copy batch has no fragments");
  return Status::Ok();
}

// The checks of fragments [begin, end) that need no registry, with InvalidArgument naming the
// first bad one; on OK, `*total_bytes` is the sum of their lengths.
Status CheckFragments(const std::vector<CopyFragment>& fragments, size_t begin, size_t end, uint64_t* total_bytes) {
  uint64_t total = 0;
  for (size_t i = begin; i < end; ++i) {
    const CopyFragment& f = fragments[i];
    if (f.pool == nullptr) {
      return Status::InvalidArgument(fmt::format("fragment {}: null pool address", i));
    }
    if (f.length == 0) return Status::InvalidArgument(fmt::format("fragment {}: zero length", i));
    if (reinterpret_cast<uintptr_t>(f.pool) > std::numeric_limits<uintptr_t>::max() - f.length) {
      return Status::InvalidArgument(fmt::format("fragment {}: pool range wraps the address space", i));
    }
    if (f.length > std::numeric_limits<uint64_t>::max() - total) {
      return Status::InvalidArgument("copy batch length overflows 64 bits");
    }
    total += f.length;
  }
  *total_bytes = total;
  return Status::Ok();
}

// The chunk size for a batch of `total_bytes` on a lane of `warps` warps: `max_chunk_bytes`, or
// less for a small batch so that it still spreads over every warp (down to kMinChunkBytes).
uint64_t ChunkBytesFor(uint64_t total_bytes, uint64_t warps, uint64_t max_chunk_bytes) {
  // A power of two: chunks of an odd size (say 16 MiB over 2112 warps, 7944 bytes) start off the
  // 4 KiB boundaries the fragments keep, and measured up to 30% slower (docs/gpu.md).
  const uint64_t even_share = std::bit_ceil(CeilDiv(total_bytes, warps));
  return std::clamp(even_share, CudaCopyEngine::kMinChunkBytes, max_chunk_bytes);
}

}  // namespace

// The parts of one batch (Options::split_min_fragments): the caller's CopyDone runs once, after
// every queued part finished, with the first error; the batch holds one in-flight slot throughout.
struct CudaCopyEngine::Joint {
  explicit Joint(CopyDone d) : done(std::move(d)) {}
  // Records one part's end (its fragments stay pinned, in `finished`, until the batch's CopyDone
  // returned, as a whole batch's do); true for the last part, which unpins them all.
  bool PartDone(const Status& status, uint64_t bytes, CopyBatch* copy) EXCLUDES(mu) {
    MutexLock lock(&mu);
    if (!status.ok() && first_error.ok()) first_error = status;
    if (status.ok()) copied_bytes += bytes;
    if (--remaining == 0) return true;
    finished.push_back(std::move(*copy));
    copy->fragments.clear();
    return false;
  }
  CopyDone done;
  Mutex mu;
  // Parts not yet finished: all of them from the start, less those a rejected part stops.
  size_t remaining GUARDED_BY(mu) = 0;
  // Read by the last part's completer only, once no part can write them.
  Status first_error;
  uint64_t copied_bytes = 0;
  std::vector<CopyBatch> finished;
  // Whether a part went to the copy engines / was staged (the batch counts once in each metric);
  // the lane's dispatcher launches every part, and alone touches them.
  bool counted_dma = false;
  bool counted_staged = false;
};

void CudaCopyEngine::CountLaunch(const Batch& batch) {
  if (batch.use_dma && (batch.joint == nullptr || !std::exchange(batch.joint->counted_dma, true))) {
    dma_total_->Increment();
  } else if (batch.staged && (batch.joint == nullptr || !std::exchange(batch.joint->counted_staged, true))) {
    staged_total_->Increment();
  }
}

Result<std::unique_ptr<CudaCopyEngine>> CudaCopyEngine::Create(Options options, const HostMemoryRegistry* host_memory,
                                                               MetricsRegistry* metrics) {
  if (host_memory == nullptr) return Status::InvalidArgument("host memory registry is null");
  if (options.max_inflight_batches == 0) {
    return Status::InvalidArgument("max_inflight_batches must be at least 1");
  }
  if (options.chunk_bytes < kMinChunkBytes || options.chunk_bytes > kMaxChunkBytes ||
      !std::has_single_bit(options.chunk_bytes)) {
    return Status::InvalidArgument(fmt::format("chunk_bytes must be a power of two in [{}, {}], not {}", kMinChunkBytes,
                                               kMaxChunkBytes, options.chunk_bytes));
  }
  if (options.blocks_per_sm < 1 || options.blocks_per_sm > kMaxBlocksPerSm) {
    return Status::InvalidArgument(
        fmt::format("blocks_per_sm must be in [1, {}], not {}", kMaxBlocksPerSm, options.blocks_per_sm));
  }
  if (options.streams_per_lane < 1 || options.streams_per_lane > kMaxStreamsPerLane) {
    return Status::InvalidArgument(
        fmt::format("streams_per_lane must be in [1, {}], not {}", kMaxStreamsPerLane, options.streams_per_lane));
  }
  if (options.method != Method::kAuto && options.method != Method::kKernel && options.method != Method::kMemcpyBatch) {
    return Status::InvalidArgument(
        fmt::format("copy method {} is not auto, kernel or memcpy-batch", static_cast<int>(options.method)));
  }
  if (options.dma_min_fragment_bytes == 0) {
    return Status::InvalidArgument("dma_min_fragment_bytes must be at least 1");
  }
  if (options.restore_staging_bytes % (uint64_t{kStagingSlots} * 4096) != 0) {
    return Status::InvalidArgument(
        fmt::format("restore_staging_bytes must be a multiple of {} (its {} slots of 4 KiB pages), "
                    "not {}",
                    kStagingSlots * 4096, kStagingSlots, options.restore_staging_bytes));
  }
  if (options.staged_min_run_bytes == 0) {
    return Status::InvalidArgument("staged_min_run_bytes must be at least 1");
  }
  if (options.staged_max_fragment_bytes == 0) {
    return Status::InvalidArgument("staged_max_fragment_bytes must be at least 1");
  }
  if (options.wake_ahead_us > kMaxWakeAheadUs) {
    return Status::InvalidArgument(
        fmt::format("wake_ahead_us must be at most {}, not {}", kMaxWakeAheadUs, options.wake_ahead_us));
  }
  if (options.ring_timeline_slots > kMaxRingTimelineSlots) {
    return Status::InvalidArgument(fmt::format("ring_timeline_slots must be at most {}, not {}", kMaxRingTimelineSlots,
                                               options.ring_timeline_slots));
  }
  int device_count = 0;
  ORBITKV_RETURN_IF_ERROR(CudaStatus(cudaGetDeviceCount(&device_count), "cudaGetDeviceCount"));
  if (device_count == 0) return Status::Unavailable("no CUDA device is visible");
  if (options.devices.empty()) {
    for (int d = 0; d < device_count; ++d) options.devices.push_back(d);
  }
  for (size_t i = 0; i < options.devices.size(); ++i) {
    const int device = options.devices[i];
    if (device < 0 || device >= device_count) {
      return Status::InvalidArgument(fmt::format("device {} does not exist ({} visible)", device, device_count));
    }
    if (std::find(options.devices.begin(), options.devices.begin() + static_cast<long>(i), device) !=
        options.devices.begin() + static_cast<long>(i)) {
      return Status::InvalidArgument(fmt::format("device {} is listed twice", device));
    }
  }
  int driver = 0;
  ORBITKV_RETURN_IF_ERROR(CudaStatus(cudaDriverGetVersion(&driver), "cudaDriverGetVersion"));
  const bool dma_available = driver >= 12080;
  if (options.method == Method::kMemcpyBatch && !dma_available) {
    return Status::Unimplemented(fmt::format("cudaMemcpyBatchAsync needs a CUDA 12.8 driver; this one is {}.{}",
                                             driver / 1000, (driver % 1000) / 10));
  }
  std::unique_ptr<CudaCopyEngine> engine(new CudaCopyEngine(std::move(options), host_memory, metrics, dma_available));
  ORBITKV_RETURN_IF_ERROR(engine->StartLanes());
  return engine;
}

CudaCopyEngine::CudaCopyEngine(Options options, const HostMemoryRegistry* host_memory, MetricsRegistry* metrics,
                               bool dma_available)
    : options_(std::move(options)),
      host_memory_(host_memory),
      owned_metrics_(metrics == nullptr ? std::make_unique<MetricsRegistry>() : nullptr),
      metrics_(&PickRegistry(metrics, owned_metrics_)),
      failed_total_(&PickRegistry(metrics, owned_metrics_)
                         .GetCounter("orbitkv_copy_failed_batches_total",
                                     "Copy batches completed with an error (a device error, or "
                                     "a bad fragment past the first part of a split batch).",
                                     {{"engine", "cuda"}})),
      dma_total_(&PickRegistry(metrics, owned_metrics_)
                      .GetCounter("orbitkv_copy_dma_batches_total",
                                  "Copy batches issued to the copy engines (cudaMemcpyBatchAsync).",
                                  {{"engine", "cuda"}})),
      staged_total_(&PickRegistry(metrics, owned_metrics_)
                         .GetCounter("orbitkv_copy_staged_batches_total",
                                     "Restores staged through the device ring (copy engines in, "
                                     "the kernel out).",
                                     {{"engine", "cuda"}})),
      wakeups_ahead_total_(&PickRegistry(metrics, owned_metrics_)
                                .GetCounter("orbitkv_copy_wakeups_ahead_total",
                                            "Dispatcher wake-ups ahead of a batch (a restore "
                                            "or save about to be submitted).",
                                            {{"engine", "cuda"}})),
      dma_available_(dma_available),
      inflight_gauge_(&PickRegistry(metrics, owned_metrics_)
                           .GetGauge("orbitkv_copy_inflight_batches", "Copy batches accepted and not yet completed.",
                                     {{"engine", "cuda"}})) {}

Status CudaCopyEngine::StartLanes() {
  for (const int device : options_.devices) {
    int multiprocessors = 0;
    ORBITKV_RETURN_IF_ERROR(CudaStatus(cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device),
                                       fmt::format("multiprocessor count of device {}", device)));
    for (const CopyDirection direction : {CopyDirection::kSave, CopyDirection::kRestore}) {
      auto lane = std::make_unique<Lane>();
      lane->device = device;
      lane->direction = direction;
      lane->max_blocks = static_cast<uint32_t>(multiprocessors) * options_.blocks_per_sm;
      lane->bytes_total = &BytesCounter(*metrics_, direction, device);
      lane->batches_total = &BatchesCounter(*metrics_, direction, device);
      for (uint32_t i = 0; i < options_.streams_per_lane; ++i) {
        ORBITKV_ASSIGN_OR_RETURN(CudaStream stream, CudaStream::Create(device));
        lane->streams.push_back(std::move(stream));
      }
      if (direction == CopyDirection::kRestore && options_.restore_staging_bytes > 0) {
        ORBITKV_RETURN_IF_ERROR(StartStagingRing(*lane, options_.restore_staging_bytes, options_.ring_timeline_slots));
      }
      lanes_.push_back(std::move(lane));
    }
  }
  // Threads last, so that a failure above leaves no thread to join.
  for (const std::unique_ptr<Lane>& lane : lanes_) {
    lane->dispatcher = std::thread([this, l = lane.get()] { DispatchLoop(l); });
    lane->completer = std::thread([this, l = lane.get()] { CompleteLoop(l); });
  }
  return Status::Ok();
}

CudaCopyEngine::~CudaCopyEngine() {
  Shutdown();
  MutexLock lock(&registry_mu_);
  for (Slot& slot : slots_) {
    ORBITKV_CHECK(slot.pins == 0);
    if (slot.live && slot.ipc_mapping != nullptr) CloseIpcMapping(slot.ipc_mapping);
  }
}

Result<uint32_t> CudaCopyEngine::DeviceIndex(int device) const {
  for (size_t i = 0; i < options_.devices.size(); ++i) {
    if (options_.devices[i] == device) return static_cast<uint32_t>(i);
  }
  return Status::InvalidArgument(fmt::format("device {} is not served by this copy engine", device));
}

Result<BufferId> CudaCopyEngine::RegisterIpcBuffer(std::span<const uint8_t> ipc_handle, int device, uint64_t bytes,
                                                   uint64_t offset) {
  static_assert(sizeof(cudaIpcMemHandle_t) == kIpcHandleBytes);
  if (ipc_handle.size() != kIpcHandleBytes) {
    return Status::InvalidArgument(
        fmt::format("a CUDA IPC handle has {} bytes, not {}", kIpcHandleBytes, ipc_handle.size()));
  }
  if (bytes == 0) return Status::InvalidArgument("buffer has zero bytes");
  if (offset > std::numeric_limits<uint64_t>::max() - bytes) {
    return Status::InvalidArgument("buffer offset + bytes overflows 64 bits");
  }
  ORBITKV_ASSIGN_OR_RETURN(const uint32_t device_index, DeviceIndex(device));
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, ipc_handle.data(), kIpcHandleBytes);
  ScopedDevice scope(device);
  ORBITKV_RETURN_IF_ERROR(scope.status());
  ORBITKV_ASSIGN_OR_RETURN(void* const mapping, OpenIpcMapping(handle, device_index));
  // The handle maps the whole exporting allocation: the registered range must lie inside it.
  Result<AllocationRange> range = DeviceAllocationRange(mapping);
  Status status = range.status();
  if (status.ok() && (offset > range->bytes || bytes > range->bytes - offset)) {
    status = Status::InvalidArgument(fmt::format(
        "IPC buffer range [{}, +{}) exceeds the imported allocation of {} bytes", offset, bytes, range->bytes));
  }
  Result<BufferId> id = status.ok() ? AddSlot(static_cast<uint8_t*>(mapping) + offset, bytes, device_index, mapping)
                                    : Result<BufferId>(status);
  if (!id.ok()) CloseIpcMapping(mapping);
  return id;
}

Result<void*> CudaCopyEngine::OpenIpcMapping(const cudaIpcMemHandle_t& handle, uint32_t device_index) {
  MutexLock lock(&ipc_mu_);
  for (IpcMapping& open : ipc_mappings_) {
    if (open.device_index == device_index && std::memcmp(&open.handle, &handle, sizeof(handle)) == 0) {
      ++open.buffers;
      return open.mapping;
    }
  }
  const int device = options_.devices[device_index];
  void* mapping = nullptr;
  if (cudaError_t error = cudaIpcOpenMemHandle(&mapping, handle, cudaIpcMemLazyEnablePeerAccess);
      error != cudaSuccess) {
    Status status = CudaStatus(error, fmt::format("cudaIpcOpenMemHandle on device {}", device));
    cudaGetLastError();
    // A handle CUDA refuses (garbage, a closed allocation, this process's own memory) is bad input.
    return error == cudaErrorNoDevice || error == cudaErrorInsufficientDriver
               ? status
               : Status::InvalidArgument(status.message());
  }
  ipc_mappings_.push_back(IpcMapping{device_index, handle, mapping, 1});
  return mapping;
}

void CudaCopyEngine::CloseIpcMapping(void* mapping) {
  MutexLock lock(&ipc_mu_);
  for (auto it = ipc_mappings_.begin(); it != ipc_mappings_.end(); ++it) {
    if (it->mapping != mapping) continue;
    if (--it->buffers == 0) {
      ScopedDevice scope(options_.devices[it->device_index]);
      cudaIpcCloseMemHandle(mapping);
      ipc_mappings_.erase(it);
    }
    return;
  }
  ORBITKV_CHECK_MSG(false, "closing an IPC mapping that is not open");
}

Result<BufferId> CudaCopyEngine::RegisterDeviceBuffer(void* device_ptr, int device, uint64_t bytes) {
  if (device_ptr == nullptr) return Status::InvalidArgument("buffer base is null");
  if (bytes == 0) return Status::InvalidArgument("buffer has zero bytes");
  ORBITKV_ASSIGN_OR_RETURN(const uint32_t device_index, DeviceIndex(device));
  ScopedDevice scope(device);
  ORBITKV_RETURN_IF_ERROR(scope.status());
  cudaPointerAttributes attributes{};
  ORBITKV_RETURN_IF_ERROR(CudaStatus(cudaPointerGetAttributes(&attributes, device_ptr), "cudaPointerGetAttributes"));
  if (attributes.type != cudaMemoryTypeDevice || attributes.device != device) {
    return Status::InvalidArgument(fmt::format("{} is not device memory of device {}", device_ptr, device));
  }
  ORBITKV_ASSIGN_OR_RETURN(const AllocationRange range, DeviceAllocationRange(device_ptr));
  const uint64_t offset = reinterpret_cast<uintptr_t>(device_ptr) - range.base;
  if (bytes > range.bytes - offset) {
    return Status::InvalidArgument(fmt::format(
        "device buffer of {} bytes at offset {} exceeds its allocation of {} bytes", bytes, offset, range.bytes));
  }
  return AddSlot(static_cast<uint8_t*>(device_ptr), bytes, device_index, nullptr);
}

Result<BufferId> CudaCopyEngine::AddSlot(uint8_t* base, uint64_t bytes, uint32_t device_index, void* ipc_mapping) {
  MutexLock lock(&registry_mu_);
  uint32_t index;
  if (!free_slots_.empty()) {
    index = free_slots_.back();
    free_slots_.pop_back();
  } else {
    if (slots_.size() > std::numeric_limits<uint32_t>::max()) {
      return Status::ResourceExhausted("every buffer slot is in use");
    }
    index = static_cast<uint32_t>(slots_.size());
    slots_.emplace_back();
  }
  Slot& slot = slots_[index];
  ORBITKV_CHECK(!slot.live && slot.pins == 0);
  slot.base = base;
  slot.bytes = bytes;
  slot.device_index = device_index;
  slot.ipc_mapping = ipc_mapping;
  slot.live = true;
  return BufferId{index, slot.generation};
}

Status CudaCopyEngine::UnregisterBuffer(BufferId id) {
  ORBITKV_CHECK_MSG(t_lane_of != this, "UnregisterBuffer() from a CopyDone of the same engine");
  void* mapping = nullptr;
  {
    MutexLock lock(&registry_mu_);
    if (FindLiveSlot(id) == nullptr) {
      return Status::NotFound(fmt::format("buffer {}/{} is not registered", id.index, id.generation));
    }
    slots_[id.index].live = false;
    // Index, not a reference: AddSlot() may grow slots_ while this waits.
    while (slots_[id.index].pins > 0) unpinned_cv_.wait(registry_mu_);
    mapping = slots_[id.index].ipc_mapping;
  }
  // Nothing references the slot now (not live, no pins, not yet free): release outside the lock.
  if (mapping != nullptr) CloseIpcMapping(mapping);
  MutexLock lock(&registry_mu_);
  Slot& slot = slots_[id.index];
  slot = Slot{.generation = slot.generation};
  // A slot whose generation would wrap is never reused, so no id is ever issued twice.
  if (slot.generation < std::numeric_limits<uint32_t>::max()) {
    ++slot.generation;
    free_slots_.push_back(id.index);
  }
  return Status::Ok();
}

CudaCopyEngine::Slot* CudaCopyEngine::FindLiveSlot(BufferId id) {
  if (id.index >= slots_.size()) return nullptr;
  Slot& slot = slots_[id.index];
  return slot.live && slot.generation == id.generation ? &slot : nullptr;
}

void CudaCopyEngine::Expect(BufferId buffer, CopyDirection direction) {
  if (options_.wake_ahead_us == 0) return;
  if (direction != CopyDirection::kSave && direction != CopyDirection::kRestore) return;
  uint32_t device_index;
  {
    MutexLock lock(&registry_mu_);
    const Slot* slot = FindLiveSlot(buffer);
    if (slot == nullptr) return;  // Submit will say why
    device_index = slot->device_index;
  }
  Lane* lane = lanes_[2 * device_index + static_cast<uint32_t>(DirectionIndex(direction))].get();
  {
    MutexLock lock(&lane->mu);
    if (!lane->pending.empty() || lane->stop) return;  // awake already, or gone
    lane->woken_ahead = true;
  }
  lane->pending_cv.notify_one();
}

Status CudaCopyEngine::Submit(CopyBatch batch, CopyDone done) {
  ORBITKV_RETURN_IF_ERROR(CheckShape(batch, done));
  // The dispatcher's wake-up overlaps the checks below.
  Expect(batch.fragments[0].buffer, batch.direction);
  const size_t n = batch.fragments.size();
  const bool parts = options_.split_min_fragments > 0 && n >= options_.split_min_fragments && n > kFirstPartFragments;
  // In parts, only the first part is checked here: each later one while the parts ahead copy.
  uint64_t total_bytes = 0;
  ORBITKV_RETURN_IF_ERROR(CheckFragments(batch.fragments, 0, parts ? kFirstPartFragments : n, &total_bytes));
  if (parts) return SubmitInParts(std::move(batch), std::move(done), total_bytes);
  auto accepted = std::make_unique<Batch>(std::move(batch), std::move(done), total_bytes);
  ORBITKV_RETURN_IF_ERROR(Admit(accepted.get()));
  Enqueue(std::move(accepted));
  return Status::Ok();
}

Status CudaCopyEngine::Admit(Batch* batch) {
  // Validation before backpressure, so that an invalid batch is never answered "retry later".
  ORBITKV_RETURN_IF_ERROR(ResolveAndPin(batch));
  ORBITKV_RETURN_IF_ERROR(Plan(batch));
  if (Status status = ReserveInflight(); !status.ok()) {
    Unpin(batch->copy);
    return status;
  }
  inflight_gauge_->Add(1);
  return Status::Ok();
}

Status CudaCopyEngine::Plan(Batch* batch) {
  const Lane& lane = *lanes_[batch->lane];
  const uint64_t average_fragment = batch->total_bytes / batch->copy.fragments.size();
  const bool dma = options_.method == Method::kMemcpyBatch || (options_.method == Method::kAuto && dma_available_ &&
                                                               average_fragment >= options_.dma_min_fragment_bytes);
  // A restore from long pool runs is staged where the kernel would copy it, and also where the copy
  // engines would but its fragments average below staged_max_fragment_bytes: it crosses the link in
  // a few slot-sized copies instead of one copy per fragment.
  batch->staged = (!dma || average_fragment < options_.staged_max_fragment_bytes) && ShouldStage(lane, *batch);
  batch->use_dma = dma && !batch->staged;
  batch->chunk_bytes =
      ChunkBytesFor(batch->total_bytes, uint64_t{lane.max_blocks} * kCopyWarpsPerBlock, options_.chunk_bytes);
  if (!batch->use_dma) {  // only the kernel's launches count chunks
    // chunk_bytes is a power of two: a shift, not a division per fragment.
    const int shift = std::countr_zero(batch->chunk_bytes);
    const uint64_t mask = batch->chunk_bytes - 1;
    for (const CopyFragment& f : batch->copy.fragments) {
      batch->chunks += (f.length >> shift) + ((f.length & mask) != 0 ? 1 : 0);
    }
  }
  if (!batch->use_dma && batch->chunks > std::numeric_limits<uint32_t>::max()) {
    Unpin(batch->copy);
    return Status::InvalidArgument(
        fmt::format("copy batch makes {} chunks of {} bytes, more than one launch takes; split it", batch->chunks,
                    batch->chunk_bytes));
  }
  return Status::Ok();
}

void CudaCopyEngine::Enqueue(std::unique_ptr<Batch> batch) {
  Lane* lane = lanes_[batch->lane].get();
  lane->busy.fetch_add(1, std::memory_order_relaxed);
  {
    MutexLock lock(&lane->mu);
    lane->pending.push_back(std::move(batch));
    lane->queued.fetch_add(1, std::memory_order_release);
  }
  lane->pending_cv.notify_one();
}

std::vector<size_t> CudaCopyEngine::PartEnds(size_t n) {
  // A short first part (the GPU's start waits for its checks), a second three times as long
  // (checked while the first copies) unless the rest would be shorter than the first, then even
  // parts of at least kPartFragments where there are that many.
  std::vector<size_t> ends{kFirstPartFragments};
  if (n >= kSecondPartEnd + kFirstPartFragments) ends.push_back(kSecondPartEnd);
  const size_t from = ends.back();
  const size_t rest = n - from;
  const size_t later = std::clamp<size_t>(rest / kPartFragments, 1, kMaxParts - ends.size());
  for (size_t k = 1; k <= later; ++k) ends.push_back(from + rest * k / later);
  return ends;
}

Status CudaCopyEngine::SubmitInParts(CopyBatch batch, CopyDone done, uint64_t first_part_bytes) {
  const std::vector<CopyFragment>& all = batch.fragments;
  const size_t n = all.size();
  const std::vector<size_t> ends = PartEnds(n);
  auto joint = std::make_shared<Joint>(std::move(done));
  const auto make_part = [&](size_t begin, size_t end, uint64_t bytes) {
    CopyBatch copy{batch.direction,
                   {all.begin() + static_cast<std::ptrdiff_t>(begin), all.begin() + static_cast<std::ptrdiff_t>(end)}};
    auto part = std::make_unique<Batch>(std::move(copy), CopyDone{}, bytes);
    part->joint = joint;
    return part;
  };
  // The first part as a whole batch would be: its errors are Submit's, and nothing is queued.
  std::unique_ptr<Batch> first = make_part(0, ends[0], first_part_bytes);
  ORBITKV_RETURN_IF_ERROR(Admit(first.get()));
  const uint32_t lane = first->lane;
  // Every part counts from the start, so the last PartDone is always a completer's, never this
  // thread's (a rejected part takes off those after it before it is queued).
  {
    MutexLock lock(&joint->mu);
    joint->remaining = ends.size();
  }
  Enqueue(std::move(first));
  // Each later part is resolved while the lane copies the ones ahead. One that fails its checks
  // ends the batch with that error (CopyDone, after the queued parts drain); the rest never run.
  for (size_t k = 1; k < ends.size(); ++k) {
    uint64_t bytes = 0;
    Status status = CheckFragments(all, ends[k - 1], ends[k], &bytes);
    std::unique_ptr<Batch> part = make_part(ends[k - 1], ends[k], bytes);
    if (!status.ok()) {
      // CheckFragments names the fragment by its index in the batch.
      status = Status(status.code(), fmt::format("{} (part from fragment {})", status.message(), ends[k - 1]));
    } else if (status = ResolveAndPin(part.get()); status.ok() && part->lane != lane) {
      Unpin(part->copy);
      status = Status::InvalidArgument(
          fmt::format("fragment {}: a batch copies to or from one device in one direction; this fragment's "
                      "buffer is on another device than fragment 0's",
                      ends[k - 1]));
    } else if (status.ok()) {
      status = Plan(part.get());  // unpins on error
    } else {
      // ResolveAndPin names the fragment by its index in the part.
      status = Status(status.code(), fmt::format("{} (part from fragment {})", status.message(), ends[k - 1]));
    }
    if (!status.ok()) {
      {
        MutexLock lock(&joint->mu);
        joint->remaining -= ends.size() - k - 1;  // the parts after this one never run
      }
      part->rejected = status;
      part->copy.fragments.clear();
      part->lane = lane;
      Enqueue(std::move(part));
      break;
    }
    Enqueue(std::move(part));
  }
  return Status::Ok();
}

Status CudaCopyEngine::ReserveInflight() {
  MutexLock lock(&inflight_mu_);
  if (!accepting_) return Status::Unavailable("copy engine is shut down");
  if (inflight_ >= options_.max_inflight_batches) {
    return Status::ResourceExhausted(
        fmt::format("{} copy batches in flight; retry later", options_.max_inflight_batches));
  }
  ++inflight_;
  return Status::Ok();
}

void CudaCopyEngine::ReleaseInflight() {
  bool drained;
  {
    MutexLock lock(&inflight_mu_);
    ORBITKV_CHECK(inflight_ > 0);
    drained = --inflight_ == 0;
  }
  if (drained) drained_cv_.notify_all();
}

Status CudaCopyEngine::ResolveAndPin(Batch* batch) {
  const std::vector<CopyFragment>& fragments = batch->copy.fragments;
  const bool save = batch->copy.direction == CopyDirection::kSave;
  // Translate the pool side first, without the registry lock (the host ranges change only when a
  // pool is created or destroyed).
  const std::vector<HostMemoryRegistry::Range> host_ranges = host_memory_->Snapshot();
  batch->src.resize(fragments.size());
  batch->dst.resize(fragments.size());
  for (size_t i = 0; i < fragments.size(); ++i) {
    const CopyFragment& f = fragments[i];
    const uint8_t* pool = HostMemoryRegistry::TranslateIn(host_ranges, f.pool, f.length);
    if (pool == nullptr) {
      return Status::InvalidArgument(
          fmt::format("fragment {}: pool range [{}, +{}) is not inside host memory registered with CUDA", i,
                      static_cast<const void*>(f.pool), f.length));
    }
    (save ? batch->dst : batch->src)[i] = reinterpret_cast<uintptr_t>(pool);
  }
  MutexLock lock(&registry_mu_);
  uint32_t device_index = 0;
  for (size_t i = 0; i < fragments.size(); ++i) {
    const CopyFragment& f = fragments[i];
    const Slot* slot = FindLiveSlot(f.buffer);
    if (slot == nullptr) {
      return Status::NotFound(
          fmt::format("fragment {}: buffer {}/{} is not registered", i, f.buffer.index, f.buffer.generation));
    }
    // Two comparisons instead of offset + length, which could overflow.
    if (f.buffer_offset > slot->bytes || f.length > slot->bytes - f.buffer_offset) {
      return Status::InvalidArgument(fmt::format("fragment {}: offset {} length {} exceeds buffer {}/{} of {} bytes", i,
                                                 f.buffer_offset, f.length, f.buffer.index, f.buffer.generation,
                                                 slot->bytes));
    }
    if (i == 0) {
      device_index = slot->device_index;
    } else if (slot->device_index != device_index) {
      return Status::InvalidArgument(
          fmt::format("fragment {}: buffer {}/{} is on device {}, fragment 0's on device {}; one batch copies "
                      "to or from one device",
                      i, f.buffer.index, f.buffer.generation, options_.devices[slot->device_index],
                      options_.devices[device_index]));
    }
    (save ? batch->src : batch->dst)[i] = reinterpret_cast<uintptr_t>(slot->base) + f.buffer_offset;
  }
  for (const CopyFragment& f : fragments) ++slots_[f.buffer.index].pins;
  batch->lane = 2 * device_index + static_cast<uint32_t>(DirectionIndex(batch->copy.direction));
  return Status::Ok();
}

void CudaCopyEngine::Unpin(const CopyBatch& batch) {
  bool retired_slot_unpinned = false;
  {
    MutexLock lock(&registry_mu_);
    for (const CopyFragment& f : batch.fragments) {
      Slot& slot = slots_[f.buffer.index];
      ORBITKV_CHECK(slot.pins > 0);
      if (--slot.pins == 0 && !slot.live) retired_slot_unpinned = true;
    }
  }
  if (retired_slot_unpinned) unpinned_cv_.notify_all();
}

void CudaCopyEngine::DispatchLoop(Lane* lane) {
  t_lane_of = this;
  ScopedDevice scope(lane->device);
  for (;;) {
    std::unique_ptr<Batch> batch;
    std::unique_ptr<Staging> staging;
    bool woken_ahead = false;
    uint64_t queued = 0;
    {
      MutexLock lock(&lane->mu);
      while (lane->pending.empty() && !lane->stop && !lane->woken_ahead) {
        lane->pending_cv.wait(lane->mu);
      }
      woken_ahead = lane->pending.empty() && !lane->stop;
      lane->woken_ahead = false;
      queued = lane->queued.load(std::memory_order_relaxed);
      if (!woken_ahead) {
        if (lane->pending.empty()) break;  // stop is set only once nothing is in flight.
        batch = std::move(lane->pending.front());
        lane->pending.pop_front();
        if (!lane->free_staging.empty()) {
          staging = std::move(lane->free_staging.back());
          lane->free_staging.pop_back();
        }
      }
    }
    if (woken_ahead) {
      wakeups_ahead_total_->Increment();
      // A batch is being built for this lane (Expect): poll for it rather than sleep again, then
      // take it (or, past wake_ahead_us, sleep as usual).
      const int64_t deadline = MonoNanos() + int64_t{options_.wake_ahead_us} * 1000;
      for (int spin = 0; lane->queued.load(std::memory_order_acquire) == queued && MonoNanos() < deadline; ++spin) {
        SpinPause(spin);
      }
      continue;
    }
    batch->launch_status = batch->rejected.ok() ? scope.status() : batch->rejected;
    if (!batch->rejected.ok() && staging != nullptr) {
      MutexLock lock(&lane->mu);  // a rejected part launches nothing
      lane->free_staging.push_back(std::move(staging));
    }
    if (staging == nullptr && batch->launch_status.ok()) {
      // At most max_inflight_batches x kMaxParts staging areas ever exist: one per batch in
      // flight, or per part of a split one.
      staging = std::make_unique<Staging>();
      Result<CudaEvent> event = CudaEvent::Create(lane->device, /*blocking_sync=*/true);
      if (event.ok()) {
        staging->done_event = std::move(event).value();
      } else {
        batch->launch_status = event.status();
        staging.reset();  // Never reused without its event.
      }
    }
    batch->staging = std::move(staging);
    // Before its first copy is queued: the GPU may start on it while the rest is being queued.
    if (options_.completion_poll_us > 0) batch->launched_ns = MonoNanos();
    if (batch->launch_status.ok()) batch->launch_status = Launch(lane, batch.get());
    {
      MutexLock lock(&lane->mu);
      lane->launched.push_back(std::move(batch));
    }
    lane->launched_cv.notify_one();
  }
  t_lane_of = nullptr;
}

bool CudaCopyEngine::ShouldStage(const Lane& lane, const Batch& batch) const {
  if (options_.method != Method::kAuto || lane.slot_bytes == 0) return false;
  // The device's save lane (the other of its pair): with saves in flight the kernel restores (on
  // the H200, staged restores beside kernel saves moved 56 GB/s together, the kernel both ways 75).
  if (lanes_[batch.lane ^ 1]->busy.load(std::memory_order_relaxed) != 0) return false;
  return batch.total_bytes / core::PoolRuns(batch.copy) >= options_.staged_min_run_bytes;
}

void CudaCopyEngine::CompleteLoop(Lane* lane) {
  t_lane_of = this;
  ScopedDevice scope(lane->device);
  for (;;) {
    Batch* head = nullptr;
    {
      MutexLock lock(&lane->mu);
      while (lane->launched.empty() && !lane->stop) lane->launched_cv.wait(lane->mu);
      if (lane->launched.empty()) break;
      // Only this thread pops `launched`, so the head stays valid outside the lock.
      head = lane->launched.front().get();
    }
    Status status = head->launch_status;
    if (status.ok()) status = WaitForBatch(lane, *head);
    std::unique_ptr<Batch> batch;
    {
      MutexLock lock(&lane->mu);
      batch = std::move(lane->launched.front());
      lane->launched.pop_front();
    }
    Finish(lane, std::move(batch), status);
  }
  t_lane_of = nullptr;
}

Status CudaCopyEngine::WaitForBatch(Lane* lane, const Batch& batch) const {
  const cudaEvent_t event = batch.staging->done_event.get();
  const auto failed = [&](cudaError_t error) {
    return CudaStatus(error, fmt::format("{} on device {}", CopyDirectionName(lane->direction), lane->device));
  };
  // Batches this large, launched on an idle lane, measure the lane's rate (their launch is a small
  // part of their time).
  constexpr uint64_t kRateSampleBytes = uint64_t{8} << 20;
  constexpr double kMaxExpectedNs = 10e9;
  constexpr int64_t kMinPollBudgetNs = 2'000'000;
  if (options_.completion_poll_us == 0) return failed(cudaEventSynchronize(event));
  const bool from_idle = batch.launched_ns >= lane->last_done_ns;
  const int64_t start = std::max(batch.launched_ns, lane->last_done_ns);
  Status status;
  if (lane->fastest_bytes_per_ns <= 0) {
    // Blocking until a large batch has shown the lane's rate.
    status = failed(cudaEventSynchronize(event));
  } else {
    const int64_t poll_ns = int64_t{options_.completion_poll_us} * 1000;
    // It starts no earlier than its launch and, in order on the lane, mostly after the batch ahead
    // ended, and takes its bytes at the lane's rate or, with a margin, up to 10% faster. A batch
    // that overlapped the one ahead (another stream) can end sooner: the sleeps are short.
    const int64_t expected = static_cast<int64_t>(
        std::min(kMaxExpectedNs, static_cast<double>(batch.total_bytes) / lane->fastest_bytes_per_ns));
    const int64_t poll_from = start + expected * 9 / 10 - poll_ns;
    const int64_t poll_budget = std::max(kMinPollBudgetNs, expected / 4);
    int64_t polling_since = 0;
    for (;;) {
      const cudaError_t query = cudaEventQuery(event);
      if (query != cudaErrorNotReady) {
        status = failed(query);
        break;
      }
      const int64_t now = MonoNanos();
      if (now < poll_from) {
        std::this_thread::sleep_for(std::chrono::nanoseconds(std::min(poll_from - now, poll_ns)));
        continue;
      }
      if (polling_since == 0) polling_since = now;
      if (now - polling_since > poll_budget) {  // longer than it should be: stop burning the core
        status = failed(cudaEventSynchronize(event));
        break;
      }
      std::this_thread::yield();
    }
  }
  const int64_t done = MonoNanos();
  if (status.ok() && from_idle && batch.total_bytes >= kRateSampleBytes && done > start) {
    lane->fastest_bytes_per_ns = std::max(lane->fastest_bytes_per_ns,
                                          static_cast<double>(batch.total_bytes) / static_cast<double>(done - start));
  }
  lane->last_done_ns = done;
  return status;
}

void CudaCopyEngine::Finish(Lane* lane, std::unique_ptr<Batch> batch, const Status& status) {
  // A split batch counts in the metrics as a whole one does: its bytes and the batch (or its
  // failure) once, at its last part.
  Joint* const joint = batch->joint.get();
  const bool last = joint == nullptr || joint->PartDone(status, batch->total_bytes, &batch->copy);
  if (last) {
    const Status& outcome = joint == nullptr ? status : joint->first_error;
    if (outcome.ok()) {
      lane->bytes_total->Increment(joint == nullptr ? batch->total_bytes : joint->copied_bytes);
      lane->batches_total->Increment();
    } else {
      failed_total_->Increment();
    }
    (joint == nullptr ? batch->done : joint->done)(outcome);
  }
  lane->busy.fetch_sub(1, std::memory_order_relaxed);
  // Only now is the batch no longer in flight: UnregisterBuffer() and Shutdown() wait for CopyDone
  // to return. (A split batch's earlier parts handed their fragments to the joint: still pinned.)
  if (last && joint != nullptr) {
    for (const CopyBatch& part : joint->finished) Unpin(part);
  }
  Unpin(batch->copy);
  if (batch->staging != nullptr) {
    MutexLock lock(&lane->mu);
    lane->free_staging.push_back(std::move(batch->staging));
  }
  batch.reset();
  if (last) {
    inflight_gauge_->Add(-1);
    ReleaseInflight();
  }
}

void CudaCopyEngine::Shutdown() {
  ORBITKV_CHECK_MSG(t_lane_of != this, "Shutdown() from a CopyDone of the same engine");
  MutexLock shutdown_lock(&shutdown_mu_);
  if (shut_down_) return;
  {
    MutexLock lock(&inflight_mu_);
    accepting_ = false;
    while (inflight_ > 0) drained_cv_.wait(inflight_mu_);
  }
  for (const std::unique_ptr<Lane>& lane : lanes_) {
    {
      MutexLock lock(&lane->mu);
      ORBITKV_CHECK(lane->pending.empty() && lane->launched.empty());
      lane->stop = true;
    }
    lane->pending_cv.notify_all();
    lane->launched_cv.notify_all();
  }
  for (const std::unique_ptr<Lane>& lane : lanes_) {
    if (lane->dispatcher.joinable()) lane->dispatcher.join();
    if (lane->completer.joinable()) lane->completer.join();
  }
  shut_down_ = true;
}

}  // namespace orbitkv::gpu
