// CUDA copy engine save/restore GB/s, 4096 scattered pages of 16-256 KiB, vs pinned cudaMemcpy.
//
// Needs a CUDA device (run it on the GPU machine: tests/gpu/run_gate.sh). The pool is a real
// PinnedPool whose arenas the HostMemoryRegistry registered with CUDA, on the NUMA node nearest the
// GPU. For each fragment size, 4096 pool blocks are restored into 4096 engine pages scattered at
// random over twice as many page slots of one device buffer (and saved from another 4096 scattered
// pages into 4096 other blocks); the 4096 pages of one direction are one batch (one Submit, one
// CopyDone), as one request's restore is. A timed pass repeats the batch until it moved at least
// 512 MiB, and GB/s is bytes over the wall time from the first Submit to the last CopyDone (median
// of 5 passes after a checked warm-up pass: every byte compared). The baselines, measured in the
// same run on the same pinned arena: one 1 GiB cudaMemcpyAsync host-to-device (pinned_h2d_peak),
// device-to-host (pinned_d2h_peak), and both at once on two streams (pinned_bidir_peak, bytes of
// both over the wall time). save_restore_concurrent submits the 64 KiB save and restore batches
// together. The metrics come from the engine's default settings (Method::kAuto); the same pages
// through the kernel alone and through cudaMemcpyBatchAsync alone are reported in "env" for
// comparison. restore_gpu_64k_all (a metric with two or more GPUs, in env with one): every visible
// GPU restoring its own 4096 scattered 64 KiB pages at once through one engine, against one pinned
// copy per GPU at once (pinned_h2d_peak_all). ORBITKV_GPU_BENCH_SWEEP=1 also prints, on stderr,
// figures for smaller batches.
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "base/check.h"
#include "base/clock.h"
#include "bench_report.h"
#include "core/slab_pool.h"
#include "gpu/copy_kernels.h"
#include "gpu/cuda_copy_engine.h"
#include "gpu/cuda_util.h"

