#include "channel/uds.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "base/check.h"

namespace orbitkv::channel {
namespace {

Result<sockaddr_un> UnixAddress(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return Status::InvalidArgument(
        fmt::format("socket path '{}' must be 1-{} bytes long", path, sizeof(addr.sun_path) - 1));
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  return addr;
}

// Waits for `events` on fd until the deadline: Ok, DeadlineExceeded, or an errno status.
Status WaitFor(int fd, short events, Deadline deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int rc = poll(&p, 1, deadline.RemainingPollMs());
    if (rc > 0) return Status::Ok();
    if (rc == 0) return Status::DeadlineExceeded("timed out waiting on the channel socket");
    if (errno != EINTR) return ErrnoStatus("poll channel socket", errno);
  }
}

}  // namespace

std::string DefaultManagerSocketPath() {
  const char* explicit_path = std::getenv("ORBITKV_SOCKET");
  if (explicit_path != nullptr && explicit_path[0] != '\0') return explicit_path;
  const char* runtime = std::getenv("XDG_RUNTIME_DIR");
  if (runtime != nullptr && runtime[0] != '\0') return fmt::format("{}/orbitkv/manager.sock", runtime);
  return fmt::format("/tmp/orbitkv-{}/manager.sock", getuid());
}

Result<ScopedFd> ListenUnix(const std::string& path, mode_t mode, int backlog) {
  ORBITKV_ASSIGN_OR_RETURN(sockaddr_un addr, UnixAddress(path));
  const std::filesystem::path dir = std::filesystem::path(path).parent_path();
  if (!dir.empty()) {
    std::error_code ec;
    if (std::filesystem::create_directories(dir, ec)) {
      const bool shared = (mode & 0066) != 0;
      std::filesystem::permissions(
          dir, shared ? static_cast<std::filesystem::perms>(0755) : std::filesystem::perms::owner_all, ec);
    }
    if (ec) return Status::Internal(fmt::format("cannot create socket directory {}: {}", dir.string(), ec.message()));
  }
  // A socket file that nobody accepts on is left over from a dead Manager: replace it. A live one
  // is an error.
  if (std::filesystem::exists(path)) {
    ScopedFd probe(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    if (probe.valid() && connect(probe.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0) {
      return Status::AlreadyExists(fmt::format("another Manager is already listening on {}", path));
    }
    if (unlink(path.c_str()) != 0 && errno != ENOENT) return ErrnoStatus("remove stale socket " + path, errno);
  }
  ScopedFd fd(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) return ErrnoStatus("socket(AF_UNIX)", errno);
  // Bind with a restrictive umask so the socket never exists with looser permissions, then pin
  // 0600.
  const mode_t old_umask = umask(0177);
  const int bound = bind(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
  const int bind_errno = errno;
  umask(old_umask);
  if (bound != 0) return ErrnoStatus("bind " + path, bind_errno);
  if (chmod(path.c_str(), mode) != 0) return ErrnoStatus("chmod " + path, errno);
  if (listen(fd.get(), backlog) != 0) return ErrnoStatus("listen " + path, errno);
  return fd;
}

Result<ScopedFd> ConnectUnix(const std::string& path) {
  ORBITKV_ASSIGN_OR_RETURN(sockaddr_un addr, UnixAddress(path));
  ScopedFd fd(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return ErrnoStatus("socket(AF_UNIX)", errno);
  if (connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int err = errno;
    return Status::Unavailable(
        fmt::format("cannot connect to the OrbitKV Manager at {}: {} (is orbitkv-manager "
                    "running, and is this the socket it was started with?)",
                    path, std::strerror(err)));
  }
  return fd;
}

Result<PeerCredentials> GetPeerCredentials(int fd) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return ErrnoStatus("SO_PEERCRED", errno);
  return PeerCredentials{cred.pid, cred.uid, cred.gid};
}

Status SendFrame(int fd, FrameType type, uint64_t request_id, std::span<const uint8_t> body, std::span<const int> fds) {
  if (sizeof(FrameHeader) + body.size() > kMaxFrameBytes) {
    return Status::InvalidArgument(fmt::format("frame body of {} bytes exceeds the {}-byte frame limit", body.size(),
                                               kMaxFrameBytes - sizeof(FrameHeader)));
  }
  if (fds.size() > kMaxFrameFds) {
    return Status::InvalidArgument(fmt::format("{} fds exceed the {} per frame", fds.size(), kMaxFrameFds));
  }
  FrameHeader header{kMagic, kWireVersion, static_cast<uint16_t>(type), static_cast<uint32_t>(body.size()),
                     0,      request_id};
  iovec iov[2] = {{&header, sizeof(header)}, {const_cast<uint8_t*>(body.data()), body.size()}};
  msghdr msg{};
  msg.msg_iov = iov;
  msg.msg_iovlen = body.empty() ? 1 : 2;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFrameFds)];
  if (!fds.empty()) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(cmsg), fds.data(), sizeof(int) * fds.size());
  }
  for (;;) {
    const ssize_t sent = sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (sent == static_cast<ssize_t>(sizeof(header) + body.size())) return Status::Ok();
    if (sent >= 0) return Status::Internal("short write of a channel frame");
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      ORBITKV_RETURN_IF_ERROR(WaitFor(fd, POLLOUT, Deadline::After(std::chrono::seconds(5))));
      continue;
    }
    if (errno == EPIPE || errno == ECONNRESET) return Status::Unavailable("channel peer closed the connection");
    return ErrnoStatus("sendmsg channel frame", errno);
  }
}

