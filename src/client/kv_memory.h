// Engine KV memory the Manager may map: a memfd sealed against shrinking and growing.
//
// The Manager maps an engine's shared-memory KV buffers and copies to and from them on its own
// threads. Were the engine to shrink such a file (ftruncate) while a copy runs, the Manager would
// fault (SIGBUS) and every engine on the host would lose its cache; so the Manager only accepts
// memfds sealed with F_SEAL_SHRINK and F_SEAL_GROW, and refuses others with an error naming the
// fix. This is how to make one in C++ (Python: orbitkv.shm).
#ifndef ORBITKV_CLIENT_KV_MEMORY_H_
#define ORBITKV_CLIENT_KV_MEMORY_H_

#include <cstdint>
#include <string>

#include "base/result.h"
#include "base/scoped_fd.h"

namespace orbitkv::client {

// A memfd of `bytes` bytes (rounded up to 4 KiB), zero-filled, sealed against shrinking and
// growing: map it MAP_SHARED and register its fd with CacheClient::RegisterGroup.
Result<ScopedFd> CreateKvMemory(const std::string& name, uint64_t bytes);

}  // namespace orbitkv::client

#endif  // ORBITKV_CLIENT_KV_MEMORY_H_
