// Issue 55: the placement transition record, reconciler leadership and the transition state machine against a
// real etcd, behind the CatalogProgress seam (a test model of the catalog copies: owners' sequences, and new
// copies that catch up when the test lets them). Each step is one Step() pass, as the reconciler thread makes them.
#include "cluster/placement_reconciler.h"

#include <gtest/gtest.h>

#include <set>

#include "cluster/cluster_keys.h"
#include "cluster/testing/cluster_fixture.h"

namespace orbitkv::cluster {
namespace {

using testing::kWaitLimit;

Deadline Soon() { return Deadline::After(kWaitLimit); }

// The catalog copies as the CatalogStatus RPC would report them: per (node, shard), per owner, a baseline and a
// sequence. Owners' sequences grow on the current copies; a new copy holds an owner once the test lets it catch up.
class ModelCatalog final : public CatalogProgress {
 public:
  Result<std::map<std::string, OwnerProgress>> ShardStatus(const std::string& node, uint32_t shard,
                                                           int64_t /*generation*/, Deadline /*deadline*/) override {
    if (down.count(node) != 0) return Status::Unavailable(fmt::format("'{}' is down", node));
    std::map<std::string, OwnerProgress> out;
    for (const std::string& owner : owners) {
      if (original.count(node) != 0) out[owner] = OwnerProgress{true, sequence + shard};
      if (caught_up.count(node) != 0) out[owner] = OwnerProgress{true, sequence + shard - behind};
    }
    return out;
  }
  std::vector<std::string> owners = {"n1", "n2", "n3"};
  std::set<std::string> original = {"n1", "n2", "n3"};  // copies of generation 1
  std::set<std::string> caught_up;                      // new copies that have caught up
  std::set<std::string> down;
  uint64_t sequence = 100;
  uint64_t behind = 0;  // how far the sequences a caught-up new copy reports trail the current copies' ones
};

class PlacementReconcilerTest : public testing::EtcdTest {
 protected:
  void SetUp() override {
    testing::EtcdTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    Result<Placement> p = Placement::Create({"n1", "n2", "n3"}, 3);
    ASSERT_TRUE(p.ok());
    ASSERT_TRUE(InstallOrVerifyPlacement(*raw_, cluster_, *p, Soon()).ok());
  }

  int64_t Lease(int64_t ttl = 30) {
    etcdserverpb::LeaseGrantRequest grant;
    grant.set_ttl(ttl);
    Result<etcdserverpb::LeaseGrantResponse> lease = raw_->LeaseGrant(grant, Soon());
    EXPECT_TRUE(lease.ok()) << lease.status();
    return lease.ok() ? lease->id() : 0;
  }
  void Revoke(int64_t lease) {
    etcdserverpb::LeaseRevokeRequest revoke;
    revoke.set_id(lease);
    ASSERT_TRUE(raw_->LeaseRevoke(revoke, Soon()).ok());
  }

