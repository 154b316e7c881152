#include "core/inventory.h"

#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <memory>
#include <thread>

#include "core/test_util.h"

namespace orbitkv::core {
namespace {

using state::StateKey;
using testing::ChainKey;

std::unique_ptr<ResidencyInventory> MakeInventory(MetricsRegistry* metrics, uint32_t shards, uint64_t journal_bytes) {
  ResidencyInventory::Options options;
  options.incarnation = 99;
  options.shards = shards;
  options.journal_bytes = journal_bytes;
  auto inventory = ResidencyInventory::Create(options, metrics);
  EXPECT_TRUE(inventory.ok()) << inventory.status();
  return std::move(*inventory);
}

TEST(InventoryTest, RejectsBadOptions) {
  MetricsRegistry metrics;
  ResidencyInventory::Options options;
  options.shards = 0;
  EXPECT_EQ(ResidencyInventory::Create(options, &metrics).status().code(), StatusCode::kInvalidArgument);
  options.shards = 16;
  options.journal_bytes = 100;
  EXPECT_EQ(ResidencyInventory::Create(options, &metrics).status().code(), StatusCode::kInvalidArgument);
}

TEST(InventoryTest, SequencesArePerShardAndContiguous) {
  MetricsRegistry metrics;
  auto inventory = MakeInventory(&metrics, 4, 1 << 20);
  std::map<uint32_t, uint64_t> next;
  for (uint64_t i = 0; i < 64; ++i) {
    const StateKey key = ChainKey(1, i);
    const uint32_t shard = inventory->ShardFor(key);
    EXPECT_EQ(inventory->Apply(shard, key, Tier::kDram, true, TransitionCause::kAdmit, i + 1, 4096), ++next[shard]);
  }
  for (uint32_t shard = 0; shard < 4; ++shard) {
    EXPECT_EQ(inventory->Watermark(shard), next[shard]);
    auto read = inventory->ReadJournal(shard, 0, 1000);
    ASSERT_TRUE(read.ok());
    EXPECT_EQ(read->records.size(), next[shard]);
    EXPECT_EQ(read->watermark, next[shard]);
    EXPECT_FALSE(read->resync_required);
    // Reading from the middle returns exactly the tail.
    if (next[shard] > 2) {
      auto tail = inventory->ReadJournal(shard, 2, 1000);
      ASSERT_TRUE(tail.ok());
      ASSERT_EQ(tail->records.size(), next[shard] - 2);
      EXPECT_EQ(tail->records.front().sequence, 3u);
    }
  }
  EXPECT_EQ(inventory->ReplicaCount(Tier::kDram), 64u);
  EXPECT_EQ(inventory->ReadJournal(9, 0, 1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(inventory->ReadJournal(0, next[0] + 1, 1).status().code(), StatusCode::kInvalidArgument);
}

TEST(InventoryTest, RemovalOfAnUnknownResidenceIsAProgrammingError) {
  MetricsRegistry metrics;
  auto inventory = MakeInventory(&metrics, 1, 1 << 20);
  EXPECT_DEATH(inventory->Apply(0, ChainKey(2, 0), Tier::kSsd, false, TransitionCause::kEvict, 1, 1), "inventory");
}

TEST(InventoryTest, OverflowOfUnacknowledgedRecordsSetsResyncAndReadersMustSnapshot) {
  MetricsRegistry metrics;
  const uint64_t capacity_records = 8;
  auto inventory = MakeInventory(&metrics, 1, capacity_records * ResidencyInventory::kRecordCharge);
  const InventorySubscriber subscriber = *inventory->Subscribe(0);
  ASSERT_TRUE(inventory->CommitSnapshot(0, subscriber, 0).ok());  // an empty shard's snapshot
  for (uint64_t i = 0; i < capacity_records; ++i) {
    inventory->Apply(0, ChainKey(3, i), Tier::kDram, true, TransitionCause::kAdmit, i + 1, 1);
  }
  EXPECT_FALSE(inventory->resync_required(0, subscriber));
  // Acknowledged records are dropped silently...
  inventory->Acknowledge(0, subscriber, 2);
  inventory->Apply(0, ChainKey(3, 100), Tier::kDram, true, TransitionCause::kAdmit, 100, 1);
  inventory->Apply(0, ChainKey(3, 101), Tier::kDram, true, TransitionCause::kAdmit, 101, 1);
  EXPECT_FALSE(inventory->resync_required(0, subscriber));
  // ...an unacknowledged one is not.
  inventory->Apply(0, ChainKey(3, 102), Tier::kDram, true, TransitionCause::kAdmit, 102, 1);
  EXPECT_TRUE(inventory->resync_required(0, subscriber));
  EXPECT_EQ(inventory->ReadJournal(0, 0, 100).status().code(), StatusCode::kOutOfRange);
  auto read = inventory->ReadJournal(0, subscriber, 3, 100);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_TRUE(read->resync_required);
  EXPECT_EQ(read->records.size(), capacity_records);
  EXPECT_EQ(metrics.GetCounter("orbitkv_inventory_resync_total", "").Value(), 1u);
  // A snapshot cut at the current watermark clears it.
  ASSERT_TRUE(inventory->CommitSnapshot(0, subscriber, inventory->Watermark(0)).ok());
  EXPECT_FALSE(inventory->resync_required(0, subscriber));
  // The view still holds every replica although the journal forgot the early records.
  EXPECT_EQ(inventory->ReplicaCount(Tier::kDram), capacity_records + 3);
  EXPECT_EQ(inventory->Size(0), capacity_records + 3);
}

TEST(InventoryTest, ASlowSubscriberResyncsAloneAndNeverStallsApply) {
  MetricsRegistry metrics;
  const uint64_t capacity_records = 8;
  auto inventory = MakeInventory(&metrics, 1, capacity_records * ResidencyInventory::kRecordCharge);
  const InventorySubscriber fast = *inventory->Subscribe(0);
  const InventorySubscriber slow = *inventory->Subscribe(0);
  EXPECT_NE(fast, slow);
  ASSERT_TRUE(inventory->CommitSnapshot(0, fast, 0).ok());
  ASSERT_TRUE(inventory->CommitSnapshot(0, slow, 0).ok());
  for (uint64_t i = 0; i < 40; ++i) {
    inventory->Apply(0, ChainKey(6, i), Tier::kDram, true, TransitionCause::kAdmit, i + 1, 1);
    inventory->Acknowledge(0, fast, i + 1);  // keeps up
  }
  EXPECT_FALSE(inventory->resync_required(0, fast));
  EXPECT_TRUE(inventory->resync_required(0, slow));
  EXPECT_EQ(metrics.GetCounter("orbitkv_inventory_resync_total", "").Value(), 1u);
  auto tail = inventory->ReadJournal(0, fast, 38, 100);
  ASSERT_TRUE(tail.ok()) << tail.status();
  EXPECT_FALSE(tail->resync_required);
  EXPECT_EQ(tail->records.size(), 2u);
  // The slow one holds retention at its acknowledgement; once it catches up (snapshot, then
  // acknowledges), what both acknowledged is let go.
  EXPECT_EQ(metrics.GetGauge("orbitkv_inventory_journal_records", "").Value(), capacity_records);
  ASSERT_TRUE(inventory->CommitSnapshot(0, slow, inventory->Watermark(0)).ok());
  inventory->Acknowledge(0, slow, inventory->Watermark(0));
  EXPECT_EQ(metrics.GetGauge("orbitkv_inventory_journal_records", "").Value(), 0);
  EXPECT_EQ(inventory->ReadJournal(0, fast, 40, 100)->records.size(), 0u);
  inventory->Apply(0, ChainKey(6, 99), Tier::kDram, true, TransitionCause::kAdmit, 99, 1);
  EXPECT_EQ(inventory->ReadJournal(0, slow, 40, 100)->records.size(), 1u);
  // A subscriber that went away no longer counts; an unknown one is refused.
  inventory->Unsubscribe(0, slow);
  EXPECT_EQ(inventory->CommitSnapshot(0, slow, 0).code(), StatusCode::kNotFound);
  EXPECT_EQ(inventory->ReadJournal(0, slow, 0, 1).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(inventory->CommitSnapshot(0, fast, inventory->Watermark(0) + 1).code(), StatusCode::kInvalidArgument);
}

TEST(InventoryTest, ACommitCannotHideARecordDroppedAfterItsCut) {
  MetricsRegistry metrics;
  const uint64_t capacity_records = 8;
  auto inventory = MakeInventory(&metrics, 1, capacity_records * ResidencyInventory::kRecordCharge);
  const InventorySubscriber subscriber = *inventory->Subscribe(0);
  EXPECT_TRUE(inventory->resync_required(0, subscriber));  // new subscribers snapshot first
  const uint64_t cut = inventory->Watermark(0);
  // While the subscriber scans, more than the journal holds happens after the cut.
  for (uint64_t i = 0; i < capacity_records + 2; ++i) {
    inventory->Apply(0, ChainKey(7, i), Tier::kDram, true, TransitionCause::kAdmit, i + 1, 1);
  }
  EXPECT_EQ(inventory->CommitSnapshot(0, subscriber, cut).code(), StatusCode::kAborted);
  EXPECT_TRUE(inventory->resync_required(0, subscriber));
  // Cut again at the present: that commit holds.
  ASSERT_TRUE(inventory->CommitSnapshot(0, subscriber, inventory->Watermark(0)).ok());
  EXPECT_FALSE(inventory->resync_required(0, subscriber));
}

TEST(InventoryTest, CommitSnapshotRacingApplyNeverHidesARecord) {
  MetricsRegistry metrics;
  const uint64_t capacity_records = 16;
  auto inventory = MakeInventory(&metrics, 1, capacity_records * ResidencyInventory::kRecordCharge);
  const InventorySubscriber subscriber = *inventory->Subscribe(0);
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    for (uint64_t i = 0; !stop.load(std::memory_order_relaxed); ++i) {
      inventory->Apply(0, ChainKey(8, i), Tier::kDram, true, TransitionCause::kAdmit, i + 1, 1);
    }
  });
  int committed = 0;
  for (int round = 0; round < 2000; ++round) {
    const uint64_t cut = inventory->Watermark(0);
    Status status = inventory->CommitSnapshot(0, subscriber, cut);
    if (!status.ok()) {
      EXPECT_EQ(status.code(), StatusCode::kAborted) << status;
      EXPECT_TRUE(inventory->resync_required(0, subscriber));
      continue;
    }
    ++committed;
    // A successful commit at `cut`: every record after it is still there to be read, or it has
    // since been dropped and the subscriber is flagged.
    Result<JournalRead> after = inventory->ReadJournal(0, subscriber, cut, 1 << 20);
    if (after.ok()) {
      if (!after->records.empty()) {
        EXPECT_EQ(after->records.front().sequence, cut + 1);
      }
    } else {
      EXPECT_EQ(after.status().code(), StatusCode::kOutOfRange);
      EXPECT_TRUE(inventory->resync_required(0, subscriber));
    }
  }
  stop = true;
  writer.join();
  EXPECT_GT(committed, 0);
}

TEST(InventoryTest, WaitForChangeWakesOnApplyAndRecordsCarryTheirTime) {
  MetricsRegistry metrics;
  auto inventory = MakeInventory(&metrics, 1, 1 << 20);
  EXPECT_FALSE(inventory->WaitForChange(0, 0, Deadline::After(std::chrono::milliseconds(5))));
  const MonoTime before = MonoNow();
  std::thread writer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    inventory->Apply(0, ChainKey(9, 0), Tier::kDram, true, TransitionCause::kAdmit, 1, 1);
  });
  EXPECT_TRUE(inventory->WaitForChange(0, 0, Deadline::After(std::chrono::seconds(30))));
  writer.join();
  auto read = inventory->ReadJournal(0, 0, 10);
  ASSERT_TRUE(read.ok());
  ASSERT_EQ(read->records.size(), 1u);
  EXPECT_GE(read->records[0].applied_at, before);
  EXPECT_LE(read->records[0].applied_at, MonoNow());
  EXPECT_TRUE(inventory->WaitForChange(0, 0, Deadline::After(std::chrono::milliseconds(1))));
}

TEST(InventoryTest, AnInventoryThatDoesNotRecordOnlyNumbersTransitions) {
  MetricsRegistry metrics;
  ResidencyInventory::Options options;
  options.shards = 16;
  options.record = false;
  auto created = ResidencyInventory::Create(options, &metrics);
  ASSERT_TRUE(created.ok()) << created.status();
  ResidencyInventory& inventory = **created;
  EXPECT_FALSE(inventory.recording());
  const StateKey first = ChainKey(12, 0);
  const uint32_t first_shard = inventory.ShardFor(first);
  std::thread writer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    inventory.Apply(first_shard, first, Tier::kDram, true, TransitionCause::kAdmit, 1, 4096);
  });
  EXPECT_TRUE(inventory.WaitForChange(first_shard, 0, Deadline::After(std::chrono::seconds(30))));
  writer.join();
  // Keys still spread over the shards (one mutex each); each shard numbers its transitions 1, 2...
  std::map<uint32_t, uint64_t> next{{first_shard, 1}};
  for (uint64_t i = 1; i < 64; ++i) {
    const StateKey key = ChainKey(12, i);
    const uint32_t shard = inventory.ShardFor(key);
    ASSERT_LT(shard, 16u);
    EXPECT_EQ(
        inventory.Apply(shard, key, i % 2 == 0 ? Tier::kDram : Tier::kSsd, true, TransitionCause::kAdmit, i + 1, 4096),
        ++next[shard]);
  }
  EXPECT_GT(next.size(), 4u);
  // Removing what was never kept is not an error here: nothing is kept.
  const StateKey removed = ChainKey(12, 5);
  const uint32_t removed_shard = inventory.ShardFor(removed);
  EXPECT_EQ(inventory.Apply(removed_shard, removed, Tier::kSsd, false, TransitionCause::kEvict, 6, 4096),
            ++next[removed_shard]);
  for (const auto& [shard, last] : next) {
    EXPECT_EQ(inventory.Watermark(shard), last);
    EXPECT_EQ(inventory.Size(shard), 0u);
    EXPECT_TRUE(inventory.Scan(shard, nullptr, 100).records.empty());
  }
  EXPECT_EQ(inventory.ReplicaCount(Tier::kDram), 0u);
  EXPECT_EQ(inventory.Subscribe(0).status().code(), StatusCode::kFailedPrecondition);
  const auto read = inventory.ReadJournal(0, 0, 100);
  EXPECT_EQ(read.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(read.status().message().find("single-host"), std::string::npos) << read.status();
  EXPECT_EQ(metrics.GetCounter("orbitkv_inventory_records_total", "").Value(), 0u);
}

