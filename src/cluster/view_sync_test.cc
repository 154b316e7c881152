// The member view against a real etcd: malformed and oversized records, compaction during Watch,
// the member limit (the oldest count, the rest wait in line), and an observer that watches without registering.
#include "cluster/view_sync.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "cluster/etcd_client.h"
#include "cluster/testing/cluster_fixture.h"

namespace orbitkv::cluster {
namespace {

using testing::CounterValue;
using testing::EtcdTest;
using testing::kWaitLimit;
using testing::WaitUntil;

// A ViewSync that only watches (no registration), on its own thread for the scope.
struct Observer {
  Observer(EtcdClient* client, const std::string& cluster, std::function<void()> on_reconnect = nullptr) {
    ViewSync::Options options;
    options.cluster = cluster;
    options.metrics = &metrics;
    options.on_reconnect = std::move(on_reconnect);
    sync = std::make_unique<ViewSync>(client, &view, options);
    thread = std::thread([this] { sync->Run(); });
  }
  ~Observer() {
    sync->Stop();
    thread.join();
  }
  MetricsRegistry metrics;
  MemberView view;
  std::unique_ptr<ViewSync> sync;
  std::thread thread;
};

class ViewSyncTest : public EtcdTest {
 protected:
  uint64_t Snapshots(MetricsRegistry& m) { return CounterValue(m, "orbitkv_membership_snapshots_total"); }
  uint64_t Invalidations(MetricsRegistry& m, const char* reason) {
    return CounterValue(m, "orbitkv_membership_view_invalidations_total", {{"reason", reason}});
  }
  uint64_t Rejected(MetricsRegistry& m, const char* reason) {
    return CounterValue(m, "orbitkv_membership_rejected_records_total", {{"reason", reason}});
  }