Result<Frame> RecvFrame(int fd, Deadline deadline) {
  std::vector<uint8_t> buffer(kMaxFrameBytes);
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFrameFds)];
  Frame frame;
  ssize_t received;
  msghdr msg{};
  for (;;) {
    ORBITKV_RETURN_IF_ERROR(WaitFor(fd, POLLIN, deadline));
    iovec iov{buffer.data(), buffer.size()};
    msg = msghdr{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    received = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (received >= 0) break;
    if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
    if (errno == ECONNRESET) return Status::Unavailable("channel peer closed the connection");
    return ErrnoStatus("recvmsg channel frame", errno);
  }
  // Take ownership of every passed fd before any validation can return.
  for (cmsghdr* cmsg = CMSG_FIRSTHDR(&msg); cmsg != nullptr; cmsg = CMSG_NXTHDR(&msg, cmsg)) {
    if (cmsg->cmsg_level != SOL_SOCKET || cmsg->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (cmsg->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int passed;
      std::memcpy(&passed, CMSG_DATA(cmsg) + i * sizeof(int), sizeof(int));
      frame.fds.emplace_back(passed);
    }
  }
  if (received == 0) return Status::Unavailable("channel peer closed the connection");
  if ((msg.msg_flags & MSG_CTRUNC) != 0) return Status::InvalidArgument("channel frame carried too many fds");
  if ((msg.msg_flags & MSG_TRUNC) != 0) return Status::InvalidArgument("channel frame exceeds the frame limit");
  if (static_cast<size_t>(received) < sizeof(FrameHeader)) {
    return Status::InvalidArgument(fmt::format("channel frame of {} bytes is shorter than its header", received));
  }
  std::memcpy(&frame.header, buffer.data(), sizeof(FrameHeader));
  const FrameHeader& h = frame.header;
  if (h.magic != kMagic) return Status::InvalidArgument(fmt::format("bad channel frame magic {:#x}", h.magic));
  if (h.version != kWireVersion) {
    return Status::FailedPrecondition(
        fmt::format("channel wire version {} is not this Manager's {}: upgrade the client and the "
                    "Manager together",
                    h.version, kWireVersion));
  }
  if (h.type == 0 || h.type > kMaxFrameType) {
    return Status::InvalidArgument(fmt::format("unknown channel frame type {}", h.type));
  }
  if (h.body_bytes != static_cast<size_t>(received) - sizeof(FrameHeader) || h.reserved != 0) {
    return Status::InvalidArgument(fmt::format("channel frame length {} does not match its {} received bytes",
                                               h.body_bytes, received - sizeof(FrameHeader)));
  }
  frame.body.assign(buffer.begin() + sizeof(FrameHeader), buffer.begin() + received);
  return frame;
}

Result<Doorbell> Doorbell::Create() {
  ScopedFd fd(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!fd.valid()) return ErrnoStatus("eventfd", errno);
  return Doorbell(std::move(fd));
}

Status Doorbell::Ring() {
  const uint64_t one = 1;
  for (;;) {
    if (write(fd_.get(), &one, sizeof(one)) == sizeof(one)) return Status::Ok();
    if (errno == EINTR) continue;
    // EAGAIN: the counter is saturated, so a wakeup is pending anyway.
    if (errno == EAGAIN) return Status::Ok();
    return ErrnoStatus("ring doorbell", errno);
  }
}

void Doorbell::Drain() {
  uint64_t value;
  while (read(fd_.get(), &value, sizeof(value)) == sizeof(value)) {
  }
}

Status Doorbell::Wait(Deadline deadline) {
  for (;;) {
    uint64_t value;
    if (read(fd_.get(), &value, sizeof(value)) == sizeof(value)) return Status::Ok();
    if (errno != EAGAIN && errno != EINTR) return ErrnoStatus("read doorbell", errno);
    pollfd p{fd_.get(), POLLIN, 0};
    const int rc = poll(&p, 1, deadline.RemainingPollMs());
    if (rc == 0) return Status::DeadlineExceeded("timed out waiting for the doorbell");
    if (rc < 0 && errno != EINTR) return ErrnoStatus("poll doorbell", errno);
  }
}

}  // namespace orbitkv::channel
