// The transfer engine against a peer in another process: on loopback, and across two network
// namespaces joined by a veth pair (UCX_TLS=tcp, so the bytes really cross the veth). Byte-exact
// scattered reads, concurrent batches, cancellation mid-batch, the peer killed mid-batch, packet
// loss injected with nftables and delay injected with the fault decorator: every batch completes or
// fails cleanly, and nothing stays pinned.
#include <gtest/gtest.h>
#include <signal.h>

#include <random>
#include <sstream>
#include <thread>

#include "transfer/fault_injecting_engine.h"
#include "transfer/test_util.h"
#include "transfer/ucx_engine.h"

namespace orbitkv::transfer {
namespace {

using testing::BatchWaiter;
using testing::ChildProcess;
using testing::NetnsPair;
using testing::TestBuffer;

constexpr uint64_t kSeed = 7;
constexpr uint64_t kPeerBytes = 16ull << 20;
// Bounds that only catch hangs on a loaded 2-core machine.
constexpr auto kWait = std::chrono::seconds(60);

enum class Topology { kLoopback, kNamespaces };

struct Peer {
  std::unique_ptr<ChildProcess> process;
  std::string address;
  std::vector<RegionDescriptor> regions;
};

class ProcessTest : public ::testing::TestWithParam<Topology> {
 protected:
  void SetUp() override {
    if (GetParam() == Topology::kNamespaces) {
      auto pair = NetnsPair::Create();
      if (!pair.ok()) GTEST_SKIP() << pair.status();
      netns_ = std::move(pair).value();
      ASSERT_TRUE(netns_->EnterA().ok());
    }
    UcxEngineOptions options;
    options.transports = "tcp";
    options.listen_address = netns_ ? std::string(NetnsPair::kAddressA) + ":0" : "127.0.0.1:0";
    if (netns_) options.net_devices = netns_->veth_a();
    auto engine = UcxTransferEngine::Create(options);
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = std::move(engine).value();
  }

  void TearDown() override {
    engine_.reset();
    peers_.clear();
    netns_.reset();  // Leaves and deletes the namespaces.
  }

