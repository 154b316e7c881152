// Test-only helpers shared by the transfer tests, the peer helper and the benchmark: byte patterns
// that make every landed byte checkable, a child process with line-based stdin/stdout, a
// network-namespace pair joined by a veth link, and a waiter for batch completions.
//
// Thread safety: BatchWaiter is safe from any thread; the others belong to the thread that created
// them.
#ifndef ORBITKV_TRANSFER_TEST_UTIL_H_
#define ORBITKV_TRANSFER_TEST_UTIL_H_

#include <sys/types.h>

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "base/clock.h"
#include "base/mutex.h"
#include "base/result.h"
#include "base/scoped_fd.h"
#include "transfer/transfer_engine.h"

namespace orbitkv::transfer::testing {

// The byte at `offset` of a region filled with `seed`; any 8-byte-aligned window is distinct per
// offset.
uint8_t PatternByte(uint64_t seed, uint64_t offset);
void FillPattern(uint8_t* data, size_t length, uint64_t seed);
// The first offset in [0, length) whose byte differs from the pattern at region offset base + i, or
// -1.
int64_t FindPatternMismatch(const uint8_t* data, size_t length, uint64_t seed, uint64_t base);

// Anonymous, populated memory for regions; unmapped on destruction.
class TestBuffer {
 public:
  explicit TestBuffer(size_t length);
  ~TestBuffer();
  TestBuffer(const TestBuffer&) = delete;
  TestBuffer& operator=(const TestBuffer&) = delete;
  uint8_t* data() const { return data_; }
  size_t size() const { return length_; }

 private:
  uint8_t* data_ = nullptr;
  size_t length_ = 0;
};

// A spawned process whose stdin and stdout are pipes. The destructor SIGKILLs and reaps it if still
// running.
class ChildProcess {
 public:
  static Result<std::unique_ptr<ChildProcess>> Spawn(const std::vector<std::string>& argv);
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  // The next line of stdout without its newline; DeadlineExceeded or Unavailable (EOF) otherwise.
  Result<std::string> ReadLine(Deadline deadline);
  Status WriteLine(std::string_view line);
  void Signal(int signal);
  // Waits for exit; returns the raw waitpid status.
  int Wait();
  pid_t pid() const { return pid_; }

 private:
  ChildProcess() = default;
  pid_t pid_ = -1;
  bool reaped_ = false;
  ScopedFd stdin_;
  ScopedFd stdout_;
  std::string buffer_;
};

// Two network namespaces joined by a veth pair: "a" at 10.77.0.1/24 and "b" at 10.77.0.2/24, named
// after the creating process so concurrent test processes do not collide. The destructor leaves
// namespace "a" if this thread entered it, deletes both namespaces (the veth goes with them) and
// never fails loudly.
class NetnsPair {
 public:
  // FailedPrecondition when not root or `ip` is missing (tests skip then).
  static Result<std::unique_ptr<NetnsPair>> Create();
  ~NetnsPair();
  NetnsPair(const NetnsPair&) = delete;
  NetnsPair& operator=(const NetnsPair&) = delete;

  const std::string& name_a() const { return name_a_; }
  const std::string& name_b() const { return name_b_; }
  const std::string& veth_a() const { return veth_a_; }
  const std::string& veth_b() const { return veth_b_; }
  static constexpr const char* kAddressA = "10.77.0.1";
  static constexpr const char* kAddressB = "10.77.0.2";

  // Moves the calling thread into namespace "a" (threads it creates afterwards inherit it), with a
  // private mount namespace whose /sys shows namespace "a" (UCX reads devices there). The process
  // must have no other threads at that point.
  Status EnterA();
  // argv prefixed with `ip netns exec <ns>`.
  std::vector<std::string> InB(std::vector<std::string> argv) const;
  // Runs a shell command inside namespace `ns`; Internal with the exit code on failure.
  static Status RunIn(const std::string& ns, const std::string& command);

 private:
  NetnsPair() = default;
  std::string name_a_;
  std::string name_b_;
  std::string veth_a_;
  std::string veth_b_;
  ScopedFd original_ns_;
  ScopedFd original_mnt_;
  bool entered_ = false;
  bool mounted_ = false;
};

Status RunCommand(const std::string& command);

// Collects one BatchResult; Wait blocks until it arrives or the deadline passes.
class BatchWaiter {
 public:
  BatchCallback Callback();
  std::optional<BatchResult> Wait(Deadline deadline);
  bool done() const;

 private:
  mutable Mutex mu_;
  std::condition_variable_any cv_;
  std::optional<BatchResult> result_ GUARDED_BY(mu_);
  int calls_ GUARDED_BY(mu_) = 0;
};

}  // namespace orbitkv::transfer::testing

#endif  // ORBITKV_TRANSFER_TEST_UTIL_H_
