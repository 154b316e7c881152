// CatalogStore alone: what it installs from deltas and snapshots, and what it refuses.
#include "catalog/catalog_store.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <thread>

#include "core/test_util.h"

namespace orbitkv::catalog {
namespace {

using Kind = CatalogReply::Kind;

constexpr uint64_t kIncarnation = 0xc0ffee;

StreamId Stream(const std::string& node = "node-a", const std::string& runtime = "run-1", int64_t epoch = 0) {
  return StreamId{node, runtime, 3, kIncarnation, epoch};
}

CatalogRecord Add(uint64_t i, uint64_t version, uint64_t generation = 1) {
  return CatalogRecord{core::testing::ChainKey(7, i), 1, true, version, generation, 4096};
}
CatalogRecord Remove(uint64_t i, uint64_t version, uint64_t generation = 1) {
  return CatalogRecord{core::testing::ChainKey(7, i), 1, false, version, generation, 4096};
}

// A baseline at watermark `w` holding keys [0, n) (versions 1..n).
void Baseline(CatalogStore& store, uint64_t n, const StreamId& stream = Stream()) {
  ASSERT_EQ(store.Begin({stream, 1, 0, n}).kind, Kind::kAck);
  SnapshotEnd end{stream, 1, n, {}};
  for (uint64_t i = 0; i < n; ++i) end.interval.push_back(Add(i, i + 1));
  ASSERT_EQ(store.End(end).kind, Kind::kAck);
}

TEST(CatalogStoreTest, DeltasApplyInOrderAndDuplicatesAreDeduplicated) {
  CatalogStore store({kIncarnation});
  EXPECT_EQ(store.Apply({Stream(), 1, {Add(0, 1)}}).kind, Kind::kResync);  // no baseline yet
  Baseline(store, 4);
  CatalogReply reply = store.Apply({Stream(), 5, {Add(9, 5), Remove(0, 6)}});
  EXPECT_EQ(reply.kind, Kind::kAck);
  EXPECT_EQ(reply.applied_sequence, 6u);
  // The same batch again, and one overlapping it: nothing applies twice.
  EXPECT_EQ(store.Apply({Stream(), 5, {Add(9, 5), Remove(0, 6)}}).applied_sequence, 6u);
  reply = store.Apply({Stream(), 6, {Remove(0, 6), Add(10, 7)}});
  EXPECT_EQ(reply.kind, Kind::kAck);
  EXPECT_EQ(reply.applied_sequence, 7u);
  EXPECT_EQ(store.Dump(3, "node-a").size(), 5u);  // 1, 2, 3, 9, 10
  EXPECT_EQ(store.used_bytes(), 5 * CatalogStore::EntryCharge());
  // What `orbitkv catalog status` shows: the owner's lag of its last delta, the age of the last repair.
  DeltaBatch late{Stream(), 8, {Add(11, 8)}};
  late.oldest_age_us = 7500;
  ASSERT_EQ(store.Apply(late).kind, Kind::kAck);
  const auto status = store.Status();
  ASSERT_EQ(status.size(), 1u);
  EXPECT_DOUBLE_EQ(status[0].lag_ms, 7.5);
  EXPECT_GE(status[0].last_repair_s, 0);
  EXPECT_LT(status[0].last_repair_s, 60);
}

// Issue 69: an owner's start is its inventory incarnation. A registration made again without a restart (a new
// runtime UUID and epoch, the same incarnation) continues its slice from the applied sequence, with its baseline:
// no resync, no rebuild, the shard complete throughout. An older registration's message is still refused, a new
// incarnation is still a new start, and a stream naming another start than its member record is refused.
TEST(CatalogStoreTest, ARegistrationMadeAgainWithTheSameStartContinuesItsSlice) {
  constexpr uint64_t kStart = 0xabc0000000000001;
  CatalogStore::OwnerRegistration member{"run-1", 1, kStart};
  CatalogStore::Options options{kIncarnation};
  options.owner_live = [&](const std::string&, const std::string& runtime) -> std::optional<bool> {
    return runtime == member.runtime;
  };
  options.owner_registration = [&](const std::string&) -> std::optional<CatalogStore::OwnerRegistration> {
    return member;
  };
  options.live_owners = [&]() -> std::optional<std::vector<std::pair<std::string, std::string>>> {
    return std::vector<std::pair<std::string, std::string>>{{"node-a", member.runtime}};
  };
  CatalogStore store(options);
  const auto stream = [](const std::string& runtime, int64_t epoch, uint64_t start) {
    StreamId id = Stream("node-a", runtime, epoch);
    id.owner_incarnation = start;
    return id;
  };
  Baseline(store, 4, stream("run-1", 1, kStart));
  ASSERT_EQ(store.Apply({stream("run-1", 1, kStart), 5, {Add(9, 5)}}).kind, Kind::kAck);
  ASSERT_TRUE(store.Complete(3));

  // The owner's registration lapsed and was made again: a new runtime and epoch, the same start.
  member = {"run-2", 2, kStart};
  const CatalogReply next = store.Apply({stream("run-2", 2, kStart), 6, {Add(10, 6)}});
  EXPECT_EQ(next.kind, Kind::kAck) << next.reason;
  EXPECT_EQ(next.applied_sequence, 6u);
  EXPECT_EQ(store.continuations(), 1u);
  EXPECT_EQ(store.Dump(3, "node-a").size(), 6u) << "the baseline was kept";
  EXPECT_TRUE(store.Complete(3));
  bool complete = false;
  const auto holders = store.Lookup(3, core::testing::ChainKey(7, 10), &complete);
  ASSERT_EQ(holders.size(), 1u);
  EXPECT_EQ(holders[0].owner_runtime, "run-2") << "lookups name the live registration";
  // The older registration's messages are refused, whatever their order.
  EXPECT_EQ(store.Apply({stream("run-1", 1, kStart), 7, {Add(11, 7)}}).kind, Kind::kRefused);

  // A registration made again that the catalog hears of first through the member view: the slice follows it.
  member = {"run-3", 3, kStart};
  EXPECT_EQ(store.DropDeadOwners(), 0u);
  EXPECT_EQ(store.continuations(), 2u);
  ASSERT_EQ(store.Slices(3).size(), 1u);
  EXPECT_EQ(store.Slices(3)[0].owner_runtime, "run-3");
  EXPECT_TRUE(store.Slices(3)[0].baseline);
  EXPECT_TRUE(store.Complete(3));

  // A stream that names another start than its member record: refused.
  EXPECT_EQ(store.Apply({stream("run-3", 3, 0xdef0000000000002), 7, {Add(11, 7)}}).kind, Kind::kRefused);

  // A restart: a new incarnation is a new start; its first delta needs a baseline, its snapshot replaces the view.
  member = {"run-4", 4, 0xdef0000000000002};
  EXPECT_EQ(store.Apply({stream("run-4", 4, member.incarnation), 1, {Add(0, 1)}}).kind, Kind::kResync);
  ASSERT_EQ(store.Begin({stream("run-4", 4, member.incarnation), 100, 0, 1}).kind, Kind::kAck);
  EXPECT_EQ(store.Dump(3, "node-a").size(), 0u) << "a new start's slice starts empty";
  EXPECT_EQ(store.continuations(), 2u);
}

// Issue 69: an owner registering again revokes its old record before it writes the new one, and a catalog's view
// can fall between the two. Within the grace its slice is kept (no holder, no dump: no member, no evidence) and
// continues once the new registration shows; an owner gone for longer than the grace loses its slice.
TEST(CatalogStoreTest, AnOwnerBetweenItsRegistrationsKeepsItsSliceForTheGrace) {
  constexpr uint64_t kStart = 0xabc0000000000001;
  std::optional<CatalogStore::OwnerRegistration> member = CatalogStore::OwnerRegistration{"run-1", 1, kStart};
  CatalogStore::Options options{kIncarnation};
  options.owner_live = [&](const std::string&, const std::string& runtime) -> std::optional<bool> {
    return member.has_value() && member->runtime == runtime;
  };
  options.owner_registration = [&](const std::string&) { return member; };
  options.absent_grace = std::chrono::milliseconds(200);
  CatalogStore store(options);
  StreamId first = Stream("node-a", "run-1", 1);
  first.owner_incarnation = kStart;
  Baseline(store, 3, first);

  member = CatalogStore::OwnerRegistration{};  // no member at all: its old record revoked, the new one not yet seen
  EXPECT_EQ(store.DropDeadOwners(), 0u);
  bool complete = false;
  EXPECT_TRUE(store.Lookup(3, core::testing::ChainKey(7, 0), &complete).empty());
  EXPECT_TRUE(store.Owners(3).empty());
  member = CatalogStore::OwnerRegistration{"run-2", 2, kStart};
  EXPECT_EQ(store.DropDeadOwners(), 0u);
  EXPECT_EQ(store.Lookup(3, core::testing::ChainKey(7, 0), &complete).size(), 1u);
  StreamId second = Stream("node-a", "run-2", 2);
  second.owner_incarnation = kStart;
  EXPECT_EQ(store.Apply({second, 4, {Add(5, 4)}}).kind, Kind::kAck);
  EXPECT_EQ(store.Dump(3, "node-a").size(), 4u);

  member = CatalogStore::OwnerRegistration{};  // gone for good
  EXPECT_EQ(store.DropDeadOwners(), 0u);
  std::this_thread::sleep_for(std::chrono::milliseconds(250));
  EXPECT_EQ(store.DropDeadOwners(), 1u);
  EXPECT_TRUE(store.Slices(3).empty());
}

TEST(CatalogStoreTest, ABatchThatDoesNotFollowAnswersGapAndOutOfOrderBatchesRecover) {
  CatalogStore store({kIncarnation});
  Baseline(store, 2);
  const DeltaBatch first{Stream(), 3, {Add(5, 3), Add(6, 4)}};
  const DeltaBatch second{Stream(), 5, {Add(7, 5)}};
  CatalogReply reply = store.Apply(second);  // overtook the first
  EXPECT_EQ(reply.kind, Kind::kGap);
  EXPECT_EQ(reply.applied_sequence, 2u);
  EXPECT_EQ(store.Apply(first).applied_sequence, 4u);
  EXPECT_EQ(store.Apply(second).applied_sequence, 5u);
  EXPECT_EQ(store.Apply(first).kind, Kind::kAck);  // a late duplicate
  EXPECT_EQ(store.Dump(3, "node-a").size(), 5u);
}

TEST(CatalogStoreTest, ASnapshotIsInstalledOnlyWhenItsIntervalIsComplete) {
  CatalogStore store({kIncarnation});
  Baseline(store, 3);
  ASSERT_EQ(store.Begin({Stream(), 2, 3, 2}).kind, Kind::kAck);
  ASSERT_EQ(store.Page({Stream(), 2, {Add(20, 2), Add(21, 3)}}).kind, Kind::kAck);
  // Readers still see the old view while the new one is built.
  EXPECT_EQ(store.Dump(3, "node-a").size(), 3u);
  EXPECT_FALSE(store.Status()[0].complete);
  // An interval (3, 6] with one record missing: refused, the old view stays.
  CatalogReply reply = store.End({Stream(), 2, 6, {Add(22, 4), Add(23, 6)}});
  EXPECT_EQ(reply.kind, Kind::kResync);
  EXPECT_EQ(store.Dump(3, "node-a").size(), 3u);
  EXPECT_EQ(store.Page({Stream(), 2, {Add(24, 5)}}).kind, Kind::kResync);  // that snapshot is gone
  // A complete one installs.
  ASSERT_EQ(store.Begin({Stream(), 3, 3, 2}).kind, Kind::kAck);
  ASSERT_EQ(store.Page({Stream(), 3, {Add(20, 2), Add(21, 3)}}).kind, Kind::kAck);
  reply = store.End({Stream(), 3, 5, {Add(22, 4), Add(23, 5)}});
  ASSERT_EQ(reply.kind, Kind::kAck);
  EXPECT_EQ(reply.applied_sequence, 5u);
  EXPECT_EQ(store.Dump(3, "node-a").size(), 4u);
  EXPECT_TRUE(store.Status()[0].complete);
  EXPECT_EQ(store.used_bytes(), 4 * CatalogStore::EntryCharge());
}

// Deletion evidence: a residence added and then evicted never comes back from older evidence that
// arrives late: a page scanned before the eviction (its add is older than the interval's removal), a
// delayed duplicate of the delta that added it, or a page of a snapshot that is no longer being built.
TEST(CatalogStoreTest, ADelayedAdditionNeverResurrectsAnEvictedResidence) {
  CatalogStore store({kIncarnation});
  ASSERT_EQ(store.Begin({Stream(), 1, 10, 2}).kind, Kind::kAck);
  // Pages taken during the cut: key 2 added at 8 (scanned before its eviction at 11), key 1 at 4.
  ASSERT_EQ(store.Page({Stream(), 1, {Add(1, 4), Add(2, 8)}}).kind, Kind::kAck);
  // Interval (10, 12]: key 2 evicted at 11, key 3 added at 12.
  ASSERT_EQ(store.End({Stream(), 1, 12, {Remove(2, 11), Add(3, 12)}}).kind, Kind::kAck);
  auto keys_of = [&] {
    std::set<state::StateKey> keys;
    for (const CatalogRecord& r : store.Dump(3, "node-a")) keys.insert(r.key);
    return keys;
  };
  const std::set<state::StateKey> expected = {core::testing::ChainKey(7, 1), core::testing::ChainKey(7, 3)};
  EXPECT_EQ(keys_of(), expected);
  // Deltas: key 5 added at 13, evicted at 14; then the add is delivered again, late.
  ASSERT_EQ(store.Apply({Stream(), 13, {Add(5, 13)}}).kind, Kind::kAck);
  ASSERT_EQ(store.Apply({Stream(), 14, {Remove(5, 14)}}).kind, Kind::kAck);
  EXPECT_EQ(store.Apply({Stream(), 13, {Add(5, 13)}}).applied_sequence, 14u);
  // A page of the finished snapshot, replayed: refused, nothing applied.
  EXPECT_EQ(store.Page({Stream(), 1, {Add(2, 8)}}).kind, Kind::kResync);
  EXPECT_EQ(keys_of(), expected);
}

TEST(CatalogStoreTest, EqualVersionsWithDifferentContentsForceANewBaseline) {
  CatalogStore store({kIncarnation});
  Baseline(store, 2);
  ASSERT_EQ(store.Begin({Stream(), 2, 2, 2}).kind, Kind::kAck);
  ASSERT_EQ(store.Page({Stream(), 2, {Add(0, 1)}}).kind, Kind::kAck);
  EXPECT_EQ(store.Page({Stream(), 2, {Add(0, 1, /*generation=*/9)}}).kind, Kind::kResync);
  EXPECT_EQ(store.End({Stream(), 2, 2, {}}).kind, Kind::kResync);  // aborted
  EXPECT_EQ(store.Dump(3, "node-a").size(), 2u);                   // the old baseline stands
  // A delta that removes what the view never held: the views disagree, the baseline goes.
  EXPECT_EQ(store.Apply({Stream(), 3, {Remove(50, 3)}}).kind, Kind::kResync);
  EXPECT_EQ(store.Apply({Stream(), 4, {Add(51, 4)}}).kind, Kind::kResync);
  EXPECT_EQ(store.used_bytes(), 0u);
}

TEST(CatalogStoreTest, TheBudgetIsNeverExceededAndWhatDoesNotFitIsIncomplete) {
  const uint64_t budget = 10 * CatalogStore::EntryCharge();
  CatalogStore store({kIncarnation, budget});
  Baseline(store, 6);
  // A second owner's snapshot of 8 records does not fit next to the first's 6.
  CatalogReply reply = store.Begin({Stream("node-b", "run-9"), 1, 0, 8});
  EXPECT_EQ(reply.kind, Kind::kRetryLater);
  EXPECT_LE(store.used_bytes(), budget);
  // One that claims 2 but sends 6: it outgrows its reservation and is aborted, never installed.
  ASSERT_EQ(store.Begin({Stream("node-b", "run-9"), 2, 0, 2}).kind, Kind::kAck);
  SnapshotPage page{Stream("node-b", "run-9"), 2, {}};
  for (uint64_t i = 0; i < 6; ++i) page.records.push_back(Add(100 + i, i + 1));
  EXPECT_EQ(store.Page(page).kind, Kind::kRetryLater);
  EXPECT_LE(store.used_bytes(), budget);
  EXPECT_TRUE(store.Dump(3, "node-b").empty());
  // Deltas beyond the budget drop that slice's derived view: incomplete, never over budget.
  DeltaBatch grow{Stream(), 7, {}};
  for (uint64_t i = 0; i < 6; ++i) grow.records.push_back(Add(200 + i, 7 + i));
  EXPECT_EQ(store.Apply(grow).kind, Kind::kRetryLater);
  EXPECT_LE(store.used_bytes(), budget);
  EXPECT_TRUE(store.Dump(3, "node-a").empty());
  EXPECT_FALSE(store.Status()[0].complete);
  EXPECT_EQ(store.Apply({Stream(), 13, {Add(300, 13)}}).kind, Kind::kResync);
}

TEST(CatalogStoreTest, AResyncThatCannotFitBesideTheOldViewDropsItAndNeverReportsTheFrozenViewComplete) {
  // Review point 1: a snapshot refused for budget used to keep the old baseline (Status and Lookup called a
  // frozen view complete), and a resync after a journal overflow could be refused for ever because the old view
  // stayed charged.
  const uint64_t budget = 10 * CatalogStore::EntryCharge();
  CatalogStore store({kIncarnation, budget});
  Baseline(store, 6);
  bool complete = false;
  EXPECT_EQ(store.Lookup(3, core::testing::ChainKey(7, 0), &complete).size(), 1u);
  EXPECT_TRUE(complete);
  // The owner resyncs with 8 records: old (6) and new (8) cannot both fit, so the old view goes and the snapshot
  // is admitted; until it is installed the shard reads incomplete.
  ASSERT_EQ(store.Begin({Stream(), 2, 6, 8}).kind, Kind::kAck);
  EXPECT_LE(store.used_bytes(), budget);
  EXPECT_TRUE(store.Lookup(3, core::testing::ChainKey(7, 0), &complete).empty());
  EXPECT_FALSE(complete);
  EXPECT_FALSE(store.Status()[0].complete);
  SnapshotPage page{Stream(), 2, {}};
  for (uint64_t i = 0; i < 8; ++i) page.records.push_back(Add(i, i + 1));
  ASSERT_EQ(store.Page(page).kind, Kind::kAck);
  ASSERT_EQ(store.End({Stream(), 2, 6, {}}).kind, Kind::kAck);
  EXPECT_TRUE(store.Status()[0].complete);
  EXPECT_EQ(store.Dump(3, "node-a").size(), 8u);
  // A resync that cannot fit even alone: refused, and the slice reads incomplete (no frozen view) until one fits.
  EXPECT_EQ(store.Begin({Stream(), 3, 8, 12}).kind, Kind::kRetryLater);
  EXPECT_LE(store.used_bytes(), budget);
  EXPECT_FALSE(store.Status()[0].complete);
  EXPECT_TRUE(store.Lookup(3, core::testing::ChainKey(7, 0), &complete).empty());
  EXPECT_FALSE(complete);
  ASSERT_EQ(store.Begin({Stream(), 4, 8, 3}).kind, Kind::kAck);  // the owner's view shrank: it fits
  SnapshotEnd end{Stream(), 4, 8, {}};
  page = SnapshotPage{Stream(), 4, {Add(0, 1), Add(1, 2), Add(2, 3)}};
  ASSERT_EQ(store.Page(page).kind, Kind::kAck);
  ASSERT_EQ(store.End(end).kind, Kind::kAck);
  EXPECT_TRUE(store.Status()[0].complete);
}

TEST(CatalogStoreTest, AShardIsCompleteOnlyWhenEveryLiveOwnerHasABaselineThere) {
  // After a catalog restart (an empty store) a shard has no slice at all: it used to read complete. Now every
  // live member's owner stream must have re-baselined first, and an incomplete member view makes it incomplete.
  std::optional<std::vector<std::pair<std::string, std::string>>> live =
      std::vector<std::pair<std::string, std::string>>{{"node-a", "run-1"}, {"node-b", "run-2"}};
  CatalogStore::Options options{kIncarnation};
  options.live_owners = [&live] { return live; };
  options.shards = {3, 5};
  CatalogStore store(std::move(options));
  auto shard = [&](uint32_t n) {
    for (const auto& s : store.Status()) {
      if (s.shard == n) return s;
    }
    ADD_FAILURE() << "no status for shard " << n;
    return CatalogStore::ShardStatus{};
  };
  EXPECT_EQ(store.Status().size(), 2u);  // both shards placed here, with no slice yet
  EXPECT_FALSE(shard(3).complete);
  EXPECT_FALSE(shard(5).complete);
  Baseline(store, 2, Stream("node-a", "run-1"));
  EXPECT_FALSE(shard(3).complete);  // node-b has not re-baselined
  bool complete = true;
  EXPECT_EQ(store.Lookup(3, core::testing::ChainKey(7, 0), &complete).size(), 1u);
  EXPECT_FALSE(complete);  // node-a's answer, but a miss here would say nothing
  Baseline(store, 1, Stream("node-b", "run-2"));
  EXPECT_TRUE(shard(3).complete);
  EXPECT_FALSE(shard(5).complete);
  EXPECT_TRUE(store.Complete(3));  // what Peer.Lookup asks once per shard of a request
  EXPECT_FALSE(store.Complete(5));
  store.Lookup(3, core::testing::ChainKey(7, 0), &complete);
  EXPECT_TRUE(complete);
  live = std::nullopt;  // the member view is incomplete: nobody knows who must have reported
  EXPECT_FALSE(shard(3).complete);
  live = std::vector<std::pair<std::string, std::string>>{{"node-a", "run-1"}, {"node-b", "run-3"}};
  EXPECT_FALSE(shard(3).complete);  // node-b restarted: its new start must baseline
  Baseline(store, 1, Stream("node-b", "run-3"));
  EXPECT_TRUE(shard(3).complete);
}

TEST(CatalogStoreTest, AnOlderStartNeverReplacesANewerSliceInAnyOrderAndReservesNothing) {
  // Review point 4: the epoch is part of the stream and orders slices on every path.
  CatalogStore store({kIncarnation});
  Baseline(store, 3, Stream("node-a", "run-2", 2));
  const uint64_t used = store.used_bytes();
  const StreamId old_start = Stream("node-a", "run-1", 1);
  // The older start's Begin, delta, page and End arrive after the newer install (reordered, or a fenced owner).
  EXPECT_EQ(store.Begin({old_start, 9, 0, 50}).kind, Kind::kRefused);
  EXPECT_EQ(store.Apply({old_start, 4, {Add(9, 4)}}).kind, Kind::kRefused);
  EXPECT_EQ(store.Page({old_start, 9, {Add(9, 1)}}).kind, Kind::kResync);  // no such snapshot: nothing applied
  EXPECT_EQ(store.End({old_start, 9, 0, {}}).kind, Kind::kResync);
  EXPECT_EQ(store.used_bytes(), used);  // no orphan build, no reservation charged
  EXPECT_TRUE(store.Status()[0].complete);
  EXPECT_EQ(store.Dump(3, "node-a").size(), 3u);
  bool complete = false;
  const auto holders = store.Lookup(3, core::testing::ChainKey(7, 0), &complete);
  ASSERT_EQ(holders.size(), 1u);
  EXPECT_EQ(holders[0].owner_runtime, "run-2");
  // Another runtime claiming the same epoch is refused too; a newer epoch replaces the slice.
  EXPECT_EQ(store.Begin({Stream("node-a", "run-x", 2), 1, 0, 1}).kind, Kind::kRefused);
  Baseline(store, 1, Stream("node-a", "run-3", 3));
  EXPECT_EQ(store.Dump(3, "node-a").size(), 1u);
  EXPECT_EQ(store.Apply({Stream("node-a", "run-2", 2), 4, {Add(1, 4)}}).kind, Kind::kRefused);
}

TEST(CatalogStoreTest, AReplayedBeginOfAnInstalledSnapshotBuildsAndChargesNothing) {
  CatalogStore store({kIncarnation});
  Baseline(store, 3);  // snapshot 1 installed
  const uint64_t used = store.used_bytes();
  CatalogReply replay = store.Begin({Stream(), 1, 0, 1000});  // snapshot 1's Begin again, duplicated late
  EXPECT_EQ(replay.kind, Kind::kAck);
  EXPECT_EQ(store.used_bytes(), used);
  EXPECT_TRUE(store.Status()[0].complete);                         // no build in progress
  EXPECT_EQ(store.End({Stream(), 1, 3, {}}).kind, Kind::kResync);  // and its End finds nothing to install
  EXPECT_EQ(store.Dump(3, "node-a").size(), 3u);
  // A newer snapshot's Begin, then a replay of an older one while it builds: the build goes on.
  ASSERT_EQ(store.Begin({Stream(), 5, 3, 3}).kind, Kind::kAck);
  ASSERT_EQ(store.Page({Stream(), 5, {Add(0, 1)}}).kind, Kind::kAck);
  EXPECT_EQ(store.Begin({Stream(), 4, 3, 3}).kind, Kind::kAck);
  EXPECT_EQ(store.Begin({Stream(), 5, 3, 3}).kind, Kind::kAck);  // its own Begin again: the build keeps its page
  ASSERT_EQ(store.Page({Stream(), 5, {Add(1, 2), Add(2, 3)}}).kind, Kind::kAck);
  ASSERT_EQ(store.End({Stream(), 5, 3, {}}).kind, Kind::kAck);
  EXPECT_TRUE(store.Status()[0].complete);
  EXPECT_EQ(store.Dump(3, "node-a").size(), 3u);
}

TEST(CatalogStoreTest, ConflictingEqualVersionsInADeltaForceAResync) {
  CatalogStore store({kIncarnation});
  Baseline(store, 3);
  // A resend of sequence 2 (applied already) with other contents: not deduplicated silently, a conflict.
  CatalogReply reply = store.Apply({Stream(), 2, {Add(1, 2, /*generation=*/99)}});
  EXPECT_EQ(reply.kind, Kind::kResync);
  EXPECT_TRUE(store.Dump(3, "node-a").empty());  // the view is gone until a new baseline
  EXPECT_FALSE(store.Status()[0].complete);
  // The same resend with equal contents is a duplicate.
  CatalogStore again({kIncarnation});
  Baseline(again, 3);
  EXPECT_EQ(again.Apply({Stream(), 2, {Add(1, 2)}}).kind, Kind::kAck);
  EXPECT_EQ(again.Dump(3, "node-a").size(), 3u);
}

TEST(CatalogStoreTest, AKeyOnAnotherShardsStreamIsRefusedWithItsMessage) {
  CatalogStore::Options options{kIncarnation};
  options.num_shards = 16;
  CatalogStore store(std::move(options));
  // Keys of shard 3 and one of another shard.
  std::vector<CatalogRecord> own, others;
  for (uint64_t i = 0; own.size() < 2 || others.empty(); ++i) {
    const state::StateKey key = core::testing::ChainKey(7, i);
    if (state::ShardOf(key, 16) == 3) {
      if (own.size() < 2) own.push_back(CatalogRecord{key, 1, true, own.size() + 1, 1, 4096});
    } else if (others.empty()) {
      others.push_back(CatalogRecord{key, 1, true, 3, 1, 4096});
    }
  }
  const CatalogRecord foreign = others[0];
  ASSERT_EQ(store.Begin({Stream(), 1, 0, 2}).kind, Kind::kAck);
  ASSERT_EQ(store.End({Stream(), 1, 2, own}).kind, Kind::kAck);
  const CatalogReply reply = store.Apply({Stream(), 3, {foreign}});
  EXPECT_EQ(reply.kind, Kind::kRefused);
  EXPECT_NE(reply.reason.find("on shard 3's stream"), std::string::npos) << reply.reason;
  EXPECT_EQ(store.Dump(3, "node-a").size(), 2u);  // nothing of it applied
  ASSERT_EQ(store.Begin({Stream(), 2, 2, 2}).kind, Kind::kAck);
  EXPECT_EQ(store.Page({Stream(), 2, {foreign}}).kind, Kind::kRefused);  // a snapshot page too, and its build goes
  EXPECT_EQ(store.End({Stream(), 2, 2, {}}).kind, Kind::kResync);
}

TEST(CatalogStoreTest, AnIncompleteMemberViewAdmitsNothingAndDropsNothing) {
  std::optional<bool> live = true;
  CatalogStore::Options options{kIncarnation};
  options.owner_live = [&](const std::string&, const std::string&) { return live; };
  CatalogStore store(std::move(options));
  Baseline(store, 2);
  live = std::nullopt;  // the member view is incomplete: who is live is unknown
  EXPECT_EQ(store.Apply({Stream(), 3, {Add(5, 3)}}).kind, Kind::kRetryLater);
  EXPECT_EQ(store.DropDeadOwners(), 0u);
  EXPECT_EQ(store.Dump(3, "node-a").size(), 2u);
  live = false;  // now known dead
  EXPECT_EQ(store.DropDeadOwners(), 1u);
}

TEST(CatalogStoreTest, LookupNamesEveryOwnerHoldingAKeyInEachTier) {
  CatalogStore store({kIncarnation});
  Baseline(store, 3, Stream("node-a", "run-1"));
  Baseline(store, 2, Stream("node-b", "run-2"));
  ASSERT_EQ(
      store.Apply({Stream("node-b", "run-2"), 3, {CatalogRecord{core::testing::ChainKey(7, 0), 2, true, 3, 5, 4096}}})
          .kind,
      Kind::kAck);  // node-b also holds key 0 on SSD
  bool complete = false;
  auto holders = store.Lookup(3, core::testing::ChainKey(7, 0), &complete);
  EXPECT_TRUE(complete);
  ASSERT_EQ(holders.size(), 3u);  // node-a DRAM, node-b DRAM and SSD
  EXPECT_EQ(holders[0].owner_node, "node-a");
  EXPECT_EQ(holders[0].owner_runtime, "run-1");
  EXPECT_EQ(holders[2].record.tier, 2);
  EXPECT_EQ(holders[2].record.generation, 5u);
  EXPECT_EQ(store.Lookup(3, core::testing::ChainKey(7, 2), &complete).size(), 1u);  // only node-a has key 2
  EXPECT_TRUE(store.Lookup(3, core::testing::ChainKey(7, 9), &complete).empty());
  EXPECT_TRUE(store.Lookup(4, core::testing::ChainKey(7, 0), &complete).empty());  // another shard
  // A slice being rebuilt makes the shard's answer incomplete.
  ASSERT_EQ(store.Begin({Stream("node-c", "run-3"), 1, 0, 1}).kind, Kind::kAck);
  EXPECT_EQ(store.Lookup(3, core::testing::ChainKey(7, 0), &complete).size(), 3u);
  EXPECT_FALSE(complete);
}

TEST(CatalogStoreTest, LookupRowsAreBoundedDramFirstAndSpreadOverTheHoldersByRequester) {
  // 200 owners hold the same 128 keys in DRAM, two more only on SSD: a row names at most four, all DRAM; one
  // requester gets the same holders for every key of the prefix (long spans from one source), and requesters
  // together spread over the holders.
  CatalogStore store({kIncarnation});
  for (int o = 0; o < 200; ++o) Baseline(store, 128, Stream(fmt::format("owner-{:03}", o), "run"));
  for (int o = 0; o < 2; ++o) {
    const StreamId ssd = Stream(fmt::format("ssd-{}", o), "run");
    ASSERT_EQ(store.Begin({ssd, 1, 0, 1}).kind, Kind::kAck);
    ASSERT_EQ(store.End({ssd, 1, 1, {CatalogRecord{core::testing::ChainKey(7, 0), 2, true, 1, 1, 4096}}}).kind,
              Kind::kAck);
  }
  std::set<std::string> chosen;
  for (int r = 0; r < 50; ++r) {
    const std::string requester = fmt::format("requester-{}", r);
    bool complete = false;
    const auto first = store.Lookup(3, core::testing::ChainKey(7, 0), &complete, requester);
    EXPECT_TRUE(complete);
    ASSERT_EQ(first.size(), CatalogStore::kMaxHoldersPerKey);
    for (const auto& h : first) {
      EXPECT_EQ(h.record.tier, 1) << h.owner_node;  // DRAM before SSD
      chosen.insert(h.owner_node);
    }
    const auto later = store.Lookup(3, core::testing::ChainKey(7, 127), &complete, requester);
    ASSERT_EQ(later.size(), first.size());
    for (size_t i = 0; i < first.size(); ++i) EXPECT_EQ(later[i].owner_node, first[i].owner_node);
  }
  EXPECT_GE(chosen.size(), 40u) << "50 requesters should be spread over the 200 holders";
  // Fewer DRAM holders than the bound: the SSD ones fill the row after them.
  CatalogStore small({kIncarnation});
  Baseline(small, 1, Stream("dram-a", "run"));
  for (const char* node : {"ssd-a", "ssd-b", "ssd-c", "ssd-d"}) {
    ASSERT_EQ(small.Begin({Stream(node, "run"), 1, 0, 1}).kind, Kind::kAck);
    ASSERT_EQ(
        small.End({Stream(node, "run"), 1, 1, {CatalogRecord{core::testing::ChainKey(7, 0), 2, true, 1, 1, 4096}}})
            .kind,
        Kind::kAck);
  }
  bool complete = false;
  const auto row = small.Lookup(3, core::testing::ChainKey(7, 0), &complete, "requester-1");
  ASSERT_EQ(row.size(), 4u);
  EXPECT_EQ(row[0].owner_node, "dram-a");
  EXPECT_EQ(row[1].record.tier, 2);
}

// Issue 70: lookups read a per-shard index of the views. Every change of a view reaches it (a delta's addition and
// removal, a snapshot replacing a view, a view dropped on a conflict), and a key held by many owners is answered with
// exactly the holders the rule names: DRAM first, node order from the requester's point (FNV-1a of its node id).
TEST(CatalogStoreTest, TheIndexFollowsEveryViewChangeAndAHotKeyGetsTheHoldersTheRuleNames) {
  CatalogStore store({kIncarnation});
  std::vector<std::string> owners;
  for (int o = 99; o >= 0; --o) {  // created out of node order
    owners.push_back(fmt::format("owner-{:03}", o));
    Baseline(store, 4, Stream(owners.back(), "run"));
  }
  std::sort(owners.begin(), owners.end());
  const state::StateKey hot = core::testing::ChainKey(7, 0);
  auto all = [&](const state::StateKey& key) {
    bool complete = false;
    std::set<std::string> nodes;
    for (const auto& h : store.Lookup(3, key, &complete, "", 1000)) nodes.insert(h.owner_node);
    return nodes;
  };
  for (int r = 0; r < 20; ++r) {
    const std::string requester = fmt::format("requester-{}", r);
    uint64_t h = 14695981039346656037ull;
    for (const char c : requester) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ull;
    bool complete = false;
    const auto row = store.Lookup(3, hot, &complete, requester);
    ASSERT_EQ(row.size(), CatalogStore::kMaxHoldersPerKey);
    for (size_t i = 0; i < row.size(); ++i) {
      EXPECT_EQ(row[i].owner_node, owners[(static_cast<size_t>(h) + i) % owners.size()]) << requester << " " << i;
    }
  }
  EXPECT_EQ(all(hot).size(), 100u);
  EXPECT_TRUE(all(core::testing::ChainKey(7, 50)).empty());  // nobody holds it
  // A delta removes the hot key from one owner, then adds it back.
  ASSERT_EQ(store.Apply({Stream("owner-042", "run"), 5, {Remove(0, 5)}}).kind, Kind::kAck);
  EXPECT_EQ(all(hot).size(), 99u);
  EXPECT_EQ(all(hot).count("owner-042"), 0u);
  ASSERT_EQ(store.Apply({Stream("owner-042", "run"), 6, {Add(0, 6)}}).kind, Kind::kAck);
  EXPECT_EQ(all(hot).count("owner-042"), 1u);
  // A new snapshot replaces one owner's view: its old keys leave the index, its new ones enter.
  const StreamId seven = Stream("owner-007", "run");
  ASSERT_EQ(store.Begin({seven, 2, 10, 1}).kind, Kind::kAck);
  ASSERT_EQ(store.End({seven, 2, 11, {Add(60, 11)}}).kind, Kind::kAck);
  EXPECT_EQ(all(hot).size(), 99u);
  EXPECT_EQ(all(hot).count("owner-007"), 0u);
  EXPECT_EQ(all(core::testing::ChainKey(7, 60)), std::set<std::string>{"owner-007"});
  // A conflict drops a view: none of its keys answers any more.
  ASSERT_EQ(store.Apply({Stream("owner-001", "run"), 2, {Add(1, 2, /*generation=*/9)}}).kind, Kind::kResync);
  EXPECT_EQ(all(hot).count("owner-001"), 0u);
  EXPECT_EQ(all(core::testing::ChainKey(7, 1)).size(), 98u);  // not owner-001's, nor owner-007's any more
  EXPECT_EQ(store.used_bytes(), (98 * 4 + 1) * CatalogStore::EntryCharge());
}

// Issue 70: while an owner waits out its absent grace it is no holder, and the rows name the holders the rule names
// over the members only (the walk behind the index's direct read).
TEST(CatalogStoreTest, AnAbsentOwnerIsNoHolderAndTheRuleCountsTheMembersOnly) {
  std::set<std::string> gone;
  CatalogStore::Options options{kIncarnation};
  options.owner_registration = [&](const std::string& node) -> std::optional<CatalogStore::OwnerRegistration> {
    if (gone.count(node) != 0) return CatalogStore::OwnerRegistration{};
    return CatalogStore::OwnerRegistration{"run", 0, 0};
  };
  options.absent_grace = std::chrono::seconds(60);
  CatalogStore store(std::move(options));
  std::vector<std::string> members;
  for (int o = 0; o < 70; ++o) {
    members.push_back(fmt::format("owner-{:03}", o));
    Baseline(store, 2, Stream(members.back(), "run"));
  }
  gone.insert("owner-010");
  EXPECT_EQ(store.DropDeadOwners(), 0u);  // absent, within its grace: kept, no holder
  members.erase(std::find(members.begin(), members.end(), "owner-010"));
  const state::StateKey hot = core::testing::ChainKey(7, 1);
  bool complete = false;
  EXPECT_EQ(store.Lookup(3, hot, &complete, "", 1000).size(), 69u);
  for (int r = 0; r < 10; ++r) {
    const std::string requester = fmt::format("requester-{}", r);
    uint64_t h = 14695981039346656037ull;
    for (const char c : requester) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ull;
    const auto row = store.Lookup(3, hot, &complete, requester);
    ASSERT_EQ(row.size(), CatalogStore::kMaxHoldersPerKey);
    for (size_t i = 0; i < row.size(); ++i) {
      EXPECT_EQ(row[i].owner_node, members[(static_cast<size_t>(h) + i) % members.size()]) << requester << " " << i;
    }
  }
  gone.clear();  // back before its grace ran out: a holder again
  EXPECT_EQ(store.DropDeadOwners(), 0u);
  EXPECT_EQ(store.Lookup(3, hot, &complete, "", 1000).size(), 70u);
}

// Issue 70: with the member view's generation, the live owners are read only when it moved and a shard's completeness
// is derived again only when its slices changed state: lookups neither copy the view nor walk its owners. A change
// is never missed: a baseline installed or lost, a new start in the view.
TEST(CatalogStoreTest, CompletenessIsCachedUntilTheShardOrTheMemberViewChanges) {
  std::optional<std::vector<std::pair<std::string, std::string>>> live =
      std::vector<std::pair<std::string, std::string>>{{"node-a", "run-1"}, {"node-b", "run-2"}};
  uint64_t generation = 1;
  int reads = 0;
  CatalogStore::Options options{kIncarnation};
  options.live_owners = [&] {
    ++reads;
    return live;
  };
  options.live_owners_generation = [&] { return generation; };
  CatalogStore store(std::move(options));
  Baseline(store, 2, Stream("node-a", "run-1"));
  EXPECT_FALSE(store.Complete(3));
  Baseline(store, 2, Stream("node-b", "run-2"));
  EXPECT_TRUE(store.Complete(3));
  const int before = reads;
  bool complete = false;
  for (int i = 0; i < 100; ++i) store.Lookup(3, core::testing::ChainKey(7, 0), &complete);
  EXPECT_TRUE(complete);
  EXPECT_EQ(reads, before);  // the view did not move: not read again
  // node-b's view is lost to a conflict: incomplete at once, with the member view unchanged.
  ASSERT_EQ(store.Apply({Stream("node-b", "run-2"), 2, {Add(1, 2, /*generation=*/9)}}).kind, Kind::kResync);
  EXPECT_FALSE(store.Complete(3));
  ASSERT_EQ(store.Begin({Stream("node-b", "run-2"), 2, 2, 1}).kind, Kind::kAck);  // its next snapshot
  ASSERT_EQ(store.End({Stream("node-b", "run-2"), 2, 3, {Add(5, 3)}}).kind, Kind::kAck);
  EXPECT_TRUE(store.Complete(3));
  // node-b restarts: the view moves, and its old baseline no longer counts.
  live = std::vector<std::pair<std::string, std::string>>{{"node-a", "run-1"}, {"node-b", "run-3"}};
  ++generation;
  EXPECT_FALSE(store.Complete(3));
  EXPECT_EQ(reads, before + 1);
  ASSERT_EQ(store.Begin({Stream("node-b", "run-3"), 1, 0, 1}).kind, Kind::kAck);
  EXPECT_FALSE(store.Complete(3));  // a snapshot in progress
  ASSERT_EQ(store.End({Stream("node-b", "run-3"), 1, 1, {Add(0, 1)}}).kind, Kind::kAck);
  EXPECT_TRUE(store.Complete(3));
  live = std::nullopt;  // the member view is incomplete
  ++generation;
  EXPECT_FALSE(store.Complete(3));
}

// Issue 70: DropDeadOwners (every 500 ms on a catalog host) does nothing while the member view stands still and no
// owner waits out its absent grace; it looks again as soon as either changes.
TEST(CatalogStoreTest, DropDeadOwnersSkipsItsRoundWhileTheMemberViewStandsStill) {
  std::map<std::string, CatalogStore::OwnerRegistration> members = {{"node-a", {"run-1", 0, 0}},
                                                                    {"node-b", {"run-2", 0, 0}}};
  uint64_t generation = 1;
  int asked = 0;
  CatalogStore::Options options{kIncarnation};
  options.owner_registration = [&](const std::string& node) -> std::optional<CatalogStore::OwnerRegistration> {
    ++asked;
    auto it = members.find(node);
    return it == members.end() ? CatalogStore::OwnerRegistration{} : it->second;
  };
  options.live_owners_generation = [&] { return generation; };
  options.absent_grace = std::chrono::milliseconds(100);
  CatalogStore store(std::move(options));
  Baseline(store, 2, Stream("node-a", "run-1"));
  Baseline(store, 2, Stream("node-b", "run-2"));
  EXPECT_EQ(store.DropDeadOwners(), 0u);
  asked = 0;
  EXPECT_EQ(store.DropDeadOwners(), 0u);
  EXPECT_EQ(asked, 0);  // nothing moved: no owner looked up
  members.erase("node-b");
  ++generation;
  EXPECT_EQ(store.DropDeadOwners(), 0u);  // absent: within its grace
  EXPECT_GT(asked, 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  EXPECT_EQ(store.DropDeadOwners(), 1u);  // the view did not move again, but a grace was running
  EXPECT_EQ(store.Slices(3).size(), 1u);
  asked = 0;
  EXPECT_EQ(store.DropDeadOwners(), 0u);
  EXPECT_EQ(asked, 0);
}

TEST(CatalogStoreTest, ANewCatalogStartAndDeadOwnersAreRefused) {
  bool a_live = true;
  CatalogStore::Options options{kIncarnation};
  options.owner_live = [&](const std::string& node, const std::string& runtime) {
    return node == "node-a" ? a_live && runtime == "run-1" : true;
  };
  CatalogStore store(options);
  Baseline(store, 2);
  StreamId old_catalog = Stream();
  old_catalog.catalog_incarnation = kIncarnation + 1;  // the owner streamed to an earlier start of this host
  CatalogReply reply = store.Apply({old_catalog, 3, {Add(3, 3)}});
  EXPECT_EQ(reply.kind, Kind::kResync);
  EXPECT_EQ(reply.catalog_incarnation, kIncarnation);
  // An older start of node-a replaying its RPCs is refused.
  EXPECT_EQ(store.Apply({Stream("node-a", "run-0"), 3, {Add(3, 3)}}).kind, Kind::kRefused);
  EXPECT_EQ(store.Begin({Stream("node-a", "run-0"), 5, 0, 1}).kind, Kind::kRefused);
  EXPECT_EQ(store.Dump(3, "node-a").size(), 2u);
  // node-a fenced: its slice goes, and its late RPCs are refused.
  a_live = false;
  EXPECT_EQ(store.DropDeadOwners(), 1u);
  EXPECT_TRUE(store.Dump(3, "node-a").empty());
  EXPECT_EQ(store.used_bytes(), 0u);
  EXPECT_EQ(store.Apply({Stream(), 3, {Add(3, 3)}}).kind, Kind::kRefused);
}

}  // namespace
}  // namespace orbitkv::catalog