  Peer& StartPeer(std::vector<std::string> extra = {}) {
    std::string listen = netns_ ? std::string(NetnsPair::kAddressB) + ":0" : "127.0.0.1:0";
    std::vector<std::string> argv = {ORBITKV_TRANSFER_PEER_BIN,  "--listen",     listen, "--bytes",
                                     std::to_string(kPeerBytes), "--regions",    "2",    "--seed",
                                     std::to_string(kSeed),      "--transports", "tcp"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    if (netns_) {
      argv.insert(argv.end(), {"--devices", netns_->veth_b()});
      argv = netns_->InB(argv);
    }
    auto child = ChildProcess::Spawn(argv);
    EXPECT_TRUE(child.ok()) << child.status();
    auto peer = std::make_unique<Peer>();
    peer->process = std::move(child).value();
    Result<std::string> line = peer->process->ReadLine(Deadline::After(kWait));
    // UCX writes its warnings to stdout too; the peer's answer is the READY line.
    while (line.ok() && line->rfind("READY ", 0) != 0) line = peer->process->ReadLine(Deadline::After(kWait));
    EXPECT_TRUE(line.ok()) << line.status();
    std::istringstream words(line.value_or(""));
    std::string ready;
    words >> ready >> peer->address;
    EXPECT_EQ(ready, "READY");
    for (std::string hex; words >> hex;) {
      auto bytes = FromHex(hex);
      EXPECT_TRUE(bytes.ok()) << bytes.status();
      if (!bytes.ok()) continue;
      auto descriptor = DecodeDescriptor(*bytes);
      EXPECT_TRUE(descriptor.ok()) << descriptor.status();
      if (descriptor.ok()) peer->regions.push_back(*descriptor);
    }
    EXPECT_EQ(peer->regions.size(), 2u);
    peers_.push_back(std::move(peer));
    return *peers_.back();
  }

  // Fragments from both remote regions, packed back to back in `dest`.
  ReadBatchRequest Plan(const Peer& peer, RegionHandle local, size_t count, uint64_t min_len, uint64_t max_len,
                        uint64_t seed) {
    std::mt19937_64 rng(seed);
    ReadBatchRequest r;
    r.peer = peer.address;
    r.remotes = peer.regions;
    r.deadline = Deadline::After(kWait);
    uint64_t at = 0;
    for (size_t i = 0; i < count; ++i) {
      Fragment f;
      f.length = min_len + rng() % (max_len - min_len + 1);
      f.remote = static_cast<uint32_t>(rng() % 2);
      f.remote_offset = rng() % (kPeerBytes - f.length + 1);
      f.local = local;
      f.local_offset = at;
      at += f.length;
      r.fragments.push_back(f);
    }
    return r;
  }

  static void ExpectLanded(const ReadBatchRequest& r, const TestBuffer& dest) {
    for (size_t i = 0; i < r.fragments.size(); ++i) {
      const Fragment& f = r.fragments[i];
      int64_t bad =
          testing::FindPatternMismatch(dest.data() + f.local_offset, f.length, kSeed + f.remote, f.remote_offset);
      ASSERT_EQ(bad, -1) << "fragment " << i << " differs at byte " << bad;
    }
  }

  BatchResult Run(TransferEngine& engine, ReadBatchRequest r) {
    BatchWaiter waiter;
    auto id = engine.ReadBatch(std::move(r), waiter.Callback());
    EXPECT_TRUE(id.ok()) << id.status();
    auto result = waiter.Wait(Deadline::After(kWait + std::chrono::seconds(30)));
    EXPECT_TRUE(result.has_value()) << "batch never completed";
    return result.value_or(BatchResult{});
  }

  // Waits (bounded) until the engine holds nothing for finished work: endpoints close
  // asynchronously.
  void ExpectNothingHeld() {
    Deadline deadline = Deadline::After(kWait);
    EngineStats s = engine_->Stats();
    while ((s.live_batches != 0 || s.pinned_regions != 0 || s.peer_endpoints != 0) && !deadline.Expired()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      s = engine_->Stats();
    }
    EXPECT_EQ(s.live_batches, 0u);
    EXPECT_EQ(s.pinned_regions, 0u);
    EXPECT_EQ(s.peer_endpoints, 0u);
  }

  std::unique_ptr<NetnsPair> netns_;
  std::unique_ptr<UcxTransferEngine> engine_;
  std::vector<std::unique_ptr<Peer>> peers_;
};

TEST_P(ProcessTest, ScatteredFragmentsLandByteExact) {
  Peer& peer = StartPeer();
  TestBuffer dest(24ull << 20);
  RegionHandle local = *engine_->RegisterRegion(dest.data(), dest.size());
  ReadBatchRequest r = Plan(peer, local, 200, 1, 64 << 10, 1);
  ReadBatchRequest big = Plan(peer, local, 4, 1 << 20, 2 << 20, 2);
  uint64_t at = r.fragments.back().local_offset + r.fragments.back().length;
  for (Fragment f : big.fragments) {
    f.local_offset += at;
    r.fragments.push_back(f);
  }
  ReadBatchRequest copy = r;
  BatchResult result = Run(*engine_, std::move(r));
  ASSERT_TRUE(result.status.ok()) << result.status;
  EXPECT_TRUE(result.checksum_verified);
  ExpectLanded(copy, dest);
  EXPECT_TRUE(engine_->UnregisterRegion(local).ok());
}

TEST_P(ProcessTest, ConcurrentBatches) {
  Peer& peer = StartPeer();
  constexpr int kBatches = 6;
  std::vector<std::unique_ptr<TestBuffer>> dests;
  std::vector<ReadBatchRequest> plans;
  std::vector<std::unique_ptr<BatchWaiter>> waiters;
  for (int i = 0; i < kBatches; ++i) {
    dests.push_back(std::make_unique<TestBuffer>(8 << 20));
    RegionHandle local = *engine_->RegisterRegion(dests.back()->data(), dests.back()->size());
    plans.push_back(Plan(peer, local, 64, 1 << 10, 96 << 10, 10 + i));
    waiters.push_back(std::make_unique<BatchWaiter>());
    ASSERT_TRUE(engine_->ReadBatch(plans.back(), waiters.back()->Callback()).ok());
  }
  for (int i = 0; i < kBatches; ++i) {
    auto result = waiters[i]->Wait(Deadline::After(kWait + std::chrono::seconds(30)));
    ASSERT_TRUE(result.has_value()) << i;
    ASSERT_TRUE(result->status.ok()) << i << ": " << result->status;
    ExpectLanded(plans[i], *dests[i]);
  }
}

TEST_P(ProcessTest, CancelMidBatch) {
  Peer& peer = StartPeer({"--inflight", std::to_string(256 << 10)});
  TestBuffer dest(64ull << 20);
  RegionHandle local = *engine_->RegisterRegion(dest.data(), dest.size());
  BatchWaiter waiter;
  auto id = engine_->ReadBatch(Plan(peer, local, 1000, 64 << 10, 64 << 10, 3), waiter.Callback());
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(engine_->Cancel(*id).ok());
  auto result = waiter.Wait(Deadline::After(kWait));
  ASSERT_TRUE(result.has_value());
  EXPECT_EQ(result->status.code(), StatusCode::kCancelled) << result->status;
  EXPECT_TRUE(engine_->UnregisterRegion(local).ok());
  // The peer released its pins too: it can unregister the region the batch read.
  Deadline deadline = Deadline::After(kWait);
  std::string answer;
  do {
    ASSERT_TRUE(peer.process->WriteLine("stats").ok());
    answer = peer.process->ReadLine(Deadline::After(kWait)).value_or("");
  } while (answer.find("serving=0") == std::string::npos && !deadline.Expired());
  EXPECT_NE(answer.find("pinned=0"), std::string::npos) << answer;
  ASSERT_TRUE(peer.process->WriteLine("unregister 0").ok());
  EXPECT_EQ(peer.process->ReadLine(Deadline::After(kWait)).value_or(""), "OK");
}

TEST_P(ProcessTest, PeerKilledMidBatchFailsCleanly) {
  Peer& peer = StartPeer();
  TestBuffer dest(32ull << 20);
  RegionHandle local = *engine_->RegisterRegion(dest.data(), dest.size());
  // Warm the pooled endpoint, then freeze the peer so the next batch is surely in flight when it
  // dies.
  ASSERT_TRUE(Run(*engine_, Plan(peer, local, 4, 100, 1000, 4)).status.ok());
  peer.process->Signal(SIGSTOP);
  BatchWaiter waiter;
  ASSERT_TRUE(engine_->ReadBatch(Plan(peer, local, 200, 64 << 10, 128 << 10, 5), waiter.Callback()).ok());
  EXPECT_EQ(engine_->UnregisterRegion(local).code(), StatusCode::kFailedPrecondition);
  peer.process->Signal(SIGKILL);
  peer.process->Wait();
  auto result = waiter.Wait(Deadline::After(kWait));
  ASSERT_TRUE(result.has_value()) << "a batch to a killed peer never completed";
  EXPECT_EQ(result->status.code(), StatusCode::kUnavailable) << result->status;
  ExpectNothingHeld();
  EXPECT_TRUE(engine_->UnregisterRegion(local).ok());

  // The engine recovers: a new peer (new endpoint) serves normally.
  Peer& next = StartPeer();
  local = *engine_->RegisterRegion(dest.data(), dest.size());
  ReadBatchRequest r = Plan(next, local, 16, 100, 64 << 10, 6);
  ReadBatchRequest copy = r;
  BatchResult ok = Run(*engine_, std::move(r));
  ASSERT_TRUE(ok.status.ok()) << ok.status;
  ExpectLanded(copy, dest);
}

TEST_P(ProcessTest, InjectedDelayCompletesOrExpiresWithinTheDeadline) {
  Peer& peer = StartPeer();
  FaultInjectingEngine faulty(engine_.get());
  TestBuffer dest(8 << 20);
  RegionHandle local = *faulty.RegisterRegion(dest.data(), dest.size());

  faulty.Delay(1, std::chrono::milliseconds(300));
  ReadBatchRequest late = Plan(peer, local, 8, 100, 10000, 7);
  late.deadline = Deadline::After(std::chrono::milliseconds(100));
  BatchResult expired = Run(faulty, std::move(late));
  EXPECT_EQ(expired.status.code(), StatusCode::kDeadlineExceeded) << expired.status;

  faulty.Delay(1, std::chrono::milliseconds(50));
  ReadBatchRequest r = Plan(peer, local, 32, 100, 128 << 10, 8);
  ReadBatchRequest copy = r;
  BatchResult delayed = Run(faulty, std::move(r));
  ASSERT_TRUE(delayed.status.ok()) << delayed.status;
  ExpectLanded(copy, dest);
  EXPECT_TRUE(faulty.UnregisterRegion(local).ok());
}

// Loss on the veth (nftables in the peer's namespace): TCP retransmits; every batch must end,
// byte-exact when OK, and otherwise with a clear deadline or connection error, never hanging or
// leaking. Only the namespace topology has a veth, so only it runs this.
using VethTest = ProcessTest;

TEST_P(VethTest, PacketLossOnTheVeth) {
  ASSERT_NE(netns_, nullptr);
  Peer& peer = StartPeer();
  ASSERT_TRUE(NetnsPair::RunIn(netns_->name_b(),
                               "nft -f - <<'EOF'\n"
                               "table inet okv_loss {\n"
                               "  chain in { type filter hook input priority 0; numgen random mod 100 < 3 drop; }\n"
                               "  chain out { type filter hook output priority 0; numgen random mod 100 < 3 drop; }\n"
                               "}\nEOF")
                  .ok());
  constexpr int kBatches = 4;
  int ok = 0;
  for (int i = 0; i < kBatches; ++i) {
    TestBuffer dest(8 << 20);
    RegionHandle local = *engine_->RegisterRegion(dest.data(), dest.size());
    ReadBatchRequest r = Plan(peer, local, 32, 16 << 10, 128 << 10, 20 + i);
    r.deadline = Deadline::After(std::chrono::seconds(20));
    ReadBatchRequest copy = r;
    MonoTime start = MonoNow();
    BatchResult result = Run(*engine_, std::move(r));
    if (result.status.ok()) {
      ++ok;
      ExpectLanded(copy, dest);
    } else {
      EXPECT_TRUE(result.status.code() == StatusCode::kDeadlineExceeded ||
                  result.status.code() == StatusCode::kUnavailable)
          << result.status;
      // Failure is reported at the deadline, not long after it (the slack is for a loaded machine).
      EXPECT_LT(MonoNow() - start, std::chrono::seconds(20) + std::chrono::seconds(15));
    }
    EXPECT_TRUE(engine_->UnregisterRegion(local).ok());
  }
  RecordProperty("batches_ok_under_loss", ok);
}

INSTANTIATE_TEST_SUITE_P(Topologies, ProcessTest, ::testing::Values(Topology::kLoopback, Topology::kNamespaces),
                         [](const auto& param_info) {
                           return param_info.param == Topology::kLoopback ? std::string("Loopback")
                                                                          : std::string("Namespaces");
                         });

INSTANTIATE_TEST_SUITE_P(Topologies, VethTest, ::testing::Values(Topology::kNamespaces),
                         [](const auto&) { return std::string("Namespaces"); });

}  // namespace
}  // namespace orbitkv::transfer