namespace orbitkv::bench {
namespace {

using core::BufferId;
using core::CopyBatch;
using core::CopyDirection;
using core::CopyFragment;
using gpu::CudaCopyEngine;

constexpr uint32_t kPages = 4096;
// One restore (or save) of the 4096 pages is one batch with one completion, as a request's is.
constexpr uint32_t kPagesPerBatch = 4096;
constexpr uint64_t kMaxFragmentBytes = 256 << 10;
constexpr uint64_t kMinPassBytes = uint64_t{512} << 20;
constexpr uint64_t kPeakBytes = uint64_t{1} << 30;
constexpr int kPasses = 5;

#define CUDA_OK(expr)                                                                                      \
  do {                                                                                                     \
    const cudaError_t orbitkv_error_ = (expr);                                                             \
    ORBITKV_CHECK_MSG(orbitkv_error_ == cudaSuccess, "{}: {}", #expr, cudaGetErrorString(orbitkv_error_)); \
  } while (false)

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

// Waits for a known number of CopyDone calls; CHECKs that each got OK.
class Completions {
 public:
  core::CopyDone Callback() {
    return [this](Status status) {
      ORBITKV_CHECK_MSG(status.ok(), "copy batch failed: {}", status.ToString());
      std::lock_guard lock(mu_);
      ++done_;
      last_done_ns_ = MonoNanos();
      cv_.notify_all();
    };
  }
  // When the latest CopyDone ran (MonoNanos).
  int64_t last_done_ns() {
    std::lock_guard lock(mu_);
    return last_done_ns_;
  }
  void WaitFor(uint64_t count) {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return done_ >= count; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t done_ = 0;
  int64_t last_done_ns_ = 0;
};

void SubmitRetrying(CudaCopyEngine& engine, const CopyBatch& batch, Completions& completions) {
  for (;;) {
    const Status status = engine.Submit(batch, completions.Callback());
    if (status.ok()) return;
    ORBITKV_CHECK_MSG(status.code() == StatusCode::kResourceExhausted, "submit failed: {}", status.ToString());
    std::this_thread::yield();
  }
}

// When a pass's steps happened (MonoNanos): its start, the first Submit's return, the last
// CopyDone, and its waiter awake.
struct PassTimes {
  int64_t start_ns = 0, first_submitted_ns = 0, last_done_ns = 0, woke_ns = 0;
};

// Runs `rounds` x every batch of every list (lists interleaved batch by batch) and returns GB/s.
// `at_start` runs just before the first Submit; `times`, if given, gets the pass's steps.
double RunGbps(CudaCopyEngine& engine, const std::vector<const std::vector<CopyBatch>*>& lists, int rounds,
               PassTimes* times = nullptr, const std::function<void()>& at_start = {}) {
  Completions completions;
  uint64_t batches = 0;
  uint64_t bytes = 0;
  PassTimes pass;
  pass.start_ns = MonoNanos();
  if (at_start) at_start();
  for (int r = 0; r < rounds; ++r) {
    const size_t longest =
        (*std::max_element(lists.begin(), lists.end(), [](auto* a, auto* b) { return a->size() < b->size(); }))->size();
    for (size_t i = 0; i < longest; ++i) {
      for (const std::vector<CopyBatch>* list : lists) {
        if (i >= list->size()) continue;
        SubmitRetrying(engine, (*list)[i], completions);
        if (batches++ == 0) pass.first_submitted_ns = MonoNanos();
        for (const CopyFragment& f : (*list)[i].fragments) bytes += f.length;
      }
    }
  }
  completions.WaitFor(batches);
  pass.woke_ns = MonoNanos();
  pass.last_done_ns = completions.last_done_ns();
  if (times != nullptr) *times = pass;
  return static_cast<double>(bytes) / (static_cast<double>(pass.woke_ns - pass.start_ns) / 1e9) / 1e9;
}

double MedianGbps(CudaCopyEngine& engine, const std::vector<const std::vector<CopyBatch>*>& lists, int rounds) {
  RunGbps(engine, lists, 1);  // Warm-up.
  std::vector<double> passes;
  for (int p = 0; p < kPasses; ++p) passes.push_back(RunGbps(engine, lists, rounds));
  return Median(passes);
}

struct Peaks {
  double h2d = 0, d2h = 0, bidir = 0;
};

// The copy kernel alone on one contiguous kPeakBytes range between the pinned arena and device
// memory, in `chunk`-byte pieces (2 blocks per SM, the engine's default grid): what the SMs'
// reads and writes of host memory reach with no scatter at all, against the copy engines' peak.
std::pair<double, double> MeasureKernelContiguous(uint8_t* pinned, uint8_t* device, uint64_t chunk, int sms) {
  void* mapped = nullptr;
  CUDA_OK(cudaHostGetDevicePointer(&mapped, pinned, 0));
  gpu::CudaStream stream = std::move(gpu::CudaStream::Create(0)).value();
  const uint64_t count = kPeakBytes / chunk;
  auto descriptors = gpu::DeviceMemory::Allocate(0, count * sizeof(gpu::CopyChunk));
  ORBITKV_CHECK_MSG(descriptors.ok(), "{}", descriptors.status().ToString());
  auto timed = [&](bool h2d) {
    std::vector<gpu::CopyChunk> chunks(count);
    for (uint64_t i = 0; i < count; ++i) {
      const uint64_t host = reinterpret_cast<uint64_t>(mapped) + i * chunk;
      const uint64_t dev = reinterpret_cast<uint64_t>(device) + i * chunk;
      chunks[i] = gpu::CopyChunk{h2d ? host : dev, h2d ? dev : host, chunk, 0};
    }
    CUDA_OK(cudaMemcpy(descriptors->data(), chunks.data(), count * sizeof(gpu::CopyChunk), cudaMemcpyHostToDevice));
    std::vector<double> passes;
    for (int p = 0; p < kPasses + 1; ++p) {
      Stopwatch watch;
      CUDA_OK(gpu::LaunchCopyChunks(reinterpret_cast<const gpu::CopyChunk*>(descriptors->data()),
                                    static_cast<uint32_t>(count), static_cast<uint32_t>(2 * sms), stream.get()));
      CUDA_OK(cudaStreamSynchronize(stream.get()));
      const double seconds = watch.ElapsedSeconds();
      if (p > 0) passes.push_back(static_cast<double>(kPeakBytes) / seconds / 1e9);
    }
    return Median(passes);
  };
  return {timed(true), timed(false)};
}

// Host-to-device copies of kPeakBytes in total as back-to-back `piece`-byte cudaMemcpyAsync calls,
// alternating over `streams` streams: what one copy's start and drain cost the copy engines (the
// staging ring copies a slot per call).
double MeasureCopyPieces(uint8_t* pinned, uint8_t* device, uint64_t piece, int streams) {
  std::vector<gpu::CudaStream> lanes;
  for (int i = 0; i < streams; ++i) lanes.push_back(std::move(gpu::CudaStream::Create(0)).value());
  std::vector<double> passes;
  for (int p = 0; p < kPasses + 1; ++p) {
    Stopwatch watch;
    for (uint64_t at = 0, i = 0; at < kPeakBytes; at += piece, ++i) {
      CUDA_OK(cudaMemcpyAsync(device + at, pinned + at, piece, cudaMemcpyHostToDevice, lanes[i % lanes.size()].get()));
    }
    for (gpu::CudaStream& lane : lanes) CUDA_OK(cudaStreamSynchronize(lane.get()));
    const double seconds = watch.ElapsedSeconds();
    if (p > 0) passes.push_back(static_cast<double>(kPeakBytes) / seconds / 1e9);
  }
  return Median(passes);
}

// A model of the staging ring outside the engine: kPeakBytes of pinned memory restored into
// `page`-byte pages scattered over device memory, through `slots` device slots of `slot_bytes`:
// each slot filled by copy-engine copies on one stream, the kernel's device-side scatter of it on
// another, events between them, nothing else. What the ring's pipeline can reach on this GPU. The
// variants take one step toward what the engine does at a time.
struct RingModel {
  uint64_t page = 16 << 10;
  uint64_t slot_bytes = 64 << 20;
  int slots = 4;
  // 0: the source is one contiguous range (one copy per slot). Else runs of run_bytes every
  // run_stride bytes of the arena (a block's pages back to back in its slab), a run cut where a
  // slot ends.
  uint64_t run_bytes = 0;
  uint64_t run_stride = 0;
  bool batch_api = false;         // a slot's runs in cudaMemcpyBatchAsync calls, not one call each
  bool host_descriptors = false;  // the scatter reads its descriptors from mapped pinned memory
  int scatter_streams = 1;        // scatters alternate over this many streams
  // > 0: the pieces go in batches of this many slots as the engine's batches do: a batch's
  // scatters on one of two streams in turn, a blocking-sync event after its last scatter, and a
  // completer thread that waits for each event in order (the engine's completion path).
  int slots_per_batch = 0;
  uint64_t pass_bytes = kPeakBytes;  // bytes per timed pass (the engine bench's passes: 512 MiB)
};

double MeasureRingModel(uint8_t* pinned, uint8_t* device, const RingModel& model, std::mt19937_64& rng, int sms) {
  uint8_t* const pages = device;
  uint8_t* const ring = device + kPeakBytes;
  const uint64_t page_count = kPeakBytes / model.page;
  const uint64_t per_slot = model.slot_bytes / model.page;
  const uint64_t pieces = model.pass_bytes / model.slot_bytes;
  std::vector<uint64_t> order(page_count);
  for (uint64_t i = 0; i < page_count; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<gpu::CopyChunk> chunks(page_count);
  for (uint64_t i = 0; i < page_count; ++i) {
    const uint64_t slot = (i / per_slot) % static_cast<uint64_t>(model.slots);
    chunks[i] = gpu::CopyChunk{reinterpret_cast<uint64_t>(ring + slot * model.slot_bytes + (i % per_slot) * model.page),
                               reinterpret_cast<uint64_t>(pages + order[i] * model.page), model.page, 0};
  }
  // Each piece's copies into its slot: (source, offset in the slot, bytes).
  struct Copy {
    const uint8_t* from;
    uint64_t at;
    uint64_t bytes;
  };
  std::vector<std::vector<Copy>> copies(pieces);
  for (uint64_t piece = 0; piece < pieces; ++piece) {
    if (model.run_bytes == 0) {
      copies[piece].push_back({pinned + piece * model.slot_bytes, 0, model.slot_bytes});
      continue;
    }
    for (uint64_t at = 0; at < model.slot_bytes;) {
      const uint64_t data = piece * model.slot_bytes + at;  // offset in the concatenated runs
      const uint64_t run = data / model.run_bytes, into = data % model.run_bytes;
      const uint64_t take = std::min(model.run_bytes - into, model.slot_bytes - at);
      copies[piece].push_back({pinned + run * model.run_stride + into, at, take});
      at += take;
    }
  }
  auto descriptors = gpu::DeviceMemory::Allocate(0, chunks.size() * sizeof(gpu::CopyChunk));
  ORBITKV_CHECK_MSG(descriptors.ok(), "{}", descriptors.status().ToString());
  CUDA_OK(
      cudaMemcpy(descriptors->data(), chunks.data(), chunks.size() * sizeof(gpu::CopyChunk), cudaMemcpyHostToDevice));
  auto mapped = gpu::PinnedHostMemory::Allocate(0, chunks.size() * sizeof(gpu::CopyChunk));
  ORBITKV_CHECK_MSG(mapped.ok(), "{}", mapped.status().ToString());
  std::memcpy(mapped->data(), chunks.data(), chunks.size() * sizeof(gpu::CopyChunk));
  const auto* device_chunks =
      reinterpret_cast<const gpu::CopyChunk*>(model.host_descriptors ? mapped->device_data() : descriptors->data());
  gpu::CudaStream copy = std::move(gpu::CudaStream::Create(0)).value();
  std::vector<gpu::CudaStream> scatters;
  const int scatter_streams = model.slots_per_batch > 0 ? 2 : model.scatter_streams;
  for (int i = 0; i < scatter_streams; ++i) {
    scatters.push_back(std::move(gpu::CudaStream::Create(0)).value());
  }
  // The engine-like completion path (slots_per_batch > 0).
  const uint64_t batches = model.slots_per_batch > 0
                               ? (pieces + static_cast<uint64_t>(model.slots_per_batch) - 1) / model.slots_per_batch
                               : 0;
  std::vector<gpu::CudaEvent> done;
  for (uint64_t b = 0; b < batches; ++b) {
    done.push_back(std::move(gpu::CudaEvent::Create(0, /*blocking_sync=*/true)).value());
  }
  std::mutex completer_mu;
  std::condition_variable completer_cv;
  uint64_t recorded = 0, completed = 0;
  bool stop = false;
  std::thread completer;
  if (batches > 0) {
    completer = std::thread([&] {
      for (;;) {
        uint64_t next;
        {
          std::unique_lock lock(completer_mu);
          completer_cv.wait(lock, [&] { return stop || completed < recorded; });
          if (completed >= recorded) return;
          next = completed;
        }
        CUDA_OK(cudaEventSynchronize(done[next % batches].get()));
        {
          std::lock_guard lock(completer_mu);
          ++completed;
        }
        completer_cv.notify_all();
      }
    });
  }
  std::vector<gpu::CudaEvent> filled, freed;
  for (int i = 0; i < model.slots; ++i) {
    filled.push_back(std::move(gpu::CudaEvent::Create(0, false)).value());
    freed.push_back(std::move(gpu::CudaEvent::Create(0, false)).value());
  }
  cudaMemcpyAttributes attributes{};
  attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attributes.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
  std::vector<double> passes;
  for (int p = 0; p < kPasses + 1; ++p) {
    Stopwatch watch;
    for (uint64_t piece = 0; piece < pieces; ++piece) {
      const int slot = static_cast<int>(piece % static_cast<uint64_t>(model.slots));
      uint8_t* const slot_at = ring + slot * model.slot_bytes;
      cudaStream_t scatter = model.slots_per_batch > 0
                                 ? scatters[(piece / static_cast<uint64_t>(model.slots_per_batch)) % 2].get()
                                 : scatters[piece % scatters.size()].get();
      if (piece >= static_cast<uint64_t>(model.slots)) {
        CUDA_OK(cudaStreamWaitEvent(copy.get(), freed[slot].get(), 0));
      }
      if (model.batch_api) {
        dsts.clear();
        srcs.clear();
        sizes.clear();
        for (const Copy& c : copies[piece]) {
          dsts.push_back(slot_at + c.at);
          srcs.push_back(c.from);
          sizes.push_back(c.bytes);
        }
        size_t first = 0;
        CUDA_OK(cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), dsts.size(), &attributes, &first, 1,
                                     copy.get()));
      } else {
        for (const Copy& c : copies[piece]) {
          CUDA_OK(cudaMemcpyAsync(slot_at + c.at, c.from, c.bytes, cudaMemcpyHostToDevice, copy.get()));
        }
      }
      CUDA_OK(cudaEventRecord(filled[slot].get(), copy.get()));
      CUDA_OK(cudaStreamWaitEvent(scatter, filled[slot].get(), 0));
      CUDA_OK(gpu::LaunchCopyChunks(device_chunks + piece * per_slot, static_cast<uint32_t>(per_slot),
                                    static_cast<uint32_t>(2 * sms), scatter));
      CUDA_OK(cudaEventRecord(freed[slot].get(), scatter));
      if (model.slots_per_batch > 0 &&
          ((piece + 1) % static_cast<uint64_t>(model.slots_per_batch) == 0 || piece + 1 == pieces)) {
        const uint64_t b = piece / static_cast<uint64_t>(model.slots_per_batch);
        CUDA_OK(cudaEventRecord(done[b].get(), scatter));
        {
          std::lock_guard lock(completer_mu);
          ++recorded;
        }
        completer_cv.notify_all();
      }
    }
    if (batches > 0) {  // the pass ends when the completer saw every batch's event
      std::unique_lock lock(completer_mu);
      completer_cv.wait(lock, [&] { return completed == recorded; });
    }
    CUDA_OK(cudaStreamSynchronize(copy.get()));
    for (gpu::CudaStream& s : scatters) CUDA_OK(cudaStreamSynchronize(s.get()));
    const double seconds = watch.ElapsedSeconds();
    if (p > 0) passes.push_back(static_cast<double>(pieces * model.slot_bytes) / seconds / 1e9);
    if (batches > 0) {
      std::lock_guard lock(completer_mu);
      recorded = completed = 0;  // the next pass reuses the events from the first
    }
  }
  if (batches > 0) {
    {
      std::lock_guard lock(completer_mu);
      stop = true;
    }
    completer_cv.notify_all();
    completer.join();
  }
  return Median(passes);
}

// One large copy per direction between the pinned arena and device memory, and both at once.
Peaks MeasurePeaks(uint8_t* pinned, uint8_t* device) {
  gpu::CudaStream up = std::move(gpu::CudaStream::Create(0)).value();
  gpu::CudaStream down = std::move(gpu::CudaStream::Create(0)).value();
  uint8_t* const host_up = pinned;
  uint8_t* const host_down = pinned + kPeakBytes;
  uint8_t* const device_up = device;
  uint8_t* const device_down = device + kPeakBytes;
  auto timed = [&](bool h2d, bool d2h) {
    std::vector<double> passes;
    for (int p = 0; p < kPasses + 1; ++p) {
      Stopwatch watch;
      if (h2d) {
        CUDA_OK(cudaMemcpyAsync(device_up, host_up, kPeakBytes, cudaMemcpyHostToDevice, up.get()));
      }
      if (d2h) {
        CUDA_OK(cudaMemcpyAsync(host_down, device_down, kPeakBytes, cudaMemcpyDeviceToHost, down.get()));
      }
      CUDA_OK(cudaStreamSynchronize(up.get()));
      CUDA_OK(cudaStreamSynchronize(down.get()));
      const double seconds = watch.ElapsedSeconds();
      if (p > 0) passes.push_back((h2d + d2h) * static_cast<double>(kPeakBytes) / seconds / 1e9);
    }
    return Median(passes);
  };
  return Peaks{timed(true, false), timed(false, true), timed(true, true)};
}

// The pages of one fragment size: 4096 restore blocks -> scattered device slots, and 4096 other
// scattered device slots -> 4096 save blocks, as batches of kPagesPerBatch pages.
struct PageSet {
  uint64_t fragment_bytes = 0;
  std::vector<core::PoolBlock> restore_blocks, save_blocks;
  std::vector<uint32_t> restore_slots, save_slots;
  std::vector<CopyBatch> restores, saves;
};

PageSet MakePageSet(core::PinnedPool& pool, BufferId buffer, uint64_t fragment_bytes, std::mt19937_64& rng,
                    uint32_t pages_per_batch = kPagesPerBatch) {
  PageSet set;
  set.fragment_bytes = fragment_bytes;
  std::vector<uint32_t> slots(2 * kPages);
  for (uint32_t i = 0; i < slots.size(); ++i) slots[i] = i;
  std::shuffle(slots.begin(), slots.end(), rng);
  set.restore_slots.assign(slots.begin(), slots.begin() + kPages);
  set.save_slots.assign(slots.begin() + kPages, slots.end());
  for (uint32_t i = 0; i < 2 * kPages; ++i) {
    auto block = pool.Allocate(fragment_bytes);
    ORBITKV_CHECK_MSG(block.ok(), "pool allocation failed: {}", block.status().ToString());
    (i < kPages ? set.restore_blocks : set.save_blocks).push_back(*block);
  }
  for (uint32_t first = 0; first < kPages; first += pages_per_batch) {
    CopyBatch restore{CopyDirection::kRestore, {}};
    CopyBatch save{CopyDirection::kSave, {}};
    for (uint32_t i = first; i < first + pages_per_batch; ++i) {
      restore.fragments.push_back(
          CopyFragment{buffer, set.restore_slots[i] * fragment_bytes, set.restore_blocks[i].data, fragment_bytes});
      save.fragments.push_back(
          CopyFragment{buffer, set.save_slots[i] * fragment_bytes, set.save_blocks[i].data, fragment_bytes});
    }
    set.restores.push_back(std::move(restore));
    set.saves.push_back(std::move(save));
  }
  return set;
}

void FreePageSet(core::PinnedPool& pool, PageSet& set) {
  for (const core::PoolBlock& block : set.restore_blocks) pool.Free(block);
  for (const core::PoolBlock& block : set.save_blocks) pool.Free(block);
  set = PageSet{};
}

void FillRandom(uint8_t* data, uint64_t bytes, std::mt19937_64& rng) {
  uint64_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    const uint64_t word = rng();
    std::memcpy(data + i, &word, 8);
  }
  for (; i < bytes; ++i) data[i] = static_cast<uint8_t>(rng());
}

// One checked pass of each direction: every restored page equals its block, every saved block
// equals its page.
void CheckBytes(CudaCopyEngine& engine, const PageSet& set, uint8_t* device, std::mt19937_64& rng) {
  const uint64_t f = set.fragment_bytes;
  const uint64_t device_bytes = 2 * kPages * f;
  for (const core::PoolBlock& block : set.restore_blocks) FillRandom(block.data, f, rng);
  std::vector<uint8_t> pages(device_bytes);
  FillRandom(pages.data(), device_bytes, rng);
  CUDA_OK(cudaMemcpy(device, pages.data(), device_bytes, cudaMemcpyHostToDevice));
  for (const core::PoolBlock& block : set.save_blocks) std::memset(block.data, 0xA5, f);
  RunGbps(engine, {&set.restores}, 1);
  RunGbps(engine, {&set.saves}, 1);
  std::vector<uint8_t> after(device_bytes);
  CUDA_OK(cudaMemcpy(after.data(), device, device_bytes, cudaMemcpyDeviceToHost));
  for (uint32_t i = 0; i < kPages; ++i) {
    ORBITKV_CHECK_MSG(std::memcmp(after.data() + set.restore_slots[i] * f, set.restore_blocks[i].data, f) == 0,
                      "restored page {} ({} KiB fragments) differs from its block", i, f >> 10);
    ORBITKV_CHECK_MSG(std::memcmp(set.save_blocks[i].data, pages.data() + set.save_slots[i] * f, f) == 0,
                      "saved block {} ({} KiB fragments) differs from its page", i, f >> 10);
  }
}

int RoundsFor(uint64_t fragment_bytes) {
  return static_cast<int>(std::max<uint64_t>(1, kMinPassBytes / (kPages * fragment_bytes)));
}

std::unique_ptr<CudaCopyEngine> MakeEngine(const gpu::HostMemoryRegistry& registry, CudaCopyEngine::Options options,
                                           MetricsRegistry* metrics = nullptr) {
  options.devices = {0};
  auto engine = CudaCopyEngine::Create(options, &registry, metrics);
  ORBITKV_CHECK_MSG(engine.ok(), "copy engine: {}", engine.status().ToString());
  return std::move(engine).value();
}

BufferId RegisterDevice(CudaCopyEngine& engine, uint8_t* device, uint64_t bytes) {
  auto id = engine.RegisterDeviceBuffer(device, 0, bytes);
  ORBITKV_CHECK_MSG(id.ok(), "register: {}", id.status().ToString());
  return *id;
}

void SetBuffer(PageSet& set, BufferId id) {
  for (std::vector<CopyBatch>* list : {&set.restores, &set.saves}) {
    for (CopyBatch& batch : *list) {
      for (CopyFragment& f : batch.fragments) f.buffer = id;
    }
  }
}

// How late a thread learns of things on this machine (microseconds, medians): a 16 MiB pinned
// copy waited for by a blocking-sync event against the same copy waited for by polling
// (cudaEventQuery and yield), the difference being the wake-up's cost; a condition variable's
// one-way wake between two threads; and how long sleep_for(50us) sleeps.
std::string WakeLatencies(uint8_t* pinned, uint8_t* device) {
  constexpr uint64_t kBytes = 16 << 20;
  constexpr int kRounds = 60;
  gpu::CudaStream stream = std::move(gpu::CudaStream::Create(0)).value();
  gpu::CudaEvent blocking = std::move(gpu::CudaEvent::Create(0, /*blocking_sync=*/true)).value();
  gpu::CudaEvent polled = std::move(gpu::CudaEvent::Create(0, /*blocking_sync=*/false)).value();
  auto copy_then = [&](bool poll) {
    std::vector<double> us;
    for (int i = 0; i < kRounds; ++i) {
      Stopwatch watch;
      CUDA_OK(cudaMemcpyAsync(device, pinned, kBytes, cudaMemcpyHostToDevice, stream.get()));
      CUDA_OK(cudaEventRecord(poll ? polled.get() : blocking.get(), stream.get()));
      if (poll) {
        while (cudaEventQuery(polled.get()) == cudaErrorNotReady) std::this_thread::yield();
      } else {
        CUDA_OK(cudaEventSynchronize(blocking.get()));
      }
      us.push_back(watch.ElapsedSeconds() * 1e6);
    }
    return Median(us);
  };
  copy_then(true);  // warm-up
  const double blocked = copy_then(false), polled_us = copy_then(true);
  std::mutex mu;
  std::condition_variable cv;
  int turn = 0;  // even: the main thread's, odd: the other's
  std::vector<double> one_way;
  int64_t sent_at = 0;
  std::thread other([&] {
    for (int i = 0; i < kRounds; ++i) {
      std::unique_lock lock(mu);
      cv.wait(lock, [&] { return turn % 2 == 1; });
      one_way.push_back(static_cast<double>(MonoNanos() - sent_at) / 1e3);
      ++turn;
      cv.notify_all();
    }
  });
  for (int i = 0; i < kRounds; ++i) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));  // let the other thread sleep
    std::unique_lock lock(mu);
    sent_at = MonoNanos();
    ++turn;
    cv.notify_all();
    cv.wait(lock, [&] { return turn % 2 == 0; });
  }
  other.join();
  std::vector<double> slept;
  for (int i = 0; i < kRounds; ++i) {
    Stopwatch watch;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
    slept.push_back(watch.ElapsedSeconds() * 1e6);
  }
  return fmt::format(
      "16 MiB copy waited by a blocking-sync event {:.1f} us, polled {:.1f} us (wake-up {:.1f} "
      "us); condition variable one way {:.1f} us; sleep_for(50us) {:.1f} us",
      blocked, polled_us, blocked - polled_us, Median(one_way), Median(slept));
}

