#include "server/loading_registry.h"

#include <fmt/format.h>

#include <algorithm>

namespace orbitkv::server {
namespace {

// Whether a waiter for `min_resident` leading blocks is answered by `resident` while the op runs (0
// waits for completion only).
bool AnsweredEarly(size_t min_resident, size_t resident) { return min_resident > 0 && resident >= min_resident; }

}  // namespace

LoadingRegistry::LoadingRegistry(const Options& options, MetricsRegistry* metrics)
    : options_(options),
      started_(&metrics->GetCounter("orbitkv_loading_started_total",
                                    "Queries answered Loading (blocks read from SSD into DRAM)")),
      active_(&metrics->GetGauge("orbitkv_loading_active", "Loading operations not yet complete")),
      held_gauge_(
          &metrics->GetGauge("orbitkv_loading_held_blocks",
                             "DRAM blocks that completed loads keep pinned until the engine's next query leases "
                             "them")) {}

LoadingRegistry::~LoadingRegistry() {
  Aftermath after;
  {
    MutexLock lock(&mu_);
    for (auto it = ops_.begin(); it != ops_.end();) {
      it = ForgetLocked(it, "dropped: the Manager is stopping", &after);
    }
  }
  after.next_start = nullptr;
  after.Run(this);
}

void LoadingRegistry::Aftermath::Run(LoadingRegistry* registry) {
  if (wake_sweeper && registry->options_.wake_sweeper) registry->options_.wake_sweeper();
  core::BlockPin::ReleaseAll(&released);
  for (auto& [done, result] : answers) done(std::move(result));
  answers.clear();
  if (next_start) {
    Status started = next_start(std::move(next_done), std::move(next_progress));
    // A stage that cannot start brings nothing: the op completes with the prefix it has.
    if (!started.ok()) registry->StageDone(next_op, next_stage, {});
  }
}

Result<uint64_t> LoadingRegistry::Start(uint64_t owner, const LoadingChain& chain, std::vector<LoadingStage> stages,
                                        size_t resident) {
  Aftermath after;
  uint64_t id = 0;
  {
    MutexLock lock(&mu_);
    if (auto found = by_chain_.find(chain); found != by_chain_.end()) return found->second;
    uint32_t& outstanding = per_owner_[owner];
    if (outstanding >= options_.max_per_owner) {
      return Status::ResourceExhausted(
          fmt::format("{} Loading operations are outstanding on this session (--max-loading); retry", outstanding));
    }
    ++outstanding;
    id = next_id_++;
    Op& op = ops_[id];
    op.owner = owner;
    op.chain = chain;
    op.stages = std::move(stages);
    op.origin.resident = resident;
    for (const LoadingStage& stage : op.stages) op.origin.stages.emplace_back(stage.name, stage.span);
    by_chain_.emplace(chain, id);
    started_->Increment();
    active_->Add(1);
    if (op.stages.empty()) {
      CompleteLocked(op, &after);
    } else {
      ArmStageLocked(id, op, &after);
    }
  }
  if (after.next_start) {
    std::function<Status(LoadingStage::Done, LoadingStage::Progress)> start = std::move(after.next_start);
    after.next_start = nullptr;
    Status started = start(std::move(after.next_done), std::move(after.next_progress));
    if (!started.ok()) {
      {
        MutexLock lock(&mu_);
        if (auto it = ops_.find(id); it != ops_.end()) {
          ForgetLocked(it, "abandoned: its first stage could not start", &after);
        }
      }
      after.Run(this);
      return started;
    }
  }
  after.Run(this);
  return id;
}

void LoadingRegistry::ArmStageLocked(uint64_t id, Op& op, Aftermath* after) {
  LoadingStage& stage = op.stages[op.stage];
  op.stage_deadline = MonoNow() + stage.deadline;
  DueByLocked(op.stage_deadline, after);
  after->next_op = id;
  after->next_stage = op.stage;
  after->next_start = std::move(stage.start);
  after->next_done = [this, id, index = op.stage](std::vector<core::BlockPin> pins) {
    StageDone(id, index, std::move(pins));
  };
  after->next_progress = [this, id, index = op.stage](size_t resident) { StageProgress(id, index, resident); };
}

void LoadingRegistry::StageProgress(uint64_t id, size_t stage, size_t resident) {
  Aftermath after;
  {
    MutexLock lock(&mu_);
    auto it = ops_.find(id);
    if (it == ops_.end() || it->second.completed || it->second.stage != stage) return;
    Op& op = it->second;
    const size_t progress = std::min(resident, op.stages[stage].span);
    if (progress <= op.progress) return;
    op.progress = progress;
    const size_t now = op.resident();
    auto reached = std::partition(op.waiters.begin(), op.waiters.end(),
                                  [now](const Op::Waiter& w) { return !AnsweredEarly(w.min_resident, now); });
    for (auto w = reached; w != op.waiters.end(); ++w) {
      after.answers.emplace_back(std::move(w->done), Result<LoadingState>(LoadingState{now, false}));
    }
    op.waiters.erase(reached, op.waiters.end());
  }
  after.Run(this);
}

void LoadingRegistry::DueByLocked(MonoTime when, Aftermath* after) {
  next_sweep_ = std::min(next_sweep_, when);
  if (when >= reported_due_) return;
  reported_due_ = when;  // the sweeper, woken, asks again
  after->wake_sweeper = true;
}

void LoadingRegistry::StageDone(uint64_t id, size_t stage, std::vector<core::BlockPin> pins) {
  Aftermath after;
  {
    MutexLock lock(&mu_);
    auto it = ops_.find(id);
    if (it == ops_.end() || it->second.completed || it->second.stage != stage) {
      // Forgotten, cancelled, or past its deadline: the blocks stay cached, unpinned.
      after.released = std::move(pins);
    } else {
      Op& op = it->second;
      const size_t span = op.stages[stage].span;
      const bool whole = pins.size() >= span;
      for (size_t i = 0; i < pins.size(); ++i) {
        if (i < span) {
          op.held.push_back(std::move(pins[i]));
        } else {
          after.released.push_back(std::move(pins[i]));
        }
      }
      const size_t added = std::min(pins.size(), span);
      op.progress = 0;  // the stage's blocks are in `held` now
      held_blocks_ += added;
      held_gauge_->Add(static_cast<double>(added));
      ++op.stage;
      if (!whole || op.stage == op.stages.size()) {
        CompleteLocked(op, &after);
      } else {
        ArmStageLocked(id, op, &after);
      }
    }
  }
  after.Run(this);
}

void LoadingRegistry::CompleteLocked(Op& op, Aftermath* after) {
  op.completed = true;
  op.completed_at = MonoNow();
  op.stage = op.stages.size();
  op.stages.clear();  // their keys are not needed any more
  active_->Add(-1);
  for (Op::Waiter& waiter : op.waiters) {
    after->answers.emplace_back(std::move(waiter.done), Result<LoadingState>(LoadingState{op.held.size(), true}));
  }
  op.waiters.clear();
}

LoadingRegistry::OpMap::iterator LoadingRegistry::ForgetLocked(OpMap::iterator it, const char* why, Aftermath* after) {
  Op& op = it->second;
  held_blocks_ -= op.held.size();
  held_gauge_->Add(-static_cast<double>(op.held.size()));
  for (core::BlockPin& pin : op.held) after->released.push_back(std::move(pin));
  for (Op::Waiter& waiter : op.waiters) {
    after->answers.emplace_back(std::move(waiter.done),
                                Status::Aborted(fmt::format("the Loading operation was {}", why)));
  }
  by_chain_.erase(op.chain);
  if (auto owner = per_owner_.find(op.owner); owner != per_owner_.end() && --owner->second == 0) {
    per_owner_.erase(owner);
  }
  if (!op.completed) active_->Add(-1);
  return ops_.erase(it);
}

const LoadingRegistry::Op* LoadingRegistry::OpOfLocked(const LoadingChain& chain) const {
  auto found = by_chain_.find(chain);
  if (found == by_chain_.end()) return nullptr;
  auto it = ops_.find(found->second);
  return it == ops_.end() ? nullptr : &it->second;
}

bool LoadingRegistry::Completed(const LoadingChain& chain) {
  MutexLock lock(&mu_);
  const Op* op = OpOfLocked(chain);
  return op != nullptr && op->completed;
}

bool LoadingRegistry::Running(const LoadingChain& chain) {
  MutexLock lock(&mu_);
  const Op* op = OpOfLocked(chain);
  return op != nullptr && !op->completed;
}

std::optional<LoadingRegistry::Origin> LoadingRegistry::CompletedOrigin(const LoadingChain& chain) {
  MutexLock lock(&mu_);
  const Op* op = OpOfLocked(chain);
  if (op == nullptr || !op->completed) return std::nullopt;
  return op->origin;
}

void LoadingRegistry::Forget(const LoadingChain& chain) {
  Aftermath after;
  {
    MutexLock lock(&mu_);
    auto found = by_chain_.find(chain);
    if (found == by_chain_.end()) return;
    if (auto it = ops_.find(found->second); it != ops_.end()) {
      ForgetLocked(it, "taken by a query answered without Loading", &after);
    }
  }
  after.Run(this);
}

bool LoadingRegistry::Cancel(uint64_t instance, uint64_t id) {
  Aftermath after;
  {
    MutexLock lock(&mu_);
    auto it = ops_.find(id);
    if (it == ops_.end() || it->second.chain.instance != instance) return false;
    ForgetLocked(it, "cancelled", &after);
  }
  after.Run(this);
  return true;
}

void LoadingRegistry::Wait(uint64_t instance, uint64_t id, Deadline deadline, WaitDone done, size_t min_resident) {
  Result<LoadingState> now = Status::NotFound(
      "no Loading operation with that id for this instance (it was taken by a query, cancelled or "
      "expired): ask the query again");
  Aftermath after;
  {
    MutexLock lock(&mu_);
    auto it = ops_.find(id);
    if (it != ops_.end() && it->second.chain.instance == instance) {
      const Op& op = it->second;
      if (op.completed) {
        now = LoadingState{op.held.size(), true};
      } else if (AnsweredEarly(min_resident, op.resident())) {
        now = LoadingState{op.resident(), false};
      } else {
        it->second.waiters.push_back(Op::Waiter{deadline.when(), std::move(done), min_resident});
        DueByLocked(deadline.when(), &after);
        done = nullptr;
      }
    }
  }
  after.Run(this);
  if (done) done(std::move(now));
}

void LoadingRegistry::DropInstance(uint64_t instance) {
  Aftermath after;
  {
    MutexLock lock(&mu_);
    for (auto it = ops_.begin(); it != ops_.end();) {
      it = it->second.chain.instance == instance ? ForgetLocked(it, "dropped: its instance went away", &after)
                                                 : std::next(it);
    }
  }
  after.Run(this);
}

MonoTime LoadingRegistry::Sweep() {
  const MonoTime now = MonoNow();
  Aftermath after;
  MonoTime next;
  {
    MutexLock lock(&mu_);
    if (now < next_sweep_) {
      reported_due_ = next_sweep_;
      return next_sweep_;
    }
    const bool hold_sweep = now - last_hold_sweep_ >= std::chrono::seconds(1);
    if (hold_sweep) last_hold_sweep_ = now;
    next = last_hold_sweep_ + std::chrono::seconds(1);
    for (auto it = ops_.begin(); it != ops_.end();) {
      Op& op = it->second;
      if (!op.completed && now >= op.stage_deadline) {
        // The running stage is late: complete with what arrived; its pins are let go when they
        // come.
        CompleteLocked(op, &after);
      }
      if (!op.completed) {
        next = std::min(next, op.stage_deadline);
        auto late = std::partition(op.waiters.begin(), op.waiters.end(),
                                   [now](const Op::Waiter& w) { return now < w.deadline; });
        for (auto w = late; w != op.waiters.end(); ++w) {
          after.answers.emplace_back(std::move(w->done),
                                     Status::DeadlineExceeded("the Loading operation is still running; ask again"));
        }
        op.waiters.erase(late, op.waiters.end());
        for (const Op::Waiter& w : op.waiters) next = std::min(next, w.deadline);
      }
      const bool expired = hold_sweep && op.completed && now - op.completed_at > options_.hold;
      it = expired ? ForgetLocked(it, "expired: nobody asked for its blocks", &after) : std::next(it);
    }
    next_sweep_ = next;
    reported_due_ = next;
  }
  after.Run(this);
  return next;
}

size_t LoadingRegistry::running() const {
  MutexLock lock(&mu_);
  size_t running = 0;
  for (const auto& [id, op] : ops_) running += op.completed ? 0 : 1;
  return running;
}

size_t LoadingRegistry::held_blocks() const {
  MutexLock lock(&mu_);
  return held_blocks_;
}

}  // namespace orbitkv::server
