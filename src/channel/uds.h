// Unix-socket plumbing of the channel: listening and connecting SOCK_SEQPACKET sockets, peer
// credentials, framed messages with file descriptors (SCM_RIGHTS), and eventfd doorbells.
//
// Received descriptors are wrapped in ScopedFd the moment they arrive, so a malformed or rejected
// frame never leaks one. Every receive validates the frame header (magic, version, type, exact
// length) and reports truncated data or control messages as InvalidArgument. A closed peer is
// Unavailable.
//
// Thread safety: free functions; a socket is used by one thread at a time.
#ifndef ORBITKV_CHANNEL_UDS_H_
#define ORBITKV_CHANNEL_UDS_H_

#include <sys/types.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "base/clock.h"
#include "base/result.h"
#include "base/scoped_fd.h"
#include "channel/wire.h"

namespace orbitkv::channel {

struct Frame {
  FrameHeader header{};
  std::vector<uint8_t> body;
  std::vector<ScopedFd> fds;
  FrameType type() const { return static_cast<FrameType>(header.type); }
};

struct PeerCredentials {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
};

// Where a Manager listens unless told otherwise: `$ORBITKV_SOCKET` when set (a system service's
// /run/orbitkv/manager.sock: set it for the service's engines), else
// `$XDG_RUNTIME_DIR/orbitkv/manager.sock` when XDG_RUNTIME_DIR is set, else
// `/tmp/orbitkv-<uid>/manager.sock`. Engines and the Manager agree on it without configuration.
std::string DefaultManagerSocketPath();

// Binds and listens on `path` with `mode` (0600: only this uid; 0666 when other uids are admitted
// by SO_PEERCRED), creating its directory if missing (0700, or 0755 for a shared socket). A stale
// socket file left by a dead Manager is replaced; a live one (something accepts connections) is
// AlreadyExists.
Result<ScopedFd> ListenUnix(const std::string& path, mode_t mode = 0600, int backlog = 64);
// Connects to `path`; Unavailable (with the path and the reason) when no Manager listens there.
Result<ScopedFd> ConnectUnix(const std::string& path);
Result<PeerCredentials> GetPeerCredentials(int fd);

// Sends one frame; the fds are duplicated into the receiver (the caller keeps its own).
Status SendFrame(int fd, FrameType type, uint64_t request_id, std::span<const uint8_t> body,
                 std::span<const int> fds = {});
// Receives one frame, waiting until `deadline`. DeadlineExceeded, Unavailable (peer closed),
// InvalidArgument (malformed), or the frame.
Result<Frame> RecvFrame(int fd, Deadline deadline);

// An eventfd used as a doorbell between processes.
class Doorbell {
 public:
  static Result<Doorbell> Create();
  explicit Doorbell(ScopedFd fd) : fd_(std::move(fd)) {}
  Doorbell(Doorbell&&) noexcept = default;
  Doorbell& operator=(Doorbell&&) noexcept = default;

  const ScopedFd& fd() const { return fd_; }
  // Wakes the other side. Never blocks.
  Status Ring();
  // Waits for a ring or the deadline (DeadlineExceeded), consuming pending rings.
  Status Wait(Deadline deadline);
  // Consumes pending rings without waiting.
  void Drain();

 private:
  ScopedFd fd_;
};

// Reads a fixed-size body struct from a frame: InvalidArgument unless the body is exactly (or, with
// `allow_trailing`, at least) sizeof(T).
template <typename T>
Result<T> BodyAs(const Frame& frame, bool allow_trailing = false);

}  // namespace orbitkv::channel

#include "channel/uds_inl.h"

#endif  // ORBITKV_CHANNEL_UDS_H_
