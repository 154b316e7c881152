// The fault decorator over a real UcxTransferEngine pair on loopback tcp.
#include "transfer/fault_injecting_engine.h"

#include <gtest/gtest.h>

#include "transfer/test_util.h"
#include "transfer/ucx_engine.h"

namespace orbitkv::transfer {
namespace {

using testing::BatchWaiter;
using testing::TestBuffer;

constexpr uint64_t kSeed = 99;
constexpr uint64_t kBytes = 1 << 20;
constexpr auto kWait = std::chrono::seconds(60);

class FaultInjectingEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    UcxEngineOptions options;
    options.transports = "tcp";
    source_ = *UcxTransferEngine::Create(options);
    requester_ = *UcxTransferEngine::Create(options);
    faulty_ = std::make_unique<FaultInjectingEngine>(requester_.get());
    testing::FillPattern(source_buffer_.data(), kBytes, kSeed);
    descriptor_ = *source_->ExportRegion(*source_->RegisterRegion(source_buffer_.data(), kBytes));
    local_ = *faulty_->RegisterRegion(dest_.data(), kBytes);
  }
  void TearDown() override {
    faulty_.reset();
    requester_.reset();
    source_.reset();
  }

  ReadBatchRequest Request(bool checksum = true) {
    ReadBatchRequest r;
    r.peer = source_->ListenAddress();
    r.remotes = {descriptor_};
    r.fragments = {Fragment{0, 1000, local_, 0, 5000}, Fragment{0, 300000, local_, 8192, 70000}};
    r.deadline = Deadline::After(kWait);
    r.verify_checksum = checksum;
    return r;
  }

  BatchResult Run(ReadBatchRequest r) {
    BatchWaiter waiter;
    EXPECT_TRUE(faulty_->ReadBatch(std::move(r), waiter.Callback()).ok());
    auto result = waiter.Wait(Deadline::After(kWait + std::chrono::seconds(30)));
    EXPECT_TRUE(result.has_value());
    return result.value_or(BatchResult{});
  }

  bool Landed() const {
    return testing::FindPatternMismatch(dest_.data(), 5000, kSeed, 1000) == -1 &&
           testing::FindPatternMismatch(dest_.data() + 8192, 70000, kSeed, 300000) == -1;
  }

  std::unique_ptr<UcxTransferEngine> source_;
  std::unique_ptr<UcxTransferEngine> requester_;
  std::unique_ptr<FaultInjectingEngine> faulty_;
  TestBuffer source_buffer_{kBytes};
  TestBuffer dest_{kBytes};
  RegionDescriptor descriptor_;
  RegionHandle local_;
};

TEST_F(FaultInjectingEngineTest, PassesThroughWithoutFaults) {
  BatchResult result = Run(Request());
  ASSERT_TRUE(result.status.ok()) << result.status;
  EXPECT_TRUE(Landed());
}

TEST_F(FaultInjectingEngineTest, DroppedBatchEndsAtItsDeadline) {
  faulty_->Drop(1);
  ReadBatchRequest r = Request();
  r.deadline = Deadline::After(std::chrono::milliseconds(200));
  MonoTime deadline = r.deadline.when();
  BatchResult result = Run(std::move(r));
  EXPECT_EQ(result.status.code(), StatusCode::kDeadlineExceeded) << result.status;
  EXPECT_GE(MonoNow(), deadline);
  // The next batch is not dropped.
  EXPECT_TRUE(Run(Request()).status.ok());
}

TEST_F(FaultInjectingEngineTest, CorruptionIsCaughtByTheChecksum) {
  faulty_->Corrupt(1);
  BatchResult result = Run(Request());
  EXPECT_EQ(result.status.code(), StatusCode::kDataLoss) << result.status;
  EXPECT_FALSE(Landed());
}

TEST_F(FaultInjectingEngineTest, CorruptionPassesSilentlyWithoutTheChecksum) {
  faulty_->Corrupt(1);
  BatchResult result = Run(Request(/*checksum=*/false));
  EXPECT_TRUE(result.status.ok()) << result.status;
  EXPECT_FALSE(Landed());  // Why the checksum is on by default.
}

TEST_F(FaultInjectingEngineTest, FailAfterN) {
  faulty_->FailAfter(1);
  EXPECT_TRUE(Run(Request()).status.ok());
  EXPECT_EQ(Run(Request()).status.code(), StatusCode::kUnavailable);
  EXPECT_EQ(Run(Request()).status.code(), StatusCode::kUnavailable);
}

TEST_F(FaultInjectingEngineTest, CancellingAHeldBatchEndsItAtOnce) {
  faulty_->Delay(1, std::chrono::seconds(3600));
  BatchWaiter waiter;
  Result<uint64_t> id = faulty_->ReadBatch(Request(), waiter.Callback());
  ASSERT_TRUE(id.ok());
  EXPECT_EQ(faulty_->Stats().live_batches, 1u);
  ASSERT_TRUE(faulty_->Cancel(*id).ok());
  auto result = waiter.Wait(Deadline::After(kWait));
  ASSERT_TRUE(result.has_value());
  EXPECT_EQ(result->status.code(), StatusCode::kCancelled);
  EXPECT_EQ(faulty_->Cancel(*id).code(), StatusCode::kNotFound);
  EXPECT_EQ(faulty_->Stats().live_batches, 0u);
}

}  // namespace
}  // namespace orbitkv::transfer
