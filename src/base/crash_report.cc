#include "base/crash_report.h"

#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include <cstdlib>
#include <exception>
#include <initializer_list>

namespace orbitkv {
namespace {

const char* g_program = "orbitkv";

void Write(const char* text) {
  if (text == nullptr) return;
  ssize_t ignored = ::write(STDERR_FILENO, text, strlen(text));
  (void)ignored;
}

// Only async-signal-safe calls, plus backtrace (its library is loaded at install time).
void WriteStack() {
  void* frames[64];
  const int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, STDERR_FILENO);
}

void OnFatalSignal(int signal) {
  Write(g_program);
  Write(": fatal signal ");
  Write(strsignal(signal));
  Write("; stack:\n");
  WriteStack();
  // SA_RESETHAND restored the default action: dying of the same signal keeps the exit status (and a core dump).
  raise(signal);
}

[[noreturn]] void OnTerminate() {
  Write(g_program);
  Write(": terminate (an uncaught exception, or a pure virtual call); stack:\n");
  WriteStack();
  signal(SIGABRT, SIG_DFL);  // this report is enough: abort's own signal does not write another
  std::abort();
}

}  // namespace

bool SanitizerReportsSignals() {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  return true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
  return true;
#else
  return false;
#endif
#else
  return false;
#endif
}

void InstallCrashReport(const char* program) {
  g_program = program;
  void* warm[1];
  (void)backtrace(warm, 1);         // loads libgcc's unwinder now, not inside a signal handler
  std::set_terminate(OnTerminate);  // no sanitizer reports a terminate: installed in every build
  if (SanitizerReportsSignals()) return;
  struct sigaction action;
  memset(&action, 0, sizeof(action));
  action.sa_handler = OnFatalSignal;
  action.sa_flags = SA_RESETHAND;
  sigemptyset(&action.sa_mask);
  for (int signal : {SIGSEGV, SIGILL, SIGFPE, SIGABRT}) sigaction(signal, &action, nullptr);
}

}  // namespace orbitkv
