#include "channel/session.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <future>
#include <thread>

#include "channel/messages.h"
#include "state/test_util.h"

namespace orbitkv::channel {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

class SessionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = fmt::format("/tmp/orbitkv-session-test-{}/{}.sock", getpid(),
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    auto listener = ListenUnix(path_);
    ASSERT_TRUE(listener.ok()) << listener.status();
    listener_ = std::move(*listener);
  }
  void TearDown() override { std::filesystem::remove_all(std::filesystem::path(path_).parent_path()); }

  AcceptOptions Options(uint64_t id = 1) {
    AcceptOptions options;
    options.session_id = id;
    options.session_epoch = 1000 + id;
    options.manager_incarnation = 5;
    options.default_layout = *ArenaLayout::Compute(16, 4, 4096);
    options.deadline = Deadline::After(seconds(10));
    return options;
  }

  // Connects a client while the server side accepts; returns both ends.
  std::pair<Result<std::unique_ptr<ServerSession>>, Result<std::unique_ptr<ClientSession>>> Open(
      ConnectOptions connect = {}, AcceptOptions accept = {}) {
    if (accept.session_id == 0) accept = Options();
    auto client = std::async(std::launch::async, [&] { return ClientSession::Connect(path_, connect); });
    ScopedFd conn;
    for (int i = 0; i < 1000 && !conn.valid(); ++i) {
      conn = ScopedFd(accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
      if (!conn.valid()) std::this_thread::sleep_for(milliseconds(5));
    }
    auto server = ServerSession::Accept(std::move(conn), accept);
    return {std::move(server), client.get()};
  }

  std::string path_;
  ScopedFd listener_;
};

TEST_F(SessionTest, PingRoundTripWithPayloadEcho) {
  auto opened = Open();
  auto& server = opened.first;
  auto& client = opened.second;
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_EQ((*client)->session_id(), 1u);
  EXPECT_EQ((*client)->welcome().session_epoch, 1001u);
  EXPECT_EQ((*server)->peer().uid, getuid());

  auto slot = (*client)->AcquireSlot();
  ASSERT_TRUE(slot.ok());
  std::memcpy((*client)->slot(*slot).data(), "hello", 5);
  Descriptor d{};
  d.opcode = static_cast<uint16_t>(Opcode::kPing);
  d.arg0 = 7;
  auto id = (*client)->Submit(d, *slot, 5);
  ASSERT_TRUE(id.ok()) << id.status();

  auto request = (*server)->NextRequest();
  ASSERT_TRUE(request.ok()) << request.status();
  ASSERT_TRUE(request->has_value());
  EXPECT_EQ((*request)->opcode(), Opcode::kPing);
  EXPECT_EQ((*request)->payload, std::vector<uint8_t>({'h', 'e', 'l', 'l', 'o'}));
  const uint8_t answer[] = {'w', 'o', 'r', 'l', 'd', '!'};
  ASSERT_TRUE((*server)->Reply((*request)->descriptor, StatusCode::kOk, 42, 43, answer).ok());

  auto reply = (*client)->WaitReply(*id, Deadline::After(seconds(5)));
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(reply->code(), StatusCode::kOk);
  EXPECT_EQ(reply->descriptor.arg0, 42u);
  EXPECT_EQ(reply->descriptor.payload_bytes, 6u);
  EXPECT_EQ(std::memcmp((*client)->slot(*slot).data(), "world!", 6), 0);
  (*client)->ReleaseSlot(*slot);
}

TEST_F(SessionTest, ClientSleepsOnTheDoorbellAndWakesForAReplyFromAnotherThread) {
  auto opened = Open();
  auto& server = opened.first;
  auto& client = opened.second;
  ASSERT_TRUE(server.ok() && client.ok());
  uint32_t slot = *(*client)->AcquireSlot();
  Descriptor d{};
  d.opcode = static_cast<uint16_t>(Opcode::kPing);
  uint64_t id = *(*client)->Submit(d, slot, 0);
  std::thread replier([&] {
    std::this_thread::sleep_for(milliseconds(50));  // let the client go to sleep
    std::optional<InboundRequest> request;
    while (!request.has_value()) request = *(*server)->NextRequest();
    ASSERT_TRUE((*server)->Reply(request->descriptor, StatusCode::kNotFound, 0, 0).ok());
  });
  auto reply = (*client)->WaitReply(id, Deadline::After(seconds(10)), /*spin_iterations=*/0);
  replier.join();
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(reply->code(), StatusCode::kNotFound);
}

TEST_F(SessionTest, TimeoutKeepsTheSlotOwnedAndLateRepliesAreStillMatched) {
  auto opened = Open();
  auto& server = opened.first;
  auto& client = opened.second;
  ASSERT_TRUE(server.ok() && client.ok());
  uint32_t slot = *(*client)->AcquireSlot();
  Descriptor d{};
  d.opcode = static_cast<uint16_t>(Opcode::kPing);
  uint64_t id = *(*client)->Submit(d, slot, 0);
  EXPECT_EQ((*client)->WaitReply(id, Deadline::After(milliseconds(20))).status().code(), StatusCode::kDeadlineExceeded);
  // The slot is not reusable while its request is outstanding.
  (*client)->ReleaseSlot(slot);
  for (int i = 0; i < 3; ++i) EXPECT_NE(*(*client)->AcquireSlot(), slot);
  auto request = *(*server)->NextRequest();
  ASSERT_TRUE((*server)->Reply(request->descriptor, StatusCode::kOk, 1, 2).ok());
  EXPECT_TRUE((*client)->WaitReply(id, Deadline::After(seconds(5))).ok());
}

TEST_F(SessionTest, ARequestPushedIsSentEvenWhenItsDoorbellFails) {
  auto opened = Open();
  auto& server = opened.first;
  auto& client = opened.second;
  ASSERT_TRUE(server.ok() && client.ok());
  ASSERT_FALSE(*(*server)->PrepareToWait());  // the Manager sleeps: the next Submit rings
  // Fault injection: the doorbell's fd now refuses writes (EBADF), which the real eventfd cannot
  // be made to do on demand.
  ScopedFd read_only(open("/dev/null", O_RDONLY | O_CLOEXEC));
  ASSERT_TRUE(read_only.valid());
  ASSERT_GE(dup2(read_only.get(), (*client)->request_doorbell_fd()), 0);
  uint32_t slot = *(*client)->AcquireSlot();
  Descriptor d{};
  d.opcode = static_cast<uint16_t>(Opcode::kPing);
  auto id = (*client)->Submit(d, slot, 0);
  ASSERT_TRUE(id.ok()) << "a pushed request must not look unsent: " << id.status();
  // It is in the Manager's ring (it would serve it once awake) ...
  (*server)->ClearWaiting();
  auto request = (*server)->NextRequest();
  ASSERT_TRUE(request.ok() && request->has_value());
  EXPECT_EQ((*request)->descriptor.request_id, *id);
  // ... and the session is dead for the client, which neither reuses the slot nor the id.
  auto reply = (*client)->WaitReply(*id, Deadline::After(seconds(5)));
  EXPECT_EQ(reply.status().code(), StatusCode::kUnavailable) << reply.status();
  EXPECT_NE(reply.status().message().find("reconnect"), std::string::npos) << reply.status();
  (*client)->ReleaseSlot(slot);
  auto again = (*client)->AcquireSlot();
  if (again.ok()) {
    EXPECT_NE(*again, slot);  // still retired: the request is outstanding
  }
  EXPECT_FALSE((*client)->Submit(d, again.ok() ? *again : 0, 0).ok());
}

TEST_F(SessionTest, ReplayedAndStaleDescriptorsAreRejected) {
  auto opened = Open();
  auto& server = opened.first;
  auto& client = opened.second;
  ASSERT_TRUE(server.ok() && client.ok());
  uint32_t slot = *(*client)->AcquireSlot();
  Descriptor d{};
  d.opcode = static_cast<uint16_t>(Opcode::kPing);
  ASSERT_TRUE((*client)->Submit(d, slot, 0).ok());
  auto first = *(*server)->NextRequest();
  ASSERT_TRUE(first.has_value());
  // Replay the same descriptor straight into the ring, bypassing the client's generation
  // bookkeeping.
  Descriptor replay = first->descriptor;
  std::memcpy(&(*server)->arena().request_entries()[1], &replay, sizeof(replay));
  (*server)->arena().request_control()->head = 2;
  auto replayed = (*server)->NextRequest();
  EXPECT_EQ(replayed.status().code(), StatusCode::kAborted) << replayed.status();
  EXPECT_NE(replayed.status().message().find("replayed"), std::string::npos);
}

TEST_F(SessionTest, WrongEpochAndMalformedDescriptorsAreRejected) {
  auto opened = Open();
  auto& server = opened.first;
  auto& client = opened.second;
  ASSERT_TRUE(server.ok() && client.ok());
  auto inject = [&](Descriptor d) {
    auto* control = (*server)->arena().request_control();
    std::memcpy(&(*server)->arena().request_entries()[control->head % 16], &d, sizeof(d));
    control->head++;
    return (*server)->NextRequest().status();
  };
  Descriptor good{};
  good.magic = kMagic;
  good.version = kWireVersion;
  good.opcode = static_cast<uint16_t>(Opcode::kPing);
  good.session_epoch = 1001;
  good.payload_generation = 1;
  Descriptor d = good;
  d.session_epoch = 999;
  EXPECT_EQ(inject(d).code(), StatusCode::kAborted);
  d = good;
  d.opcode = 200;
  EXPECT_EQ(inject(d).code(), StatusCode::kInvalidArgument);
  d = good;
  d.payload_slot = 4;
  EXPECT_EQ(inject(d).code(), StatusCode::kInvalidArgument);
  d = good;
  d.payload_bytes = 4097;
  EXPECT_EQ(inject(d).code(), StatusCode::kInvalidArgument);
  d = good;
  d.payload_generation = 2;
  EXPECT_EQ(inject(d).code(), StatusCode::kInvalidArgument);
  d = good;
  d.version = 9;
  EXPECT_EQ(inject(d).code(), StatusCode::kFailedPrecondition);
  d = good;
  d.flags = 1;
  EXPECT_EQ(inject(d).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(inject(good).ok());
}

TEST_F(SessionTest, PoisonTellsTheClientWhy) {
  auto opened = Open();
  auto& server = opened.first;
  auto& client = opened.second;
  ASSERT_TRUE(server.ok() && client.ok());
  uint32_t slot = *(*client)->AcquireSlot();
  Descriptor d{};
  d.opcode = static_cast<uint16_t>(Opcode::kPing);
  uint64_t id = *(*client)->Submit(d, slot, 0);
  (*server)->Poison(Status::InvalidArgument("query key 3: bad encoding"));
  auto reply = (*client)->WaitReply(id, Deadline::After(seconds(5)));
  ASSERT_EQ(reply.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(reply.status().message().find("bad encoding"), std::string::npos);
  // Every later call fails the same way, fast.
  EXPECT_EQ((*client)->Submit(d, *(*client)->AcquireSlot(), 0).status().code(), StatusCode::kInvalidArgument);
}

TEST_F(SessionTest, ManagerGoneIsUnavailableNotAHang) {
  auto opened = Open();
  auto& server = opened.first;
  auto& client = opened.second;
  ASSERT_TRUE(server.ok() && client.ok());
  uint32_t slot = *(*client)->AcquireSlot();
  Descriptor d{};
  d.opcode = static_cast<uint16_t>(Opcode::kPing);
  uint64_t id = *(*client)->Submit(d, slot, 0);
  server->reset();  // the Manager process dies: its socket closes
  auto reply = (*client)->WaitReply(id, Deadline::After(seconds(30)));
  EXPECT_EQ(reply.status().code(), StatusCode::kUnavailable) << reply.status();
}

TEST_F(SessionTest, DisallowedUidIsRefusedWithTheFix) {
  // Run the client as another uid in a child process (the test runs as root in CI; skip the switch
  // otherwise).
  if (geteuid() != 0) GTEST_SKIP() << "needs root to connect as another uid";
  pid_t child = fork();
  if (child == 0) {
    if (setgid(65534) != 0 || setuid(65534) != 0) _exit(10);
    // The socket is 0600: the other uid cannot even connect, which is the first line of defence.
    auto client = ClientSession::Connect(path_, {});
    _exit(client.ok() ? 11 : (client.status().code() == StatusCode::kUnavailable ? 0 : 12));
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

TEST_F(SessionTest, LifecycleFramesRoundTripWithFds) {
  auto opened = Open();
  auto& server = opened.first;
  auto& client = opened.second;
  ASSERT_TRUE(server.ok() && client.ok());
  auto bell = Doorbell::Create();
  const RegisterInstanceBody body{77, {}};
  const int fds[] = {bell->fd().get()};
  auto pending = std::async(std::launch::async, [&] {
    return (*client)->Lifecycle(FrameType::kRegisterInstance,
                                std::span(reinterpret_cast<const uint8_t*>(&body), sizeof(body)), fds,
                                Deadline::After(seconds(10)));
  });
  std::optional<Frame> frame;
  for (int i = 0; i < 2000 && !frame.has_value(); ++i) {
    auto got = (*server)->ReadFrame();
    ASSERT_TRUE(got.ok()) << got.status();
    frame = std::move(*got);
    if (!frame.has_value()) std::this_thread::sleep_for(milliseconds(5));
  }
  ASSERT_TRUE(frame.has_value());
  EXPECT_EQ(frame->type(), FrameType::kRegisterInstance);
  EXPECT_EQ(frame->fds.size(), 1u);
  ASSERT_TRUE((*server)->SendLifecycleReply(frame->header.request_id, Status::Ok(), 4096).ok());
  auto value = pending.get();
  ASSERT_TRUE(value.ok()) << value.status();
  EXPECT_EQ(*value, 4096u);
}

}  // namespace
}  // namespace orbitkv::channel
