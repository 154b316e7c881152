// RemoteFetcher against a real source in this process: the source's BlockCache, SourceHolds and PeerService on
// loopback gRPC, a UCX engine on each side (tcp on loopback), the requester's candidate index filled with the
// source's real versions (warm: no catalog involved). The requester's engine is wrapped in the test-only
// FaultInjectingEngine for the faults UCX cannot produce on demand: a corrupted fragment, a lost batch, a peer that
// stops answering after some batches. Every case checks what was sealed byte for byte, that nothing unverified is
// resident, and that the staging charge and the source's holds go back to 0.
#include "server/distributed/remote_fetch.h"

#include "catalog/peer_service.h"  // first of the gRPC users (cluster/grpc.h)

#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <map>

#include "base/runtime_id.h"
#include "catalog/catalog_grpc.h"
#include "catalog/testing/loopback_server.h"
#include "catalog/transfer_grants.h"
#include "core/test_util.h"
#include "transfer/fault_injecting_engine.h"
#include "transfer/ucx_engine.h"

namespace orbitkv::server {
namespace {

constexpr uint64_t kBlock = 256 << 10;

cluster::Member MemberOf(const std::string& node, const std::string& uuid, const std::string& endpoint) {
  cluster::Member m;
  m.record = cluster::MemberRecord{"t", node, 1, endpoint, uuid};
  return m;
}

core::BlockCacheOptions CacheOptions() {
  auto options = core::testing::SmallCacheOptions(64ull << 20, 4ull << 20);
  options.incarnation = 0;
  return options;
}

class RemoteFetchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // The source.
    auto source_cache = core::BlockCache::Create(CacheOptions(), &source_metrics_);
    ASSERT_TRUE(source_cache.ok()) << source_cache.status();
    source_cache_ = std::move(*source_cache);
    source_engine_ = StartEngine(*source_cache_, &source_arenas_, source_uuid_);
    issuer_ = std::make_unique<catalog::TransferGrantIssuer>(source_engine_.get(), source_arenas_);
    holds_ = std::make_unique<catalog::SourceHolds>(catalog::SourceHolds::Options{}, &source_cache_->table(),
                                                    &source_cache_->pool(), &source_cache_->transfer_budget(),
                                                    issuer_.get());
    catalog::PeerService::Options service;
    service.self = catalog::PeerIdentity{"t", "source", source_uuid_, 1, "fp"};
    service.source = holds_.get();
    service.ucx_worker_address = source_engine_->ListenAddress();
    service_ = std::make_unique<catalog::PeerService>(std::move(service), &view_);
    catalog::testing::LoopbackServer loopback = catalog::testing::StartLoopbackServer({service_.get()});
    server_ = std::move(loopback.server);
    ASSERT_NE(loopback.port, 0);
    std::map<std::string, cluster::Member> members;
    members.emplace("source", MemberOf("source", source_uuid_, loopback.endpoint()));
    members.emplace("requester", MemberOf("requester", requester_uuid_, ""));
    view_.Install(std::move(members), 1);

    // The requester.
    auto cache = core::BlockCache::Create(CacheOptions(), &metrics_);
    ASSERT_TRUE(cache.ok()) << cache.status();
    cache_ = std::move(*cache);
    engine_ = StartEngine(*cache_, nullptr, requester_uuid_);
    faults_ = std::make_unique<transfer::FaultInjectingEngine>(engine_.get());
    for (size_t i = 0; i < cache_->pool().arena_count(); ++i) {
      auto region = faults_->RegisterRegion(cache_->pool().arena(i).data(), cache_->pool().arena(i).size());
      ASSERT_TRUE(region.ok()) << region.status();
      arenas_.push_back(*region);
    }
    transport_ = std::make_unique<catalog::GrpcRequesterTransport>(
        catalog::PeerIdentity{"t", "requester", requester_uuid_, 1, "fp"}, &view_, nullptr);
    catalog::Discovery::Options discovery;
    discovery.host_of = [](const state::StateKey&) { return std::string("source"); };
    discovery_ = std::make_unique<catalog::Discovery>(std::move(discovery), &index_, transport_.get());
  }

