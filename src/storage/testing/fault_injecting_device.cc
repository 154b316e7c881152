#include "storage/testing/fault_injecting_device.h"

#include <vector>

namespace orbitkv::storage::testing {

FaultInjectingDevice::FaultInjectingDevice(std::unique_ptr<Device> inner)
    : Device(inner->size(), inner->io_alignment()), inner_(std::move(inner)) {}

void FaultInjectingDevice::FailReads(uint64_t after, uint64_t count, Status status) {
  MutexLock lock(&mu_);
  pass_ = after;
  fail_ = count;
  status_ = std::move(status);
}

void FaultInjectingDevice::DoSubmit(std::span<const IoRequest> requests, std::span<const size_t> valid,
                                    std::span<Status> statuses) {
  // Which of the valid requests fail here; the others go to the real device in one batch.
  std::vector<IoRequest> pass;
  std::vector<size_t> pass_index;
  {
    MutexLock lock(&mu_);
    for (size_t i : valid) {
      if (requests[i].op == IoRequest::Op::kRead && fail_ > 0) {
        if (pass_ > 0) {
          --pass_;
        } else {
          --fail_;
          statuses[i] = status_;
          failed_.fetch_add(1, std::memory_order_relaxed);
          continue;
        }
      }
      pass.push_back(requests[i]);
      pass_index.push_back(i);
    }
  }
  if (pass.empty()) return;
  const std::vector<Status> done = inner_->Submit(pass);
  for (size_t k = 0; k < pass_index.size(); ++k) statuses[pass_index[k]] = done[k];
}

}  // namespace orbitkv::storage::testing
