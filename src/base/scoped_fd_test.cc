#include "base/scoped_fd.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cerrno>

namespace orbitkv {
namespace {

bool IsOpen(int fd) { return ::fcntl(fd, F_GETFD) != -1 || errno != EBADF; }

TEST(ScopedFdTest, ClosesOnDestruction) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  ::close(fds[1]);
  {
    ScopedFd fd(fds[0]);
    EXPECT_TRUE(fd.valid());
    EXPECT_TRUE(IsOpen(fds[0]));
  }
  EXPECT_FALSE(IsOpen(fds[0]));
}

TEST(ScopedFdTest, MoveTransfersOwnership) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  ScopedFd a(fds[0]);
  ScopedFd w(fds[1]);
  ScopedFd b = std::move(a);
  EXPECT_FALSE(a.valid());  // NOLINT(bugprone-use-after-move): moved-from state is specified.
  EXPECT_EQ(b.get(), fds[0]);
  ScopedFd c;
  c = std::move(b);
  EXPECT_EQ(c.get(), fds[0]);
  EXPECT_TRUE(IsOpen(fds[0]));
}

TEST(ScopedFdTest, ReleaseKeepsFdOpen) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  int raw;
  {
    ScopedFd fd(fds[0]);
    raw = fd.Release();
    EXPECT_FALSE(fd.valid());
  }
  EXPECT_TRUE(IsOpen(raw));
  ::close(raw);
  ::close(fds[1]);
}

TEST(ScopedFdTest, DuplicateOwnsANewFd) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  ScopedFd r(fds[0]), w(fds[1]);
  Result<ScopedFd> dup = w.Duplicate();
  ASSERT_TRUE(dup.ok());
  EXPECT_NE(dup->get(), w.get());
  w.Reset();
  ASSERT_EQ(::write(dup->get(), "x", 1), 1);
  char c = 0;
  ASSERT_EQ(::read(r.get(), &c, 1), 1);
  EXPECT_EQ(c, 'x');
  EXPECT_EQ(ScopedFd().Duplicate().status().code(), StatusCode::kFailedPrecondition);
}

TEST(ScopedFdTest, ErrnoStatusMapsCodes) {
  EXPECT_EQ(ErrnoStatus("open", ENOENT).code(), StatusCode::kNotFound);
  EXPECT_EQ(ErrnoStatus("write", ENOSPC).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(ErrnoStatus("read", EIO).code(), StatusCode::kDataLoss);
  EXPECT_EQ(ErrnoStatus("connect", ECONNREFUSED).code(), StatusCode::kUnavailable);
  Status s = ErrnoStatus("open /x", ENOENT);
  EXPECT_NE(s.message().find("open /x: "), std::string_view::npos);
  EXPECT_NE(s.message().find("errno 2"), std::string_view::npos);
}

}  // namespace
}  // namespace orbitkv
