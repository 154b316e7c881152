// Issue 55: the placement transition record, reconciler leadership and the transition state machine against a
// real etcd, behind the CatalogProgress seam (a test model of the catalog copies: owners' sequences, and new
// copies that catch up when the test lets them). Each step is one Step() pass, as the reconciler thread makes them.
#include "cluster/placement_reconciler.h"

#include <gtest/gtest.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <set>
#include <thread>

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
                                                           int64_t /*generation*/, Deadline deadline) override {
    if (down.count(node) != 0) return Status::Unavailable(fmt::format("'{}' is down", node));
    if (hung.count(node) != 0) {  // connected, never answers: the call ends at its deadline
      longest_given = std::max(longest_given, deadline.Remaining());
      std::this_thread::sleep_for(deadline.Remaining());
      return Status::DeadlineExceeded(fmt::format("'{}' did not answer", node));
    }
    std::map<std::string, OwnerProgress> out;
    for (const std::string& owner : owners) {
      const uint64_t start = starts.count(owner) != 0 ? starts.at(owner) : 0;
      const uint64_t base = restarted_at.count(owner) != 0 ? restarted_at.at(owner) : sequence;
      if (original.count(node) != 0) out[owner] = OwnerProgress{true, base + shard, start};
      if (caught_up.count(node) != 0) {
        auto held = new_copy_holds.find(owner);
        out[owner] = held != new_copy_holds.end() ? OwnerProgress{true, held->second.second + shard, held->second.first}
                                                  : OwnerProgress{true, base + shard - behind, start};
      }
    }
    return out;
  }
  std::vector<std::string> owners = {"n1", "n2", "n3"};
  std::set<std::string> original = {"n1", "n2", "n3"};  // copies of generation 1
  std::set<std::string> caught_up;                      // new copies that have caught up
  std::set<std::string> down;
  std::set<std::string> hung;            // accept the call and never answer
  MonoClock::duration longest_given{0};  // the longest deadline a hung copy was given
  uint64_t sequence = 100;
  uint64_t behind = 0;  // how far the sequences a caught-up new copy reports trail the current copies' ones
  std::map<std::string, uint64_t> starts;        // owner -> its live start (inventory incarnation; absent: 0)
  std::map<std::string, uint64_t> restarted_at;  // owner -> the sequence its current start is at (absent: sequence)
  // owner -> (start, sequence) a caught-up new copy holds instead (a slice of an earlier start not replaced yet)
  std::map<std::string, std::pair<uint64_t, uint64_t>> new_copy_holds;

  std::map<std::string, uint64_t> Live() const {
    std::map<std::string, uint64_t> live;
    for (const std::string& owner : owners) live[owner] = starts.count(owner) != 0 ? starts.at(owner) : 0;
    return live;
  }
};

