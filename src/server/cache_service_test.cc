// CacheService and LoadingRegistry, driven directly: a real cache core, the CPU copy engine over
// this process's memory, a real SSD tier in a temporary directory, and no channel or session.
#include "server/cache_service.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

#include "base/scoped_fd.h"
#include "base/temp_dir.h"
#include "core/cpu_copy_engine.h"
#include "core/test_util.h"
#include "state/test_util.h"

namespace orbitkv::server {
namespace {

using namespace std::chrono_literals;

constexpr uint64_t kBlock = 64 * 1024;
constexpr uint32_t kPages = 32;
constexpr uint64_t kOwner = 11;
constexpr uint64_t kInstance = 5;

template <typename T>
struct Captured {
  std::promise<Result<T>> promise;
  std::future<Result<T>> future = promise.get_future();
  CacheService::Done<T> Callback() {
    return [this](Result<T> result) { promise.set_value(std::move(result)); };
  }
  Result<T> Get() {
    EXPECT_EQ(future.wait_for(10s), std::future_status::ready);
    return future.get();
  }
};

// The CPU copy engine, but its Submit number `refuse_at` (counted from 1; 0: none) is refused with
// ResourceExhausted, as an engine with every batch slot taken refuses one; counts the batches it
// accepted that finished.
class RefusingEngine : public core::CopyEngine {
 public:
  Status Submit(core::CopyBatch batch, core::CopyDone done) override {
    if (++submits == refuse_at.load()) return Status::ResourceExhausted("every batch slot is taken");
    return inner->Submit(std::move(batch), [this, done = std::move(done)](Status status) {
      finished.fetch_add(1);
      done(std::move(status));
    });
  }
  void Expect(core::BufferId buffer, core::CopyDirection direction) override { inner->Expect(buffer, direction); }
  void Shutdown() override {}
  std::string_view name() const override { return inner->name(); }

  std::atomic<int> refuse_at{0};
  std::atomic<int> submits{0};
  std::atomic<int> finished{0};
  core::CopyEngine* inner = nullptr;  // the fixture's engine (set by Open)
};

class CacheServiceTest : public ::testing::Test {
 protected:
  void SetUp() override { Open(/*with_ssd=*/false); }
  void TearDown() override { Close(); }

  void Open(bool with_ssd, CacheServiceOptions options = {}) {
    auto cache = core::BlockCache::Create(core::testing::SmallCacheOptions(4 << 20), &metrics_);
    ASSERT_TRUE(cache.ok()) << cache.status();
    cache_ = std::move(*cache);
    if (with_ssd) {
      core::SsdTierOptions ssd;
      ssd.store.directory = dir_.path();
      ssd.store.capacity_bytes = 64 << 20;
      ssd.store.file_count = 1;
      ssd.store.backend = storage::DeviceBackend::kPsync;
      ssd.min_frequency = 0;
      auto tier = core::SsdTier::Create(ssd, cache_.get(), &metrics_);
      ASSERT_TRUE(tier.ok()) << tier.status();
      ssd_ = std::move(*tier);
    }
    auto engine = core::CpuCopyEngine::Create({}, &metrics_);
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = std::move(*engine);
    service_ = std::make_unique<CacheService>(options, cache_.get(), ssd_.get(), &metrics_);
    // The engine's KV: one buffer of kPages pages in this process.
    memory_.assign(kPages * kBlock, 0);
    ASSERT_TRUE(service_->instances().Register(kOwner, kInstance, ns_).ok());
    auto group = std::make_shared<KvGroup>();
    group->num_pages = kPages;
    group->engine = engine_.get();
    if (refusing_ != nullptr) {
      refusing_->inner = engine_.get();
      group->engine = refusing_;
    }
    group->block_bytes = kBlock;
    group->padded_bytes = kBlock;
    auto id = engine_->RegisterBuffer(memory_.data(), memory_.size());
    ASSERT_TRUE(id.ok()) << id.status();
    group->buffers.push_back(KvGroup::Buffer{nullptr, memory_.size(), {memory_.size(), 0, kBlock, kBlock}, *id});
    ASSERT_TRUE((*service_->instances().Find(kOwner, kInstance))->AddGroup(group).ok());
  }
  void Close() {
    if (ssd_) ssd_->Shutdown();
    if (engine_) engine_->Shutdown();
    service_.reset();
    engine_.reset();
    ssd_.reset();
    cache_.reset();
  }

  // Natives of chain `chain`, page i: 8 bytes of chain, 8 of i.
  static std::vector<uint8_t> Natives(uint64_t chain, size_t n) {
    std::vector<uint8_t> natives(n * 16);
    for (uint64_t i = 0; i < n; ++i) {
      std::memcpy(natives.data() + i * 16, &chain, 8);
      std::memcpy(natives.data() + i * 16 + 8, &i, 8);
    }
    return natives;
  }
  channel::QueryRequest QueryOf(uint64_t chain, size_t n) const {
    channel::QueryRequest query;
    query.instance = kInstance;
    query.page_tokens = 16;
    query.native_bytes = 16;
    query.natives = Natives(chain, n);
    return query;
  }
  std::vector<state::StateKey> KeysOf(uint64_t chain, size_t n) const {
    std::vector<state::StateKey> keys;
    const std::vector<uint8_t> natives = Natives(chain, n);
    EXPECT_TRUE(state::StateKey::AppendChain(ns_, 0, 0, 16, natives, 16, 1, &keys).ok());
    return keys;
  }
  uint8_t* Page(uint32_t page) { return memory_.data() + page * kBlock; }
  // Saves pages 0..n-1, stamped with their page number + seed, under chain `chain`.
  channel::SaveReply SaveChain(uint64_t chain, size_t n, uint64_t seed = 0) {
    channel::SaveRequest save;
    save.instance = kInstance;
    const auto keys = KeysOf(chain, n);
    for (uint32_t i = 0; i < n; ++i) {
      core::testing::Stamp(Page(i), kBlock, seed + i);
      save.items.push_back(channel::SaveItem{keys[i], i});
    }
    Captured<channel::SaveReply> saved;
    service_->Save(kOwner, save, saved.Callback());
    Result<channel::SaveReply> reply = saved.Get();
    EXPECT_TRUE(reply.ok()) << reply.status();
    return reply.ok() ? *reply : channel::SaveReply{};
  }
  Result<channel::RestoreReply> RestoreTo(uint64_t lease, std::vector<uint32_t> pages) {
    channel::RestoreRequest restore;
    restore.instance = kInstance;
    restore.lease = lease;
    restore.pages = std::move(pages);
    Captured<channel::RestoreReply> restored;
    service_->Restore(kOwner, restore, restored.Callback());
    return restored.Get();
  }

