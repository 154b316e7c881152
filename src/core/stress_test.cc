// Concurrency stress test of BlockCache, meant to run under TSan: several threads, each an engine
// instance, publish, query, lease, consume, release, pin, remove, evict and clean up over a shared
// key space for a fixed number of iterations (never for a fixed time).
//
// Payloads are content addressed: every block written for a key has a size and bytes derived from
// the key alone, so any thread can verify any block it pins, whoever published it. Every call
// accepts only the outcomes its contract documents. At the end every gauge (leases, reservations,
// pins, pool bytes) must be back at zero.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <latch>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/block_cache.h"
#include "core/test_util.h"

namespace orbitkv::core {
namespace {

using state::StateKey;

constexpr uint64_t kKiB = 1024;
constexpr int kThreads = 6;
constexpr int kIterations = 10000;
constexpr uint64_t kSharedChains = 6;
constexpr uint64_t kPrivateChains = 2;  // per thread
constexpr uint64_t kChainLength = 8;
constexpr size_t kMaxHeldLeases = 3;
constexpr size_t kMaxHeldUses = 2;
constexpr size_t kMaxHeldPins = 3;

// Content addressing: a key's size and stamp depend on (chain, index) only.
uint64_t BytesOf(uint64_t chain, uint64_t index) { return (chain + index) % 3 == 0 ? 12 * kKiB - 100 : 16 * kKiB; }
uint64_t StampOf(uint64_t chain, uint64_t index) { return chain << 16 | index; }

// Every key the threads use, built before they start and read-only afterwards.
class KeySpace {
 public:
  KeySpace() {
    const uint64_t chains = kSharedChains + kThreads * kPrivateChains;
    for (uint64_t chain = 0; chain < chains; ++chain) {
      chains_.push_back(testing::Chain(chain, kChainLength));
      for (uint64_t i = 0; i < kChainLength; ++i) {
        where_.emplace(chains_[chain][i], Where{chain, i});
      }
    }
  }

  std::span<const StateKey> chain(uint64_t chain) const { return chains_[chain]; }
  uint64_t chain_count() const { return chains_.size(); }
  uint64_t private_chain(int thread, uint64_t n) const {
    return kSharedChains + static_cast<uint64_t>(thread) * kPrivateChains + n;
  }

  // True when `data`/`bytes` are exactly what any publisher writes for `key`.
  bool Verify(const StateKey& key, const uint8_t* data, uint64_t bytes) const {
    auto it = where_.find(key);
    if (it == where_.end()) return false;
    const auto [chain, index] = it->second;
    return bytes == BytesOf(chain, index) && testing::CheckStamp(data, bytes, StampOf(chain, index));
  }

 private:
  struct Where {
    uint64_t chain;
    uint64_t index;
  };
  std::vector<std::vector<StateKey>> chains_;
  std::unordered_map<StateKey, Where, state::StateKeyHash> where_;
};

bool OneOf(StatusCode code, std::initializer_list<StatusCode> allowed) {
  for (StatusCode ok : allowed) {
    if (code == ok) return true;
  }
  return false;
}

// Outcomes counted per thread and summed after the join.
struct Tally {
  uint64_t published = 0;
  uint64_t already_exists = 0;
  uint64_t lost_races = 0;  // Prepare answered Aborted: another thread was writing the key
  uint64_t exhausted = 0;
  uint64_t hits = 0;
  uint64_t backpressure = 0;
  uint64_t consumed = 0;
  uint64_t cleaned_up = 0;
  uint64_t repins = 0;

  void Add(const Tally& other) {
    published += other.published;
    already_exists += other.already_exists;
    lost_races += other.lost_races;
    exhausted += other.exhausted;
    hits += other.hits;
    backpressure += other.backpressure;
    consumed += other.consumed;
    cleaned_up += other.cleaned_up;
    repins += other.repins;
  }
};

// One engine instance hammering the cache from its own thread. Only this worker creates leases for
// its instance id, so it knows exactly which of them are live.
class Worker {
 public:
  Worker(BlockCache* cache, const KeySpace* keys, int index)
      : cache_(cache), keys_(keys), index_(index), instance_(100 + static_cast<uint64_t>(index)) {
    rng_.seed(0x57e55 + static_cast<uint64_t>(index));
  }

  void Run(int iterations) {
    for (int i = 0; i < iterations; ++i) Step();
    ReleaseAll();
  }

