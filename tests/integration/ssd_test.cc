// The SSD tier through a real orbitkv-manager: blocks evicted from DRAM come back byte-exact from
// SSD (query -> Loading -> Hit), survive a restart and a kill -9 in the middle of write-back, a
// corrupted record is a miss and never data, and a full file system disables SSD admissions while
// DRAM service continues.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/falloc.h>
#include <stdlib.h>
#include <sys/mount.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "base/temp_dir.h"
#include "client/manager_link.h"
#include "engine_kv.h"
#include "manager_process.h"

namespace orbitkv {
namespace {

using TempDir = ::orbitkv::testing::TempDir;

using client::CacheClient;
using client::QueryResult;
using state::StateKey;
using testing::Chain;
using testing::Connect;
using testing::CorruptEveryRecord;
using testing::EngineKv;
using testing::EventuallyIdle;
using testing::ManagerProcess;
using testing::Register;
using testing::SaveChain;
using testing::StatField;

// 16 MiB of DRAM holds 512 blocks of 32 KiB; the chains below are longer, so their heads go to SSD.
constexpr uint32_t kPages = 1024;

std::vector<std::string> SsdFlags(const std::string& dir, const std::string& capacity = "64MiB",
                                  const std::string& policy = "write-back") {
  return {"--dram",      "16MiB", "--ssd-path",          dir, "--ssd-capacity", capacity,
          "--ssd-queue", "8MiB",  "--ssd-min-frequency", "1", "--ssd-policy",   policy};
}

// Waits until the Manager's pinned_blocks stat is `count` (0: the write-back queue drained).
bool EventuallyPinned(CacheClient& client, uint64_t count) {
  for (int i = 0; i < 2000; ++i) {
    if (StatField(client, "pinned_blocks") == count) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

// Saves `keys` 128 at a time into pages [0, kPages), letting the SSD writers drain between parts so
// that no write-back is dropped for a full queue.
void SaveAll(CacheClient& client, uint64_t instance, EngineKv& kv, const std::vector<StateKey>& keys) {
  for (uint32_t start = 0; start < keys.size(); start += 128) {
    std::vector<StateKey> part(keys.begin() + start, keys.begin() + start + 128);
    ASSERT_TRUE(SaveChain(client, instance, kv, part, start % kPages).ok());
    ASSERT_TRUE(EventuallyPinned(client, 0));
  }
}

// Queries `keys` until the answer is no longer Loading (the Manager reads SSD blocks into DRAM in
// the background). Every Loading answer for the same chain names the same operation.
QueryResult QueryThroughLoading(CacheClient& client, uint64_t instance, const std::vector<StateKey>& keys,
                                int* loading_answers = nullptr) {
  uint64_t op = 0;
  for (int i = 0; i < 2000; ++i) {
    auto result = client.Query(instance, 0, keys);
    EXPECT_TRUE(result.ok()) << result.status();
    if (!result.ok() || result->loading_op == 0) return result.ok() ? *result : QueryResult{};
    if (op != 0) {
      EXPECT_EQ(result->loading_op, op);
    }
    op = result->loading_op;
    if (loading_answers != nullptr) ++*loading_answers;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ADD_FAILURE() << "still Loading after 10 s";
  return QueryResult{};
}

// Waits until the Manager's SSD tier holds at least `records` records.
bool EventuallyOnSsd(CacheClient& client, uint64_t records) {
  for (int i = 0; i < 2000; ++i) {
    if (StatField(client, "records") >= records) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

// Connects to `manager` and registers instance `instance` over `kv`'s pages; null (with a failure
// recorded) when the Manager is not running or cannot be reached.
std::unique_ptr<CacheClient> ConnectEngine(ManagerProcess& manager, uint64_t instance, EngineKv& kv) {
  if (!manager.running()) {
    ADD_FAILURE() << "the Manager is not running:\n" << manager.LogText();
    return nullptr;
  }
  auto client = Connect(manager);
  if (client == nullptr) {
    ADD_FAILURE() << "cannot connect to the Manager";
    return nullptr;
  }
  Register(*client, instance, kv);
  return client;
}

// Connects as instance 1, saves `keys` and waits until every one of them is on SSD (a write-through
// Manager); null (with a failure recorded) when a step fails.
std::unique_ptr<CacheClient> SaveOnSsd(ManagerProcess& manager, EngineKv& kv, const std::vector<StateKey>& keys) {
  auto client = ConnectEngine(manager, 1, kv);
  if (client == nullptr) return nullptr;
  SaveAll(*client, 1, kv, keys);
  if (!EventuallyOnSsd(*client, keys.size())) {
    ADD_FAILURE() << "the blocks did not all reach SSD:\n" << manager.LogText();
    return nullptr;
  }
  return client;
}

// Restores `keys` (a Hit of all of them) into poisoned pages and checks every byte.
void ExpectRestoresByteExact(CacheClient& client, uint64_t instance, EngineKv& kv, const std::vector<StateKey>& keys,
                             const QueryResult& hit) {
  ASSERT_EQ(hit.hits, keys.size()) << client.Stats().value();
  kv.Poison();
  std::vector<uint32_t> pages(keys.size());
  for (uint32_t i = 0; i < keys.size(); ++i) pages[i] = i;
  ASSERT_TRUE(client.Restore(instance, 0, hit.lease, pages).ok());
  for (uint32_t i = 0; i < keys.size(); ++i) ASSERT_TRUE(kv.Holds(i, keys[i])) << "block " << i;
}

// The engine need not poll: the Manager answers a Loading wait when the op completes, on the
// client's completion fd, and QueryWait then leases the whole prefix.
TEST(SsdIntegrationTest, LoadingCompletionIsDeliveredAndQueryWaitLeasesThePrefix) {
  TempDir ssd;
  const auto keys = Chain(7, kPages);
  const std::vector<StateKey> head(keys.begin(), keys.begin() + 64);
  ManagerProcess manager(SsdFlags(ssd.path(), "64MiB", "write-through"));
  EngineKv kv(kPages);
  auto client = SaveOnSsd(manager, kv, keys);
  ASSERT_NE(client, nullptr);
  auto loading = client->Query(1, 0, head);
  ASSERT_TRUE(loading.ok()) << loading.status();
  ASSERT_NE(loading->loading_op, 0u) << "the head should have been evicted to SSD";
  Result<uint64_t> resident = client->WaitLoading(1, loading->loading_op, std::chrono::seconds(10));
  ASSERT_TRUE(resident.ok()) << resident.status();
  EXPECT_EQ(*resident, head.size());
  // Completed: the wait answers at once, and the next query is the hit.
  EXPECT_EQ(client->WaitLoading(1, loading->loading_op, std::chrono::seconds(1)).value_or(0), head.size());
  auto hit = client->QueryWait(1, 0, head, std::chrono::seconds(10));
  ASSERT_TRUE(hit.ok()) << hit.status();
  ExpectRestoresByteExact(*client, 1, kv, head, *hit);
  // Taken by that query: a wait on the op now hears NotFound (ask the query again).
  EXPECT_EQ(client->WaitLoading(1, loading->loading_op, std::chrono::seconds(1)).status().code(),
            StatusCode::kNotFound);
  // QueryWait from Loading straight to the hit, for a part of the chain still on SSD.
  const std::vector<StateKey> middle(keys.begin() + 64, keys.begin() + 128);
  auto waited = client->QueryWait(1, 0, middle, std::chrono::seconds(10));
  ASSERT_TRUE(waited.ok()) << waited.status();
  EXPECT_EQ(waited->loading_op, 0u);
  ExpectRestoresByteExact(*client, 1, kv, middle, *waited);
  EXPECT_TRUE(EventuallyIdle(*client));
}

TEST(SsdIntegrationTest, EvictedBlocksComeBackFromSsdAndAfterRestart) {
  TempDir ssd;
  const auto keys = Chain(1, kPages);
  const std::vector<StateKey> head(keys.begin(), keys.begin() + 64);
  {
    // Write-through, so the blocks still in DRAM at shutdown are on SSD too.
    ManagerProcess manager(SsdFlags(ssd.path(), "64MiB", "write-through"));
    EngineKv kv(kPages);
    auto client = SaveOnSsd(manager, kv, keys);
    ASSERT_NE(client, nullptr);
    int loading = 0;
    const QueryResult hit = QueryThroughLoading(*client, 1, head, &loading);
    EXPECT_GT(loading, 0);  // the head had been evicted: it came from SSD
    ExpectRestoresByteExact(*client, 1, kv, head, hit);
    EXPECT_GE(StatField(*client, "reads"), 1u);
    EXPECT_TRUE(EventuallyIdle(*client));
    EXPECT_EQ(manager.Stop(SIGTERM), 0);
  }
  // A new Manager on the same files finds the blocks again.
  ManagerProcess manager(SsdFlags(ssd.path()));
  EngineKv kv(64);
  auto client = ConnectEngine(manager, 2, kv);
  ASSERT_NE(client, nullptr);
  EXPECT_GE(StatField(*client, "recovered_records"), 256u);
  int loading = 0;
  const QueryResult hit = QueryThroughLoading(*client, 2, head, &loading);
  EXPECT_GT(loading, 0);
  ExpectRestoresByteExact(*client, 2, kv, head, hit);
  EXPECT_EQ(StatField(*client, "reads"), head.size());  // all of the head came from SSD

  // Cancel: a Loading op can be cancelled once; unknown ids and other instances' ops are NotFound.
  const std::vector<StateKey> rest(keys.begin() + 64, keys.end());
  auto pending = client->Query(2, 0, rest);
  ASSERT_TRUE(pending.ok());
  ASSERT_NE(pending->loading_op, 0u);
  ASSERT_TRUE(client->RegisterInstance(3, state::testing::SampleNamespace()).ok());
  EXPECT_EQ(client->Cancel(3, pending->loading_op).value(), false);  // another instance's operation
  EXPECT_EQ(client->Cancel(4, pending->loading_op).status().code(), StatusCode::kNotFound);  // not registered
  const Result<bool> cancelled = client->Cancel(2, pending->loading_op);
  EXPECT_TRUE(cancelled.ok()) << cancelled.status();  // true, or false when it completed and was taken
  EXPECT_EQ(client->Cancel(2, pending->loading_op).value(), false);
  EXPECT_EQ(client->Cancel(2, 999'999).value(), false);
  // The reads drained anyway: asking again ends in a Hit of the whole rest.
  const QueryResult rest_hit = QueryThroughLoading(*client, 2, rest);
  EXPECT_GT(rest_hit.hits, 0u);
  if (rest_hit.hits > 0) {
    ASSERT_TRUE(client->Release(2, rest_hit.lease).ok());
  }
  EXPECT_TRUE(EventuallyIdle(*client));
}

// Blocks that DRAM never evicted are written to SSD when the Manager is stopped with SIGTERM
// (--ssd-persist-on-exit), so the restarted Manager serves them; with 0 it exits without writing.
TEST(SsdIntegrationTest, GracefulStopPersistsDramOnlyBlocks) {
  for (const bool persist : {true, false}) {
    SCOPED_TRACE(persist ? "persist" : "no persist");
    TempDir ssd;
    const auto keys = Chain(7, 256);  // 8 MiB: DRAM keeps all of them
    {
      std::vector<std::string> flags = SsdFlags(ssd.path());
      flags.insert(flags.end(), {"--ssd-persist-on-exit", persist ? "30" : "0"});
      ManagerProcess manager(flags);
      EngineKv kv(kPages);
      auto client = ConnectEngine(manager, 1, kv);
      ASSERT_NE(client, nullptr);
      SaveAll(*client, 1, kv, keys);
      EXPECT_EQ(StatField(*client, "records"), 0u);  // write-back: nothing was evicted
      EXPECT_TRUE(EventuallyIdle(*client));
      client.reset();
      EXPECT_EQ(manager.Stop(SIGTERM), 0);
      if (persist) {
        EXPECT_NE(manager.LogText().find("wrote 256 of 256 DRAM-only block(s)"), std::string::npos)
            << manager.LogText();
      }
    }
    ManagerProcess manager(SsdFlags(ssd.path()));
    EngineKv kv(static_cast<uint32_t>(keys.size()));
    auto client = ConnectEngine(manager, 2, kv);
    ASSERT_NE(client, nullptr);
    EXPECT_EQ(StatField(*client, "recovered_records"), persist ? keys.size() : 0u);
    if (!persist) continue;
    const QueryResult hit = QueryThroughLoading(*client, 2, keys);
    ExpectRestoresByteExact(*client, 2, kv, keys, hit);
    EXPECT_EQ(StatField(*client, "reads"), keys.size());
  }
}

// Issue 73: an engine on a client::ManagerLink keeps running across its Manager's restart (SIGTERM, the same flags
// and socket). The link learns of the loss from the session's socket, not from a failing call; calls while the
// Manager is away get no client at once; the watcher connects to the new start and replays the registration before
// the engine's next call, and the blocks the old start persisted on exit are hits again from SSD, byte-exact.
TEST(SsdIntegrationTest, AnEngineOnAManagerLinkRidesThroughARestartAndFindsThePersistedBlocks) {
  TempDir ssd;
  ManagerProcess manager(SsdFlags(ssd.path()));
  ASSERT_TRUE(manager.running()) << manager.LogText();
  EngineKv kv(kPages);
  client::ManagerLink::Options options;
  options.client.socket_path = manager.socket();
  std::atomic<int> replays{0};
  options.on_connect = [&](CacheClient& client) {
    ++replays;
    ORBITKV_RETURN_IF_ERROR(client.RegisterInstance(1, state::testing::SampleNamespace()));
    return client.RegisterGroup(1, 0, kv.pages(), kv.Specs()).status();
  };
  auto link = client::ManagerLink::Start(options);
  ASSERT_TRUE(link.ok()) << link.status();
  std::shared_ptr<CacheClient> first = (*link)->Client();
  ASSERT_NE(first, nullptr);
  const auto keys = Chain(73, 128);
  SaveAll(*first, 1, kv, keys);
  ASSERT_TRUE(EventuallyIdle(*first));

  manager.Restart(SIGTERM);  // the old start persists its DRAM-only blocks, then the new one recovers them
  ASSERT_TRUE(manager.running()) << manager.LogText();
  // The old session is gone: the watcher takes the link down by itself and brings the new session up.
  std::shared_ptr<CacheClient> second;
  for (int i = 0; i < 1000 && (second = (*link)->Client()) == first; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  second = (*link)->WaitClient(std::chrono::seconds(10));
  ASSERT_NE(second, nullptr);
  EXPECT_NE(second, first);
  EXPECT_NE(second->manager_incarnation(), first->manager_incarnation());
  EXPECT_FALSE(first->SessionAlive());
  EXPECT_TRUE(second->SessionAlive());
  EXPECT_EQ(replays.load(), 2);
  const client::ManagerLink::Stats stats = (*link)->GetStats();
  EXPECT_EQ(stats.connects, 2u);
  EXPECT_EQ(stats.losses, 1u);
  // A save on the old client is refused as the old session's, never taken by the new start.
  std::vector<client::SaveItem> item{{keys[0], 0}};
  EXPECT_EQ(first->Save(1, 0, item).status().code(), StatusCode::kUnavailable);
  EXPECT_FALSE((*link)->Failed(first, Status::Unavailable("a late failure of the old session")));
  EXPECT_EQ((*link)->Client(), second);

  EXPECT_EQ(StatField(*second, "recovered_records"), keys.size());
  kv.Poison();
  const QueryResult hit = QueryThroughLoading(*second, 1, keys);
  ASSERT_EQ(hit.hits, keys.size());
  std::vector<uint32_t> pages(hit.hits);
  for (uint32_t i = 0; i < hit.hits; ++i) pages[i] = i;
  ASSERT_TRUE(second->Restore(1, 0, hit.lease, pages).ok());
  for (uint32_t i = 0; i < hit.hits; ++i) EXPECT_TRUE(kv.Holds(i, keys[i])) << i;

  // Stopped for good: the link goes down and hands out no client; calls fail fast, nothing waits.
  manager.Stop(SIGKILL);
  std::shared_ptr<CacheClient> gone = second;
  for (int i = 0; i < 1000 && gone != nullptr; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    gone = (*link)->Client();
  }
  EXPECT_EQ(gone, nullptr);
  EXPECT_EQ((*link)->GetStats().losses, 2u);
}

// A completed Loading operation keeps the blocks it loaded pinned until the engine's next query of
// the chain leases them, so other loads and saves cannot evict them first; a cancel, the engine's
// disconnection or --loading-hold seconds without that query let them go.
TEST(SsdIntegrationTest, LoadedBlocksAreHeldUntilTheEngineAsksAgain) {
  TempDir ssd;
  const auto keys = Chain(8, kPages);
  std::vector<std::string> flags = SsdFlags(ssd.path(), "64MiB", "write-through");
  flags.insert(flags.end(), {"--loading-hold", "2"});
  ManagerProcess manager(flags);
  EngineKv kv(kPages);
  auto client = SaveOnSsd(manager, kv, keys);
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(EventuallyPinned(*client, 0));
  // Three parts of the evicted head, 64 blocks each.
  auto part = [&](uint32_t n) { return std::vector<StateKey>(keys.begin() + n * 64, keys.begin() + (n + 1) * 64); };
  // Asked again: a Hit, leased; released, nothing stays pinned.
  auto first = client->Query(1, 0, part(0));
  ASSERT_TRUE(first.ok() && first->loading_op != 0);
  ASSERT_TRUE(EventuallyPinned(*client, 64)) << client->Stats().value();
  auto hit = client->Query(1, 0, part(0));
  ASSERT_TRUE(hit.ok());
  EXPECT_EQ(hit->loading_op, 0u);
  EXPECT_EQ(hit->hits, 64u);
  EXPECT_EQ(StatField(*client, "pinned_blocks"), 64u);  // by the lease now
  ASSERT_TRUE(client->Release(1, hit->lease).ok());
  EXPECT_TRUE(EventuallyPinned(*client, 0));
  // Cancelled after it completed: the hold goes.
  auto second = client->Query(1, 0, part(1));
  ASSERT_TRUE(second.ok() && second->loading_op != 0);
  ASSERT_TRUE(EventuallyPinned(*client, 64));
  EXPECT_TRUE(client->Cancel(1, second->loading_op).ok());  // true, or false once it completed and was taken
  EXPECT_TRUE(EventuallyPinned(*client, 0));
  // Nobody asks: the hold ends after --loading-hold, on a Manager that gets no query meanwhile.
  auto unasked = client->Query(1, 0, part(3));
  ASSERT_TRUE(unasked.ok() && unasked->loading_op != 0);
  ASSERT_TRUE(EventuallyPinned(*client, 64));
  EXPECT_TRUE(EventuallyPinned(*client, 0)) << client->Stats().value();
  // The engine goes away: its instance's holds go with it.
  auto third = client->Query(1, 0, part(2));
  ASSERT_TRUE(third.ok() && third->loading_op != 0);
  ASSERT_TRUE(EventuallyPinned(*client, 64));
  client.reset();
  auto observer = Connect(manager);
  ASSERT_NE(observer, nullptr);
  EXPECT_TRUE(EventuallyPinned(*observer, 0)) << observer->Stats().value();
}

TEST(SsdIntegrationTest, KillDuringWritebackNeverServesATornBlock) {
  TempDir ssd;
  const auto keys = Chain(2, 2 * kPages);
  {
    ManagerProcess manager(SsdFlags(ssd.path(), "128MiB"));
    EngineKv kv(kPages);
    auto client = ConnectEngine(manager, 1, kv);
    ASSERT_NE(client, nullptr);
    for (uint32_t start = 0; start < 2 * kPages; start += 128) {
      std::vector<StateKey> part(keys.begin() + start, keys.begin() + start + 128);
      ASSERT_TRUE(SaveChain(*client, 1, kv, part, start % kPages).ok());
    }
    // Kill it while the write-back queue is still draining.
    manager.Stop(SIGKILL);
  }
  ManagerProcess manager(SsdFlags(ssd.path(), "128MiB"));
  EngineKv kv(64);
  auto client = ConnectEngine(manager, 2, kv);
  ASSERT_NE(client, nullptr);
  // Every block the restarted Manager serves is byte-exact; the others are misses.
  uint64_t served = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    const std::vector<StateKey> one{keys[i]};
    // Single-key queries: the key's own chain position does not matter for this check.
    auto result = QueryThroughLoading(*client, 2, one);
    if (result.hits == 0) continue;
    kv.Poison();
    const uint32_t page = 0;
    ASSERT_TRUE(client->Restore(2, 0, result.lease, std::span(&page, 1)).ok());
    ASSERT_TRUE(kv.Holds(0, keys[i])) << "block " << i << " restored with wrong bytes";
    ++served;
  }
  EXPECT_GT(served, 0u);
  EXPECT_TRUE(EventuallyIdle(*client));
}

TEST(SsdIntegrationTest, CorruptedRecordIsAMissNeverData) {
  TempDir ssd;
  const auto keys = Chain(3, kPages);
  const std::vector<StateKey> head(keys.begin(), keys.begin() + 32);
  {
    ManagerProcess manager(SsdFlags(ssd.path(), "64MiB", "write-through"));
    EngineKv kv(kPages);
    ASSERT_NE(SaveOnSsd(manager, kv, keys), nullptr);
    EXPECT_EQ(manager.Stop(SIGTERM), 0);
  }
  CorruptEveryRecord(ssd.path());
  ManagerProcess manager(SsdFlags(ssd.path()));
  EngineKv kv(64);
  auto client = ConnectEngine(manager, 2, kv);
  ASSERT_NE(client, nullptr);
  const QueryResult result = QueryThroughLoading(*client, 2, head);
  EXPECT_EQ(result.hits, 0u);
  EXPECT_GE(StatField(*client, "verify_failures"), 1u);
  // The bad records are gone: the next query is a plain miss.
  auto again = client->Query(2, 0, head);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->hits, 0u);
  EXPECT_EQ(again->loading_op, 0u);
}

TEST(SsdIntegrationTest, FullFileSystemDisablesSsdAdmissionsAndDramContinues) {
  TempDir mount_point;
  ASSERT_EQ(::mount("tmpfs", mount_point.path().c_str(), "tmpfs", 0, "size=24m"), 0)
      << "mounting a tmpfs needs root (CI runs as root): " << std::strerror(errno);
  struct Unmount {
    std::string path;
    ~Unmount() { ::umount2(path.c_str(), MNT_DETACH); }
  } unmount{mount_point.path()};
  const std::string dir = mount_point.path() + "/ssd";
  ManagerProcess manager(SsdFlags(dir, "8MiB"));
  EngineKv kv(kPages);
  auto client = ConnectEngine(manager, 1, kv);
  ASSERT_NE(client, nullptr);
  // Take the preallocation away and fill the file system: the tier's next write gets ENOSPC.
  {
    int fd = ::open((dir + "/orbitkv-ssd-0.data").c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, 8 << 20), 0);
    ::close(fd);
    int filler = ::open((mount_point.path() + "/filler").c_str(), O_CREAT | O_WRONLY, 0600);
    ASSERT_GE(filler, 0);
    std::vector<uint8_t> chunk(1 << 16, 1);
    while (::write(filler, chunk.data(), chunk.size()) > 0) {
    }
    ::close(filler);
  }
  const auto keys = Chain(4, kPages);
  for (uint32_t start = 0; start < kPages; start += 128) {
    std::vector<StateKey> part(keys.begin() + start, keys.begin() + start + 128);
    ASSERT_TRUE(SaveChain(*client, 1, kv, part, start).ok());
  }
  bool disabled = false;
  for (int i = 0; i < 2000 && !disabled; ++i) {
    auto json = client->Stats();
    ASSERT_TRUE(json.ok());
    disabled = json->find("\"admissions_enabled\": false") != std::string::npos;
    if (!disabled) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_TRUE(disabled) << manager.LogText();
  EXPECT_GE(StatField(*client, "write_errors"), 1u);
  EXPECT_NE(manager.LogText().find("admissions are disabled"), std::string::npos);
  // DRAM service goes on: the chain's tail is still resident and restores byte-exact.
  const std::vector<StateKey> tail(keys.end() - 64, keys.end());
  auto hit = client->Query(1, 0, tail);
  ASSERT_TRUE(hit.ok());
  ExpectRestoresByteExact(*client, 1, kv, tail, *hit);
  EXPECT_TRUE(EventuallyIdle(*client));
}

}  // namespace
}  // namespace orbitkv