  testing::TempDir dir_;
  MetricsRegistry metrics_;
  const state::StateNamespace ns_ = state::testing::SampleNamespace();
  std::unique_ptr<core::BlockCache> cache_;
  std::unique_ptr<core::SsdTier> ssd_;
  std::unique_ptr<core::CpuCopyEngine> engine_;
  std::unique_ptr<CacheService> service_;
  std::vector<uint8_t> memory_;
  // When set before Open: the group's copy engine, a fault injector around engine_.
  RefusingEngine* refusing_ = nullptr;
};

TEST_F(CacheServiceTest, SavedBlocksComeBackByteExact) {
  EXPECT_EQ(SaveChain(1, 4, 100), (channel::SaveReply{4, 0}));
  Result<channel::QueryReply> hit = service_->Query(kOwner, QueryOf(1, 6));
  ASSERT_TRUE(hit.ok()) << hit.status();
  EXPECT_EQ(hit->outcome, channel::QueryOutcome::kHit);
  EXPECT_EQ(hit->hits, 4u);
  std::memset(memory_.data(), 0, memory_.size());
  Result<channel::RestoreReply> restored = RestoreTo(hit->lease, {10, 11, channel::kSkipPage, 13});
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->bytes, 3 * kBlock);
  EXPECT_TRUE(core::testing::CheckStamp(Page(10), kBlock, 100));
  EXPECT_TRUE(core::testing::CheckStamp(Page(11), kBlock, 101));
  EXPECT_TRUE(core::testing::CheckStamp(Page(13), kBlock, 103));
  // The restore consumed the lease: its pins and reservation are gone.
  EXPECT_EQ(cache_->GetStats().leases_active, 0u);
  EXPECT_EQ(cache_->GetStats().table.pinned_blocks, 0u);
  EXPECT_FALSE(RestoreTo(hit->lease, {0}).ok());  // a consumed lease is stale
}

// Issue 58: a fixed-span query (kQueryFixedSpan: native keys that name their whole prefix, as
// SGLang's page hashes do) finds pages saved with the same span wherever the query starts, and not
// pages saved under consecutive spans; an ordinary query does not find fixed-span pages past the
// first.
TEST_F(CacheServiceTest, FixedSpanQueriesFindPagesWhereverTheChainStarts) {
  const std::vector<uint8_t> natives = Natives(7, 6);
  std::vector<state::StateKey> fixed;
  ASSERT_TRUE(state::StateKey::AppendChain(ns_, 0, 0, 16, natives, 16, 2, &fixed, /*fixed_span=*/true).ok());
  for (const state::StateKey& key : fixed) EXPECT_EQ(key.span(), (state::TokenRange{0, 16}));
  channel::SaveRequest save;
  save.instance = kInstance;
  for (uint32_t i = 0; i < fixed.size(); ++i) {
    core::testing::Stamp(Page(i), kBlock, 500 + i);
    save.items.push_back(channel::SaveItem{fixed[i], i});
  }
  Captured<channel::SaveReply> saved;
  service_->Save(kOwner, save, saved.Callback());
  ASSERT_TRUE(saved.Get().ok());
  channel::QueryRequest tail = QueryOf(7, 6);
  tail.key_version = 2;
  tail.flags = channel::kQueryFixedSpan;
  tail.natives.erase(tail.natives.begin(), tail.natives.begin() + 3 * 16);  // pages 3..5 alone
  Result<channel::QueryReply> hit = service_->Query(kOwner, tail);
  ASSERT_TRUE(hit.ok()) << hit.status();
  EXPECT_EQ(hit->hits, 3u);
  std::memset(memory_.data(), 0, memory_.size());
  ASSERT_TRUE(RestoreTo(hit->lease, {20, 21, 22}).ok());
  EXPECT_TRUE(core::testing::CheckStamp(Page(20), kBlock, 503));
  EXPECT_TRUE(core::testing::CheckStamp(Page(22), kBlock, 505));
  // Consecutive spans name other keys: only the first page (span [0, 16)) is the same.
  channel::QueryRequest consecutive = QueryOf(7, 6);
  consecutive.key_version = 2;
  hit = service_->Query(kOwner, consecutive);
  ASSERT_TRUE(hit.ok()) << hit.status();
  EXPECT_EQ(hit->hits, 1u);
  EXPECT_TRUE(service_->Release(kOwner, {kInstance, hit->lease}).ok());
}

// More than 4x restore_lead_pages pages: the first restore_lead_pages go to the copy engine at
// once, the rest as a second batch; the reply comes once both drained, every page byte-exact.
TEST_F(CacheServiceTest, ALongRestoreIsTwoBatchesAndComesBackByteExact) {
  Close();
  CacheServiceOptions options;
  options.restore_lead_pages = 2;
  Open(false, options);
  Counter& batches = metrics_.GetCounter("orbitkv_copy_batches_total", "",
                                         {{"engine", "cpu"}, {"direction", "restore"}, {"device", "host"}});
  constexpr size_t kBlocks = 12;
  ASSERT_EQ(SaveChain(1, kBlocks, 300).written, kBlocks);
  Result<channel::QueryReply> hit = service_->Query(kOwner, QueryOf(1, kBlocks));
  ASSERT_TRUE(hit.ok() && hit->hits == kBlocks) << hit.status();
  std::memset(memory_.data(), 0, memory_.size());
  std::vector<uint32_t> pages;
  for (uint32_t i = 0; i < kBlocks; ++i) pages.push_back(i == 5 ? channel::kSkipPage : 16 + i);
  const uint64_t before = batches.Value();
  Result<channel::RestoreReply> restored = RestoreTo(hit->lease, pages);
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(batches.Value(), before + 2);
  EXPECT_EQ(restored->bytes, (kBlocks - 1) * kBlock);
  for (uint32_t i = 0; i < kBlocks; ++i) {
    if (i == 5) {
      EXPECT_TRUE(std::all_of(Page(16 + i), Page(17 + i), [](uint8_t b) { return b == 0; }));
    } else {
      EXPECT_TRUE(core::testing::CheckStamp(Page(16 + i), kBlock, 300 + i)) << "page " << 16 + i;
    }
  }
  EXPECT_EQ(cache_->GetStats().leases_active, 0u);
  EXPECT_EQ(cache_->GetStats().table.pinned_blocks, 0u);
  EXPECT_EQ(service_->operations_active(), 0u);

  // 4x restore_lead_pages pages or fewer, or a rest that is all skipped: one batch.
  hit = service_->Query(kOwner, QueryOf(1, 8));
  ASSERT_TRUE(hit.ok() && hit->hits == 8) << hit.status();
  const uint64_t short_before = batches.Value();
  ASSERT_TRUE(RestoreTo(hit->lease, {0, 1, 2, 3, 4, 5, 6, 7}).ok());
  EXPECT_EQ(batches.Value(), short_before + 1);
  hit = service_->Query(kOwner, QueryOf(1, 10));
  ASSERT_TRUE(hit.ok() && hit->hits == 10) << hit.status();
  std::vector<uint32_t> skipped_rest(10, channel::kSkipPage);
  skipped_rest[0] = 0;
  skipped_rest[1] = 1;
  Result<channel::RestoreReply> lead_only = RestoreTo(hit->lease, skipped_rest);
  ASSERT_TRUE(lead_only.ok()) << lead_only.status();
  EXPECT_EQ(lead_only->bytes, 2 * kBlock);
  EXPECT_EQ(batches.Value(), short_before + 2);
  // A lead that is all skipped: nothing to send ahead, the rest is one batch.
  hit = service_->Query(kOwner, QueryOf(1, 10));
  ASSERT_TRUE(hit.ok() && hit->hits == 10) << hit.status();
  std::vector<uint32_t> skipped_lead = {channel::kSkipPage, channel::kSkipPage};
  for (uint32_t i = 2; i < 10; ++i) skipped_lead.push_back(i);
  Result<channel::RestoreReply> rest_only = RestoreTo(hit->lease, skipped_lead);
  ASSERT_TRUE(rest_only.ok()) << rest_only.status();
  EXPECT_EQ(rest_only->bytes, 8 * kBlock);
  EXPECT_EQ(batches.Value(), short_before + 3);
  EXPECT_EQ(cache_->GetStats().table.pinned_blocks, 0u);
}

// The copy engine refuses a long restore's second batch: the restore fails with that error, and
// only once its first batch drained (its pins cover that copy); the lease and the operation's slot
// go back. Refused at the first batch, the second is never built or submitted.
TEST_F(CacheServiceTest, ALongRestoreWhoseSecondBatchIsRefusedFailsAfterTheFirstDrained) {
  for (const int refuse_at : {2, 1}) {
    SCOPED_TRACE(refuse_at);
    Close();
    RefusingEngine refusing;
    refusing_ = &refusing;
    CacheServiceOptions options;
    options.restore_lead_pages = 2;
    Open(false, options);
    ASSERT_EQ(SaveChain(1, 12).written, 12u);
    Result<channel::QueryReply> hit = service_->Query(kOwner, QueryOf(1, 12));
    ASSERT_TRUE(hit.ok() && hit->hits == 12) << hit.status();
    const int submits = refusing.submits.load();  // the save's
    refusing.refuse_at = submits + refuse_at;
    channel::RestoreRequest restore;
    restore.instance = kInstance;
    restore.lease = hit->lease;
    for (uint32_t i = 0; i < 12; ++i) restore.pages.push_back(16 + i);
    std::promise<std::pair<Status, int>> replied;
    service_->Restore(kOwner, restore, [&](Result<channel::RestoreReply> reply) {
      replied.set_value({reply.status(), refusing.finished.load()});
    });
    auto reply = replied.get_future();
    ASSERT_EQ(reply.wait_for(10s), std::future_status::ready);
    const auto [status, finished_at_reply] = reply.get();
    EXPECT_EQ(status.code(), StatusCode::kResourceExhausted) << status;
    EXPECT_EQ(refusing.submits.load() - submits, refuse_at);
    // Every batch it accepted (the save's, and the lead when the rest was refused) had drained.
    EXPECT_EQ(finished_at_reply, refusing.submits.load() - 1);
    EXPECT_EQ(cache_->GetStats().leases_active, 0u);
    EXPECT_EQ(cache_->GetStats().table.pinned_blocks, 0u);
    EXPECT_EQ(service_->operations_active(), 0u);
    Close();
    refusing_ = nullptr;
  }
  Open(false);
}

TEST_F(CacheServiceTest, SaveSkipsBlocksAlreadyResidentAndRefusesForeignKeys) {
  EXPECT_EQ(SaveChain(1, 3), (channel::SaveReply{3, 0}));
  EXPECT_EQ(SaveChain(1, 5), (channel::SaveReply{2, 3}));  // the first three are resident
  Captured<channel::SaveReply> refused;
  std::vector<state::StateKey> keys;
  const std::vector<uint8_t> natives = Natives(3, 1);
  state::Digest256 digest;
  digest.bytes[0] = 0xee;
  ASSERT_TRUE(state::StateKey::AppendChain(state::StateNamespace(digest), 0, 0, 16, natives, 16, 1, &keys).ok());
  channel::SaveRequest foreign;
  foreign.instance = kInstance;
  foreign.items.push_back(channel::SaveItem{keys[0], 0});
  service_->Save(kOwner, foreign, refused.Callback());
  EXPECT_EQ(refused.Get().status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(service_->operations_active(), 0u);
}

TEST_F(CacheServiceTest, OnlyTheOwnerUsesItsInstance) {
  SaveChain(1, 2);
  EXPECT_EQ(service_->Query(kOwner + 1, QueryOf(1, 2)).status().code(), StatusCode::kPermissionDenied);
  channel::QueryRequest other_group = QueryOf(1, 2);
  other_group.group = 3;
  EXPECT_EQ(service_->Query(kOwner, other_group).status().code(), StatusCode::kNotFound);
  Result<channel::QueryReply> hit = service_->Query(kOwner, QueryOf(1, 2));
  ASSERT_TRUE(hit.ok());
  EXPECT_EQ(service_->Release(kOwner + 1, {kInstance, hit->lease}).code(), StatusCode::kPermissionDenied);
  EXPECT_TRUE(service_->Release(kOwner, {kInstance, hit->lease}).ok());
  EXPECT_EQ(service_->Query(kOwner, QueryOf(2, 2))->outcome, channel::QueryOutcome::kMiss);
}

TEST_F(CacheServiceTest, RestoreOutOfRangeIsRefusedAndTheLeaseEnds) {
  SaveChain(1, 2);
  Result<channel::QueryReply> hit = service_->Query(kOwner, QueryOf(1, 2));
  ASSERT_TRUE(hit.ok());
  EXPECT_EQ(RestoreTo(hit->lease, {0, kPages}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache_->GetStats().table.pinned_blocks, 0u);
  EXPECT_EQ(service_->operations_active(), 0u);
}

TEST_F(CacheServiceTest, MaxOperationsBoundsCopiesInFlight) {
  Close();
  CacheServiceOptions options;
  options.max_operations = 0;
  Open(false, options);
  channel::SaveRequest save;
  save.instance = kInstance;
  save.items.push_back(channel::SaveItem{KeysOf(1, 1)[0], 0});
  Captured<channel::SaveReply> saved;
  service_->Save(kOwner, save, saved.Callback());
  EXPECT_EQ(saved.Get().status().code(), StatusCode::kResourceExhausted);
}

// A restore refused because too many copies are in flight releases its lease: an engine that gave
// up on it (a stopped Manager's backlog after kill -CONT) never leaves blocks pinned.
TEST_F(CacheServiceTest, ARestoreThatCannotStartReleasesItsLease) {
  Close();
  CacheServiceOptions options;
  options.max_operations = 0;
  Open(false, options);
  {  // blocks put into the cache directly (saves are refused too at max_operations 0)
    std::vector<core::BlockWriter> writers;
    for (const state::StateKey& key : KeysOf(1, 2)) {
      Result<core::BlockWriter> writer = cache_->Prepare(key, kBlock);
      ASSERT_TRUE(writer.ok()) << writer.status();
      writers.push_back(std::move(*writer));
    }
    cache_->SealAll(writers);
  }
  Result<channel::QueryReply> hit = service_->Query(kOwner, QueryOf(1, 2));
  ASSERT_TRUE(hit.ok() && hit->hits == 2) << hit.status();
  EXPECT_EQ(cache_->GetStats().leases_active, 1u);
  EXPECT_EQ(RestoreTo(hit->lease, {0, 1}).status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(cache_->GetStats().leases_active, 0u);
  EXPECT_EQ(cache_->GetStats().table.pinned_blocks, 0u);
}

// The prefix continues on SSD: the query answers Loading, the op's completion is delivered to a
// waiter, and the next query leases the whole prefix.
TEST_F(CacheServiceTest, QueryLoadsFromSsdAndTheWaiterHearsWhenItIsDone) {
  Close();
  Open(/*with_ssd=*/true);
  SaveChain(1, 6, 500);
  cache_->table().EvictBytes(64 << 20);
  ssd_->Flush();
  Result<channel::QueryReply> loading = service_->Query(kOwner, QueryOf(1, 6));
  ASSERT_TRUE(loading.ok()) << loading.status();
  ASSERT_EQ(loading->outcome, channel::QueryOutcome::kLoading);
  // The waiter registers before any query can take the op (it is answered at once if the op already
  // ended).
  Captured<channel::WaitLoadingReply> waited;
  service_->WaitLoading(kOwner, {kInstance, loading->loading_op, 5000}, waited.Callback());
  // Asking again while it runs names the same op; the SSD reads may also have finished by now (they
  // run on the tier's own threads), and then the query leases the whole prefix at once.
  Result<channel::QueryReply> again = service_->Query(kOwner, QueryOf(1, 6));
  ASSERT_TRUE(again.ok()) << again.status();
  const bool still_loading = again->outcome == channel::QueryOutcome::kLoading;
  if (still_loading) {
    EXPECT_EQ(again->loading_op, loading->loading_op);
  }
  Result<channel::WaitLoadingReply> done = waited.Get();
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->resident, 6u);
  Result<channel::QueryReply> hit = again;
  if (still_loading) {
    EXPECT_EQ(service_->loading().held_blocks(), 6u);  // held for the engine's next query
    hit = service_->Query(kOwner, QueryOf(1, 6));
  }
  ASSERT_TRUE(hit.ok());
  ASSERT_EQ(hit->outcome, channel::QueryOutcome::kHit);
  EXPECT_EQ(hit->hits, 6u);
  EXPECT_EQ(service_->loading().held_blocks(), 0u);  // the lease holds them now
  std::memset(memory_.data(), 0, memory_.size());
  ASSERT_TRUE(RestoreTo(hit->lease, {0, 1, 2, 3, 4, 5}).ok());
  for (uint32_t i = 0; i < 6; ++i) EXPECT_TRUE(core::testing::CheckStamp(Page(i), kBlock, 500 + i));
  // A waiter on an op that is gone hears NotFound (ask the query again).
  Captured<channel::WaitLoadingReply> gone;
  service_->WaitLoading(kOwner, {kInstance, loading->loading_op, 100}, gone.Callback());
  EXPECT_EQ(gone.Get().status().code(), StatusCode::kNotFound);
}

TEST_F(CacheServiceTest, AnsweredQueriesCountTheirBlocksByTheTierThatServedThem) {
  Close();
  Open(/*with_ssd=*/true);
  auto counted = [&](const char* tier) {
    return metrics_.GetCounter("orbitkv_query_hit_blocks_total", "", {{"tier", tier}}).Value();
  };
  auto missed = [&] { return metrics_.GetCounter("orbitkv_query_missed_blocks_total", "").Value(); };
  SaveChain(1, 6, 700);
  cache_->table().EvictBytes(64 << 20);
  ssd_->Flush();
  SaveChain(1, 2, 700);  // the first two are back in DRAM; the next four are only on SSD
  // Eight asked: two in DRAM, four on SSD, two nowhere.
  Result<channel::QueryReply> loading = service_->Query(kOwner, QueryOf(1, 8));
  ASSERT_TRUE(loading.ok()) << loading.status();
  ASSERT_EQ(loading->outcome, channel::QueryOutcome::kLoading);
  EXPECT_EQ(counted("dram") + counted("ssd") + missed(),
            0u);  // a Loading answer counts nothing yet
  Captured<channel::WaitLoadingReply> waited;
  service_->WaitLoading(kOwner, {kInstance, loading->loading_op, 5000}, waited.Callback());
  ASSERT_TRUE(waited.Get().ok());
  Result<channel::QueryReply> hit = service_->Query(kOwner, QueryOf(1, 8));
  ASSERT_TRUE(hit.ok());
  ASSERT_EQ(hit->outcome, channel::QueryOutcome::kHit);
  ASSERT_EQ(hit->hits, 6u);
  EXPECT_EQ(counted("dram"), 2u);
  EXPECT_EQ(counted("ssd"), 4u);
  EXPECT_EQ(counted("remote"), 0u);
  EXPECT_EQ(missed(), 2u);
  Histogram& restore_seconds =
      metrics_.GetHistogram("orbitkv_restore_seconds", "", Histogram::ExponentialBounds(1e-5, 2, 20));
  Histogram& submit_seconds =
      metrics_.GetHistogram("orbitkv_restore_submit_seconds", "", Histogram::ExponentialBounds(1e-6, 2, 20));
  const uint64_t restores = restore_seconds.Count();
  const uint64_t submits = submit_seconds.Count();
  ASSERT_TRUE(RestoreTo(hit->lease, {0, 1, 2, 3, 4, 5}).ok());
  EXPECT_EQ(restore_seconds.Count(), restores + 1);
  // The submission is the start of the same restore: counted once, never longer than the whole.
  EXPECT_EQ(submit_seconds.Count(), submits + 1);
  EXPECT_GT(submit_seconds.Sum(), 0.0);
  EXPECT_LE(submit_seconds.Sum(), restore_seconds.Sum());
  EXPECT_GE(metrics_.GetHistogram("orbitkv_save_seconds", "", Histogram::ExponentialBounds(1e-5, 2, 20)).Count(), 2u);
  // Asked again, the whole prefix is in DRAM now.
  Result<channel::QueryReply> warm = service_->Query(kOwner, QueryOf(1, 8));
  ASSERT_TRUE(warm.ok());
  ASSERT_EQ(warm->outcome, channel::QueryOutcome::kHit);
  EXPECT_EQ(counted("dram"), 8u);
  EXPECT_EQ(counted("ssd"), 4u);
  EXPECT_EQ(missed(), 4u);
  ASSERT_TRUE(service_->Release(kOwner, {kInstance, warm->lease}).ok());
}

// A waiting engine restores a remote stage's blocks while the rest arrive: a partial query leases
// the prefix in DRAM while the op runs, a progress waiter hears of each batch, and the chain's
// final answer (the only one counted) leases it all.
TEST_F(CacheServiceTest, PartialQueriesLeaseWhatArrivedWhileTheRemoteStageRuns) {
  std::vector<LoadingStage::Done> done;
  std::vector<LoadingStage::Progress> progress;
  std::vector<size_t> spans;
  service_->SetRemoteStage([&](std::vector<state::StateKey> keys) -> std::optional<LoadingStage> {
    LoadingStage stage;
    stage.name = "remote";
    stage.span = keys.size();
    spans.push_back(keys.size());
    stage.start = [&](LoadingStage::Done d, LoadingStage::Progress p) {
      done.push_back(std::move(d));
      progress.push_back(std::move(p));
      return Status::Ok();
    };
    return stage;
  });
  auto counted = [&](const char* tier) {
    return metrics_.GetCounter("orbitkv_query_hit_blocks_total", "", {{"tier", tier}}).Value();
  };
  SaveChain(1, 2, 900);  // two in DRAM; the next four "on a peer"
  Result<channel::QueryReply> loading = service_->Query(kOwner, QueryOf(1, 6));
  ASSERT_TRUE(loading.ok()) << loading.status();
  ASSERT_EQ(loading->outcome, channel::QueryOutcome::kLoading);
  ASSERT_EQ(spans, std::vector<size_t>{6});  // the remote stage pins the resident front itself
  channel::QueryRequest partial = QueryOf(1, 6);
  partial.flags = channel::kQueryPartial;
  Result<channel::QueryReply> first = service_->Query(kOwner, partial);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_EQ(first->outcome, channel::QueryOutcome::kPartial);
  EXPECT_EQ(first->hits, 2u);
  std::memset(memory_.data(), 0, memory_.size());
  ASSERT_TRUE(RestoreTo(first->lease, {0, 1}).ok());
  // A batch of two arrives: a waiter for three hears four (not completed).
  Captured<channel::WaitLoadingReply> three;
  service_->WaitLoading(kOwner, {kInstance, loading->loading_op, 5000, 3}, three.Callback());
  SaveChain(1, 4, 900);  // what the stage's batch sealed
  ASSERT_EQ(progress.size(), 1u);
  progress[0](4);  // the stage's front two and its first batch
  Result<channel::WaitLoadingReply> heard = three.Get();
  ASSERT_TRUE(heard.ok()) << heard.status();
  EXPECT_EQ(heard->resident, 4u);
  EXPECT_FALSE(heard->completed);
  Result<channel::QueryReply> second = service_->Query(kOwner, partial);
  ASSERT_TRUE(second.ok());
  ASSERT_EQ(second->outcome, channel::QueryOutcome::kPartial);
  EXPECT_EQ(second->hits, 4u);
  ASSERT_TRUE(RestoreTo(second->lease, {channel::kSkipPage, channel::kSkipPage, 2, 3}).ok());
  // An ordinary query still hears Loading (the vLLM connector's single shot).
  Result<channel::QueryReply> plain = service_->Query(kOwner, QueryOf(1, 6));
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->outcome, channel::QueryOutcome::kLoading);
  EXPECT_EQ(plain->loading_op, loading->loading_op);
  EXPECT_EQ(counted("dram") + counted("remote"), 0u);  // partial answers count nothing
  // The stage completes: the final answer leases all six and counts them by tier.
  SaveChain(1, 6, 900);
  std::vector<core::BlockPin> pins;
  const std::vector<state::StateKey> keys = KeysOf(1, 6);
  ASSERT_EQ(cache_->table().PinPrefix(keys, &pins), 6u);
  Captured<channel::WaitLoadingReply> completed;
  service_->WaitLoading(kOwner, {kInstance, loading->loading_op, 5000, 5}, completed.Callback());
  done[0](std::move(pins));
  ASSERT_TRUE(completed.Get()->completed);
  Result<channel::QueryReply> last = service_->Query(kOwner, partial);
  ASSERT_TRUE(last.ok());
  ASSERT_EQ(last->outcome, channel::QueryOutcome::kHit);
  EXPECT_EQ(last->hits, 6u);
  ASSERT_TRUE(
      RestoreTo(last->lease, {channel::kSkipPage, channel::kSkipPage, channel::kSkipPage, channel::kSkipPage, 4, 5})
          .ok());
  for (uint32_t i = 0; i < 6; ++i) EXPECT_TRUE(core::testing::CheckStamp(Page(i), kBlock, 900 + i));
  EXPECT_EQ(counted("dram"), 2u);
  EXPECT_EQ(counted("remote"), 4u);
  EXPECT_EQ(service_->Stats().partial_answers, 2u);
  EXPECT_EQ(service_->loading().held_blocks(), 0u);
  EXPECT_EQ(cache_->GetStats().table.pinned_blocks, 0u);
}

TEST_F(CacheServiceTest, CancelForgetsTheOpAndItsWaitersHearIt) {
  Close();
  Open(/*with_ssd=*/true);
  SaveChain(1, 4);
  cache_->table().EvictBytes(64 << 20);
  ssd_->Flush();
  Result<channel::QueryReply> loading = service_->Query(kOwner, QueryOf(1, 4));
  ASSERT_EQ(loading->outcome, channel::QueryOutcome::kLoading);
  EXPECT_EQ(service_->Cancel(kOwner, {kInstance, loading->loading_op}).value(), true);
  EXPECT_EQ(service_->Cancel(kOwner, {kInstance, loading->loading_op}).value(), false);  // gone: nothing to cancel
  EXPECT_EQ(service_->Cancel(kOwner, {kInstance + 1, loading->loading_op}).status().code(), StatusCode::kNotFound);
  // What the reads brought stays cached; nothing is left pinned.
  ssd_->Flush();
  EXPECT_EQ(service_->loading().held_blocks(), 0u);
}

// Engine memory that vanishes under a save fails that save, seals nothing, and reports the owner
// so the Manager can poison its sessions; the service goes on serving.
TEST_F(CacheServiceTest, EngineMemoryThatVanishesFailsTheSaveAndReportsTheOwner) {
  Close();
  std::vector<std::pair<uint64_t, Status>> faults;
  std::mutex faults_mu;
  CacheServiceOptions options;
  options.on_engine_fault = [&](uint64_t owner, const Status& why) {
    std::lock_guard<std::mutex> lock(faults_mu);
    faults.emplace_back(owner, why);
  };
  Open(false, options);
  // A second group over a mapping whose file is then truncated (the fault injected directly: the
  // Manager itself only maps sealed memfds).
  constexpr uint64_t kBytes = 4 * kBlock;
  ScopedFd fd(memfd_create("vanishing", MFD_CLOEXEC));
  ASSERT_EQ(ftruncate(fd.get(), kBytes), 0);
  auto* mapped = static_cast<uint8_t*>(mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0));
  ASSERT_NE(mapped, MAP_FAILED);
  auto group = std::make_shared<KvGroup>();
  group->group = 1;
  group->num_pages = 4;
  group->engine = engine_.get();
  group->block_bytes = kBlock;
  group->padded_bytes = kBlock;
  auto id = engine_->RegisterBuffer(mapped, kBytes);
  ASSERT_TRUE(id.ok());
  group->buffers.push_back(KvGroup::Buffer{nullptr, kBytes, {kBytes, 0, kBlock, kBlock}, *id});
  ASSERT_TRUE((*service_->instances().Find(kOwner, kInstance))->AddGroup(group).ok());
  ASSERT_EQ(ftruncate(fd.get(), 0), 0);
  std::vector<state::StateKey> keys;
  const std::vector<uint8_t> natives = Natives(40, 2);
  ASSERT_TRUE(state::StateKey::AppendChain(ns_, 1, 0, 16, natives, 16, 1, &keys).ok());
  channel::SaveRequest save;
  save.instance = kInstance;
  save.group = 1;
  save.items = {{keys[0], 0}, {keys[1], 1}};
  Captured<channel::SaveReply> saved;
  service_->Save(kOwner, save, saved.Callback());
  EXPECT_EQ(saved.Get().status().code(), StatusCode::kDataLoss);
  {
    std::lock_guard<std::mutex> lock(faults_mu);
    ASSERT_EQ(faults.size(), 1u);
    EXPECT_EQ(faults[0].first, kOwner);
  }
  channel::QueryRequest query = QueryOf(40, 2);
  query.group = 1;
  EXPECT_EQ(service_->Query(kOwner, query)->outcome, channel::QueryOutcome::kMiss);  // not sealed
  EXPECT_EQ(SaveChain(1, 2), (channel::SaveReply{2, 0}));                            // the healthy group still works
  engine_->Shutdown();
  munmap(mapped, kBytes);
}

// ---- LoadingRegistry on its own: stages, deadlines, races, hold ----

class LoadingRegistryTest : public ::testing::Test {
 protected:
  LoadingRegistryTest() {
    auto cache = core::BlockCache::Create(core::testing::SmallCacheOptions(), &metrics_);
    EXPECT_TRUE(cache.ok());
    cache_ = std::move(*cache);
  }
  // A resident block pinned: what a stage reports.
  core::BlockPin Pinned(uint64_t i) {
    auto writer = cache_->Prepare(core::testing::ChainKey(77, i), 4096);
    EXPECT_TRUE(writer.ok()) << writer.status();
    core::BlockPin pin;
    cache_->Seal(*writer, core::TransitionCause::kAdmit, &pin);
    return pin;
  }
  std::vector<core::BlockPin> Pins(uint64_t first, size_t n) {
    std::vector<core::BlockPin> pins;
    for (size_t i = 0; i < n; ++i) pins.push_back(Pinned(first + i));
    return pins;
  }
  // A stage that hands its completion to the test.
  // `progress`, when given, receives the stage's progress reporter.
  LoadingStage Manual(size_t span, std::chrono::milliseconds deadline, std::vector<LoadingStage::Done>* started,
                      std::vector<LoadingStage::Progress>* progress = nullptr) {
    LoadingStage stage;
    stage.name = "manual";
    stage.span = span;
    stage.deadline = deadline;
    stage.start = [started, progress](LoadingStage::Done done, LoadingStage::Progress report) {
      started->push_back(std::move(done));
      if (progress != nullptr) progress->push_back(std::move(report));
      return Status::Ok();
    };
    return stage;
  }
  uint64_t pinned() { return cache_->GetStats().table.pinned_blocks; }

