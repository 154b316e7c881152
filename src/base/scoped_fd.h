// ScopedFd: sole owner of a file descriptor; closes it on destruction. Move-only.
//
// Every OS resource in OrbitKV has a move-only RAII owner (STYLE.md §2); this is the one for plain fds (sockets,
// memfds, eventfds, files). Release() hands ownership back to the caller, e.g. before passing an fd to a
// library that closes it itself.
#ifndef ORBITKV_BASE_SCOPED_FD_H_
#define ORBITKV_BASE_SCOPED_FD_H_

#include <utility>

#include "base/result.h"

namespace orbitkv {

class ScopedFd {
 public:
  ScopedFd() = default;
  explicit ScopedFd(int fd) : fd_(fd) {}
  ScopedFd(ScopedFd&& other) noexcept : fd_(other.Release()) {}
  ScopedFd& operator=(ScopedFd&& other) noexcept {
    if (this != &other) Reset(other.Release());
    return *this;
  }
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  ~ScopedFd() { Reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  explicit operator bool() const { return valid(); }

  // Gives up ownership without closing; returns the fd (or -1).
  [[nodiscard]] int Release() { return std::exchange(fd_, -1); }

  // Closes the current fd (if any) and takes ownership of `fd`. Resetting to the same fd is a broken invariant.
  void Reset(int fd = -1);

  // dup(2) with O_CLOEXEC; the new fd is owned by the returned object.
  Result<ScopedFd> Duplicate() const;

 private:
  int fd_ = -1;
};

// "open: /x: No such file or directory (errno 2)" as a Status with the code that fits errno.
Status ErrnoStatus(std::string_view what, int err);

}  // namespace orbitkv

#endif  // ORBITKV_BASE_SCOPED_FD_H_
