// Membership against a real etcd: registration, epochs, duplicate Node IDs, expiry after kill -9,
// fencing, placement, etcd restarts and the no-etcd-call guarantee of the cache-operation path.
#include "cluster/membership.h"
#include "cluster/placement_transition.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <mutex>
#include <thread>

#include "cluster/etcd_client.h"
#include "cluster/testing/child_process.h"
#include "cluster/testing/cluster_fixture.h"

namespace orbitkv::cluster {
namespace {

using testing::CounterValue;
using testing::EtcdTest;
using testing::kWaitLimit;
using testing::WaitUntil;

class MembershipTest : public EtcdTest {};

TEST_F(MembershipTest, TwoManagersRegisterAndSeeEachOther) {
  MetricsRegistry ma, mb;
  auto a = Join(Options("node-a", {"node-a", "node-b"}), &ma);
  auto b = Join(Options("node-b", {"node-b", "node-a"}), &mb);
  ASSERT_TRUE(a && b);
  ASSERT_TRUE(WaitUntil([&] { return Sees(*a, "node-b") && Sees(*b, "node-a"); }));
  EXPECT_EQ(a->state(), MembershipState::kRegistered);
  EXPECT_TRUE(a->CanDoRemoteWork());
  EXPECT_EQ(a->self().epoch, 1);
  Result<Member> b_seen_by_a = a->view().Find("node-b");
  ASSERT_TRUE(b_seen_by_a.ok());
  EXPECT_EQ(b_seen_by_a->record, b->self());
  EXPECT_NE(a->self().runtime_uuid, b->self().runtime_uuid);
  EXPECT_EQ(a->view().Read().members.size(), 2u);
  const std::string text = a->StatusText();
  EXPECT_NE(text.find("membership: registered"), std::string::npos) << text;
  EXPECT_NE(text.find("node-b epoch 1"), std::string::npos) << text;
  EXPECT_EQ(ma.GetGauge("orbitkv_membership_registered", "").Value(), 1.0);
}

TEST_F(MembershipTest, ThreeManagersResolveEveryShardOwnerFromTheCache) {
  const std::vector<std::string> catalog = {"node-a", "node-b", "node-c"};
  MetricsRegistry m1, m2, m3;
  auto a = Join(Options("node-a", catalog), &m1);
  auto b = Join(Options("node-b", catalog), &m2);
  auto c = Join(Options("node-c", catalog), &m3);
  ASSERT_TRUE(a && b && c);
  const std::map<std::string, const Membership*> by_id = {
      {"node-a", a.get()}, {"node-b", b.get()}, {"node-c", c.get()}};
  for (const Membership* m : {a.get(), b.get(), c.get()}) {
    ASSERT_TRUE(WaitUntil([&] { return m->view().complete() && m->view().size() == 3; }));
    for (uint32_t shard = 0; shard < kNumShards; ++shard) {
      Result<Member> owner = m->ResolveShardOwner(shard);
      ASSERT_TRUE(owner.ok()) << owner.status();
      EXPECT_EQ(owner->record, by_id.at(m->placement().OwnerOf(shard))->self());
    }
  }
}

// Issue 69: the member limit holds for everyone. A Manager joining a full cluster is refused with the limit's name;
// one that races past that best-effort check (an etcd Txn cannot compare a key count) waits in line: registered,
// remote work off with the limit as its reason (not fenced for a "missing" own record), while the others keep a
// complete view and remote work; when an older one leaves, it is counted, by everyone alike.
TEST_F(MembershipTest, TheMemberLimitHoldsForEveryone) {
  constexpr size_t kLimit = 3;
  const auto limited = [&](const std::string& node) {
    MembershipOptions o = Options(node);
    o.member_limit = kLimit;
    return o;
  };
  std::vector<std::unique_ptr<MetricsRegistry>> metrics;
  std::vector<std::unique_ptr<Membership>> members;
  for (const char* node : {"node-a", "node-b", "node-c"}) {
    metrics.push_back(std::make_unique<MetricsRegistry>());
    members.push_back(Join(limited(node), metrics.back().get()));
    ASSERT_TRUE(members.back());
  }
  ASSERT_TRUE(WaitUntil([&] {
    for (auto& m : members) {
      if (!m->CanDoRemoteWork() || m->view().size() != kLimit) return false;
    }
    return true;
  }));

  // The join-time refusal names the limit and the fix.
  MetricsRegistry md;
  Result<std::unique_ptr<Membership>> refused = Membership::Create(limited("node-d"), &md);
  ASSERT_TRUE(refused.ok());
  const Status full = (*refused)->Join(Deadline::After(kWaitLimit));
  EXPECT_EQ(full.code(), StatusCode::kResourceExhausted) << full;
  EXPECT_NE(full.message().find("member limit is 3"), std::string::npos) << full;
  EXPECT_NE(full.message().find("--cluster-name"), std::string::npos) << full;

  // One that races past the check waits in line.
  MembershipOptions racing = limited("node-d");
  racing.refuse_join_when_full = false;
  MetricsRegistry me;
  auto d = Join(racing, &me);
  ASSERT_TRUE(d);
  ASSERT_TRUE(WaitUntil([&] { return d->view().complete(); }));
  EXPECT_EQ(d->state(), MembershipState::kRegistered);
  EXPECT_TRUE(d->RegistrationValid());
  EXPECT_FALSE(d->CanDoRemoteWork());
  const MembershipStatus waiting = d->GetStatus();
  EXPECT_EQ(waiting.place.standing, MemberView::Standing::kWaiting);
  EXPECT_EQ(waiting.place.position, 1u);
  EXPECT_FALSE(waiting.remote_work_allowed);
  EXPECT_NE(d->StatusText().find("this Manager is number 1 in line"), std::string::npos) << d->StatusText();
  for (auto& m : members) {
    ASSERT_TRUE(WaitUntil([&] { return m->view().PlaceOf("node-d").standing == MemberView::Standing::kWaiting; }));
    EXPECT_TRUE(m->view().complete());
    EXPECT_TRUE(m->CanDoRemoteWork()) << "an existing Manager lost remote work to one member too many";
    EXPECT_FALSE(Sees(*m, "node-d"));
  }
  for (auto& m : metrics) {
    EXPECT_EQ(CounterValue(*m, "orbitkv_membership_view_invalidations_total", {{"reason", "line_unknown"}}), 0u);
  }

  // An older one leaves: node-d is counted, everywhere, and does remote work.
  members[1]->Shutdown();
  ASSERT_TRUE(WaitUntil([&] { return d->CanDoRemoteWork(); })) << d->StatusText();
  for (size_t i : {size_t{0}, size_t{2}}) {
    ASSERT_TRUE(WaitUntil([&] { return Sees(*members[i], "node-d") && !Sees(*members[i], "node-b"); }));
    EXPECT_TRUE(members[i]->CanDoRemoteWork());
    EXPECT_EQ(members[i]->view().Read().members, d->view().Read().members);
  }
  EXPECT_EQ(d->GetStatus().registrations, 1);
}

TEST_F(MembershipTest, DuplicateNodeIdIsRefusedWhileLive) {
  MetricsRegistry ma, mdup;
  auto a = Join(Options("node-a"), &ma);
  ASSERT_TRUE(a);
  Result<std::unique_ptr<Membership>> dup = Membership::Create(Options("node-a"), &mdup);
  ASSERT_TRUE(dup.ok());
  const Status joined = (*dup)->Join(Deadline::After(kWaitLimit));
  EXPECT_EQ(joined.code(), StatusCode::kAlreadyExists) << joined;
  EXPECT_NE(joined.message().find(a->self().runtime_uuid), std::string_view::npos) << joined;
  EXPECT_EQ((*dup)->state(), MembershipState::kNotJoined);
  EXPECT_FALSE((*dup)->RegistrationValid());
  // The live registration is untouched, and the refused attempt did not bump the epoch.
  ASSERT_TRUE(WaitUntil([&] { return a->view().complete(); }));
  EXPECT_EQ(a->state(), MembershipState::kRegistered);
  Result<Member> self = a->view().Find("node-a");
  ASSERT_TRUE(self.ok());
  EXPECT_EQ(self->record.epoch, 1);
}

TEST_F(MembershipTest, EpochIncrementsAcrossRestartsAndShutdownRevokes) {
  MetricsRegistry mw;
  auto watcher = Join(Options("watcher"), &mw);
  ASSERT_TRUE(watcher);
  std::string last_uuid;
  for (int64_t expected_epoch = 1; expected_epoch <= 3; ++expected_epoch) {
    MetricsRegistry m;
    auto a = Join(Options("node-a"), &m);
    ASSERT_TRUE(a);
    EXPECT_EQ(a->self().epoch, expected_epoch);
    EXPECT_NE(a->self().runtime_uuid, last_uuid);
    last_uuid = a->self().runtime_uuid;
    ASSERT_TRUE(WaitUntil([&] {
      Result<Member> seen = watcher->view().Find("node-a");
      return seen.ok() && seen->record.runtime_uuid == last_uuid;
    }));
    a->Shutdown();
    EXPECT_EQ(a->state(), MembershipState::kStopped);
    // Revoked, not left to expire (the TTL is 20 s): the record is gone from etcd as Shutdown()
    // returns.
    etcdserverpb::RangeRequest range;
    range.set_key(MemberKey(cluster_, "node-a"));
    Result<etcdserverpb::RangeResponse> gone = raw_->Range(range, Deadline::After(kWaitLimit));
    ASSERT_TRUE(gone.ok());
    EXPECT_EQ(gone->kvs_size(), 0);
    ASSERT_TRUE(WaitUntil([&] { return watcher->view().Find("node-a").status().code() == StatusCode::kNotFound; }));
  }
}

TEST_F(MembershipTest, KillNineExpiresTheLeaseAndTheSurvivorDropsTheStaleMember) {
  MetricsRegistry mb;
  auto b = Join(Options("node-b", {"node-a", "node-b"}), &mb);
  ASSERT_TRUE(b);
  auto spawn_a = [&] {
    testing::ChildProcess::Options options;
    options.argv = {ORBITKV_MEMBER_HELPER, etcd_->endpoint(), cluster_, "node-a", "2",
                    "node-a,node-b",       "127.0.0.1:7999"};
    options.pipe_stdio = true;
    return testing::ChildProcess::Spawn(options);
  };
  Result<testing::ChildProcess> a = spawn_a();
  ASSERT_TRUE(a.ok()) << a.status();
  Result<std::string> line = a->ReadLine(Deadline::After(kWaitLimit));
  ASSERT_TRUE(line.ok()) << line.status();
  ASSERT_TRUE(line->starts_with("joined 1 ")) << *line;
  const std::string first_uuid = line->substr(9);
  ASSERT_TRUE(WaitUntil([&] { return Sees(*b, "node-a"); }));
  uint32_t shard_of_a = kNumShards;
  for (uint32_t s = 0; s < kNumShards; ++s) {
    if (b->placement().OwnerOf(s) == "node-a") shard_of_a = s;
  }
  ASSERT_LT(shard_of_a, kNumShards);
  ASSERT_TRUE(b->ResolveShardOwner(shard_of_a).ok());

  ASSERT_TRUE(a->Signal(SIGKILL).ok());
  Result<int> status = a->Wait(Deadline::After(kWaitLimit));
  ASSERT_TRUE(status.ok());
  EXPECT_TRUE(WIFSIGNALED(*status));
  // Nobody revokes: etcd expires the 2 s lease, and B's Watch drops the stale member.
  ASSERT_TRUE(WaitUntil([&] { return b->view().Find("node-a").status().code() == StatusCode::kNotFound; }));
  EXPECT_EQ(b->ResolveShardOwner(shard_of_a).status().code(), StatusCode::kUnavailable);
  EXPECT_TRUE(b->CanDoRemoteWork());

  // A restart is a new incarnation; B resolves the shard to it, never to the killed runtime.
  Result<testing::ChildProcess> again = spawn_a();
  ASSERT_TRUE(again.ok());
  line = again->ReadLine(Deadline::After(kWaitLimit));
  ASSERT_TRUE(line.ok() && line->starts_with("joined 2 ")) << (line.ok() ? *line : line.status().ToString());
  const std::string second_uuid = line->substr(9);
  EXPECT_NE(second_uuid, first_uuid);
  ASSERT_TRUE(WaitUntil([&] {
    Result<Member> owner = b->ResolveShardOwner(shard_of_a);
    return owner.ok() && owner->record.runtime_uuid == second_uuid;
  }));
  again->CloseStdin();
  line = again->ReadLine(Deadline::After(kWaitLimit));
  EXPECT_TRUE(line.ok() && *line == "stopped");
}

// Issue 51: the own record deleted (its lease expired in etcd, or an operator removed it) ends the registration,
// and the Manager registers again in-process: a new epoch, a new runtime UUID, a new lease; the old lease revoked.
TEST_F(MembershipTest, OwnRecordRemovalEndsTheRegistrationAndItIsMadeAgain) {
  MetricsRegistry m;
  std::vector<std::string> calls;
  std::mutex calls_mu;
  MembershipOptions o = Options("node-a");
  o.on_lapsed = [&](const std::string& cause) {
    std::lock_guard<std::mutex> lock(calls_mu);
    calls.push_back("lapsed: " + cause);
  };
  o.on_registered = [&](const MemberRecord& self) {
    std::lock_guard<std::mutex> lock(calls_mu);
    calls.push_back(fmt::format("registered: {} {}", self.epoch, self.runtime_uuid));
  };
  auto a = Join(o, &m);
  ASSERT_TRUE(a);
  ASSERT_TRUE(WaitUntil([&] { return a->CanDoRemoteWork(); }));
  const MemberRecord first = a->self();
  const int64_t first_lease = a->GetStatus().lease_id;
  ASSERT_TRUE(RawDelete(MemberKey(cluster_, "node-a")).ok());
  ASSERT_TRUE(WaitUntil([&] { return a->self().epoch == first.epoch + 1 && a->CanDoRemoteWork(); }));
  const MembershipStatus s = a->GetStatus();
  EXPECT_EQ(s.state, MembershipState::kRegistered);
  EXPECT_NE(s.self.runtime_uuid, first.runtime_uuid);
  EXPECT_NE(s.lease_id, first_lease);
  EXPECT_EQ(s.registrations, 2);
  EXPECT_NE(s.last_cause.find("deleted"), std::string::npos) << s.last_cause;
  EXPECT_NE(a->StatusText().find("the last one ended"), std::string::npos) << a->StatusText();
  // etcd holds the new record, and the old lease is gone.
  MetricsRegistry probe_metrics;
  auto probe = Join(Options("probe"), &probe_metrics);
  ASSERT_TRUE(probe);
  ASSERT_TRUE(WaitUntil([&] {
    Result<Member> seen = probe->view().Find("node-a");
    return seen.ok() && seen->record.runtime_uuid == s.self.runtime_uuid && seen->record.epoch == first.epoch + 1;
  }));
  etcdserverpb::LeaseTimeToLiveRequest ttl;
  ttl.set_id(first_lease);
  Result<etcdserverpb::LeaseTimeToLiveResponse> old = raw_->LeaseTimeToLive(ttl, Deadline::After(kWaitLimit));
  ASSERT_TRUE(old.ok()) << old.status();
  EXPECT_EQ(old->ttl(), -1);  // etcd: no such lease
  EXPECT_EQ(CounterValue(m, "orbitkv_membership_registration_ends_total", {{"state", "expired"}}), 1u);
  EXPECT_EQ(CounterValue(m, "orbitkv_membership_reregistrations_total"), 1u);
  std::lock_guard<std::mutex> lock(calls_mu);
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_TRUE(calls[0].starts_with("lapsed: own member record"));
  EXPECT_EQ(calls[1], fmt::format("registered: {} {}", first.epoch + 1, s.self.runtime_uuid));
}

// Another runtime holding the Node ID is a fence for good: the Manager never takes the Node ID back.
TEST_F(MembershipTest, ANodeIdTakenByAnotherRuntimeStaysFenced) {
  MetricsRegistry m;
  auto a = Join(Options("node-a"), &m);
  ASSERT_TRUE(a);
  ASSERT_TRUE(WaitUntil([&] { return a->CanDoRemoteWork(); }));
  // The record goes (a lapse) and another runtime registers the Node ID right after: whether this Manager sees
  // the record replaced, or finds it held when it registers again, it is fenced.
  const std::string other = FakeRecord("node-a", 7);
  ASSERT_TRUE(RawDelete(MemberKey(cluster_, "node-a")).ok());
  ASSERT_TRUE(RawPut(MemberKey(cluster_, "node-a"), other).ok());
  ASSERT_TRUE(WaitUntil([&] { return a->state() == MembershipState::kFenced; }));
  // Well past several backoffs: still fenced, the other runtime's record untouched.
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  EXPECT_EQ(a->state(), MembershipState::kFenced);
  EXPECT_FALSE(a->RegistrationValid());
  EXPECT_FALSE(a->CanDoRemoteWork());
  EXPECT_EQ(a->ResolveShardOwner(0).status().code(), StatusCode::kUnavailable);
  etcdserverpb::RangeRequest read;
  read.set_key(MemberKey(cluster_, "node-a"));
  Result<etcdserverpb::RangeResponse> held = raw_->Range(read, Deadline::After(kWaitLimit));
  ASSERT_TRUE(held.ok() && held->kvs_size() == 1);
  EXPECT_EQ(held->kvs(0).value(), other);
  EXPECT_NE(a->StatusText().find("fenced"), std::string::npos) << a->StatusText();
}

TEST_F(MembershipTest, ReplacedRecordFences) {
  MetricsRegistry m;
  auto a = Join(Options("node-a"), &m);
  ASSERT_TRUE(a);
  ASSERT_TRUE(WaitUntil([&] { return a->view().complete(); }));
  ASSERT_TRUE(RawPut(MemberKey(cluster_, "node-a"), FakeRecord("node-a", 7)).ok());
  ASSERT_TRUE(WaitUntil([&] { return a->state() == MembershipState::kFenced; }));
  EXPECT_NE(a->GetStatus().reason.find("replaced"), std::string::npos) << a->GetStatus().reason;
}

TEST_F(MembershipTest, PlacementMismatchOnJoinFailsClearly) {
  MetricsRegistry ma, mb;
  auto a = Join(Options("node-a", {"node-a", "node-b"}), &ma);
  ASSERT_TRUE(a);
  Result<std::unique_ptr<Membership>> b = Membership::Create(Options("node-b", {"node-a", "node-c"}), &mb);
  ASSERT_TRUE(b.ok());
  const Status joined = (*b)->Join(Deadline::After(kWaitLimit));
  EXPECT_EQ(joined.code(), StatusCode::kFailedPrecondition) << joined;
  EXPECT_NE(joined.message().find("placement mismatch"), std::string_view::npos) << joined;
  EXPECT_NE(joined.message().find("node-a,node-b"), std::string_view::npos) << joined;
  EXPECT_NE(joined.message().find("node-a,node-c"), std::string_view::npos) << joined;
  // Nothing of B was registered, and its Node ID's epoch was never touched.
  etcdserverpb::RangeRequest range;
  range.set_key(ClusterPrefix(cluster_));
  range.set_range_end(PrefixEnd(ClusterPrefix(cluster_)));
  Result<etcdserverpb::RangeResponse> all = raw_->Range(range, Deadline::After(kWaitLimit));
  ASSERT_TRUE(all.ok());
  for (const auto& kv : all->kvs()) EXPECT_EQ(kv.key().find("node-b"), std::string::npos) << kv.key();
}

TEST_F(MembershipTest, PlacementChangeFencesEveryMember) {
  MetricsRegistry m;
  auto a = Join(Options("node-a"), &m);
  ASSERT_TRUE(a);
  ASSERT_TRUE(WaitUntil([&] { return a->view().complete(); }));
  ASSERT_TRUE(RawPut(PlacementKey(cluster_), Placement::Create({"node-a", "node-z"})->Encode()).ok());
  ASSERT_TRUE(WaitUntil([&] { return a->state() == MembershipState::kFenced; }));
  EXPECT_NE(a->GetStatus().reason.find("placement"), std::string::npos) << a->GetStatus().reason;
}

// Issue 55: a committed placement of the next generation is adopted without fencing, through the watch alone; a
// Manager started later with the old --catalog-nodes joins and follows the installed generation; one started with
// a set the cluster never had at generation 1 is still refused.
TEST_F(MembershipTest, ANewerPlacementGenerationIsAdoptedAndLaterJoinsFollowIt) {
  MetricsRegistry ma, mb, mc;
  auto a = Join(Options("node-a", {"node-a"}), &ma);
  ASSERT_TRUE(a);
  ASSERT_TRUE(WaitUntil([&] { return a->view().complete(); }));
  const Placement next = Placement::Create({"node-a", "node-b"}, kDefaultCatalogReplicas, 2).value();
  ASSERT_TRUE(RawPut(PlacementKey(cluster_), next.Encode()).ok());
  ASSERT_TRUE(WaitUntil([&] { return a->placement().generation() == 2; }));
  EXPECT_EQ(a->state(), MembershipState::kRegistered);
  EXPECT_EQ(a->placement().catalog_nodes(), next.catalog_nodes());
  EXPECT_NE(a->StatusText().find("placement generation 2"), std::string::npos) << a->StatusText();
  auto b = Join(Options("node-b", {"node-a"}), &mb);  // the flags of generation 1
  ASSERT_TRUE(b);
  EXPECT_EQ(b->placement(), next);
  EXPECT_EQ(b->GetStatus().placement_fingerprint, a->GetStatus().placement_fingerprint);
  // Back to generation 1: a regression, every member fences.
  ASSERT_TRUE(RawPut(PlacementKey(cluster_), Placement::Create({"node-a"}).value().Encode()).ok());
  ASSERT_TRUE(
      WaitUntil([&] { return a->state() == MembershipState::kFenced && b->state() == MembershipState::kFenced; }));
  EXPECT_NE(a->GetStatus().reason.find("went back"), std::string::npos) << a->GetStatus().reason;
}

// Issue 55: a Manager joining while a change moves adopts the committed placement and the change: its owner
// streams go to both generations' copies of a moving shard, and it serves the next generation's routes. Started with
// the set the cluster is changing to, it joins too (that is the set it will have).
TEST_F(MembershipTest, AMemberJoiningMidTransitionAdoptsTheChangeInProgress) {
  MetricsRegistry ma, mb;
  auto a = Join(Options("node-a", {"node-a", "node-b", "node-c"}), &ma);
  ASSERT_TRUE(a);
  const Placement from = a->placement();
  const Placement to = Placement::Create({"node-a", "node-b", "node-c", "node-d"}, kDefaultCatalogReplicas, 2).value();
  PlacementTransition t = PlacementTransition::Start(from, to, "node-a/x", 1);
  uint32_t moving = kNumShards;
  for (uint32_t shard = 0; shard < kNumShards && moving == kNumShards; ++shard) {
    if (!PlacementTransition::NewCopies(from, to, shard).empty()) moving = shard;
  }
  ASSERT_LT(moving, kNumShards);
  t.shards[moving].state = ShardMove::State::kMoving;
  ASSERT_TRUE(RawPut(PlacementTransitionKey(cluster_), t.Encode()).ok());
  ASSERT_TRUE(WaitUntil([&] { return a->live_placement().Get()->moving(); }));
  auto d = Join(Options("node-d", {"node-a", "node-b", "node-c", "node-d"}), &mb);
  ASSERT_TRUE(d);
  const auto live = d->live_placement().Get();
  EXPECT_EQ(live->committed, from);
  ASSERT_TRUE(live->moving());
  const std::vector<std::string> publish = live->PublishCopies(moving);
  EXPECT_NE(std::find(publish.begin(), publish.end(), "node-d"), publish.end());
  EXPECT_TRUE(live->Accepts(to.fingerprint()));
  EXPECT_TRUE(live->Hosts(moving, "node-d"));
  EXPECT_EQ(d->state(), MembershipState::kRegistered);
}

TEST_F(MembershipTest, EtcdStoppedAndRestartedRepairsTheView) {
  MetricsRegistry ma, mb;
  MembershipOptions oa = Options("node-a", {"node-a"}, 120);
  oa.etcd_call_timeout = std::chrono::milliseconds(1000);
  auto a = Join(oa, &ma);
  auto b = Join(Options("node-b", {"node-a"}, 120), &mb);
  ASSERT_TRUE(a && b);
  ASSERT_TRUE(WaitUntil([&] { return Sees(*a, "node-b"); }));
  const uint64_t snapshots = CounterValue(ma, "orbitkv_membership_snapshots_total");
  const uint64_t acks = CounterValue(ma, "orbitkv_membership_keepalive_acks_total");

  ASSERT_TRUE(etcd_->Stop().ok());
  ASSERT_TRUE(WaitUntil([&] { return !a->view().complete(); }));
  // Remote work pauses; the registration itself is still within its TTL/2 window.
  EXPECT_FALSE(a->CanDoRemoteWork());
  EXPECT_EQ(a->state(), MembershipState::kRegistered);
  EXPECT_TRUE(a->RegistrationValid());
  EXPECT_EQ(a->view().Find("node-b").status().code(), StatusCode::kUnavailable);

  ASSERT_TRUE(etcd_->Launch().ok());
  ASSERT_TRUE(etcd_->WaitReady(Deadline::After(kWaitLimit)).ok());
  ASSERT_TRUE(WaitUntil([&] { return a->CanDoRemoteWork() && Sees(*a, "node-b"); }));
  // Nothing changed while etcd was down: the view caught up from the (no) changes, without a snapshot (issue 69).
  EXPECT_EQ(CounterValue(ma, "orbitkv_membership_snapshots_total"), snapshots);
  EXPECT_GE(CounterValue(ma, "orbitkv_membership_view_catch_ups_total"), 1u);
  EXPECT_GE(CounterValue(ma, "orbitkv_membership_view_invalidations_total", {{"reason", "reconnect"}}), 1u);
  EXPECT_EQ(a->state(), MembershipState::kRegistered);
  // Keepalives resumed on the restarted etcd (none can be acknowledged while it is down).
  ASSERT_TRUE(WaitUntil([&] { return CounterValue(ma, "orbitkv_membership_keepalive_acks_total") > acks; }));
}

// Issue 51: a registration that lapsed while etcd was down is made again when etcd answers (the old lease, which
// an etcd restart refreshes, is revoked first), without a new Membership; with reregister off it stays expired.
TEST_F(MembershipTest, RegistrationThatLapsedWhileEtcdWasDownIsMadeAgainWhenEtcdAnswers) {
  MetricsRegistry m, m_off;
  MembershipOptions o = Options("node-a", {"node-a"}, 2);
  o.etcd_call_timeout = std::chrono::milliseconds(500);
  auto a = Join(o, &m);
  MembershipOptions off = Options("node-b", {"node-a"}, 2);
  off.etcd_call_timeout = std::chrono::milliseconds(500);
  off.reregister = false;
  auto b = Join(off, &m_off);
  ASSERT_TRUE(a && b);
  const MemberRecord first = a->self();
  ASSERT_TRUE(etcd_->Stop().ok());
  ASSERT_TRUE(WaitUntil([&] { return a->state() == MembershipState::kExpired; }));
  EXPECT_FALSE(a->RegistrationValid());
  // While etcd is down it keeps trying, and says so.
  ASSERT_TRUE(WaitUntil([&] { return a->GetStatus().attempts >= 2; }));
  EXPECT_FALSE(a->GetStatus().last_error.empty());
  EXPECT_NE(a->StatusText().find("registering again: attempt"), std::string::npos) << a->StatusText();
  ASSERT_TRUE(etcd_->Launch().ok());
  ASSERT_TRUE(etcd_->WaitReady(Deadline::After(kWaitLimit)).ok());
  ASSERT_TRUE(WaitUntil([&] { return a->CanDoRemoteWork(); }));
  EXPECT_EQ(a->state(), MembershipState::kRegistered);
  EXPECT_EQ(a->self().epoch, first.epoch + 1);
  EXPECT_NE(a->self().runtime_uuid, first.runtime_uuid);
  EXPECT_EQ(a->GetStatus().registrations, 2);
  // The one that does not register again stays expired.
  EXPECT_EQ(b->state(), MembershipState::kExpired);
  EXPECT_FALSE(b->CanDoRemoteWork());
  b->Shutdown();
  MetricsRegistry m2;
  auto again = Join(Options("node-b", {"node-a"}), &m2);
  ASSERT_TRUE(again);
  EXPECT_EQ(again->self().epoch, 2);
}

TEST_F(MembershipTest, CacheOperationsMakeNoEtcdCalls) {
  MetricsRegistry ma, mb;
  auto a = Join(Options("node-a", {"node-a", "node-b"}), &ma);
  auto b = Join(Options("node-b", {"node-a", "node-b"}), &mb);
  ASSERT_TRUE(a && b);
  ASSERT_TRUE(WaitUntil([&] { return a->CanDoRemoteWork() && Sees(*a, "node-b"); }));
  auto non_keepalive_calls = [&] {
    uint64_t total = 0;
    for (const char* method :
         {"Range", "Put", "DeleteRange", "Txn", "LeaseGrant", "LeaseRevoke", "LeaseTimeToLive", "Watch"}) {
      total += CounterValue(ma, "orbitkv_etcd_calls_total", {{"method", method}});
    }
    return total;
  };
  const uint64_t thread_before = EtcdClient::CallsOnThisThread();
  const uint64_t calls_before = non_keepalive_calls();
  uint64_t resolved = 0;
  for (int i = 0; i < 100'000; ++i) {
    const uint32_t shard = static_cast<uint32_t>(i) % kNumShards;
    if (a->CanDoRemoteWork() && a->ResolveShardOwner(shard).ok()) ++resolved;
    (void)a->view().Find(i % 2 ? "node-a" : "node-b");
  }
  EXPECT_EQ(resolved, 100'000u);
  EXPECT_EQ(EtcdClient::CallsOnThisThread(), thread_before);
  EXPECT_EQ(non_keepalive_calls(), calls_before);
}

}  // namespace
}  // namespace orbitkv::cluster
