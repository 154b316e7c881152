#include "transfer/fault_injecting_engine.h"

#include <vector>

#include "transfer/checksum.h"

namespace orbitkv::transfer {

FaultInjectingEngine::FaultInjectingEngine(TransferEngine* inner) : inner_(inner) {
  timer_ = std::thread([this] { TimerLoop(); });
}

FaultInjectingEngine::~FaultInjectingEngine() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  timer_.join();
}

void FaultInjectingEngine::Drop(int batches) {
  MutexLock lock(&mu_);
  drop_ = batches;
}

void FaultInjectingEngine::Delay(int batches, MonoClock::duration delay) {
  MutexLock lock(&mu_);
  delay_count_ = batches;
  delay_ = delay;
}

void FaultInjectingEngine::Corrupt(int batches) {
  MutexLock lock(&mu_);
  corrupt_ = batches;
}

void FaultInjectingEngine::FailAfter(int batches) {
  MutexLock lock(&mu_);
  fail_after_ = batches;
}

Result<RegionHandle> FaultInjectingEngine::RegisterRegion(void* base, size_t length) {
  Result<RegionHandle> handle = inner_->RegisterRegion(base, length);
  if (handle.ok()) {
    MutexLock lock(&mu_);
    regions_[handle->index] = {static_cast<uint8_t*>(base), length};
  }
  return handle;
}

Status FaultInjectingEngine::UnregisterRegion(RegionHandle region) {
  Status status = inner_->UnregisterRegion(region);
  if (status.ok()) {
    MutexLock lock(&mu_);
    regions_.erase(region.index);
  }
  return status;
}

EngineStats FaultInjectingEngine::Stats() const {
  EngineStats stats = inner_->Stats();
  MutexLock lock(&mu_);
  stats.live_batches += held_.size();
  return stats;
}

FaultInjectingEngine::Fault FaultInjectingEngine::NextFault(MonoClock::duration* delay) {
  if (fail_after_ == 0) return Fault::kFail;
  if (fail_after_ > 0) fail_after_ -= 1;
  if (drop_ > 0) {
    drop_ -= 1;
    return Fault::kDrop;
  }
  if (delay_count_ > 0) {
    delay_count_ -= 1;
    *delay = delay_;
    return Fault::kDelay;
  }
  if (corrupt_ > 0) {
    corrupt_ -= 1;
    return Fault::kCorrupt;
  }
  return Fault::kNone;
}

Result<uint64_t> FaultInjectingEngine::ReadBatch(ReadBatchRequest request, BatchCallback done) {
  if (request.deadline.IsInfinite()) return Status::InvalidArgument("ReadBatch: the deadline must be finite");
  uint64_t id = 0;
  Fault fault = Fault::kNone;
  {
    MutexLock lock(&mu_);
    id = next_id_++;
    MonoClock::duration delay{};
    fault = NextFault(&delay);
    if (fault == Fault::kDrop || fault == Fault::kDelay) {
      Held held;
      held.fault = fault;
      held.release = fault == Fault::kDrop ? request.deadline.when() : MonoNow() + delay;
      held.request = std::move(request);
      held.done = std::move(done);
      held_.emplace(id, std::move(held));
    }
  }
  switch (fault) {
    case Fault::kDrop:
    case Fault::kDelay:
      cv_.notify_all();
      return id;
    case Fault::kFail: {
      BatchResult result;
      result.batch_id = id;
      result.status = Status::Unavailable("fault injection: the peer stopped answering");
      done(result);
      return id;
    }
    case Fault::kCorrupt:
      done = WrapCorrupt(request, std::move(done));
      break;
    case Fault::kNone:
      break;
  }
  auto shared_done = std::make_shared<BatchCallback>(std::move(done));
  ORBITKV_RETURN_IF_ERROR(Submit(id, std::move(request), shared_done));
  return id;
}

