// Starts the UCX transfer engine of a distributed Manager: it serves the pool's arenas to peers, only inside grants
// (docs/transfer.md), with descriptors that name this start, on the first free port of --transfer-listen.
//
// Thread safety: a function; the engine it returns is thread-safe.
#ifndef ORBITKV_SERVER_DISTRIBUTED_TRANSFER_START_H_
#define ORBITKV_SERVER_DISTRIBUTED_TRANSFER_START_H_

#include <memory>
#include <vector>

#include "base/metrics.h"
#include "base/result.h"
#include "base/runtime_id.h"
#include "core/slab_pool.h"
#include "server/config.h"
#include "transfer/ucx_engine.h"

namespace orbitkv::server {

// The engine, with every pool arena registered: `regions` gets the transfer region of each arena, in arena order.
// Unavailable when no port of --transfer-listen is free; other errors name the flags to check.
Result<std::unique_ptr<transfer::UcxTransferEngine>> StartTransferEngine(const ManagerConfig& config,
                                                                         const RuntimeId& runtime,
                                                                         core::PinnedPool& pool,
                                                                         std::vector<transfer::RegionHandle>* regions,
                                                                         MetricsRegistry* metrics);

}  // namespace orbitkv::server

#endif  // ORBITKV_SERVER_DISTRIBUTED_TRANSFER_START_H_
