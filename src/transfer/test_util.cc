#include "transfer/test_util.h"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "base/check.h"

namespace orbitkv::transfer::testing {

namespace {

uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

uint8_t PatternByte(uint64_t seed, uint64_t offset) {
  uint64_t word = Mix(seed * 0x100000001b3ull ^ (offset >> 3));
  return static_cast<uint8_t>(word >> (8 * (offset & 7)));
}

void FillPattern(uint8_t* data, size_t length, uint64_t seed) {
  size_t i = 0;
  for (; i + 8 <= length; i += 8) {
    uint64_t word = Mix(seed * 0x100000001b3ull ^ (i >> 3));
    std::memcpy(data + i, &word, 8);
  }
  for (; i < length; ++i) data[i] = PatternByte(seed, i);
}

int64_t FindPatternMismatch(const uint8_t* data, size_t length, uint64_t seed, uint64_t base) {
  for (size_t i = 0; i < length; ++i) {
    if (data[i] != PatternByte(seed, base + i)) return static_cast<int64_t>(i);
  }
  return -1;
}

TestBuffer::TestBuffer(size_t length) : length_(length) {
  void* p = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  ORBITKV_CHECK_MSG(p != MAP_FAILED, "mmap {} bytes: {}", length, std::strerror(errno));
  data_ = static_cast<uint8_t*>(p);
}

TestBuffer::~TestBuffer() { munmap(data_, length_); }

Result<std::unique_ptr<ChildProcess>> ChildProcess::Spawn(const std::vector<std::string>& argv) {
  int in[2];
  int out[2];
  if (pipe2(in, O_CLOEXEC) != 0) return ErrnoStatus("pipe2", errno);
  if (pipe2(out, O_CLOEXEC) != 0) {
    close(in[0]);
    close(in[1]);
    return ErrnoStatus("pipe2", errno);
  }
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = fork();
  if (pid < 0) return ErrnoStatus("fork", errno);
  if (pid == 0) {
    dup2(in[0], STDIN_FILENO);
    dup2(out[1], STDOUT_FILENO);
    execvp(args[0], args.data());
    _exit(127);
  }
  close(in[0]);
  close(out[1]);
  std::unique_ptr<ChildProcess> child(new ChildProcess());
  child->pid_ = pid;
  child->stdin_.Reset(in[1]);
  child->stdout_.Reset(out[0]);
  return child;
}

ChildProcess::~ChildProcess() {
  if (pid_ > 0 && !reaped_) {
    kill(pid_, SIGKILL);
    Wait();
  }
}

Result<std::string> ChildProcess::ReadLine(Deadline deadline) {
  for (;;) {
    size_t newline = buffer_.find('\n');
    if (newline != std::string::npos) {
      std::string line = buffer_.substr(0, newline);
      buffer_.erase(0, newline + 1);
      return line;
    }
    pollfd fd{stdout_.get(), POLLIN, 0};
    int n = poll(&fd, 1, deadline.RemainingPollMs());
    if (n < 0 && errno == EINTR) continue;
    if (n == 0) return Status::DeadlineExceeded("no line from the child process in time");
    char chunk[4096];
    ssize_t got = read(stdout_.get(), chunk, sizeof(chunk));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return Status::Unavailable("the child process closed its stdout");
    buffer_.append(chunk, static_cast<size_t>(got));
  }
}

Status ChildProcess::WriteLine(std::string_view line) {
  std::string text = std::string(line) + "\n";
  if (write(stdin_.get(), text.data(), text.size()) != static_cast<ssize_t>(text.size())) {
    return ErrnoStatus("write to child", errno);
  }
  return Status::Ok();
}

void ChildProcess::Signal(int signal) {
  if (pid_ > 0 && !reaped_) kill(pid_, signal);
}

int ChildProcess::Wait() {
  int status = 0;
  while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
  }
  reaped_ = true;
  return status;
}

Status RunCommand(const std::string& command) {
  int rc = std::system(command.c_str());
  if (rc != 0) return Status::Internal(fmt::format("'{}' exited with {}", command, rc));
  return Status::Ok();
}

Result<std::unique_ptr<NetnsPair>> NetnsPair::Create() {
  if (geteuid() != 0) return Status::FailedPrecondition("network namespaces need root");
  if (std::system("ip -V >/dev/null 2>&1") != 0) return Status::FailedPrecondition("`ip` is not installed");
  std::unique_ptr<NetnsPair> pair(new NetnsPair());
  pair->name_a_ = fmt::format("okvt-a-{}", getpid());
  pair->name_b_ = fmt::format("okvt-b-{}", getpid());
  pair->veth_a_ = fmt::format("okva{}", getpid());
  pair->veth_b_ = fmt::format("okvb{}", getpid());
  const std::string& veth_a = pair->veth_a_;
  const std::string& veth_b = pair->veth_b_;
  const std::string& a = pair->name_a_;
  const std::string& b = pair->name_b_;
  for (const std::string& command : {
           fmt::format("ip netns add {}", a),
           fmt::format("ip netns add {}", b),
           fmt::format("ip link add {} netns {} type veth peer name {} netns {}", veth_a, a, veth_b, b),
           fmt::format("ip -n {} addr add {}/24 dev {}", a, kAddressA, veth_a),
           fmt::format("ip -n {} addr add {}/24 dev {}", b, kAddressB, veth_b),
           fmt::format("ip -n {} link set {} up", a, veth_a),
           fmt::format("ip -n {} link set {} up", b, veth_b),
           fmt::format("ip -n {} link set lo up", a),
           fmt::format("ip -n {} link set lo up", b),
       }) {
    ORBITKV_RETURN_IF_ERROR(RunCommand(command + " >/dev/null 2>&1"));
  }
  // The veth's carrier comes up asynchronously; UCX ignores devices that are not running yet.
  Deadline deadline = Deadline::After(std::chrono::seconds(30));
  for (;;) {
    bool up = RunCommand(fmt::format("ip -n {} link show dev {} | grep -q 'state UP'", a, veth_a)).ok() &&
              RunCommand(fmt::format("ip -n {} link show dev {} | grep -q 'state UP'", b, veth_b)).ok();
    if (up) break;
    if (deadline.Expired()) return Status::Unavailable("the veth pair did not come up");
    usleep(10000);
  }
  return pair;
}

NetnsPair::~NetnsPair() {
  if (mounted_ && original_mnt_.valid()) setns(original_mnt_.get(), CLONE_NEWNS);
  if (entered_ && original_ns_.valid()) setns(original_ns_.get(), CLONE_NEWNET);
  (void)RunCommand(fmt::format("ip netns delete {} >/dev/null 2>&1", name_a_));
  (void)RunCommand(fmt::format("ip netns delete {} >/dev/null 2>&1", name_b_));
}

Status NetnsPair::EnterA() {
  original_ns_.Reset(open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC));
  if (!original_ns_.valid()) return ErrnoStatus("open /proc/thread-self/ns/net", errno);
  original_mnt_.Reset(open("/proc/thread-self/ns/mnt", O_RDONLY | O_CLOEXEC));
  if (!original_mnt_.valid()) return ErrnoStatus("open /proc/thread-self/ns/mnt", errno);
  ScopedFd target(open(fmt::format("/var/run/netns/{}", name_a_).c_str(), O_RDONLY | O_CLOEXEC));
  if (!target.valid()) return ErrnoStatus("open netns " + name_a_, errno);
  if (setns(target.get(), CLONE_NEWNET) != 0) return ErrnoStatus("setns " + name_a_, errno);
  entered_ = true;
  // What `ip netns exec` does: a private mount namespace with a sysfs of the new network namespace,
  // because UCX lists network devices from /sys/class/net. Needs a single-threaded process
  // (CLONE_FS).
  if (unshare(CLONE_NEWNS) != 0) {
    return ErrnoStatus("unshare(CLONE_NEWNS) (the process must have no other threads yet)", errno);
  }
  mounted_ = true;
  if (mount("none", "/", nullptr, MS_SLAVE | MS_REC, nullptr) != 0) return ErrnoStatus("mount --make-rslave /", errno);
  umount2("/sys", MNT_DETACH);
  if (mount(name_a_.c_str(), "/sys", "sysfs", 0, nullptr) != 0) return ErrnoStatus("mount sysfs", errno);
  return Status::Ok();
}

std::vector<std::string> NetnsPair::InB(std::vector<std::string> argv) const {
  std::vector<std::string> full = {"ip", "netns", "exec", name_b_};
  full.insert(full.end(), argv.begin(), argv.end());
  return full;
}

Status NetnsPair::RunIn(const std::string& ns, const std::string& command) {
  return RunCommand(fmt::format("ip netns exec {} {}", ns, command));
}

BatchCallback BatchWaiter::Callback() {
  return [this](const BatchResult& result) {
    // Notified under the lock: the waiter may destroy this object as soon as it can take mu_.
    MutexLock lock(&mu_);
    calls_ += 1;
    ORBITKV_CHECK_MSG(calls_ == 1, "batch {} completed {} times", result.batch_id, calls_);
    result_ = result;
    cv_.notify_all();
  };
}

std::optional<BatchResult> BatchWaiter::Wait(Deadline deadline) {
  MutexLock lock(&mu_);
  while (!result_) {
    if (cv_.wait_until(mu_, deadline.when()) == std::cv_status::timeout && !result_) return std::nullopt;
  }
  return result_;
}

bool BatchWaiter::done() const {
  MutexLock lock(&mu_);
  return result_.has_value();
}

}  // namespace orbitkv::transfer::testing
