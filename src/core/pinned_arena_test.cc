#include "core/pinned_arena.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <linux/capability.h>
#include <numa.h>
#include <numaif.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <string>

namespace orbitkv::core {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kMiB = uint64_t{1} << 20;

// VmLck of this process in KiB.
uint64_t LockedKiB() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.starts_with("VmLck:")) return std::stoull(line.substr(6));
  }
  return 0;
}

bool HasIpcLock() {
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[_LINUX_CAPABILITY_U32S_3] = {};
  if (syscall(SYS_capget, &header, data) != 0) return false;
  return (data[CAP_IPC_LOCK / 32].effective & (1U << (CAP_IPC_LOCK % 32))) != 0;
}

// Whether this process may lock `bytes` more: CAP_IPC_LOCK, or room under RLIMIT_MEMLOCK.
bool CanLock(uint64_t bytes) {
  if (HasIpcLock()) return true;
  struct rlimit limit {};
  if (getrlimit(RLIMIT_MEMLOCK, &limit) != 0) return false;
  return limit.rlim_cur == RLIM_INFINITY || limit.rlim_cur >= LockedKiB() * 1024 + bytes;
}

// Removes CAP_IPC_LOCK from the effective and permitted sets of the calling process for good.
bool DropIpcLock() {
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[_LINUX_CAPABILITY_U32S_3] = {};
  if (syscall(SYS_capget, &header, data) != 0) return false;
  data[CAP_IPC_LOCK / 32].effective &= ~(1U << (CAP_IPC_LOCK % 32));
  data[CAP_IPC_LOCK / 32].permitted &= ~(1U << (CAP_IPC_LOCK % 32));
  return syscall(SYS_capset, &header, data) == 0;
}

// Runs `body` in a forked child and returns its exit code (or 200 + signal when it died of one).
template <typename Body>
int RunInChild(Body body) {
  pid_t pid = fork();
  if (pid == 0) _exit(body());
  if (pid < 0) return 255;
  int wstatus = 0;
  if (waitpid(pid, &wstatus, 0) != pid) return 254;
  if (WIFEXITED(wstatus)) return WEXITSTATUS(wstatus);
  return 200 + (WIFSIGNALED(wstatus) ? WTERMSIG(wstatus) : 0);
}

TEST(PinnedArenaTest, RejectsSizesThatAreNotWholePages) {
  for (uint64_t bytes : {uint64_t{0}, uint64_t{1}, uint64_t{4095}, uint64_t{4097}, 3 * kMiB + 512}) {
    auto arena = PinnedArena::Create({.bytes = bytes, .pin_mode = PinMode::kAllowUnpinned});
    EXPECT_EQ(arena.status().code(), StatusCode::kInvalidArgument) << bytes;
  }
  auto arena = PinnedArena::Create({.bytes = 4097, .name = "sized-wrong"});
  EXPECT_THAT(std::string(arena.status().message()), HasSubstr("sized-wrong"));
  EXPECT_THAT(std::string(arena.status().message()), HasSubstr("4097"));
}

TEST(PinnedArenaTest, RejectsNodesWithoutMemory) {
  EXPECT_EQ(PinnedArena::Create({.bytes = 4096, .numa_node = -2}).status().code(), StatusCode::kInvalidArgument);
  auto arena = PinnedArena::Create({.bytes = 4096, .numa_node = 4000});
  EXPECT_EQ(arena.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(arena.status().message()), HasSubstr("4000"));
}

TEST(PinnedArenaTest, WholeRangeIsWritableAndReadsBack) {
  constexpr uint64_t kBytes = 4 * kMiB;
  auto arena = PinnedArena::Create({.bytes = kBytes, .pin_mode = PinMode::kAllowUnpinned, .name = "rw"});
  ASSERT_TRUE(arena.ok()) << arena.status();
  PinnedArena& a = **arena;
  ASSERT_NE(a.data(), nullptr);
  EXPECT_EQ(a.size(), kBytes);
  EXPECT_EQ(a.name(), "rw");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data()) % kArenaPageBytes, 0U);
  for (uint64_t i = 0; i < kBytes; ++i) a.data()[i] = static_cast<uint8_t>(i * 131 + 7);
  uint64_t mismatches = 0;
  for (uint64_t i = 0; i < kBytes; ++i) mismatches += a.data()[i] != static_cast<uint8_t>(i * 131 + 7);
  EXPECT_EQ(mismatches, 0U);
}

