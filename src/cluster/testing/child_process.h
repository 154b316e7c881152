// ChildProcess (test-only): a process the test started, killed and reaped by its PID when the owner
// goes away.
//
// The child gets PR_SET_PDEATHSIG(SIGKILL), so it dies with the test even if the test crashes.
// Output goes to a file (for etcd's log) or to a pipe the test reads line by line (for the member
// helper), and stdin can be a pipe whose closing asks the child to exit cleanly.
//
// Thread safety: one owner thread.
#ifndef ORBITKV_CLUSTER_TESTING_CHILD_PROCESS_H_
#define ORBITKV_CLUSTER_TESTING_CHILD_PROCESS_H_

#include <sys/types.h>

#include <string>
#include <string_view>
#include <vector>

#include "base/clock.h"
#include "base/result.h"
#include "base/scoped_fd.h"

namespace orbitkv::cluster::testing {

// Runs `shell` through /bin/sh with stderr joined to stdout; its output, or Internal naming `what` and carrying the
// output when it exits non-zero.
Result<std::string> RunShell(const std::string& shell, std::string_view what);

class ChildProcess {
 public:
  struct Options {
    std::vector<std::string> argv;
    // Append stdout and stderr here; empty with pipe_stdio false inherits the test's.
    std::string output_path;
    // stdin and stdout are pipes to the test (stderr still goes to output_path or the test's).
    bool pipe_stdio = false;
  };

  static Result<ChildProcess> Spawn(const Options& options);

  ChildProcess() = default;
  ChildProcess(ChildProcess&& other) noexcept;
  ChildProcess& operator=(ChildProcess&& other) noexcept;
  ~ChildProcess() { Kill(); }

  pid_t pid() const { return pid_; }
  bool running() const { return pid_ > 0; }
  // Sends `sig` without waiting.
  Status Signal(int sig);
  // Waits for the child to exit; returns its wait status. Kills it with SIGKILL when `deadline`
  // passes first.
  Result<int> Wait(Deadline deadline);
  // SIGKILL and reap; no-op when not running.
  void Kill();

  // One line from the child's stdout (without '\n'); DeadlineExceeded or Unavailable (EOF)
  // otherwise.
  Result<std::string> ReadLine(Deadline deadline);
  void CloseStdin() { stdin_.Reset(); }

 private:
  pid_t pid_ = -1;
  ScopedFd stdin_;
  ScopedFd stdout_;
  std::string buffered_;
};

}  // namespace orbitkv::cluster::testing

#endif  // ORBITKV_CLUSTER_TESTING_CHILD_PROCESS_H_
