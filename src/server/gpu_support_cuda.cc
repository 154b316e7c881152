// GpuSupport with the gpu module: the CUDA host registry for the pool and the CUDA copy engine.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <span>
#include <string_view>

#include "base/logging.h"
#include "core/pinned_arena.h"
#include "gpu/cuda_copy_engine.h"
#include "gpu/cuda_util.h"
#include "gpu/host_memory_registry.h"
#include "server/gpu_support.h"

namespace orbitkv::server {
namespace {

class CudaSupport final : public GpuSupport {
 public:
  CudaSupport(std::vector<int> devices, std::string description)
      : host_memory_(std::make_unique<gpu::HostMemoryRegistry>()),
        devices_(std::move(devices)),
        description_(std::move(description)) {}
  std::string Describe() const override { return description_; }
  gpu::HostMemoryRegistry* registry() { return host_memory_.get(); }

  Status Start(uint32_t max_inflight, uint64_t restore_staging_bytes, MetricsRegistry* metrics) override {
    gpu::CudaCopyEngine::Options options;
    options.devices = devices_;  // empty: every visible GPU
    options.max_inflight_batches = std::max<uint32_t>(max_inflight, 1);
    options.restore_staging_bytes = restore_staging_bytes;
    Result<std::unique_ptr<gpu::CudaCopyEngine>> cuda =
        gpu::CudaCopyEngine::Create(options, host_memory_.get(), metrics);
    if (!cuda.ok()) return cuda.status().WithContext("starting the CUDA copy engine");
    engine_ = std::move(*cuda);
    return Status::Ok();
  }
  core::CopyEngine* engine() override { return engine_.get(); }

  Result<core::BufferId> RegisterCudaIpc(const channel::CudaIpcBuffer& cuda, uint64_t bytes) override {
    if (engine_ == nullptr) return Status::FailedPrecondition("the CUDA copy engine is not running");
    const size_t bus_id_length = strnlen(cuda.pci_bus_id, sizeof(cuda.pci_bus_id));
    if (bus_id_length == sizeof(cuda.pci_bus_id)) {
      return Status::InvalidArgument("its PCI bus id is not terminated");
    }
    const std::string_view bus_id(cuda.pci_bus_id, bus_id_length);
    ORBITKV_ASSIGN_OR_RETURN(int device, gpu::DeviceByPciBusId(bus_id));
    Result<core::BufferId> id = engine_->RegisterIpcBuffer(
        std::span<const uint8_t>(cuda.ipc_handle, sizeof(cuda.ipc_handle)), device, bytes, cuda.offset);
    if (!id.ok()) {
      return id.status().WithContext(fmt::format("importing {} bytes at offset {} of a CUDA IPC allocation on GPU {}",
                                                 bytes, cuda.offset, bus_id));
    }
    return id;
  }

  Status Unregister(core::BufferId id) override {
    if (engine_ == nullptr) return Status::NotFound("the CUDA copy engine is not running");
    return engine_->UnregisterBuffer(id);
  }
  void Shutdown() override {
    if (engine_) engine_->Shutdown();
  }
  // Closes the IPC mappings still open; the host registry, which unregisters nothing the pool did
  // not, goes with this object, after the pool.
  void CloseEngine() override { engine_.reset(); }

 private:
  // Declared first: destroyed after the engine.
  std::unique_ptr<gpu::HostMemoryRegistry> host_memory_;
  const std::vector<int> devices_;
  const std::string description_;
  std::unique_ptr<gpu::CudaCopyEngine> engine_;
};

// Describes the served GPUs ("0 (0000:00:06.0, NUMA node 0), ...") and, with --numa auto (no nodes
// given), puts the pool's arenas on their NUMA nodes (one per node when the GPUs sit on several),
// so restores and saves cross no socket link; a GPU whose node is unknown or has no memory leaves
// the default (every node with memory).
std::string PlacePoolNearGpus(const std::vector<int>& served, core::PoolOptions* pool) {
  std::vector<int> near;
  std::string description;
  for (const int device : served) {
    Result<std::string> bus = gpu::PciBusIdOf(device);
    Result<int> node = bus.ok() ? core::NumaNodeOfPciDevice(*bus) : Result<int>(-1);
    const int numa = node.ok() ? *node : -1;
    near.push_back(numa);
    description +=
        fmt::format("{}{} ({}, NUMA node {})", description.empty() ? "" : ", ", device,
                    bus.ok() ? *bus : std::string("?"), numa < 0 ? std::string("unknown") : std::to_string(numa));
  }
  std::sort(near.begin(), near.end());
  near.erase(std::unique(near.begin(), near.end()), near.end());
  if (!pool->numa_nodes.empty() || near.empty() || near.front() < 0) return description;
  Result<std::vector<int>> with_memory = core::MemoryNumaNodes();  // ascending
  if (!with_memory.ok() || !std::includes(with_memory->begin(), with_memory->end(), near.begin(), near.end())) {
    return description;
  }
  pool->numa_nodes = near;
  ORBITKV_LOG_INFO("manager: the pool goes to NUMA node(s) {}, where its GPUs are (--numa auto)", fmt::join(near, ","));
  return description;
}

}  // namespace

Result<std::unique_ptr<GpuSupport>> GpuSupport::Detect(core::BlockCacheOptions* options,
                                                       const std::optional<std::vector<int>>& gpus) {
  if (gpus.has_value() && gpus->empty()) {
    ORBITKV_LOG_INFO("manager: --gpus none: serving CPU engines only");
    return std::unique_ptr<GpuSupport>();
  }
  Result<int> devices = gpu::UsableDeviceCount();
  if (!devices.ok() || *devices == 0) {
    if (gpus.has_value()) {
      return Status::FailedPrecondition(
          fmt::format("--gpus names GPUs but none is usable here ({}); check "
                      "CUDA_VISIBLE_DEVICES and the NVIDIA driver, or pass --gpus none",
                      devices.ok() ? "no GPU found" : devices.status().ToString()));
    }
    if (!devices.ok()) {
      ORBITKV_LOG_WARN("manager: CUDA is not usable ({}); serving CPU engines only", devices.status().ToString());
    } else {
      ORBITKV_LOG_INFO("manager: no GPU found; serving CPU engines only");
    }
    return std::unique_ptr<GpuSupport>();
  }
  std::vector<int> chosen = gpus.value_or(std::vector<int>());
  for (const int device : chosen) {
    if (device >= *devices) {
      return Status::InvalidArgument(
          fmt::format("--gpus names GPU {} but {} GPU(s) are visible (ordinals 0-{}, after "
                      "CUDA_VISIBLE_DEVICES)",
                      device, *devices, *devices - 1));
    }
  }
  std::vector<int> served = chosen;
  if (served.empty()) {
    for (int d = 0; d < *devices; ++d) served.push_back(d);
  }
  const std::string description = PlacePoolNearGpus(served, &options->pool);
  auto support = std::make_unique<CudaSupport>(chosen, description);
  options->pool.registrar = support->registry();
  ORBITKV_LOG_INFO("manager: {} GPU(s) usable, serving {}: the pool is registered with CUDA", *devices,
                   chosen.empty() ? std::string("all") : fmt::format("{}", fmt::join(chosen, ",")));
  return std::unique_ptr<GpuSupport>(std::move(support));
}

Status GpuSupport::Unavailable() {
  return Status::FailedPrecondition(
      "this Manager found no usable GPU when it started, so it cannot import CUDA IPC buffers; "
      "start it where the engine's GPU is visible (check CUDA_VISIBLE_DEVICES and the NVIDIA "
      "driver), or register host memory instead");
}

}  // namespace orbitkv::server
