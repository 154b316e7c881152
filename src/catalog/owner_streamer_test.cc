// OwnerStreamer against a real ResidencyInventory and a CatalogStore, over an in-process transport that
// can lose, duplicate and reorder messages or fail outright: after any of it the catalog's slice
// converges to exactly the owner's inventory.
#include "catalog/owner_streamer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <random>
#include <set>
#include <thread>
#include <tuple>

#include "catalog/catalog_store.h"
#include "core/test_util.h"

namespace orbitkv::catalog {
namespace {

constexpr uint32_t kShard = 0;

// Delivers straight to a CatalogStore, with faults on demand (the real gRPC transport cannot lose or
// reorder a message at will).
class InProcessTransport final : public CatalogTransport {
 public:
  explicit InProcessTransport(CatalogStore* store) : store_(store) {}
  void set_store(CatalogStore* store) { store_ = store; }
  double drop = 0, duplicate = 0, hold = 0;  // probabilities: lose it, deliver twice, deliver later
  bool unavailable = false;
  std::function<void()> on_page;  // runs before each snapshot page is delivered
  uint64_t delivered = 0;

  Result<CatalogReply> Deliver(const std::string&, const CatalogMessage& message) override {
    if (unavailable) return Status::Unavailable("catalog host unreachable");
    if (on_page && std::holds_alternative<SnapshotPage>(message)) on_page();
    std::uniform_real_distribution<double> coin(0, 1);
    if (coin(rng_) < hold && std::holds_alternative<DeltaBatch>(message)) {
      held_.push_back(message);  // delivered after a later message: reordered
      return Status::DeadlineExceeded("no reply in time");
    }
    if (coin(rng_) < drop) return Status::DeadlineExceeded("lost");
    CatalogReply reply = Send(message);
    if (coin(rng_) < duplicate) reply = Send(message);
    while (!held_.empty()) {
      (void)Send(held_.front());
      held_.pop_front();
    }
    return reply;
  }

 private:
  CatalogReply Send(const CatalogMessage& message) {
    ++delivered;
    return store_->Handle(message);
  }
  CatalogStore* store_;
  std::mt19937_64 rng_{7};
  std::deque<CatalogMessage> held_;
};

// Random residency churn on one shard, tracking what is present (Apply CHECKs removals).
class Churn {
 public:
  explicit Churn(core::ResidencyInventory* inventory, uint64_t seed) : inventory_(inventory), rng_(seed) {}
  void Run(int changes) {
    for (int i = 0; i < changes; ++i) {
      const uint64_t k = rng_() % 400;
      const state::StateKey key = core::testing::ChainKey(11, k);
      if (present_.count(k) != 0 && rng_() % 3 != 0) {
        inventory_->Apply(kShard, key, core::Tier::kDram, false, core::TransitionCause::kEvict, 1, 4096);
        present_.erase(k);
      } else if (present_.count(k) != 0) {
        inventory_->Apply(kShard, key, core::Tier::kDram, true, core::TransitionCause::kReplace, ++generation_, 4096);
      } else {
        inventory_->Apply(kShard, key, core::Tier::kDram, true, core::TransitionCause::kAdmit, ++generation_, 4096);
        present_.insert(k);
      }
    }
  }

