#include "base/scoped_fd.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "base/check.h"

namespace orbitkv {

void ScopedFd::Reset(int fd) {
  ORBITKV_CHECK_MSG(fd < 0 || fd != fd_, "ScopedFd reset to the fd it already owns ({})", fd);
  if (fd_ >= 0) {
    // close() errors (EINTR/EIO) cannot be acted on; the fd is released either way on Linux.
    ::close(fd_);
  }
  fd_ = fd;
}

Result<ScopedFd> ScopedFd::Duplicate() const {
  if (!valid()) return Status::FailedPrecondition("Duplicate() of an empty ScopedFd");
  int copy = ::fcntl(fd_, F_DUPFD_CLOEXEC, 0);
  if (copy < 0) return ErrnoStatus("dup", errno);
  return ScopedFd(copy);
}

Status ErrnoStatus(std::string_view what, int err) {
  StatusCode code = StatusCode::kInternal;
  switch (err) {
    case ENOENT:
      code = StatusCode::kNotFound;
      break;
    case EEXIST:
      code = StatusCode::kAlreadyExists;
      break;
    case EACCES:
    case EPERM:
      code = StatusCode::kPermissionDenied;
      break;
    case EINVAL:
    case EBADF:
      code = StatusCode::kInvalidArgument;
      break;
    case ENOSPC:
    case ENOMEM:
    case EMFILE:
    case ENFILE:
    case EAGAIN:
      code = StatusCode::kResourceExhausted;
      break;
    case ETIMEDOUT:
      code = StatusCode::kDeadlineExceeded;
      break;
    case ECONNREFUSED:
    case ECONNRESET:
    case EPIPE:
    case ENOTCONN:
      code = StatusCode::kUnavailable;
      break;
    case EIO:
      code = StatusCode::kDataLoss;
      break;
    case ECANCELED:
      code = StatusCode::kCancelled;
      break;
    default:
      break;
  }
  char buf[128];
  // GNU strerror_r returns the message pointer (possibly not buf).
  const char* text = ::strerror_r(err, buf, sizeof(buf));
  return Status(code, std::string(what) + ": " + text + " (errno " + std::to_string(err) + ")");
}

}  // namespace orbitkv
