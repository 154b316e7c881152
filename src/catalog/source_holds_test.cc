#include "catalog/source_holds.h"

#include "base/metric_reader.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <mutex>
#include <set>
#include <thread>

#include "base/temp_dir.h"
#include "core/ssd_tier.h"
#include "core/test_util.h"
#include "storage/testing/fault_injecting_device.h"

namespace orbitkv::catalog {
namespace {

using core::testing::Chain;

// Records grants; revocations drain only when the test says (a transfer still in flight).
class RecordingIssuer final : public GrantIssuer {
 public:
  Result<Issued> Grant(const std::string& peer, const std::vector<Range>& ranges) override {
    MutexLock lock(&mu_);
    grants[next_] = {peer, ranges};
    const uint64_t id = next_++;
    return Issued{id, std::string(kGrantSecretBytes, static_cast<char>('a' + id % 26))};
  }
  Status Revoke(uint64_t grant, std::function<void()> drained) override {
    MutexLock lock(&mu_);
    if (grants.erase(grant) == 0) return Status::NotFound("no such grant");
    ++revokes;
    pending.push_back(std::move(drained));
    return Status::Ok();
  }
  Status RevokePeer(const std::string& peer, std::function<void()> drained) override {
    MutexLock lock(&mu_);
    for (auto it = grants.begin(); it != grants.end();) {
      it = it->second.first == peer ? grants.erase(it) : std::next(it);
    }
    peers_revoked.push_back(peer);
    pending.push_back(std::move(drained));
    return Status::Ok();
  }
  Result<std::vector<uint8_t>> Describe(uint32_t arena) override {
    return std::vector<uint8_t>{static_cast<uint8_t>(arena), 0xd5};
  }
  // The revocation `i` (in the order they were made) drains.
  void DrainOne(size_t i) {
    std::function<void()> run;
    {
      MutexLock lock(&mu_);
      run = std::move(pending.at(i));
      pending.at(i) = [] {};
    }
    run();
  }
  // The transfers in flight finish: every revoked grant drains.
  void DrainAll() {
    std::vector<std::function<void()>> run;
    {
      MutexLock lock(&mu_);
      run.swap(pending);
    }
    for (auto& f : run) f();
  }
  size_t live() {
    MutexLock lock(&mu_);
    return grants.size();
  }

  Mutex mu_;
  uint64_t next_ = 100;
  std::map<uint64_t, std::pair<std::string, std::vector<Range>>> grants;
  std::vector<std::function<void()>> pending;
  std::vector<std::string> peers_revoked;
  int revokes = 0;
};

class SourceHoldsTest : public ::testing::Test {
 protected:
  static constexpr uint64_t kBlock = 64 << 10;
  void SetUp() override {
    auto options = core::testing::SmallCacheOptions(8ull << 20);
    options.transfer_budget_bytes = 1ull << 20;  // 16 blocks
    options.max_transfer_sessions = 3;
    auto cache = core::BlockCache::Create(options, &metrics_);
    ASSERT_TRUE(cache.ok()) << cache.status();
    cache_ = std::move(*cache);
    SourceHolds::Options o;
    o.now = [this] { return now_; };
    holds_ = std::make_unique<SourceHolds>(o, &cache_->table(), &cache_->pool(), &cache_->transfer_budget(), &issuer_);
  }
  void TearDown() override {
    holds_.reset();
    cache_.reset();
  }
  // Publishes `keys` and returns the versions a lookup would name.
  std::vector<SourceBlockVersion> Publish(const std::vector<state::StateKey>& keys) {
    std::vector<SourceBlockVersion> versions;
    for (size_t i = 0; i < keys.size(); ++i) {
      auto writer = cache_->Prepare(keys[i], kBlock);
      EXPECT_TRUE(writer.ok()) << writer.status();
      core::testing::Stamp(writer->data(), kBlock, i);
      const uint64_t generation = cache_->Seal(*writer);
      auto pin = cache_->table().Pin(keys[i]);
      EXPECT_TRUE(pin.ok());
      versions.push_back({keys[i], generation, pin->sequence()});
    }
    return versions;
  }
  AuthorizeArgs Args(std::vector<SourceBlockVersion> blocks, uint64_t request = 1, std::string peer = "rt-b") {
    AuthorizeArgs args;
    args.peer_node = "node-b";
    args.peer_runtime = std::move(peer);
    args.request_id = request;
    args.blocks = std::move(blocks);
    return args;
  }
  // The value the holds visit for a metric (and label value): what /metrics shows.
  double Metric(std::string_view name, std::string_view label_value = {}) {
    MetricReader reader(name, label_value);
    holds_->VisitStats(reader);
    return reader.value();
  }

