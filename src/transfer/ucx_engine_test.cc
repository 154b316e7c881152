// UcxTransferEngine between two engines of one process over loopback tcp (UCX_TLS=tcp): byte-exact
// scattered reads in both pull modes, concurrency, cancellation, stale descriptors, validation,
// pins, deadlines against a peer that never answers, and shutdown with live batches.
#include "transfer/ucx_engine.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <atomic>
#include <optional>
#include <random>
#include <thread>

#include "base/runtime_id.h"
#include "base/scoped_fd.h"
#include "transfer/test_util.h"

namespace orbitkv::transfer {
namespace {

using testing::BatchWaiter;
using testing::FindPatternMismatch;
using testing::TestBuffer;

constexpr uint64_t kSeed = 42;
// Generous: a loaded 2-core CI machine; a hang is what these bounds detect, not slowness.
constexpr auto kWait = std::chrono::seconds(60);

// `inflight` bounds both windows (the requester's RMA gets and what a served request posts);
// `served`, when given, sets the served one alone.
std::unique_ptr<UcxTransferEngine> MakeEngine(PullMode mode = PullMode::kAuto, uint64_t inflight = 64ull << 20,
                                              bool require_grants = false,
                                              std::optional<uint64_t> served = std::nullopt) {
  UcxEngineOptions options;
  options.require_grants = require_grants;
  options.listen_address = "127.0.0.1:0";
  options.transports = "tcp";
  options.default_mode = mode;
  options.max_inflight_bytes = inflight;
  options.max_served_inflight_bytes = served.value_or(inflight);
  auto engine = UcxTransferEngine::Create(options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return std::move(engine).value();
}

struct Plan {
  std::vector<Fragment> fragments;
  uint64_t bytes = 0;
};

// `count` fragments of random lengths in [min_len, max_len] at random source offsets, packed back
// to back in the destination (so every destination byte is checked against exactly one source
// offset).
Plan RandomPlan(size_t count, uint64_t min_len, uint64_t max_len, uint64_t source_bytes, RegionHandle local,
                uint64_t seed) {
  std::mt19937_64 rng(seed);
  Plan plan;
  for (size_t i = 0; i < count; ++i) {
    uint64_t len = min_len + rng() % (max_len - min_len + 1);
    Fragment f;
    f.remote = 0;
    f.remote_offset = rng() % (source_bytes - len + 1);
    f.local = local;
    f.local_offset = plan.bytes;
    f.length = len;
    plan.bytes += len;
    plan.fragments.push_back(f);
  }
  return plan;
}

void ExpectLanded(const Plan& plan, const TestBuffer& dest) {
  for (size_t i = 0; i < plan.fragments.size(); ++i) {
    const Fragment& f = plan.fragments[i];
    int64_t bad = FindPatternMismatch(dest.data() + f.local_offset, f.length, kSeed, f.remote_offset);
    ASSERT_EQ(bad, -1) << "fragment " << i << " differs at byte " << bad;
  }
}

// A source with the windows production runs with (the requester's default 64 MiB, the served
// default) serving kSourceBytes of the test pattern from one region.
struct ProductionSource {
  static constexpr uint64_t kBytes = 16ull << 20;
  explicit ProductionSource(bool require_grants)
      : buffer(kBytes),
        engine(MakeEngine(PullMode::kAuto, UcxEngineOptions{}.max_inflight_bytes, require_grants,
                          UcxEngineOptions{}.max_served_inflight_bytes)) {
    testing::FillPattern(buffer.data(), kBytes, kSeed);
    region = *engine->RegisterRegion(buffer.data(), kBytes);
  }
  TestBuffer buffer;  // outlives the engine
  std::unique_ptr<UcxTransferEngine> engine;
  RegionHandle region;
};

class UcxEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    source_ = MakeEngine();
    source_buffer_ = std::make_unique<TestBuffer>(kSourceBytes);
    testing::FillPattern(source_buffer_->data(), kSourceBytes, kSeed);
    auto handle = source_->RegisterRegion(source_buffer_->data(), kSourceBytes);
    ASSERT_TRUE(handle.ok()) << handle.status();
    source_region_ = *handle;
    descriptor_ = *source_->ExportRegion(source_region_);
  }

  ReadBatchRequest Request(const Plan& plan, PullMode mode = PullMode::kAuto) {
    ReadBatchRequest r;
    r.peer = source_->ListenAddress();
    r.remotes = {descriptor_};
    r.fragments = plan.fragments;
    r.deadline = Deadline::After(kWait);
    r.mode = mode;
    return r;
  }

  BatchResult ReadAndWait(UcxTransferEngine& engine, ReadBatchRequest request) {
    BatchWaiter waiter;
    Result<uint64_t> id = engine.ReadBatch(std::move(request), waiter.Callback());
    EXPECT_TRUE(id.ok()) << id.status();
    std::optional<BatchResult> result = waiter.Wait(Deadline::After(kWait + std::chrono::seconds(30)));
    EXPECT_TRUE(result.has_value()) << "batch did not complete";
    return result.value_or(BatchResult{});
  }