  void TearDown() override {
    fetcher_.reset();
    faults_.reset();
    engine_.reset();
    if (server_) server_->Shutdown();
    source_engine_.reset();
    holds_.reset();
  }

  std::unique_ptr<transfer::UcxTransferEngine> StartEngine(core::BlockCache& cache,
                                                           std::vector<transfer::RegionHandle>* arenas,
                                                           const std::string& uuid) {
    transfer::UcxEngineOptions options;
    options.transports = "tcp";
    options.require_grants = true;
    options.engine_id = RuntimeId::Parse(uuid)->incarnation();
    auto engine = transfer::UcxTransferEngine::Create(options);
    EXPECT_TRUE(engine.ok()) << engine.status();
    if (arenas != nullptr) {
      for (size_t i = 0; i < cache.pool().arena_count(); ++i) {
        auto region = (*engine)->RegisterRegion(cache.pool().arena(i).data(), cache.pool().arena(i).size());
        EXPECT_TRUE(region.ok()) << region.status();
        arenas->push_back(*region);
      }
    }
    return std::move(*engine);
  }

  // The fetcher, with `max_batch_bytes` per batch and `deadline` per stage.
  void MakeFetcher(uint64_t max_batch_bytes = 16ull << 20,
                   std::chrono::milliseconds deadline = std::chrono::milliseconds(10000),
                   std::chrono::milliseconds breaker = std::chrono::milliseconds(0)) {
    RemoteFetcher::Options options;
    options.source_breaker = breaker;
    options.self_node = "requester";
    options.threads = 2;
    options.deadline = deadline;
    options.max_batch_bytes = max_batch_bytes;
    options.can_work = can_work_;
    fetcher_ = std::make_unique<RemoteFetcher>(options, cache_.get(), &index_, discovery_.get(), transport_.get(),
                                               faults_.get(), arenas_, &metrics_);
  }

  // Saves `n` blocks of chain `chain` on the source and teaches the requester's index their versions.
  std::vector<state::StateKey> SaveOnSource(uint64_t chain, size_t n) {
    const auto keys = core::testing::Chain(chain, n);
    for (size_t i = 0; i < n; ++i) {
      auto writer = source_cache_->Prepare(keys[i], kBlock);
      EXPECT_TRUE(writer.ok()) << writer.status();
      core::testing::Stamp(writer->data(), kBlock, chain * 1000 + i);
      const uint64_t generation = source_cache_->Seal(*writer);
      auto pin = source_cache_->table().Pin(keys[i]);
      EXPECT_TRUE(pin.ok());
      index_.Insert(keys[i], {catalog::Candidate{"source", source_uuid_, 1, generation, pin->sequence(), kBlock}});
    }
    return keys;
  }

  // Runs the remote stage for `keys` and returns the pins it reported; `progress` (when given) gets each progress
  // report, with how many of the reported blocks were resident byte-exact when it came.
  std::vector<core::BlockPin> RunStage(const std::vector<state::StateKey>& keys,
                                       std::vector<std::pair<size_t, size_t>>* progress = nullptr, uint64_t chain = 0) {
    std::optional<LoadingStage> stage = fetcher_->Stage(keys);
    EXPECT_TRUE(stage.has_value());
    if (!stage.has_value()) return {};
    std::promise<std::vector<core::BlockPin>> done;
    LoadingStage::Progress report;
    if (progress != nullptr) {
      report = [&, progress, chain](size_t n) {
        progress->emplace_back(n, ResidentExact(std::vector<state::StateKey>(keys.begin(), keys.begin() + n), chain));
      };
    }
    EXPECT_TRUE(
        stage->start([&done](std::vector<core::BlockPin> pins) { done.set_value(std::move(pins)); }, std::move(report))
            .ok());
    return done.get_future().get();
  }