  const Tally& tally() const { return tally_; }
  uint64_t instance() const { return instance_; }

 private:
  uint64_t Uniform(uint64_t n) { return std::uniform_int_distribution<uint64_t>(0, n - 1)(rng_); }

  uint64_t RandomChain() {
    return Uniform(10) < 7 ? Uniform(kSharedChains) : keys_->private_chain(index_, Uniform(kPrivateChains));
  }
  std::span<const StateKey> RandomPrefix(uint64_t* chain) {
    *chain = RandomChain();
    return keys_->chain(*chain).first(1 + Uniform(kChainLength));
  }
  std::span<const StateKey> RandomPrefix() {
    uint64_t chain = 0;
    return RandomPrefix(&chain);
  }

  void Step() {
    const uint64_t roll = Uniform(100);
    if (roll < 30) {
      Publish();
    } else if (roll < 45) {
      QueryAndConsume();
    } else if (roll < 55) {
      QueryAndRelease();
    } else if (roll < 63) {
      PinAndRepin();
    } else if (roll < 70) {
      DrainSome();
    } else if (roll < 76) {
      Remove();
    } else if (roll < 80) {
      cache_->table().EvictBytes(Uniform(64 * kKiB));
    } else if (roll < 83) {
      Cleanup();
    } else if (roll < 93) {
      Ssd();
    } else if (roll < 99) {
      Lookup();
    } else {
      cache_->table().RemoveAllDram();
    }
  }

  // Publishes a prefix of a chain, as an engine saving pages would; stops at backpressure.
  void Publish() {
    uint64_t chain = 0;
    const std::span<const StateKey> prefix = RandomPrefix(&chain);
    for (uint64_t i = 0; i < prefix.size(); ++i) {
      const uint64_t bytes = BytesOf(chain, i);
      Result<BlockWriter> writer = cache_->Prepare(prefix[i], bytes);
      if (!writer.ok()) {
        const StatusCode code = writer.status().code();
        EXPECT_TRUE(OneOf(code, {StatusCode::kAlreadyExists, StatusCode::kAborted, StatusCode::kResourceExhausted}))
            << "Prepare: " << writer.status();
        tally_.already_exists += code == StatusCode::kAlreadyExists ? 1 : 0;
        tally_.lost_races += code == StatusCode::kAborted ? 1 : 0;
        if (code == StatusCode::kResourceExhausted) {
          ++tally_.exhausted;
          return;
        }
        continue;
      }
      EXPECT_EQ(writer->bytes(), bytes);
      testing::Stamp(writer->data(), bytes, StampOf(chain, i));
      // Widens the window in which another publisher of the same key gets Aborted.
      if (Uniform(4) == 0) std::this_thread::yield();
      if (Uniform(20) == 0) {
        writer->Abort();
        continue;
      }
      EXPECT_GT(cache_->Seal(*writer), 0u);
      ++tally_.published;
    }
  }

  // Queries a prefix; returns the lease (if any) after checking the answer. Backpressure is the
  // only error.
  std::optional<LeaseId> Query(std::span<const StateKey> prefix, size_t* hits) {
    const uint64_t padded = 16 * kKiB + 512 * Uniform(3);
    Result<QueryResult> result = cache_->Query(instance_, prefix, padded);
    *hits = 0;
    if (!result.ok()) {
      EXPECT_EQ(result.status().code(), StatusCode::kResourceExhausted) << result.status();
      ++tally_.backpressure;
      return std::nullopt;
    }
    EXPECT_LE(result->hits, prefix.size());
    EXPECT_EQ(result->lease.has_value(), result->hits > 0);
    if (!result->lease.has_value()) return std::nullopt;
    *hits = result->hits;
    tally_.hits += result->hits;
    Result<size_t> count = cache_->leases().BlockCount(*result->lease, instance_);
    EXPECT_TRUE(count.ok()) << count.status();
    if (count.ok()) {
      EXPECT_EQ(*count, result->hits);
    }
    return result->lease;
  }

  void VerifyPins(std::span<const StateKey> prefix, const LeaseUse& use, size_t hits) {
    ASSERT_EQ(use.pins().size(), hits);
    ASSERT_EQ(use.owner(), instance_);
    for (size_t i = 0; i < hits; ++i) {
      const BlockPin& pin = use.pins()[i];
      ASSERT_TRUE(pin.valid());
      EXPECT_TRUE(keys_->Verify(prefix[i], pin.data(), pin.bytes()))
          << "leased block " << i << " of " << prefix[i].ToString() << " has the wrong bytes";
    }
  }

