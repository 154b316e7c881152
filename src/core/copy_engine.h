// CopyEngine: moves bytes between an inference engine's KV buffers and the pinned DRAM pool, in
// batches.
//
// A caller (a restore or a save of one request) describes its copies as one CopyBatch: a direction
// and a list of fragments, each a contiguous byte range of a registered engine buffer paired with a
// range of the same length in the host pool. The engine copies every fragment, in any order and
// possibly in parallel, and then calls the batch's CopyDone once. Implementations differ in what a
// buffer is and how it is registered (the CPU engine takes a host pointer into a shared-memory
// mapping; the GPU engine imports a CUDA IPC handle), so registration lives in the concrete class;
// this interface is what the block cache programs against.
//
// Contract of Submit, for every implementation:
//   - Validation first. Every fragment must name a registered, live buffer (right index and
//     generation), lie within it (offset + length <= buffer size, computed without overflow), have
//     a non-null pool address and a non-zero length; the batch must have at least one fragment and
//     a non-null `done`. A batch that fails any check is rejected whole: Submit returns
//     InvalidArgument (NotFound for an unknown or stale buffer), copies no byte and never calls
//     `done` (except past the first part of a batch queued in parts, below).
//   - An accepted batch (Submit returned OK) calls `done` exactly once, from an engine thread
//     (never from inside Submit), after every fragment has been copied; the copied bytes are
//     visible to whoever `done` signals. The Status passed to `done` is OK unless the device failed
//     mid-copy (the CPU engine never fails), or, in a CUDA engine that queues large batches in
//     parts (CudaCopyEngine::Options::split_min_fragments: 4096 by default), a fragment past the
//     first part failed its checks: then `done` gets that check's error once the parts ahead
//     drained, and the fragments from that part on are never copied.
//   - Backpressure: each engine bounds the batches in flight (accepted, `done` not yet returned).
//     Beyond the bound Submit returns ResourceExhausted and the caller retries later; nothing is
//     queued without bound. Validation comes first, so an invalid batch is never answered "retry
//     later".
//   - After Shutdown() began, Submit returns Unavailable. Shutdown() lets every accepted batch
//     complete (its `done` runs), then joins the engine's threads; it is idempotent.
//   - Fragments of one batch are independent: their engine ranges must not overlap each other when
//     restoring, nor their pool ranges when saving, or the overlapping bytes are unspecified.
//     Nothing checks this.
//
// Thread safety: Submit() may be called from any thread, including from inside a CopyDone.
// Shutdown() may be called from any thread except an engine thread (a CopyDone), where it would
// wait on itself.
#ifndef ORBITKV_CORE_COPY_ENGINE_H_
#define ORBITKV_CORE_COPY_ENGINE_H_

#include <compare>
#include <cstdint>
#include <functional>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace orbitkv::core {

enum class CopyDirection : uint8_t {
  kSave = 0,     // Engine buffer -> pool (a request publishes its KV).
  kRestore = 1,  // Pool -> engine buffer (a request reuses cached KV).
};

// "save" or "restore" (metric labels, logs); "invalid" for a value outside the enum.
constexpr std::string_view CopyDirectionName(CopyDirection direction) {
  switch (direction) {
    case CopyDirection::kSave:
      return "save";
    case CopyDirection::kRestore:
      return "restore";
  }
  return "invalid";
}

// Names a registered engine buffer. It crosses processes (the engine adapter names its buffers in
// requests), so it is an {index, generation} pair validated on every use: unregistering bumps the
// slot's generation, and a stale id is then NotFound rather than an alias of whatever is registered
// at that index next. Generation 0 is never issued, so a default-constructed BufferId is never
// valid.
struct BufferId {
  uint32_t index = 0;
  uint32_t generation = 0;

  // Generation in the high 32 bits, index in the low 32 bits: the layout of the id on the wire.
  constexpr uint64_t Pack() const { return (uint64_t{generation} << 32) | index; }
  static constexpr BufferId Unpack(uint64_t packed) {
    return BufferId{static_cast<uint32_t>(packed), static_cast<uint32_t>(packed >> 32)};
  }

  friend constexpr auto operator<=>(const BufferId&, const BufferId&) = default;
};
static_assert(sizeof(BufferId) == 8, "BufferId packs into one uint64_t");

// One contiguous copy: `length` bytes at `buffer_offset` in the engine buffer `buffer`, and at
// `pool` in the host pool. The direction of the batch says which side is the source.
struct CopyFragment {
  BufferId buffer;
  uint64_t buffer_offset = 0;
  // Not owned; must stay valid until the batch's CopyDone has been called.
  uint8_t* pool = nullptr;
  uint64_t length = 0;
};

struct CopyBatch {
  CopyDirection direction = CopyDirection::kRestore;
  std::vector<CopyFragment> fragments;
};

// Runs of adjacent pool memory in the batch's fragment order (a fragment whose pool side starts
// where the previous one's ends continues its run); 0 for no fragments.
inline uint64_t PoolRuns(const CopyBatch& batch) {
  uint64_t runs = batch.fragments.empty() ? 0 : 1;
  for (size_t i = 1; i < batch.fragments.size(); ++i) {
    const CopyFragment& previous = batch.fragments[i - 1];
    if (batch.fragments[i].pool != previous.pool + previous.length) ++runs;
  }
  return runs;
}

// Called exactly once per accepted batch, from an engine thread. It should be short (it holds an
// engine thread) and must not call Shutdown() or wait for batches of the same engine to complete.
using CopyDone = std::function<void(Status)>;

class CopyEngine {
 public:
  virtual ~CopyEngine() = default;

  // Validates `batch` and queues it (see the contract above): OK, InvalidArgument, NotFound,
  // ResourceExhausted or Unavailable. Both arguments are taken by value, so a rejected batch and
  // its `done` are destroyed without `done` being called; a caller that retries after
  // ResourceExhausted submits copies (or rebuilds the batch).
  virtual Status Submit(CopyBatch batch, CopyDone done) = 0;

  // A hint before a Submit: a batch whose fragments name `buffer` and copy in `direction` is being
  // built. An engine whose worker sleeps may wake it now, so that the batch's first copy does not
  // wait for a wake-up after Submit. Reserves nothing; the default ignores it.
  virtual void Expect(BufferId /*buffer*/, CopyDirection /*direction*/) {}

  // Stops accepting batches, waits for every accepted batch to complete and joins the engine's
  // threads.
  virtual void Shutdown() = 0;

  // A short constant naming the implementation ("cpu", "cuda"), used as the metrics label `engine`.
  virtual std::string_view name() const = 0;
};

}  // namespace orbitkv::core

#endif  // ORBITKV_CORE_COPY_ENGINE_H_
