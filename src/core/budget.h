// Budget: byte and ticket limits for payload the Manager retains on someone's behalf, with
// backpressure.
//
// Two budgets use this shape (DESIGN.md §7):
//   - the query budget charges each query reservation the registered group's padded bytes, from
//   reservation
//     through copy completion, against a global limit and a per-instance limit;
//   - the transfer budget bounds source exports to peers (default half the pool, at most 1024
//   sessions).
// A reservation is a BudgetTicket that returns its bytes when destroyed. When a limit is reached
// TryReserve returns ResourceExhausted at once (backpressure: the caller keeps its request pending
// and may WaitForRoom); nothing ever queues inside the budget. A request that can never fit (bytes
// above a limit) gets OutOfRange, so the caller treats it as a miss instead of waiting forever.
//
// Thread safety: all methods are safe from any thread. A ticket may be destroyed on any thread.
#ifndef ORBITKV_CORE_BUDGET_H_
#define ORBITKV_CORE_BUDGET_H_

#include <condition_variable>
#include <cstdint>
#include <string>
#include <unordered_map>

#include "base/clock.h"
#include "base/metrics.h"
#include "base/mutex.h"
#include "base/result.h"
#include "base/thread_annotations.h"

namespace orbitkv::core {

class Budget;

// Bytes (and one ticket slot) charged to a budget until destroyed or Reset. Move-only.
class BudgetTicket {
 public:
  BudgetTicket() = default;
  BudgetTicket(BudgetTicket&& other) noexcept;
  BudgetTicket& operator=(BudgetTicket&& other) noexcept;
  BudgetTicket(const BudgetTicket&) = delete;
  BudgetTicket& operator=(const BudgetTicket&) = delete;
  ~BudgetTicket() { Reset(); }

  bool valid() const { return budget_ != nullptr; }
  uint64_t bytes() const { return bytes_; }
  uint64_t owner() const { return owner_; }
  void Reset();

 private:
  friend class Budget;
  BudgetTicket(Budget* budget, uint64_t owner, uint64_t bytes) : budget_(budget), owner_(owner), bytes_(bytes) {}

  Budget* budget_ = nullptr;
  uint64_t owner_ = 0;
  uint64_t bytes_ = 0;
};

class Budget {
 public:
  struct Options {
    std::string name;              // metric label: "query", "transfer"
    uint64_t global_bytes = 0;     // 0: unlimited
    uint64_t per_owner_bytes = 0;  // 0: unlimited
    uint32_t max_tickets = 0;      // 0: unlimited
  };

  // `metrics` must outlive the budget. Every ticket must be gone before the budget is destroyed
  // (CHECK).
  Budget(Options options, MetricsRegistry* metrics);
  ~Budget();
  Budget(const Budget&) = delete;
  Budget& operator=(const Budget&) = delete;

  // Charges `bytes` to `owner` (an instance id, or a peer session id). ResourceExhausted when a
  // limit is currently full (backpressure), OutOfRange when `bytes` exceeds a limit outright.
  Result<BudgetTicket> TryReserve(uint64_t owner, uint64_t bytes);
  // Blocks until TryReserve(owner, bytes) could succeed or the deadline passes (DeadlineExceeded).
  // Another thread may take the room first; callers loop on TryReserve.
  Status WaitForRoom(uint64_t owner, uint64_t bytes, Deadline deadline);

  uint64_t reserved_bytes() const;
  uint64_t reserved_bytes(uint64_t owner) const;
  uint32_t tickets() const;
  const Options& options() const { return options_; }

 private:
  friend class BudgetTicket;
  void Return(uint64_t owner, uint64_t bytes);
  Status CheckLocked(uint64_t owner, uint64_t bytes) const REQUIRES(mu_);

  // Immutable after construction.
  const Options options_;
  Counter* waits_ = nullptr;
  Counter* bypasses_ = nullptr;
  Gauge* reserved_gauge_ = nullptr;
  Gauge* tickets_gauge_ = nullptr;

  mutable Mutex mu_;
  std::condition_variable_any room_;
  uint64_t reserved_ GUARDED_BY(mu_) = 0;
  uint32_t tickets_ GUARDED_BY(mu_) = 0;
  std::unordered_map<uint64_t, uint64_t> per_owner_ GUARDED_BY(mu_);
};

}  // namespace orbitkv::core

#endif  // ORBITKV_CORE_BUDGET_H_