  void QueryAndConsume() {
    const std::span<const StateKey> prefix = RandomPrefix();
    size_t hits = 0;
    const std::optional<LeaseId> lease = Query(prefix, &hits);
    if (!lease.has_value()) return;
    Result<LeaseUse> use = cache_->ConsumeLease(instance_, *lease);
    ASSERT_TRUE(use.ok()) << "the lease is this thread's and still live: " << use.status();
    ++tally_.consumed;
    VerifyPins(prefix, *use, hits);
    EXPECT_EQ(cache_->ConsumeLease(instance_, *lease).status().code(), StatusCode::kFailedPrecondition);
    if (held_uses_.size() < kMaxHeldUses && Uniform(3) == 0) {
      held_uses_.push_back(HeldUse{std::move(*use), prefix});
    } else {
      use->Reset();
    }
  }

  void QueryAndRelease() {
    const std::span<const StateKey> prefix = RandomPrefix();
    size_t hits = 0;
    const std::optional<LeaseId> lease = Query(prefix, &hits);
    if (!lease.has_value()) return;
    if (held_leases_.size() < kMaxHeldLeases && Uniform(2) == 0) {
      held_leases_.push_back(*lease);
      return;
    }
    EXPECT_TRUE(cache_->ReleaseLease(instance_, *lease).ok());
    EXPECT_EQ(cache_->ReleaseLease(instance_, *lease).code(), StatusCode::kFailedPrecondition);
  }

  // Pins one key, verifies it and re-pins it by ref: the ref stays valid while published, and an
  // unpublished block is refused as stale, never handed out.
  void PinAndRepin() {
    const std::span<const StateKey> prefix = RandomPrefix();
    const StateKey& key = prefix.back();
    Result<BlockPin> pin = cache_->table().Pin(key);
    if (!pin.ok()) {
      EXPECT_EQ(pin.status().code(), StatusCode::kNotFound) << pin.status();
      return;
    }
    EXPECT_TRUE(keys_->Verify(key, pin->data(), pin->bytes()));
    Result<BlockPin> again = cache_->table().PinRef(pin->ref());
    if (again.ok()) {
      ++tally_.repins;
      EXPECT_EQ(again->generation(), pin->generation());
      EXPECT_EQ(again->data(), pin->data());
    } else {
      EXPECT_EQ(again.status().code(), StatusCode::kAborted) << again.status();
    }
    if (held_pins_.size() < kMaxHeldPins) held_pins_.push_back(HeldPin{std::move(*pin), key});
  }

  // Completes held copies, releases held leases and pins, verifying the bytes once more first.
  void DrainSome() {
    if (!held_uses_.empty()) {
      HeldUse& held = held_uses_.back();
      VerifyPins(held.prefix, held.use, held.use.pins().size());
      held_uses_.pop_back();
    }
    if (!held_leases_.empty()) {
      EXPECT_TRUE(cache_->ReleaseLease(instance_, held_leases_.back()).ok());
      held_leases_.pop_back();
    }
    if (!held_pins_.empty()) {
      const HeldPin& held = held_pins_.back();
      EXPECT_TRUE(keys_->Verify(held.key, held.pin.data(), held.pin.bytes()));
      held_pins_.pop_back();
    }
  }

  void Remove() {
    const std::span<const StateKey> prefix = RandomPrefix();
    const Status status = cache_->table().Remove(prefix.back(), Tier::kDram);
    EXPECT_TRUE(OneOf(status.code(), {StatusCode::kOk, StatusCode::kNotFound})) << status;
  }

  // The engine went away: its live leases (exactly the ones this thread holds) are released; copies
  // it already started keep their pins until they complete.
  void Cleanup() {
    EXPECT_EQ(cache_->CleanupInstance(instance_), held_leases_.size());
    tally_.cleaned_up += held_leases_.size();
    for (const LeaseId& lease : held_leases_) {
      EXPECT_EQ(cache_->ReleaseLease(instance_, lease).code(), StatusCode::kFailedPrecondition);
    }
    held_leases_.clear();
  }