  MetricsRegistry metrics_;
  std::unique_ptr<core::BlockCache> cache_;
  RecordingIssuer issuer_;
  MonoTime now_ = MonoNow();
  std::unique_ptr<SourceHolds> holds_;
};

TEST_F(SourceHoldsTest, GrantsExactlyThePinnedBlocksAndFreesThemOnlyAfterTheReleaseDrained) {
  const auto versions = Publish(Chain(1, 4));
  auto grant = holds_->Authorize(Args(versions));
  ASSERT_TRUE(grant.ok()) << grant.status();
  EXPECT_EQ(grant->outcome, SourceOutcome::kGranted);
  EXPECT_EQ(grant->granted, 4u);
  ASSERT_EQ(grant->blocks.size(), 4u);
  ASSERT_EQ(issuer_.grants.count(grant->grant_id), 1u);
  const auto& ranges = issuer_.grants[grant->grant_id].second;
  ASSERT_EQ(ranges.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(ranges[i].bytes, kBlock);
    EXPECT_EQ(grant->blocks[i].offset, ranges[i].offset);
    EXPECT_LT(grant->blocks[i].region, grant->regions.size());
  }
  EXPECT_EQ(issuer_.grants[grant->grant_id].first, "rt-b");
  EXPECT_EQ(holds_->GetStats().sessions, 1u);
  EXPECT_EQ(holds_->GetStats().pinned_bytes, 4 * kBlock);
  EXPECT_EQ(cache_->transfer_budget().reserved_bytes(), 4 * kBlock);
  // The pins keep the blocks: eviction cannot take them.
  EXPECT_EQ(cache_->table().EvictBytes(4 * kBlock), 0u);
  // A duplicate Authorize is the same grant, no second session.
  auto again = holds_->Authorize(Args(versions));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->grant_id, grant->grant_id);
  EXPECT_EQ(holds_->GetStats().sessions, 1u);
  // Release revokes; the pins stay until the transport drained.
  EXPECT_TRUE(holds_->Release("rt-b", 1));
  EXPECT_TRUE(holds_->Release("rt-b", 1));  // idempotent
  EXPECT_EQ(issuer_.revokes, 1);
  EXPECT_EQ(holds_->GetStats().pinned_bytes, 4 * kBlock);
  EXPECT_EQ(cache_->table().Stats().pinned_blocks, 4u);
  issuer_.DrainAll();
  EXPECT_EQ(holds_->GetStats().sessions, 0u);
  EXPECT_EQ(holds_->GetStats().pinned_bytes, 0u);
  EXPECT_EQ(cache_->table().Stats().pinned_blocks, 0u);
  EXPECT_EQ(cache_->transfer_budget().reserved_bytes(), 0u);
  EXPECT_FALSE(holds_->Release("rt-b", 1));  // gone
  EXPECT_EQ(Metric("orbitkv_source_sessions"), 0);
}

TEST_F(SourceHoldsTest, AReplacedOrEvictedBlockIsRefusedWithNothingPinned) {
  const auto keys = Chain(2, 3);
  auto versions = Publish(keys);
  // Key 0 replaced after the lookup (removed and saved again: a new version).
  ASSERT_TRUE(cache_->table().Remove(keys[0], core::Tier::kDram).ok());
  Publish({keys[0]});
  auto stale = holds_->Authorize(Args(versions));
  ASSERT_TRUE(stale.ok());
  EXPECT_EQ(stale->outcome, SourceOutcome::kStale);
  EXPECT_EQ(stale->granted, 0u);
  EXPECT_EQ(stale->grant_id, 0u);
  EXPECT_TRUE(stale->blocks.empty());
  EXPECT_TRUE(issuer_.grants.empty());
  EXPECT_EQ(holds_->GetStats().sessions, 0u);
  EXPECT_EQ(cache_->table().Stats().pinned_blocks, 0u);
  // Key 2 evicted to SSD only: the prefix before it is granted, the stop says why.
  cache_->table().PublishSsd(keys[2], 9, kBlock);
  ASSERT_TRUE(cache_->table().Remove(keys[2], core::Tier::kDram).ok());
  std::vector<SourceBlockVersion> tail(versions.begin() + 1, versions.end());
  auto partial = holds_->Authorize(Args(tail, 2));
  ASSERT_TRUE(partial.ok());
  EXPECT_EQ(partial->outcome, SourceOutcome::kGranted);
  EXPECT_EQ(partial->granted, 1u);
  EXPECT_EQ(partial->stop, SourceOutcome::kNotInDram);
  auto ssd_only = holds_->Authorize(Args({versions[2]}, 3));
  ASSERT_TRUE(ssd_only.ok());
  EXPECT_EQ(ssd_only->outcome, SourceOutcome::kNotInDram);
  EXPECT_EQ(Metric("orbitkv_source_rejections_total", "stale"), 1);
  EXPECT_EQ(Metric("orbitkv_source_rejections_total", "not_in_dram"), 1);
  EXPECT_EQ(Metric("orbitkv_source_rejections_total", "resource_exhausted"), 0);
  EXPECT_TRUE(holds_->Release("rt-b", 2));
  issuer_.DrainAll();
  EXPECT_EQ(holds_->GetStats().sessions, 0u);
}

TEST_F(SourceHoldsTest, TheSessionLimitAndTheBudgetRefuseWithResourceExhaustedAndPinNothing) {
  const auto versions = Publish(Chain(3, 8));
  for (uint64_t r = 1; r <= 3; ++r) {
    ASSERT_TRUE(holds_->Authorize(Args({versions[r]}, r)).ok());
  }
  auto fourth = holds_->Authorize(Args({versions[5]}, 4));
  EXPECT_EQ(fourth.status().code(), StatusCode::kResourceExhausted) << fourth.status();
  EXPECT_NE(fourth.status().message().find("--transfer-budget"), std::string::npos);
  EXPECT_EQ(holds_->GetStats().sessions, 3u);
  EXPECT_EQ(cache_->table().Stats().pinned_blocks, 3u);
  for (uint64_t r = 1; r <= 3; ++r) EXPECT_TRUE(holds_->Release("rt-b", r));
  issuer_.DrainAll();
  // Past the byte budget (16 blocks of 64 KiB): refused, nothing held.
  auto big = Publish(Chain(4, 20));
  auto over = holds_->Authorize(Args(big, 9));
  EXPECT_EQ(over.status().code(), StatusCode::kResourceExhausted) << over.status();
  EXPECT_EQ(cache_->table().Stats().pinned_blocks, 0u);
  // The requester's byte limit trims the grant instead.
  auto args = Args(big, 10);
  args.byte_limit = 5 * kBlock;
  auto trimmed = holds_->Authorize(args);
  ASSERT_TRUE(trimmed.ok()) << trimmed.status();
  EXPECT_EQ(trimmed->granted, 5u);
  EXPECT_TRUE(holds_->Release("rt-b", 10));
  issuer_.DrainAll();
  EXPECT_EQ(cache_->transfer_budget().reserved_bytes(), 0u);
}

TEST_F(SourceHoldsTest, AnExpiredGrantIsQuarantinedUntilItDrainedNeverFreedOnTheTimerAlone) {
  const auto versions = Publish(Chain(5, 2));
  auto args = Args(versions);
  args.lifetime = std::chrono::milliseconds(500);
  ASSERT_TRUE(holds_->Authorize(args).ok());
  EXPECT_EQ(holds_->ExpireDue(), 0u);
  now_ += std::chrono::seconds(1);
  EXPECT_EQ(holds_->ExpireDue(), 1u);
  EXPECT_EQ(holds_->ExpireDue(), 0u);  // already revoking
  EXPECT_EQ(issuer_.live(), 0u);
  // Past the deadline, revoked, but a transfer may still touch the bytes: pinned and charged.
  EXPECT_EQ(holds_->GetStats().quarantined, 1u);
  EXPECT_EQ(holds_->GetStats().quarantined_bytes, 2 * kBlock);
  EXPECT_EQ(Metric("orbitkv_source_quarantined_bytes"), 2.0 * kBlock);
  EXPECT_EQ(cache_->table().Stats().pinned_blocks, 2u);
  EXPECT_TRUE(holds_->Release("rt-b", 1));  // a late Release changes nothing
  issuer_.DrainAll();
  EXPECT_EQ(holds_->GetStats().sessions, 0u);
  EXPECT_EQ(Metric("orbitkv_source_quarantined_bytes"), 0);
  EXPECT_EQ(cache_->table().Stats().pinned_blocks, 0u);
}

// Issue 51: this Manager's registration ended, so every grant it gave goes. Each stays pinned and charged
// (quarantined) until its own revocation drained; a grant given after that (the new registration) neither waits for
// them nor is touched by them.
TEST_F(SourceHoldsTest, RevokeAllQuarantinesEveryGrantUntilItDrainedAndLaterGrantsDoNotWait) {
  const auto versions = Publish(Chain(7, 3));
  ASSERT_TRUE(holds_->Authorize(Args({versions[0]}, 1, "rt-x")).ok());
  ASSERT_TRUE(holds_->Authorize(Args({versions[1]}, 2, "rt-y")).ok());
  EXPECT_EQ(holds_->RevokeAll("registration lapsed", /*stop_accepting=*/true), 2u);
  EXPECT_EQ(holds_->RevokeAll("again"), 0u);  // already revoking
  // Until the new registration, nothing more is granted (an Authorize already past the remote-work check too).
  auto refused = holds_->Authorize(Args({versions[2]}, 3, "rt-new"));
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition) << refused.status();
  holds_->Accept();
  EXPECT_EQ(issuer_.live(), 0u);
  EXPECT_EQ(holds_->GetStats().quarantined, 2u);
  EXPECT_EQ(holds_->GetStats().quarantined_bytes, 2 * kBlock);
  EXPECT_EQ(cache_->table().Stats().pinned_blocks, 2u);
  // A new grant (the new registration's requester) is given at once, and revoking the old ones does not touch it.
  auto later = holds_->Authorize(Args({versions[2]}, 3, "rt-new"));
  ASSERT_TRUE(later.ok()) << later.status();
  EXPECT_EQ(later->outcome, SourceOutcome::kGranted);
  EXPECT_EQ(issuer_.live(), 1u);
  issuer_.DrainOne(0);
  EXPECT_EQ(holds_->GetStats().sessions, 2u);  // one old hold drained and went; the other is still in flight
  issuer_.DrainOne(1);
  EXPECT_EQ(holds_->GetStats().sessions, 1u);
  EXPECT_EQ(holds_->GetStats().quarantined, 0u);
  EXPECT_EQ(cache_->table().Stats().pinned_blocks, 1u);
  // The new one ends by its grant id and secret alone, but only for the node that holds it (issue 52: a release
  // without the grant's secret, or with another, is refused and counted, and releases nothing).
  const std::string secret = later->grant_secret;
  ASSERT_EQ(secret.size(), kGrantSecretBytes);
  EXPECT_FALSE(holds_->ReleaseGrant("node-other", later->grant_id, secret));
  EXPECT_FALSE(holds_->ReleaseGrant("node-b", later->grant_id + 1000, secret));
  std::string wrong = secret;
  wrong[3] ^= 1;
  EXPECT_FALSE(holds_->ReleaseGrant("node-b", later->grant_id, ""));
  EXPECT_FALSE(holds_->ReleaseGrant("node-b", later->grant_id, wrong));
  EXPECT_EQ(holds_->GetStats().release_secret_refusals, 2u);
  EXPECT_EQ(holds_->GetStats().sessions, 1u);  // the new grant still held: nothing was released by them
  EXPECT_TRUE(holds_->ReleaseGrant("node-b", later->grant_id, secret));
  EXPECT_TRUE(holds_->ReleaseGrant("node-b", later->grant_id, secret));  // a duplicate while it drains
  EXPECT_EQ(cache_->table().Stats().pinned_blocks, 1u);                  // pinned until drained
  issuer_.DrainAll();
  EXPECT_FALSE(holds_->ReleaseGrant("node-b", later->grant_id, secret));
  EXPECT_EQ(holds_->GetStats().sessions, 0u);
  EXPECT_EQ(cache_->table().Stats().pinned_blocks, 0u);
  EXPECT_EQ(Metric("orbitkv_source_quarantined_bytes"), 0);
}