  PlacementReconciler::Options ReconcilerOptions() {
    PlacementReconciler::Options o;
    o.cluster = cluster_;
    o.max_moving = 2;
    o.shard_bound = std::chrono::milliseconds(60'000);
    o.retire_grace = std::chrono::milliseconds(10'000);
    o.now_ms = [this] { return now_ms_; };
    o.live_owners = [this] { return catalog_.owners; };
    o.progress = &catalog_;
    return o;
  }

  Status Request(std::vector<std::string> nodes) {
    PlacementRequest r;
    r.catalog_nodes = std::move(nodes);
    r.replicas = 3;
    r.requested_by = "operator";
    r.requested_ms = now_ms_;
    return RawPut(PlacementRequestKey(cluster_), r.Encode());
  }

  Result<PlacementReconciler::Snapshot> Read() {
    PlacementReconciler reader(ReconcilerOptions(), raw_.get());
    return reader.Read(Soon());
  }

  ModelCatalog catalog_;
  int64_t now_ms_ = 1'000'000;
};

TEST(PlacementTransitionTest, RoundTripsAndRefusesMalformedRecords) {
  const Placement from = *Placement::Create({"n1", "n2", "n3"}, 3);
  const Placement to = *Placement::Create({"n1", "n2", "n3", "n4"}, 3);
  PlacementTransition t = PlacementTransition::Start(from, to, "n1/uuid", 42);
  EXPECT_EQ(t.To().generation(), 2);
  size_t moving = 0;
  for (uint32_t shard = 0; shard < kNumShards; ++shard) {
    const bool gains = !PlacementTransition::NewCopies(from, t.To(), shard).empty();
    EXPECT_EQ(t.shards[shard].state, gains ? ShardMove::State::kWaiting : ShardMove::State::kStay);
    moving += gains;
  }
  EXPECT_GT(moving, 0u);
  EXPECT_LT(moving, kNumShards);  // n4 takes some shards' third copy, not every shard's
  t.shards[3].state = ShardMove::State::kMoving;
  t.shards[3].watermarks = {{"n1", 7}, {"n2", 0}};
  Result<PlacementTransition> back = PlacementTransition::Decode(t.Encode());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->Encode(), t.Encode());
  EXPECT_EQ(back->shards[3], t.shards[3]);
  for (const std::string& bad :
       {std::string("{}"), t.Encode().replace(t.Encode().find("moving"), 6, "flying"),
        t.Encode().replace(t.Encode().find("\"to_generation\":2"), 17, "\"to_generation\":3")}) {
    EXPECT_FALSE(PlacementTransition::Decode(bad).ok()) << bad;
  }
  const Placement next = *Placement::Create({"n1", "n2", "n3"}, 3, 2);
  EXPECT_EQ(next.generation(), 2);
  EXPECT_TRUE(next.SameContent(from));
  EXPECT_FALSE(next == from);
  EXPECT_NE(next.fingerprint(), from.fingerprint());
}

TEST_F(PlacementReconcilerTest, OneLeaderAtATimeAndADeposedLeadersWriteChangesNothing) {
  ReconcilerLeadership a(raw_.get(), cluster_, "n1", "uuid-a");
  ReconcilerLeadership b(raw_.get(), cluster_, "n2", "uuid-b");
  const int64_t lease_a = Lease();
  ASSERT_TRUE(a.Campaign(lease_a, Soon()).value());
  EXPECT_FALSE(b.Campaign(Lease(), Soon()).value());
  EXPECT_TRUE(a.Campaign(lease_a, Soon()).value());  // a repeated campaign: still this start's
  EXPECT_EQ(b.Leader(Soon()).value(), "n1/uuid-a");
  // A starts a change; then its lease goes (a killed Manager) and B leads.
  ASSERT_TRUE(Request({"n1", "n2", "n3", "n4"}).ok());
  PlacementReconciler ra(ReconcilerOptions(), raw_.get());
  ASSERT_EQ(ra.Step(a, Soon()).value().did, PlacementReconciler::Did::kStarted);
  Revoke(lease_a);
  ASSERT_TRUE(b.Campaign(Lease(), Soon()).value());
  const int64_t revision = Read()->transition_revision;
  // A still believes it leads: its next write fails on the leader key's compares, and A stops leading.
  EXPECT_TRUE(a.leading());
  Result<PlacementReconciler::Outcome> deposed = ra.Step(a, Soon());
  ASSERT_TRUE(deposed.ok()) << deposed.status();
  EXPECT_EQ(deposed->did, PlacementReconciler::Did::kNotLeader) << deposed->detail;
  EXPECT_FALSE(a.leading());
  EXPECT_EQ(Read()->transition_revision, revision);
  // A lapsed registration gives up at once, before any etcd call.
  b.Lapsed();
  EXPECT_FALSE(b.leading());
  PlacementReconciler rb(ReconcilerOptions(), raw_.get());
  EXPECT_EQ(rb.Step(b, Soon()).value().did, PlacementReconciler::Did::kNotLeader);
}

// Adds a fourth catalog node: at most two shards move at once, each becomes ready only when its new copy holds
// every live owner past the watermark taken when it started, and G+1 commits in one transaction; the record
// retires after the grace period.
TEST_F(PlacementReconcilerTest, AddingANodeMovesAtMostTwoShardsAtOnceAndCommitsTheNextGeneration) {
  ReconcilerLeadership leader(raw_.get(), cluster_, "n1", "uuid-a");
  ASSERT_TRUE(leader.Campaign(Lease(), Soon()).value());
  PlacementReconciler reconciler(ReconcilerOptions(), raw_.get());
  EXPECT_EQ(reconciler.Step(leader, Soon()).value().did, PlacementReconciler::Did::kNothing);
  ASSERT_TRUE(Request({"n1", "n2", "n3", "n4"}).ok());
  ASSERT_EQ(reconciler.Step(leader, Soon()).value().did, PlacementReconciler::Did::kStarted);
  EXPECT_FALSE(Read()->request.has_value());  // consumed in the same transaction
  // The new copy has baselines, but of sequences older than the watermarks taken when its shards started moving:
  // nothing is ready.
  catalog_.caught_up = {"n4"};
  catalog_.behind = 50;
  for (int pass = 0; pass < 3; ++pass) {
    now_ms_ += 100;
    ASSERT_TRUE(reconciler.Step(leader, Soon()).ok());
    EXPECT_EQ(Read()->transition->CountIn(ShardMove::State::kReady), 0u);
    EXPECT_EQ(Read()->transition->CountIn(ShardMove::State::kMoving), 2u);
  }
  catalog_.behind = 0;
  catalog_.caught_up.clear();
  size_t passes = 0;
  PlacementReconciler::Did did = PlacementReconciler::Did::kNothing;
  while (did != PlacementReconciler::Did::kCommitted && passes++ < 64) {
    now_ms_ += 100;
    Result<PlacementReconciler::Outcome> step = reconciler.Step(leader, Soon());
    ASSERT_TRUE(step.ok()) << step.status();
    did = step->did;
    Result<PlacementReconciler::Snapshot> s = Read();
    ASSERT_TRUE(s.ok());
    if (s->transition.has_value() && s->transition->phase == PlacementTransition::Phase::kMoving) {
      EXPECT_LE(s->transition->CountIn(ShardMove::State::kMoving), 2u);
      for (const ShardMove& m : s->transition->shards) {
        if (m.state != ShardMove::State::kMoving) continue;
        // Watermarks: every live owner, at the sequence the current copies reported when the move started.
        EXPECT_EQ(m.watermarks.size(), 3u);
      }
    }
    // The new copy catches up one pass after its shard started moving (owners keep publishing meanwhile).
    if (passes % 2 == 0) catalog_.caught_up.insert("n4");
    if (passes % 2 == 1) catalog_.caught_up.erase("n4");
    catalog_.sequence += 1;
  }
  ASSERT_EQ(did, PlacementReconciler::Did::kCommitted);
  Result<PlacementReconciler::Snapshot> s = Read();
  ASSERT_TRUE(s.ok() && s->placement.has_value() && s->transition.has_value());
  EXPECT_EQ(s->placement->generation(), 2);
  EXPECT_EQ(s->placement->catalog_nodes(), (std::vector<std::string>{"n1", "n2", "n3", "n4"}));
  EXPECT_EQ(s->transition->phase, PlacementTransition::Phase::kCommitted);
  EXPECT_EQ(reconciler.stats().committed, 1u);
  EXPECT_EQ(reconciler.stats().shard_moves, s->transition->CountIn(ShardMove::State::kReady));
  EXPECT_EQ(reconciler.Step(leader, Soon()).value().did, PlacementReconciler::Did::kWaiting);  // the grace period
  now_ms_ += 10'001;
  EXPECT_EQ(reconciler.Step(leader, Soon()).value().did, PlacementReconciler::Did::kRetired);
  EXPECT_FALSE(Read()->transition.has_value());
}

// The leader dies after each of the first k passes; a new leader finishes the change from what etcd holds.
TEST_F(PlacementReconcilerTest, ANewLeaderFinishesWhateverStepTheOldOneDiedAfter) {
  for (int k = 1; k <= 5; ++k) {
    SCOPED_TRACE(k);
    // Back to generation 1 of three nodes: a fresh cluster name per round.
    cluster_ = fmt::format("kill{}", k);
    ASSERT_TRUE(InstallOrVerifyPlacement(*raw_, cluster_, *Placement::Create({"n1", "n2", "n3"}, 3), Soon()).ok());
    catalog_.caught_up = {"n4"};
    ASSERT_TRUE(Request({"n1", "n2", "n3", "n4"}).ok());
    const int64_t lease_a = Lease();
    ReconcilerLeadership a(raw_.get(), cluster_, "n1", "uuid-a");
    ASSERT_TRUE(a.Campaign(lease_a, Soon()).value());
    PlacementReconciler ra(ReconcilerOptions(), raw_.get());
    for (int pass = 0; pass < k; ++pass) ASSERT_TRUE(ra.Step(a, Soon()).ok());
    Revoke(lease_a);  // killed
    ReconcilerLeadership b(raw_.get(), cluster_, "n2", "uuid-b");
    ASSERT_TRUE(b.Campaign(Lease(), Soon()).value());
    PlacementReconciler rb(ReconcilerOptions(), raw_.get());
    for (int pass = 0; pass < 40 && Read()->placement->generation() == 1; ++pass) ASSERT_TRUE(rb.Step(b, Soon()).ok());
    EXPECT_EQ(Read()->placement->generation(), 2);
  }
}

// A new copy that never catches up (its host killed while catching up) aborts the change after the shard bound:
// generation 1 stays, the abort is marked with its reason and counted; the host coming back before the bound
// lets the change finish instead.
TEST_F(PlacementReconcilerTest, ACopyThatDoesNotConvergeAbortsTheChangeAndGenerationOneStays) {
  ReconcilerLeadership leader(raw_.get(), cluster_, "n1", "uuid-a");
  ASSERT_TRUE(leader.Campaign(Lease(), Soon()).value());
  PlacementReconciler::Options options = ReconcilerOptions();
  options.shard_bound = std::chrono::milliseconds(5'000);
  PlacementReconciler reconciler(options, raw_.get());
  ASSERT_TRUE(Request({"n1", "n2", "n3", "n4"}).ok());
  ASSERT_EQ(reconciler.Step(leader, Soon()).value().did, PlacementReconciler::Did::kStarted);
  catalog_.down = {"n4"};
  PlacementReconciler::Did did = PlacementReconciler::Did::kNothing;
  for (int pass = 0; pass < 20 && did != PlacementReconciler::Did::kAborted; ++pass) {
    now_ms_ += 1'000;
    did = reconciler.Step(leader, Soon()).value().did;
  }
  ASSERT_EQ(did, PlacementReconciler::Did::kAborted);
  Result<PlacementReconciler::Snapshot> s = Read();
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->placement->generation(), 1);
  EXPECT_EQ(s->transition->phase, PlacementTransition::Phase::kAborted);
  EXPECT_NE(s->transition->reason.find("did not converge within 5 s: copy 'n4' did not answer"), std::string::npos)
      << s->transition->reason;
  EXPECT_EQ(reconciler.stats().aborted, 1u);
  now_ms_ += 10'001;
  EXPECT_EQ(reconciler.Step(leader, Soon()).value().did, PlacementReconciler::Did::kRetired);
  // Asked again, with the host back in time, the change commits.
  catalog_.down.clear();
  catalog_.caught_up = {"n4"};
  ASSERT_TRUE(Request({"n1", "n2", "n3", "n4"}).ok());
  for (int pass = 0; pass < 40 && Read()->placement->generation() == 1; ++pass) {
    now_ms_ += 100;
    ASSERT_TRUE(reconciler.Step(leader, Soon()).ok());
  }
  EXPECT_EQ(Read()->placement->generation(), 2);
}

// etcd stops mid-change: passes fail with etcd's error and change nothing; once it is back the change goes on.
TEST_F(PlacementReconcilerTest, EtcdStoppedMidChangeLosesNothing) {
  ReconcilerLeadership leader(raw_.get(), cluster_, "n1", "uuid-a");
  ASSERT_TRUE(leader.Campaign(Lease(120), Soon()).value());
  PlacementReconciler reconciler(ReconcilerOptions(), raw_.get());
  catalog_.caught_up = {"n4"};
  ASSERT_TRUE(Request({"n1", "n2", "n3", "n4"}).ok());
  ASSERT_EQ(reconciler.Step(leader, Soon()).value().did, PlacementReconciler::Did::kStarted);
  ASSERT_TRUE(reconciler.Step(leader, Soon()).ok());
  ASSERT_TRUE(etcd_->Stop().ok());
  Result<PlacementReconciler::Outcome> down = reconciler.Step(leader, Deadline::After(std::chrono::seconds(2)));
  EXPECT_FALSE(down.ok());
  ASSERT_TRUE(etcd_->Launch().ok());
  ASSERT_TRUE(etcd_->WaitReady(Soon()).ok());
  for (int pass = 0; pass < 40 && Read()->placement->generation() == 1; ++pass) {
    now_ms_ += 100;
    Result<PlacementReconciler::Outcome> step = reconciler.Step(leader, Soon());
    ASSERT_TRUE(step.ok()) << step.status();
  }
  EXPECT_EQ(Read()->placement->generation(), 2);
}

}  // namespace
}  // namespace orbitkv::cluster
