// The release queue against sources played by the test: one behind a partition (its RPCs hang until their
// deadline), one that answers.
#include "catalog/release_queue.h"

#include "base/metrics.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <set>
#include <thread>

namespace orbitkv::catalog {
namespace {

class PartitionedSources final : public SourceTransport {
 public:
  Result<SourceReply> Authorize(const std::string&, const std::string&, uint64_t, std::span<const SourceBlockVersion>,
                                uint64_t, std::chrono::milliseconds, Deadline) override {
    return Status::Unimplemented("not asked here");
  }
  Result<bool> Release(const std::string& node, const std::string&, uint64_t, uint64_t grant_id,
                       const std::string& /*grant_secret*/, Deadline deadline) override {
    std::unique_lock<std::mutex> lock(mu);
    ++attempts[node];
    max_in_flight[node] = std::max(max_in_flight[node], ++in_flight[node]);
    struct Done {
      PartitionedSources* self;
      std::string node;
      ~Done() { --self->in_flight[node]; }
    } done{this, node};
    cv.notify_all();
    if (gone.count(node) != 0) return Status::NotFound(node + " restarted");
    // Behind the partition the RPC hangs until its deadline (or the partition heals meanwhile).
    while (partitioned.count(node) != 0) {
      if (cv.wait_until(lock, deadline.when()) == std::cv_status::timeout && partitioned.count(node) != 0) {
        return Status::DeadlineExceeded(node + " did not answer");
      }
    }
    released.insert(grant_id);
    cv.notify_all();
    return true;
  }
  void Heal(const std::string& node) {
    std::lock_guard<std::mutex> lock(mu);
    partitioned.erase(node);
    cv.notify_all();
  }
  bool WaitFor(const std::function<bool()>& done) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(30), done);
  }

  std::mutex mu;
  std::condition_variable cv;
  std::set<std::string> partitioned, gone;
  std::set<uint64_t> released;
  std::map<std::string, int> attempts;
  std::map<std::string, int> in_flight, max_in_flight;  // concurrent Release RPCs per node
};

ReleaseQueue::Options Quick() {
  ReleaseQueue::Options options;
  options.rpc_timeout = std::chrono::milliseconds(100);
  options.backoff_min = std::chrono::milliseconds(5);
  options.backoff_max = std::chrono::milliseconds(20);
  return options;
}