  void Ssd() {
    const std::span<const StateKey> prefix = RandomPrefix();
    const StateKey& key = prefix.back();
    const uint64_t roll = Uniform(3);
    if (roll == 0) {
      const uint64_t generation = cache_->table().PublishSsd(key, rng_(), 16 * kKiB);
      EXPECT_GT(generation, 0u);
      ssd_.emplace_back(key, generation);
    } else if (roll == 1 && !ssd_.empty()) {
      const auto [old_key, generation] = ssd_.back();
      ssd_.pop_back();
      const Status status = cache_->table().DropSsd(old_key, generation, TransitionCause::kCleanup);
      // Aborted: another thread republished it; NotFound: another thread dropped or removed it.
      EXPECT_TRUE(OneOf(status.code(), {StatusCode::kOk, StatusCode::kAborted, StatusCode::kNotFound})) << status;
    } else {
      const Status status = cache_->table().Remove(key, Tier::kSsd);
      EXPECT_TRUE(OneOf(status.code(), {StatusCode::kOk, StatusCode::kNotFound})) << status;
    }
  }

  void Lookup() {
    const std::span<const StateKey> prefix = RandomPrefix();
    std::vector<Residence> tiers;
    const size_t found = cache_->table().LookupPrefixTiers(prefix, &tiers);
    EXPECT_LE(found, prefix.size());
    EXPECT_EQ(tiers.size(), found);
    for (Residence tier : tiers) EXPECT_NE(tier, Residence::kMiss);
    EXPECT_LE(cache_->table().LookupPrefix(prefix), prefix.size());
  }

  void ReleaseAll() {
    while (!held_uses_.empty() || !held_leases_.empty() || !held_pins_.empty()) DrainSome();
  }

  struct HeldUse {
    LeaseUse use;
    std::span<const StateKey> prefix;
  };
  struct HeldPin {
    BlockPin pin;
    StateKey key;
  };

  BlockCache* const cache_;
  const KeySpace* const keys_;
  const int index_;
  const uint64_t instance_;
  std::mt19937_64 rng_;
  std::vector<LeaseId> held_leases_;
  std::vector<HeldUse> held_uses_;
  std::vector<HeldPin> held_pins_;
  std::vector<std::pair<StateKey, uint64_t>> ssd_;
  Tally tally_;
};

class BlockCacheStressTest : public ::testing::Test {
 protected:
  void SetUp() override {
    BlockCacheOptions options = testing::SmallCacheOptions(2 << 20, 1 << 20);
    options.table.shards = 4;
    options.table.window_fraction = 0.1;
    // Tight enough that queries meet backpressure (budget and lease table) now and then.
    options.query_budget_bytes = 1 << 20;
    options.query_instance_budget_bytes = 160 * kKiB;
    options.max_leases = 12;
    auto cache = BlockCache::Create(options, &metrics_);
    ASSERT_TRUE(cache.ok()) << cache.status();
    cache_ = std::move(*cache);
    // Runs on whichever thread evicts, with no lock held: the evicted block must still carry its
    // key's bytes.
    cache_->table().SetEvictionListener([this](const StateKey& key, BlockPin pin) {
      EXPECT_TRUE(keys_.Verify(key, pin.data(), pin.bytes())) << "evicted " << key.ToString();
      // Relaxed: only read after the threads are joined.
      evictions_seen_.fetch_add(1, std::memory_order_relaxed);
    });
  }

  double GaugeValue(const char* name, MetricLabels labels = {}) {
    return metrics_.GetGauge(name, "", std::move(labels)).Value();
  }