// A TCP proxy in front of etcd that passes requests at once and holds every reply for `reply_delay`: a write it
// forwards takes effect while a caller with a shorter deadline sees DEADLINE_EXCEEDED (a reply lost on the way,
// which a real etcd cannot be made to do on demand).
class SlowRepliesProxy {
 public:
  SlowRepliesProxy(int target_port, std::chrono::milliseconds reply_delay)
      : target_port_(target_port), delay_(reply_delay) {
    listener_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr = Loopback(0);
    socklen_t size = sizeof(addr);
    if (::bind(listener_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(listener_, 16) != 0 ||
        ::getsockname(listener_, reinterpret_cast<sockaddr*>(&addr), &size) != 0) {
      ADD_FAILURE() << "proxy: no loopback port";
      return;
    }
    port_ = ntohs(addr.sin_port);
    threads_.emplace_back([this] { Accept(); });
  }
  ~SlowRepliesProxy() {
    stop_ = true;
    ::shutdown(listener_, SHUT_RDWR);
    ::close(listener_);
    for (int fd : fds_) ::shutdown(fd, SHUT_RDWR);
    for (std::thread& t : threads_) t.join();
    for (int fd : fds_) ::close(fd);
  }
  std::string endpoint() const { return fmt::format("127.0.0.1:{}", port_); }

 private:
  static sockaddr_in Loopback(int port) {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    return addr;
  }
  void Accept() {
    while (!stop_) {
      const int client = ::accept(listener_, nullptr, nullptr);
      if (client < 0) return;
      const int server = ::socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in addr = Loopback(target_port_);
      if (::connect(server, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
        ::close(client);
        ::close(server);
        continue;
      }
      fds_.push_back(client);
      fds_.push_back(server);
      threads_.emplace_back([this, client, server] { Pump(client, server, std::chrono::milliseconds(0)); });
      threads_.emplace_back([this, client, server] { Pump(server, client, delay_); });
    }
  }
  void Pump(int from, int to, std::chrono::milliseconds delay) {
    char buffer[65536];
    while (!stop_) {
      const ssize_t n = ::read(from, buffer, sizeof(buffer));
      if (n <= 0) break;
      if (delay.count() > 0) std::this_thread::sleep_for(delay);
      if (::write(to, buffer, static_cast<size_t>(n)) != n) break;
    }
    ::shutdown(to, SHUT_WR);
  }

  const int target_port_;
  const std::chrono::milliseconds delay_;
  int listener_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::vector<int> fds_;              // Accept's thread only, then the destructor
  std::vector<std::thread> threads_;  // likewise
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
    o.live_owners = [this] { return catalog_.Live(); };
    o.progress = &catalog_;
    return o;
  }

  Status Request(std::vector<std::string> nodes, int64_t base_generation = 0, bool abort = false) {
    PlacementRequest r;
    r.catalog_nodes = std::move(nodes);
    r.replicas = 3;
    r.requested_by = "operator";
    r.requested_ms = now_ms_;
    r.base_generation = base_generation;
    r.abort = abort;
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
        // The watermarks (every live owner, at the sequence the current copies reported when the move started) stay
        // in the leader's memory: the record does not grow with the owners (issue 84; the passes above show they
        // hold).
        EXPECT_TRUE(m.watermarks.empty());
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

// Issue 84, item 1: a copy that accepts the status call and never answers. Each status call has its own deadline
// (status_call), and the write its own fresh one, so a pass whose own read deadline the hung calls outlast still
// writes; the change aborts within two passes past its bound.
TEST_F(PlacementReconcilerTest, AHungCopyCostsOneCallADeadlineAndTheChangeAbortsJustPastItsBound) {
  ReconcilerLeadership leader(raw_.get(), cluster_, "n1", "uuid-a");
  ASSERT_TRUE(leader.Campaign(Lease(), Soon()).value());
  PlacementReconciler::Options options = ReconcilerOptions();
  options.shard_bound = std::chrono::milliseconds(5'000);
  options.status_call = std::chrono::milliseconds(200);
  PlacementReconciler reconciler(options, raw_.get());
  ASSERT_TRUE(Request({"n1", "n2", "n3", "n4"}).ok());
  ASSERT_EQ(reconciler.Step(leader, Soon()).value().did, PlacementReconciler::Did::kStarted);
  catalog_.hung = {"n4"};
  int passes_after_bound = -1;
  int64_t moving_since = -1;
  for (int pass = 0; pass < 20; ++pass) {
    now_ms_ += 1'000;
    // Two moving shards each ask n4 (200 ms each): more than this pass's own 300 ms.
    Result<PlacementReconciler::Outcome> step =
        reconciler.Step(leader, Deadline::After(std::chrono::milliseconds(300)));
    ASSERT_TRUE(step.ok()) << "pass " << pass << ": " << step.status();
    if (moving_since < 0) moving_since = now_ms_;
    if (now_ms_ - moving_since >= 5'000) ++passes_after_bound;
    if (step->did == PlacementReconciler::Did::kAborted) break;
  }
  EXPECT_GE(passes_after_bound, 0);
  EXPECT_LE(passes_after_bound, 2) << "the change aborted more than two passes after its bound";
  Result<PlacementReconciler::Snapshot> s = Read();
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->transition->phase, PlacementTransition::Phase::kAborted);
  EXPECT_NE(s->transition->reason.find("copy 'n4' did not answer"), std::string::npos) << s->transition->reason;
  EXPECT_EQ(reconciler.stats().aborted, 1u);
  EXPECT_LE(catalog_.longest_given, std::chrono::milliseconds(200)) << "a status call got more than its cap";
}

// Issue 84, item 1: the bound counts only time the reconciler could act. An etcd outage (no pass reads anything)
// longer than the bound does not abort the change the moment etcd answers again.
TEST_F(PlacementReconcilerTest, AnOutageLongerThanTheBoundDoesNotUseItUp) {
  ReconcilerLeadership leader(raw_.get(), cluster_, "n1", "uuid-a");
  ASSERT_TRUE(leader.Campaign(Lease(120), Soon()).value());
  PlacementReconciler::Options options = ReconcilerOptions();
  options.shard_bound = std::chrono::milliseconds(5'000);
  PlacementReconciler reconciler(options, raw_.get());
  ASSERT_TRUE(Request({"n1", "n2", "n3", "n4"}).ok());
  ASSERT_EQ(reconciler.Step(leader, Soon()).value().did, PlacementReconciler::Did::kStarted);
  ASSERT_TRUE(reconciler.Step(leader, Soon()).ok());  // two shards moving, n4 behind (it has caught up on nothing)
  ASSERT_TRUE(etcd_->Stop().ok());
  now_ms_ += 1'000;
  EXPECT_FALSE(reconciler.Step(leader, Deadline::After(std::chrono::seconds(1))).ok());
  now_ms_ += 60'000;  // a minute of outage
  ASSERT_TRUE(etcd_->Launch().ok());
  ASSERT_TRUE(etcd_->WaitReady(Soon()).ok());
  Result<PlacementReconciler::Outcome> back = reconciler.Step(leader, Soon());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_NE(back->did, PlacementReconciler::Did::kAborted) << back->detail;
  // The host catches up meanwhile: the change commits.
  catalog_.caught_up = {"n4"};
  for (int pass = 0; pass < 40 && Read()->placement->generation() == 1; ++pass) {
    now_ms_ += 100;
    ASSERT_TRUE(reconciler.Step(leader, Soon()).ok());
  }
  EXPECT_EQ(Read()->placement->generation(), 2);
  EXPECT_EQ(reconciler.stats().aborted, 0u);
}

// Issue 84, item 1: `orbitkv catalog placement --abort` ends a moving change at the next pass; with nothing moving
// the abort is dropped.
TEST_F(PlacementReconcilerTest, AnOperatorsAbortEndsTheMoveAtTheNextPass) {
  ReconcilerLeadership leader(raw_.get(), cluster_, "n1", "uuid-a");
  ASSERT_TRUE(leader.Campaign(Lease(), Soon()).value());
  PlacementReconciler reconciler(ReconcilerOptions(), raw_.get());
  ASSERT_TRUE(Request({"n1", "n2", "n3", "n4"}, 1).ok());
  ASSERT_EQ(reconciler.Step(leader, Soon()).value().did, PlacementReconciler::Did::kStarted);
  ASSERT_TRUE(reconciler.Step(leader, Soon()).ok());
  ASSERT_TRUE(Request({"n1", "n2", "n3"}, 1, /*abort=*/true).ok());
  now_ms_ += 100;
  Result<PlacementReconciler::Outcome> step = reconciler.Step(leader, Soon());
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(step->did, PlacementReconciler::Did::kAborted);
  Result<PlacementReconciler::Snapshot> s = Read();
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->placement->generation(), 1);
  EXPECT_EQ(s->transition->phase, PlacementTransition::Phase::kAborted);
  EXPECT_NE(s->transition->reason.find("aborted by the operator"), std::string::npos) << s->transition->reason;
  EXPECT_FALSE(s->request.has_value()) << "the abort request stays";
  EXPECT_EQ(reconciler.stats().aborted, 1u);
  now_ms_ += 10'001;
  EXPECT_EQ(reconciler.Step(leader, Soon()).value().did, PlacementReconciler::Did::kRetired);
  // Nothing moving: an abort changes nothing and goes.
  ASSERT_TRUE(Request({"n1", "n2", "n3"}, 1, /*abort=*/true).ok());
  step = reconciler.Step(leader, Soon());
  ASSERT_TRUE(step.ok());
  EXPECT_EQ(step->did, PlacementReconciler::Did::kNothing);
  EXPECT_NE(step->detail.find("found no change in progress"), std::string::npos) << step->detail;
  EXPECT_FALSE(Read()->request.has_value());
  EXPECT_FALSE(Read()->transition.has_value());
  EXPECT_EQ(reconciler.stats().refused, 1u);
}

// Issue 84, item 4: a request names the generation it was built on. One built on generation 1 after generation 2
// committed would undo generation 2: it is refused, naming the placement now; one built on 2 goes ahead.
TEST_F(PlacementReconcilerTest, ARequestBuiltOnAnOlderGenerationIsRefused) {
  ReconcilerLeadership leader(raw_.get(), cluster_, "n1", "uuid-a");
  ASSERT_TRUE(leader.Campaign(Lease(), Soon()).value());
  PlacementReconciler reconciler(ReconcilerOptions(), raw_.get());
  catalog_.caught_up = {"n4"};
  ASSERT_TRUE(Request({"n1", "n2", "n3", "n4"}, 1).ok());
  for (int pass = 0; pass < 40 && Read()->placement->generation() == 1; ++pass) {
    now_ms_ += 100;
    ASSERT_TRUE(reconciler.Step(leader, Soon()).ok());
  }
  ASSERT_EQ(Read()->placement->generation(), 2);
  now_ms_ += 10'001;
  ASSERT_EQ(reconciler.Step(leader, Soon()).value().did, PlacementReconciler::Did::kRetired);
  // Built from a lagging view of generation 1: "remove n3" from {n1, n2, n3}, which would drop n4 too.
  ASSERT_TRUE(Request({"n1", "n2"}, 1).ok());
  Result<PlacementReconciler::Outcome> step = reconciler.Step(leader, Soon());
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(step->did, PlacementReconciler::Did::kNothing);
  EXPECT_NE(step->detail.find("built on placement generation 1, and the placement is at generation 2 (catalog nodes "
                              "n1,n2,n3,n4)"),
            std::string::npos)
      << step->detail;
  EXPECT_FALSE(Read()->request.has_value());
  EXPECT_FALSE(Read()->transition.has_value());
  EXPECT_EQ(Read()->placement->generation(), 2);
  EXPECT_EQ(reconciler.stats().refused, 1u);
  // Built on generation 2, the same change goes ahead.
  ASSERT_TRUE(Request({"n1", "n2", "n4"}, 2).ok());
  EXPECT_EQ(reconciler.Step(leader, Soon()).value().did, PlacementReconciler::Did::kStarted);
}

// Issue 84, item 2: watermarks are per owner start. An owner that starts again mid-move (a rolling upgrade: its
// sequences restart) does not keep the shard from ever being ready; a slice of a start that is no longer live, still
// on the new copy, does not make it ready.
TEST_F(PlacementReconcilerTest, AnOwnerRestartedMidMoveLetsTheMoveCompleteAndADeadStartsSliceCountsForNothing) {
  ReconcilerLeadership leader(raw_.get(), cluster_, "n1", "uuid-a");
  ASSERT_TRUE(leader.Campaign(Lease(), Soon()).value());
  PlacementReconciler reconciler(ReconcilerOptions(), raw_.get());
  catalog_.starts = {{"n1", 11}, {"n2", 21}, {"n3", 31}};
  ASSERT_TRUE(Request({"n1", "n2", "n3", "n4"}).ok());
  ASSERT_EQ(reconciler.Step(leader, Soon()).value().did, PlacementReconciler::Did::kStarted);
  ASSERT_TRUE(reconciler.Step(leader, Soon()).ok());  // shards moving, watermarks at 100 + shard
  // n2 starts again (sequences from 5); n3 too, but n4 still holds n3's earlier start, past its old watermark.
  catalog_.starts["n2"] = 22;
  catalog_.restarted_at["n2"] = 5;
  catalog_.starts["n3"] = 32;
  catalog_.restarted_at["n3"] = 3;
  catalog_.new_copy_holds["n3"] = {31, 500};
  catalog_.caught_up = {"n4"};
  for (int pass = 0; pass < 20; ++pass) {
    now_ms_ += 100;
    Result<PlacementReconciler::Outcome> step = reconciler.Step(leader, Soon());
    ASSERT_TRUE(step.ok()) << step.status();
    ASSERT_NE(step->did, PlacementReconciler::Did::kAborted) << step->detail;
  }
  EXPECT_EQ(Read()->placement->generation(), 1) << "a dead start's slice made a shard ready";
  EXPECT_EQ(reconciler.stats().shard_moves, 0u);
  // n4 gets n3's new start: every shard moves and the change commits, n2 (restarted) included.
  catalog_.new_copy_holds.clear();
  for (int pass = 0; pass < 60 && Read()->placement->generation() == 1; ++pass) {
    now_ms_ += 100;
    Result<PlacementReconciler::Outcome> step = reconciler.Step(leader, Soon());
    ASSERT_TRUE(step.ok()) << step.status();
    ASSERT_NE(step->did, PlacementReconciler::Did::kAborted) << step->detail;
  }
  EXPECT_EQ(Read()->placement->generation(), 2);
}

// Issue 84, item 3: the transition record does not grow with the cluster: 4,096 owners with 40-character Node IDs
// and a change that moves most shards commit through records far under the bound.
TEST_F(PlacementReconcilerTest, TheTransitionRecordStaysSmallWithFourThousandOwners) {
  ReconcilerLeadership leader(raw_.get(), cluster_, "n1", "uuid-a");
  ASSERT_TRUE(leader.Campaign(Lease(), Soon()).value());
  catalog_.owners.clear();
  for (int i = 0; i < 4096; ++i) catalog_.owners.push_back(fmt::format("owner-{:034}", i));  // 40 characters
  catalog_.caught_up = {"n4", "n5"};
  PlacementReconciler::Options options = ReconcilerOptions();
  options.max_moving = 10;
  PlacementReconciler reconciler(options, raw_.get());
  ASSERT_TRUE(Request({"n1", "n2", "n3", "n4", "n5"}).ok());
  ASSERT_EQ(reconciler.Step(leader, Soon()).value().did, PlacementReconciler::Did::kStarted);
  ASSERT_GE(Read()->transition->CountIn(ShardMove::State::kWaiting), 10u);
  size_t largest = 0;
  for (int pass = 0; pass < 40 && Read()->placement->generation() == 1; ++pass) {
    now_ms_ += 100;
    Result<PlacementReconciler::Outcome> step = reconciler.Step(leader, Soon());
    ASSERT_TRUE(step.ok()) << step.status();
    Result<std::string> record = RawGet(PlacementTransitionKey(cluster_));
    if (record.ok()) largest = std::max(largest, record->size());
  }
  EXPECT_EQ(Read()->placement->generation(), 2);
  EXPECT_LT(largest, 4096u) << "the transition record grows with the owners";
  EXPECT_LE(largest, options.max_record_bytes);
}

// Issue 84, item 5: an abort whose write took effect while its reply was lost (the caller saw DEADLINE_EXCEEDED) is
// still counted, once a later pass reads it: `placement_changes_aborted` on the leader says what it did.
TEST_F(PlacementReconcilerTest, AnAbortWhoseReplyWasLostIsCountedWhenAPassReadsIt) {
  ReconcilerLeadership leader(raw_.get(), cluster_, "n1", "uuid-a");
  ASSERT_TRUE(leader.Campaign(Lease(), Soon()).value());
  const std::string& direct = etcd_->endpoint();
  SlowRepliesProxy proxy(std::stoi(direct.substr(direct.rfind(':') + 1)), std::chrono::milliseconds(300));
  EtcdClientOptions client_options;
  client_options.endpoints = {proxy.endpoint()};
  Result<std::unique_ptr<EtcdClient>> slow = EtcdClient::Create(client_options);
  ASSERT_TRUE(slow.ok()) << slow.status();
  PlacementReconciler::Options options = ReconcilerOptions();
  options.shard_bound = std::chrono::milliseconds(1'000);
  options.etcd_call = std::chrono::milliseconds(100);  // every write's reply comes too late: 300 ms
  PlacementReconciler reconciler(options, slow->get());
  ASSERT_TRUE(Request({"n1", "n2", "n3", "n4"}).ok());
  catalog_.down = {"n4"};
  for (int pass = 0; pass < 12; ++pass) {
    now_ms_ += 1'000;
    (void)reconciler.Step(leader, Soon());  // the writes answer DEADLINE_EXCEEDED and take effect
    Result<PlacementReconciler::Snapshot> s = Read();
    ASSERT_TRUE(s.ok());
    if (s->transition.has_value() && s->transition->phase == PlacementTransition::Phase::kAborted &&
        reconciler.stats().aborted == 1) {
      break;
    }
  }
  Result<PlacementReconciler::Snapshot> s = Read();
  ASSERT_TRUE(s.ok());
  ASSERT_TRUE(s->transition.has_value());
  EXPECT_EQ(s->transition->phase, PlacementTransition::Phase::kAborted) << s->transition->reason;
  EXPECT_EQ(reconciler.stats().aborted, 1u) << "an abort that took effect was not counted";
}

}  // namespace
}  // namespace orbitkv::cluster
