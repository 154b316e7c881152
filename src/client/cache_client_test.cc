// CacheClient against a scripted Manager end: a real channel (socket, arena, rings, doorbells) whose
// server side answers like the Manager, except that it holds chosen replies back until the test
// lets them go. That is the fault the real Manager cannot produce on demand (a restore or a Loading
// operation that takes as long as the test wants), and it makes the waits deterministic.
#include "client/cache_client.h"
#include "client/manager_link.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

#include "channel/messages.h"
#include "channel/uds.h"
#include "state/test_util.h"

namespace orbitkv::client {
namespace {

using namespace std::chrono_literals;
using channel::Descriptor;
using channel::Opcode;

// Serves one session on its own thread. Queries of a chain are answered Loading (op 7) until
// `loaded`, then Hit(count, lease 42); WaitLoading and restore replies wait for the test.
class ScriptedManager {
 public:
  explicit ScriptedManager(const std::string& path) : path_(path) {
    auto listener = channel::ListenUnix(path_);
    EXPECT_TRUE(listener.ok()) << listener.status();
    listener_ = std::move(*listener);
    thread_ = std::thread([this] { Serve(); });
  }
  ~ScriptedManager() {
    stop_ = true;
    thread_.join();
    std::filesystem::remove_all(std::filesystem::path(path_).parent_path());
  }

  std::atomic<bool> loaded{false};
  std::atomic<int> queries{0};
  std::atomic<bool> release_restores{false};
  std::atomic<bool> release_waits{false};

