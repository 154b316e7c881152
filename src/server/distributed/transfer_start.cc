#include "server/distributed/transfer_start.h"

#include "base/logging.h"
#include "fmt/format.h"
#include "server/distributed/node_config.h"

namespace orbitkv::server {

Result<std::unique_ptr<transfer::UcxTransferEngine>> StartTransferEngine(const ManagerConfig& config,
                                                                         const RuntimeId& runtime,
                                                                         core::PinnedPool& pool,
                                                                         std::vector<transfer::RegionHandle>* regions,
                                                                         MetricsRegistry* metrics) {
  ORBITKV_ASSIGN_OR_RETURN(TransferListen listen, ParseTransferListen(config));
  transfer::UcxEngineOptions options;
  options.transports = config.ucx_tls;
  options.net_devices = config.ucx_net_devices;
  options.require_grants = true;
  options.engine_id = runtime.incarnation();
  options.metrics = metrics;
  Status last;
  for (uint32_t port = listen.first_port; port <= listen.last_port; ++port) {
    options.listen_address = fmt::format("{}:{}", listen.host, port);
    Result<std::unique_ptr<transfer::UcxTransferEngine>> engine = transfer::UcxTransferEngine::Create(options);
    if (!engine.ok()) {
      last = engine.status();
      if (last.code() == StatusCode::kUnavailable) continue;  // that port is taken: the next one
      return last.WithContext("starting the UCX transfer engine (--transfer-listen, --ucx-tls, --ucx-net-devices)");
    }
    regions->clear();
    for (size_t i = 0; i < pool.arena_count(); ++i) {
      Result<transfer::RegionHandle> region = (*engine)->RegisterRegion(pool.arena(i).data(), pool.arena(i).size());
      if (!region.ok()) return region.status().WithContext("registering the DRAM pool with UCX");
      regions->push_back(*region);
    }
    ORBITKV_LOG_INFO("manager: UCX transfer engine on {} (transports '{}', devices '{}'; reads only inside grants)",
                     (*engine)->ListenAddress(), config.ucx_tls.empty() ? "UCX default" : config.ucx_tls,
                     config.ucx_net_devices.empty() ? "all" : config.ucx_net_devices);
    return engine;
  }
  return Status::Unavailable(fmt::format("no port of --transfer-listen {}:{}-{} is free ({})", listen.host,
                                         listen.first_port, listen.last_port, last.ToString()));
}

}  // namespace orbitkv::server