  static constexpr uint64_t kSourceBytes = 16ull << 20;
  std::unique_ptr<UcxTransferEngine> source_;
  std::unique_ptr<TestBuffer> source_buffer_;
  RegionHandle source_region_;
  RegionDescriptor descriptor_;
};

TEST_F(UcxEngineTest, ActiveMessagePullLandsScatteredFragmentsByteExact) {
  auto requester = MakeEngine();
  TestBuffer dest(32ull << 20);
  RegionHandle local = *requester->RegisterRegion(dest.data(), dest.size());
  // Small fragments travel eagerly, large ones by rendezvous: cover both.
  Plan plan = RandomPlan(300, 1, 48 << 10, kSourceBytes, local, 1);
  Plan big = RandomPlan(6, 1 << 20, 3 << 20, kSourceBytes, local, 2);
  for (Fragment f : big.fragments) {
    f.local_offset += plan.bytes;
    plan.fragments.push_back(f);
  }
  plan.bytes += big.bytes;
  ASSERT_LE(plan.bytes, dest.size());

  BatchResult result = ReadAndWait(*requester, Request(plan, PullMode::kActiveMessage));
  ASSERT_TRUE(result.status.ok()) << result.status;
  EXPECT_EQ(result.mode, PullMode::kActiveMessage);
  EXPECT_TRUE(result.checksum_verified);
  EXPECT_EQ(result.bytes, plan.bytes);
  ExpectLanded(plan, dest);
  EXPECT_TRUE(requester->UnregisterRegion(local).ok());
}

TEST_F(UcxEngineTest, RmaPullLandsScatteredFragmentsByteExact) {
  auto requester = MakeEngine();
  TestBuffer dest(4ull << 20);
  RegionHandle local = *requester->RegisterRegion(dest.data(), dest.size());
  // tcp emulates RMA slowly: keep this one small.
  Plan plan = RandomPlan(64, 1, 32 << 10, kSourceBytes, local, 3);
  BatchResult result = ReadAndWait(*requester, Request(plan, PullMode::kRma));
  ASSERT_TRUE(result.status.ok()) << result.status;
  EXPECT_EQ(result.mode, PullMode::kRma);
  EXPECT_TRUE(result.checksum_verified);
  ExpectLanded(plan, dest);
}

TEST_F(UcxEngineTest, AutoModeStaysOnActiveMessagesOverTcp) {
  auto requester = MakeEngine();
  TestBuffer dest(1 << 20);
  RegionHandle local = *requester->RegisterRegion(dest.data(), dest.size());
  Plan plan = RandomPlan(8, 100, 4096, kSourceBytes, local, 4);
  for (int i = 0; i < 2; ++i) {
    BatchResult result = ReadAndWait(*requester, Request(plan));
    ASSERT_TRUE(result.status.ok()) << result.status;
    // The second batch runs after the endpoint's lanes were inspected: tcp has no native RMA lane.
    EXPECT_EQ(result.mode, PullMode::kActiveMessage) << "batch " << i;
  }
  EXPECT_EQ(requester->Stats().peer_endpoints, 1u);  // Pooled: one endpoint for both batches.
}

TEST_F(UcxEngineTest, ChecksumCanBeTurnedOff) {
  auto requester = MakeEngine();
  TestBuffer dest(1 << 20);
  RegionHandle local = *requester->RegisterRegion(dest.data(), dest.size());
  Plan plan = RandomPlan(16, 1, 32 << 10, kSourceBytes, local, 5);
  ReadBatchRequest request = Request(plan);
  request.verify_checksum = false;
  BatchResult result = ReadAndWait(*requester, std::move(request));
  ASSERT_TRUE(result.status.ok()) << result.status;
  EXPECT_FALSE(result.checksum_verified);
  ExpectLanded(plan, dest);
}

TEST_F(UcxEngineTest, ConcurrentBatchesFromSeveralThreads) {
  auto requester = MakeEngine();
  constexpr int kThreads = 3;
  constexpr int kBatchesPerThread = 4;
  std::vector<std::unique_ptr<TestBuffer>> dests;
  std::vector<RegionHandle> locals;
  for (int t = 0; t < kThreads * kBatchesPerThread; ++t) {
    dests.push_back(std::make_unique<TestBuffer>(4 << 20));
    locals.push_back(*requester->RegisterRegion(dests.back()->data(), dests.back()->size()));
  }
  std::vector<Plan> plans(dests.size());
  std::vector<std::optional<BatchResult>> results(dests.size());
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<std::unique_ptr<BatchWaiter>> waiters;
      for (int b = 0; b < kBatchesPerThread; ++b) {
        size_t k = t * kBatchesPerThread + b;
        plans[k] = RandomPlan(40, 1, 96 << 10, kSourceBytes, locals[k], 100 + k);
        waiters.push_back(std::make_unique<BatchWaiter>());
        EXPECT_TRUE(requester->ReadBatch(Request(plans[k]), waiters.back()->Callback()).ok());
      }
      for (int b = 0; b < kBatchesPerThread; ++b) {
        results[t * kBatchesPerThread + b] = waiters[b]->Wait(Deadline::After(kWait + std::chrono::seconds(30)));
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (size_t k = 0; k < dests.size(); ++k) {
    ASSERT_TRUE(results[k].has_value()) << k;
    ASSERT_TRUE(results[k]->status.ok()) << k << ": " << results[k]->status;
    ExpectLanded(plans[k], *dests[k]);
  }
  EXPECT_EQ(requester->Stats().live_batches, 0u);
  EXPECT_EQ(requester->Stats().pinned_regions, 0u);
}

TEST_F(UcxEngineTest, ASmallBatchIssuedBehindALargeOneIsNotHeldBackByIt) {
  // A source with the default served window posts a served request a few fragments at a time, so a
  // later request's fragments and its done message queue behind that window of the large batch's
  // data, not all of it (UCX interleaves everything posted: with the whole 64 MiB posted, every
  // fragment of both batches ended together). The windows production runs with: the requester's
  // default 64 MiB, the served default.
  ProductionSource served(/*require_grants=*/false);
  UcxTransferEngine* source = served.engine.get();
  const RegionHandle region = served.region;
  auto requester = MakeEngine();
  TestBuffer large_dest(64ull << 20);
  TestBuffer small_dest(1ull << 20);
  RegionHandle large_local = *requester->RegisterRegion(large_dest.data(), large_dest.size());
  RegionHandle small_local = *requester->RegisterRegion(small_dest.data(), small_dest.size());
  // 64 MiB: 16 times the served window (and all of the requester's, so a source that served with
  // that one posts the whole batch at once and fails here); the small request arrives while it
  // streams.
  const Plan large = RandomPlan(64, 1 << 20, 1 << 20, kSourceBytes, large_local, 41);
  const Plan small = RandomPlan(4, 16 << 10, 64 << 10, kSourceBytes, small_local, 42);
  auto request = [&](const Plan& plan) {
    ReadBatchRequest r = Request(plan, PullMode::kActiveMessage);
    r.peer = source->ListenAddress();
    r.remotes = {*source->ExportRegion(region)};
    return r;
  };
  BatchWaiter large_waiter, small_waiter;
  ASSERT_TRUE(requester->ReadBatch(request(large), large_waiter.Callback()).ok());
  ASSERT_TRUE(requester->ReadBatch(request(small), small_waiter.Callback()).ok());
  std::optional<BatchResult> small_result = small_waiter.Wait(Deadline::After(kWait + std::chrono::seconds(30)));
  const bool large_done_first = large_waiter.done();
  std::optional<BatchResult> large_result = large_waiter.Wait(Deadline::After(kWait + std::chrono::seconds(30)));
  ASSERT_TRUE(small_result.has_value() && large_result.has_value());
  ASSERT_TRUE(small_result->status.ok()) << small_result->status;
  ASSERT_TRUE(large_result->status.ok()) << large_result->status;
  EXPECT_FALSE(large_done_first) << "the small batch waited for the 64 MiB one ahead of it";
  ExpectLanded(small, small_dest);
  ExpectLanded(large, large_dest);
  EXPECT_TRUE(requester->UnregisterRegion(small_local).ok());
  EXPECT_TRUE(requester->UnregisterRegion(large_local).ok());
}

TEST_F(UcxEngineTest, CancelStopsTheSourceAndDrainsBeforeReleasing) {
  // A small in-flight window at the source so that the cancel arrives long before the last fragment
  // is sent.
  source_ = MakeEngine(PullMode::kAuto, /*inflight=*/128 << 10);
  auto handle = source_->RegisterRegion(source_buffer_->data(), kSourceBytes);
  ASSERT_TRUE(handle.ok());
  descriptor_ = *source_->ExportRegion(*handle);
  auto requester = MakeEngine();
  TestBuffer dest(64ull << 20);
  RegionHandle local = *requester->RegisterRegion(dest.data(), dest.size());
  Plan plan = RandomPlan(1024, 64 << 10, 64 << 10, kSourceBytes, local, 6);

  BatchWaiter waiter;
  Result<uint64_t> id = requester->ReadBatch(Request(plan, PullMode::kActiveMessage), waiter.Callback());
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(requester->Cancel(*id).ok());
  std::optional<BatchResult> result = waiter.Wait(Deadline::After(kWait));
  ASSERT_TRUE(result.has_value());
  EXPECT_EQ(result->status.code(), StatusCode::kCancelled) << result->status;
  // Completion means drained: the destination and the source's pins are free again.
  EXPECT_EQ(requester->Cancel(*id).code(), StatusCode::kNotFound);
  EXPECT_TRUE(requester->UnregisterRegion(local).ok());
  for (int i = 0; i < 1000 && source_->Stats().serving_requests != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));  // The source's done send completes async.
  }
  EXPECT_EQ(source_->Stats().serving_requests, 0u);
  EXPECT_TRUE(source_->UnregisterRegion(*handle).ok());
}

