// Model-based randomized test of BlockCache: seeded sequences of a few thousand operations run
// against the cache and against a small reference model, and the cache's observable state is
// reconciled with the model after every step.
//
// The model cannot predict which unpinned block the cache picks as a victim, so it allows a key to
// leave DRAM during the operations that may evict (Prepare, EvictBytes) provided nothing pins that
// key's block; everything else is exact: which keys are resident with which generation and size,
// the bytes of every block, lease and reservation accounting, pool bytes, table counters, the
// inventory and its journal, and the gauges.
//
// A failure names the configuration, seed and step; rerun with --gtest_filter to replay it.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <random>
#include <span>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/block_cache.h"
#include "core/test_util.h"

namespace orbitkv::core {
namespace {

using state::StateKey;
using testing::CheckStamp;
using testing::Stamp;

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kUnit = 64 * kKiB;  // the usual block size; budgets are counted in it
constexpr int kChains = 5;
constexpr int kChainLength = 8;
constexpr int kKeys = kChains * kChainLength;
constexpr uint64_t kInstances = 3;  // instance ids 1..kInstances
constexpr uint32_t kMaxLeases = 8;
constexpr int kSteps = 3000;
constexpr size_t kMaxOpenWriters = 3;
constexpr size_t kMaxDirectPins = 6;
constexpr size_t kMaxUses = 4;
// Bytes of every block checked after every step: a freed pool object has its first bytes
// overwritten by the free list and a new writer stamps from the first byte, so a slot reused too
// early shows there. Whole blocks are checked before every release and every 100 steps.
constexpr uint64_t kHeadCheckBytes = 512;

struct ModelConfig {
  const char* name;
  uint64_t capacity_bytes;
  std::vector<uint64_t> block_sizes;  // one is drawn per publication
  uint32_t table_shards;
  double window_fraction;
};

struct ModelParam {
  ModelConfig config;
  uint64_t seed;
};

void PrintTo(const ModelParam& param, std::ostream* out) { *out << param.config.name << " seed " << param.seed; }

// One DRAM publication of a key, from Seal until it is unpublished and its last pin is gone.
struct Publication {
  int key = 0;
  uint64_t generation = 0;
  uint64_t bytes = 0;
  uint64_t stamp = 0;
  const uint8_t* data = nullptr;
  BlockRef ref;
  int pins = 0;
  bool published = true;
};

// Causes of a DRAM generation's two journal records, for the replay check.
struct History {
  TransitionCause admitted = TransitionCause::kAdmit;
  std::optional<TransitionCause> removed;
};

struct LiveLease {
  LeaseId id;
  uint64_t owner = 0;
  std::vector<uint64_t> generations;
  uint64_t reserved = 0;
};

struct LiveUse {
  LeaseUse use;
  std::vector<uint64_t> generations;
  uint64_t reserved = 0;
};

struct DirectPin {
  BlockPin pin;
  uint64_t generation = 0;
};

struct OpenWriter {
  BlockWriter writer;
  int key = 0;
  uint64_t stamp = 0;
};

struct Replica {
  uint64_t generation = 0;
  uint64_t bytes = 0;
  friend bool operator==(const Replica&, const Replica&) = default;
};

class BlockCacheModelTest : public ::testing::TestWithParam<ModelParam> {
 protected:
  void SetUp() override {
    const ModelConfig& config = GetParam().config;
    rng_.seed(GetParam().seed);
    BlockCacheOptions options = testing::SmallCacheOptions(config.capacity_bytes, 1 << 20);
    options.table.shards = config.table_shards;
    options.table.window_fraction = config.window_fraction;
    options.table.expected_blocks = 64;
    options.inventory_shards = 4;
    options.journal_bytes = 64ull << 20;  // never drops a record in kSteps steps
    options.query_budget_bytes = 12 * kUnit;
    options.query_instance_budget_bytes = 8 * kUnit;
    options.max_leases = kMaxLeases;
    auto cache = BlockCache::Create(options, &metrics_);
    ASSERT_TRUE(cache.ok()) << cache.status();
    cache_ = std::move(*cache);
    for (int chain = 0; chain < kChains; ++chain) {
      for (int i = 0; i < kChainLength; ++i) {
        keys_.push_back(testing::ChainKey(static_cast<uint64_t>(chain), static_cast<uint64_t>(i)));
        key_index_.emplace(keys_.back(), static_cast<int>(keys_.size() - 1));
      }
    }
    std::vector<double> weights;
    for (const Operation& op : Operations()) weights.push_back(op.weight);
    op_distribution_ = std::discrete_distribution<size_t>(weights.begin(), weights.end());
  }

  // Counts outcomes worth reaching, so the test can insist that a sequence reached them.
  void Saw(const char* outcome) { ++seen_[outcome]; }

  uint64_t Uniform(uint64_t n) { return std::uniform_int_distribution<uint64_t>(0, n - 1)(rng_); }
  bool Chance(double p) { return std::bernoulli_distribution(p)(rng_); }
  int RandomKey() { return static_cast<int>(Uniform(kKeys)); }
  uint64_t RandomInstance() { return 1 + Uniform(kInstances); }
  Gauge& GaugeNamed(const char* name, MetricLabels labels = {}) {
    return metrics_.GetGauge(name, "", std::move(labels));
  }

  // ---- model bookkeeping ----

