// Crash reports: a process that dies of a fatal signal (SIGSEGV, SIGILL, SIGFPE, SIGABRT) or of std::terminate
// (an uncaught exception, "pure virtual method called") writes what happened and its stack to stderr, then dies as
// it would have (the signal re-raised with its default action), so the operator's log or a CI run shows where.
//
// Under AddressSanitizer or ThreadSanitizer only the terminate report is installed: the sanitizers report fatal
// signals themselves, better.
//
// Thread safety: call once, early, before threads start.
#ifndef ORBITKV_BASE_CRASH_REPORT_H_
#define ORBITKV_BASE_CRASH_REPORT_H_

namespace orbitkv {

// `program` names the process in the report (e.g. "orbitkv-manager"); it must outlive the process.
void InstallCrashReport(const char* program);

// Whether this build's sanitizer reports fatal signals (then InstallCrashReport leaves them to it).
bool SanitizerReportsSignals();

}  // namespace orbitkv

#endif  // ORBITKV_BASE_CRASH_REPORT_H_
