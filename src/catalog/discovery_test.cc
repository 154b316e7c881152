// Discovery over an in-process transport (catalog hosts played by the test: the fault it needs, a host that is
// down or too slow, the real gRPC cannot produce on demand): warm queries make no RPC, cold ones batch per host,
// the host cap holds, a failing host's breaker makes later queries skip it, empty rows are asked again.
#include "catalog/discovery.h"

#include <gtest/gtest.h>

#include <atomic>
#include <initializer_list>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "core/test_util.h"

namespace orbitkv::catalog {
namespace {

using std::chrono::milliseconds;

class FakeHosts final : public LookupTransport {
 public:
  std::set<std::string> down, slow, empty;
  std::map<std::string, Status> refuses;  // host -> the route refusal it answers with
  std::set<std::string> incomplete;       // answers rows without holders, marked incomplete
  std::set<std::string> misses;           // answers rows without holders, marked complete (authoritative)
  std::map<std::string, int> late_ms;     // answers, this many ms late
  std::atomic<int> cancelled{0};          // calls to a slow host its caller cancelled

  // Whether every host of `names` was asked at least once.
  bool AskedEach(std::initializer_list<const char*> names) {
    std::lock_guard<std::mutex> lock(asked_mu);
    for (const char* name : names) {
      if (asked[name] < 1) return false;
    }
    return true;
  }
  std::mutex asked_mu;
  std::map<std::string, int> asked;                                // host -> Lookup RPCs
  std::map<std::string, std::chrono::milliseconds> longest_given;  // host -> the longest deadline it was given
  std::atomic<int> rpcs{0}, in_flight{0}, max_in_flight{0};
  std::atomic<size_t> largest_batch{0};
  int slow_ms = 2;

  Result<std::vector<LookupRow>> Lookup(const std::string& host, std::span<const state::StateKey> keys,
                                        Deadline deadline, CallCancel* cancel) override {
    if (cancel != nullptr && !cancel->Arm([] {})) return Status::Cancelled("cancelled before the call");
    rpcs.fetch_add(1);
    {
      std::lock_guard<std::mutex> lock(asked_mu);
      ++asked[host];
      auto given = std::chrono::duration_cast<std::chrono::milliseconds>(deadline.Remaining());
      longest_given[host] = std::max(longest_given[host], given);
    }
    const int now = in_flight.fetch_add(1) + 1;
    for (int seen = max_in_flight.load(); now > seen && !max_in_flight.compare_exchange_weak(seen, now);) {
    }
    size_t batch = largest_batch.load();
    while (keys.size() > batch && !largest_batch.compare_exchange_weak(batch, keys.size())) {
    }
    std::this_thread::sleep_for(milliseconds(slow_ms));  // let hosts (and callers) overlap
    Result<std::vector<LookupRow>> out = Answer(host, keys, deadline, cancel);
    if (cancel != nullptr) cancel->Disarm();
    in_flight.fetch_sub(1);
    return out;
  }