  Publication& Pub(uint64_t generation) { return publications_.at(generation); }
  void AddPin(uint64_t generation) { ++Pub(generation).pins; }
  // Whole-block check of pinned blocks, done just before their pins are released.
  void CheckWhole(const std::vector<uint64_t>& generations) {
    for (uint64_t generation : generations) {
      const Publication& pub = Pub(generation);
      ASSERT_GT(pub.pins, 0);
      ASSERT_TRUE(CheckStamp(pub.data, pub.bytes, pub.stamp))
          << "bytes of pinned generation " << generation << " (key " << pub.key << ") changed";
    }
  }
  // The model side of releasing pins.
  void DropPins(const std::vector<uint64_t>& generations) {
    for (uint64_t generation : generations) ASSERT_NO_FATAL_FAILURE(DropPin(generation));
  }
  void DropPin(uint64_t generation) {
    Publication& pub = Pub(generation);
    ASSERT_GT(pub.pins, 0);
    if (--pub.pins == 0 && !pub.published) publications_.erase(generation);
  }
  void Unpublish(int key, TransitionCause cause) {
    const uint64_t generation = resident_.at(key);
    resident_.erase(key);
    history_[generation].removed = cause;
    Publication& pub = Pub(generation);
    pub.published = false;
    if (pub.pins == 0) publications_.erase(generation);
  }
  bool AllResidentPinned() const {
    return std::all_of(resident_.begin(), resident_.end(),
                       [&](const auto& kv) { return publications_.at(kv.second).pins > 0; });
  }
  size_t ResidentPrefix(int chain, int length) const {
    size_t hits = 0;
    while (static_cast<int>(hits) < length && resident_.count(chain * kChainLength + static_cast<int>(hits)) > 0) {
      ++hits;
    }
    return hits;
  }
  uint64_t ReservedBy(uint64_t owner) const {
    uint64_t bytes = 0;
    for (const LiveLease& lease : leases_) bytes += lease.owner == owner ? lease.reserved : 0;
    for (const LiveUse& use : uses_) bytes += use.use.owner() == owner ? use.reserved : 0;
    return bytes;
  }
  void RetireLease(size_t i) {
    retired_.push_back(leases_[i].id);
    leases_.erase(leases_.begin() + static_cast<std::ptrdiff_t>(i));
  }

  // The cache's current replicas, read from the inventory (which takes no table lock and changes no
  // replacement state).
  void InventoryReplicas(std::map<int, Replica>* dram, std::map<int, Replica>* ssd) {
    for (uint32_t shard = 0; shard < cache_->inventory().shard_count(); ++shard) {
      std::optional<InventoryCursor> cursor;
      do {
        InventoryPage page = cache_->inventory().Scan(shard, cursor ? &*cursor : nullptr, 16);
        for (const InventoryRecord& record : page.records) {
          std::map<int, Replica>& out = record.tier == Tier::kDram ? *dram : *ssd;
          out[key_index_.at(record.key)] = Replica{record.generation, record.bytes};
        }
        cursor = page.next;
      } while (cursor.has_value());
    }
  }
  std::map<int, Replica> ModelDram() const {
    std::map<int, Replica> out;
    for (const auto& [key, generation] : resident_) {
      out[key] = {generation, publications_.at(generation).bytes};
    }
    return out;
  }
  std::map<int, Replica> ModelSsd() const {
    std::map<int, Replica> out;
    for (const auto& [key, ssd] : ssd_) out[key] = {ssd.generation, ssd.bytes};
    return out;
  }

  // After an operation that may evict: keys the cache no longer holds must have been unpinned; they
  // leave the model as evictions. `bytes` gets their total size.
  void TakeEvictions(uint64_t* bytes) {
    *bytes = 0;
    std::map<int, Replica> dram;
    std::map<int, Replica> ssd;
    InventoryReplicas(&dram, &ssd);
    std::vector<int> gone;
    for (const auto& [key, generation] : resident_) {
      if (dram.count(key) > 0) continue;
      ASSERT_EQ(Pub(generation).pins, 0) << "pinned block of key " << key << " was evicted";
      gone.push_back(key);
    }
    for (int key : gone) {
      *bytes += Pub(resident_.at(key)).bytes;
      Unpublish(key, TransitionCause::kEvict);
    }
  }

  // ---- operations ----

  void Seal(OpenWriter open) {
    const TransitionCause cause = Chance(0.2) ? TransitionCause::kRestore : TransitionCause::kAdmit;
    Publication pub;
    pub.key = open.key;
    pub.bytes = open.writer.bytes();
    pub.stamp = open.stamp;
    pub.data = open.writer.data();
    pub.ref = open.writer.ref();
    pub.generation = cache_->Seal(open.writer, cause);
    ASSERT_FALSE(open.writer.valid());
    ASSERT_GT(pub.generation, last_generation_);
    last_generation_ = pub.generation;
    resident_[open.key] = pub.generation;
    history_[pub.generation].admitted = cause;
    old_refs_.push_back(pub.ref);
    publications_.emplace(pub.generation, pub);
  }

  int PublishTarget() {
    if (Chance(0.4)) return RandomKey();
    // Extend a chain's resident prefix, as a save of the next page would.
    const int chain = static_cast<int>(Uniform(kChains));
    return chain * kChainLength +
           static_cast<int>(std::min<size_t>(ResidentPrefix(chain, kChainLength), kChainLength - 1));
  }