TEST(PinnedArenaTest, MemfdIsSealedAndSharesTheMapping) {
  constexpr uint64_t kBytes = 2 * kMiB;
  auto arena = PinnedArena::Create({.bytes = kBytes, .pin_mode = PinMode::kAllowUnpinned});
  ASSERT_TRUE(arena.ok()) << arena.status();
  const int fd = (*arena)->memfd().get();
  ASSERT_GE(fd, 0);
  EXPECT_EQ(fcntl(fd, F_GET_SEALS), F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  EXPECT_NE(fcntl(fd, F_GETFD) & FD_CLOEXEC, 0);
  struct stat st {};
  ASSERT_EQ(fstat(fd, &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), kBytes);
  // The seals hold: no resizing and no new seals.
  EXPECT_NE(ftruncate(fd, kBytes / 2), 0);
  EXPECT_NE(ftruncate(fd, kBytes * 2), 0);
  EXPECT_NE(fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE), 0);
  // MAP_SHARED: bytes written through the mapping are the fd's bytes, as another process sees them.
  (*arena)->data()[kBytes - 3] = 0x5a;
  uint8_t byte = 0;
  ASSERT_EQ(pread(fd, &byte, 1, static_cast<off_t>(kBytes - 3)), 1);
  EXPECT_EQ(byte, 0x5a);
}

TEST(PinnedArenaTest, LocksTheWholeRangeAndUnlocksOnDestruction) {
  constexpr uint64_t kBytes = 16 * kMiB;
  if (!CanLock(kBytes)) GTEST_SKIP() << "no CAP_IPC_LOCK and RLIMIT_MEMLOCK below " << kBytes << " bytes";
  const uint64_t before_kib = LockedKiB();
  {
    auto arena = PinnedArena::Create({.bytes = kBytes});
    ASSERT_TRUE(arena.ok()) << arena.status();
    EXPECT_TRUE((*arena)->locked());
    EXPECT_EQ((*arena)->numa_node(), -1);
    EXPECT_GE(LockedKiB(), before_kib + kBytes / 1024);
  }
  EXPECT_EQ(LockedKiB(), before_kib);
}

TEST(PinnedArenaTest, BindsToNodeZeroBeforePopulating) {
  auto nodes = MemoryNumaNodes();
  ASSERT_TRUE(nodes.ok());
  if ((*nodes)[0] != 0) GTEST_SKIP() << "node 0 has no memory here";
  auto arena = PinnedArena::Create({.bytes = 2 * kMiB, .numa_node = 0, .pin_mode = PinMode::kAllowUnpinned});
  ASSERT_TRUE(arena.ok()) << arena.status();
  EXPECT_EQ((*arena)->numa_node(), 0);
  if (numa_available() < 0) return;  // Nothing to bind on a kernel without NUMA.
  // The policy of the pages is MPOL_BIND to {0}, and the populated pages are on node 0.
  int mode = -1;
  unsigned long mask[16] = {};  // NOLINT(google-runtime-int): get_mempolicy's type.
  ASSERT_EQ(get_mempolicy(&mode, mask, sizeof(mask) * 8, (*arena)->data(), MPOL_F_ADDR), 0) << strerror(errno);
  EXPECT_EQ(mode, MPOL_BIND);
  EXPECT_EQ(mask[0], 1UL);
  for (uint64_t offset : {uint64_t{0}, kMiB, 2 * kMiB - kArenaPageBytes}) {
    int node = -1;
    ASSERT_EQ(get_mempolicy(&node, nullptr, 0, (*arena)->data() + offset, MPOL_F_NODE | MPOL_F_ADDR), 0);
    EXPECT_EQ(node, 0) << offset;
  }
}

TEST(PinnedArenaTest, EveryMemoryNodeCanBackAnArena) {
  auto nodes = MemoryNumaNodes();
  ASSERT_TRUE(nodes.ok()) << nodes.status();
  ASSERT_FALSE(nodes->empty());
  EXPECT_TRUE(std::is_sorted(nodes->begin(), nodes->end()));
  for (int node : *nodes) {
    EXPECT_GE(node, 0);
    auto arena = PinnedArena::Create({.bytes = 64 * 1024, .numa_node = node, .pin_mode = PinMode::kAllowUnpinned});
    EXPECT_TRUE(arena.ok()) << node << ": " << arena.status();
  }
}

TEST(PinnedArenaTest, MoveTransfersOwnership) {
  auto arena = PinnedArena::Create({.bytes = 64 * 1024, .pin_mode = PinMode::kAllowUnpinned, .name = "moved"});
  ASSERT_TRUE(arena.ok());
  uint8_t* data = (*arena)->data();
  const int fd = (*arena)->memfd().get();
  data[0] = 42;
  PinnedArena moved(std::move(**arena));
  EXPECT_EQ((*arena)->data(), nullptr);
  EXPECT_EQ((*arena)->size(), 0U);
  EXPECT_FALSE((*arena)->memfd().valid());
  EXPECT_EQ(moved.data(), data);
  EXPECT_EQ(moved.memfd().get(), fd);
  EXPECT_EQ(moved.size(), 64U * 1024);
  EXPECT_EQ(moved.data()[0], 42);
  arena->reset();  // Destroying the moved-from arena must leave the mapping alone.
  EXPECT_EQ(moved.data()[0], 42);
  EXPECT_GE(fcntl(fd, F_GETFD), 0);  // Still open: owned by `moved`.
}

