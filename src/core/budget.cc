#include "core/budget.h"

#include <utility>

#include "base/check.h"

namespace orbitkv::core {

BudgetTicket::BudgetTicket(BudgetTicket&& other) noexcept
    : budget_(std::exchange(other.budget_, nullptr)), owner_(other.owner_), bytes_(other.bytes_) {}

BudgetTicket& BudgetTicket::operator=(BudgetTicket&& other) noexcept {
  if (this != &other) {
    Reset();
    budget_ = std::exchange(other.budget_, nullptr);
    owner_ = other.owner_;
    bytes_ = other.bytes_;
  }
  return *this;
}

void BudgetTicket::Reset() {
  if (budget_ != nullptr) std::exchange(budget_, nullptr)->Return(owner_, bytes_);
}

Budget::Budget(Options options, MetricsRegistry* metrics) : options_(std::move(options)) {
  ORBITKV_CHECK(metrics != nullptr);
  MetricLabels labels{{"budget", options_.name}};
  waits_ = &metrics->GetCounter("orbitkv_budget_waits_total",
                                "Reservations refused because the budget was full (backpressure)", labels);
  bypasses_ = &metrics->GetCounter("orbitkv_budget_bypasses_total",
                                   "Reservations larger than a limit, answered as a miss", labels);
  reserved_gauge_ = &metrics->GetGauge("orbitkv_budget_reserved_bytes", "Bytes currently reserved", labels);
  tickets_gauge_ = &metrics->GetGauge("orbitkv_budget_tickets", "Reservations currently held", labels);
}

Budget::~Budget() {
  MutexLock lock(&mu_);
  ORBITKV_CHECK_MSG(tickets_ == 0, "budget '{}' destroyed with {} tickets outstanding", options_.name, tickets_);
}

Status Budget::CheckLocked(uint64_t owner, uint64_t bytes) const {
  if (options_.max_tickets != 0 && tickets_ >= options_.max_tickets) {
    return Status::ResourceExhausted(
        fmt::format("{} budget: all {} sessions are in use", options_.name, options_.max_tickets));
  }
  if (options_.global_bytes != 0 && reserved_ + bytes > options_.global_bytes) {
    return Status::ResourceExhausted(fmt::format("{} budget: {} of {} bytes reserved, {} more do not fit",
                                                 options_.name, reserved_, options_.global_bytes, bytes));
  }
  if (options_.per_owner_bytes != 0) {
    auto it = per_owner_.find(owner);
    const uint64_t held = it == per_owner_.end() ? 0 : it->second;
    if (held + bytes > options_.per_owner_bytes) {
      return Status::ResourceExhausted(fmt::format("{} budget: owner {} holds {} of its {} bytes, {} more do not fit",
                                                   options_.name, owner, held, options_.per_owner_bytes, bytes));
    }
  }
  return Status::Ok();
}

Result<BudgetTicket> Budget::TryReserve(uint64_t owner, uint64_t bytes) {
  const uint64_t limit =
      options_.per_owner_bytes != 0 && (options_.global_bytes == 0 || options_.per_owner_bytes < options_.global_bytes)
          ? options_.per_owner_bytes
          : options_.global_bytes;
  if (limit != 0 && bytes > limit) {
    bypasses_->Increment();
    return Status::OutOfRange(fmt::format("{} budget: {} bytes exceed the {}-byte limit and can never be reserved",
                                          options_.name, bytes, limit));
  }
  MutexLock lock(&mu_);
  Status status = CheckLocked(owner, bytes);
  if (!status.ok()) {
    waits_->Increment();
    return status;
  }
  reserved_ += bytes;
  ++tickets_;
  if (bytes != 0) per_owner_[owner] += bytes;
  reserved_gauge_->Add(static_cast<double>(bytes));
  tickets_gauge_->Add(1);
  return BudgetTicket(this, owner, bytes);
}

Status Budget::WaitForRoom(uint64_t owner, uint64_t bytes, Deadline deadline) {
  MutexLock lock(&mu_);
  while (!CheckLocked(owner, bytes).ok()) {
    if (deadline.IsInfinite()) {
      room_.wait(mu_);
    } else if (room_.wait_until(mu_, deadline.when()) == std::cv_status::timeout && !CheckLocked(owner, bytes).ok()) {
      return Status::DeadlineExceeded(
          fmt::format("{} budget: no room for {} bytes before the deadline", options_.name, bytes));
    }
  }
  return Status::Ok();
}

void Budget::Return(uint64_t owner, uint64_t bytes) {
  {
    MutexLock lock(&mu_);
    ORBITKV_CHECK(reserved_ >= bytes && tickets_ > 0);
    reserved_ -= bytes;
    --tickets_;
    auto it = per_owner_.find(owner);
    if (it != per_owner_.end()) {
      ORBITKV_CHECK(it->second >= bytes);
      it->second -= bytes;
      if (it->second == 0) per_owner_.erase(it);
    } else {
      ORBITKV_CHECK(bytes == 0);  // zero-byte tickets leave no per-owner entry behind
    }
    reserved_gauge_->Add(-static_cast<double>(bytes));
    tickets_gauge_->Add(-1);
  }
  room_.notify_all();
}

uint64_t Budget::reserved_bytes() const {
  MutexLock lock(&mu_);
  return reserved_;
}

uint64_t Budget::reserved_bytes(uint64_t owner) const {
  MutexLock lock(&mu_);
  auto it = per_owner_.find(owner);
  return it == per_owner_.end() ? 0 : it->second;
}

uint32_t Budget::tickets() const {
  MutexLock lock(&mu_);
  return tickets_;
}

}  // namespace orbitkv::core