TEST(InventoryTest, PagedScanWithTheSnapshotCutRebuildsTheViewDespiteConcurrentChanges) {
  MetricsRegistry metrics;
  auto inventory = MakeInventory(&metrics, 1, 1 << 20);
  for (uint64_t i = 0; i < 50; ++i) {
    inventory->Apply(0, ChainKey(4, i), Tier::kDram, true, TransitionCause::kAdmit, i + 1, 10);
  }
  // Receiver: start watermark, pages of 7, changes interleaved with the scan, end watermark, then
  // the interval.
  std::map<std::pair<StateKey, Tier>, uint64_t> view;  // -> version
  const uint64_t start = inventory->Watermark(0);
  std::optional<InventoryCursor> cursor;
  uint64_t changes = 0;
  do {
    InventoryPage page = inventory->Scan(0, cursor ? &*cursor : nullptr, 7);
    EXPECT_LE(page.records.size(), 7u);
    for (const auto& record : page.records) view[{record.key, record.tier}] = record.version;
    cursor = page.next;
    // Concurrent modifications: remove a key (possibly already scanned) and add a new one.
    inventory->Apply(0, ChainKey(4, changes), Tier::kDram, false, TransitionCause::kEvict, changes + 1, 10);
    inventory->Apply(0, ChainKey(5, changes), Tier::kSsd, true, TransitionCause::kAdmit, 500 + changes, 10);
    ++changes;
  } while (cursor.has_value());
  auto interval = inventory->ReadJournal(0, start, 1 << 20);
  ASSERT_TRUE(interval.ok());
  for (const auto& record : interval->records) {
    auto id = std::make_pair(record.key, record.tier);
    if (record.present) {
      auto it = view.find(id);
      if (it == view.end() || it->second < record.sequence) view[id] = record.sequence;
    } else {
      view.erase(id);
    }
  }
  // The rebuilt view equals a full scan taken now.
  std::map<std::pair<StateKey, Tier>, uint64_t> truth;
  InventoryPage all = inventory->Scan(0, nullptr, 1 << 20);
  EXPECT_FALSE(all.next.has_value());
  for (const auto& record : all.records) truth[{record.key, record.tier}] = record.version;
  EXPECT_EQ(view, truth);
  EXPECT_EQ(truth.size(), 50u);
}