TEST_F(SourceHoldsTest, AVanishedRequestersGrantsAreRevokedThroughItsTransportThenFreed) {
  const auto versions = Publish(Chain(6, 3));
  ASSERT_TRUE(holds_->Authorize(Args({versions[0]}, 1, "rt-gone")).ok());
  ASSERT_TRUE(holds_->Authorize(Args({versions[1]}, 2, "rt-gone")).ok());
  ASSERT_TRUE(holds_->Authorize(Args({versions[2]}, 3, "rt-alive")).ok());
  const auto alive = [](const std::string&, const std::string& runtime) { return runtime == "rt-alive"; };
  EXPECT_EQ(holds_->DropVanished(alive), 1u);
  EXPECT_EQ(holds_->DropVanished(alive), 0u);  // its transport is already being revoked
  ASSERT_EQ(issuer_.peers_revoked.size(), 1u);
  EXPECT_EQ(issuer_.peers_revoked[0], "rt-gone");
  EXPECT_EQ(holds_->GetStats().quarantined, 2u);
  EXPECT_EQ(cache_->table().Stats().pinned_blocks, 3u);
  issuer_.DrainAll();
  EXPECT_EQ(holds_->GetStats().sessions, 1u);
  EXPECT_EQ(cache_->table().Stats().pinned_blocks, 1u);
  EXPECT_TRUE(holds_->Release("rt-alive", 3));
  issuer_.DrainAll();
  EXPECT_EQ(holds_->GetStats().sessions, 0u);
  EXPECT_EQ(cache_->transfer_budget().reserved_bytes(), 0u);
}