  void DoPublish() {
    const int key = PublishTarget();
    const bool was_resident = resident_.count(key) > 0;
    const bool writing =
        std::any_of(writers_.begin(), writers_.end(), [&](const OpenWriter& w) { return w.key == key; });
    if (Chance(0.02)) {
      // Sizes the pool can never serve are rejected and leave the key as it was.
      const uint64_t bad = Chance(0.5) ? 0 : cache_->pool().slab_bytes() + 1;
      const StatusCode expected = bad == 0       ? StatusCode::kInvalidArgument
                                  : was_resident ? StatusCode::kAlreadyExists
                                  : writing      ? StatusCode::kAborted
                                                 : StatusCode::kInvalidArgument;
      ASSERT_EQ(cache_->Prepare(keys_[key], bad).status().code(), expected);
      return;
    }
    const std::vector<uint64_t>& sizes = GetParam().config.block_sizes;
    const uint64_t bytes = sizes[Uniform(sizes.size())];
    Result<BlockWriter> writer = cache_->Prepare(keys_[key], bytes);
    uint64_t evicted = 0;
    ASSERT_NO_FATAL_FAILURE(TakeEvictions(&evicted));
    if (was_resident) {
      ASSERT_EQ(writer.status().code(), StatusCode::kAlreadyExists);
      ASSERT_EQ(evicted, 0u);
      return;
    }
    if (writing) {
      Saw("prepare while writing");
      ASSERT_EQ(writer.status().code(), StatusCode::kAborted);
      ASSERT_EQ(evicted, 0u);
      return;
    }
    if (evicted > 0) Saw("prepare evicted");
    if (!writer.ok()) {
      Saw("prepare exhausted");
      ASSERT_EQ(writer.status().code(), StatusCode::kResourceExhausted) << writer.status();
      ASSERT_TRUE(AllResidentPinned()) << "Prepare gave up while an unpinned block could be evicted";
      return;
    }
    ASSERT_EQ(writer->bytes(), bytes);
    ASSERT_EQ(reinterpret_cast<uintptr_t>(writer->data()) % (4 * kKiB), 0u);
    // The fresh range must not overlap any block that is still referenced; checked before writing
    // to it.
    ASSERT_NO_FATAL_FAILURE(CheckDisjoint(writer->data(), bytes));
    OpenWriter open{std::move(*writer), key, static_cast<uint64_t>(key) << 32 | ++publication_count_};
    Stamp(open.writer.data(), bytes, open.stamp);
    if (writers_.size() < kMaxOpenWriters && Chance(0.25)) {
      writers_.push_back(std::move(open));
    } else {
      ASSERT_NO_FATAL_FAILURE(Seal(std::move(open)));
    }
  }

  void DoSealOrAbortOpen(bool seal) {
    if (writers_.empty()) return;
    const size_t i = Uniform(writers_.size());
    OpenWriter open = std::move(writers_[i]);
    writers_.erase(writers_.begin() + static_cast<std::ptrdiff_t>(i));
    ASSERT_EQ(resident_.count(open.key), 0u);
    if (seal) {
      ASSERT_NO_FATAL_FAILURE(Seal(std::move(open)));
    } else if (Chance(0.5)) {  // otherwise the writer's destructor aborts
      open.writer.Abort();
      ASSERT_FALSE(open.writer.valid());
    }
  }

  void DoQuery() {
    const uint64_t instance = RandomInstance();
    const int chain = static_cast<int>(Uniform(kChains));
    const int length = 1 + static_cast<int>(Uniform(kChainLength));
    static constexpr uint64_t kPadded[] = {kUnit, kUnit + 512, kUnit + kUnit / 2};
    const uint64_t padded = kPadded[Uniform(std::size(kPadded))];
    const std::span<const StateKey> keys(keys_.data() + chain * kChainLength, static_cast<size_t>(length));
    const Budget::Options& budget = cache_->query_budget().options();
    // Only as many keys as one lease can ever hold are looked at.
    const int fits = static_cast<int>(std::min(budget.global_bytes, budget.per_owner_bytes) / padded);
    const size_t hits = ResidentPrefix(chain, std::min(length, fits));
    const uint64_t bytes = hits * padded;
    uint64_t reserved = 0;
    for (uint64_t owner = 1; owner <= kInstances; ++owner) reserved += ReservedBy(owner);

    Result<QueryResult> result = cache_->Query(instance, keys, padded);
    const bool miss = hits == 0;
    if (!miss && (reserved + bytes > budget.global_bytes || ReservedBy(instance) + bytes > budget.per_owner_bytes ||
                  leases_.size() >= kMaxLeases)) {
      ASSERT_EQ(result.status().code(), StatusCode::kResourceExhausted) << result.status();
      Saw("query backpressure");
      return;
    }
    ASSERT_TRUE(result.ok()) << result.status();
    if (length > fits && hits > 0) Saw("query cut to what fits");
    if (miss) {
      ASSERT_EQ(result->hits, 0u);
      ASSERT_FALSE(result->lease.has_value());
      return;
    }
    ASSERT_EQ(result->hits, hits);
    ASSERT_TRUE(result->lease.has_value());
    LiveLease lease{*result->lease, instance, {}, bytes};
    for (size_t i = 0; i < hits; ++i) {
      lease.generations.push_back(resident_.at(chain * kChainLength + static_cast<int>(i)));
      AddPin(lease.generations.back());
    }
    Result<size_t> count = cache_->leases().BlockCount(lease.id, instance);
    ASSERT_TRUE(count.ok()) << count.status();
    ASSERT_EQ(*count, hits);
    leases_.push_back(std::move(lease));
    Saw("query hit");
  }

  // Valid, wrong-owner, double, stale and never-issued releases (and consumes of dead ids).
  void DoRelease() {
    const uint64_t variant = Uniform(8);
    if ((variant <= 1 || variant >= 6) && !leases_.empty()) {
      const size_t i = Uniform(leases_.size());
      const LiveLease lease = leases_[i];
      ASSERT_NO_FATAL_FAILURE(CheckWhole(lease.generations));
      ASSERT_TRUE(cache_->ReleaseLease(lease.owner, lease.id).ok());
      ASSERT_NO_FATAL_FAILURE(DropPins(lease.generations));
      RetireLease(i);
      if (variant == 1) {
        ASSERT_EQ(cache_->ReleaseLease(lease.owner, lease.id).code(), StatusCode::kFailedPrecondition);
      }
    } else if (variant == 2 && !leases_.empty()) {
      const LiveLease& lease = leases_[Uniform(leases_.size())];
      const uint64_t other = lease.owner % kInstances + 1;
      ASSERT_EQ(cache_->ReleaseLease(other, lease.id).code(), StatusCode::kPermissionDenied);
      ASSERT_EQ(cache_->ConsumeLease(other, lease.id).status().code(), StatusCode::kPermissionDenied);
    } else if (variant == 3 && !retired_.empty()) {
      const LeaseId id = retired_[Uniform(retired_.size())];
      const uint64_t owner = RandomInstance();
      ASSERT_EQ(cache_->ReleaseLease(owner, id).code(), StatusCode::kFailedPrecondition);
      ASSERT_EQ(cache_->ConsumeLease(owner, id).status().code(), StatusCode::kFailedPrecondition);
      Saw("stale release");
    } else {
      const LeaseId never{static_cast<uint32_t>(1000 + Uniform(1000)), 1};
      ASSERT_EQ(cache_->ReleaseLease(RandomInstance(), never).code(), StatusCode::kFailedPrecondition);
      ASSERT_EQ(cache_->ReleaseLease(RandomInstance(), LeaseId{}).code(), StatusCode::kFailedPrecondition);
    }
  }