  MetricsRegistry metrics_;
  KeySpace keys_;
  std::atomic<uint64_t> evictions_seen_{0};
  std::unique_ptr<BlockCache> cache_;
};

TEST_F(BlockCacheStressTest, ManyThreadsEndWithEveryGaugeAtZero) {
  std::vector<std::unique_ptr<Worker>> workers;
  for (int i = 0; i < kThreads; ++i) {
    workers.push_back(std::make_unique<Worker>(cache_.get(), &keys_, i));
  }
  std::latch start(kThreads);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      start.arrive_and_wait();
      workers[static_cast<size_t>(i)]->Run(kIterations);
    });
  }
  for (std::thread& thread : threads) thread.join();

  Tally total;
  for (const auto& worker : workers) total.Add(worker->tally());
  for (const auto& [name, value] : {std::pair{"published", total.published},
                                    {"already_exists", total.already_exists},
                                    {"lost_races", total.lost_races},
                                    {"exhausted", total.exhausted},
                                    {"hits", total.hits},
                                    {"backpressure", total.backpressure},
                                    {"consumed", total.consumed},
                                    {"cleaned_up", total.cleaned_up},
                                    {"repins", total.repins},
                                    {"evictions", evictions_seen_.load(std::memory_order_relaxed)}}) {
    RecordProperty(name, fmt::format("{}", value));
  }
  EXPECT_GT(total.published, 0u);
  EXPECT_GT(total.hits, 0u);
  EXPECT_GT(total.consumed, 0u);

  // Every thread released what it held: nothing is leased, reserved or pinned.
  EXPECT_EQ(cache_->leases().active(), 0u);
  EXPECT_EQ(cache_->query_budget().reserved_bytes(), 0u);
  EXPECT_EQ(cache_->query_budget().tickets(), 0u);
  for (int i = 0; i < kThreads; ++i) {
    EXPECT_EQ(cache_->query_budget().reserved_bytes(workers[static_cast<size_t>(i)]->instance()), 0u);
  }
  BlockTableStats table = cache_->table().Stats();
  EXPECT_EQ(table.pinned_blocks, 0u);
  EXPECT_EQ(table.preparing_blocks, 0u);
  EXPECT_EQ(table.unpublished_blocks, 0u);
  // What the pool still holds is exactly the resident blocks, and the inventory agrees with the
  // table.
  EXPECT_EQ(cache_->pool().Stats().requested_bytes, table.resident_bytes);
  EXPECT_EQ(cache_->pool().Stats().blocks_in_use, table.resident_blocks);
  EXPECT_EQ(cache_->inventory().ReplicaCount(Tier::kDram), table.resident_blocks);
  EXPECT_EQ(cache_->inventory().ReplicaCount(Tier::kSsd), table.ssd_residences);

  // Every block still resident carries its key's bytes.
  for (uint64_t chain = 0; chain < keys_.chain_count(); ++chain) {
    for (const StateKey& key : keys_.chain(chain)) {
      Result<BlockPin> pin = cache_->table().Pin(key);
      if (pin.ok()) {
        EXPECT_TRUE(keys_.Verify(key, pin->data(), pin->bytes())) << key.ToString();
      } else {
        EXPECT_EQ(pin.status().code(), StatusCode::kNotFound) << pin.status();
      }
    }
  }
  EXPECT_EQ(cache_->table().RemoveAllDram(), table.resident_blocks);
  for (uint64_t chain = 0; chain < keys_.chain_count(); ++chain) {
    for (const StateKey& key : keys_.chain(chain)) {
      const std::optional<SsdResidence> ssd = cache_->table().FindSsd(key);
      if (ssd.has_value()) {
        EXPECT_TRUE(cache_->table().DropSsd(key, ssd->generation, TransitionCause::kCleanup).ok());
      }
    }
  }
  table = cache_->table().Stats();
  EXPECT_EQ(table.resident_blocks, 0u);
  EXPECT_EQ(table.ssd_residences, 0u);
  const PoolStats pool = cache_->pool().Stats();
  EXPECT_EQ(pool.blocks_in_use, 0u);
  EXPECT_EQ(pool.allocated_bytes, 0u);
  EXPECT_EQ(pool.free_slabs, pool.total_slabs);
  EXPECT_EQ(cache_->inventory().ReplicaCount(Tier::kDram), 0u);
  EXPECT_EQ(cache_->inventory().ReplicaCount(Tier::kSsd), 0u);

  EXPECT_EQ(GaugeValue("orbitkv_leases_active"), 0.0);
  EXPECT_EQ(GaugeValue("orbitkv_cache_pinned_blocks"), 0.0);
  EXPECT_EQ(GaugeValue("orbitkv_budget_reserved_bytes", {{"budget", "query"}}), 0.0);
  EXPECT_EQ(GaugeValue("orbitkv_budget_tickets", {{"budget", "query"}}), 0.0);
  EXPECT_EQ(GaugeValue("orbitkv_pool_allocated_bytes"), 0.0);
  EXPECT_EQ(GaugeValue("orbitkv_pool_requested_bytes"), 0.0);
  EXPECT_EQ(GaugeValue("orbitkv_cache_resident_blocks", {{"tier", "dram"}}), 0.0);
  EXPECT_EQ(GaugeValue("orbitkv_cache_resident_bytes", {{"tier", "dram"}}), 0.0);
  EXPECT_EQ(GaugeValue("orbitkv_cache_resident_bytes", {{"tier", "ssd"}}), 0.0);
}

}  // namespace
}  // namespace orbitkv::core