  MetricsRegistry metrics_;
  std::unique_ptr<core::BlockCache> cache_;
  const LoadingChain chain_{1, 0, 99};
};

TEST_F(LoadingRegistryTest, StagesRunInOrderAndTheOpCompletesAfterTheLast) {
  LoadingRegistry registry({}, &metrics_);
  std::vector<LoadingStage::Done> first, second;
  std::vector<LoadingStage> stages;
  stages.push_back(Manual(2, 10s, &first));
  stages.push_back(Manual(3, 10s, &second));
  Result<uint64_t> op = registry.Start(kOwner, chain_, std::move(stages));
  ASSERT_TRUE(op.ok());
  ASSERT_EQ(first.size(), 1u);
  EXPECT_TRUE(second.empty());  // not before the first stage completed
  Result<LoadingState> resident = Status::Unknown("not answered");
  registry.Wait(chain_.instance, *op, Deadline::After(10s), [&](Result<LoadingState> r) { resident = std::move(r); });
  first[0](Pins(0, 2));
  ASSERT_EQ(second.size(), 1u);
  EXPECT_FALSE(registry.Completed(chain_));
  EXPECT_EQ(resident.status().code(), StatusCode::kUnknown);
  second[0](Pins(2, 3));
  EXPECT_TRUE(registry.Completed(chain_));
  ASSERT_TRUE(resident.ok());
  EXPECT_EQ(resident->resident, 5u);
  EXPECT_TRUE(resident->completed);
  EXPECT_EQ(registry.held_blocks(), 5u);
  EXPECT_EQ(pinned(), 5u);
  registry.Forget(chain_);
  EXPECT_EQ(pinned(), 0u);
  EXPECT_EQ(registry.running(), 0u);
}

TEST_F(LoadingRegistryTest, AProgressWaiterHearsOfTheRunningStagesBlocksAndACompletionWaiterDoesNot) {
  LoadingRegistry registry({}, &metrics_);
  std::vector<LoadingStage::Done> first, second;
  std::vector<LoadingStage::Progress> progress;
  std::vector<LoadingStage> stages;
  stages.push_back(Manual(2, 10s, &first));
  stages.push_back(Manual(6, 10s, &second, &progress));
  Result<uint64_t> op = registry.Start(kOwner, chain_, std::move(stages));
  ASSERT_TRUE(op.ok());
  Result<LoadingState> at_three = Status::Unknown(""), at_eight = Status::Unknown(""), done = Status::Unknown("");
  registry.Wait(
      chain_.instance, *op, Deadline::After(10s), [&](Result<LoadingState> r) { at_three = std::move(r); }, 3);
  registry.Wait(
      chain_.instance, *op, Deadline::After(10s), [&](Result<LoadingState> r) { at_eight = std::move(r); }, 8);
  registry.Wait(chain_.instance, *op, Deadline::After(10s), [&](Result<LoadingState> r) { done = std::move(r); });
  first[0](Pins(0, 2));
  EXPECT_EQ(at_three.status().code(), StatusCode::kUnknown);  // 2 of the chain so far
  ASSERT_EQ(progress.size(), 1u);
  progress[0](1);  // the second stage's first block: 3 of the chain
  ASSERT_TRUE(at_three.ok()) << at_three.status();
  EXPECT_EQ(at_three->resident, 3u);
  EXPECT_FALSE(at_three->completed);
  EXPECT_EQ(at_eight.status().code(), StatusCode::kUnknown);
  EXPECT_EQ(done.status().code(), StatusCode::kUnknown);
  EXPECT_TRUE(registry.Running(chain_));
  progress[0](0);   // never backwards
  progress[0](40);  // never past the span
  ASSERT_TRUE(at_eight.ok());
  EXPECT_EQ(at_eight->resident, 8u);
  EXPECT_FALSE(at_eight->completed);
  // A waiter asking for what is already there hears at once; a completion waiter still waits.
  Result<LoadingState> now = Status::Unknown("");
  registry.Wait(
      chain_.instance, *op, Deadline::After(10s), [&](Result<LoadingState> r) { now = std::move(r); }, 5);
  ASSERT_TRUE(now.ok());
  EXPECT_EQ(now->resident, 8u);
  EXPECT_EQ(done.status().code(), StatusCode::kUnknown);
  second[0](Pins(2, 6));
  ASSERT_TRUE(done.ok());
  EXPECT_EQ(done->resident, 8u);
  EXPECT_TRUE(done->completed);
  EXPECT_FALSE(registry.Running(chain_));
  progress[0](6);  // a report after the stage completed changes nothing
  EXPECT_EQ(registry.held_blocks(), 8u);
  registry.Forget(chain_);
  EXPECT_EQ(pinned(), 0u);
}

TEST_F(LoadingRegistryTest, AShortStageStopsThePrefixThere) {
  LoadingRegistry registry({}, &metrics_);
  std::vector<LoadingStage::Done> first, second;
  std::vector<LoadingStage> stages;
  stages.push_back(Manual(4, 10s, &first));
  stages.push_back(Manual(3, 10s, &second));
  ASSERT_TRUE(registry.Start(kOwner, chain_, std::move(stages)).ok());
  first[0](Pins(0, 2));  // two of four
  EXPECT_TRUE(second.empty());
  EXPECT_TRUE(registry.Completed(chain_));
  EXPECT_EQ(registry.held_blocks(), 2u);
}

TEST_F(LoadingRegistryTest, AStagePastItsDeadlineCompletesTheOpWithWhatArrived) {
  LoadingRegistry registry({}, &metrics_);
  std::vector<LoadingStage::Done> first, second;
  std::vector<LoadingStage> stages;
  stages.push_back(Manual(2, 10s, &first));
  stages.push_back(Manual(3, 1ms, &second));
  Result<uint64_t> op = registry.Start(kOwner, chain_, std::move(stages));
  first[0](Pins(0, 2));
  ASSERT_EQ(second.size(), 1u);
  std::this_thread::sleep_for(5ms);
  registry.Sweep();
  EXPECT_TRUE(registry.Completed(chain_));
  EXPECT_EQ(registry.held_blocks(), 2u);
  // The late stage's pins are let go when they come.
  second[0](Pins(2, 3));
  EXPECT_EQ(registry.held_blocks(), 2u);
  EXPECT_EQ(pinned(), 2u);
}

TEST_F(LoadingRegistryTest, CancelWhileAStageRunsReleasesItsLatePinsAndAbortsWaiters) {
  LoadingRegistry registry({}, &metrics_);
  std::vector<LoadingStage::Done> first;
  std::vector<LoadingStage> stages;
  stages.push_back(Manual(3, 10s, &first));
  Result<uint64_t> op = registry.Start(kOwner, chain_, std::move(stages));
  ASSERT_TRUE(op.ok());
  Result<LoadingState> heard = Status::Unknown("");
  registry.Wait(chain_.instance, *op, Deadline::After(10s), [&](Result<LoadingState> r) { heard = std::move(r); });
  EXPECT_FALSE(registry.Cancel(chain_.instance + 1, *op));  // not this instance's
  EXPECT_TRUE(registry.Cancel(chain_.instance, *op));
  EXPECT_EQ(heard.status().code(), StatusCode::kAborted);
  first[0](Pins(0, 3));  // the reads drained after the cancel
  EXPECT_EQ(pinned(), 0u);
  EXPECT_EQ(registry.held_blocks(), 0u);
  // The same chain starts a fresh op.
  std::vector<LoadingStage> again;
  again.push_back(Manual(3, 10s, &first));
  Result<uint64_t> next = registry.Start(kOwner, chain_, std::move(again));
  ASSERT_TRUE(next.ok());
  EXPECT_NE(*next, *op);
}

TEST_F(LoadingRegistryTest, CancelRacingTheStageCompletionLeavesNothingPinned) {
  for (int round = 0; round < 50; ++round) {
    LoadingRegistry registry({}, &metrics_);
    std::vector<LoadingStage::Done> first;
    std::vector<LoadingStage> stages;
    stages.push_back(Manual(2, 10s, &first));
    Result<uint64_t> op = registry.Start(kOwner, chain_, std::move(stages));
    ASSERT_TRUE(op.ok());
    std::vector<core::BlockPin> pins = Pins(round * 2, 2);
    std::thread completer([&] { first[0](std::move(pins)); });
    (void)registry.Cancel(chain_.instance, *op);
    completer.join();
    EXPECT_EQ(registry.held_blocks(), 0u);
    registry.Forget(chain_);
    EXPECT_EQ(pinned(), 0u) << "round " << round;
  }
}

TEST_F(LoadingRegistryTest, HeldBlocksExpireAfterTheHold) {
  LoadingRegistry::Options options;
  options.hold = 10ms;
  LoadingRegistry registry(options, &metrics_);
  std::vector<LoadingStage::Done> first;
  std::vector<LoadingStage> stages;
  stages.push_back(Manual(2, 10s, &first));
  ASSERT_TRUE(registry.Start(kOwner, chain_, std::move(stages)).ok());
  first[0](Pins(0, 2));
  EXPECT_EQ(pinned(), 2u);
  std::this_thread::sleep_for(20ms);
  registry.Sweep();
  EXPECT_EQ(pinned(), 0u);
  EXPECT_FALSE(registry.Completed(chain_));
}

TEST_F(LoadingRegistryTest, AWaiterPastItsDeadlineHearsDeadlineExceededAndTheSweeperIsWoken) {
  int wakes = 0;
  LoadingRegistry::Options options;
  options.wake_sweeper = [&] { ++wakes; };
  LoadingRegistry registry(options, &metrics_);
  std::vector<LoadingStage::Done> first;
  std::vector<LoadingStage> stages;
  stages.push_back(Manual(2, 10s, &first));
  Result<uint64_t> op = registry.Start(kOwner, chain_, std::move(stages));
  const int after_start = wakes;
  EXPECT_GE(after_start, 1);  // the stage deadline is new work for the sweeper
  Result<LoadingState> heard = Status::Unknown("");
  registry.Wait(chain_.instance, *op, Deadline::After(1ms), [&](Result<LoadingState> r) { heard = std::move(r); });
  EXPECT_GT(wakes, after_start);  // an earlier deadline than the stage's
  std::this_thread::sleep_for(5ms);
  registry.Sweep();
  EXPECT_EQ(heard.status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_FALSE(registry.Completed(chain_));  // the op itself runs on
  first[0](Pins(0, 2));
  EXPECT_TRUE(registry.Completed(chain_));
}

TEST_F(LoadingRegistryTest, MaxPerOwnerAndAFailedFirstStage) {
  LoadingRegistry::Options options;
  options.max_per_owner = 1;
  LoadingRegistry registry(options, &metrics_);
  std::vector<LoadingStage::Done> first;
  std::vector<LoadingStage> stages;
  stages.push_back(Manual(1, 10s, &first));
  ASSERT_TRUE(registry.Start(kOwner, chain_, std::move(stages)).ok());
  std::vector<LoadingStage> more;
  more.push_back(Manual(1, 10s, &first));
  EXPECT_EQ(registry.Start(kOwner, {1, 0, 100}, std::move(more)).status().code(), StatusCode::kResourceExhausted);
  registry.Forget(chain_);
  LoadingStage failing;
  failing.span = 1;
  failing.start = [](LoadingStage::Done, LoadingStage::Progress) {
    return Status::Unavailable("the tier is stopping");
  };
  std::vector<LoadingStage> bad;
  bad.push_back(std::move(failing));
  EXPECT_EQ(registry.Start(kOwner, chain_, std::move(bad)).status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(registry.running(), 0u);
  EXPECT_EQ(metrics_.GetGauge("orbitkv_loading_active", "").Value(), 0);
}

}  // namespace
}  // namespace orbitkv::server