 private:
  Result<std::vector<LookupRow>> Answer(const std::string& host, std::span<const state::StateKey> keys,
                                        Deadline deadline, CallCancel* cancel) {
    if (down.count(host) != 0) return Status::Unavailable(host + " is down");
    if (auto it = refuses.find(host); it != refuses.end()) return it->second;
    if (slow.count(host) != 0) {  // blackholed: answers nothing until its deadline, or its caller cancels
      while (!deadline.Expired()) {
        if (cancel != nullptr && cancel->cancelled()) {
          ++cancelled;
          return Status::Cancelled(host + ": cancelled by the caller");
        }
        std::this_thread::sleep_for(milliseconds(1));
      }
      return Status::DeadlineExceeded(host + " did not answer in time");
    }
    if (auto it = late_ms.find(host); it != late_ms.end()) {  // slow but answers
      std::this_thread::sleep_for(milliseconds(it->second));
    }
    std::vector<LookupRow> rows(keys.size());
    if (empty.count(host) != 0) return rows;
    if (incomplete.count(host) != 0 || misses.count(host) != 0) {
      for (LookupRow& row : rows) {
        row.placed_here = true;
        row.complete = misses.count(host) != 0;
      }
      return rows;
    }
    for (LookupRow& row : rows) {
      row.placed_here = row.complete = true;
      row.candidates.push_back(Candidate{"owner-" + host, "uuid", 1, 1, 1, 4096});
    }
    return rows;
  }
};

std::vector<state::StateKey> Keys(uint64_t chain, size_t n) { return core::testing::Chain(chain, n); }

Discovery::Options Options(size_t max_hosts = 4) {
  Discovery::Options options;
  options.max_hosts = max_hosts;
  options.budget = milliseconds(3000);
  options.host_of = [](const state::StateKey& key) { return "host-" + std::to_string(state::ShardOf(key, 16) % 3); };
  return options;
}

TEST(DiscoveryTest, ColdQueriesBatchPerHostAndWarmOnesAskNothing) {
  CandidateIndex index({64ull << 20, milliseconds(600000)});  // a TTL sanitizer slowness cannot expire
  FakeHosts hosts;
  Discovery discovery(Options(), &index, &hosts);
  const auto keys = Keys(1, 1024);
  Discovery::Outcome cold = discovery.Discover(keys);
  EXPECT_EQ(cold.known_prefix, 1024u);
  EXPECT_LE(cold.rpcs, 1024u / 128 + 2);  // never one per block: batches of 128 per host
  EXPECT_LE(hosts.largest_batch.load(), 128u);
  EXPECT_TRUE(cold.failed_hosts.empty() && cold.skipped_hosts.empty());
  const int after_cold = hosts.rpcs.load();
  for (int i = 0; i < 2000; ++i) {
    Discovery::Outcome warm = discovery.Discover(std::span(keys).subspan(static_cast<size_t>(i) % 512, 128));
    ASSERT_EQ(warm.rpcs, 0u) << i;
    ASSERT_EQ(warm.known_prefix, 128u) << i;
  }
  EXPECT_EQ(hosts.rpcs.load(), after_cold);
}

TEST(DiscoveryTest, NoMoreHostsInFlightThanAllowed) {
  CandidateIndex index({});
  FakeHosts hosts;
  Discovery discovery(Options(/*max_hosts=*/2), &index, &hosts);
  EXPECT_EQ(discovery.Discover(Keys(2, 1024)).known_prefix, 1024u);
  EXPECT_LE(hosts.max_in_flight.load(), 2);
  EXPECT_GE(hosts.max_in_flight.load(), 1);
  // What the Manager reports as discovery_max_hosts_in_flight: never more than the hosts really in flight.
  EXPECT_LE(discovery.GetStats().max_hosts_in_flight, 2u);
  EXPECT_GE(discovery.GetStats().max_hosts_in_flight, 1u);
  EXPECT_EQ(discovery.GetStats().rpcs, static_cast<uint64_t>(hosts.rpcs.load()));
}

TEST(DiscoveryTest, AFailingHostIsSkippedUntilItsBreakerCloses) {
  MonoTime now = MonoNow();
  CandidateIndex index({});
  FakeHosts hosts;
  hosts.down = {"host-1"};
  Discovery::Options options = Options();
  options.breaker_open = milliseconds(5000);
  options.now = [&] { return now; };
  Discovery discovery(options, &index, &hosts);
  const auto keys = Keys(3, 300);
  Discovery::Outcome first = discovery.Discover(keys);
  EXPECT_EQ(first.failed_hosts, std::vector<std::string>{"host-1"});
  EXPECT_LT(first.known_prefix, 300u);  // the prefix stops at host-1's first key
  // The other hosts' keys were learnt; the next query asks only... nobody: host-1 is skipped at once.
  const int before = hosts.rpcs.load();
  Discovery::Outcome second = discovery.Discover(keys);
  EXPECT_EQ(second.skipped_hosts, std::vector<std::string>{"host-1"});
  EXPECT_EQ(second.rpcs, 0u);
  EXPECT_EQ(hosts.rpcs.load(), before);
  // Once the breaker closes (and the host is back), it is asked again.
  hosts.down.clear();
  now += milliseconds(5001);
  Discovery::Outcome third = discovery.Discover(keys);
  EXPECT_GT(third.rpcs, 0u);
  EXPECT_EQ(third.known_prefix, 300u);
}

// Issue 51: a host that answers with a route refusal (its view does not show this Manager's new start yet, or it
// is registering again itself) is alive: no breaker, the next discovery asks it again. Breakers tripped before this
// Manager registered again are closed by ResetBreakers.
TEST(DiscoveryTest, ARouteRefusalOpensNoBreakerAndResetBreakersClosesThem) {
  MonoTime now = MonoNow();
  CandidateIndex index({});
  FakeHosts hosts;
  Discovery::Options options = Options();
  options.now = [&] { return now; };
  Discovery discovery(options, &index, &hosts);
  const auto keys = Keys(4, 300);
  for (const Status& refusal :
       {Status::PermissionDenied("node 'x' sent as runtime a epoch 1, but its registered start is runtime b epoch 2"),
        Status::FailedPrecondition("stale incarnation: request addressed to runtime a"),
        Status::NotFound("node 'host-1' is not a live member at revision 10"),
        Status::Unavailable("member view is incomplete (etcd snapshot pending)")  // this side's own view
            .WithReason(StatusReason::kViewIncomplete),
        Status::Unavailable("a peer's view is incomplete").WithReason(StatusReason::kViewIncomplete)}) {
    ASSERT_TRUE(IsRouteRefusal(refusal)) << refusal;
    hosts.refuses = {{"host-1", refusal}};
    Discovery::Outcome refused = discovery.Discover(keys);
    EXPECT_EQ(refused.refused_hosts, std::vector<std::string>{"host-1"}) << refusal;
    EXPECT_TRUE(refused.failed_hosts.empty()) << refusal;
    EXPECT_LT(refused.known_prefix, 300u);
  }
  EXPECT_FALSE(IsRouteRefusal(Status::Unavailable("failed to connect to all addresses")));
  // The text decides nothing: an UNAVAILABLE that only says so is a host down.
  EXPECT_FALSE(IsRouteRefusal(Status::Unavailable("member view is incomplete")));
  hosts.refuses.clear();
  Discovery::Outcome answered = discovery.Discover(keys);  // asked at once, no breaker to wait out
  EXPECT_TRUE(answered.skipped_hosts.empty());
  EXPECT_EQ(answered.known_prefix, 300u);
  EXPECT_EQ(discovery.GetStats().refused_hosts, 5u);
  // A down host trips its breaker; ResetBreakers closes it before its time.
  const auto more = Keys(5, 300);
  hosts.down = {"host-2"};
  EXPECT_EQ(discovery.Discover(more).failed_hosts, std::vector<std::string>{"host-2"});
  hosts.down.clear();
  EXPECT_EQ(discovery.Discover(more).skipped_hosts, std::vector<std::string>{"host-2"});
  discovery.ResetBreakers();
  Discovery::Outcome after_reset = discovery.Discover(more);
  EXPECT_TRUE(after_reset.skipped_hosts.empty());
  EXPECT_EQ(after_reset.known_prefix, 300u);
}

// Issue 54: every shard has three copies (host-0..2, the order rotating with the shard). Hedging is off unless a
// test asks for it (a hedge after a second, beyond the per-copy deadline), so that slow sanitizer runs ask nothing
// twice.
Discovery::Options ThreeCopies(milliseconds hedge_after = milliseconds(1000)) {
  Discovery::Options options = Options();
  options.copy_deadline = milliseconds(100);
  options.hedge_after = options.hedge_unsampled = hedge_after;
  options.copies_of = [](const state::StateKey& key) {
    const uint32_t shard = state::ShardOf(key, 16);
    std::vector<std::string> copies;
    for (uint32_t c = 0; c < 3; ++c) copies.push_back("host-" + std::to_string((shard + c) % 3));
    return copies;
  };
  return options;
}

TEST(DiscoveryTest, ThreeCopiesBatchPerHostAndADownCopyFailsOverWithinTheLookup) {
  CandidateIndex index({});
  FakeHosts hosts;
  Discovery discovery(ThreeCopies(), &index, &hosts);
  const auto healthy = Keys(20, 300);
  Discovery::Outcome cold = discovery.Discover(healthy);
  EXPECT_EQ(cold.known_prefix, 300u);
  EXPECT_LE(cold.rpcs, 3u * 3u);  // batched per host (at most 3 hosts x ceil(300 / 128)), never per shard
  EXPECT_EQ(cold.failovers, 0u);
  // host-1 down: its shards' keys go to their next copy in the same lookup; nothing is lost.
  hosts.down = {"host-1"};
  const auto keys = Keys(21, 300);
  Discovery::Outcome first = discovery.Discover(keys);
  EXPECT_EQ(first.known_prefix, 300u);
  EXPECT_EQ(first.failed_hosts, std::vector<std::string>{"host-1"});
  EXPECT_GE(first.failovers, 1u);
  // Its breaker is open: the next lookup skips it at once and still learns everything.
  const int asked_before = hosts.asked["host-1"];
  Discovery::Outcome second = discovery.Discover(Keys(22, 300));
  EXPECT_EQ(second.known_prefix, 300u);
  EXPECT_TRUE(second.failed_hosts.empty());
  EXPECT_EQ(hosts.asked["host-1"], asked_before);
  EXPECT_GE(discovery.GetStats().failovers, 1u);
}

// Issue 84: while a shard moves, its new copy (still filling) comes after the committed ones for every requester:
// the rotation spreads requesters within the committed copies and within the new ones, never across them.
TEST(DiscoveryTest, WhileAShardMovesEveryRequesterAsksACommittedCopyBeforeTheNewOne) {
  FakeHosts hosts;
  for (uint64_t requester = 0; requester < 32; ++requester) {
    CandidateIndex index({});
    Discovery::Options options = ThreeCopies();
    options.copies_of = [](const state::StateKey&) {
      return std::vector<std::string>{"host-0", "host-1", "host-2", "new-copy"};
    };
    options.committed_copies_of = [](const state::StateKey&) { return size_t{3}; };
    options.rotation = requester;
    options.shard_of = [](const state::StateKey& key) { return state::ShardOf(key, 16); };
    Discovery discovery(options, &index, &hosts);
    EXPECT_EQ(discovery.Discover(Keys(900 + requester, 1)).known_prefix, 1u);
  }
  EXPECT_EQ(hosts.asked["new-copy"], 0) << "a requester asked the still-filling new copy first";
  EXPECT_TRUE(hosts.AskedEach({"host-0", "host-1", "host-2"})) << "the committed copies share the requesters";
  // The new copy is still there behind them: with every committed copy down it answers.
  CandidateIndex index({});
  Discovery::Options options = ThreeCopies();
  options.copies_of = [](const state::StateKey&) {
    return std::vector<std::string>{"host-0", "host-1", "host-2", "new-copy"};
  };
  options.committed_copies_of = [](const state::StateKey&) { return size_t{3}; };
  hosts.down = {"host-0", "host-1", "host-2"};
  Discovery discovery(options, &index, &hosts);
  EXPECT_EQ(discovery.Discover(Keys(999, 1)).known_prefix, 1u);
  EXPECT_GE(hosts.asked["new-copy"], 1);
}

// Without a hedge first, a copy that does not answer costs its per-copy deadline, not the budget: it is given at
// most copy_deadline (then it counts as failed), and the last copy left for a key the whole remaining budget.
TEST(DiscoveryTest, ASlowCopyIsGivenThePerCopyDeadlineAndTheNextCopyAnswers) {
  CandidateIndex index({});
  FakeHosts hosts;
  hosts.slow = {"host-0"};
  Discovery discovery(ThreeCopies(), &index, &hosts);
  Discovery::Outcome outcome = discovery.Discover(Keys(23, 300));
  EXPECT_EQ(outcome.known_prefix, 300u);
  EXPECT_EQ(outcome.failed_hosts, std::vector<std::string>{"host-0"});
  std::lock_guard<std::mutex> lock(hosts.asked_mu);
  EXPECT_LE(hosts.longest_given["host-0"], milliseconds(100));
  EXPECT_GT(hosts.asked["host-1"] + hosts.asked["host-2"], 0);
}

// A blackholed copy is hedged: its keys' next copies are asked beside it after hedge_after, they answer, and the
// blackholed call is cancelled (no breaker: it did not fail, it was overtaken). Later lookups ask it after the
// other copies, so they do not wait for it at all.
TEST(DiscoveryTest, ABlackholedCopyIsHedgedCancelledAndAskedLastAfterwards) {
  CandidateIndex index({});
  FakeHosts hosts;
  hosts.slow = {"host-0"};
  Discovery::Options options = ThreeCopies(milliseconds(200));
  options.copy_deadline = milliseconds(2500);  // the hedge, not the per-copy deadline, moves the lookup on
  Discovery discovery(options, &index, &hosts);
  Discovery::Outcome outcome = discovery.Discover(Keys(28, 300));
  EXPECT_EQ(outcome.known_prefix, 300u);
  EXPECT_GE(outcome.hedges, 1u);
  EXPECT_GE(outcome.failovers, 1u);
  EXPECT_TRUE(outcome.failed_hosts.empty());
  EXPECT_GE(hosts.cancelled.load(), 1);  // the blackholed call was cancelled, not left to its deadline
  EXPECT_EQ(hosts.in_flight.load(), 0);  // and no call outlives the lookup
  EXPECT_GE(discovery.GetStats().hedges, 1u);
  int asked_before = 0;
  {
    std::lock_guard<std::mutex> lock(hosts.asked_mu);
    asked_before = hosts.asked["host-0"];
    EXPECT_GE(asked_before, 1);
  }
  Discovery::Outcome later = discovery.Discover(Keys(29, 300));
  EXPECT_EQ(later.known_prefix, 300u);
  EXPECT_EQ(later.hedges, 0u);
  std::lock_guard<std::mutex> lock(hosts.asked_mu);
  EXPECT_EQ(hosts.asked["host-0"], asked_before);
}

// The same with a lookup of one key (one call: nothing else ends to wake the lookup before its hedge is due).
TEST(DiscoveryTest, AOneKeyLookupHedgesItsBlackholedFirstCopy) {
  CandidateIndex index({});
  FakeHosts hosts;
  hosts.slow = {"host-0"};
  Discovery::Options options = ThreeCopies(milliseconds(200));
  options.copy_deadline = milliseconds(2500);
  Discovery discovery(options, &index, &hosts);
  // One-key lookups until one meets host-0 first (the copies' order rotates with the shard).
  Discovery::Outcome hedged;
  for (uint64_t chain = 40; chain < 80 && hedged.hedges == 0; ++chain) {
    Discovery::Outcome outcome = discovery.Discover(Keys(chain, 1));
    ASSERT_EQ(outcome.known_prefix, 1u) << chain;
    if (outcome.hedges > 0) hedged = outcome;
  }
  ASSERT_EQ(hedged.hedges, 1u);
  EXPECT_TRUE(hedged.failed_hosts.empty());  // overtaken and cancelled, not left to its per-copy deadline
  EXPECT_EQ(hosts.cancelled.load(), 1);
}

// A copy that answers late races its hedge: whichever answers first, every key is learnt, nothing fails.
TEST(DiscoveryTest, ALateCopyAndItsHedgeRaceWithoutLossOrFailure) {
  for (int round = 0; round < 5; ++round) {
    CandidateIndex index({});
    FakeHosts hosts;
    hosts.late_ms = {{"host-1", 5 * round}};
    Discovery::Options options = ThreeCopies(milliseconds(3));
    options.copy_deadline = milliseconds(2500);
    Discovery discovery(options, &index, &hosts);
    const auto keys = Keys(30 + static_cast<uint64_t>(round), 300);
    Discovery::Outcome outcome = discovery.Discover(keys);
    EXPECT_EQ(outcome.known_prefix, 300u) << round;
    EXPECT_TRUE(outcome.failed_hosts.empty()) << round;
    EXPECT_EQ(hosts.in_flight.load(), 0) << round;
    for (const state::StateKey& key : keys) ASSERT_FALSE(index.Find(key).empty()) << round;
  }
}

// The hedge delay follows each host's answer time: hosts that answer slowly but surely (a loaded machine, a far
// zone) are not asked twice once their time is known.
TEST(DiscoveryTest, TheHedgeDelayFollowsAHostsAnswerTime) {
  CandidateIndex index({});
  FakeHosts hosts;
  hosts.late_ms = {{"host-0", 30}, {"host-1", 30}, {"host-2", 30}};
  Discovery::Options options = ThreeCopies(milliseconds(5));
  options.copy_deadline = milliseconds(2500);
  Discovery discovery(options, &index, &hosts);
  Discovery::Outcome first = discovery.Discover(Keys(37, 100));  // nothing known yet: 30 ms is past 5 ms
  EXPECT_EQ(first.known_prefix, 100u);
  EXPECT_GE(first.hedges, 1u);
  // Now each is hedged after 3 x ~30 ms: answers in 15 ms (past the 5 ms floor, so only the learnt time keeps
  // them from being hedged) leave a wide margin for a loaded machine.
  hosts.late_ms = {{"host-0", 15}, {"host-1", 15}, {"host-2", 15}};
  Discovery::Outcome later = discovery.Discover(Keys(38, 100));
  EXPECT_EQ(later.known_prefix, 100u);
  EXPECT_EQ(later.hedges, 0u);
  EXPECT_TRUE(later.failed_hosts.empty());
}

// Every copy blackholed: the lookup ends at its budget with nothing learnt and no call left running.
TEST(DiscoveryTest, EveryCopyBlackholedEndsAtTheBudgetWithNoCallLeft) {
  CandidateIndex index({});
  FakeHosts hosts;
  hosts.slow = {"host-0", "host-1", "host-2"};
  Discovery::Options options = ThreeCopies(milliseconds(5));
  options.budget = milliseconds(300);
  Discovery discovery(options, &index, &hosts);
  Discovery::Outcome outcome = discovery.Discover(Keys(36, 100));
  EXPECT_EQ(outcome.known_prefix, 0u);
  EXPECT_EQ(hosts.in_flight.load(), 0);
  EXPECT_TRUE(hosts.AskedEach({"host-0", "host-1", "host-2"}));  // each copy was asked (hedged) before the end
}

// A miss from an incomplete copy proves nothing (the next copy is asked); a miss from a complete copy is
// authoritative (no other copy is asked); with every copy incomplete nothing is learnt and nothing is claimed.
TEST(DiscoveryTest, OnlyACompleteCopysMissIsAuthoritative) {
  {
    CandidateIndex index({});
    FakeHosts hosts;
    hosts.incomplete = {"host-0"};
    Discovery discovery(ThreeCopies(), &index, &hosts);
    Discovery::Outcome outcome = discovery.Discover(Keys(24, 300));
    EXPECT_EQ(outcome.known_prefix, 300u);
    EXPECT_GE(outcome.failovers, 1u);
    EXPECT_TRUE(outcome.failed_hosts.empty());
    // Later lookups ask the copies last seen complete first.
    const int incomplete_asked = hosts.asked["host-0"];
    EXPECT_EQ(discovery.Discover(Keys(25, 300)).known_prefix, 300u);
    EXPECT_EQ(hosts.asked["host-0"], incomplete_asked);
  }
  {
    CandidateIndex index({});
    FakeHosts hosts;
    hosts.misses = {"host-0", "host-1", "host-2"};
    Discovery discovery(ThreeCopies(), &index, &hosts);
    Discovery::Outcome outcome = discovery.Discover(Keys(26, 300));
    EXPECT_EQ(outcome.known_prefix, 0u);
    EXPECT_EQ(outcome.failovers, 0u);  // one complete copy per shard answered: no other copy is asked
    EXPECT_LE(outcome.rpcs, 3u * 3u);
  }
  {
    CandidateIndex index({});
    FakeHosts hosts;
    hosts.incomplete = {"host-0", "host-1", "host-2"};
    Discovery discovery(ThreeCopies(), &index, &hosts);
    Discovery::Outcome outcome = discovery.Discover(Keys(27, 300));
    EXPECT_EQ(outcome.known_prefix, 0u);
    EXPECT_TRUE(index.Find(Keys(27, 1)[0]).empty());
    EXPECT_TRUE(hosts.AskedEach({"host-0", "host-1", "host-2"}));  // every copy was asked before giving up
  }
}

TEST(DiscoveryTest, ASlowHostCostsOneBudgetThenIsSkipped) {
  CandidateIndex index({});
  FakeHosts hosts;
  hosts.slow = {"host-2"};
  Discovery::Options options = Options();
  options.budget = milliseconds(200);
  Discovery discovery(options, &index, &hosts);
  const auto keys = Keys(4, 200);
  Discovery::Outcome first = discovery.Discover(keys);
  EXPECT_EQ(first.failed_hosts, std::vector<std::string>{"host-2"});
  Discovery::Outcome second = discovery.Discover(keys);
  EXPECT_EQ(second.skipped_hosts, std::vector<std::string>{"host-2"});
  EXPECT_EQ(second.rpcs, 0u);  // no second wait for it
}

TEST(DiscoveryTest, EmptyRowsProveNothingAndAreAskedAgain) {
  CandidateIndex index({});
  FakeHosts hosts;
  hosts.empty = {"host-0", "host-1", "host-2"};
  Discovery discovery(Options(), &index, &hosts);
  const auto keys = Keys(5, 64);
  EXPECT_EQ(discovery.Discover(keys).known_prefix, 0u);
  EXPECT_EQ(index.GetStats().entries, 0u);
  EXPECT_GT(discovery.Discover(keys).rpcs, 0u);  // not cached as absent
}

TEST(DiscoveryTest, ConcurrentMissesOfOnePrefixShareOneLookupAndEmptyResultsAreAskedAgain) {
  FakeHosts hosts;
  hosts.slow_ms = 200;  // long enough for the other callers to find the lookup in flight
  CandidateIndex index({});
  Discovery discovery(Options(), &index, &hosts);
  const auto keys = Keys(70, 100);
  std::vector<std::thread> callers;
  std::atomic<int> coalesced{0}, complete{0};
  for (int i = 0; i < 4; ++i) {
    callers.emplace_back([&] {
      const Discovery::Outcome outcome = discovery.Discover(keys);
      coalesced.fetch_add(outcome.coalesced ? 1 : 0);
      complete.fetch_add(outcome.known_prefix == keys.size() ? 1 : 0);
    });
  }
  for (auto& t : callers) t.join();
  EXPECT_EQ(complete.load(), 4);
  // One caller's lookup: one RPC per host (100 keys over 3 hosts), whichever caller sent it.
  EXPECT_EQ(hosts.rpcs.load(), 3);
  EXPECT_EQ(coalesced.load(), 3);
  // Empty answers are not shared as proof: each waiter asks again.
  FakeHosts empty;
  empty.slow_ms = 50;
  for (int h = 0; h < 3; ++h) empty.empty.insert("host-" + std::to_string(h));
  CandidateIndex index2({});
  Discovery discovery2(Options(), &index2, &empty);
  callers.clear();
  for (int i = 0; i < 2; ++i) callers.emplace_back([&] { (void)discovery2.Discover(keys); });
  for (auto& t : callers) t.join();
  EXPECT_EQ(empty.rpcs.load(), 6);
}

}  // namespace
}  // namespace orbitkv::catalog
