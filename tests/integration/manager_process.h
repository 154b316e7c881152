// Test-only: runs a real orbitkv-manager process on a private socket and stops it.
#ifndef ORBITKV_TESTS_INTEGRATION_MANAGER_PROCESS_H_
#define ORBITKV_TESTS_INTEGRATION_MANAGER_PROCESS_H_

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "channel/session.h"
#include "channel/uds.h"

namespace orbitkv::testing {

class ManagerProcess {
 public:
  // Starts the Manager with `extra` flags on a fresh socket; waits until it accepts connections.
  // `launcher` prefixes the command line (e.g. `ip netns exec NS`: the Manager in a network
  // namespace; its socket is a path, reachable from every namespace).
  explicit ManagerProcess(std::vector<std::string> extra = {}, std::string tag = "m",
                          std::vector<std::string> launcher = {}) {
    dir_ = fmt::format("/tmp/orbitkv-it-{}-{}-{}", getpid(), tag, counter_++);
    std::filesystem::create_directories(dir_);
    socket_ = dir_ + "/manager.sock";
    log_ = dir_ + "/manager.log";
    std::vector<std::string> args = {
        ORBITKV_MANAGER_BIN, "--socket", socket_,       "--dram", "64MiB", "--slab", "4MiB",
        "--log-file",        log_,       "--log-level", "debug"};
    args.insert(args.end(), extra.begin(), extra.end());
    args.insert(args.begin(), launcher.begin(), launcher.end());
    args_ = std::move(args);
    Launch();
  }
  ~ManagerProcess() {
    Stop(SIGKILL);
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  // Stops the Manager with `signal` and starts it again with the same flags, socket and log (appended): what an
  // operator's restart does. Returns once the new start accepts sessions (running() false if it did not start).
  void Restart(int signal = SIGTERM) {
    Stop(signal);
    Launch();
  }

 private:
  void Launch() {
    std::vector<std::string> args = args_;
    pid_ = fork();
    if (pid_ == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive a crashed parent
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execvp(argv[0], argv.data());
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

 public:
  bool running() const { return pid_ > 0; }
  const std::string& socket() const { return socket_; }
  const std::string& log() const { return log_; }
  // The Manager's log so far (for failure messages).
  std::string LogText() const {
    std::ifstream in(log_);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  pid_t pid() const { return pid_; }

  // kill -STOP, returning once every thread of the Manager is stopped (the signal is asynchronous: a thread
  // may go on with a request for a moment after kill returns). False if that never happened.
  bool Pause() const {
    if (pid_ <= 0 || kill(pid_, SIGSTOP) != 0) return false;
    for (int attempt = 0; attempt < 5000; ++attempt) {
      bool stopped = true;
      std::error_code error;
      for (const auto& task : std::filesystem::directory_iterator(fmt::format("/proc/{}/task", pid_), error)) {
        std::ifstream in(task.path() / "stat");
        std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        const size_t paren = stat.rfind(')');  // the state follows the command name, which may hold spaces
        if (paren == std::string::npos || paren + 2 >= stat.size() ||
            (stat[paren + 2] != 'T' && stat[paren + 2] != 't')) {
          stopped = false;
          break;
        }
      }
      if (stopped && !error) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return false;
  }

  // Sends `signal` and reaps the process; returns its wait status (-1 if it was not running).
  int Stop(int signal = SIGTERM) {
    if (pid_ <= 0) return -1;
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      // It had died before anyone stopped it: say how, with its log's end and its stderr's crash report, so a
      // failure elsewhere in the test is not the only trace.
      const std::string log = LogText();
      const size_t from = log.size() > 6000 ? log.size() - 6000 : 0;
      fmt::print(stderr, "ManagerProcess {}: the Manager had exited on its own ({} {}); its log ends:\n{}\n", dir_,
                 WIFSIGNALED(status) ? "signal" : "status",
                 WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status), log.substr(from));
      pid_ = -1;
      return status;
    }
    kill(pid_, signal);
    waitpid(pid_, &status, 0);
    pid_ = -1;
    return status;
  }

 private:
  static inline int counter_ = 0;
  std::string dir_, socket_, log_;
  std::vector<std::string> args_;
  pid_t pid_ = -1;
};

// A TCP port free on 127.0.0.1 right now (bound to 0, read back, released): for --metrics-addr.
inline uint16_t FreeLoopbackPort() {
  // Below the kernel's ephemeral range (ip_local_port_range, 32768-60999 by default): a port handed out to some
  // process's outgoing connection or "any port" listener between this check and the Manager's bind would make the
  // Manager fail with "address in use"; only an explicit bind can take one of these. Random, so that two tests
  // running at once rarely try the same one.
  static std::mt19937 random(std::random_device{}() ^ static_cast<unsigned>(getpid()));
  for (int attempt = 0; attempt < 200; ++attempt) {
    const uint16_t port = static_cast<uint16_t>(20000 + random() % 12000);
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(port);
    const bool bound = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    close(fd);
    if (bound) return port;
  }
  return 0;
}

// GET /metrics from a Manager's metrics endpoint on `host`:`port` (127.0.0.1 by default; "" when it does not
// answer).
inline std::string MetricsText(uint16_t port, const char* host = "127.0.0.1") {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  inet_pton(AF_INET, host, &addr.sin_addr);
  std::string text;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string request = "GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n";
    (void)!write(fd, request.data(), request.size());
    char buf[4096];
    for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) text.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  return text;
}

}  // namespace orbitkv::testing

#endif  // ORBITKV_TESTS_INTEGRATION_MANAGER_PROCESS_H_