// The shape of an async restore of a Qwen3-8B-shaped model: `blocks` blocks of 36 pages of 64 KiB,
// each block's pages back to back in a 4 MiB slab of the pinned arena (one run of 2.25 MiB), every
// page to its own scattered device page, as ONE batch (a 4K-token restore is 9216 fragments, an
// 8K one 18432). Checked byte for byte once, then GB/s (median of kPasses after a warm-up) through
// each engine, in turn.
std::string BlockRestores(const gpu::HostMemoryRegistry& registry, uint8_t* pinned, uint64_t pinned_bytes,
                          uint8_t* device, uint64_t device_bytes, uint64_t blocks, std::mt19937_64& rng) {
  constexpr uint64_t kPage = 64 << 10, kPagesPerBlock = 36, kSlab = 4 << 20;
  const uint64_t pages = blocks * kPagesPerBlock;
  if (pages > device_bytes / kPage || blocks * kSlab > pinned_bytes) {
    return "does not fit this bench's buffers";
  }
  std::vector<uint64_t> slots(device_bytes / kPage);
  for (uint64_t i = 0; i < slots.size(); ++i) slots[i] = i;
  std::shuffle(slots.begin(), slots.end(), rng);
  CopyBatch batch{CopyDirection::kRestore, {}};
  for (uint64_t b = 0; b < blocks; ++b) {
    for (uint64_t l = 0; l < kPagesPerBlock; ++l) {
      batch.fragments.push_back(
          CopyFragment{BufferId{}, slots[b * kPagesPerBlock + l] * kPage, pinned + b * kSlab + l * kPage, kPage});
    }
  }
  for (uint64_t b = 0; b < blocks; ++b) FillRandom(pinned + b * kSlab, kPagesPerBlock * kPage, rng);
  struct Variant {
    const char* name;
    CudaCopyEngine::Options options;
  };
  const std::vector<Variant> variants = {
      {"default", {}},
      {"whole", {.split_min_fragments = 0}},
      {"copy_engines", {.staged_max_fragment_bytes = 1}},
      {"blocking", {.completion_poll_us = 0}},
      {"no_wake_ahead", {.wake_ahead_us = 0}},
  };
  std::vector<std::unique_ptr<CudaCopyEngine>> engines;
  std::vector<std::vector<CopyBatch>> lists;
  for (const Variant& v : variants) {
    engines.push_back(MakeEngine(registry, v.options));
    const BufferId id = RegisterDevice(*engines.back(), device, device_bytes);
    CopyBatch mine = batch;
    for (CopyFragment& f : mine.fragments) f.buffer = id;
    lists.push_back({std::move(mine)});
  }
  // Every byte, once, through the default engine.
  CUDA_OK(cudaMemset(device, 0xA5, device_bytes));
  RunGbps(*engines[0], {&lists[0]}, 1);
  std::vector<uint8_t> after(device_bytes);
  CUDA_OK(cudaMemcpy(after.data(), device, device_bytes, cudaMemcpyDeviceToHost));
  for (const CopyFragment& f : batch.fragments) {
    ORBITKV_CHECK_MSG(std::memcmp(after.data() + f.buffer_offset, f.pool, kPage) == 0,
                      "block restore: the page at {} differs from its pool bytes", f.buffer_offset);
  }
  std::vector<std::vector<double>> gbps(variants.size());
  for (int turn = 0; turn < 3; ++turn) {
    for (size_t v = 0; v < variants.size(); ++v) {
      gbps[v].push_back(MedianGbps(*engines[v], {&lists[v]}, 1));
    }
  }
  std::string out =
      fmt::format("{} fragments of 64 KiB from {} runs of 2.25 MiB, one batch:", batch.fragments.size(), blocks);
  for (size_t v = 0; v < variants.size(); ++v) {
    out += fmt::format(" {} {:.1f}", variants[v].name, Median(gbps[v]));
    engines[v]->Shutdown();
  }
  return out + " GB/s";
}