  // Writes `count` valid member records node-0000.. in transactions of 128 puts.
  void PutFakeMembers(int first, int count) {
    for (int start = first; start < first + count; start += 128) {
      etcdserverpb::TxnRequest txn;
      for (int i = start; i < std::min(first + count, start + 128); ++i) {
        const std::string node = fmt::format("node-{:04}", i);
        etcdserverpb::PutRequest* put = txn.add_success()->mutable_request_put();
        put->set_key(MemberKey(cluster_, node));
        put->set_value(FakeRecord(node));
      }
      Result<etcdserverpb::TxnResponse> r = raw_->Txn(txn, Deadline::After(kWaitLimit));
      ASSERT_TRUE(r.ok() && r->succeeded()) << r.status();
    }
  }
};

TEST_F(ViewSyncTest, MalformedAndOversizedRecordsAreIgnoredAndTriggerAFreshSnapshot) {
  MetricsRegistry m;
  auto a = Join(Options("node-a"), &m);
  ASSERT_TRUE(a);
  ASSERT_TRUE(WaitUntil([&] { return a->view().complete(); }));
  ASSERT_EQ(Snapshots(m), 1u);

  ASSERT_TRUE(RawPut(MemberKey(cluster_, "bad"), "{not json").ok());
  // The Watch event invalidates the view; the fresh snapshot skips the record again and completes.
  ASSERT_TRUE(WaitUntil([&] { return Snapshots(m) == 2 && a->view().complete(); }));
  EXPECT_EQ(Invalidations(m, "malformed"), 1u);
  EXPECT_EQ(Rejected(m, "malformed"), 2u);  // Once in the event, once in the snapshot.
  EXPECT_EQ(a->view().Find("bad").status().code(), StatusCode::kNotFound);

  std::string big = FakeRecord("big");
  big.insert(big.size() - 1, ",\"pad\":\"" + std::string(2048, 'x') + "\"");
  ASSERT_TRUE(RawPut(MemberKey(cluster_, "big"), big).ok());
  ASSERT_TRUE(WaitUntil([&] { return Snapshots(m) == 3 && a->view().complete(); }));
  EXPECT_EQ(Rejected(m, "oversized"), 2u);
  EXPECT_EQ(a->view().Find("big").status().code(), StatusCode::kNotFound);
  // A record under a name that is not a Node ID is malformed too.
  ASSERT_TRUE(RawPut(MemberKey(cluster_, "a/b"), FakeRecord("ok")).ok());
  ASSERT_TRUE(WaitUntil([&] { return Snapshots(m) == 4 && a->view().complete(); }));
  // Throughout, the registration itself was never in doubt.
  EXPECT_EQ(a->state(), MembershipState::kRegistered);
  EXPECT_TRUE(a->CanDoRemoteWork());
}

TEST_F(ViewSyncTest, CompactionDuringWatchTriggersAFreshSnapshot) {
  MetricsRegistry m;
  MembershipOptions o = Options("node-a");
  std::atomic<int> installs{0};
  // Between the first snapshot (revision R) and its Watch (from R+1), history up to a newer
  // revision is compacted away; the Watch must be cancelled for compaction and the view rebuilt
  // from a fresh snapshot.
  o.on_view_installed = [&](int64_t) {
    if (installs.fetch_add(1) != 0) return;
    ASSERT_TRUE(RawPut(MemberKey(cluster_, "ghost-1"), FakeRecord("ghost-1")).ok());
    ASSERT_TRUE(RawPut(MemberKey(cluster_, "ghost-2"), FakeRecord("ghost-2")).ok());
    Result<int64_t> now = CurrentRevision();
    ASSERT_TRUE(now.ok());
    etcdserverpb::CompactionRequest compact;
    compact.set_revision(*now);
    ASSERT_TRUE(raw_->Compact(compact, Deadline::After(kWaitLimit)).ok());
  };
  auto a = Join(o, &m);
  ASSERT_TRUE(a);
  ASSERT_TRUE(WaitUntil([&] { return installs.load() == 2 && a->view().complete(); }));
  EXPECT_EQ(Invalidations(m, "compaction"), 1u);
  EXPECT_TRUE(Sees(*a, "ghost-1"));
  EXPECT_TRUE(Sees(*a, "ghost-2"));
  EXPECT_EQ(a->state(), MembershipState::kRegistered);
}

// Issue 69: one member more than the limit (4,096) used to overflow every view, for ever: every Manager lost remote
// work. Now the 4,096 oldest registrations count, the younger one waits in line, and no view becomes incomplete.
TEST_F(ViewSyncTest, OneMemberTooManyWaitsInLineAndNobodyLosesRemoteWork) {
  // 4,095 others plus node-a is exactly the limit.
  PutFakeMembers(0, static_cast<int>(kMaxMembers) - 1);
  MetricsRegistry m;
  auto a = Join(Options("node-a"), &m);
  ASSERT_TRUE(a);
  ASSERT_TRUE(WaitUntil([&] { return a->view().complete(); }));
  EXPECT_EQ(a->view().size(), kMaxMembers);
  EXPECT_TRUE(a->CanDoRemoteWork());
  // Snapshot pages hold at most 128 records at one revision.
  EXPECT_GE(CounterValue(m, "orbitkv_etcd_calls_total", {{"method", "Range"}}), kMaxMembers / 128);
  const uint64_t snapshots = CounterValue(m, "orbitkv_membership_snapshots_total");

  // One more member arrives through the Watch: it waits in line; the view stays complete.
  ASSERT_TRUE(RawPut(MemberKey(cluster_, "one-too-many"), FakeRecord("one-too-many")).ok());
  ASSERT_TRUE(WaitUntil([&] { return a->view().PlaceOf("one-too-many").standing == MemberView::Standing::kWaiting; }));
  EXPECT_EQ(a->view().PlaceOf("one-too-many").position, 1u);
  const Status beyond = a->view().Find("one-too-many").status();
  EXPECT_EQ(beyond.code(), StatusCode::kNotFound);
  EXPECT_NE(beyond.message().find("member limit of 4096"), std::string::npos) << beyond;
  EXPECT_TRUE(a->view().complete());
  EXPECT_EQ(a->view().size(), kMaxMembers);
  EXPECT_TRUE(a->CanDoRemoteWork());
  EXPECT_EQ(CounterValue(m, "orbitkv_membership_snapshots_total"), snapshots) << "the view was rebuilt";
  EXPECT_EQ(a->view().Read().waiting, 1u);

  // An older one leaves: the one in line is counted, without a snapshot.
  ASSERT_TRUE(RawDelete(MemberKey(cluster_, "node-0000")).ok());
  ASSERT_TRUE(WaitUntil([&] { return Sees(*a, "one-too-many"); }));
  EXPECT_EQ(a->view().size(), kMaxMembers);
  EXPECT_EQ(a->view().Read().waiting, 0u);
  EXPECT_TRUE(a->CanDoRemoteWork());
  EXPECT_EQ(CounterValue(m, "orbitkv_membership_snapshots_total"), snapshots);

  // A fresh Manager's snapshot of a cluster past its limit counts the same ones.
  ASSERT_TRUE(RawPut(MemberKey(cluster_, "late"), FakeRecord("late")).ok());
  Observer fresh(raw_.get(), cluster_);
  ASSERT_TRUE(WaitUntil([&] { return fresh.view.complete() && fresh.view.PlaceOf("late").position == 1; }));
  ASSERT_TRUE(WaitUntil([&] { return a->view().PlaceOf("late").position == 1; }));
  EXPECT_EQ(fresh.view.Read().members, a->view().Read().members);
}

// Issue 69: a broken watch no longer re-reads the whole view (about 1 MB at 4,096 members, from every Manager at
// once after an etcd failover): the view catches up from a count and the records changed since its revision; only a
// deletion in the gap (which no changed record shows) takes a snapshot.
TEST_F(ViewSyncTest, ABrokenWatchCatchesUpFromTheChangesAndSnapshotsOnlyForADeletion) {
  PutFakeMembers(0, 300);
  std::atomic<int> gap{0};  // what the test changes in etcd while the watch is down
  Observer observer(raw_.get(), cluster_, [&] {
    const int what = gap.exchange(0);
    if (what == 1) {
      ASSERT_TRUE(RawPut(MemberKey(cluster_, "late-1"), FakeRecord("late-1")).ok());
      ASSERT_TRUE(RawPut(MemberKey(cluster_, "node-0001"), FakeRecord("node-0001", 2)).ok());
    } else if (what == 2) {
      ASSERT_TRUE(RawDelete(MemberKey(cluster_, "node-0002")).ok());
    }
  });
  MemberView& view = observer.view;
  ASSERT_TRUE(WaitUntil([&] { return view.complete() && view.size() == 300; }));
  ASSERT_EQ(Snapshots(observer.metrics), 1u);
  const uint64_t ranges = CounterValue(raw_metrics_, "orbitkv_etcd_calls_total", {{"method", "Range"}});

  gap = 1;
  observer.sync->BreakWatchForTesting();
  ASSERT_TRUE(WaitUntil([&] {
    Result<Member> changed = view.Find("node-0001");
    return view.complete() && view.Find("late-1").ok() && changed.ok() && changed->record.epoch == 2 &&
           CounterValue(observer.metrics, "orbitkv_membership_view_catch_ups_total") == 1u;
  }));
  EXPECT_EQ(view.size(), 301u);
  EXPECT_EQ(Snapshots(observer.metrics), 1u) << "a reconnect re-read the whole view";
  EXPECT_EQ(CounterValue(observer.metrics, "orbitkv_membership_view_catch_ups_total"), 1u);
  EXPECT_EQ(Invalidations(observer.metrics, "reconnect"), 1u);
  // Two small reads (a count, the changes), not three pages of 128.
  EXPECT_EQ(CounterValue(raw_metrics_, "orbitkv_etcd_calls_total", {{"method", "Range"}}) - ranges, 2u);

  // A deletion in the gap: the count says so, and a snapshot rebuilds the view.
  gap = 2;
  observer.sync->BreakWatchForTesting();
  ASSERT_TRUE(
      WaitUntil([&] { return view.complete() && view.Find("node-0002").status().code() == StatusCode::kNotFound; }));
  EXPECT_EQ(view.size(), 300u);
  EXPECT_EQ(Snapshots(observer.metrics), 2u);
  EXPECT_EQ(CounterValue(observer.metrics, "orbitkv_membership_view_catch_ups_total"), 1u);
}

TEST_F(ViewSyncTest, ObserverFollowsMembersWithoutRegistering) {
  Observer observer(raw_.get(), cluster_);
  MemberView& view = observer.view;
  ASSERT_TRUE(WaitUntil([&] { return view.complete(); }));
  EXPECT_EQ(view.size(), 0u);
  ASSERT_TRUE(RawPut(MemberKey(cluster_, "x"), FakeRecord("x")).ok());
  ASSERT_TRUE(WaitUntil([&] { return view.Find("x").ok(); }));
  const int64_t revision = view.revision();
  ASSERT_TRUE(RawDelete(MemberKey(cluster_, "x")).ok());
  ASSERT_TRUE(WaitUntil([&] { return view.Find("x").status().code() == StatusCode::kNotFound; }));
  EXPECT_GT(view.revision(), revision);
  // Keys outside the view range never show up.
  ASSERT_TRUE(RawPut(EpochKey(cluster_, "y"), "5").ok());
  ASSERT_TRUE(RawPut(MemberKey(cluster_, "z"), FakeRecord("z")).ok());
  ASSERT_TRUE(WaitUntil([&] { return view.Find("z").ok(); }));
  EXPECT_EQ(view.size(), 1u);
}

}  // namespace
}  // namespace orbitkv::cluster