// Child exit codes of the lock-failure test, so a failure names the check that failed.
enum LockChildResult : int {
  kChildOk = 0,
  kCouldNotDropLimit = 10,
  kRequireLockedSucceeded = 11,
  kWrongCode = 12,
  kMessageLacksUlimit = 13,
  kMessageLacksNeededKiB = 14,
  kMessageLacksLimit = 15,
  kMessageLacksAlternatives = 16,
  kSmallArenaFailed = 17,
  kSmallArenaNotLocked = 18,
  kUnpinnedFailed = 19,
  kUnpinnedClaimsLocked = 20,
  kUnpinnedNotWritable = 21,
};

// Without CAP_IPC_LOCK and with a 1 MiB RLIMIT_MEMLOCK, a 64 MiB arena cannot be locked:
// kRequireLocked must fail with the fix in the message and kAllowUnpinned must carry on unlocked.
// Runs in a child so that the dropped capability and the lowered limit do not leak into other
// tests.
TEST(PinnedArenaTest, LockFailureNamesTheFixOrFallsBackWhenAllowed) {
  int result = RunInChild([]() -> int {
    DropIpcLock();  // Fails harmlessly when not root: the limit below applies anyway.
    struct rlimit limit {};
    limit.rlim_cur = limit.rlim_max = kMiB;
    if (setrlimit(RLIMIT_MEMLOCK, &limit) != 0 || HasIpcLock()) return kCouldNotDropLimit;

    auto required = PinnedArena::Create({.bytes = 64 * kMiB, .name = "needs-lock"});
    if (required.ok()) return kRequireLockedSucceeded;
    if (required.status().code() != StatusCode::kResourceExhausted) return kWrongCode;
    const std::string message(required.status().message());
    if (message.find("`ulimit -l`") == std::string::npos) return kMessageLacksUlimit;
    if (message.find("at least 65536 KiB") == std::string::npos) return kMessageLacksNeededKiB;
    if (message.find("RLIMIT_MEMLOCK is 1024 KiB") == std::string::npos) return kMessageLacksLimit;
    if (message.find("CAP_IPC_LOCK") == std::string::npos || message.find("--allow-unpinned") == std::string::npos) {
      return kMessageLacksAlternatives;
    }

    // Within the limit, locking still works.
    auto small = PinnedArena::Create({.bytes = 512 * 1024});
    if (!small.ok()) return kSmallArenaFailed;
    if (!(*small)->locked()) return kSmallArenaNotLocked;

    auto unpinned = PinnedArena::Create({.bytes = 64 * kMiB, .pin_mode = PinMode::kAllowUnpinned});
    if (!unpinned.ok()) return kUnpinnedFailed;
    if ((*unpinned)->locked()) return kUnpinnedClaimsLocked;
    uint8_t* data = (*unpinned)->data();
    for (uint64_t offset = 0; offset < 64 * kMiB; offset += kArenaPageBytes) data[offset] = 0xab;
    for (uint64_t offset = 0; offset < 64 * kMiB; offset += kArenaPageBytes) {
      if (data[offset] != 0xab) return kUnpinnedNotWritable;
    }
    return kChildOk;
  });
  EXPECT_EQ(result, kChildOk) << "see LockChildResult for the failed check";
}

TEST(NumaNodeOfPciDeviceTest, UnknownDeviceIsMinusOne) {
  auto node = NumaNodeOfPciDevice("fffe:fe:1f.7");
  ASSERT_TRUE(node.ok()) << node.status();
  EXPECT_EQ(*node, -1);
  node = NumaNodeOfPciDevice("0000FFFE:FE:1F.7");  // nvidia-smi's spelling.
  ASSERT_TRUE(node.ok()) << node.status();
  EXPECT_EQ(*node, -1);
}

TEST(NumaNodeOfPciDeviceTest, MalformedBusIdIsInvalid) {
  for (const char* text : {"", "gpu0", "00:1f", "0000:00:1f", "0000:00:20.0", "0000:00:1f.8", "000000000:00:00.0",
                           "0000:100:00.0", "0000:00:00.x"}) {
    EXPECT_EQ(NumaNodeOfPciDevice(text).status().code(), StatusCode::kInvalidArgument) << text;
  }
}

}  // namespace
}  // namespace orbitkv::core
