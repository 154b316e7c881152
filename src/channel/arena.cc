#include "channel/arena.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <bit>
#include <cstring>

#include "base/check.h"

namespace orbitkv::channel {
namespace {

constexpr uint64_t kPage = 4096;
constexpr uint32_t kRequiredSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

uint64_t RoundUp(uint64_t v, uint64_t to) { return (v + to - 1) / to * to; }

// Cross-process atomics on plain fields of the shared mapping.
std::atomic_ref<uint64_t> AtomicU64(uint64_t& field) { return std::atomic_ref<uint64_t>(field); }
std::atomic_ref<uint32_t> AtomicU32(uint32_t& field) { return std::atomic_ref<uint32_t>(field); }

}  // namespace

Result<ArenaLayout> ArenaLayout::Compute(uint32_t ring_entries, uint32_t payload_slots, uint32_t slot_bytes) {
  if (ring_entries < 16 || ring_entries > 4096 || !std::has_single_bit(ring_entries)) {
    return Status::InvalidArgument(fmt::format("ring_entries {} is not a power of two in [16, 4096]", ring_entries));
  }
  if (payload_slots < 1 || payload_slots > 1024) {
    return Status::InvalidArgument(fmt::format("payload_slots {} is not in [1, 1024]", payload_slots));
  }
  if (slot_bytes < kPage || slot_bytes > (1u << 20) || slot_bytes % kPage != 0) {
    return Status::InvalidArgument(
        fmt::format("slot_bytes {} is not a multiple of 4096 in [4096, 1048576]", slot_bytes));
  }
  ArenaLayout layout;
  layout.ring_entries = ring_entries;
  layout.payload_slots = payload_slots;
  layout.slot_bytes = slot_bytes;
  const uint64_t ring_bytes = sizeof(RingControl) + uint64_t{ring_entries} * sizeof(Descriptor);
  layout.request_ring_offset = 256;  // after the header, cache-line aligned
  layout.reply_ring_offset = RoundUp(layout.request_ring_offset + ring_bytes, 256);
  layout.slots_offset = RoundUp(layout.reply_ring_offset + ring_bytes, kPage);
  layout.claims_offset = layout.slots_offset + uint64_t{payload_slots} * slot_bytes;
  layout.arena_bytes = RoundUp(layout.claims_offset + uint64_t{payload_slots} * sizeof(uint64_t), kPage);
  return layout;
}

Result<std::unique_ptr<DescriptorArena>> DescriptorArena::Create(const ArenaLayout& requested, uint64_t session_epoch) {
  ORBITKV_ASSIGN_OR_RETURN(ArenaLayout layout,
                           ArenaLayout::Compute(requested.ring_entries, requested.payload_slots, requested.slot_bytes));
  ScopedFd fd(memfd_create("orbitkv-channel", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid()) return ErrnoStatus("memfd_create for the channel arena", errno);
  if (ftruncate(fd.get(), static_cast<off_t>(layout.arena_bytes)) != 0) {
    return ErrnoStatus("ftruncate channel arena", errno);
  }
  if (fcntl(fd.get(), F_ADD_SEALS, kRequiredSeals) != 0) return ErrnoStatus("seal channel arena", errno);
  void* mapped = mmap(nullptr, layout.arena_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (mapped == MAP_FAILED) return ErrnoStatus("mmap channel arena", errno);
  auto* base = static_cast<uint8_t*>(mapped);
  ArenaHeader header{};
  header.magic = kMagic;
  header.version = kWireVersion;
  header.ring_entries = layout.ring_entries;
  header.payload_slots = layout.payload_slots;
  header.slot_bytes = layout.slot_bytes;
  header.session_epoch = session_epoch;
  header.arena_bytes = layout.arena_bytes;
  header.request_ring_offset = layout.request_ring_offset;
  header.reply_ring_offset = layout.reply_ring_offset;
  header.slots_offset = layout.slots_offset;
  std::memcpy(base, &header, sizeof(header));
  return std::unique_ptr<DescriptorArena>(new DescriptorArena(std::move(fd), base, layout, session_epoch));
}

Result<std::unique_ptr<DescriptorArena>> DescriptorArena::Attach(ScopedFd fd, const WelcomeBody& welcome) {
  ORBITKV_ASSIGN_OR_RETURN(ArenaLayout layout,
                           ArenaLayout::Compute(welcome.ring_entries, welcome.payload_slots, welcome.slot_bytes));
  if (layout.arena_bytes != welcome.arena_bytes) {
    return Status::DataLoss(fmt::format("channel arena size {} does not match its layout ({} bytes)",
                                        welcome.arena_bytes, layout.arena_bytes));
  }
  const int seals = fcntl(fd.get(), F_GET_SEALS);
  if (seals < 0) return ErrnoStatus("F_GET_SEALS on the channel arena", errno);
  if ((static_cast<uint32_t>(seals) & kRequiredSeals) != kRequiredSeals) {
    return Status::PermissionDenied("channel arena is not sealed against resizing");
  }
  struct stat st {};
  if (fstat(fd.get(), &st) != 0) return ErrnoStatus("fstat channel arena", errno);
  if (static_cast<uint64_t>(st.st_size) != layout.arena_bytes) {
    return Status::DataLoss(fmt::format("channel arena is {} bytes, expected {}", st.st_size, layout.arena_bytes));
  }
  void* mapped = mmap(nullptr, layout.arena_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (mapped == MAP_FAILED) return ErrnoStatus("mmap channel arena", errno);
  auto arena = std::unique_ptr<DescriptorArena>(
      new DescriptorArena(std::move(fd), static_cast<uint8_t*>(mapped), layout, welcome.session_epoch));
  ArenaHeader header;
  std::memcpy(&header, mapped, sizeof(header));
  if (header.magic != kMagic || header.version != kWireVersion || header.session_epoch != welcome.session_epoch ||
      header.ring_entries != layout.ring_entries || header.payload_slots != layout.payload_slots ||
      header.slot_bytes != layout.slot_bytes || header.request_ring_offset != layout.request_ring_offset ||
      header.reply_ring_offset != layout.reply_ring_offset || header.slots_offset != layout.slots_offset) {
    return Status::DataLoss("channel arena header does not match the Welcome frame");
  }
  return arena;
}

DescriptorArena::~DescriptorArena() { munmap(base_, layout_.arena_bytes); }

RingControl* DescriptorArena::request_control() const {
  return reinterpret_cast<RingControl*>(base_ + layout_.request_ring_offset);
}
Descriptor* DescriptorArena::request_entries() const {
  return reinterpret_cast<Descriptor*>(base_ + layout_.request_ring_offset + sizeof(RingControl));
}
RingControl* DescriptorArena::reply_control() const {
  return reinterpret_cast<RingControl*>(base_ + layout_.reply_ring_offset);
}
Descriptor* DescriptorArena::reply_entries() const {
  return reinterpret_cast<Descriptor*>(base_ + layout_.reply_ring_offset + sizeof(RingControl));
}
std::span<uint8_t> DescriptorArena::slot(uint32_t index) const {
  ORBITKV_CHECK(index < layout_.payload_slots);
  return {base_ + layout_.slots_offset + uint64_t{index} * layout_.slot_bytes, layout_.slot_bytes};
}

uint64_t* DescriptorArena::claim_word(uint32_t index) const {
  ORBITKV_CHECK(index < layout_.payload_slots);
  return reinterpret_cast<uint64_t*>(base_ + layout_.claims_offset) + index;
}

std::span<uint8_t> DescriptorArena::claim_region() const {
  return {base_ + layout_.claims_offset, layout_.arena_bytes - layout_.claims_offset};
}

Status RingProducer::TryPush(const Descriptor& d) {
  // Acquire pairs with the consumer's release of tail: its copy-out of the entry we would overwrite
  // is done.
  const uint64_t tail = AtomicU64(control_->tail).load(std::memory_order_acquire);
  if (tail > head_ || head_ - tail > count_) {
    return Status::DataLoss(fmt::format("ring tail {} is inconsistent with head {}", tail, head_));
  }
  if (head_ - tail == count_) return Status::ResourceExhausted("descriptor ring is full");
  std::memcpy(&entries_[head_ % count_], &d, sizeof(d));
  ++head_;
  // Sequentially consistent (not just release): orders this store before the consumer_waiting load
  // in ConsumerWaiting, the other half of the no-lost-wakeup handshake.
  AtomicU64(control_->head).store(head_, std::memory_order_seq_cst);
  return Status::Ok();
}

bool RingProducer::ConsumerWaiting() const {
  return AtomicU32(control_->consumer_waiting).load(std::memory_order_seq_cst) != 0;
}

Result<uint64_t> RingConsumer::ValidatedHead() const {
  // Acquire pairs with the producer's store of head: the entries before it are fully written.
  const uint64_t head = AtomicU64(control_->head).load(std::memory_order_acquire);
  if (head < tail_ || head - tail_ > count_) {
    return Status::DataLoss(fmt::format("ring head {} is inconsistent with tail {}", head, tail_));
  }
  return head;
}

Result<bool> RingConsumer::TryPop(Descriptor* out) {
  ORBITKV_ASSIGN_OR_RETURN(uint64_t head, ValidatedHead());
  if (head == tail_) return false;
  std::memcpy(out, &entries_[tail_ % count_], sizeof(*out));
  ++tail_;
  // Release: the copy-out above happens before the producer may reuse the entry.
  AtomicU64(control_->tail).store(tail_, std::memory_order_release);
  return true;
}

Result<bool> RingConsumer::PrepareToWait() {
  AtomicU32(control_->consumer_waiting).store(1, std::memory_order_seq_cst);
  // Sequentially consistent re-check: either we see the producer's new head, or it sees
  // consumer_waiting.
  const uint64_t head = AtomicU64(control_->head).load(std::memory_order_seq_cst);
  if (head < tail_ || head - tail_ > count_) {
    return Status::DataLoss(fmt::format("ring head {} is inconsistent with tail {}", head, tail_));
  }
  return head != tail_;
}

void RingConsumer::ClearWaiting() { AtomicU32(control_->consumer_waiting).store(0, std::memory_order_relaxed); }

}  // namespace orbitkv::channel
