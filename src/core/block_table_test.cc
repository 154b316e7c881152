#include "core/block_table.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <vector>

#include "core/test_util.h"

namespace orbitkv::core {
namespace {

using state::StateKey;
using testing::Chain;
using testing::ChainKey;

constexpr uint64_t kBlock = 64 << 10;

class BlockTableTest : public ::testing::Test {
 protected:
  void SetUp() override { Build(16 * kBlock, 4); }

  void Build(uint64_t capacity, uint32_t shards, double window_fraction = 0.01) {
    table_.reset();
    PoolOptions pool_options;
    pool_options.capacity_bytes = capacity;
    pool_options.slab_bytes = 1 << 20;
    pool_options.numa_nodes = {-1};
    pool_options.pin_mode = PinMode::kAllowUnpinned;
    pool_ = *PinnedPool::Create(pool_options, &metrics_);
    ResidencyInventory::Options inventory_options;
    inventory_options.incarnation = 1;
    inventory_ = *ResidencyInventory::Create(inventory_options, &metrics_);
    BlockTable::Options options;
    options.shards = shards;
    options.window_fraction = window_fraction;
    options.expected_blocks = 256;
    table_ = std::make_unique<BlockTable>(options, pool_.get(), inventory_.get(), &metrics_);
  }

  // Publishes `key` with a stamped payload; returns the residence generation.
  uint64_t Publish(const StateKey& key, uint64_t seed, uint64_t bytes = kBlock) {
    auto writer = table_->Prepare(key, bytes);
    EXPECT_TRUE(writer.ok()) << writer.status();
    if (!writer.ok()) return 0;
    testing::Stamp(writer->data(), bytes, seed);
    return table_->Seal(*writer);
  }

