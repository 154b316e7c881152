// The parts' options from the Manager's flags: what each ManagerConfig field means to the cache
// core, the SSD tier and the cache service.
#ifndef ORBITKV_SERVER_OPTIONS_H_
#define ORBITKV_SERVER_OPTIONS_H_

#include "base/result.h"
#include "core/block_cache.h"
#include "core/ssd_tier.h"
#include "server/cache_service.h"
#include "server/config.h"

namespace orbitkv::server {

core::BlockCacheOptions CacheOptionsFor(const ManagerConfig& config);
// The capacity defaults to 64 GiB and never exceeds 90% of the free space of the file system
// holding --ssd-path (preallocation must not fill the disk). ResourceExhausted naming the space
// when an explicit --ssd-capacity does not fit; InvalidArgument when the directory cannot be made.
Result<core::SsdTierOptions> SsdOptionsFor(const ManagerConfig& config);
CacheServiceOptions ServiceOptionsFor(const ManagerConfig& config);

}  // namespace orbitkv::server

#endif  // ORBITKV_SERVER_OPTIONS_H_