// Where a staged restore's time goes, on the GPU's own clock (Options::ring_timeline_slots): one
// pass of `lists` through an engine with `options` and a timeline, after a warm-up pass. Fill GB/s
// is the slots' bytes over their copies' time alone; busy is the share of the copy stream's span
// (first fill's start to last fill's end) spent copying; span GB/s counts from the first fill's
// start to the last scatter's end; wall GB/s is the same pass timed by the caller, Submit to the
// last CopyDone's waiter waking. The wall's rest, split: start (a mark recorded on an idle stream
// of the caller's just before the first Submit, to the first fill's start, on the GPU's clock; of
// it, the first Submit call on the CPU), end (the last scatter's end to the last CopyDone, the CPU
// clock less the GPU's start and span) and hand-off (that CopyDone to its waiter awake).
std::string RingTimeline(const gpu::HostMemoryRegistry& registry, uint8_t* device, uint64_t device_bytes,
                         CudaCopyEngine::Options options, PageSet& set, int rounds) {
  options.ring_timeline_slots = 4096;
  auto engine = MakeEngine(registry, options);
  SetBuffer(set, RegisterDevice(*engine, device, device_bytes));
  RunGbps(*engine, {&set.restores}, rounds);  // warm-up: staging areas, first touches
  if (auto first = engine->TakeRingTimeline(0); !first.ok()) {
    engine->Shutdown();
    return fmt::format("no timeline: {}", first.status().ToString());  // e.g. no room for a ring
  }
  gpu::CudaStream side = std::move(gpu::CudaStream::Create(0)).value();
  gpu::CudaEvent origin = std::move(gpu::CudaEvent::Create(0, false, /*timing=*/true)).value();
  PassTimes pass;
  const double wall =
      RunGbps(*engine, {&set.restores}, rounds, &pass, [&] { CUDA_OK(cudaEventRecord(origin.get(), side.get())); });
  CUDA_OK(cudaEventSynchronize(origin.get()));
  auto timeline = engine->TakeRingTimeline(0, origin.get());
  ORBITKV_CHECK_MSG(timeline.ok(), "timeline: {}", timeline.status().ToString());
  engine->Shutdown();
  if (timeline->empty()) return fmt::format("no staged slot (wall {:.1f} GB/s)", wall);
  const std::vector<CudaCopyEngine::RingSlotTiming>& t = *timeline;
  uint64_t slot_bytes = 0, runs = 0;
  double filling = 0, scatter = 0, largest_gap = 0, gaps = 0;
  for (size_t i = 0; i < t.size(); ++i) {
    slot_bytes += t[i].bytes;
    runs += t[i].runs;
    filling += t[i].fill_end_ms - t[i].fill_start_ms;
    scatter += t[i].scatter_end_ms - t[i].fill_end_ms;
    if (i > 0) {
      const double gap = t[i].fill_start_ms - t[i - 1].fill_end_ms;
      gaps += gap;
      largest_gap = std::max(largest_gap, gap);
    }
  }
  const double gb = static_cast<double>(slot_bytes) / 1e9;
  const double copy_span = t.back().fill_end_ms - t.front().fill_start_ms;
  double last_scatter = 0;
  for (const auto& slot : t) last_scatter = std::max(last_scatter, slot.scatter_end_ms);
  const double start_ms = t.front().fill_start_ms;
  const double span_ms = last_scatter - start_ms;
  const auto ms_since_start = [&](int64_t ns) { return static_cast<double>(ns - pass.start_ns) / 1e6; };
  return fmt::format(
      "{} slots, {:.1f} runs each: fill {:.1f} GB/s, copy stream busy {:.3f} (gaps {:.3f} ms in "
      "all, largest {:.3f}), fill to scatter end {:.3f} ms a slot, span {:.1f} GB/s, wall {:.1f} "
      "GB/s; start {:.3f} ms (first Submit {:.3f}), end {:.3f} ms, hand-off {:.3f} ms",
      t.size(), static_cast<double>(runs) / static_cast<double>(t.size()), gb / (filling / 1e3), filling / copy_span,
      gaps, largest_gap, scatter / static_cast<double>(t.size()), gb / (span_ms / 1e3), wall, start_ms,
      ms_since_start(pass.first_submitted_ns), ms_since_start(pass.last_done_ns) - last_scatter,
      static_cast<double>(pass.woke_ns - pass.last_done_ns) / 1e6);
}