TEST_F(SourceHoldsTest, AHoldBeingReleasedWhenItsRequesterVanishesIsFreedOnlyByItsOwnDrain) {
  const auto versions = Publish(Chain(8, 2));
  ASSERT_TRUE(holds_->Authorize(Args({versions[0]}, 1, "rt-gone")).ok());
  ASSERT_TRUE(holds_->Authorize(Args({versions[1]}, 2, "rt-gone")).ok());
  EXPECT_TRUE(holds_->Release("rt-gone", 1));  // revocation 0: its sends may still be in flight
  EXPECT_EQ(holds_->DropVanished([](const std::string&, const std::string&) { return false; }), 1u);
  ASSERT_EQ(issuer_.pending.size(), 2u);
  // The peer's revocation drained (its endpoints closed): only the hold it revoked goes; the released one waits
  // for its own grant to drain.
  issuer_.DrainOne(1);
  EXPECT_EQ(holds_->GetStats().sessions, 1u);
  EXPECT_EQ(cache_->table().Stats().pinned_blocks, 1u);
  issuer_.DrainOne(0);
  EXPECT_EQ(holds_->GetStats().sessions, 0u);
  EXPECT_EQ(cache_->table().Stats().pinned_blocks, 0u);
}

TEST_F(SourceHoldsTest, ConcurrentDuplicateAuthorizesMakeOneSession) {
  const auto versions = Publish(Chain(7, 2));
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  std::mutex ids_mu;
  std::set<uint64_t> ids;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      auto grant = holds_->Authorize(Args(versions, 42));
      if (!grant.ok()) return;
      ok.fetch_add(1);
      std::lock_guard<std::mutex> lock(ids_mu);
      ids.insert(grant->grant_id);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 4);
  EXPECT_EQ(ids.size(), 1u);
  EXPECT_EQ(holds_->GetStats().sessions, 1u);
  EXPECT_EQ(issuer_.live(), 1u);
  EXPECT_TRUE(holds_->Release("rt-b", 42));
  issuer_.DrainAll();
  EXPECT_EQ(cache_->table().Stats().pinned_blocks, 0u);
}

// Issue 56: SSD-resident blocks are read into DRAM (the loader stands in for SsdTier::Load: the test completes each
// load when it says, sealing the blocks it read into DRAM as the tier does) before they are granted.
class SourceHoldsSsdTest : public SourceHoldsTest {
 protected:
  void SetUp() override {
    SourceHoldsTest::SetUp();
    staging_ = std::make_unique<core::Budget>(
        core::Budget::Options{.name = "ssd_staging", .global_bytes = 6 * cache_->pool().ClassBytes(kBlock)}, &metrics_);
    MakeHolds(SourceHolds::Options{}.prepare_piece_bytes);
  }
  // The holds under test, reading their preparations in pieces of `piece_bytes` (the first one too, unless
  // `first_piece_bytes`), answering kPending at once unless `pending_wait`.
  void MakeHolds(uint64_t piece_bytes, std::chrono::milliseconds pending_wait = std::chrono::milliseconds(0),
                 uint64_t first_piece_bytes = 0) {
    SourceHolds::Options o;
    o.now = [this] { return now_; };
    o.ssd_staging = staging_.get();
    o.prepare_piece_bytes = piece_bytes;
    o.first_piece_bytes = first_piece_bytes == 0 ? piece_bytes : first_piece_bytes;
    o.pending_wait = pending_wait;
    o.load_ssd = [this](std::vector<state::StateKey> keys, std::function<void(std::vector<core::BlockPin>)> done) {
      std::lock_guard<std::mutex> lock(loads_mu_);
      loads_.push_back({std::move(keys), std::move(done)});
      return Status::Ok();
    };
    holds_ = std::make_unique<SourceHolds>(o, &cache_->table(), &cache_->pool(), &cache_->transfer_budget(), &issuer_);
  }
  void TearDown() override {
    holds_.reset();
    loads_.clear();  // reads never completed: their staging charges go with them
    staging_.reset();
    SourceHoldsTest::TearDown();
  }
  // `keys` on SSD only (a residence each, as the SSD tier publishes after a write): the versions a lookup names.
  std::vector<SourceBlockVersion> OnSsd(const std::vector<state::StateKey>& keys) {
    std::vector<SourceBlockVersion> versions;
    for (size_t i = 0; i < keys.size(); ++i) {
      const uint64_t generation = cache_->table().PublishSsd(keys[i], /*locator=*/i, kBlock);
      versions.push_back({keys[i], generation, /*sequence=*/1000 + i, kSourceSsd});
    }
    return versions;
  }
  // Completes load `i`: its first `readable` keys are read into DRAM (stamped with their index), the callback gets
  // pins on them.
  void CompleteLoad(size_t i, size_t readable) {
    std::vector<state::StateKey> keys;
    std::function<void(std::vector<core::BlockPin>)> done;
    {
      std::lock_guard<std::mutex> lock(loads_mu_);
      keys = loads_.at(i).first;
      done = std::move(loads_.at(i).second);
    }
    std::vector<core::BlockPin> pins;
    for (size_t k = 0; k < std::min(readable, keys.size()); ++k) {
      auto pinned = cache_->table().Pin(keys[k]);
      if (!pinned.ok()) {
        auto writer = cache_->Prepare(keys[k], kBlock);
        ASSERT_TRUE(writer.ok()) << writer.status();
        core::testing::Stamp(writer->data(), kBlock, k);
        cache_->Seal(*writer, core::TransitionCause::kRestore);
        pinned = cache_->table().Pin(keys[k]);
      }
      ASSERT_TRUE(pinned.ok());
      pins.push_back(std::move(*pinned));
    }
    done(std::move(pins));
  }
  size_t loads() {
    std::lock_guard<std::mutex> lock(loads_mu_);
    return loads_.size();
  }
  // How many keys each load started so far asked for, in order.
  std::vector<size_t> LoadSizes() {
    std::lock_guard<std::mutex> lock(loads_mu_);
    std::vector<size_t> sizes;
    for (const auto& load : loads_) sizes.push_back(load.first.size());
    return sizes;
  }
  // Asks `args` again: a grant of `granted` blocks stopping for `stop`.
  void ExpectGrant(const AuthorizeArgs& args, size_t granted, SourceOutcome stop) {
    Result<SourceGrant> grant = holds_->Authorize(args);
    ASSERT_TRUE(grant.ok()) << grant.status();
    ASSERT_EQ(grant->outcome, SourceOutcome::kGranted);
    EXPECT_EQ(grant->granted, granted);
    EXPECT_EQ(grant->stop, stop);
  }