  void DoConsume() {
    if (leases_.empty() || uses_.size() >= kMaxUses) return;
    const size_t i = Uniform(leases_.size());
    const LiveLease lease = leases_[i];
    Result<LeaseUse> use = cache_->ConsumeLease(lease.owner, lease.id);
    ASSERT_TRUE(use.ok()) << use.status();
    RetireLease(i);
    ASSERT_EQ(use->owner(), lease.owner);
    ASSERT_EQ(use->pins().size(), lease.generations.size());
    for (size_t k = 0; k < lease.generations.size(); ++k) {
      const Publication& pub = Pub(lease.generations[k]);
      ASSERT_NO_FATAL_FAILURE(CheckPin(use->pins()[k], pub));
      ASSERT_TRUE(CheckStamp(use->pins()[k].data(), pub.bytes, pub.stamp));
    }
    ASSERT_EQ(cache_->ConsumeLease(lease.owner, lease.id).status().code(), StatusCode::kFailedPrecondition);
    uses_.push_back(LiveUse{std::move(*use), lease.generations, lease.reserved});
    Saw("consume");
  }

  void DoResetUse() {
    if (uses_.empty()) return;
    const size_t i = Uniform(uses_.size());
    LiveUse use = std::move(uses_[i]);
    uses_.erase(uses_.begin() + static_cast<std::ptrdiff_t>(i));
    ASSERT_NO_FATAL_FAILURE(CheckWhole(use.generations));
    // Half the time the copy completes through Reset (twice: the second is a no-op), otherwise the
    // LeaseUse is simply destroyed.
    if (Chance(0.5)) {
      use.use.Reset();
      ASSERT_TRUE(use.use.pins().empty());
      use.use.Reset();
    }
    ASSERT_NO_FATAL_FAILURE(DropPins(use.generations));
  }

  void DoCleanup() {
    const uint64_t instance = RandomInstance();
    std::vector<uint64_t> generations;
    size_t expected = 0;
    for (const LiveLease& lease : leases_) {
      if (lease.owner != instance) continue;
      generations.insert(generations.end(), lease.generations.begin(), lease.generations.end());
      ++expected;
    }
    ASSERT_NO_FATAL_FAILURE(CheckWhole(generations));
    ASSERT_EQ(cache_->CleanupInstance(instance), expected);
    if (expected > 0) Saw("cleanup released leases");
    ASSERT_NO_FATAL_FAILURE(DropPins(generations));
    for (size_t k = leases_.size(); k-- > 0;) {
      if (leases_[k].owner == instance) RetireLease(k);
    }
  }

  void DoRemove() {
    const int key = RandomKey();
    if (Chance(0.2)) {
      const Status status = cache_->table().Remove(keys_[key], Tier::kSsd);
      if (ssd_.count(key) == 0) {
        ASSERT_EQ(status.code(), StatusCode::kNotFound);
      } else {
        ASSERT_TRUE(status.ok()) << status;
        ssd_.erase(key);
      }
      return;
    }
    const TransitionCause cause = Chance(0.5) ? TransitionCause::kCleanup : TransitionCause::kEvict;
    const Status status = cache_->table().Remove(keys_[key], Tier::kDram, cause);
    if (resident_.count(key) == 0) {
      ASSERT_EQ(status.code(), StatusCode::kNotFound);
      return;
    }
    ASSERT_TRUE(status.ok()) << status;
    if (Pub(resident_.at(key)).pins > 0) Saw("removed while pinned");
    ASSERT_NO_FATAL_FAILURE(Unpublish(key, cause));
  }

  void DoEvict() {
    const uint64_t asked = Uniform(4 * kUnit);
    const uint64_t returned = cache_->table().EvictBytes(asked);
    uint64_t evicted = 0;
    ASSERT_NO_FATAL_FAILURE(TakeEvictions(&evicted));
    ASSERT_EQ(returned, evicted);
    if (returned > 0) Saw("evict bytes");
    if (returned < asked) {
      ASSERT_TRUE(AllResidentPinned()) << "EvictBytes stopped early";
    }
    const std::vector<uint64_t>& sizes = GetParam().config.block_sizes;
    ASSERT_LT(returned, asked + *std::max_element(sizes.begin(), sizes.end())) << "EvictBytes overshot";
  }

  void DoPublishSsd() {
    const int key = RandomKey();
    const uint64_t locator = rng_();
    const uint64_t bytes = 1 + Uniform(kUnit);
    const uint64_t generation = cache_->table().PublishSsd(keys_[key], locator, bytes);
    ASSERT_GT(generation, last_generation_);
    last_generation_ = generation;
    if (ssd_.count(key) > 0) retired_ssd_.emplace_back(key, ssd_[key].generation);
    ssd_[key] = SsdResidence{generation, locator, bytes};
    const std::optional<SsdResidence> found = cache_->table().FindSsd(keys_[key]);
    ASSERT_TRUE(found.has_value());
    ASSERT_EQ(found->generation, generation);
    ASSERT_EQ(found->locator, locator);
    ASSERT_EQ(found->bytes, bytes);
  }

