// Test-only: runs a real orbitkv-manager process on a private socket and stops it.
#ifndef ORBITKV_TESTS_INTEGRATION_MANAGER_PROCESS_H_
#define ORBITKV_TESTS_INTEGRATION_MANAGER_PROCESS_H_

#include <fmt/format.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "channel/session.h"
#include "channel/uds.h"

namespace orbitkv::testing {

class ManagerProcess {
 public:
  // Starts the Manager with `extra` flags on a fresh socket; waits until it accepts connections.
  explicit ManagerProcess(std::vector<std::string> extra = {}, std::string tag = "m") {
    dir_ = fmt::format("/tmp/orbitkv-it-{}-{}-{}", getpid(), tag, counter_++);
    std::filesystem::create_directories(dir_);
    socket_ = dir_ + "/manager.sock";
    log_ = dir_ + "/manager.log";
    std::vector<std::string> args = {
        ORBITKV_MANAGER_BIN, "--socket", socket_,       "--dram", "64MiB", "--slab", "4MiB",
        "--log-file",        log_,       "--log-level", "debug"};
    args.insert(args.end(), extra.begin(), extra.end());
    pid_ = fork();
    if (pid_ == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive a crashed parent
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
    // Ready means a session was welcomed: the socket exists from Create on, but only a started
    // dispatcher answers Hello (a Manager that fails to join its cluster exits before that).
    for (int i = 0; i < 3000; ++i) {
      channel::ConnectOptions options;
      options.deadline = Deadline::After(std::chrono::milliseconds(200));
      if (auto session = channel::ClientSession::Connect(socket_, options); session.ok()) return;
      int status;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  ~ManagerProcess() {
    Stop(SIGKILL);
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  bool running() const { return pid_ > 0; }
  const std::string& socket() const { return socket_; }
  const std::string& log() const { return log_; }
  // The Manager's log so far (for failure messages).
  std::string LogText() const {
    std::ifstream in(log_);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  pid_t pid() const { return pid_; }

  // Sends `signal` and reaps the process; returns its wait status (-1 if it was not running).
  int Stop(int signal = SIGTERM) {
    if (pid_ <= 0) return -1;
    kill(pid_, signal);
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    return status;
  }

 private:
  static inline int counter_ = 0;
  std::string dir_, socket_, log_;
  pid_t pid_ = -1;
};

}  // namespace orbitkv::testing

#endif  // ORBITKV_TESTS_INTEGRATION_MANAGER_PROCESS_H_
