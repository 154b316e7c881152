#include "cluster/testing/child_process.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <utility>

namespace orbitkv::cluster::testing {

Result<std::string> RunShell(const std::string& shell, std::string_view what) {
  std::FILE* pipe = ::popen(("(" + shell + ") 2>&1").c_str(), "r");
  if (pipe == nullptr) return Status::Internal(fmt::format("popen for {} failed", what));
  std::string out;
  char buffer[4096];
  for (size_t n; (n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0;) out.append(buffer, n);
  if (::pclose(pipe) != 0) return Status::Internal(fmt::format("{} failed: {}", what, out));
  return out;
}

Result<ChildProcess> ChildProcess::Spawn(const Options& options) {
  std::vector<char*> argv;
  for (const std::string& arg : options.argv) argv.push_back(const_cast<char*>(arg.c_str()));
  argv.push_back(nullptr);
  int in_pipe[2] = {-1, -1};
  int out_pipe[2] = {-1, -1};
  if (options.pipe_stdio && (pipe2(in_pipe, O_CLOEXEC) != 0 || pipe2(out_pipe, O_CLOEXEC) != 0)) {
    return ErrnoStatus("pipe2", errno);
  }
  ScopedFd in_read(in_pipe[0]), in_write(in_pipe[1]), out_read(out_pipe[0]), out_write(out_pipe[1]);
  ScopedFd log;
  if (!options.output_path.empty()) {
    log.Reset(open(options.output_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644));
    if (!log) return ErrnoStatus("open " + options.output_path, errno);
  }
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) return ErrnoStatus("fork", errno);
  if (pid == 0) {
    // Child: only async-signal-safe calls until exec.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);
    if (options.pipe_stdio) {
      dup2(in_read.get(), STDIN_FILENO);
      dup2(out_write.get(), STDOUT_FILENO);
    } else if (log) {
      dup2(log.get(), STDOUT_FILENO);
    }
    if (log) dup2(log.get(), STDERR_FILENO);
    execv(argv[0], argv.data());
    _exit(127);
  }
  ChildProcess child;
  child.pid_ = pid;
  if (options.pipe_stdio) {
    child.stdin_ = std::move(in_write);
    child.stdout_ = std::move(out_read);
  }
  return child;
}

ChildProcess::ChildProcess(ChildProcess&& other) noexcept
    : pid_(std::exchange(other.pid_, -1)),
      stdin_(std::move(other.stdin_)),
      stdout_(std::move(other.stdout_)),
      buffered_(std::move(other.buffered_)) {}

ChildProcess& ChildProcess::operator=(ChildProcess&& other) noexcept {
  if (this != &other) {
    Kill();
    pid_ = std::exchange(other.pid_, -1);
    stdin_ = std::move(other.stdin_);
    stdout_ = std::move(other.stdout_);
    buffered_ = std::move(other.buffered_);
  }
  return *this;
}

Status ChildProcess::Signal(int sig) {
  if (pid_ <= 0) return Status::FailedPrecondition("process is not running");
  if (kill(pid_, sig) != 0) return ErrnoStatus("kill", errno);
  return Status::Ok();
}

Result<int> ChildProcess::Wait(Deadline deadline) {
  if (pid_ <= 0) return Status::FailedPrecondition("process is not running");
  while (true) {
    int status = 0;
    const pid_t r = waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      pid_ = -1;
      return status;
    }
    if (r < 0 && errno != EINTR) return ErrnoStatus("waitpid", errno);
    if (deadline.Expired()) {
      Kill();
      return Status::DeadlineExceeded("process did not exit in time; killed");
    }
    // No child-exit fd to wait on portably; poll the exit status at a short interval.
    usleep(10'000);
  }
}

void ChildProcess::Kill() {
  if (pid_ <= 0) return;
  kill(pid_, SIGKILL);
  int status = 0;
  while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
  }
  pid_ = -1;
}

Result<std::string> ChildProcess::ReadLine(Deadline deadline) {
  if (!stdout_) return Status::FailedPrecondition("stdout is not a pipe");
  while (true) {
    const size_t newline = buffered_.find('\n');
    if (newline != std::string::npos) {
      std::string line = buffered_.substr(0, newline);
      buffered_.erase(0, newline + 1);
      return line;
    }
    pollfd pfd{stdout_.get(), POLLIN, 0};
    const int ready = poll(&pfd, 1, deadline.RemainingPollMs());
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) return ErrnoStatus("poll", errno);
    if (ready == 0) return Status::DeadlineExceeded("no line from the child process in time");
    char buf[512];
    const ssize_t n = read(stdout_.get(), buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoStatus("read", errno);
    if (n == 0) return Status::Unavailable("child process closed its stdout");
    buffered_.append(buf, static_cast<size_t>(n));
  }
}

}  // namespace orbitkv::cluster::testing