BatchCallback FaultInjectingEngine::WrapCorrupt(const ReadBatchRequest& request, BatchCallback done) {
  std::vector<std::pair<uint8_t*, uint64_t>> landed;
  {
    MutexLock lock(&mu_);
    for (const Fragment& f : request.fragments) {
      auto it = regions_.find(f.local.index);
      landed.emplace_back(it == regions_.end() ? nullptr : it->second.first + f.local_offset, f.length);
    }
  }
  bool verify = request.verify_checksum;
  return [landed = std::move(landed), verify, done = std::move(done)](const BatchResult& inner) {
    BatchResult result = inner;
    if (result.status.ok() && landed[0].first != nullptr) {
      landed[0].first[landed[0].second / 2] ^= 0x5a;
      if (verify) {
        BatchChecksum check(landed.size());
        for (size_t i = 0; i < landed.size(); ++i) check.Set(i, FragmentHash(landed[i].first, landed[i].second));
        if (check.Finish() != result.source_checksum) {
          result.status = Status::DataLoss("fault injection: a landed byte was flipped and the checksum caught it");
          result.checksum_verified = false;
        }
      }
    }
    done(result);
  };
}

Status FaultInjectingEngine::Cancel(uint64_t batch_id) {
  Held held;
  uint64_t inner_id = 0;
  {
    MutexLock lock(&mu_);
    auto it = held_.find(batch_id);
    if (it != held_.end()) {
      held = std::move(it->second);
      held_.erase(it);
    } else if (auto inner = inner_ids_.find(batch_id); inner != inner_ids_.end()) {
      inner_id = inner->second;
    } else {
      return Status::NotFound(fmt::format("batch {} is not live", batch_id));
    }
  }
  // Outside our lock: the inner completion takes it.
  if (inner_id != 0) return inner_->Cancel(inner_id);
  BatchResult result;
  result.batch_id = batch_id;
  result.status = Status::Cancelled("cancelled while held by fault injection (never submitted)");
  held.done(result);
  return Status::Ok();
}

Status FaultInjectingEngine::Submit(uint64_t outer_id, ReadBatchRequest request,
                                    std::shared_ptr<BatchCallback> shared_done) {
  Result<uint64_t> inner_id = Status::Internal("not submitted");
  {
    // Held across the inner ReadBatch so the id mapping exists before the completion (on the inner
    // engine's thread, which takes mu_) can erase it. The inner engine never completes a batch
    // inside ReadBatch.
    MutexLock lock(&mu_);
    inner_id = inner_->ReadBatch(std::move(request), [this, outer_id, shared_done](const BatchResult& inner) {
      {
        MutexLock inner_lock(&mu_);
        inner_ids_.erase(outer_id);
      }
      BatchResult result = inner;
      result.batch_id = outer_id;
      (*shared_done)(result);
    });
    if (inner_id.ok()) inner_ids_[outer_id] = *inner_id;
  }
  return inner_id.status();
}

void FaultInjectingEngine::TimerLoop() {
  MutexLock lock(&mu_);
  while (!stopping_ || !held_.empty()) {
    MonoTime now = MonoNow();
    MonoTime next = MonoTime::max();
    std::vector<std::pair<uint64_t, Held>> due;
    for (auto it = held_.begin(); it != held_.end();) {
      if (stopping_ || it->second.release <= now) {
        due.emplace_back(it->first, std::move(it->second));
        it = held_.erase(it);
      } else {
        next = std::min(next, it->second.release);
        ++it;
      }
    }
    if (!due.empty()) {
      bool stopping = stopping_;
      mu_.Unlock();
      for (auto& [id, held] : due) {
        if (held.fault == Fault::kDelay && !stopping) {
          auto shared_done = std::make_shared<BatchCallback>(std::move(held.done));
          if (Status status = Submit(id, std::move(held.request), shared_done); !status.ok()) {
            BatchResult result;
            result.batch_id = id;
            result.status = status;
            (*shared_done)(result);
          }
        } else {
          BatchResult result;
          result.batch_id = id;
          result.status = stopping ? Status::Cancelled("fault injection engine destroyed")
                                   : Status::DeadlineExceeded("fault injection dropped the batch");
          held.done(result);
        }
      }
      mu_.Lock();
      continue;
    }
    if (stopping_) break;
    if (next == MonoTime::max()) {
      cv_.wait(mu_);
    } else {
      cv_.wait_until(mu_, next);
    }
  }
}

}  // namespace orbitkv::transfer
