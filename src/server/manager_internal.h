// The Manager's per-session, per-instance and per-group state (manager.cc and operations.cc only).
#ifndef ORBITKV_SERVER_MANAGER_INTERNAL_H_
#define ORBITKV_SERVER_MANAGER_INTERNAL_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "base/mutex.h"
#include "channel/session.h"
#include "channel/wire.h"
#include "core/copy_engine.h"
#include "server/manager.h"

namespace orbitkv::server {

struct Manager::Session {
  uint64_t id = 0;
  // Shared with copy completions, which reply after the dispatcher may have closed the session.
  std::shared_ptr<channel::ServerSession> channel;
  // The control session this one acts for (itself for a control session).
  uint64_t owner_id = 0;
};

// A registered KV group: where page p of each buffer lives (mapped from the engine's shared memory,
// in the engine process, or in its GPU). In-flight copies hold a reference, so the mappings outlive
// the instance until every copy drained; a GPU buffer's IPC mapping is closed by its copy engine's
// UnregisterBuffer, which the cleanup thread calls after the instance retired.
struct Manager::Group {
  struct Buffer {
    uint8_t* base = nullptr;  // shared memory only: the Manager's mapping (unmapped by ~Group)
    uint64_t bytes = 0;
    channel::BufferDescriptor layout{};
    core::BufferId id;
  };
  ~Group();

  uint32_t group = 0;
  uint32_t num_pages = 0;
  channel::BufferKind kind = channel::BufferKind::kSharedMemory;
  // The copy engine its buffers are registered with (CPU for shared and process memory; the CUDA
  // engine for GPU buffers). Owned by the Manager, which outlives every group.
  core::CopyEngine* engine = nullptr;
  uint64_t block_bytes = 0;  // sum of page_bytes over buffers: one block
  uint64_t padded_bytes =
      0;  // block_bytes rounded up to 4 KiB: what a query reservation charges per block
  std::vector<Buffer> buffers;
};

struct Manager::Instance {
  uint64_t id = 0;
  std::array<uint8_t, 32> namespace_digest{};
  uint64_t owner_session = 0;
  // Release/acquire: set before cleanup starts; operations started later see it and refuse.
  std::atomic<bool> retired{false};
  Mutex mu;
  std::map<uint32_t, std::shared_ptr<Group>> groups GUARDED_BY(mu);
};

}  // namespace orbitkv::server

#endif  // ORBITKV_SERVER_MANAGER_INTERNAL_H_