  void DoDropSsd() {
    int key = RandomKey();
    uint64_t generation = 1 + Uniform(last_generation_ + 1);
    if (Chance(0.5) && !ssd_.empty()) {
      auto it = std::next(ssd_.begin(), static_cast<std::ptrdiff_t>(Uniform(ssd_.size())));
      key = it->first;
      generation = it->second.generation;
    } else if (Chance(0.5) && !retired_ssd_.empty()) {
      std::tie(key, generation) = retired_ssd_[Uniform(retired_ssd_.size())];
    }
    const Status status = cache_->table().DropSsd(keys_[key], generation, TransitionCause::kCleanup);
    auto it = ssd_.find(key);
    if (it == ssd_.end()) {
      ASSERT_EQ(status.code(), StatusCode::kNotFound) << status;
      ASSERT_FALSE(cache_->table().FindSsd(keys_[key]).has_value());
    } else if (it->second.generation != generation) {
      ASSERT_EQ(status.code(), StatusCode::kAborted) << status;
      Saw("stale ssd drop");
    } else {
      ASSERT_TRUE(status.ok()) << status;
      retired_ssd_.emplace_back(key, generation);
      ssd_.erase(it);
    }
  }

  void DoPin() {
    if (pins_.size() >= kMaxDirectPins) return;
    const int key = RandomKey();
    Result<BlockPin> pin = cache_->table().Pin(keys_[key]);
    if (resident_.count(key) == 0) {
      ASSERT_EQ(pin.status().code(), StatusCode::kNotFound);
      return;
    }
    ASSERT_TRUE(pin.ok()) << pin.status();
    const uint64_t generation = resident_.at(key);
    ASSERT_NO_FATAL_FAILURE(CheckPin(*pin, Pub(generation)));
    AddPin(generation);
    pins_.push_back(DirectPin{std::move(*pin), generation});
  }

  // Re-pins by ref: refs of past publications (stale unless still published), of blocks being
  // written (invisible) and out-of-range refs.
  void DoPinRef() {
    if (pins_.size() >= kMaxDirectPins) return;
    BlockRef ref;
    const uint64_t variant = Uniform(8);
    if (variant == 0) {
      ref = BlockRef{cache_->table().shard_count() + static_cast<uint32_t>(Uniform(3)), 0, 1};
    } else if (variant == 1) {
      ref = BlockRef{0, 1u << 20, 1};
    } else if (variant == 2 && !writers_.empty()) {
      ref = writers_[Uniform(writers_.size())].writer.ref();
    } else if (!old_refs_.empty()) {
      ref = old_refs_[old_refs_.size() - 1 - Uniform(std::min<size_t>(old_refs_.size(), 64))];
    } else {
      return;
    }
    Result<BlockPin> pin = cache_->table().PinRef(ref);
    if (variant <= 1) {
      ASSERT_EQ(pin.status().code(), StatusCode::kInvalidArgument) << pin.status();
      return;
    }
    auto it = std::find_if(resident_.begin(), resident_.end(),
                           [&](const auto& kv) { return publications_.at(kv.second).ref == ref; });
    if (it == resident_.end()) {
      ASSERT_EQ(pin.status().code(), StatusCode::kAborted) << pin.status();
      Saw(variant == 2 ? "pin ref of a writer" : "pin ref stale");
      return;
    }
    Saw("pin ref hit");
    ASSERT_TRUE(pin.ok()) << pin.status();
    ASSERT_NO_FATAL_FAILURE(CheckPin(*pin, Pub(it->second)));
    AddPin(it->second);
    pins_.push_back(DirectPin{std::move(*pin), it->second});
  }

  // Pins every resident block, then publishes: with nothing evictable the pool must either still
  // have room or refuse with ResourceExhausted. The pins drain through later Unpin steps.
  void DoPinAll() {
    for (const auto& [key, generation] : resident_) {
      Result<BlockPin> pin = cache_->table().Pin(keys_[key]);
      ASSERT_TRUE(pin.ok()) << pin.status();
      ASSERT_NO_FATAL_FAILURE(CheckPin(*pin, Pub(generation)));
      AddPin(generation);
      pins_.push_back(DirectPin{std::move(*pin), generation});
    }
    for (int i = 0; i < 3; ++i) ASSERT_NO_FATAL_FAILURE(DoPublish());
  }

  // Releases one direct pin, or half of them after a PinAll.
  void DoUnpin() {
    const size_t count = pins_.size() > kMaxDirectPins ? pins_.size() / 2 : 1;
    for (size_t n = 0; n < count && !pins_.empty(); ++n) {
      const size_t i = Uniform(pins_.size());
      DirectPin pin = std::move(pins_[i]);
      pins_.erase(pins_.begin() + static_cast<std::ptrdiff_t>(i));
      ASSERT_NO_FATAL_FAILURE(CheckWhole({pin.generation}));
      if (Chance(0.5)) {  // otherwise the pin is released by its destructor
        pin.pin.Reset();
        ASSERT_FALSE(pin.pin.valid());
      }
      ASSERT_NO_FATAL_FAILURE(DropPins({pin.generation}));
    }
  }

  void DoRemoveAll() {
    ASSERT_EQ(cache_->table().RemoveAllDram(), resident_.size());
    while (!resident_.empty()) Unpublish(resident_.begin()->first, TransitionCause::kCleanup);
  }

  void DoLookup() {
    const int chain = static_cast<int>(Uniform(kChains));
    const std::span<const StateKey> keys(keys_.data() + chain * kChainLength, kChainLength);
    ASSERT_EQ(cache_->table().LookupPrefix(keys), ResidentPrefix(chain, kChainLength));
    std::vector<Residence> tiers;
    const size_t found = cache_->table().LookupPrefixTiers(keys, &tiers);
    std::vector<Residence> expected;
    for (int i = 0; i < kChainLength; ++i) {
      const int key = chain * kChainLength + i;
      if (resident_.count(key) > 0) {
        expected.push_back(Residence::kDram);
      } else if (ssd_.count(key) > 0) {
        expected.push_back(Residence::kSsd);
      } else {
        break;
      }
    }
    ASSERT_EQ(found, expected.size());
    ASSERT_EQ(tiers, expected);
  }

