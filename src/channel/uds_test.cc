#include "channel/uds.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <string>

namespace orbitkv::channel {
namespace {

using std::chrono::milliseconds;

std::string TempSocketPath(const char* name) {
  std::string dir = fmt::format("/tmp/orbitkv-test-{}-{}", getpid(), name);
  return dir + "/manager.sock";
}

struct Pair {
  ScopedFd a, b;
};
Pair SocketPair() {
  int fds[2];
  EXPECT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, fds), 0);
  return {ScopedFd(fds[0]), ScopedFd(fds[1])};
}

TEST(UdsTest, ListenCreatesAPrivateSocketAndConnectReachesIt) {
  const std::string path = TempSocketPath("listen");
  auto listener = ListenUnix(path);
  ASSERT_TRUE(listener.ok()) << listener.status();
  struct stat st {};
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  auto client = ConnectUnix(path);
  ASSERT_TRUE(client.ok()) << client.status();
  // A second Manager on the same live socket is refused.
  EXPECT_EQ(ListenUnix(path).status().code(), StatusCode::kAlreadyExists);
  ScopedFd accepted(accept4(listener->get(), nullptr, nullptr, SOCK_CLOEXEC));
  ASSERT_TRUE(accepted.valid());
  auto cred = GetPeerCredentials(accepted.get());
  ASSERT_TRUE(cred.ok());
  EXPECT_EQ(cred->uid, getuid());
  EXPECT_EQ(cred->pid, getpid());
  // A stale socket file (its Manager gone) is replaced.
  listener->Reset();
  accepted.Reset();
  EXPECT_TRUE(ListenUnix(path).ok());
  std::filesystem::remove_all(std::filesystem::path(path).parent_path());
}