// Pages in the scan order visit every replica exactly once, in the same order as one whole scan (and the same
// order for the same contents in another inventory), and a cursor whose residence was removed meanwhile still
// resumes right after it.
TEST(InventoryTest, ScanPagesVisitEveryReplicaOnceInOneStableOrder) {
  MetricsRegistry metrics;
  auto a = MakeInventory(&metrics, 1, 1 << 20);
  auto b = MakeInventory(&metrics, 1, 1 << 20);
  for (uint64_t i = 0; i < 300; ++i) {
    a->Apply(0, ChainKey(8, i), i % 3 == 0 ? Tier::kSsd : Tier::kDram, true, TransitionCause::kAdmit, i + 1, 10);
  }
  for (uint64_t i = 300; i-- > 0;) {  // the same replicas, inserted in the other order
    b->Apply(0, ChainKey(8, i), i % 3 == 0 ? Tier::kSsd : Tier::kDram, true, TransitionCause::kAdmit, i + 1, 10);
  }
  auto order = [](const InventoryPage& page) {
    std::vector<std::pair<StateKey, Tier>> out;
    for (const auto& r : page.records) out.emplace_back(r.key, r.tier);
    return out;
  };
  const InventoryPage whole = a->Scan(0, nullptr, 1000);
  ASSERT_EQ(whole.records.size(), 300u);
  EXPECT_FALSE(whole.next.has_value());
  EXPECT_EQ(order(whole), order(b->Scan(0, nullptr, 1000)));
  // Every replica of `inventory`'s shard 0, scanned in pages of `page_records`.
  auto paged = [&](const ResidencyInventory& inventory, size_t page_records) {
    std::vector<std::pair<StateKey, Tier>> out;
    std::optional<InventoryCursor> cursor;
    do {
      InventoryPage page = inventory.Scan(0, cursor ? &*cursor : nullptr, page_records);
      EXPECT_LE(page.records.size(), page_records);
      for (auto& r : order(page)) out.push_back(r);
      cursor = page.next;
    } while (cursor.has_value());
    return out;
  };
  EXPECT_EQ(paged(*a, 7), order(whole));
  // Many replicas per hash bucket and pages that end mid-bucket: the same single order, each replica once.
  auto big = MakeInventory(&metrics, 1, 1 << 20);
  for (uint64_t i = 0; i < 5000; ++i) {
    big->Apply(0, ChainKey(9, i), i % 5 == 0 ? Tier::kSsd : Tier::kDram, true, TransitionCause::kAdmit, i + 1, 10);
  }
  const InventoryPage all = big->Scan(0, nullptr, 10000);
  ASSERT_EQ(all.records.size(), 5000u);
  EXPECT_EQ(paged(*big, 333), order(all));
  // Remove the cursor's own residence: the next page starts right after where it was.
  InventoryPage first = a->Scan(0, nullptr, 10);
  ASSERT_TRUE(first.next.has_value());
  a->Apply(0, first.next->key, first.next->tier, false, TransitionCause::kEvict, 0, 10);
  InventoryPage second = a->Scan(0, &*first.next, 5);
  ASSERT_EQ(second.records.size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(second.records[i].key, whole.records[10 + i].key) << i;
  }
}

}  // namespace
}  // namespace orbitkv::core