  void DoSealOpen() { DoSealOrAbortOpen(/*seal=*/true); }
  void DoAbortOpen() { DoSealOrAbortOpen(/*seal=*/false); }

  struct Operation {
    void (BlockCacheModelTest::*run)();
    const char* name;
    double weight;  // relative frequency
  };
  static std::span<const Operation> Operations() {
    using T = BlockCacheModelTest;
    static constexpr Operation kOperations[] = {
        {&T::DoPublish, "Publish", 30},
        {&T::DoSealOpen, "SealOpen", 5},
        {&T::DoAbortOpen, "AbortOpen", 3},
        {&T::DoQuery, "Query", 20},
        {&T::DoRelease, "Release", 10},
        {&T::DoConsume, "Consume", 6},
        {&T::DoResetUse, "ResetUse", 6},
        {&T::DoCleanup, "Cleanup", 2},
        {&T::DoRemove, "Remove", 3},
        {&T::DoEvict, "Evict", 2},
        {&T::DoPublishSsd, "PublishSsd", 4},
        {&T::DoDropSsd, "DropSsd", 4},
        {&T::DoPin, "Pin", 4},
        {&T::DoPinRef, "PinRef", 4},
        {&T::DoUnpin, "Unpin", 5},
        {&T::DoRemoveAll, "RemoveAll", 0.3},
        {&T::DoLookup, "Lookup", 3},
        {&T::DoPinAll, "PinAll", 0.5},
    };
    return kOperations;
  }

  // ---- invariants ----

  void CheckPin(const BlockPin& pin, const Publication& pub) {
    ASSERT_TRUE(pin.valid());
    ASSERT_EQ(pin.generation(), pub.generation);
    ASSERT_EQ(pin.bytes(), pub.bytes);
    ASSERT_EQ(pin.data(), pub.data);
    ASSERT_EQ(pin.ref(), pub.ref);
  }

  // Every referenced block (published or pinned) and every open writer owns a distinct range of the
  // pool; `extra` is a range about to be handed to a writer.
  void CheckDisjoint(const uint8_t* extra = nullptr, uint64_t extra_bytes = 0) {
    std::vector<std::pair<const uint8_t*, uint64_t>> ranges;
    for (const auto& [generation, pub] : publications_) ranges.emplace_back(pub.data, pub.bytes);
    for (const OpenWriter& open : writers_) {
      ranges.emplace_back(open.writer.data(), open.writer.bytes());
    }
    if (extra != nullptr) ranges.emplace_back(extra, extra_bytes);
    std::sort(ranges.begin(), ranges.end());
    for (size_t i = 1; i < ranges.size(); ++i) {
      ASSERT_LE(ranges[i - 1].first + ranges[i - 1].second, ranges[i].first) << "two live blocks overlap";
    }
  }

  void CheckPayloads(bool whole) {
    for (const auto& [generation, pub] : publications_) {
      ASSERT_TRUE(CheckStamp(pub.data, whole ? pub.bytes : std::min(pub.bytes, kHeadCheckBytes), pub.stamp))
          << "bytes of generation " << generation << " (key " << pub.key << ", " << pub.pins << " pins, published "
          << pub.published << ") changed";
    }
    for (const DirectPin& pin : pins_) {
      ASSERT_NO_FATAL_FAILURE(CheckPin(pin.pin, Pub(pin.generation)));
    }
    for (const LiveUse& use : uses_) {
      ASSERT_EQ(use.use.pins().size(), use.generations.size());
      for (size_t k = 0; k < use.generations.size(); ++k) {
        ASSERT_NO_FATAL_FAILURE(CheckPin(use.use.pins()[k], Pub(use.generations[k])));
      }
    }
  }

  void CheckAccounting() {
    uint64_t requested = 0;
    uint64_t allocated = 0;
    uint64_t pinned = 0;
    uint64_t unpublished = 0;
    for (const auto& [generation, pub] : publications_) {
      requested += pub.bytes;
      allocated += cache_->pool().ClassBytes(pub.bytes);
      pinned += pub.pins > 0 ? 1 : 0;
      unpublished += pub.published ? 0 : 1;
    }
    for (const OpenWriter& open : writers_) {
      requested += open.writer.bytes();
      allocated += cache_->pool().ClassBytes(open.writer.bytes());
    }
    uint64_t resident_bytes = 0;
    for (const auto& [key, generation] : resident_) {
      resident_bytes += publications_.at(generation).bytes;
    }
    uint64_t ssd_bytes = 0;
    for (const auto& [key, ssd] : ssd_) ssd_bytes += ssd.bytes;

    const PoolStats pool = cache_->pool().Stats();
    ASSERT_EQ(pool.requested_bytes, requested);
    ASSERT_EQ(pool.allocated_bytes, allocated);
    ASSERT_EQ(pool.blocks_in_use, publications_.size() + writers_.size());
    const BlockTableStats table = cache_->table().Stats();
    ASSERT_EQ(table.resident_blocks, resident_.size());
    ASSERT_EQ(table.resident_bytes, resident_bytes);
    ASSERT_EQ(table.pinned_blocks, pinned);
    ASSERT_EQ(table.preparing_blocks, writers_.size());
    ASSERT_EQ(table.unpublished_blocks, unpublished);
    ASSERT_EQ(table.ssd_residences, ssd_.size());
    ASSERT_EQ(table.ssd_bytes, ssd_bytes);

    uint64_t reserved = 0;
    for (uint64_t owner = 1; owner <= kInstances; ++owner) {
      ASSERT_EQ(cache_->query_budget().reserved_bytes(owner), ReservedBy(owner)) << "instance " << owner;
      reserved += ReservedBy(owner);
    }
    ASSERT_EQ(cache_->query_budget().reserved_bytes(), reserved);
    ASSERT_EQ(cache_->query_budget().tickets(), leases_.size() + uses_.size());
    ASSERT_EQ(cache_->leases().active(), leases_.size());
    ASSERT_EQ(cache_->inventory().ReplicaCount(Tier::kDram), table.resident_blocks);
    ASSERT_EQ(cache_->inventory().ReplicaCount(Tier::kSsd), table.ssd_residences);

    ASSERT_EQ(GaugeNamed("orbitkv_leases_active").Value(), static_cast<double>(leases_.size()));
    ASSERT_EQ(GaugeNamed("orbitkv_cache_pinned_blocks").Value(), static_cast<double>(pinned));
    ASSERT_EQ(GaugeNamed("orbitkv_budget_reserved_bytes", {{"budget", "query"}}).Value(),
              static_cast<double>(reserved));
    ASSERT_EQ(GaugeNamed("orbitkv_cache_resident_blocks", {{"tier", "dram"}}).Value(),
              static_cast<double>(resident_.size()));
    ASSERT_EQ(GaugeNamed("orbitkv_cache_resident_bytes", {{"tier", "dram"}}).Value(),
              static_cast<double>(resident_bytes));
    ASSERT_EQ(GaugeNamed("orbitkv_pool_requested_bytes").Value(), static_cast<double>(requested));
  }