TEST_F(UcxEngineTest, StaleDescriptorIsRefusedBySource) {
  auto requester = MakeEngine();
  TestBuffer dest(1 << 20);
  RegionHandle local = *requester->RegisterRegion(dest.data(), dest.size());
  Plan plan = RandomPlan(4, 10, 1000, kSourceBytes, local, 7);
  ASSERT_TRUE(source_->UnregisterRegion(source_region_).ok());
  // Re-registering the same memory gives a new generation; the old descriptor stays dead.
  RegionHandle again = *source_->RegisterRegion(source_buffer_->data(), kSourceBytes);
  EXPECT_NE(again.generation, source_region_.generation);
  BatchResult result = ReadAndWait(*requester, Request(plan, PullMode::kActiveMessage));
  EXPECT_EQ(result.status.code(), StatusCode::kNotFound) << result.status;
  EXPECT_NE(result.status.message().find("not registered"), std::string_view::npos) << result.status;

  RegionDescriptor other_incarnation = *source_->ExportRegion(again);
  other_incarnation.engine_id ^= 1;
  ReadBatchRequest request = Request(plan, PullMode::kActiveMessage);
  request.remotes = {other_incarnation};
  result = ReadAndWait(*requester, std::move(request));
  EXPECT_EQ(result.status.code(), StatusCode::kNotFound) << result.status;
  EXPECT_NE(result.status.message().find("incarnation"), std::string_view::npos) << result.status;
  EXPECT_EQ(requester->Stats().pinned_regions, 0u);
}