  std::unique_ptr<core::Budget> staging_;
  std::mutex loads_mu_;
  std::vector<std::pair<std::vector<state::StateKey>, std::function<void(std::vector<core::BlockPin>)>>> loads_;
};

TEST_F(SourceHoldsSsdTest, AnSsdSpanIsPendingWhileItIsReadThenGrantedUnderTheSameRequestId) {
  const auto keys = Chain(40, 4);
  auto versions = OnSsd(keys);
  auto first = holds_->Authorize(Args(versions));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->outcome, SourceOutcome::kPending);
  EXPECT_GT(first->retry_after.count(), 0);
  ASSERT_EQ(loads(), 1u);
  EXPECT_EQ(staging_->reserved_bytes(), 4 * cache_->pool().ClassBytes(kBlock));
  EXPECT_EQ(holds_->GetStats().ssd_preparing, 1u);
  // Asked again before the read finished: still pending, no second read.
  auto again = holds_->Authorize(Args(versions));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->outcome, SourceOutcome::kPending);
  EXPECT_EQ(loads(), 1u);
  CompleteLoad(0, 4);
  auto granted = holds_->Authorize(Args(versions));
  ASSERT_TRUE(granted.ok()) << granted.status();
  ASSERT_EQ(granted->outcome, SourceOutcome::kGranted);
  EXPECT_EQ(granted->granted, 4u);
  ASSERT_EQ(issuer_.grants.count(granted->grant_id), 1u);
  EXPECT_EQ(issuer_.grants[granted->grant_id].second.size(), 4u);
  const SourceHolds::Stats stats = holds_->GetStats();
  EXPECT_EQ(stats.ssd_preparations, 1u);
  EXPECT_EQ(stats.ssd_granted, 1u);
  EXPECT_EQ(stats.ssd_prepared_blocks, 4u);
  EXPECT_EQ(stats.ssd_preparing, 0u);
  EXPECT_EQ(cache_->transfer_budget().reserved_bytes(), 0u);  // charged to the SSD staging budget instead
  EXPECT_EQ(cache_->table().Stats().pinned_blocks, 4u);
  // The prepared blocks stay resident at the source (a normal admission), the grant's pins end with its drain.
  EXPECT_TRUE(holds_->Release("rt-b", 1));
  EXPECT_EQ(staging_->reserved_bytes(), 4 * cache_->pool().ClassBytes(kBlock));  // until drained
  issuer_.DrainAll();
  EXPECT_EQ(holds_->GetStats().sessions, 0u);
  EXPECT_EQ(staging_->reserved_bytes(), 0u);
  EXPECT_EQ(cache_->table().Stats().pinned_blocks, 0u);
  EXPECT_EQ(cache_->table().LookupPrefix(keys), 4u);
}

TEST_F(SourceHoldsSsdTest, AFullStagingBudgetIsBackpressureAndAChangedGenerationIsStale) {
  auto big = OnSsd(Chain(41, 7));  // 7 blocks, room for 6
  auto busy = holds_->Authorize(Args(big));
  ASSERT_TRUE(busy.ok());
  EXPECT_EQ(busy->outcome, SourceOutcome::kBackpressure);
  EXPECT_EQ(holds_->GetStats().sessions, 0u);
  EXPECT_EQ(loads(), 0u);
  EXPECT_EQ(holds_->GetStats().ssd_backpressure, 1u);
  auto versions = OnSsd(Chain(42, 2));
  cache_->table().PublishSsd(versions[0].key, 7, kBlock);  // rewritten since the lookup: another generation
  auto stale = holds_->Authorize(Args(versions, 2));
  ASSERT_TRUE(stale.ok());
  EXPECT_EQ(stale->outcome, SourceOutcome::kStale);
  EXPECT_EQ(loads(), 0u);
  EXPECT_EQ(staging_->reserved_bytes(), 0u);
}