// Every visible GPU restoring at once (restore_gpu_64k_all): one engine with a lane per device,
// 4096 scattered 64 KiB pages per device, one batch per device per round, submitted device by
// device; checked byte for byte first. The baseline (pinned_h2d_peak_all): one pinned
// cudaMemcpyAsync per device from its own slice of the arena, all at once, bytes of all over the
// wall time. On one GPU both reduce to the single-device figures.
struct AllDevices {
  double restore = 0, peak = 0;
};

AllDevices MeasureAllDevices(gpu::HostMemoryRegistry& registry, core::PinnedPool& pool, int devices,
                             std::mt19937_64& rng) {
  constexpr uint64_t kFragment = 64 << 10;
  const uint64_t device_bytes = 2 * kPages * kFragment;
  std::vector<gpu::DeviceMemory> memory;
  std::vector<gpu::CudaStream> streams;
  for (int d = 0; d < devices; ++d) {
    auto m = gpu::DeviceMemory::Allocate(d, std::max(device_bytes, kPeakBytes));
    ORBITKV_CHECK_MSG(m.ok(), "device {} memory: {}", d, m.status().ToString());
    memory.push_back(std::move(m).value());
    streams.push_back(std::move(gpu::CudaStream::Create(d)).value());
  }
  AllDevices out;
  {
    // The arena's bytes are free: no block is allocated while this runs.
    const uint64_t slice =
        std::min<uint64_t>(kPeakBytes, pool.arena(0).size() / static_cast<uint64_t>(devices)) & ~uint64_t{4095};
    std::vector<double> passes;
    for (int p = 0; p < kPasses + 1; ++p) {
      Stopwatch watch;
      for (int d = 0; d < devices; ++d) {
        CUDA_OK(cudaMemcpyAsync(memory[d].data(), pool.arena(0).data() + d * slice, slice, cudaMemcpyHostToDevice,
                                streams[d].get()));
      }
      for (int d = 0; d < devices; ++d) CUDA_OK(cudaStreamSynchronize(streams[d].get()));
      const double seconds = watch.ElapsedSeconds();
      if (p > 0) passes.push_back(static_cast<double>(devices * slice) / seconds / 1e9);
    }
    out.peak = Median(passes);
  }
  CudaCopyEngine::Options options;
  for (int d = 0; d < devices; ++d) options.devices.push_back(d);
  auto created = CudaCopyEngine::Create(options, &registry, nullptr);
  ORBITKV_CHECK_MSG(created.ok(), "copy engine on {} devices: {}", devices, created.status().ToString());
  CudaCopyEngine& engine = **created;
  std::vector<std::vector<CopyBatch>> lists(devices);
  std::vector<std::vector<core::PoolBlock>> blocks(devices);
  std::vector<std::vector<uint32_t>> slots(devices);
  for (int d = 0; d < devices; ++d) {
    auto id = engine.RegisterDeviceBuffer(memory[d].data(), d, device_bytes);
    ORBITKV_CHECK_MSG(id.ok(), "register device {}: {}", d, id.status().ToString());
    std::vector<uint32_t> all(2 * kPages);
    for (uint32_t i = 0; i < all.size(); ++i) all[i] = i;
    std::shuffle(all.begin(), all.end(), rng);
    slots[d].assign(all.begin(), all.begin() + kPages);
    CopyBatch batch{CopyDirection::kRestore, {}};
    for (uint32_t i = 0; i < kPages; ++i) {
      auto block = pool.Allocate(kFragment);
      ORBITKV_CHECK_MSG(block.ok(), "pool allocation failed: {}", block.status().ToString());
      FillRandom(block->data, kFragment, rng);
      blocks[d].push_back(*block);
      batch.fragments.push_back(CopyFragment{*id, slots[d][i] * kFragment, block->data, kFragment});
    }
    lists[d].push_back(std::move(batch));
  }
  std::vector<const std::vector<CopyBatch>*> all_lists;
  for (const auto& list : lists) all_lists.push_back(&list);
  RunGbps(engine, all_lists, 1);
  std::vector<uint8_t> after(device_bytes);
  for (int d = 0; d < devices; ++d) {
    CUDA_OK(cudaMemcpy(after.data(), memory[d].data(), device_bytes, cudaMemcpyDeviceToHost));
    for (uint32_t i = 0; i < kPages; ++i) {
      ORBITKV_CHECK_MSG(std::memcmp(after.data() + slots[d][i] * kFragment, blocks[d][i].data, kFragment) == 0,
                        "device {}: restored page {} differs from its block", d, i);
    }
  }
  out.restore = MedianGbps(engine, all_lists, RoundsFor(kFragment));
  engine.Shutdown();
  for (const auto& list : blocks) {
    for (const core::PoolBlock& block : list) pool.Free(block);
  }
  return out;
}

