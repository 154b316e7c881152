// LeaseTable: leases that pin exact DRAM block versions on behalf of an engine instance.
//
// A query that hits creates a lease holding one BlockPin per hit block plus the query's budget
// ticket. The engine then either releases it (it will not restore) or hands it to a restore:
// Consume() moves the pins and the ticket into a LeaseUse that the copy owns, and they are released
// when the copy completes (the LeaseUse is destroyed). Either way the lease id is retired at once.
//
// Lease ids cross the process boundary as {index, generation}, never pointers. Every id is
// validated: a stale, unknown or already released/consumed id is FailedPrecondition with a clear
// message, never a crash. Slot generations advance on every retirement so an old id can never name
// a newer lease.
//
// Thread safety: all methods are safe from any thread. The table mutex is never held while pins are
// released (releasing a pin takes a block-table shard lock).
#ifndef ORBITKV_CORE_LEASE_TABLE_H_
#define ORBITKV_CORE_LEASE_TABLE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "base/metrics.h"
#include "base/mutex.h"
#include "base/result.h"
#include "base/thread_annotations.h"
#include "core/block_table.h"
#include "core/budget.h"

namespace orbitkv::core {

struct LeaseId {
  uint32_t index = 0;
  uint32_t generation = 0;  // 0 is never a live lease
  uint64_t Pack() const { return static_cast<uint64_t>(generation) << 32 | index; }
  static LeaseId Unpack(uint64_t packed) {
    return LeaseId{static_cast<uint32_t>(packed), static_cast<uint32_t>(packed >> 32)};
  }
  std::string ToString() const;
  friend bool operator==(const LeaseId&, const LeaseId&) = default;
};

// The pins and reservation of a consumed lease, owned by the copy that restores from it. Move-only;
// destroying it releases everything.
class LeaseUse {
 public:
  LeaseUse() = default;
  LeaseUse(std::vector<BlockPin> pins, BudgetTicket ticket, uint64_t owner)
      : pins_(std::move(pins)), ticket_(std::move(ticket)), owner_(owner) {}
  LeaseUse(LeaseUse&&) noexcept = default;
  LeaseUse& operator=(LeaseUse&& other) noexcept {
    if (this != &other) {
      Reset();
      pins_ = std::move(other.pins_);
      ticket_ = std::move(other.ticket_);
      owner_ = other.owner_;
    }
    return *this;
  }

  const std::vector<BlockPin>& pins() const { return pins_; }
  uint64_t owner() const { return owner_; }
  // Releases pins and reservation now (the copy completed).
  void Reset() {
    BlockPin::ReleaseAll(&pins_);
    ticket_.Reset();
  }
  ~LeaseUse() { Reset(); }

 private:
  std::vector<BlockPin> pins_;
  BudgetTicket ticket_;
  uint64_t owner_ = 0;
};

class LeaseTable {
 public:
  struct Options {
    uint32_t max_leases = 1u << 16;
  };

  LeaseTable(const Options& options, MetricsRegistry* metrics);
  // Releases every remaining lease.
  ~LeaseTable();
  LeaseTable(const LeaseTable&) = delete;
  LeaseTable& operator=(const LeaseTable&) = delete;

  // Creates a lease for `owner` holding `pins` and `ticket`. ResourceExhausted when max_leases are
  // live (the pins and ticket are released before returning).
  Result<LeaseId> Create(uint64_t owner, std::vector<BlockPin> pins, BudgetTicket ticket);

  // The engine will not restore from it: releases pins and reservation. FailedPrecondition for an
  // id that is not live (never issued, already released, consumed, or cleaned up); PermissionDenied
  // when `owner` differs.
  Status Release(LeaseId id, uint64_t owner);

  // Hands the lease to a restore; the id is retired and the returned LeaseUse owns the pins until
  // the copy completes. Same errors as Release.
  Result<LeaseUse> Consume(LeaseId id, uint64_t owner);

  // Pins the lease's blocks once more without consuming it: a partial restore (some layers of every
  // block) copies under these pins while the lease stays valid for the next part. The errors of
  // Release.
  Result<std::vector<BlockPin>> Borrow(LeaseId id, uint64_t owner) const;

  // Number of blocks the lease holds, or the Release errors.
  Result<size_t> BlockCount(LeaseId id, uint64_t owner) const;

  // Releases every live lease of `owner` (its engine went away); returns how many. Consumed leases
  // are owned by their copies and end when those drain.
  size_t ReleaseOwner(uint64_t owner);

  size_t active() const;

 private:
  struct Slot {
    uint32_t generation = 1;
    bool live = false;
    uint64_t owner = 0;
    std::vector<BlockPin> pins;
    BudgetTicket ticket;
  };

  // Validates and retires `id`, moving its contents to `out`.
  Status TakeLocked(LeaseId id, uint64_t owner, Slot* out) REQUIRES(mu_);
  Status ValidateLocked(LeaseId id, uint64_t owner) const REQUIRES(mu_);

  // Immutable after construction.
  const uint32_t max_leases_;
  Gauge* active_gauge_ = nullptr;
  Counter* stale_total_ = nullptr;

  mutable Mutex mu_;
  std::vector<Slot> slots_ GUARDED_BY(mu_);
  std::vector<uint32_t> free_ GUARDED_BY(mu_);
  size_t active_ GUARDED_BY(mu_) = 0;
};

}  // namespace orbitkv::core

#endif  // ORBITKV_CORE_LEASE_TABLE_H_
