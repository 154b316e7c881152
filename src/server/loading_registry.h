// LoadingRegistry: the Loading operations of the Manager, one per (instance, group, chain).
//
// A query whose prefix continues below DRAM (today on SSD; on a peer later) starts a Loading
// operation and is answered Loading; the engine asks again with the same keys (the same op is
// returned) or waits for the op's completion, and once the op completed the next query of the chain
// is answered from DRAM. An op owns an ordered list of stages, each covering the next span of the
// chain: a stage starts when the one before it completed with its whole span resident, reports pins
// on the prefix of its span it made resident, and has its own deadline, after which the op
// completes with what arrived (a late stage's pins are let go). The op completes after its last
// stage, or early when a stage stopped short. A completed op holds pins on the blocks it loaded
// (so other loads and saves cannot evict them first) until the engine's next query of the chain
// takes them, a cancel, its instance's cleanup, or `hold` without that query. At most
// `max_per_owner` ops are outstanding per owner (the control session that started them).
//
// Waiters (WaitLoading) are answered once: with the resident count when the op completes, or
// Aborted when it is forgotten first. Callbacks (stage starts, waiters) never run under the lock.
//
// Thread safety: every method is safe from any thread. Stage callbacks may run on any thread, also
// inline in Start.
#ifndef ORBITKV_SERVER_LOADING_REGISTRY_H_
#define ORBITKV_SERVER_LOADING_REGISTRY_H_

#include <chrono>
#include <compare>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "base/clock.h"
#include "base/metrics.h"
#include "base/mutex.h"
#include "base/result.h"
#include "base/thread_annotations.h"
#include "core/block_table.h"

namespace orbitkv::server {

// The identity of a chain a Loading op brings in.
struct LoadingChain {
  uint64_t instance = 0;
  uint32_t group = 0;
  uint64_t chain = 0;  // hash of the chain's last key and length
  friend auto operator<=>(const LoadingChain&, const LoadingChain&) = default;
};

struct LoadingStage {
  // Called with pins on the leading blocks of the stage's span now resident in DRAM (as many as it
  // brought, in order; fewer than `span` stops the op there).
  using Done = std::function<void(std::vector<core::BlockPin> pins)>;
  // Optional, any number of times before `done`: the leading `resident` blocks of the stage's span
  // are in DRAM now (pinned by the stage until `done`), so waiters asking for progress hear of it.
  using Progress = std::function<void(size_t resident)>;
  std::string name;                           // "ssd", in logs and errors
  size_t span = 0;                            // blocks of the chain this stage covers, after the previous stages' spans
  std::chrono::milliseconds deadline{30000};  // from the stage's start
  // Starts the stage; it calls `done` exactly once unless it returns an error.
  std::function<Status(Done done, Progress progress)> start;
};

// What a waiter hears: the chain's leading blocks in DRAM, and whether the op completed.
struct LoadingState {
  uint64_t resident = 0;
  bool completed = true;
};

class LoadingRegistry {
 public:
  struct Options {
    uint32_t max_per_owner = 256;
    std::chrono::milliseconds hold{10000};
    // Called (never under the lock) when Sweep's next due time moved earlier than it last
    // returned: a new stage or waiter deadline. The Manager wakes its cleaner thread.
    std::function<void()> wake_sweeper;
  };
  // Answered once: the resident count of a completed op (or of a running one that reached the
  // waiter's min_resident), or the reason it was forgotten.
  using WaitDone = std::function<void(Result<LoadingState> state)>;

  LoadingRegistry(const Options& options, MetricsRegistry* metrics);
  // Forgets every op (waiters hear Aborted); stage callbacks arriving later find nothing.
  ~LoadingRegistry();
  LoadingRegistry(const LoadingRegistry&) = delete;
  LoadingRegistry& operator=(const LoadingRegistry&) = delete;

