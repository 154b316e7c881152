// FaultGuard: copy to or from memory another process controls, and survive it vanishing.
//
// The Manager maps engines' shared-memory KV buffers. Sealing them against shrinking (the Manager
// refuses anything else) rules out the common way to pull pages from under a copy, but not every
// way (a hugetlb file whose pages cannot be faulted back, a hole punched in a file system that
// cannot fill it): touching such a page raises SIGBUS, which by default kills the process and every
// engine's cache with it. GuardedCopy is a copy (memcpy, or StreamCopy's non-temporal stores) that
// returns false instead, for faults inside the range it was told is foreign; any other fault still
// takes its normal (fatal) course.
//
// Why this is safe: the handler only acts on a synchronous SIGBUS raised by the guarded memcpy of
// this very thread (a thread-local marks it armed, and the faulting address must lie in the range
// it guards). The copy holds no lock and leaves no state behind, so jumping out of it to the point
// before it started (siglongjmp) abandons only bytes of the copy itself, which the caller then
// treats as failed (a save is not sealed; a restore is reported failed, its pages never counted as
// restored). The signal mask is restored on that path (SIGBUS is blocked while its handler runs).
// Install() chains to the handler that was there before (a sanitizer's, say) for faults it does not
// own.
//
// Thread safety: Install() once per process, before the threads that copy; GuardedCopy from any
// thread.
#ifndef ORBITKV_BASE_FAULT_GUARD_H_
#define ORBITKV_BASE_FAULT_GUARD_H_

#include <cstddef>
#include <cstdint>

#include "base/stream_copy.h"

namespace orbitkv {

class FaultGuard {
 public:
  // Installs the SIGBUS handler (idempotent).
  static void Install();
  // CopyBytes(dst, src, n, stores); false when a SIGBUS hit an address in
  // [foreign, foreign + foreign_bytes) meanwhile (the copy is then partial). Install() must have run.
  static bool GuardedCopy(void* dst, const void* src, size_t n, const void* foreign, size_t foreign_bytes,
                          CopyStores stores = CopyStores::kCached);
  // SIGBUS faults recovered so far (tests, metrics).
  static uint64_t recovered();
};

}  // namespace orbitkv

#endif  // ORBITKV_BASE_FAULT_GUARD_H_