 private:
  core::ResidencyInventory* inventory_;
  std::mt19937_64 rng_;
  std::set<uint64_t> present_;
  uint64_t generation_ = 1;
};

std::unique_ptr<core::ResidencyInventory> Inventory(uint64_t journal_bytes = 16ull << 20) {
  core::ResidencyInventory::Options options;
  options.incarnation = 0x1234;
  options.shards = 1;
  options.journal_bytes = journal_bytes;
  static MetricsRegistry metrics;  // the inventory registers its gauges (shared by the tests)
  auto inventory = core::ResidencyInventory::Create(options, &metrics);
  EXPECT_TRUE(inventory.ok()) << inventory.status();
  return std::move(*inventory);
}

// The owner's view of the shard, as catalog records.
std::vector<CatalogRecord> OwnerView(const core::ResidencyInventory& inventory) {
  std::vector<CatalogRecord> out;
  std::optional<core::InventoryCursor> cursor;
  for (;;) {
    core::InventoryPage page = inventory.Scan(kShard, cursor ? &*cursor : nullptr, 100);
    for (const auto& r : page.records) {
      out.push_back(CatalogRecord{r.key, static_cast<uint8_t>(r.tier), true, r.version, r.generation, r.bytes});
    }
    if (!page.next) break;
    cursor = page.next;
  }
  // In the catalog's dump order (key, tier); the inventory scans in hash order.
  std::sort(out.begin(), out.end(), [](const CatalogRecord& a, const CatalogRecord& b) {
    return std::tie(a.key, a.tier) < std::tie(b.key, b.tier);
  });
  return out;
}

OwnerStreamer::Options StreamerOptions() {
  OwnerStreamer::Options options;
  options.owner_node = "node-a";
  options.owner_runtime = "run-1";
  options.shard = kShard;
  options.catalog_node = "node-c";
  options.max_batch_records = 64;
  options.page_records = 50;
  options.backoff_min = std::chrono::milliseconds(0);
  options.backoff_max = std::chrono::milliseconds(0);
  return options;
}

// Steps until the streamer has nothing left to do (bounded).
void Drain(OwnerStreamer& streamer) {
  for (int i = 0; i < 100000 && streamer.Step(); ++i) {
  }
}

TEST(OwnerStreamerTest, TheCatalogFollowsTheInventoryThroughDeltasAfterOneSnapshot) {
  auto inventory = Inventory();
  CatalogStore store({0xca7});
  InProcessTransport transport(&store);
  Churn churn(inventory.get(), 1);
  churn.Run(300);  // before the stream exists: the first snapshot carries it
  auto streamer = *OwnerStreamer::Create(StreamerOptions(), inventory.get(), &transport);
  Drain(*streamer);
  EXPECT_EQ(store.Dump(kShard, "node-a"), OwnerView(*inventory));
  EXPECT_EQ(streamer->snapshots(), 1u);
  for (int round = 0; round < 10; ++round) {
    churn.Run(150);
    Drain(*streamer);
    ASSERT_EQ(store.Dump(kShard, "node-a"), OwnerView(*inventory)) << round;
  }
  EXPECT_EQ(streamer->snapshots(), 1u);  // deltas only, once the baseline was in
  EXPECT_EQ(streamer->acknowledged(), inventory->Watermark(kShard));
  EXPECT_EQ(streamer->state(), OwnerStreamer::State::kStreaming);
  EXPECT_TRUE(streamer->converged());
}

TEST(OwnerStreamerTest, LostDuplicatedAndReorderedMessagesStillConverge) {
  auto inventory = Inventory();
  CatalogStore store({0xca7});
  InProcessTransport transport(&store);
  transport.drop = 0.2;
  transport.duplicate = 0.2;
  transport.hold = 0.2;
  Churn churn(inventory.get(), 2);
  auto streamer = *OwnerStreamer::Create(StreamerOptions(), inventory.get(), &transport);
  for (int round = 0; round < 20; ++round) {
    churn.Run(100);
    for (int i = 0; i < 50; ++i) streamer->Step();
  }
  transport.drop = transport.duplicate = transport.hold = 0;
  Drain(*streamer);
  EXPECT_EQ(store.Dump(kShard, "node-a"), OwnerView(*inventory));
  EXPECT_GT(streamer->gaps() + streamer->snapshots(), 1u);  // the faults were felt
}

TEST(OwnerStreamerTest, ARestartedCatalogHostIsRepairedFromTheOwner) {
  auto inventory = Inventory();
  auto store = std::make_unique<CatalogStore>(CatalogStore::Options{0xca7});
  InProcessTransport transport(store.get());
  Churn churn(inventory.get(), 3);
  churn.Run(400);
  auto streamer = *OwnerStreamer::Create(StreamerOptions(), inventory.get(), &transport);
  Drain(*streamer);
  ASSERT_EQ(store->Dump(kShard, "node-a"), OwnerView(*inventory));
  // The catalog host restarts with nothing (a new incarnation); the next change reaches it.
  store = std::make_unique<CatalogStore>(CatalogStore::Options{0xca8});
  transport.set_store(store.get());
  churn.Run(10);
  Drain(*streamer);
  EXPECT_EQ(store->Dump(kShard, "node-a"), OwnerView(*inventory));
  EXPECT_EQ(streamer->snapshots(), 2u);
  // And once more with no change at all: the heartbeat finds the new start, and the owner repairs it.
  store = std::make_unique<CatalogStore>(CatalogStore::Options{0xca9});
  transport.set_store(store.get());
  EXPECT_FALSE(streamer->Step());  // nothing to send...
  EXPECT_TRUE(streamer->Heartbeat());
  Drain(*streamer);
  EXPECT_EQ(store->Dump(kShard, "node-a"), OwnerView(*inventory));
  EXPECT_EQ(streamer->snapshots(), 3u);
  // Unreachable for a while: the owner backs off, Publish goes on, then it converges.
  transport.unavailable = true;
  churn.Run(200);
  for (int i = 0; i < 20; ++i) streamer->Step();
  transport.unavailable = false;
  Drain(*streamer);
  EXPECT_EQ(store->Dump(kShard, "node-a"), OwnerView(*inventory));
}

// Issue 54: a shard's copies are each fed by the owner's own stream to it. One copy unreachable while the owner
// keeps publishing, then back as a new start (restarted empty): only its stream snapshots again; the other copy
// follows with deltas throughout and never notices.
TEST(OwnerStreamerTest, TwoCopiesOfAShardAreFedByTheirOwnStreamsAndOneResyncsAlone) {
  auto inventory = Inventory();
  CatalogStore copy_c({0xc1});
  auto copy_d = std::make_unique<CatalogStore>(CatalogStore::Options{0xd1});
  InProcessTransport to_c(&copy_c), to_d(copy_d.get());
  Churn churn(inventory.get(), 11);
  churn.Run(300);
  OwnerStreamer::Options to_node_c = StreamerOptions(), to_node_d = StreamerOptions();
  to_node_d.catalog_node = "node-d";
  auto c = *OwnerStreamer::Create(to_node_c, inventory.get(), &to_c);
  auto d = *OwnerStreamer::Create(to_node_d, inventory.get(), &to_d);
  Drain(*c);
  Drain(*d);
  ASSERT_EQ(copy_c.Dump(kShard, "node-a"), OwnerView(*inventory));
  ASSERT_EQ(copy_d->Dump(kShard, "node-a"), OwnerView(*inventory));
  to_d.unavailable = true;
  for (int round = 0; round < 5; ++round) {
    churn.Run(100);
    Drain(*c);
    for (int i = 0; i < 10; ++i) d->Step();
    ASSERT_EQ(copy_c.Dump(kShard, "node-a"), OwnerView(*inventory)) << round;
  }
  copy_d = std::make_unique<CatalogStore>(CatalogStore::Options{0xd2});
  to_d.set_store(copy_d.get());
  to_d.unavailable = false;
  churn.Run(10);
  Drain(*c);
  Drain(*d);
  EXPECT_EQ(copy_d->Dump(kShard, "node-a"), OwnerView(*inventory));
  EXPECT_EQ(copy_c.Dump(kShard, "node-a"), OwnerView(*inventory));
  EXPECT_EQ(c->snapshots(), 1u);  // the copy that stayed up never resynced
  EXPECT_GE(d->snapshots(), 2u);
}

// A journal too small for the churn: the subscriber is flagged for resync, and a snapshot whose
// interval overflowed the journal mid-cut is aborted and retried until one fits.
TEST(OwnerStreamerTest, AJournalThatLostHistoryForcesSnapshotsAndAnOverflowingIntervalIsRetried) {
  auto inventory = Inventory(64 * core::ResidencyInventory::kRecordCharge);
  CatalogStore store({0xca7});
  InProcessTransport transport(&store);
  Churn churn(inventory.get(), 4);
  churn.Run(500);
  auto streamer = *OwnerStreamer::Create(StreamerOptions(), inventory.get(), &transport);
  Drain(*streamer);
  ASSERT_EQ(store.Dump(kShard, "node-a"), OwnerView(*inventory));
  churn.Run(300);  // far more than the journal keeps: this subscriber must resync
  EXPECT_TRUE(inventory->resync_required(kShard, 1));
  // While the next snapshot's pages travel, churn overflows its interval: that cut aborts.
  int pages = 0;
  transport.on_page = [&] {
    if (++pages <= 2) churn.Run(100);
  };
  Drain(*streamer);
  EXPECT_GE(streamer->snapshot_aborts(), 1u);
  EXPECT_EQ(store.Dump(kShard, "node-a"), OwnerView(*inventory));
  EXPECT_TRUE(streamer->converged());
  EXPECT_FALSE(inventory->resync_required(kShard, 1));
}

// An interval longer than a batch travels in interval pages before End (each message stays bounded).
TEST(OwnerStreamerTest, ALongIntervalTravelsInPages) {
  auto inventory = Inventory();
  CatalogStore store({0xca7});
  InProcessTransport transport(&store);
  Churn churn(inventory.get(), 8);
  churn.Run(200);
  auto streamer = *OwnerStreamer::Create(StreamerOptions(), inventory.get(), &transport);
  int pages = 0;
  transport.on_page = [&] {
    if (++pages == 1) churn.Run(500);  // 500 changes inside the cut: an interval of about 8 batches
  };
  Drain(*streamer);
  EXPECT_EQ(store.Dump(kShard, "node-a"), OwnerView(*inventory));
  EXPECT_EQ(streamer->snapshots(), 1u);
  EXPECT_GT(pages, 8);
}

// A large shard snapshotted while it changes steadily, with a journal far smaller than a scan's worth of changes:
// the interval travels while the pages are taken (after each page), so the cut converges, and the catalog then
// follows by deltas (TSan runs this).
TEST(OwnerStreamerTest, ALargeShardUnderSteadyChurnWithASmallJournalConverges) {
  auto inventory = Inventory(256 << 10);
  CatalogStore store({0xca7});
  InProcessTransport transport(&store);
  uint64_t generation = 1;
  constexpr uint64_t kRecords = 20000;
  for (uint64_t k = 0; k < kRecords; ++k) {
    inventory->Apply(kShard, core::testing::ChainKey(12, k), core::Tier::kDram, true, core::TransitionCause::kAdmit,
                     ++generation, 4096);
  }
  OwnerStreamer::Options options = StreamerOptions();
  options.page_records = 1024;
  options.max_batch_records = 4096;
  options.backoff_min = std::chrono::milliseconds(1);
  options.backoff_max = std::chrono::milliseconds(50);
  auto streamer = *OwnerStreamer::Create(options, inventory.get(), &transport);
  std::atomic<bool> stop{false};
  std::thread churn([&] {  // 2,000 changes/s: alternately a new residence and an eviction of the oldest
    uint64_t next = kRecords, oldest = 0, changes = 0;
    const MonoTime start = MonoNow();
    while (!stop.load()) {
      const double due = std::chrono::duration<double>(MonoNow() - start).count() * 2000;
      for (; changes < due; ++changes) {
        if (changes % 2 == 0) {
          inventory->Apply(kShard, core::testing::ChainKey(12, next++), core::Tier::kDram, true,
                           core::TransitionCause::kAdmit, ++generation, 4096);
        } else {
          inventory->Apply(kShard, core::testing::ChainKey(12, oldest++), core::Tier::kDram, false,
                           core::TransitionCause::kEvict, 1, 4096);
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  bool streaming = false;
  const MonoTime t0 = MonoNow();
  while (!streaming && MonoNow() - t0 < std::chrono::seconds(60)) {
    streamer->Step();
    streaming = streamer->snapshots() > 0 && streamer->state() == OwnerStreamer::State::kStreaming;
  }
  stop = true;
  churn.join();
  ASSERT_TRUE(streaming) << "no snapshot converged: " << streamer->snapshot_aborts() << " aborted";
  EXPECT_TRUE(streamer->converged());
  Drain(*streamer);
  EXPECT_EQ(store.Dump(kShard, "node-a"), OwnerView(*inventory));
  EXPECT_EQ(streamer->acknowledged(), inventory->Watermark(kShard));
}

TEST(OwnerStreamerTest, ARefusedOwnerStops) {
  auto inventory = Inventory();
  CatalogStore::Options options{0xca7};
  options.owner_live = [](const std::string&, const std::string& runtime) { return runtime != "run-1"; };
  CatalogStore store(options);
  InProcessTransport transport(&store);
  Churn churn(inventory.get(), 5);
  churn.Run(10);
  auto streamer = *OwnerStreamer::Create(StreamerOptions(), inventory.get(), &transport);
  Drain(*streamer);
  EXPECT_EQ(streamer->state(), OwnerStreamer::State::kStopped);
  EXPECT_FALSE(streamer->Step());
  EXPECT_TRUE(store.Dump(kShard, "node-a").empty());
}

// The production loop on its own thread while another thread publishes: never a wait on the
// stream, and the catalog converges once publishing stops (TSan runs this).
TEST(OwnerStreamerTest, RunFollowsConcurrentPublishes) {
  auto inventory = Inventory();
  CatalogStore store({0xca7});
  InProcessTransport transport(&store);
  auto streamer = *OwnerStreamer::Create(StreamerOptions(), inventory.get(), &transport);
  std::atomic<bool> stop{false};
  std::thread runner([&] { streamer->Run(stop); });
  Churn churn(inventory.get(), 6);
  for (int i = 0; i < 40; ++i) {
    churn.Run(50);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  bool equal = false;
  for (int i = 0; i < 3000 && !equal; ++i) {
    equal = streamer->acknowledged() == inventory->Watermark(kShard) &&
            store.Dump(kShard, "node-a") == OwnerView(*inventory);
    if (!equal) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  stop = true;
  runner.join();
  EXPECT_TRUE(equal);
}

}  // namespace
}  // namespace orbitkv::catalog