  // How many of `keys`, from the first, are resident on the requester with exactly the source's bytes.
  size_t ResidentExact(const std::vector<state::StateKey>& keys, uint64_t chain) {
    size_t n = 0;
    for (; n < keys.size(); ++n) {
      auto pin = cache_->table().Pin(keys[n]);
      if (!pin.ok() || !core::testing::CheckStamp(pin->data(), kBlock, chain * 1000 + n)) break;
    }
    return n;
  }
  size_t Resident(const std::vector<state::StateKey>& keys) {
    size_t n = 0;
    for (const auto& key : keys) n += cache_->table().Pin(key).ok() ? 1 : 0;
    return n;
  }
  // The source gave everything back (its holds drain on the engine's thread).
  bool SourceIdle() {
    for (int i = 0; i < 500; ++i) {
      if (holds_->GetStats().sessions == 0 && source_cache_->table().Stats().pinned_blocks == 0) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }

  const std::string source_uuid_ = RuntimeId::New().ToString();
  const std::string requester_uuid_ = RuntimeId::New().ToString();
  cluster::MemberView view_;
  MetricsRegistry source_metrics_, metrics_;
  std::unique_ptr<core::BlockCache> source_cache_, cache_;
  std::vector<transfer::RegionHandle> source_arenas_, arenas_;
  std::unique_ptr<transfer::UcxTransferEngine> source_engine_, engine_;
  std::unique_ptr<catalog::TransferGrantIssuer> issuer_;
  std::unique_ptr<catalog::SourceHolds> holds_;
  std::unique_ptr<catalog::PeerService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<transfer::FaultInjectingEngine> faults_;
  catalog::CandidateIndex index_{{}};
  std::unique_ptr<catalog::GrpcRequesterTransport> transport_;
  std::unique_ptr<catalog::Discovery> discovery_;
  std::unique_ptr<RemoteFetcher> fetcher_;
  std::function<bool()> can_work_;  // the fetcher's, when set before MakeFetcher
};

// Issue 51: a stage made while remote work was allowed, whose fetch starts after it was turned off (the
// registration lapsed meanwhile), asks again and fetches nothing: no authorization reaches the source.
TEST_F(RemoteFetchTest, AFetchThatWaitedChecksAgainThatRemoteWorkIsAllowed) {
  std::atomic<bool> allowed{true};
  can_work_ = [&] { return allowed.load(); };
  MakeFetcher();
  const auto keys = SaveOnSource(3, 4);
  std::optional<LoadingStage> stage = fetcher_->Stage(keys);
  ASSERT_TRUE(stage.has_value());
  allowed = false;
  EXPECT_FALSE(fetcher_->Stage(keys).has_value());  // no new stage either
  std::promise<std::vector<core::BlockPin>> done;
  ASSERT_TRUE(stage->start([&done](std::vector<core::BlockPin> pins) { done.set_value(std::move(pins)); }, {}).ok());
  EXPECT_TRUE(done.get_future().get().empty());
  EXPECT_EQ(fetcher_->GetStats().authorizations, 0u);
  EXPECT_EQ(holds_->GetStats().granted, 0u);
  EXPECT_EQ(Resident(keys), 0u);
  // Allowed again: the same keys are fetched.
  allowed = true;
  EXPECT_EQ(RunStage(keys).size(), keys.size());
}

// Issue 51: a hold is released by its grant id while the member view is incomplete on both sides (here they share
// one view): the requester reaches the source at the endpoint the grant came from, the source checks no view. A
// release by request id alone needs the view and is refused meanwhile.
TEST_F(RemoteFetchTest, AGrantIsReleasedByItsIdWhileEitherSidesViewIsIncomplete) {
  const auto keys = SaveOnSource(4, 2);
  catalog::AuthorizeOptions authorize;
  authorize.self_node = "requester";
  authorize.request_id = 77;
  catalog::AuthorizeOutcome outcome = catalog::AuthorizeBest(keys, index_, *transport_, authorize);
  ASSERT_TRUE(outcome.authorized.has_value()) << outcome.last_error;
  const uint64_t grant = outcome.authorized->reply.grant.grant_id;
  ASSERT_NE(grant, 0u);
  EXPECT_EQ(holds_->GetStats().sessions, 1u);
  view_.Invalidate();
  const Deadline deadline = Deadline::After(std::chrono::seconds(5));
  const std::string secret = outcome.authorized->reply.grant.grant_secret;
  ASSERT_EQ(secret.size(), catalog::kGrantSecretBytes);  // carried by the Authorize reply, for this requester
  Result<bool> by_request = transport_->Release("source", source_uuid_, 77, /*grant_id=*/0, "", deadline);
  EXPECT_EQ(by_request.status().code(), StatusCode::kUnavailable) << by_request.status();
  Result<bool> wrong = transport_->Release("source", source_uuid_, 77, grant + 1, secret, deadline);
  ASSERT_TRUE(wrong.ok()) << wrong.status();
  EXPECT_FALSE(*wrong);  // no such grant of this node: nothing released
  // Issue 52: the grant id without its secret releases nothing.
  Result<bool> unbound = transport_->Release("source", source_uuid_, 77, grant, "", deadline);
  ASSERT_TRUE(unbound.ok()) << unbound.status();
  EXPECT_FALSE(*unbound);
  EXPECT_EQ(holds_->GetStats().sessions, 1u);
  EXPECT_EQ(holds_->GetStats().release_secret_refusals, 1u);
  Result<bool> released = transport_->Release("source", source_uuid_, 77, grant, secret, deadline);
  ASSERT_TRUE(released.ok()) << released.status();
  EXPECT_TRUE(*released);
  EXPECT_TRUE(SourceIdle());
}

TEST_F(RemoteFetchTest, FetchesTheSpanIntoSealedBlocksInPipelinedBatchesAndReleasesTheSource) {
  MakeFetcher(/*max_batch_bytes=*/1 << 20);  // 4 blocks a batch: 4 batches, two in flight
  const auto keys = SaveOnSource(1, 16);
  std::vector<std::pair<size_t, size_t>> progress;
  std::vector<core::BlockPin> pins = RunStage(keys, &progress, 1);
  ASSERT_EQ(pins.size(), keys.size());
  // A progress report after each sealed batch, each naming blocks already resident with the source's bytes.
  ASSERT_EQ(progress.size(), 4u);
  for (size_t b = 0; b < progress.size(); ++b) {
    EXPECT_EQ(progress[b].first, 4 * (b + 1));
    EXPECT_EQ(progress[b].second, progress[b].first);
  }
  for (size_t i = 0; i < pins.size(); ++i) {
    EXPECT_TRUE(core::testing::CheckStamp(pins[i].data(), kBlock, 1000 + i)) << i;
  }
  core::BlockPin::ReleaseAll(&pins);
  EXPECT_EQ(ResidentExact(keys, 1), keys.size());
  const RemoteFetcher::Stats stats = fetcher_->GetStats();
  EXPECT_EQ(stats.fetched_blocks, keys.size());
  EXPECT_EQ(stats.fetched_bytes, keys.size() * kBlock);
  EXPECT_EQ(stats.failed, 0u);
  EXPECT_EQ(stats.staging_bytes, 0u);
  EXPECT_EQ(stats.discovery_rpcs, 0u);  // warm: the index knew every key
  EXPECT_TRUE(SourceIdle());
  // A second stage finds everything resident: nothing fetched, nothing authorized.
  pins = RunStage(keys);
  EXPECT_EQ(pins.size(), keys.size());
  core::BlockPin::ReleaseAll(&pins);
  EXPECT_EQ(fetcher_->GetStats().authorizations, stats.authorizations);
}

TEST_F(RemoteFetchTest, ACorruptedFragmentIsNeverSealedAndStopsThePrefixThere) {
  MakeFetcher(/*max_batch_bytes=*/1 << 20);
  const auto keys = SaveOnSource(2, 8);
  faults_->Corrupt(1);  // the first batch's bytes change between the wire and the check
  std::vector<core::BlockPin> pins = RunStage(keys);
  EXPECT_TRUE(pins.empty());
  EXPECT_EQ(Resident(keys), 0u);  // nothing unverified is served
  EXPECT_EQ(fetcher_->GetStats().failed, 1u);
  EXPECT_EQ(fetcher_->GetStats().staging_bytes, 0u);
  EXPECT_EQ(cache_->table().Stats().pinned_blocks, 0u);
  EXPECT_TRUE(SourceIdle());
  // The next stage fetches them whole.
  pins = RunStage(keys);
  EXPECT_EQ(pins.size(), keys.size());
  core::BlockPin::ReleaseAll(&pins);
  EXPECT_EQ(ResidentExact(keys, 2), keys.size());
}

TEST_F(RemoteFetchTest, APeerThatStopsAnsweringPartWayLeavesTheVerifiedPrefixOnly) {
  MakeFetcher(/*max_batch_bytes=*/1 << 20);
  const auto keys = SaveOnSource(3, 16);
  faults_->FailAfter(2);  // two batches (8 blocks) pass, then the peer is gone
  std::vector<core::BlockPin> pins = RunStage(keys);
  EXPECT_EQ(pins.size(), 8u);
  core::BlockPin::ReleaseAll(&pins);
  EXPECT_EQ(ResidentExact(keys, 3), 8u);
  EXPECT_EQ(Resident(keys), 8u);
  EXPECT_EQ(fetcher_->GetStats().failed, 1u);
  EXPECT_EQ(fetcher_->GetStats().staging_bytes, 0u);
  EXPECT_TRUE(SourceIdle());
}

TEST_F(RemoteFetchTest, ALostBatchEndsTheStageByItsDeadlineWithWhatArrived) {
  MakeFetcher(/*max_batch_bytes=*/1 << 20, /*deadline=*/std::chrono::milliseconds(1500));
  const auto keys = SaveOnSource(4, 8);
  faults_->Drop(1);                                   // the first batch never arrives
  std::vector<core::BlockPin> pins = RunStage(keys);  // returns: the batch's deadline bounds it
  EXPECT_TRUE(pins.empty());
  EXPECT_EQ(Resident(keys), 0u);
  EXPECT_EQ(fetcher_->GetStats().staging_bytes, 0u);
  EXPECT_TRUE(SourceIdle());
}

TEST_F(RemoteFetchTest, ASourceWhoseTransferFailedIsSkippedUntilItsBreakerCloses) {
  MakeFetcher(/*max_batch_bytes=*/1 << 20, std::chrono::milliseconds(10000), /*breaker=*/std::chrono::hours(1));
  const auto keys = SaveOnSource(6, 8);
  faults_->FailAfter(0);  // the source's transfers fail from the first batch
  EXPECT_TRUE(RunStage(keys).empty());
  const uint64_t authorizations = fetcher_->GetStats().authorizations;
  EXPECT_EQ(authorizations, 1u);
  // The next stages do not ask that source again (no retry storm): the local answer at once.
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(RunStage(keys).empty());
  EXPECT_EQ(fetcher_->GetStats().authorizations, authorizations);
  EXPECT_EQ(fetcher_->GetStats().sources_skipped, 3u);
  EXPECT_TRUE(SourceIdle());
}

TEST_F(RemoteFetchTest, ConcurrentStagesOfOnePrefixShareOneFetch) {
  MakeFetcher(/*max_batch_bytes=*/1 << 20);
  const auto keys = SaveOnSource(5, 16);
  faults_->Delay(1, std::chrono::seconds(2));  // the first fetch's reads wait: it stays in flight
  std::vector<core::BlockPin> first, second;
  std::thread one([&] { first = RunStage(keys); });
  // The first stage authorized (its fetch is registered before that) and is reading: start the second.
  while (fetcher_->GetStats().authorizations == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  second = RunStage(keys);
  one.join();
  EXPECT_EQ(first.size(), keys.size());
  EXPECT_EQ(second.size(), keys.size());
  core::BlockPin::ReleaseAll(&first);
  core::BlockPin::ReleaseAll(&second);
  EXPECT_EQ(fetcher_->GetStats().fetched_blocks, keys.size());  // once
  EXPECT_EQ(fetcher_->GetStats().shared, 1u);
  EXPECT_EQ(fetcher_->GetStats().authorizations, 1u);
  EXPECT_TRUE(SourceIdle());
}

}  // namespace
}  // namespace orbitkv::server
