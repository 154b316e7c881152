#include "base/fault_guard.h"

#include <setjmp.h>
#include <signal.h>

#include <atomic>
#include <cstring>
#include <mutex>

namespace orbitkv {
namespace {

struct Armed {
  sigjmp_buf* jump = nullptr;
  uintptr_t lo = 0;
  uintptr_t hi = 0;
};
thread_local Armed t_armed;

struct sigaction g_previous {};
std::atomic<uint64_t> g_recovered{0};
std::once_flag g_installed;

void OnSigbus(int sig, siginfo_t* info, void* context) {
  Armed& armed = t_armed;
  const auto address = reinterpret_cast<uintptr_t>(info->si_addr);
  if (armed.jump != nullptr && address >= armed.lo && address < armed.hi) {
    sigjmp_buf* jump = armed.jump;
    armed.jump = nullptr;
    siglongjmp(*jump, 1);
  }
  // Not a guarded copy's fault: what would have happened without us.
  if (g_previous.sa_flags & SA_SIGINFO) {
    if (g_previous.sa_sigaction != nullptr) return g_previous.sa_sigaction(sig, info, context);
  } else if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
    return g_previous.sa_handler(sig);
  }
  // Default: reset and return, so the faulting instruction runs again and the process dies of it.
  signal(SIGBUS, SIG_DFL);
}

}  // namespace

void FaultGuard::Install() {
  std::call_once(g_installed, [] {
    struct sigaction action {};
    action.sa_sigaction = OnSigbus;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    sigaction(SIGBUS, &action, &g_previous);
  });
}

bool FaultGuard::GuardedCopy(void* dst, const void* src, size_t n, const void* foreign, size_t foreign_bytes,
                             CopyStores stores) {
  sigjmp_buf jump;
  // savemask 0: no sigprocmask call on the fast path; the rare recovery unblocks SIGBUS itself.
  if (sigsetjmp(jump, 0) != 0) {
    sigset_t bus;
    sigemptyset(&bus);
    sigaddset(&bus, SIGBUS);
    pthread_sigmask(SIG_UNBLOCK, &bus, nullptr);
    StreamCopyFence();  // what was streamed before the fault is ordered before the caller's next step
    g_recovered.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  Armed& armed = t_armed;
  armed.lo = reinterpret_cast<uintptr_t>(foreign);
  armed.hi = armed.lo + foreign_bytes;
  // The handler runs on this thread: a compiler fence orders the arming before the copy.
  std::atomic_signal_fence(std::memory_order_seq_cst);
  armed.jump = &jump;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  CopyBytes(dst, src, n, stores);
  std::atomic_signal_fence(std::memory_order_seq_cst);
  armed.jump = nullptr;
  return true;
}

uint64_t FaultGuard::recovered() { return g_recovered.load(std::memory_order_relaxed); }

}  // namespace orbitkv
