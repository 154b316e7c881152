#include "core/lease_table.h"

#include <utility>

#include "base/check.h"

namespace orbitkv::core {

std::string LeaseId::ToString() const { return fmt::format("lease {}:{}", index, generation); }

LeaseTable::LeaseTable(const Options& options, MetricsRegistry* metrics) : max_leases_(options.max_leases) {
  ORBITKV_CHECK(metrics != nullptr && max_leases_ > 0);
  active_gauge_ = &metrics->GetGauge("orbitkv_leases_active", "Leases pinning DRAM blocks for engines");
  stale_total_ = &metrics->GetCounter("orbitkv_lease_stale_total",
                                      "Release or consume of a lease id that was not live (stale or repeated)");
}

LeaseTable::~LeaseTable() {
  std::vector<Slot> drained;
  {
    MutexLock lock(&mu_);
    for (Slot& slot : slots_) {
      if (slot.live) {
        active_gauge_->Add(-1);
        drained.push_back(std::move(slot));
      }
    }
    slots_.clear();
  }
  // Pins and tickets are released here, outside the lock.
  for (Slot& slot : drained) BlockPin::ReleaseAll(&slot.pins);
}

Result<LeaseId> LeaseTable::Create(uint64_t owner, std::vector<BlockPin> pins, BudgetTicket ticket) {
  MutexLock lock(&mu_);
  if (active_ >= max_leases_) {
    return Status::ResourceExhausted(
        fmt::format("all {} leases are in use; release leases or wait for restores to finish", max_leases_));
  }
  uint32_t index;
  if (!free_.empty()) {
    index = free_.back();
    free_.pop_back();
  } else {
    index = static_cast<uint32_t>(slots_.size());
    slots_.emplace_back();
  }
  Slot& slot = slots_[index];
  slot.live = true;
  slot.owner = owner;
  slot.pins = std::move(pins);
  slot.ticket = std::move(ticket);
  ++active_;
  active_gauge_->Add(1);
  return LeaseId{index, slot.generation};
}

Status LeaseTable::ValidateLocked(LeaseId id, uint64_t owner) const {
  if (id.index >= slots_.size() || slots_[id.index].generation != id.generation || !slots_[id.index].live) {
    return Status::FailedPrecondition(
        fmt::format("{} is not live: it was already released or consumed, or never issued", id.ToString()));
  }
  if (slots_[id.index].owner != owner) {
    return Status::PermissionDenied(fmt::format("{} belongs to another instance", id.ToString()));
  }
  return Status::Ok();
}

Status LeaseTable::TakeLocked(LeaseId id, uint64_t owner, Slot* out) {
  Status status = ValidateLocked(id, owner);
  if (!status.ok()) {
    if (status.code() == StatusCode::kFailedPrecondition) stale_total_->Increment();
    return status;
  }
  Slot& slot = slots_[id.index];
  out->owner = slot.owner;
  out->pins = std::move(slot.pins);
  out->ticket = std::move(slot.ticket);
  slot.pins.clear();
  slot.live = false;
  if (++slot.generation == 0) slot.generation = 1;
  free_.push_back(id.index);
  --active_;
  active_gauge_->Add(-1);
  return Status::Ok();
}

Status LeaseTable::Release(LeaseId id, uint64_t owner) {
  Slot taken;
  {
    MutexLock lock(&mu_);
    ORBITKV_RETURN_IF_ERROR(TakeLocked(id, owner, &taken));
  }
  BlockPin::ReleaseAll(&taken.pins);  // outside the lock; the ticket goes with `taken`
  return Status::Ok();
}

Result<LeaseUse> LeaseTable::Consume(LeaseId id, uint64_t owner) {
  Slot taken;
  {
    MutexLock lock(&mu_);
    ORBITKV_RETURN_IF_ERROR(TakeLocked(id, owner, &taken));
  }
  return LeaseUse(std::move(taken.pins), std::move(taken.ticket), taken.owner);
}

Result<std::vector<BlockPin>> LeaseTable::Borrow(LeaseId id, uint64_t owner) const {
  MutexLock lock(&mu_);
  ORBITKV_RETURN_IF_ERROR(ValidateLocked(id, owner));
  std::vector<BlockPin> pins;
  pins.reserve(slots_[id.index].pins.size());
  for (const BlockPin& pin : slots_[id.index].pins) pins.push_back(pin.Clone());
  return pins;
}

Result<size_t> LeaseTable::BlockCount(LeaseId id, uint64_t owner) const {
  MutexLock lock(&mu_);
  ORBITKV_RETURN_IF_ERROR(ValidateLocked(id, owner));
  return slots_[id.index].pins.size();
}

size_t LeaseTable::ReleaseOwner(uint64_t owner) {
  std::vector<Slot> taken;
  {
    MutexLock lock(&mu_);
    for (uint32_t index = 0; index < slots_.size(); ++index) {
      if (!slots_[index].live || slots_[index].owner != owner) continue;
      taken.emplace_back();
      ORBITKV_CHECK(TakeLocked(LeaseId{index, slots_[index].generation}, owner, &taken.back()).ok());
    }
  }
  return taken.size();
}

size_t LeaseTable::active() const {
  MutexLock lock(&mu_);
  return active_;
}

}  // namespace orbitkv::core