// GB/s of restore, save and both at once for other settings, on stderr (for tuning the defaults;
// ORBITKV_GPU_BENCH_SWEEP=1): other batch sizes, grid sizes and chunk sizes for the kernel.
void Sweep(gpu::HostMemoryRegistry& registry, core::PinnedPool& pool, uint8_t* device, std::mt19937_64& rng) {
  using Method = CudaCopyEngine::Method;
  constexpr uint64_t k16 = 16 << 10, k64 = 64 << 10, k256 = 256 << 10;
  struct Config {
    const char* name;
    uint64_t fragment;
    uint32_t pages_per_batch;
    CudaCopyEngine::Options options;
  };
  const std::vector<Config> configs = {
      {"kernel", k16, 64, {.method = Method::kKernel}},    {"kernel", k16, 256, {.method = Method::kKernel}},
      {"kernel", k16, 1024, {.method = Method::kKernel}},  {"kernel", k64, 4096, {.method = Method::kKernel}},
      {"kernel", k256, 4096, {.method = Method::kKernel}}, {"copy engines", k64, 256, {.method = Method::kMemcpyBatch}},
  };

  for (const Config& config : configs) {
    auto engine = MakeEngine(registry, config.options);
    const BufferId id = RegisterDevice(*engine, device, 2 * kPages * kMaxFragmentBytes);
    PageSet set = MakePageSet(pool, id, config.fragment, rng, config.pages_per_batch);
    const int rounds = RoundsFor(config.fragment);
    const double restore = MedianGbps(*engine, {&set.restores}, rounds);
    const double save = MedianGbps(*engine, {&set.saves}, rounds);
    const double both = MedianGbps(*engine, {&set.restores, &set.saves}, rounds);
    fmt::print(stderr,
               "sweep fragment={}KiB pages_per_batch={} {}: restore={:.1f} save={:.1f} "
               "concurrent={:.1f} GB/s\n",
               config.fragment >> 10, config.pages_per_batch, config.name, restore, save, both);
    FreePageSet(pool, set);
  }
}

}  // namespace
}  // namespace orbitkv::bench