  void CheckAll(bool whole_payloads) {
    std::map<int, Replica> dram;
    std::map<int, Replica> ssd;
    InventoryReplicas(&dram, &ssd);
    ASSERT_EQ(dram, ModelDram()) << "DRAM residency differs from the model";
    ASSERT_EQ(ssd, ModelSsd()) << "SSD residency differs from the model";
    ASSERT_NO_FATAL_FAILURE(CheckAccounting());
    ASSERT_NO_FATAL_FAILURE(CheckPayloads(whole_payloads));
    ASSERT_NO_FATAL_FAILURE(CheckDisjoint());
  }

  // Replays every inventory journal from sequence 0 and compares the result with the model; also
  // checks sequences, the cause of every DRAM record and that SSD republication is recorded as a
  // replacement.
  void CheckJournalReplay() {
    std::map<int, Replica> dram;
    std::map<int, Replica> ssd;
    for (uint32_t shard = 0; shard < cache_->inventory().shard_count(); ++shard) {
      Result<JournalRead> read = cache_->inventory().ReadJournal(shard, 0, std::numeric_limits<size_t>::max());
      ASSERT_TRUE(read.ok()) << read.status();
      ASSERT_EQ(read->records.size(), read->watermark) << "shard " << shard;
      for (size_t i = 0; i < read->records.size(); ++i) {
        const ResidencyRecord& record = read->records[i];
        ASSERT_EQ(record.sequence, i + 1);
        ASSERT_EQ(cache_->inventory().ShardFor(record.key), shard);
        const int key = key_index_.at(record.key);
        std::map<int, Replica>& view = record.tier == Tier::kDram ? dram : ssd;
        if (!record.present) {
          ASSERT_EQ(view.count(key), 1u) << "journal removes a replica it never added";
          ASSERT_EQ(view[key], (Replica{record.generation, record.bytes}));
          view.erase(key);
          if (record.tier == Tier::kDram) {
            ASSERT_EQ(history_.at(record.generation).removed, record.cause);
          }
          continue;
        }
        if (record.tier == Tier::kDram) {
          ASSERT_EQ(view.count(key), 0u) << "DRAM residence published twice";
          ASSERT_EQ(history_.at(record.generation).admitted, record.cause);
        } else {
          ASSERT_EQ(record.cause, view.count(key) > 0 ? TransitionCause::kReplace : TransitionCause::kAdmit);
        }
        view[key] = Replica{record.generation, record.bytes};
      }
    }
    ASSERT_EQ(dram, ModelDram());
    ASSERT_EQ(ssd, ModelSsd());
  }

  // Releases every lease, use, pin and writer, checks that nothing stays charged, then empties both
  // tiers.
  void ReleaseEverything() {
    ASSERT_NO_FATAL_FAILURE(CheckPayloads(/*whole=*/true));
    writers_.clear();
    std::vector<uint64_t> generations;
    for (uint64_t owner = 1; owner <= kInstances; ++owner) {
      const size_t owned = static_cast<size_t>(
          std::count_if(leases_.begin(), leases_.end(), [&](const LiveLease& lease) { return lease.owner == owner; }));
      ASSERT_EQ(cache_->CleanupInstance(owner), owned);
    }
    for (const LiveLease& lease : leases_) {
      generations.insert(generations.end(), lease.generations.begin(), lease.generations.end());
    }
    while (!leases_.empty()) RetireLease(leases_.size() - 1);
    for (const LiveUse& use : uses_) {
      generations.insert(generations.end(), use.generations.begin(), use.generations.end());
    }
    uses_.clear();
    for (const DirectPin& pin : pins_) generations.push_back(pin.generation);
    pins_.clear();
    ASSERT_NO_FATAL_FAILURE(DropPins(generations));
    ASSERT_NO_FATAL_FAILURE(CheckAll(/*whole_payloads=*/true));
    ASSERT_EQ(cache_->leases().active(), 0u);
    ASSERT_EQ(cache_->query_budget().reserved_bytes(), 0u);
    ASSERT_EQ(cache_->query_budget().tickets(), 0u);
    ASSERT_EQ(cache_->table().Stats().pinned_blocks, 0u);
    ASSERT_EQ(cache_->table().Stats().unpublished_blocks, 0u);
    ASSERT_EQ(cache_->table().Stats().preparing_blocks, 0u);

    ASSERT_NO_FATAL_FAILURE(DoRemoveAll());
    while (!ssd_.empty()) {
      const auto [key, residence] = *ssd_.begin();
      ASSERT_TRUE(cache_->table().DropSsd(keys_[key], residence.generation, TransitionCause::kCleanup).ok());
      ssd_.erase(key);
    }
    ASSERT_NO_FATAL_FAILURE(CheckAll(/*whole_payloads=*/true));
    const PoolStats pool = cache_->pool().Stats();
    ASSERT_EQ(pool.blocks_in_use, 0u);
    ASSERT_EQ(pool.allocated_bytes, 0u);
    ASSERT_EQ(pool.free_slabs, pool.total_slabs);
    ASSERT_EQ(cache_->inventory().ReplicaCount(Tier::kDram), 0u);
    ASSERT_EQ(cache_->inventory().ReplicaCount(Tier::kSsd), 0u);
    for (const char* gauge : {"orbitkv_leases_active", "orbitkv_cache_pinned_blocks", "orbitkv_pool_allocated_bytes",
                              "orbitkv_pool_requested_bytes"}) {
      EXPECT_EQ(GaugeNamed(gauge).Value(), 0.0) << gauge;
    }
    EXPECT_EQ(GaugeNamed("orbitkv_budget_reserved_bytes", {{"budget", "query"}}).Value(), 0.0);
    EXPECT_EQ(GaugeNamed("orbitkv_budget_tickets", {{"budget", "query"}}).Value(), 0.0);
    EXPECT_EQ(GaugeNamed("orbitkv_cache_resident_blocks", {{"tier", "dram"}}).Value(), 0.0);
    EXPECT_EQ(GaugeNamed("orbitkv_cache_resident_bytes", {{"tier", "ssd"}}).Value(), 0.0);
  }