TEST(UdsTest, ConnectToNothingExplainsWhatIsMissing) {
  auto client = ConnectUnix("/tmp/orbitkv-no-such-dir/manager.sock");
  ASSERT_EQ(client.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(client.status().message().find("orbitkv-manager"), std::string::npos);
  EXPECT_EQ(ConnectUnix(std::string(200, 'x')).status().code(), StatusCode::kInvalidArgument);
}

TEST(UdsTest, FramesCarryBodiesAndDescriptors) {
  Pair p = SocketPair();
  auto bell = Doorbell::Create();
  ASSERT_TRUE(bell.ok());
  const HelloBody hello{1, 42, 0, 0, 0, 0, 0};
  int fds[] = {bell->fd().get()};
  ASSERT_TRUE(SendFrame(p.a.get(), FrameType::kHello, 9,
                        std::span(reinterpret_cast<const uint8_t*>(&hello), sizeof(hello)), fds)
                  .ok());
  auto frame = RecvFrame(p.b.get(), Deadline::After(milliseconds(2000)));
  ASSERT_TRUE(frame.ok()) << frame.status();
  EXPECT_EQ(frame->type(), FrameType::kHello);
  EXPECT_EQ(frame->header.request_id, 9u);
  auto body = BodyAs<HelloBody>(*frame);
  ASSERT_TRUE(body.ok());
  EXPECT_EQ(body->client_pid, 42u);
  ASSERT_EQ(frame->fds.size(), 1u);
  // The received fd is the same eventfd: ringing through it wakes the original.
  Doorbell received(std::move(frame->fds[0]));
  ASSERT_TRUE(received.Ring().ok());
  EXPECT_TRUE(bell->Wait(Deadline::After(milliseconds(2000))).ok());
  EXPECT_EQ(BodyAs<WelcomeBody>(*frame).status().code(), StatusCode::kInvalidArgument);
}

TEST(UdsTest, MalformedFramesAreRejectedAndTheirFdsClosed) {
  Pair p = SocketPair();
  auto deadline = [] { return Deadline::After(milliseconds(2000)); };
  // Too short for a header.
  ASSERT_EQ(send(p.a.get(), "abc", 3, 0), 3);
  EXPECT_EQ(RecvFrame(p.b.get(), deadline()).status().code(), StatusCode::kInvalidArgument);
  // Wrong magic, wrong version, unknown type, lying length.
  auto raw = [&](FrameHeader h, size_t extra) {
    std::vector<uint8_t> bytes(sizeof(h) + extra);
    std::memcpy(bytes.data(), &h, sizeof(h));
    ASSERT_EQ(send(p.a.get(), bytes.data(), bytes.size(), 0), static_cast<ssize_t>(bytes.size()));
  };
  raw(FrameHeader{0x1234, kWireVersion, 1, 0, 0, 0}, 0);
  EXPECT_EQ(RecvFrame(p.b.get(), deadline()).status().code(), StatusCode::kInvalidArgument);
  raw(FrameHeader{kMagic, kWireVersion + 1, 1, 0, 0, 0}, 0);
  auto version = RecvFrame(p.b.get(), deadline());
  EXPECT_EQ(version.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(version.status().message().find("upgrade"), std::string::npos);
  raw(FrameHeader{kMagic, kWireVersion, 99, 0, 0, 0}, 0);
  EXPECT_EQ(RecvFrame(p.b.get(), deadline()).status().code(), StatusCode::kInvalidArgument);
  raw(FrameHeader{kMagic, kWireVersion, 1, 100, 0, 0}, 4);
  EXPECT_EQ(RecvFrame(p.b.get(), deadline()).status().code(), StatusCode::kInvalidArgument);
  // A malformed frame with an fd attached: the fd is closed, not leaked.
  auto bell = Doorbell::Create();
  int fds[] = {bell->fd().get()};
  const uint32_t open_before = static_cast<uint32_t>(
      std::distance(std::filesystem::directory_iterator("/proc/self/fd"), std::filesystem::directory_iterator()));
  ASSERT_TRUE(SendFrame(p.a.get(), FrameType::kHello, 1, {}, fds).ok());
  auto frame = RecvFrame(p.b.get(), deadline());
  ASSERT_TRUE(frame.ok());
  EXPECT_EQ(BodyAs<HelloBody>(*frame).status().code(), StatusCode::kInvalidArgument);
  frame = Status::Cancelled("drop");
  const uint32_t open_after = static_cast<uint32_t>(
      std::distance(std::filesystem::directory_iterator("/proc/self/fd"), std::filesystem::directory_iterator()));
  EXPECT_EQ(open_after, open_before);
}

TEST(UdsTest, RecvReportsTimeoutsAndClosedPeers) {
  Pair p = SocketPair();
  EXPECT_EQ(RecvFrame(p.b.get(), Deadline::After(milliseconds(10))).status().code(), StatusCode::kDeadlineExceeded);
  p.a.Reset();
  EXPECT_EQ(RecvFrame(p.b.get(), Deadline::After(milliseconds(2000))).status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(SendFrame(p.b.get(), FrameType::kHello, 1, {}).code(), StatusCode::kUnavailable);
}

TEST(UdsTest, OversizedFramesAreRefusedBeforeSending) {
  Pair p = SocketPair();
  std::vector<uint8_t> big(kMaxFrameBytes);
  EXPECT_EQ(SendFrame(p.a.get(), FrameType::kHello, 1, big).code(), StatusCode::kInvalidArgument);
}

TEST(DoorbellTest, WaitTimesOutAndRingsCoalesce) {
  auto bell = Doorbell::Create();
  ASSERT_TRUE(bell.ok());
  EXPECT_EQ(bell->Wait(Deadline::After(milliseconds(5))).code(), StatusCode::kDeadlineExceeded);
  ASSERT_TRUE(bell->Ring().ok());
  ASSERT_TRUE(bell->Ring().ok());
  EXPECT_TRUE(bell->Wait(Deadline::After(milliseconds(100))).ok());
  // Two rings, one wakeup: the count was consumed.
  EXPECT_EQ(bell->Wait(Deadline::After(milliseconds(5))).code(), StatusCode::kDeadlineExceeded);
}

}  // namespace
}  // namespace orbitkv::channel