TEST_F(SourceHoldsSsdTest, NothingReadIsMissingAndFreesItsCharge) {
  auto versions = OnSsd(Chain(43, 3));
  ASSERT_EQ(holds_->Authorize(Args(versions))->outcome, SourceOutcome::kPending);
  CompleteLoad(0, 0);  // every record failed its read or checksum
  auto missing = holds_->Authorize(Args(versions));
  ASSERT_TRUE(missing.ok());
  EXPECT_EQ(missing->outcome, SourceOutcome::kMissing);
  EXPECT_EQ(issuer_.live(), 0u);
  EXPECT_EQ(staging_->reserved_bytes(), 0u);
  EXPECT_EQ(holds_->GetStats().ssd_missing, 1u);
  EXPECT_TRUE(holds_->Release("rt-b", 1));
  EXPECT_EQ(holds_->GetStats().sessions, 0u);
  // A prefix that made it is granted alone.
  auto partial = OnSsd(Chain(44, 3));
  ASSERT_EQ(holds_->Authorize(Args(partial, 2))->outcome, SourceOutcome::kPending);
  CompleteLoad(1, 2);
  auto two = holds_->Authorize(Args(partial, 2));
  ASSERT_TRUE(two.ok());
  EXPECT_EQ(two->outcome, SourceOutcome::kGranted);
  EXPECT_EQ(two->granted, 2u);
}

TEST_F(SourceHoldsSsdTest, ARequesterGoneOrReleasedMidPreparationLeavesNoPinChargeOrGrant) {
  auto versions = OnSsd(Chain(45, 4));
  ASSERT_EQ(holds_->Authorize(Args(versions, 1, "rt-gone"))->outcome, SourceOutcome::kPending);
  ASSERT_EQ(holds_->Authorize(Args(OnSsd(Chain(46, 2)), 2, "rt-b"))->outcome, SourceOutcome::kPending);
  EXPECT_EQ(holds_->DropVanished([](const std::string&, const std::string& runtime) { return runtime != "rt-gone"; }),
            1u);
  issuer_.DrainAll();
  EXPECT_TRUE(holds_->Release("rt-b", 2));
  EXPECT_EQ(holds_->GetStats().sessions, 0u);
  EXPECT_EQ(staging_->reserved_bytes(), 0u);
  // The reads finish afterwards: their blocks are not granted to anyone and not kept pinned.
  CompleteLoad(0, 4);
  CompleteLoad(1, 2);
  EXPECT_EQ(issuer_.live(), 0u);
  EXPECT_EQ(cache_->table().Stats().pinned_blocks, 0u);
  EXPECT_EQ(holds_->GetStats().sessions, 0u);
}

// A span read in pieces: the first piece is granted as soon as it is in DRAM, saying more is coming (stop kMore); the
// later pieces land in DRAM unpinned, and the requester's next request for them is a plain DRAM grant.
TEST_F(SourceHoldsSsdTest, TheFirstPieceIsGrantedWhileTheRestIsReadAndTheRestIsThenInDram) {
  MakeHolds(2 * kBlock);
  const auto keys = Chain(48, 5);
  const auto versions = OnSsd(keys);
  ASSERT_EQ(holds_->Authorize(Args(versions))->outcome, SourceOutcome::kPending);
  ASSERT_EQ(LoadSizes(), (std::vector<size_t>{2, 2, 1}));  // all started at once
  CompleteLoad(0, 2);
  ExpectGrant(Args(versions), 2, SourceOutcome::kMore);
  CompleteLoad(1, 2);
  CompleteLoad(2, 1);
  EXPECT_EQ(holds_->GetStats().ssd_prepared_blocks, 5u);
  EXPECT_EQ(cache_->table().Stats().pinned_blocks, 2u);  // only the granted piece
  EXPECT_EQ(cache_->table().LookupPrefix(std::vector<state::StateKey>(keys.begin() + 2, keys.end())), 3u);
  // A short first piece (a read failed in it) stops the grant there, with no more to come.
  MakeHolds(2 * kBlock);
  const auto other = OnSsd(Chain(49, 4));
  ASSERT_EQ(holds_->Authorize(Args(other, 2))->outcome, SourceOutcome::kPending);
  CompleteLoad(3, 1);
  auto short_piece = holds_->Authorize(Args(other, 2));
  ASSERT_TRUE(short_piece.ok());
  EXPECT_EQ(short_piece->granted, 1u);
  EXPECT_EQ(short_piece->stop, SourceOutcome::kMissing);
}

// A preparation starts with a small piece and doubles it: the requester's first read waits for one small SSD read.
// The requester's next request, for a span that starts inside those reads, continues them: whole pieces, no second
// read of anything.
TEST_F(SourceHoldsSsdTest, TheFirstPieceIsSmallAndARequestForTheRestContinuesTheReadsAlreadyStarted) {
  holds_.reset();
  staging_ = std::make_unique<core::Budget>(
      core::Budget::Options{.name = "ssd_staging", .global_bytes = 16 * cache_->pool().ClassBytes(kBlock)}, &metrics_);
  MakeHolds(2 * kBlock, std::chrono::milliseconds(0), /*first_piece_bytes=*/kBlock);
  const auto keys = Chain(50, 6);
  const auto versions = OnSsd(keys);
  ASSERT_EQ(holds_->Authorize(Args(versions))->outcome, SourceOutcome::kPending);
  ASSERT_EQ(LoadSizes(), (std::vector<size_t>{1, 2, 2, 1}));  // all started at once
  CompleteLoad(0, 1);
  ExpectGrant(Args(versions), 1, SourceOutcome::kMore);
  // The rest, asked for before its blocks landed: one load of a whole first piece (shared with the read in flight
  // by the SSD tier's coalescer), no read-ahead of the pieces after it.
  const std::vector<SourceBlockVersion> rest(versions.begin() + 1, versions.end());
  ASSERT_EQ(holds_->Authorize(Args(rest, 2))->outcome, SourceOutcome::kPending);
  ASSERT_EQ(loads(), 5u);
  EXPECT_EQ(loads_[4].first, std::vector<state::StateKey>(keys.begin() + 1, keys.begin() + 3));
  CompleteLoad(1, 2);
  CompleteLoad(4, 2);
  ExpectGrant(Args(rest, 2), 2, SourceOutcome::kMore);
  // A span no read covers any more starts small again and reads ahead.
  CompleteLoad(2, 2);
  CompleteLoad(3, 1);
  EXPECT_EQ(holds_->GetStats().ssd_prepared_blocks, 6u);  // each block once: the continuation read nothing new
  // The rest asked for once every read landed: its blocks are in DRAM already, nothing is read or counted again.
  const std::vector<SourceBlockVersion> last(versions.begin() + 3, versions.end());
  ASSERT_EQ(holds_->Authorize(Args(last, 4))->outcome, SourceOutcome::kPending);
  ASSERT_EQ(loads(), 6u);
  CompleteLoad(5, 2);
  ExpectGrant(Args(last, 4), 2, SourceOutcome::kMore);
  EXPECT_EQ(holds_->GetStats().ssd_prepared_blocks, 6u);
  const auto others = OnSsd(Chain(51, 3));
  ASSERT_EQ(holds_->Authorize(Args(others, 3))->outcome, SourceOutcome::kPending);
  ASSERT_EQ(LoadSizes(), (std::vector<size_t>{1, 2, 2, 1, 2, 2, 1, 2}));  // the last two: 1 and 2 blocks
}