  MetricsRegistry metrics_;
  std::unique_ptr<BlockCache> cache_;
  std::mt19937_64 rng_;
  std::discrete_distribution<size_t> op_distribution_;
  std::vector<StateKey> keys_;
  std::unordered_map<StateKey, int, state::StateKeyHash> key_index_;

  // The model. Declared after cache_ so that everything holding pins is destroyed first.
  // By generation: every publication still published, or unpublished and still pinned.
  std::map<uint64_t, Publication> publications_;
  // Key -> generation of its DRAM residence.
  std::map<int, uint64_t> resident_;
  // Every DRAM generation ever sealed.
  std::map<uint64_t, History> history_;
  std::map<int, SsdResidence> ssd_;
  // (key, generation) of SSD residences since replaced or dropped.
  std::vector<std::pair<int, uint64_t>> retired_ssd_;
  std::vector<LiveLease> leases_;
  std::vector<LeaseId> retired_;
  std::vector<LiveUse> uses_;
  std::vector<DirectPin> pins_;
  std::vector<OpenWriter> writers_;
  std::vector<BlockRef> old_refs_;
  uint64_t last_generation_ = 0;
  uint64_t publication_count_ = 0;
  std::map<std::string, int> seen_;
};

// The outcomes every run must reach, so a passing run exercised the interesting paths.
constexpr const char* kRequiredOutcomes[] = {"prepare evicted",
                                             "prepare exhausted",
                                             "prepare while writing",
                                             "query hit",
                                             "query backpressure",
                                             "query cut to what fits",
                                             "consume",
                                             "cleanup released leases",
                                             "stale release",
                                             "removed while pinned",
                                             "evict bytes",
                                             "pin ref hit",
                                             "pin ref stale",
                                             "pin ref of a writer",
                                             "stale ssd drop"};

TEST_P(BlockCacheModelTest, RandomOperationsMatchTheModel) {
  // kSteps steps, continued (up to 4x) until every required outcome was reached: the random walk
  // depends on replacement decisions, so a change in eviction order may move where an outcome first
  // happens.
  auto all_seen = [this] {
    for (const char* outcome : kRequiredOutcomes) {
      if (seen_[outcome] == 0) return false;
    }
    return true;
  };
  int step = 0;
  for (; step < kSteps || (!all_seen() && step < 4 * kSteps); ++step) {
    const Operation& op = Operations()[op_distribution_(rng_)];
    SCOPED_TRACE(fmt::format("seed {} step {} op {}", GetParam().seed, step, op.name));
    ASSERT_NO_FATAL_FAILURE((this->*op.run)());
    ASSERT_NO_FATAL_FAILURE(CheckAll(/*whole_payloads=*/step % 100 == 0));
    if (step % 500 == 499) {
      ASSERT_NO_FATAL_FAILURE(CheckJournalReplay());
    }
  }
  SCOPED_TRACE(fmt::format("seed {} after {} steps", GetParam().seed, step));
  ASSERT_NO_FATAL_FAILURE(CheckJournalReplay());
  for (const char* outcome : kRequiredOutcomes) {
    EXPECT_GT(seen_[outcome], 0) << "no step reached: " << outcome;
  }
  EXPECT_GT(history_.size(), 100u);
  EXPECT_GT(retired_.size(), 10u);
  ASSERT_NO_FATAL_FAILURE(ReleaseEverything());
  ASSERT_NO_FATAL_FAILURE(CheckJournalReplay());
}

std::vector<ModelParam> Params() {
  const ModelConfig kUniform{"Uniform64K", 1ull << 20, {kUnit}, 4, 0.01};
  const ModelConfig kMixed{"MixedSizes", 3ull << 20, {kUnit, kUnit, 32 * kKiB - 100, 96 * kKiB + 123}, 2, 0.2};
  std::vector<ModelParam> params;
  for (const ModelConfig& config : {kUniform, kMixed}) {
    for (uint64_t seed : {1, 2, 3, 0x5eed}) params.push_back({config, seed});
  }
  return params;
}

INSTANTIATE_TEST_SUITE_P(Seeds, BlockCacheModelTest, ::testing::ValuesIn(Params()),
                         [](const ::testing::TestParamInfo<ModelParam>& param_info) {
                           return fmt::format("{}_seed{}", param_info.param.config.name, param_info.param.seed);
                         });

}  // namespace
}  // namespace orbitkv::core
