// FaultInjectingEngine (test-only): a TransferEngine decorator that injects the faults a real
// transport cannot be made to produce on demand, for fault tests of the engine and of its users.
//
// Faults apply to ReadBatch calls in order, per the plan set before them:
//  - Drop(n):        the next n batches are lost: never submitted, they end with DeadlineExceeded
//  at their
//                    deadline (what a request lost on the wire looks like to the requester).
//  - Delay(n, d):    the next n batches are submitted to the inner engine d later (user-space
//  delay: this
//                    kernel has no netem). A batch whose deadline passes meanwhile ends with
//                    DeadlineExceeded.
//  - Corrupt(n):     the next n batches land normally, then one byte of their first fragment is
//  flipped before
//                    the checksum is verified again here: DataLoss when the batch verified
//                    checksums, silent corruption (OK) when it did not. This models bytes changed
//                    between the wire and the check.
//  - FailAfter(k):   after k more batches pass, every later batch fails with Unavailable without
//  reaching the
//                    inner engine (a peer that stops answering for good).
// Held batches (dropped or delayed) can be cancelled; nothing was submitted, so they end Cancelled
// at once.
//
// Thread safety: as TransferEngine. The decorator owns one timer thread for held batches. The inner
// engine is not owned and must outlive the decorator.
#ifndef ORBITKV_TRANSFER_FAULT_INJECTING_ENGINE_H_
#define ORBITKV_TRANSFER_FAULT_INJECTING_ENGINE_H_

#include <condition_variable>
#include <map>
#include <memory>
#include <thread>

#include "base/mutex.h"
#include "base/thread_annotations.h"
#include "transfer/transfer_engine.h"

namespace orbitkv::transfer {

class FaultInjectingEngine final : public TransferEngine {
 public:
  explicit FaultInjectingEngine(TransferEngine* inner);
  ~FaultInjectingEngine() override;
  FaultInjectingEngine(const FaultInjectingEngine&) = delete;
  FaultInjectingEngine& operator=(const FaultInjectingEngine&) = delete;

  void Drop(int batches) EXCLUDES(mu_);
  void Delay(int batches, MonoClock::duration delay) EXCLUDES(mu_);
  void Corrupt(int batches) EXCLUDES(mu_);
  void FailAfter(int batches) EXCLUDES(mu_);

  Result<RegionHandle> RegisterRegion(void* base, size_t length) override EXCLUDES(mu_);
  Status UnregisterRegion(RegionHandle region) override EXCLUDES(mu_);
  Result<RegionDescriptor> ExportRegion(RegionHandle region) override { return inner_->ExportRegion(region); }
  Result<uint64_t> ReadBatch(ReadBatchRequest request, BatchCallback done) override EXCLUDES(mu_);
  Status Cancel(uint64_t batch_id) override EXCLUDES(mu_);
  Result<IssuedGrant> CreateGrant(GrantRequest request) override { return inner_->CreateGrant(std::move(request)); }
  Status RevokeGrant(uint64_t grant, DrainedCallback drained) override {
    return inner_->RevokeGrant(grant, std::move(drained));
  }
  Status RevokePeer(const std::string& peer, DrainedCallback drained) override {
    return inner_->RevokePeer(peer, std::move(drained));
  }
  std::string ListenAddress() const override { return inner_->ListenAddress(); }
  Capabilities GetCapabilities() const override { return inner_->GetCapabilities(); }
  EngineStats Stats() const override;

 private:
  enum class Fault { kNone, kDrop, kDelay, kCorrupt, kFail };
  struct Held {
    ReadBatchRequest request;
    BatchCallback done;
    Fault fault = Fault::kNone;
    MonoTime release;  // kDelay: when to submit; kDrop: the deadline.
  };

  Fault NextFault(MonoClock::duration* delay) REQUIRES(mu_);
  void TimerLoop() EXCLUDES(mu_);
  // Submits to the inner engine; on error the callback has not run.
  Status Submit(uint64_t outer_id, ReadBatchRequest request, std::shared_ptr<BatchCallback> done) EXCLUDES(mu_);
  BatchCallback WrapCorrupt(const ReadBatchRequest& request, BatchCallback done) EXCLUDES(mu_);

  TransferEngine* const inner_;

  mutable Mutex mu_;
  std::condition_variable_any cv_;
  int drop_ GUARDED_BY(mu_) = 0;
  int delay_count_ GUARDED_BY(mu_) = 0;
  MonoClock::duration delay_ GUARDED_BY(mu_){};
  int corrupt_ GUARDED_BY(mu_) = 0;
  int fail_after_ GUARDED_BY(mu_) = -1;  // -1: off.
  bool stopping_ GUARDED_BY(mu_) = false;
  uint64_t next_id_ GUARDED_BY(mu_) = 1;
  std::map<uint64_t, Held> held_ GUARDED_BY(mu_);
  std::map<uint64_t, uint64_t> inner_ids_ GUARDED_BY(mu_);                   // Outer id -> inner id, while live.
  std::map<uint32_t, std::pair<uint8_t*, size_t>> regions_ GUARDED_BY(mu_);  // By region index.
  std::thread timer_;
};

}  // namespace orbitkv::transfer

#endif  // ORBITKV_TRANSFER_FAULT_INJECTING_ENGINE_H_