  // The chain's op (the engine asked again), or a new one running `stages` in order; returns its
  // id. ResourceExhausted when `owner` has max_per_owner ops outstanding; the first stage's start
  // error otherwise (the op is forgotten).
  // `resident` is how many leading blocks of the chain were in DRAM when the op started (for the
  // per-tier hit counts of Origin).
  Result<uint64_t> Start(uint64_t owner, const LoadingChain& chain, std::vector<LoadingStage> stages,
                         size_t resident = 0) EXCLUDES(mu_);
  // Whether the chain has an op that completed (its blocks are held resident).
  bool Completed(const LoadingChain& chain) EXCLUDES(mu_);
  // Whether the chain has an op still running.
  bool Running(const LoadingChain& chain) EXCLUDES(mu_);
  // Where a completed op's blocks came from: the chain's first `resident` blocks were in DRAM, and
  // each stage covered the next `span` blocks (stages cover the chain from its start, in order).
  struct Origin {
    size_t resident = 0;
    std::vector<std::pair<std::string, size_t>> stages;  // (name, span)
  };
  // The chain's completed op's Origin; nullopt when it has none.
  std::optional<Origin> CompletedOrigin(const LoadingChain& chain) EXCLUDES(mu_);
  // Forgets the chain's op, running or completed; its held pins go (after the caller's lease took
  // its own, the blocks stay resident).
  void Forget(const LoadingChain& chain) EXCLUDES(mu_);
  // Forgets op `id` of `instance`; false when there is none (it completed and was taken, or was cancelled).
  // Its reads drain on their own; what they bring stays cached.
  bool Cancel(uint64_t instance, uint64_t id) EXCLUDES(mu_);
  // Calls `done` when op `id` of `instance` completes (now, if it has), when `min_resident` > 0
  // leading blocks of its chain are in DRAM while it runs (now, if they are), or DeadlineExceeded
  // once `deadline` passed (at the next Sweep); NotFound (inline) when there is no such op.
  void Wait(uint64_t instance, uint64_t id, Deadline deadline, WaitDone done, size_t min_resident = 0) EXCLUDES(mu_);
  // Forgets every op of `instance`.
  void DropInstance(uint64_t instance) EXCLUDES(mu_);
  // Completes ops whose current stage passed its deadline, answers waiters whose deadline passed
  // and, at most once a second, forgets the completed ops nobody asked for within `hold`. Returns
  // when it next has work (a stage or waiter deadline, or the next hold sweep).
  MonoTime Sweep() EXCLUDES(mu_);

  size_t running() const EXCLUDES(mu_);
  size_t held_blocks() const EXCLUDES(mu_);

 private:
  struct Op {
    uint64_t owner = 0;
    LoadingChain chain;
    std::vector<LoadingStage> stages;
    size_t stage = 0;         // the running stage (stages.size() once completed)
    MonoTime stage_deadline;  // of the running stage
    bool completed = false;
    Origin origin;  // for CompletedOrigin (the stages themselves go when the op completes)
    MonoTime completed_at;
    std::vector<core::BlockPin> held;  // the prefix loaded so far
    size_t progress = 0;               // leading blocks of the running stage's span in DRAM (its own pins)
    size_t resident() const { return held.size() + progress; }
    struct Waiter {
      MonoTime deadline;
      WaitDone done;
      size_t min_resident = 0;  // 0: only completion answers it
    };
    std::vector<Waiter> waiters;
  };
  using OpMap = std::unordered_map<uint64_t, Op>;
  // What to do outside the lock once the lock is dropped.
  struct Aftermath {
    std::vector<core::BlockPin> released;
    std::vector<std::pair<WaitDone, Result<LoadingState>>> answers;
    LoadingStage::Done next_done;  // the next stage to start, with its completion and progress
    LoadingStage::Progress next_progress;
    std::function<Status(LoadingStage::Done, LoadingStage::Progress)> next_start;
    uint64_t next_op = 0;
    size_t next_stage = 0;
    bool wake_sweeper = false;
    void Run(LoadingRegistry* registry);
  };

  // The chain's op, or null.
  const Op* OpOfLocked(const LoadingChain& chain) const REQUIRES(mu_);
  // The stage `stage` of op `id` reported `pins`.
  void StageDone(uint64_t id, size_t stage, std::vector<core::BlockPin> pins) EXCLUDES(mu_);
  // The stage `stage` of op `id` has `resident` leading blocks of its span in DRAM.
  void StageProgress(uint64_t id, size_t stage, size_t resident) EXCLUDES(mu_);
  // Completes the op: its waiters are answered.
  void CompleteLocked(Op& op, Aftermath* after) REQUIRES(mu_);
  // Prepares the start of the op's current stage (run by Aftermath).
  void ArmStageLocked(uint64_t id, Op& op, Aftermath* after) REQUIRES(mu_);
  // Removes the op; held pins and waiters go to `after`. Returns the next entry.
  OpMap::iterator ForgetLocked(OpMap::iterator it, const char* why, Aftermath* after) REQUIRES(mu_);
  // Sweep must run by `when`.
  void DueByLocked(MonoTime when, Aftermath* after) REQUIRES(mu_);

  const Options options_;
  Counter* started_;
  Gauge* active_;
  Gauge* held_gauge_;

  mutable Mutex mu_;
  OpMap ops_ GUARDED_BY(mu_);
  std::map<LoadingChain, uint64_t> by_chain_ GUARDED_BY(mu_);
  std::unordered_map<uint64_t, uint32_t> per_owner_ GUARDED_BY(mu_);
  uint64_t next_id_ GUARDED_BY(mu_) = 1;
  MonoTime last_hold_sweep_ GUARDED_BY(mu_);
  MonoTime next_sweep_ GUARDED_BY(mu_);  // before it, Sweep has nothing to do
  // What Sweep last returned: work due earlier wakes the sweeper.
  MonoTime reported_due_ GUARDED_BY(mu_) = MonoTime::max();
  size_t held_blocks_ GUARDED_BY(mu_) = 0;
};

}  // namespace orbitkv::server

#endif  // ORBITKV_SERVER_LOADING_REGISTRY_H_