int main(int argc, char** argv) {
  using namespace orbitkv;
  using namespace orbitkv::bench;
  const bool json =
      ParseBenchArgs(argc, argv,
                     "Save and restore GB/s through the CUDA copy engine for 4096 scattered pages of 16, 64 "
                     "and 256 KiB fragments, vs one large pinned cudaMemcpy per direction (needs a GPU).");
  int devices = 0;
  if (const cudaError_t error = cudaGetDeviceCount(&devices); error != cudaSuccess || devices == 0) {
    fmt::print(stderr, "gpu_bench: no CUDA device ({}); run it on the GPU machine\n", cudaGetErrorString(error));
    return 1;
  }
  BenchReport report("gpu");
  AddStandardEnv(report);
  cudaDeviceProp properties{};
  CUDA_OK(cudaGetDeviceProperties(&properties, 0));
  char pci[32] = {};
  CUDA_OK(cudaDeviceGetPCIBusId(pci, sizeof(pci), 0));
  int driver = 0;
  CUDA_OK(cudaDriverGetVersion(&driver));
  const Result<int> node = core::NumaNodeOfPciDevice(pci);
  const int numa_node = node.ok() ? *node : -1;
  report.AddEnv("gpu", fmt::format("{} ({}, {} SMs)", properties.name, pci, properties.multiProcessorCount));
  report.AddEnv("cuda_driver", fmt::format("{}.{}", driver / 1000, (driver % 1000) / 10));
  report.AddEnv("pool_numa_node", std::to_string(numa_node));

  gpu::HostMemoryRegistry registry(0);
  core::PoolOptions pool_options;
  pool_options.capacity_bytes = 2 * kPages * kMaxFragmentBytes + (uint64_t{64} << 20);
  pool_options.numa_nodes = {numa_node};
  pool_options.pin_mode = core::PinMode::kAllowUnpinned;
  pool_options.registrar = &registry;
  auto pool_or = core::PinnedPool::Create(pool_options, nullptr);
  ORBITKV_CHECK_MSG(pool_or.ok(), "pool: {}", pool_or.status().ToString());
  core::PinnedPool& pool = **pool_or;
  report.AddEnv("pool_locked", pool.arena(0).locked() ? "yes" : "no");
  auto device_or = gpu::DeviceMemory::Allocate(0, 2 * kPages * kMaxFragmentBytes);
  ORBITKV_CHECK_MSG(device_or.ok(), "device memory: {}", device_or.status().ToString());
  uint8_t* const device = device_or->data();
  std::mt19937_64 rng(2026);

  // Baselines first, on the fresh arena (no block allocated yet, so its bytes are free to use).
  const Peaks peaks = MeasurePeaks(pool.arena(0).data(), device);
  for (uint64_t chunk : {uint64_t{16} << 10, uint64_t{64} << 10}) {
    const auto [restore, save] =
        MeasureKernelContiguous(pool.arena(0).data(), device, chunk, properties.multiProcessorCount);
    report.AddEnv(fmt::format("kernel_contiguous_{}k", chunk >> 10),
                  fmt::format("restore {:.1f} ({:.3f} of the peak), save {:.1f} ({:.3f}) GB/s", restore,
                              restore / peaks.h2d, save, save / peaks.d2h));
  }
  report.AddEnv("wake_latency", WakeLatencies(pool.arena(0).data(), device));
  std::mt19937_64 ring_rng(7);  // its own: the pages below keep their placement
  const uint64_t mib = 1 << 20;
  const std::vector<std::pair<std::string, RingModel>> ring_models = {
      {"16k_64m_slots", {}},
      {"16k_16m_slots", {.slot_bytes = 16 * mib}},
      {"16k_64m_host_descriptors", {.host_descriptors = true}},
      {"16k_64m_two_scatter_streams", {.scatter_streams = 2}},
      // Qwen3-8B blocks: 2.25 MiB of 64 KiB pages in 4 MiB slabs.
      {"64k_blocks_16m_slots",
       {.page = 64 << 10, .slot_bytes = 16 * mib, .run_bytes = 2304 << 10, .run_stride = 4 * mib}},
      {"64k_blocks_16m_slots_batch_api",
       {.page = 64 << 10, .slot_bytes = 16 * mib, .run_bytes = 2304 << 10, .run_stride = 4 * mib, .batch_api = true}},
      {"64k_blocks_64m_slots", {.page = 64 << 10, .run_bytes = 2304 << 10, .run_stride = 4 * mib}},
      {"64k_blocks_64m_slots_batch_api",
       {.page = 64 << 10, .run_bytes = 2304 << 10, .run_stride = 4 * mib, .batch_api = true}},
      // One step at a time toward the engine's restore_gpu_16k (16 MiB slots, batches of 4,
      // descriptors in mapped memory, 512 MiB passes).
      {"16k_16m_slots_half_passes", {.slot_bytes = 16 * mib, .pass_bytes = 512 * mib}},
      {"16k_16m_slots_batches_of_4", {.slot_bytes = 16 * mib, .slots_per_batch = 4, .pass_bytes = 512 * mib}},
      {"16k_16m_slots_batches_of_4_host_descriptors",
       {.slot_bytes = 16 * mib, .host_descriptors = true, .slots_per_batch = 4, .pass_bytes = 512 * mib}},
      // ... and each slot's one run through cudaMemcpyBatchAsync, as the engine fills it.
      {"16k_16m_slots_batches_of_4_host_descriptors_batch_api",
       {.slot_bytes = 16 * mib,
        .batch_api = true,
        .host_descriptors = true,
        .slots_per_batch = 4,
        .pass_bytes = 512 * mib}},
  };
  for (const auto& [name, model] : ring_models) {
    const double ring = MeasureRingModel(pool.arena(0).data(), device, model, ring_rng, properties.multiProcessorCount);
    report.AddEnv("ring_model_" + name,
                  fmt::format("restore {:.1f} ({:.3f} of the peak) GB/s", ring, ring / peaks.h2d));
  }
  for (uint64_t piece_mib : {64, 16, 4, 1}) {
    const double one = MeasureCopyPieces(pool.arena(0).data(), device, piece_mib << 20, 1);
    const double two = MeasureCopyPieces(pool.arena(0).data(), device, piece_mib << 20, 2);
    report.AddEnv(fmt::format("h2d_copies_of_{}m", piece_mib),
                  fmt::format("one stream {:.1f} ({:.3f} of the peak), two {:.1f} ({:.3f}) GB/s", one, one / peaks.h2d,
                              two, two / peaks.h2d));
  }

  // The default engine gives the metrics; the kernel alone and the copy engines alone run the same
  // pages for comparison (in "env").
  const CudaCopyEngine::Options defaults;
  auto engine = MakeEngine(registry, defaults);
  // Batches go whole in these (the default queues batches of 4096 fragments or more in parts; the
  // one-batch figures below compare the two).
  const CudaCopyEngine::Options kernel_options{.method = CudaCopyEngine::Method::kKernel, .split_min_fragments = 0};
  auto kernel = MakeEngine(registry, kernel_options);
  auto batch_api = MakeEngine(registry, {.method = CudaCopyEngine::Method::kMemcpyBatch});
  // Every restore of small fragments through the staging ring, whatever its pool runs (the default
  // stages only runs averaging 1 MiB or more, and has no ring unless given one); the copy engines
  // only for fragments of 1 MiB. The ring's size: ORBITKV_GPU_BENCH_STAGING_MIB (default 256).
  MetricsRegistry staged_metrics;
  const char* staging_mib = std::getenv("ORBITKV_GPU_BENCH_STAGING_MIB");
  const CudaCopyEngine::Options staged_options{
      .dma_min_fragment_bytes = uint64_t{1} << 20,
      .restore_staging_bytes = (staging_mib != nullptr ? std::strtoull(staging_mib, nullptr, 10) : 256) << 20,
      .staged_min_run_bytes = 1,
      .split_min_fragments = 0};
  auto staged = MakeEngine(registry, staged_options, &staged_metrics);
  report.AddEnv("engine", fmt::format("auto (copy engines from {} KiB fragments, else kernel), kernel chunk "
                                      "{} KiB, {} blocks/SM, {} streams per lane, {} pages per batch",
                                      defaults.dma_min_fragment_bytes >> 10, defaults.chunk_bytes >> 10,
                                      defaults.blocks_per_sm, defaults.streams_per_lane, kPagesPerBatch));
  const uint64_t device_bytes = 2 * kPages * kMaxFragmentBytes;
  const BufferId id = RegisterDevice(*engine, device, device_bytes);
  const BufferId kernel_id = RegisterDevice(*kernel, device, device_bytes);
  const BufferId batch_id = RegisterDevice(*batch_api, device, device_bytes);
  const BufferId staged_id = RegisterDevice(*staged, device, device_bytes);
  for (const uint64_t fragment : {uint64_t{16} << 10, uint64_t{64} << 10, uint64_t{256} << 10}) {
    const std::string size = fmt::format("{}k", fragment >> 10);
    const int rounds = RoundsFor(fragment);
    PageSet set = MakePageSet(pool, id, fragment, rng);
    CheckBytes(*engine, set, device, rng);
    report.Add(
        {"restore_gpu_" + size, "GB/s", MedianGbps(*engine, {&set.restores}, rounds), "pinned_h2d_peak", peaks.h2d});
    report.Add({"save_gpu_" + size, "GB/s", MedianGbps(*engine, {&set.saves}, rounds), "pinned_d2h_peak", peaks.d2h});
    if (fragment == (uint64_t{64} << 10)) {
      report.Add({"save_restore_concurrent", "GB/s", MedianGbps(*engine, {&set.restores, &set.saves}, rounds),
                  "pinned_bidir_peak", peaks.bidir});
    }
    // How much of the restore's pool side is adjacent (the staged path's condition).
    report.AddEnv(fmt::format("restore_pool_runs_{}", size),
                  fmt::format("{} runs in a batch of {} fragments", core::PoolRuns(set.restores[0]),
                              set.restores[0].fragments.size()));
    for (const auto& [name, other, other_id] :
         {std::tuple{"kernel", kernel.get(), kernel_id}, std::tuple{"memcpy_batch", batch_api.get(), batch_id},
          std::tuple{"staged", staged.get(), staged_id}}) {
      SetBuffer(set, other_id);
      CheckBytes(*other, set, device, rng);
      report.AddEnv(fmt::format("{}_{}", name, size),
                    fmt::format("restore {:.1f}, save {:.1f}, concurrent {:.1f} GB/s",
                                MedianGbps(*other, {&set.restores}, rounds), MedianGbps(*other, {&set.saves}, rounds),
                                MedianGbps(*other, {&set.restores, &set.saves}, rounds)));
    }
    if (fragment == (uint64_t{16} << 10)) {
      // Passes four times as long: how much of the gap is the pipeline's start and drain per pass.
      SetBuffer(set, staged_id);
      report.AddEnv("staged_16k_long_passes",
                    fmt::format("restore {:.1f} GB/s", MedianGbps(*staged, {&set.restores}, 4 * rounds)));
      // The same pass as one batch (the pages `rounds` times over): what the engine loses from
      // batch to batch, against what it loses inside one.
      std::vector<CopyBatch> one{CopyBatch{CopyDirection::kRestore, {}}};
      for (int r = 0; r < rounds; ++r) {
        for (const CopyBatch& b : set.restores) {
          one[0].fragments.insert(one[0].fragments.end(), b.fragments.begin(), b.fragments.end());
        }
      }
      report.AddEnv("staged_16k_one_batch", fmt::format("restore {:.1f} GB/s", MedianGbps(*staged, {&one}, 1)));
      for (CopyFragment& f : one[0].fragments) f.buffer = kernel_id;
      report.AddEnv("kernel_16k_one_batch", fmt::format("restore {:.1f} GB/s", MedianGbps(*kernel, {&one}, 1)));
      // The same batch queued in parts (Options::split_min_fragments): the GPU starts after the
      // first part's Submit work, not the whole batch's.
      for (const auto& [name, base] : {std::pair{"staged", staged_options}, std::pair{"kernel", kernel_options}}) {
        CudaCopyEngine::Options split = base;
        split.split_min_fragments = 8192;
        auto parts = MakeEngine(registry, split);
        const BufferId parts_id = RegisterDevice(*parts, device, device_bytes);
        std::vector<CopyBatch> in_parts = one;
        for (CopyFragment& f : in_parts[0].fragments) f.buffer = parts_id;
        report.AddEnv(fmt::format("{}_16k_one_batch_in_parts", name),
                      fmt::format("restore {:.1f} GB/s", MedianGbps(*parts, {&in_parts}, 1)));
        parts->Shutdown();
      }
      // The same pages read from the arena's first 64 MiB, where the peak and the ring model
      // read: whether where the pool's bytes sit costs the copy engines.
      std::vector<CopyBatch> front = set.restores;
      for (CopyBatch& b : front) {
        for (size_t j = 0; j < b.fragments.size(); ++j) {
          b.fragments[j].pool = pool.arena(0).data() + j * fragment;
          b.fragments[j].buffer = staged_id;
        }
      }
      report.AddEnv("staged_16k_arena_front",
                    fmt::format("restore {:.1f} GB/s", MedianGbps(*staged, {&front}, rounds)));
      // The caller's share of it: Submit() alone (checks, translation, pins; a copy of the batch).
      std::vector<double> submits;
      for (int p = 0; p < kPasses; ++p) {
        Completions completions;
        Stopwatch watch;
        SubmitRetrying(*kernel, one[0], completions);
        submits.push_back(watch.ElapsedSeconds() * 1e9 / static_cast<double>(one[0].fragments.size()));
        completions.WaitFor(1);
      }
      report.AddEnv("submit_ns_per_fragment",
                    fmt::format("{:.1f} ns ({} fragments)", Median(submits), one[0].fragments.size()));
    }
    // Where the default engine's staged restores spend their time, on the GPU's clock, and the same
    // with the dispatcher woken only when each batch is queued (the pass's start).
    CudaCopyEngine::Options blocking_options = defaults, late_wake_options = defaults;
    blocking_options.completion_poll_us = 0;
    late_wake_options.wake_ahead_us = 0;
    CudaCopyEngine::Options whole_options = defaults;
    whole_options.split_min_fragments = 0;
    report.AddEnv(fmt::format("timeline_{}", size),
                  RingTimeline(registry, device, device_bytes, defaults, set, rounds));
    report.AddEnv(fmt::format("timeline_{}_no_wake_ahead", size),
                  RingTimeline(registry, device, device_bytes, late_wake_options, set, rounds));
    // The defaults (the completer polling near each batch's end, the dispatcher woken as Submit
    // begins, 4096-page batches in parts) against the completer blocking in cudaEventSynchronize,
    // the dispatcher woken when the batch is queued, and the batches whole, in turn (drift hits
    // them alike).
    {
      const std::vector<std::pair<const char*, CudaCopyEngine::Options>> variants = {
          {"default", defaults},
          {"blocking", blocking_options},
          {"no wake-ahead", late_wake_options},
          {"whole", whole_options}};
      std::vector<std::unique_ptr<CudaCopyEngine>> engines;
      std::vector<BufferId> ids;
      for (const auto& [name, options] : variants) {
        engines.push_back(MakeEngine(registry, options));
        ids.push_back(RegisterDevice(*engines.back(), device, device_bytes));
      }
      std::vector<std::vector<double>> gbps(variants.size());
      for (int turn = 0; turn < 3; ++turn) {
        for (size_t v = 0; v < variants.size(); ++v) {
          SetBuffer(set, ids[v]);
          gbps[v].push_back(MedianGbps(*engines[v], {&set.restores}, rounds));
        }
      }
      std::string line = "restore";
      for (size_t v = 0; v < variants.size(); ++v) {
        line += fmt::format("{} {} {:.1f}", v == 0 ? "" : ",", variants[v].first, Median(gbps[v]));
        engines[v]->Shutdown();
      }
      report.AddEnv(fmt::format("completion_{}", size), line + " GB/s");
    }
    // The metric's engine and pages once more, after everything above: whether the metric's first
    // passes over these pages ran slower than later ones (docs/gpu.md, H100 2026-12-05).
    SetBuffer(set, id);
    report.AddEnv(fmt::format("restore_gpu_{}_again", size),
                  fmt::format("{:.1f} GB/s", MedianGbps(*engine, {&set.restores}, rounds)));
    FreePageSet(pool, set);
  }
  // The shape of the vLLM connector's async restores of 4K and 8K tokens (restore_8k_gbps in the
  // TTFT bench): default (staged, in parts, polling), whole, copy engines, blocking completer,
  // the dispatcher woken late.
  // (The arena's bytes are free to use raw here: every page set was freed.)
  for (const uint64_t blocks : {uint64_t{256}, uint64_t{512}}) {
    report.AddEnv(
        fmt::format("blocks_64k_{}", blocks),
        BlockRestores(registry, pool.arena(0).data(), pool.arena(0).size(), device, device_bytes, blocks, rng));
  }
  // Every GPU at once (issue 24's restore_gpu_64k_all): a metric where there are several, in env
  // on one (where it is restore_gpu_64k again, through the multi-device code path).
  const AllDevices all = MeasureAllDevices(registry, pool, devices, rng);
  if (devices > 1) {
    report.Add({"restore_gpu_64k_all", "GB/s", all.restore, "pinned_h2d_peak_all", all.peak});
  } else {
    report.AddEnv("restore_gpu_64k_all", fmt::format("1 device: restore {:.1f} GB/s against {:.1f} ({:.3f})",
                                                     all.restore, all.peak, all.restore / all.peak));
  }
  report.AddEnv("devices", std::to_string(devices));
  report.AddEnv(
      "staged_restores",
      fmt::format("{} batches through the ring",
                  staged_metrics.GetCounter("orbitkv_copy_staged_batches_total", "", {{"engine", "cuda"}}).Value()));
  engine->Shutdown();
  kernel->Shutdown();
  batch_api->Shutdown();
  staged->Shutdown();
  report.Print(json);
  std::fflush(stdout);
  if (const char* sweep = std::getenv("ORBITKV_GPU_BENCH_SWEEP"); sweep != nullptr && std::string(sweep) == "1") {
    Sweep(registry, pool, device, rng);
  }
  return 0;
}