// Waits (boundedly) for a drained callback.
class DrainFlag {
 public:
  DrainedCallback Callback() {
    return [this] { fired_.fetch_add(1, std::memory_order_acq_rel); };
  }
  bool Wait() const {
    for (int i = 0; i < 6000 && fired_.load(std::memory_order_acquire) == 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return fired_.load(std::memory_order_acquire) == 1;
  }
  int fired() const { return fired_.load(std::memory_order_acquire); }

 private:
  std::atomic<int> fired_{0};
};

TEST_F(UcxEngineTest, AGrantBoundsEveryFragmentItServes) {
  source_ = MakeEngine(PullMode::kAuto, 64ull << 20, /*require_grants=*/true);
  RegionHandle region = *source_->RegisterRegion(source_buffer_->data(), kSourceBytes);
  descriptor_ = *source_->ExportRegion(region);
  EXPECT_TRUE(descriptor_.rkey.empty()) << "with grants required no rkey may leave the source";
  EXPECT_TRUE(source_->GetCapabilities().grants_required);
  auto requester = MakeEngine();
  // Granted: [1 MiB, +2 MiB) and [8 MiB, +64 KiB).
  auto grant = source_->CreateGrant(GrantRequest{"node-b", {{region, 8 << 20, 64 << 10}, {region, 1 << 20, 2 << 20}}});
  ASSERT_TRUE(grant.ok()) << grant.status();
  EXPECT_EQ(source_->Stats().live_grants, 1u);
  const uint64_t id = grant->id;
  const GrantSecret secret = grant->secret;
  auto read_as = [&](UcxTransferEngine& reader, uint64_t grant_id, const GrantSecret& presented,
                     std::vector<std::pair<uint64_t, uint64_t>> spans, PullMode mode = PullMode::kAuto) {
    TestBuffer into(4 << 20);
    std::memset(into.data(), 0, into.size());
    RegionHandle landing = *reader.RegisterRegion(into.data(), into.size());
    Plan plan;
    for (auto [offset, length] : spans) {
      plan.fragments.push_back(Fragment{0, offset, landing, plan.bytes, length});
      plan.bytes += length;
    }
    ReadBatchRequest request = Request(plan, mode);
    request.grant = grant_id;
    request.grant_secret = presented;
    BatchResult result = ReadAndWait(reader, std::move(request));
    if (result.status.ok()) {
      ExpectLanded(plan, into);
    } else {
      // Refused: nothing landed.
      EXPECT_EQ(std::count(into.data(), into.data() + plan.bytes, uint8_t{0}), static_cast<long>(plan.bytes));
    }
    EXPECT_TRUE(reader.UnregisterRegion(landing).ok());
    return result.status;
  };
  auto read = [&](uint64_t grant_id, std::vector<std::pair<uint64_t, uint64_t>> spans,
                  PullMode mode = PullMode::kAuto) { return read_as(*requester, grant_id, secret, spans, mode); };
  // Inside the grant (both ranges, their edges included), with its secret: byte exact, by active messages.
  EXPECT_TRUE(read(id, {{1 << 20, 4096}, {(3 << 20) - 100, 100}, {8 << 20, 64 << 10}}).ok());
  // No grant, a grant never issued, a fragment one byte past a range, a fragment in a gap between
  // ranges, a fragment spanning a range's end: refused as a whole, by the source.
  for (auto [grant_id, spans] : std::vector<std::pair<uint64_t, std::vector<std::pair<uint64_t, uint64_t>>>>{
           {0, {{1 << 20, 4096}}},
           {id ^ 0x5a5a, {{1 << 20, 4096}}},
           {id, {{1 << 20, 4096}, {(3 << 20) - 100, 101}}},
           {id, {{4 << 20, 4096}}},
           {id, {{(8 << 20) + (60 << 10), 8 << 10}}},
           {id, {{0, 4096}}}}) {
    Status refused = read(grant_id, spans);
    EXPECT_EQ(refused.code(), StatusCode::kPermissionDenied) << refused;
  }
  // Issue 52: the grant id replayed by a third host, without the secret or with a wrong one, reads nothing; the
  // holder's own request without its secret neither. Each is counted.
  auto third = MakeEngine();
  GrantSecret wrong = secret;
  wrong[5] ^= 0x01;
  for (auto [reader, presented] : std::vector<std::pair<UcxTransferEngine*, GrantSecret>>{
           {third.get(), GrantSecret{}}, {third.get(), wrong}, {requester.get(), GrantSecret{}}}) {
    Status refused = read_as(*reader, id, presented, {{1 << 20, 4096}});
    EXPECT_EQ(refused.code(), StatusCode::kPermissionDenied) << refused;
    EXPECT_NE(refused.message().find("does not present the grant's secret"), std::string::npos) << refused;
  }
  EXPECT_EQ(source_->Stats().grant_secret_refusals, 3u);
  EXPECT_TRUE(read(id, {{1 << 20, 4096}}).ok());  // the holder, with its secret, still reads
  // RMA is off: there is no rkey to read with.
  EXPECT_EQ(read(id, {{1 << 20, 4096}}, PullMode::kRma).code(), StatusCode::kInvalidArgument);
  // The grant pins its region; after revoking and draining it refuses, and the region is free.
  EXPECT_EQ(source_->UnregisterRegion(region).code(), StatusCode::kFailedPrecondition);
  DrainFlag drained;
  ASSERT_TRUE(source_->RevokeGrant(id, drained.Callback()).ok());
  EXPECT_EQ(source_->RevokeGrant(id, nullptr).code(), StatusCode::kNotFound);
  EXPECT_TRUE(drained.Wait());
  EXPECT_EQ(read(id, {{1 << 20, 4096}}).code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(source_->Stats().live_grants, 0u);
  EXPECT_TRUE(source_->UnregisterRegion(region).ok());
  EXPECT_EQ(requester->Stats().pinned_regions, 0u);
}

TEST_F(UcxEngineTest, TheBatchesOfOneGrantAreServedInOrder) {
  // One fetch's pipelined batches (one grant) are posted one request after the other: the first
  // ends while the second still streams, instead of both ending together. A request whose turn
  // comes while the one ahead of it is cancelled goes on at once.
  static_assert(ProductionSource::kBytes == kSourceBytes);
  ProductionSource served(/*require_grants=*/true);
  UcxTransferEngine* source = served.engine.get();
  const RegionHandle region = served.region;
  auto requester = MakeEngine();
  auto grant = source->CreateGrant(GrantRequest{"node-b", {{region, 0, kSourceBytes}}});
  ASSERT_TRUE(grant.ok()) << grant.status();
  TestBuffer dest(48ull << 20);
  RegionHandle local = *requester->RegisterRegion(dest.data(), dest.size());
  auto request = [&](const Plan& plan) {
    ReadBatchRequest r = Request(plan, PullMode::kActiveMessage);
    r.peer = source->ListenAddress();
    r.remotes = {*source->ExportRegion(region)};
    r.grant = grant->id;
    r.grant_secret = grant->secret;
    return r;
  };
  // 16 MiB each, four times the served window, packed one after the other in `dest`.
  Plan first = RandomPlan(16, 1 << 20, 1 << 20, kSourceBytes, local, 51);
  Plan second = RandomPlan(16, 1 << 20, 1 << 20, kSourceBytes, local, 52);
  for (Fragment& f : second.fragments) f.local_offset += first.bytes;
  std::memset(dest.data(), 0, dest.size());
  // Counted in whichever completion comes first, on the engine's thread, which is also the one
  // landing data: how many fragments of the other batch had landed by then. Served side by side,
  // all or nearly all of them; in order, about one served window (4 of 16). Which request the
  // source takes first is the order they arrive in, which on a new endpoint may not be the order
  // they were sent in.
  auto landed = [&](const Plan& plan) {
    size_t count = 0;
    for (const Fragment& f : plan.fragments) {
      if (FindPatternMismatch(dest.data() + f.local_offset, f.length, kSeed, f.remote_offset) == -1) ++count;
    }
    return count;
  };
  std::optional<size_t> other_landed_at_first_done;
  auto counting = [&](const Plan& other, BatchCallback forward) -> BatchCallback {
    return [&, other = &other, forward = std::move(forward)](const BatchResult& result) {
      if (!other_landed_at_first_done.has_value()) other_landed_at_first_done = landed(*other);
      forward(result);
    };
  };
  BatchWaiter first_waiter, second_waiter;
  ASSERT_TRUE(requester->ReadBatch(request(first), counting(second, first_waiter.Callback())).ok());
  ASSERT_TRUE(requester->ReadBatch(request(second), counting(first, second_waiter.Callback())).ok());
  std::optional<BatchResult> first_result = first_waiter.Wait(Deadline::After(kWait + std::chrono::seconds(30)));
  std::optional<BatchResult> second_result = second_waiter.Wait(Deadline::After(kWait + std::chrono::seconds(30)));
  ASSERT_TRUE(first_result.has_value() && second_result.has_value());
  ASSERT_TRUE(first_result->status.ok()) << first_result->status;
  ASSERT_TRUE(second_result->status.ok()) << second_result->status;
  ASSERT_TRUE(other_landed_at_first_done.has_value());
  EXPECT_LT(*other_landed_at_first_done, second.fragments.size() / 2)
      << "the two batches of the grant streamed side by side instead of one after the other ("
      << *other_landed_at_first_done << " of the other's 16 fragments had landed when one ended)";
  ExpectLanded(first, dest);
  ExpectLanded(second, dest);

  // A 32 MiB batch cancelled at once: the small one queued behind it in the grant is served.
  Plan large = RandomPlan(32, 1 << 20, 1 << 20, kSourceBytes, local, 53);
  Plan small = RandomPlan(4, 16 << 10, 64 << 10, kSourceBytes, local, 54);
  for (Fragment& f : small.fragments) f.local_offset += large.bytes;
  BatchWaiter large_waiter, small_waiter;
  Result<uint64_t> large_id = requester->ReadBatch(request(large), large_waiter.Callback());
  ASSERT_TRUE(large_id.ok());
  ASSERT_TRUE(requester->ReadBatch(request(small), small_waiter.Callback()).ok());
  ASSERT_TRUE(requester->Cancel(*large_id).ok());
  std::optional<BatchResult> small_result = small_waiter.Wait(Deadline::After(kWait + std::chrono::seconds(30)));
  ASSERT_TRUE(small_result.has_value());
  ASSERT_TRUE(small_result->status.ok()) << small_result->status;
  ExpectLanded(small, dest);
  ASSERT_TRUE(large_waiter.Wait(Deadline::After(kWait + std::chrono::seconds(30))).has_value());

  DrainFlag drained;
  ASSERT_TRUE(source->RevokeGrant(grant->id, drained.Callback()).ok());
  EXPECT_TRUE(drained.Wait());
  EXPECT_EQ(source->Stats().live_grants, 0u);
  EXPECT_TRUE(source->UnregisterRegion(region).ok());
  EXPECT_TRUE(requester->UnregisterRegion(local).ok());
}

TEST_F(UcxEngineTest, GrantsAreCheckedAgainstTheirRegionsWhenIssued) {
  auto other = std::make_unique<TestBuffer>(1 << 20);
  RegionHandle small = *source_->RegisterRegion(other->data(), 1 << 20);
  EXPECT_EQ(source_->CreateGrant(GrantRequest{"p", {}}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(source_->CreateGrant(GrantRequest{"p", {{small, 1 << 20, 1}}}).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(source_->CreateGrant(GrantRequest{"p", {{small, 0, 0}}}).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(source_->CreateGrant(GrantRequest{"p", {{small, 0, 4096}, {small, 100, 4096}}}).status().code(),
            StatusCode::kInvalidArgument);  // overlapping ranges
  RegionHandle stale = small;
  stale.generation += 1;
  EXPECT_EQ(source_->CreateGrant(GrantRequest{"p", {{stale, 0, 4096}}}).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(source_->Stats().live_grants, 0u);
  EXPECT_TRUE(source_->UnregisterRegion(small).ok());  // a refused grant pins nothing
}

// Revoking a peer while its fragments are in flight: its endpoints are force-closed, the batch
// fails, and the grant's pins are released only once every send of it is terminal (ASan/TSan: no
// use after free, nothing freed before the drain).
TEST_F(UcxEngineTest, RevokingAPeerMidTransferDrainsBeforeReleasing) {
  source_ = MakeEngine(PullMode::kAuto, /*inflight=*/256 << 10, /*require_grants=*/true);
  RegionHandle region = *source_->RegisterRegion(source_buffer_->data(), kSourceBytes);
  descriptor_ = *source_->ExportRegion(region);
  auto requester = MakeEngine();
  TestBuffer dest(64ull << 20);
  RegionHandle local = *requester->RegisterRegion(dest.data(), dest.size());
  auto grant = source_->CreateGrant(GrantRequest{"node-b", {{region, 0, kSourceBytes}}});
  auto kept = source_->CreateGrant(GrantRequest{"node-c", {{region, 0, 4096}}});
  ASSERT_TRUE(grant.ok() && kept.ok());
  Plan plan = RandomPlan(1024, 64 << 10, 64 << 10, kSourceBytes, local, 11);
  ReadBatchRequest request = Request(plan, PullMode::kActiveMessage);
  request.grant = grant->id;
  request.grant_secret = grant->secret;
  BatchWaiter waiter;
  ASSERT_TRUE(requester->ReadBatch(std::move(request), waiter.Callback()).ok());
  for (int i = 0; i < 2000 && source_->Stats().serving_requests == 0 && !waiter.done(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  DrainFlag drained;
  ASSERT_TRUE(source_->RevokePeer("node-b", drained.Callback()).ok());
  std::optional<BatchResult> result = waiter.Wait(Deadline::After(kWait));
  ASSERT_TRUE(result.has_value());
  ASSERT_TRUE(drained.Wait());
  if (!result->status.ok()) {  // (a fast machine may have finished all 64 MiB before the revoke)
    EXPECT_TRUE(result->status.code() == StatusCode::kPermissionDenied ||
                result->status.code() == StatusCode::kUnavailable)
        << result->status;
  }
  // Drained means: nothing of the grant is in flight and its pins are gone; the other peer's grant
  // still pins the region.
  EXPECT_EQ(source_->Stats().serving_requests, 0u);
  EXPECT_EQ(source_->Stats().live_grants, 1u);
  EXPECT_EQ(source_->UnregisterRegion(region).code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(requester->UnregisterRegion(local).ok());
  // A later read under the revoked grant is refused; the kept one still reads.
  RegionHandle local2 = *requester->RegisterRegion(dest.data(), dest.size());
  Plan one = RandomPlan(1, 4096, 4096, 4096, local2, 12);
  ReadBatchRequest again = Request(one, PullMode::kActiveMessage);
  again.grant = grant->id;
  again.grant_secret = grant->secret;
  EXPECT_EQ(ReadAndWait(*requester, std::move(again)).status.code(), StatusCode::kPermissionDenied);
  ReadBatchRequest other = Request(one, PullMode::kActiveMessage);
  other.grant = kept->id;
  other.grant_secret = kept->secret;
  EXPECT_TRUE(ReadAndWait(*requester, std::move(other)).status.ok());
  // A peer with no grants: drained at once.
  DrainFlag nobody;
  ASSERT_TRUE(source_->RevokePeer("node-z", nobody.Callback()).ok());
  EXPECT_TRUE(nobody.Wait());
  DrainFlag last;
  ASSERT_TRUE(source_->RevokeGrant(kept->id, last.Callback()).ok());
  EXPECT_TRUE(last.Wait());
  EXPECT_TRUE(source_->UnregisterRegion(region).ok());
  EXPECT_EQ(drained.fired(), 1);
}

TEST_F(UcxEngineTest, ValidationErrorsAreReturnedWithoutACallback) {
  auto requester = MakeEngine();
  TestBuffer dest(1 << 20);
  RegionHandle local = *requester->RegisterRegion(dest.data(), dest.size());
  Plan plan = RandomPlan(2, 10, 100, kSourceBytes, local, 8);
  int calls = 0;
  auto count = [&calls](const BatchResult&) { ++calls; };

  ReadBatchRequest r = Request(plan);
  r.deadline = Deadline::Infinite();
  EXPECT_EQ(requester->ReadBatch(r, count).status().code(), StatusCode::kInvalidArgument);
  r = Request(plan);
  r.fragments[0].local_offset = dest.size();
  EXPECT_EQ(requester->ReadBatch(r, count).status().code(), StatusCode::kOutOfRange);
  r = Request(plan);
  r.fragments[1].remote_offset = kSourceBytes - 1;
  EXPECT_EQ(requester->ReadBatch(r, count).status().code(), StatusCode::kOutOfRange);
  r = Request(plan);
  r.fragments[0].local.generation += 1;
  EXPECT_EQ(requester->ReadBatch(r, count).status().code(), StatusCode::kNotFound);
  r = Request(plan);
  r.fragments.clear();
  EXPECT_EQ(requester->ReadBatch(r, count).status().code(), StatusCode::kInvalidArgument);
  r = Request(plan);
  r.peer = "not-an-address";
  EXPECT_EQ(requester->ReadBatch(r, count).status().code(), StatusCode::kInvalidArgument);
  r = Request(plan);
  r.fragments[0].length = 0;
  EXPECT_EQ(requester->ReadBatch(r, count).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(calls, 0);
  // Failed validation pinned nothing.
  EXPECT_TRUE(requester->UnregisterRegion(local).ok());
  EXPECT_EQ(requester->UnregisterRegion(local).code(), StatusCode::kNotFound);
  EXPECT_EQ(requester->RegisterRegion(nullptr, 10).status().code(), StatusCode::kInvalidArgument);
}

// A TCP listener that completes handshakes in the kernel and never speaks: a peer that hangs.
class SilentListener {
 public:
  SilentListener() {
    fd_.Reset(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(bind(fd_.get(), reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
    EXPECT_EQ(listen(fd_.get(), 16), 0);
    socklen_t len = sizeof(sa);
    getsockname(fd_.get(), reinterpret_cast<sockaddr*>(&sa), &len);
    address_ = "127.0.0.1:" + std::to_string(ntohs(sa.sin_port));
  }
  const std::string& address() const { return address_; }

 private:
  ScopedFd fd_;
  std::string address_;
};

TEST_F(UcxEngineTest, HungPeerPinsUntilTheDeadlineThenReleases) {
  SilentListener silent;
  auto requester = MakeEngine();
  TestBuffer dest(1 << 20);
  RegionHandle local = *requester->RegisterRegion(dest.data(), dest.size());
  Plan plan = RandomPlan(4, 10, 1000, kSourceBytes, local, 9);
  ReadBatchRequest request = Request(plan, PullMode::kActiveMessage);
  request.peer = silent.address();
  request.deadline = Deadline::After(std::chrono::milliseconds(500));
  BatchWaiter waiter;
  ASSERT_TRUE(requester->ReadBatch(std::move(request), waiter.Callback()).ok());
  // The destination stays owned while the batch lives.
  if (!waiter.done()) {
    EXPECT_EQ(requester->UnregisterRegion(local).code(), StatusCode::kFailedPrecondition);
  }
  std::optional<BatchResult> result = waiter.Wait(Deadline::After(kWait));
  ASSERT_TRUE(result.has_value()) << "a batch to a hung peer never completed";
  EXPECT_TRUE(result->status.code() == StatusCode::kDeadlineExceeded ||
              result->status.code() == StatusCode::kUnavailable)
      << result->status;
  EXPECT_TRUE(requester->UnregisterRegion(local).ok());
  EXPECT_EQ(requester->Stats().live_batches, 0u);
}

TEST_F(UcxEngineTest, DestroyingTheEngineCompletesLiveBatches) {
  SilentListener silent;
  auto requester = MakeEngine();
  TestBuffer dest(1 << 20);
  RegionHandle local = *requester->RegisterRegion(dest.data(), dest.size());
  Plan plan = RandomPlan(4, 10, 1000, kSourceBytes, local, 10);
  ReadBatchRequest request = Request(plan);
  request.peer = silent.address();
  BatchWaiter waiter;
  ASSERT_TRUE(requester->ReadBatch(std::move(request), waiter.Callback()).ok());
  requester.reset();
  std::optional<BatchResult> result = waiter.Wait(Deadline::After(std::chrono::seconds(1)));
  ASSERT_TRUE(result.has_value());
  EXPECT_EQ(result->status.code(), StatusCode::kCancelled) << result->status;
}

TEST_F(UcxEngineTest, RegionTableFillsUp) {
  UcxEngineOptions options;
  options.transports = "tcp";
  options.max_regions = 2;
  auto engine = *UcxTransferEngine::Create(options);
  TestBuffer buffer(3 * 4096);
  ASSERT_TRUE(engine->RegisterRegion(buffer.data(), 4096).ok());
  RegionHandle second = *engine->RegisterRegion(buffer.data() + 4096, 4096);
  EXPECT_EQ(engine->RegisterRegion(buffer.data() + 8192, 4096).status().code(), StatusCode::kResourceExhausted);
  ASSERT_TRUE(engine->UnregisterRegion(second).ok());
  RegionHandle reused = *engine->RegisterRegion(buffer.data() + 8192, 4096);
  EXPECT_EQ(reused.index, second.index);
  EXPECT_NE(reused.generation, second.generation);
  EXPECT_EQ(engine->Stats().registered_regions, 2u);
}

TEST(UcxEngineCreateTest, DescriptorsCarryTheEngineIdTheManagerGives) {
  const RuntimeId runtime = RuntimeId::New();
  UcxEngineOptions options;
  options.transports = "tcp";
  options.engine_id = runtime.incarnation();
  auto engine = UcxTransferEngine::Create(options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  TestBuffer buffer(4096);
  RegionHandle region = *(*engine)->RegisterRegion(buffer.data(), 4096);
  Result<RegionDescriptor> exported = (*engine)->ExportRegion(region);
  ASSERT_TRUE(exported.ok()) << exported.status();
  EXPECT_EQ(exported->engine_id, runtime.incarnation());
}

TEST(UcxEngineCreateTest, BadOptionsFailClearly) {
  UcxEngineOptions options;
  options.listen_address = "localhost";
  EXPECT_EQ(UcxTransferEngine::Create(options).status().code(), StatusCode::kInvalidArgument);
  options.listen_address = "127.0.0.1:99999";
  EXPECT_EQ(UcxTransferEngine::Create(options).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace orbitkv::transfer