TEST(ReleaseQueueTest, APartitionedSourceDelaysNeitherTheCallerNorOtherSourcesAndItsReleaseGoesThroughOnceHealed) {
  PartitionedSources sources;
  sources.partitioned.insert("p");
  ReleaseQueue queue(Quick(), &sources);
  // Both calls return before anything was answered: the caller (a fetch worker) never waits for a source.
  ASSERT_TRUE(queue.Release("p", "rt-p", 1, 11, "secret", Deadline::After(std::chrono::seconds(2))).value());
  ASSERT_TRUE(queue.Release("q", "rt-q", 2, 22, "secret", Deadline::After(std::chrono::seconds(2))).value());
  {
    std::lock_guard<std::mutex> lock(sources.mu);
    EXPECT_EQ(sources.released.count(11), 0u);
  }
  // q's release goes through while p's still hangs behind the partition.
  ASSERT_TRUE(sources.WaitFor([&] { return sources.released.count(22) == 1 && sources.attempts["p"] >= 2; }));
  EXPECT_EQ(sources.released.count(11), 0u);
  EXPECT_GE(queue.GetStats().retries, 1u);
  EXPECT_EQ(queue.GetStats().pending, 1u);
  sources.Heal("p");
  ASSERT_TRUE(sources.WaitFor([&] { return sources.released.count(11) == 1; }));
  for (int i = 0; i < 3000 && queue.GetStats().pending != 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const ReleaseQueue::Stats stats = queue.GetStats();
  EXPECT_EQ(stats.queued, 2u);
  EXPECT_EQ(stats.released, 2u);
  EXPECT_EQ(stats.abandoned, 0u);
  EXPECT_EQ(stats.pending, 0u);
}

TEST(ReleaseQueueTest, ARestartedSourceEndsTheReleaseAndOneNeverHealedIsAbandonedAtTheGrantLifetime) {
  PartitionedSources sources;
  sources.gone.insert("g");
  sources.partitioned.insert("p");
  ReleaseQueue::Options options = Quick();
  options.give_up_after = std::chrono::milliseconds(300);
  ReleaseQueue queue(options, &sources);
  ASSERT_TRUE(queue.Release("g", "rt-g", 1, 11, "secret", Deadline::Infinite()).ok());
  ASSERT_TRUE(queue.Release("p", "rt-p", 2, 22, "secret", Deadline::Infinite()).ok());
  for (int i = 0; i < 30000 && queue.GetStats().pending != 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const ReleaseQueue::Stats stats = queue.GetStats();
  EXPECT_EQ(stats.pending, 0u);
  EXPECT_EQ(stats.not_held, 1u);
  EXPECT_EQ(stats.abandoned, 1u);
  std::lock_guard<std::mutex> lock(sources.mu);
  EXPECT_EQ(sources.attempts["g"], 1);  // NotFound is an answer: no retry
  EXPECT_GE(sources.attempts["p"], 2);
  EXPECT_TRUE(sources.released.empty());
}

// Many releases to one unreachable source hold one worker at most (one RPC to a node at a time): a release to
// another source goes through while they wait.
TEST(ReleaseQueueTest, ManyReleasesToOneUnreachableSourceHoldOneWorkerAtMost) {
  PartitionedSources sources;
  sources.partitioned.insert("p");
  ReleaseQueue queue(Quick(), &sources);
  for (uint64_t i = 0; i < 6; ++i)
    ASSERT_TRUE(queue.Release("p", "rt-p", i, 100 + i, "secret", Deadline::Infinite()).ok());
  ASSERT_TRUE(sources.WaitFor([&] { return sources.attempts["p"] >= 3; }));
  ASSERT_TRUE(queue.Release("q", "rt-q", 9, 999, "secret", Deadline::Infinite()).ok());
  ASSERT_TRUE(sources.WaitFor([&] { return sources.released.count(999) == 1; }));
  {
    std::lock_guard<std::mutex> lock(sources.mu);
    EXPECT_EQ(sources.max_in_flight["p"], 1);
    EXPECT_TRUE(std::none_of(sources.released.begin(), sources.released.end(), [](uint64_t g) { return g < 999; }));
  }
  sources.Heal("p");
  ASSERT_TRUE(sources.WaitFor([&] { return sources.released.size() == 7; }));
}

TEST(ReleaseQueueTest, PastItsBoundTheQueueRefusesAndCountsTheDrop) {
  PartitionedSources sources;
  sources.partitioned.insert("p");
  ReleaseQueue::Options options = Quick();
  options.max_queued = 3;
  options.workers = 1;
  MetricsRegistry metrics;
  ReleaseQueue queue(options, &sources);
  // Its figures reach /metrics through a collector, read when scraped (declared after the queue: it goes first).
  auto collector = metrics.AddCollector([&queue](StatsVisitor& v) { queue.VisitStats(v); });
  for (uint64_t i = 0; i < 3; ++i)
    ASSERT_TRUE(queue.Release("p", "rt-p", i, 100 + i, "secret", Deadline::Infinite()).ok());
  Result<bool> over = queue.Release("p", "rt-p", 9, 109, "secret", Deadline::Infinite());
  EXPECT_EQ(over.status().code(), StatusCode::kResourceExhausted) << over.status();
  EXPECT_EQ(queue.GetStats().dropped, 1u);
  const std::string text = metrics.RenderPrometheus();
  EXPECT_NE(text.find("orbitkv_remote_releases_total{outcome=\"dropped\"} 1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("orbitkv_remote_releases_pending 3\n"), std::string::npos) << text;
  sources.Heal("p");
  ASSERT_TRUE(sources.WaitFor([&] { return sources.released.size() == 3; }));
  queue.Stop();
  EXPECT_EQ(queue.GetStats().released, 3u);
}

}  // namespace
}  // namespace orbitkv::catalog
