// StreamCopy: memcpy whose stores bypass the caches, for copies whose destination is not read again
// soon.
//
// A save copies an engine's pages into pool memory that is next read by a restore or an SSD write,
// long after; with ordinary stores every destination line is first read into the cache (a
// read-for-ownership) and later written back, three memory transfers per line instead of two, and
// the copy evicts whatever the cache held. glibc's memcpy switches to non-temporal stores only for
// copies of several MiB, while a save is thousands of 16-64 KiB fragments: measured on the 2-core
// VM, 16 KiB fragments scattered over 128 MiB copy at 4.3 GB/s with memcpy and 7.9 GB/s streamed.
//
// On x86-64 the body goes through SSE2 non-temporal stores (part of the x86-64 baseline) after an
// ordinary copy of the head up to 16-byte alignment; the tail and copies under kStreamCopyMinBytes
// use memcpy. An sfence at the end makes the streamed stores globally visible before the caller
// publishes the copy (a release store or a lock that another thread acquires). Elsewhere
// StreamCopy is memcpy.
//
// Thread safety: none needed (a function of its arguments).
#ifndef ORBITKV_BASE_STREAM_COPY_H_
#define ORBITKV_BASE_STREAM_COPY_H_

#include <cstddef>

namespace orbitkv {

// How a copy writes its destination.
enum class CopyStores {
  kCached,     // memcpy: the destination is read soon
  kStreaming,  // non-temporal stores: it is not
};

// Below this, streaming gains nothing: memcpy.
inline constexpr size_t kStreamCopyMinBytes = 1024;

void StreamCopy(void* dst, const void* src, size_t n);

// Both forms behind one call (the copy engines pick per batch).
void CopyBytes(void* dst, const void* src, size_t n, CopyStores stores);

// Makes streamed stores visible (sfence on x86-64); for a copy abandoned part way.
void StreamCopyFence();

}  // namespace orbitkv

#endif  // ORBITKV_BASE_STREAM_COPY_H_