 private:
  void Serve() {
    ScopedFd conn;
    while (!stop_ && !conn.valid()) {
      conn = ScopedFd(accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
      if (!conn.valid()) std::this_thread::sleep_for(1ms);
    }
    if (stop_) return;
    channel::AcceptOptions options;
    options.session_id = 1;
    options.session_epoch = 77;
    options.manager_incarnation = 5;
    options.default_layout = *channel::ArenaLayout::Compute(16, 8, 4096);
    options.deadline = Deadline::After(10s);
    auto session = channel::ServerSession::Accept(std::move(conn), options);
    ASSERT_TRUE(session.ok()) << session.status();
    std::vector<Descriptor> held_restores, held_waits;
    while (!stop_) {
      auto request = (*session)->NextRequest();
      ASSERT_TRUE(request.ok()) << request.status();
      if (release_restores) {
        for (const Descriptor& d : held_restores) (void)(*session)->Answer(d, channel::EncodeRestoreReply({4096}));
        held_restores.clear();
      }
      if (release_waits) {
        for (const Descriptor& d : held_waits) (void)(*session)->Answer(d, channel::EncodeWaitLoadingReply({3}));
        held_waits.clear();
      }
      if (!request->has_value()) {
        std::this_thread::sleep_for(100us);
        continue;
      }
      const Descriptor& d = (*request)->descriptor;
      switch ((*request)->opcode()) {
        case Opcode::kQuery: {
          ++queries;
          const auto count = static_cast<uint32_t>(d.arg1);
          (void)(*session)->Answer(d, channel::EncodeQueryReply(loaded ? channel::QueryReply::Hit(count, 42)
                                                                       : channel::QueryReply::Loading(7)));
          break;
        }
        case Opcode::kRestore:
          held_restores.push_back(d);
          break;
        case Opcode::kWaitLoading:
          held_waits.push_back(d);
          break;
        default:
          (void)(*session)->Answer(d, channel::ReplyArgs{});
      }
    }
  }

  const std::string path_;
  ScopedFd listener_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

class CacheClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = fmt::format("/tmp/orbitkv-client-test-{}/{}.sock", getpid(),
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    manager_ = std::make_unique<ScriptedManager>(path_);
    ClientOptions options;
    options.socket_path = path_;
    options.timeout = 500ms;
    auto client = CacheClient::Connect(options);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
  }
  std::vector<uint8_t> Natives(size_t n) const { return std::vector<uint8_t>(n * 16, 0xab); }
  Result<QueryResult> Query(size_t n) {
    const std::vector<uint8_t> natives = Natives(n);
    return client_->QueryNative(1, 0, 0, 16, 16, natives);
  }

  std::string path_;
  std::unique_ptr<ScriptedManager> manager_;
  std::unique_ptr<CacheClient> client_;
};

TEST_F(CacheClientTest, AWaitingRestoreDoesNotBlockOtherThreadsQueries) {
  manager_->loaded = true;
  const uint32_t pages[] = {0};
  Result<uint64_t> handle = client_->StartRestore(1, 0, 42, pages);
  ASSERT_TRUE(handle.ok()) << handle.status();
  std::atomic<bool> restored{false};
  std::thread waiter([&] {
    EXPECT_TRUE(client_->WaitRestore(*handle, 10s).ok());
    restored = true;
  });
  // While the restore waits (the Manager holds its reply), another thread's queries are answered.
  for (int i = 0; i < 20; ++i) {
    Result<QueryResult> hit = Query(3);
    ASSERT_TRUE(hit.ok()) << hit.status();
    EXPECT_EQ(hit->hits, 3u);
    EXPECT_EQ(hit->lease, 42u);
  }
  EXPECT_FALSE(restored.load());
  manager_->release_restores = true;
  waiter.join();
  EXPECT_TRUE(restored.load());
}

TEST_F(CacheClientTest, QueryWaitSleepsUntilTheLoadingCompletionThenAsksAgain) {
  auto waited = std::async(std::launch::async, [&] {
    const std::vector<uint8_t> natives = Natives(3);
    return client_->QueryNativeWait(1, 0, 0, 16, 16, natives, 10s);
  });
  // The first query was answered Loading and the client now waits for the op's completion: it does
  // not ask again (no polling) until the Manager says the op completed.
  while (manager_->queries.load() == 0) std::this_thread::sleep_for(1ms);
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(manager_->queries.load(), 1);
  EXPECT_EQ(waited.wait_for(0s), std::future_status::timeout);
  manager_->loaded = true;
  manager_->release_waits = true;
  Result<QueryResult> hit = waited.get();
  ASSERT_TRUE(hit.ok()) << hit.status();
  EXPECT_EQ(hit->hits, 3u);
  EXPECT_EQ(manager_->queries.load(), 2);
}

TEST_F(CacheClientTest, QueryWaitReturnsLoadingAtItsTimeoutAndTheLateAnswerHarmsNothing) {
  const std::vector<uint8_t> natives = Natives(2);
  // The Manager never answers the wait in time: the client gives up after the wait's own timeout
  // plus its call timeout, and the query result is still Loading.
  Result<uint64_t> wait = client_->WaitLoading(1, 7, 20ms);
  EXPECT_EQ(wait.status().code(), StatusCode::kDeadlineExceeded) << wait.status();
  Result<QueryResult> loading = client_->QueryNativeWait(1, 0, 0, 16, 16, natives, 1ms);
  ASSERT_TRUE(loading.ok()) << loading.status();
  EXPECT_EQ(loading->loading_op, 7u);
  // The late answers arrive; the session keeps working and its abandoned slots come back.
  manager_->release_waits = true;
  manager_->loaded = true;
  for (int i = 0; i < 40; ++i) {
    Result<QueryResult> hit = Query(2);
    ASSERT_TRUE(hit.ok()) << hit.status();
    EXPECT_EQ(hit->hits, 2u);
  }
}

// Many threads on one client at once: every call gets its own reply, whoever reads it off the ring
// (one waiter sleeps on the doorbell, the others are handed their replies).
TEST_F(CacheClientTest, ConcurrentCallersEachGetTheirOwnReply) {
  manager_->loaded = true;
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        const size_t n = 1 + static_cast<size_t>((t * 7 + i) % 9);
        Result<QueryResult> hit = Query(n);
        if (!hit.ok() || hit->hits != n) ++wrong;
        if (i % 50 == 0 && !client_->Ping().ok()) ++wrong;
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(manager_->queries.load(), 800);
}

// Issue 73: a ManagerLink started while no Manager listens serves none (at once, from any thread), connects and
// replays once one listens, and goes down by itself when that Manager's session closes: no call fails first.
TEST(ManagerLinkTest, ConnectsWhenAManagerListensAndGoesDownWhenItsSessionCloses) {
  const std::string path = fmt::format("/tmp/orbitkv-client-test-{}/link.sock", getpid());
  ManagerLink::Options options;
  options.client.socket_path = path;
  options.client.timeout = 500ms;
  options.watch_interval = 10ms;
  std::atomic<int> replays{0};
  options.on_connect = [&](CacheClient& client) {
    ++replays;
    return client.Ping().status();
  };
  auto link = ManagerLink::Start(options);
  ASSERT_TRUE(link.ok()) << link.status();
  EXPECT_EQ((*link)->Client(), nullptr);
  std::shared_ptr<CacheClient> served;
  {
    ScriptedManager manager(path);
    served = (*link)->WaitClient(10s);
    ASSERT_NE(served, nullptr);
    EXPECT_EQ(replays.load(), 1);
    EXPECT_TRUE(served->SessionAlive());
    std::atomic<int> seen{0};
    std::vector<std::thread> callers;
    for (int t = 0; t < 4; ++t) {
      callers.emplace_back([&] {
        for (int i = 0; i < 200; ++i) seen += (*link)->Client() == served ? 1 : 0;
      });
    }
    for (std::thread& t : callers) t.join();
    EXPECT_EQ(seen.load(), 800);
  }  // the Manager goes, and its session with it
  for (int i = 0; i < 1000 && (*link)->Client() != nullptr; ++i) std::this_thread::sleep_for(5ms);
  EXPECT_EQ((*link)->Client(), nullptr);
  EXPECT_FALSE(served->SessionAlive());
  const ManagerLink::Stats stats = (*link)->GetStats();
  EXPECT_EQ(stats.connects, 1u);
  EXPECT_EQ(stats.losses, 1u);
  EXPECT_EQ(stats.refusals, 0u);
  EXPECT_FALSE((*link)->Failed(served, Status::Unavailable("a late failure of the lost session")));
  EXPECT_EQ((*link)->GetStats().losses, 1u);
}

}  // namespace
}  // namespace orbitkv::client