  MetricsRegistry metrics_;
  std::unique_ptr<PinnedPool> pool_;
  std::unique_ptr<ResidencyInventory> inventory_;
  std::unique_ptr<BlockTable> table_;
};

TEST_F(BlockTableTest, PreparingBlocksAreInvisibleUntilSealed) {
  const StateKey key = ChainKey(1, 0);
  auto writer = table_->Prepare(key, kBlock);
  ASSERT_TRUE(writer.ok()) << writer.status();
  EXPECT_EQ(table_->LookupPrefix(std::span(&key, 1)), 0u);
  EXPECT_EQ(table_->Pin(key).status().code(), StatusCode::kNotFound);
  // A second publisher of the same key while the first writes loses the race.
  EXPECT_EQ(table_->Prepare(key, kBlock).status().code(), StatusCode::kAborted);
  testing::Stamp(writer->data(), kBlock, 42);
  const uint64_t generation = table_->Seal(*writer);
  EXPECT_FALSE(writer->valid());
  EXPECT_GT(generation, 0u);
  EXPECT_EQ(table_->LookupPrefix(std::span(&key, 1)), 1u);
  auto pin = table_->Pin(key);
  ASSERT_TRUE(pin.ok());
  EXPECT_EQ(pin->generation(), generation);
  EXPECT_TRUE(testing::CheckStamp(pin->data(), kBlock, 42));
  // Content addressed: publishing a resident key again has nothing to write.
  EXPECT_EQ(table_->Prepare(key, kBlock).status().code(), StatusCode::kAlreadyExists);
}

TEST_F(BlockTableTest, AbortedWriteFreesMemoryAndLeavesNoEntry) {
  const StateKey key = ChainKey(1, 0);
  {
    auto writer = table_->Prepare(key, kBlock);
    ASSERT_TRUE(writer.ok());
    EXPECT_EQ(pool_->Stats().blocks_in_use, 1u);
  }  // dropped unsealed
  EXPECT_EQ(pool_->Stats().blocks_in_use, 0u);
  EXPECT_EQ(table_->Stats().preparing_blocks, 0u);
  EXPECT_EQ(table_->LookupPrefix(std::span(&key, 1)), 0u);
  EXPECT_TRUE(table_->Prepare(key, kBlock).ok());  // and the key can be written again
}

TEST_F(BlockTableTest, PrefixLookupStopsAtTheFirstGap) {
  const auto keys = Chain(2, 6);
  for (size_t i : {0, 1, 2, 4, 5}) Publish(keys[i], i);
  EXPECT_EQ(table_->LookupPrefix(keys), 3u);
  std::vector<BlockPin> pins;
  EXPECT_EQ(table_->PinPrefix(keys, &pins), 3u);
  ASSERT_EQ(pins.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_TRUE(testing::CheckStamp(pins[i].data(), kBlock, i));
  EXPECT_EQ(table_->LookupPrefix(std::span(keys).subspan(4)), 2u);
  EXPECT_EQ(table_->LookupPrefix(std::span(keys).subspan(3)), 0u);
}

TEST_F(BlockTableTest, SealAllPublishesEveryWriterAsSealWould) {
  const auto keys = Chain(31, 8);
  std::vector<BlockWriter> writers;
  for (size_t i = 0; i < keys.size(); ++i) {
    auto writer = table_->Prepare(keys[i], kBlock);
    ASSERT_TRUE(writer.ok()) << writer.status();
    testing::Stamp(writer->data(), kBlock, 300 + i);
    writers.push_back(std::move(*writer));
  }
  EXPECT_EQ(table_->LookupPrefix(keys), 0u);  // preparing blocks are invisible
  table_->SealAll(writers);
  EXPECT_EQ(table_->LookupPrefix(keys), keys.size());
  std::vector<BlockPin> pins;
  ASSERT_EQ(table_->PinPrefix(keys, &pins), keys.size());
  std::set<uint64_t> generations;
  for (size_t i = 0; i < keys.size(); ++i) {
    EXPECT_TRUE(testing::CheckStamp(pins[i].data(), kBlock, 300 + i));
    EXPECT_NE(pins[i].sequence(), 0u);
    generations.insert(pins[i].generation());
  }
  EXPECT_EQ(generations.size(), keys.size());  // each publication its own generation
  BlockPin::ReleaseAll(&pins);
  EXPECT_EQ(table_->Stats().resident_blocks, keys.size());
}

TEST_F(BlockTableTest, PinExactPinsOnlyTheAnnouncedVersionsAndSaysWhyItStopped) {
  const auto keys = Chain(21, 5);
  for (size_t i = 0; i < 4; ++i) Publish(keys[i], i);
  // What a peer was told: each key's residence generation and inventory sequence.
  std::vector<uint64_t> generations, sequences;
  for (size_t i = 0; i < 4; ++i) {
    auto pin = table_->Pin(keys[i]);
    ASSERT_TRUE(pin.ok());
    EXPECT_NE(pin->sequence(), 0u);
    EXPECT_EQ(pin->arena_offset() % 4096, 0u);
    generations.push_back(pin->generation());
    sequences.push_back(pin->sequence());
  }
  std::vector<BlockPin> pins;
  ExactPins all = table_->PinExact(std::span(keys).first(4), generations, sequences, &pins);
  EXPECT_EQ(all.pinned, 4u);
  EXPECT_EQ(all.stop, ExactStop::kNone);
  ASSERT_EQ(pins.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_TRUE(testing::CheckStamp(pins[i].data(), kBlock, i));
    EXPECT_EQ(pins[i].sequence(), sequences[i]);
  }
  BlockPin::ReleaseAll(&pins);
  // Key 1 replaced by a new publication (removed and sealed again): a new version, refused.
  ASSERT_TRUE(table_->Remove(keys[1], Tier::kDram).ok());
  Publish(keys[1], 100);
  ExactPins replaced = table_->PinExact(std::span(keys).first(4), generations, sequences, &pins);
  EXPECT_EQ(replaced.pinned, 1u);
  EXPECT_EQ(replaced.stop, ExactStop::kReplaced);
  EXPECT_EQ(pins.size(), 1u);
  BlockPin::ReleaseAll(&pins);
  // Key 2 gone from DRAM but on SSD; key 3 gone everywhere.
  table_->PublishSsd(keys[2], 5, kBlock);
  ASSERT_TRUE(table_->Remove(keys[2], Tier::kDram).ok());
  ASSERT_TRUE(table_->Remove(keys[3], Tier::kDram).ok());
  std::vector<StateKey> tail = {keys[2]};
  EXPECT_EQ(
      table_->PinExact(tail, std::span(generations).subspan(2, 1), std::span(sequences).subspan(2, 1), &pins).stop,
      ExactStop::kNotDram);
  tail = {keys[3]};
  EXPECT_EQ(
      table_->PinExact(tail, std::span(generations).subspan(3, 1), std::span(sequences).subspan(3, 1), &pins).stop,
      ExactStop::kAbsent);
  EXPECT_TRUE(pins.empty());
  EXPECT_EQ(table_->Stats().pinned_blocks, 0u);
}

TEST_F(BlockTableTest, PinnedBlocksAreNeverEvictedAndFullPinnedPoolIsBackpressure) {
  const auto keys = Chain(3, 16);
  std::vector<BlockPin> pins;
  for (size_t i = 0; i < keys.size(); ++i) {
    Publish(keys[i], i);
    auto pin = table_->Pin(keys[i]);
    ASSERT_TRUE(pin.ok());
    pins.push_back(std::move(*pin));
  }
  auto full = table_->Prepare(ChainKey(4, 0), kBlock);
  EXPECT_EQ(full.status().code(), StatusCode::kResourceExhausted) << full.status();
  EXPECT_EQ(table_->LookupPrefix(keys), keys.size());
  // Releasing one pin makes exactly that block evictable.
  pins[5].Reset();
  ASSERT_TRUE(table_->Prepare(ChainKey(4, 0), kBlock).ok());
  EXPECT_EQ(table_->Pin(keys[5]).status().code(), StatusCode::kNotFound);
  for (size_t i = 0; i < keys.size(); ++i) {
    if (i != 5) {
      EXPECT_TRUE(testing::CheckStamp(pins[i].data(), kBlock, i)) << i;
    }
  }
}

TEST_F(BlockTableTest, RecentlyUsedBlocksOutliveOlderOnes) {
  Build(16 * kBlock, 1, /*window_fraction=*/0.0);
  const auto keys = Chain(5, 16);
  for (size_t i = 0; i < keys.size(); ++i) Publish(keys[i], i);
  // Touch the first half so the second half is older.
  for (size_t round = 0; round < 3; ++round) EXPECT_EQ(table_->LookupPrefix(std::span(keys).first(8)), 8u);
  for (size_t i = 0; i < 4; ++i) Publish(ChainKey(6, i), 100 + i);
  // The recently and frequently used half survives; capacity is still fully used.
  EXPECT_EQ(table_->LookupPrefix(std::span(keys).first(8)), 8u);
  EXPECT_EQ(table_->Stats().resident_blocks, 16u);
  EXPECT_EQ(metrics_.GetCounter("orbitkv_cache_evictions_total", "", {{"tier", "dram"}}).Value(), 4u);
}

TEST_F(BlockTableTest, OneHitWondersDoNotFlushAHotPrefix) {
  Build(64 * kBlock, 1, /*window_fraction=*/0.05);
  const auto hot = Chain(7, 32);
  for (size_t i = 0; i < hot.size(); ++i) Publish(hot[i], i);
  for (int round = 0; round < 6; ++round) EXPECT_EQ(table_->LookupPrefix(hot), hot.size());
  // A long scan of blocks that are each seen once.
  for (uint64_t i = 0; i < 400; ++i) Publish(ChainKey(8, i), 1000 + i);
  EXPECT_EQ(table_->LookupPrefix(hot), hot.size());
  EXPECT_GT(metrics_.GetCounter("orbitkv_cache_admissions_rejected_total", "").Value(), 300u);
}

TEST_F(BlockTableTest, EvictionListenerGetsReadableBytesUntilItDropsThePin) {
  // The listener keeps the first two evicted blocks (a write-back in flight) and lets the rest go.
  std::vector<std::pair<StateKey, BlockPin>> taken;
  size_t evicted = 0;
  table_->SetEvictionListener([&](const StateKey& key, BlockPin pin) {
    ++evicted;
    if (taken.size() < 2) taken.emplace_back(key, std::move(pin));
  });
  const auto keys = Chain(9, 20);
  for (size_t i = 0; i < keys.size(); ++i) Publish(keys[i], i);
  // Held blocks still occupy memory, so publishing 4 past capacity evicted 2 more to make room.
  EXPECT_EQ(evicted, 6u);
  ASSERT_EQ(taken.size(), 2u);
  for (auto& [key, pin] : taken) {
    size_t index = std::find(keys.begin(), keys.end(), key) - keys.begin();
    ASSERT_LT(index, keys.size());
    EXPECT_TRUE(testing::CheckStamp(pin.data(), kBlock, index));
    EXPECT_EQ(table_->Pin(key).status().code(), StatusCode::kNotFound);
  }
  EXPECT_EQ(table_->Stats().unpublished_blocks, 2u);
  const uint64_t held = pool_->Stats().blocks_in_use;
  taken.clear();
  EXPECT_EQ(pool_->Stats().blocks_in_use, held - 2);
  EXPECT_EQ(table_->Stats().unpublished_blocks, 0u);
}

TEST_F(BlockTableTest, SsdResidenceIsIndependentOfDram) {
  const auto keys = Chain(10, 3);
  Publish(keys[0], 0);
  const uint64_t ssd_gen = table_->PublishSsd(keys[0], /*locator=*/77, kBlock);
  table_->PublishSsd(keys[1], 78, kBlock);
  std::vector<Residence> tiers;
  EXPECT_EQ(table_->LookupPrefixTiers(keys, &tiers), 2u);
  EXPECT_EQ(tiers, (std::vector<Residence>{Residence::kDram, Residence::kSsd}));
  // Evicting DRAM leaves the SSD copy discoverable.
  ASSERT_TRUE(table_->Remove(keys[0], Tier::kDram, TransitionCause::kEvict).ok());
  tiers.clear();
  EXPECT_EQ(table_->LookupPrefixTiers(keys, &tiers), 2u);
  EXPECT_EQ(tiers[0], Residence::kSsd);
  EXPECT_EQ(table_->FindSsd(keys[0])->locator, 77u);
  // A late failure naming an old generation never drops a newer copy.
  const uint64_t newer = table_->PublishSsd(keys[0], 79, kBlock);
  EXPECT_NE(newer, ssd_gen);
  EXPECT_EQ(table_->DropSsd(keys[0], ssd_gen, TransitionCause::kCleanup).code(), StatusCode::kAborted);
  EXPECT_TRUE(table_->DropSsd(keys[0], newer, TransitionCause::kCleanup).ok());
  EXPECT_EQ(table_->DropSsd(keys[0], newer, TransitionCause::kCleanup).code(), StatusCode::kNotFound);
  EXPECT_EQ(table_->Stats().ssd_residences, 1u);
}

TEST_F(BlockTableTest, StaleRefsAreDetectedAfterSlotReuse) {
  const StateKey key = ChainKey(11, 0);
  Publish(key, 1);
  BlockRef ref;
  {
    auto pin = table_->Pin(key);
    ASSERT_TRUE(pin.ok());
    ref = pin->ref();
    auto again = table_->PinRef(ref);
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(again->data(), pin->data());
  }
  ASSERT_TRUE(table_->Remove(key, Tier::kDram).ok());
  Publish(key, 2);  // likely reuses the slot with a new generation
  EXPECT_EQ(table_->PinRef(ref).status().code(), StatusCode::kAborted);
  EXPECT_EQ(table_->PinRef(BlockRef{99, 0, 1}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(table_->PinRef(BlockRef{ref.shard, 1u << 30, 1}).status().code(), StatusCode::kInvalidArgument);
}

TEST_F(BlockTableTest, RemovedPinnedBlockStaysReadableUntilUnpinned) {
  const StateKey key = ChainKey(12, 0);
  Publish(key, 5);
  auto pin = table_->Pin(key);
  ASSERT_TRUE(pin.ok());
  ASSERT_TRUE(table_->Remove(key, Tier::kDram).ok());
  EXPECT_EQ(table_->Remove(key, Tier::kDram).code(), StatusCode::kNotFound);
  // A new version can be published while the old one is still read.
  Publish(key, 6);
  EXPECT_TRUE(testing::CheckStamp(pin->data(), kBlock, 5));
  EXPECT_EQ(pool_->Stats().blocks_in_use, 2u);
  pin->Reset();
  EXPECT_EQ(pool_->Stats().blocks_in_use, 1u);
  auto fresh = table_->Pin(key);
  ASSERT_TRUE(fresh.ok());
  EXPECT_TRUE(testing::CheckStamp(fresh->data(), kBlock, 6));
}

TEST_F(BlockTableTest, EveryTransitionIsJournaledAndTheInventoryMatchesTheTable) {
  const auto keys = Chain(13, 24);  // more than fit: evictions happen
  for (size_t i = 0; i < keys.size(); ++i) Publish(keys[i], i);
  table_->PublishSsd(keys[0], 1, kBlock);
  ASSERT_TRUE(table_->Remove(keys[23], Tier::kDram).ok());
  // Replay every shard's journal from the start into a map and compare with the inventory and the
  // table.
  std::map<std::pair<StateKey, Tier>, uint64_t> replayed;
  uint64_t evictions = 0;
  for (uint32_t shard = 0; shard < inventory_->shard_count(); ++shard) {
    auto read = inventory_->ReadJournal(shard, 0, 1 << 20);
    ASSERT_TRUE(read.ok()) << read.status();
    uint64_t expected_sequence = 1;
    for (const auto& record : read->records) {
      EXPECT_EQ(record.sequence, expected_sequence++);
      EXPECT_EQ(inventory_->ShardFor(record.key), shard);
      if (record.present) {
        replayed[{record.key, record.tier}] = record.generation;
      } else {
        EXPECT_EQ(replayed.erase({record.key, record.tier}), 1u);
      }
      if (record.cause == TransitionCause::kEvict) ++evictions;
    }
  }
  EXPECT_EQ(evictions, metrics_.GetCounter("orbitkv_cache_evictions_total", "", {{"tier", "dram"}}).Value());
  EXPECT_GT(evictions, 0u);
  const auto stats = table_->Stats();
  EXPECT_EQ(inventory_->ReplicaCount(Tier::kDram), stats.resident_blocks);
  EXPECT_EQ(inventory_->ReplicaCount(Tier::kSsd), 1u);
  size_t dram = 0;
  for (const auto& [key_tier, generation] : replayed) {
    if (key_tier.second != Tier::kDram) continue;
    ++dram;
    auto pin = table_->Pin(key_tier.first);
    ASSERT_TRUE(pin.ok());
    EXPECT_EQ(pin->generation(), generation);
  }
  EXPECT_EQ(dram, stats.resident_blocks);
}

TEST_F(BlockTableTest, RemoveAllDramAndEvictBytes) {
  const auto keys = Chain(14, 8);
  for (size_t i = 0; i < keys.size(); ++i) Publish(keys[i], i);
  EXPECT_EQ(table_->EvictBytes(3 * kBlock), 3 * kBlock);
  EXPECT_EQ(table_->Stats().resident_blocks, 5u);
  std::optional<BlockPin> pin;
  for (const auto& key : keys) {
    if (auto p = table_->Pin(key); p.ok()) {
      pin = std::move(*p);
      break;
    }
  }
  ASSERT_TRUE(pin.has_value());
  EXPECT_EQ(table_->RemoveAllDram(), 5u);
  EXPECT_EQ(table_->Stats().resident_blocks, 0u);
  EXPECT_EQ(pool_->Stats().blocks_in_use, 1u);  // the pinned one
  pin->Reset();
  EXPECT_EQ(pool_->Stats().blocks_in_use, 0u);
}

TEST_F(BlockTableTest, InvalidSizesAreRejected) {
  EXPECT_EQ(table_->Prepare(ChainKey(15, 0), 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(table_->Prepare(ChainKey(15, 0), 2 << 20).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(table_->Stats().preparing_blocks, 0u);
}

}  // namespace
}  // namespace orbitkv::core
