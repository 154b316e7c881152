// DescriptorArena: the shared-memory half of a channel session, and the SPSC rings inside it.
//
// The Manager creates the arena (a memfd sized by ArenaLayout, header written, then sealed against
// resizing so neither side can make the other fault on a truncated mapping) and passes the fd to
// the engine, which maps it and validates the header against the Welcome frame. The request ring
// carries engine -> Manager descriptors, the reply ring the other way; payload slots follow.
//
// Ring protocol (one producer and one consumer per ring, in different processes): the producer
// copies a descriptor into entry head % entries, then publishes head with a release store; the
// consumer reads head with an acquire load, copies the entry out, then publishes tail with a
// release store. A consumer about to sleep sets consumer_waiting and re-checks head (both
// sequentially consistent), and a producer rings the doorbell only if it sees consumer_waiting
// after publishing head (also sequentially consistent): no wakeup is lost. Indices read from the
// other process are validated (0 <= head - tail <= entries); a violation is DataLoss and poisons
// the session.
//
// Thread safety: an arena may be used from any thread, but each ring end has exactly one user at a
// time.
#ifndef ORBITKV_CHANNEL_ARENA_H_
#define ORBITKV_CHANNEL_ARENA_H_

#include <cstdint>
#include <memory>
#include <span>

#include "base/result.h"
#include "base/scoped_fd.h"
#include "channel/wire.h"

namespace orbitkv::channel {

struct ArenaLayout {
  uint32_t ring_entries = 256;
  uint32_t payload_slots = 64;
  uint32_t slot_bytes = 64 * 1024;
  // Derived by Compute().
  uint64_t request_ring_offset = 0;
  uint64_t reply_ring_offset = 0;
  uint64_t slots_offset = 0;
  uint64_t claims_offset = 0;  // one claim word (u64) per payload slot, after the slots (claims.h)
  uint64_t arena_bytes = 0;

  // Validates the three sizes (ring_entries a power of two in [16, 4096], payload_slots in [1,
  // 1024], slot_bytes a multiple of 4096 in [4096, 1 MiB]) and computes the offsets.
  // InvalidArgument names the bad field.
  static Result<ArenaLayout> Compute(uint32_t ring_entries, uint32_t payload_slots, uint32_t slot_bytes);
};

class DescriptorArena {
 public:
  // Manager side: a new sealed memfd arena with its header written.
  static Result<std::unique_ptr<DescriptorArena>> Create(const ArenaLayout& layout, uint64_t session_epoch);
  // Engine side: maps `fd` and checks its seals, size and header against what Welcome announced.
  static Result<std::unique_ptr<DescriptorArena>> Attach(ScopedFd fd, const WelcomeBody& welcome);

  ~DescriptorArena();
  DescriptorArena(const DescriptorArena&) = delete;
  DescriptorArena& operator=(const DescriptorArena&) = delete;

  const ArenaLayout& layout() const { return layout_; }
  uint64_t session_epoch() const { return session_epoch_; }
  const ScopedFd& fd() const { return fd_; }

  RingControl* request_control() const;
  Descriptor* request_entries() const;
  RingControl* reply_control() const;
  Descriptor* reply_entries() const;
  // The payload slot `index` (< payload_slots), slot_bytes long.
  std::span<uint8_t> slot(uint32_t index) const;
  // The claim word of payload slot `index`: shared by both processes, used through claims.h only.
  uint64_t* claim_word(uint32_t index) const;
  // Every claim word, through the arena's end (page-aligned and whole pages: see ArenaLayout).
  std::span<uint8_t> claim_region() const;

 private:
  DescriptorArena(ScopedFd fd, uint8_t* base, const ArenaLayout& layout, uint64_t session_epoch)
      : fd_(std::move(fd)), base_(base), layout_(layout), session_epoch_(session_epoch) {}

  // Immutable after construction.
  ScopedFd fd_;
  uint8_t* const base_;
  const ArenaLayout layout_;
  const uint64_t session_epoch_;
};

// The producer end of a ring.
class RingProducer {
 public:
  RingProducer(RingControl* control, Descriptor* entries, uint32_t entries_count)
      : control_(control), entries_(entries), count_(entries_count) {}

  // Appends `d`. ResourceExhausted when the ring is full; DataLoss when the consumer's tail is
  // corrupt.
  Status TryPush(const Descriptor& d);
  // True when the consumer announced it is sleeping (ring its doorbell).
  bool ConsumerWaiting() const;

 private:
  RingControl* control_;
  Descriptor* entries_;
  uint32_t count_;
  uint64_t head_ = 0;  // only this end writes head, so it keeps its own copy
};

// The consumer end of a ring.
class RingConsumer {
 public:
  RingConsumer(RingControl* control, Descriptor* entries, uint32_t entries_count)
      : control_(control), entries_(entries), count_(entries_count) {}

  // Copies the next descriptor into *out: true if there was one, false if empty. DataLoss when the
  // producer's head is corrupt (ahead by more than the ring size, or behind the tail).
  Result<bool> TryPop(Descriptor* out);
  // Announces that this end is about to sleep on its doorbell, then re-checks: returns true if a
  // descriptor arrived meanwhile (do not sleep). Pair every true or false with ClearWaiting after
  // waking.
  Result<bool> PrepareToWait();
  void ClearWaiting();

 private:
  Result<uint64_t> ValidatedHead() const;

  RingControl* control_;
  Descriptor* entries_;
  uint32_t count_;
  uint64_t tail_ = 0;  // only this end writes tail
};

}  // namespace orbitkv::channel

#endif  // ORBITKV_CHANNEL_ARENA_H_
