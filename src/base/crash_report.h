// Crash reports: a process that dies of a fatal signal (SIGSEGV, SIGILL, SIGFPE, SIGABRT) or of std::terminate
// (an uncaught exception, "pure virtual method called") writes what happened and its stack to stderr, then dies as
// it would have (the signal re-raised with its default action), so the operator's log or a CI run shows where.
//
// Not installed under AddressSanitizer or ThreadSanitizer: their own reports are better.
//
// Thread safety: call once, early, before threads start.
#ifndef ORBITKV_BASE_CRASH_REPORT_H_
#define ORBITKV_BASE_CRASH_REPORT_H_

namespace orbitkv {

// `program` names the process in the report (e.g. "orbitkv-manager"); it must outlive the process.
void InstallCrashReport(const char* program);

}  // namespace orbitkv

#endif  // ORBITKV_BASE_CRASH_REPORT_H_