// An authorization that would be pending waits for its first piece (Options::pending_wait) and answers the grant:
// the requester neither sleeps nor asks again. A release while it waits ends the wait (pending: asked again, the
// hold is gone).
TEST_F(SourceHoldsSsdTest, APendingAuthorizationWaitsForItsFirstPieceAndAnswersTheGrant) {
  MakeHolds(SourceHolds::Options{}.prepare_piece_bytes, std::chrono::seconds(30));
  const auto versions = OnSsd(Chain(52, 3));
  // Until `n` loads were started (at most about 5 s: a preparation that never starts fails the test, not hangs it).
  auto started = [this](size_t n) {
    for (int i = 0; i < 5000 && loads() < n; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return loads() >= n;
  };
  auto answer = std::async(std::launch::async, [&] { return holds_->Authorize(Args(versions)); });
  ASSERT_TRUE(started(1));
  CompleteLoad(0, 3);
  Result<SourceGrant> granted = answer.get();
  ASSERT_TRUE(granted.ok()) << granted.status();
  EXPECT_EQ(granted->outcome, SourceOutcome::kGranted);
  EXPECT_EQ(granted->granted, 3u);
  EXPECT_EQ(issuer_.live(), 1u);
  // Released mid-wait: the wait ends with kPending, nothing is left behind once the read lands.
  const auto others = OnSsd(Chain(53, 2));
  auto waiting = std::async(std::launch::async, [&] { return holds_->Authorize(Args(others, 2)); });
  ASSERT_TRUE(started(2));
  EXPECT_TRUE(holds_->Release("rt-b", 2));
  Result<SourceGrant> pending = waiting.get();
  ASSERT_TRUE(pending.ok());
  EXPECT_EQ(pending->outcome, SourceOutcome::kPending);
  CompleteLoad(1, 2);
  EXPECT_EQ(issuer_.live(), 1u);  // the first grant alone
  EXPECT_TRUE(holds_->Release("rt-b", 1));
  issuer_.DrainAll();
  EXPECT_EQ(holds_->GetStats().sessions, 0u);
  EXPECT_EQ(staging_->reserved_bytes(), 0u);
  EXPECT_EQ(cache_->table().Stats().pinned_blocks, 0u);
}

TEST_F(SourceHoldsSsdTest, ASpanGoingFromDramToSsdIsPreparedWholeWithItsDramBlocksExact) {
  const auto keys = Chain(47, 4);
  std::vector<SourceBlockVersion> versions = Publish({keys[0], keys[1]});
  for (const auto& v : OnSsd({keys[2], keys[3]})) versions.push_back(v);
  auto pending = holds_->Authorize(Args(versions));
  ASSERT_TRUE(pending.ok());
  ASSERT_EQ(pending->outcome, SourceOutcome::kPending);
  ASSERT_EQ(loads(), 1u);
  EXPECT_EQ(loads_[0].first.size(), 4u);
  CompleteLoad(0, 4);
  auto granted = holds_->Authorize(Args(versions));
  ASSERT_TRUE(granted.ok());
  EXPECT_EQ(granted->outcome, SourceOutcome::kGranted);
  EXPECT_EQ(granted->granted, 4u);
  // A DRAM block named in another version stops the span before it: nothing to prepare from a stale start.
  std::vector<SourceBlockVersion> wrong = versions;
  wrong[0].sequence += 1;
  auto stale = holds_->Authorize(Args(wrong, 9));
  ASSERT_TRUE(stale.ok());
  EXPECT_EQ(stale->outcome, SourceOutcome::kStale);
}

// Issue 56 over the real SSD tier (its coalesced, verified reads, on psync) with a device that fails reads on demand:
// a span read whole is granted with the bytes that were saved; a read error in the middle of a preparation grants
// the prefix before it; a read error on the first block is kMissing, never a grant.
class SourceHoldsSsdTierTest : public SourceHoldsTest {
 protected:
  void SetUp() override {
    SourceHoldsTest::SetUp();
    core::SsdTierOptions options;
    options.store.directory = dir_.path();
    options.store.capacity_bytes = 16ull << 20;
    options.store.file_count = 1;
    options.store.backend = storage::DeviceBackend::kPsync;
    options.store.wrap_device = [this](std::unique_ptr<storage::Device> inner) {
      auto device = std::make_unique<storage::testing::FaultInjectingDevice>(std::move(inner));
      device_ = device.get();
      return std::unique_ptr<storage::Device>(std::move(device));
    };
    options.min_frequency = 1;
    options.policy = core::SsdWritePolicy::kWriteThrough;
    // One writer, one write in flight: a span's records are written in key order at increasing offsets (two writers
    // race for extents), and one reader reads a batch in offset order, so a fault lands on the block the test names.
    options.writer_threads = 1;
    options.writes_in_flight = 1;
    options.reader_threads = 1;
    auto tier = core::SsdTier::Create(options, cache_.get(), &metrics_);
    ASSERT_TRUE(tier.ok()) << tier.status();
    tier_ = std::move(*tier);
    staging_ = std::make_unique<core::Budget>(core::Budget::Options{.name = "ssd_staging"}, &metrics_);
    SourceHolds::Options o;
    o.ssd_staging = staging_.get();
    o.load_ssd = [this](std::vector<state::StateKey> keys, std::function<void(std::vector<core::BlockPin>)> done) {
      return tier_->Load(std::move(keys), std::move(done));
    };
    holds_ = std::make_unique<SourceHolds>(o, &cache_->table(), &cache_->pool(), &cache_->transfer_budget(), &issuer_);
  }
  void TearDown() override {
    issuer_.DrainAll();
    holds_.reset();
    if (tier_) tier_->Shutdown();
    tier_.reset();
    staging_.reset();
    SourceHoldsTest::TearDown();
  }
  // Saves `keys` (stamped with their index), writes them through to SSD, then drops their DRAM copies: the versions
  // a lookup names for their SSD residences.
  std::vector<SourceBlockVersion> SavedToSsdOnly(const std::vector<state::StateKey>& keys) {
    Publish(keys);
    for (const auto& key : keys) tier_->OnSealed(key);
    tier_->Flush();
    std::vector<SourceBlockVersion> versions;
    for (size_t i = 0; i < keys.size(); ++i) {
      EXPECT_TRUE(cache_->table().Remove(keys[i], core::Tier::kDram).ok());
      const std::optional<core::SsdResidence> ssd = cache_->table().FindSsd(keys[i]);
      EXPECT_TRUE(ssd.has_value());
      versions.push_back({keys[i], ssd ? ssd->generation : 0, 1, kSourceSsd});
    }
    return versions;
  }
  // Once every grant drained: no hold, no staging charge, no pin. The tier's reader drops its own pins on what it
  // sealed just after the load callbacks ran (the grant can be answered before that, now that a pending
  // authorization waits for its read).
  void ExpectNothingHeld() {
    issuer_.DrainAll();
    EXPECT_EQ(holds_->GetStats().sessions, 0u);
    EXPECT_EQ(staging_->reserved_bytes(), 0u);
    for (int i = 0; i < 5000 && cache_->table().Stats().pinned_blocks != 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    EXPECT_EQ(cache_->table().Stats().pinned_blocks, 0u);
  }
  // Asks until the answer is not pending (about 5 s at most).
  SourceGrant AskUntilSettled(const AuthorizeArgs& args) {
    for (int i = 0; i < 5000; ++i) {
      Result<SourceGrant> grant = holds_->Authorize(args);
      EXPECT_TRUE(grant.ok()) << grant.status();
      if (!grant.ok() || grant->outcome != SourceOutcome::kPending) return grant.ok() ? *grant : SourceGrant{};
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ADD_FAILURE() << "still pending";
    return {};
  }

  orbitkv::testing::TempDir dir_;
  storage::testing::FaultInjectingDevice* device_ = nullptr;
  std::unique_ptr<core::SsdTier> tier_;
  std::unique_ptr<core::Budget> staging_;
};

TEST_F(SourceHoldsSsdTierTest, TheSpanIsReadFromSsdIntoDramAndGrantedWithTheSavedBytes) {
  const auto keys = Chain(60, 4);
  const auto versions = SavedToSsdOnly(keys);
  const SourceGrant grant = AskUntilSettled(Args(versions));
  ASSERT_EQ(grant.outcome, SourceOutcome::kGranted);
  ASSERT_EQ(grant.granted, 4u);
  const auto& ranges = issuer_.grants.at(grant.grant_id).second;
  for (size_t i = 0; i < 4; ++i) {
    const uint8_t* data = cache_->pool().arena(ranges[i].arena).data() + ranges[i].offset;
    EXPECT_TRUE(core::testing::CheckStamp(data, kBlock, i)) << "block " << i;
  }
  EXPECT_EQ(holds_->GetStats().ssd_prepared_blocks, 4u);
  EXPECT_EQ(tier_->Stats().verify_failures, 0u);
}

// Each read-error case on a fresh store: a record dropped by an earlier case would free an extent a later record
// reuses, and the tier reads a batch in offset order, not key order.
TEST_F(SourceHoldsSsdTierTest, AReadErrorMidPreparationGrantsThePrefixBeforeIt) {
  ASSERT_NE(device_, nullptr);
  const auto versions = SavedToSsdOnly(Chain(61, 4));
  // The third block's read fails (each record is read as two requests: its header page and its payload).
  device_->FailReads(/*after=*/4, /*count=*/1);
  const SourceGrant partial = AskUntilSettled(Args(versions));
  EXPECT_EQ(device_->failed_reads(), 1u);
  ASSERT_EQ(partial.outcome, SourceOutcome::kGranted);
  EXPECT_EQ(partial.granted, 2u);
  EXPECT_TRUE(holds_->Release("rt-b", 1));
  ExpectNothingHeld();
}

TEST_F(SourceHoldsSsdTierTest, AReadErrorOnTheFirstBlockIsMissing) {
  ASSERT_NE(device_, nullptr);
  const auto versions = SavedToSsdOnly(Chain(62, 3));
  device_->FailReads(/*after=*/0, /*count=*/1);
  const SourceGrant missing = AskUntilSettled(Args(versions, 2));
  EXPECT_EQ(device_->failed_reads(), 1u);
  EXPECT_EQ(missing.outcome, SourceOutcome::kMissing);
  EXPECT_EQ(missing.grant_id, 0u);
  EXPECT_TRUE(holds_->Release("rt-b", 2));
  ExpectNothingHeld();
}

}  // namespace
}  // namespace orbitkv::catalog
