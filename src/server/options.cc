#include "server/options.h"

#include <sys/stat.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "base/scoped_fd.h"

namespace orbitkv::server {
namespace {

std::vector<int> ParseNumaNodes(const std::string& numa) {
  if (numa == "auto") return {};
  if (numa == "none") return {-1};
  std::vector<int> nodes;
  size_t start = 0;
  while (start < numa.size()) {
    const size_t comma = std::min(numa.find(',', start), numa.size());
    nodes.push_back(std::stoi(numa.substr(start, comma - start)));
    start = comma + 1;
  }
  return nodes;
}

// The bytes the file system of `path` has for the tier: free space plus what the tier's own files
// already hold.
Result<uint64_t> SsdSpaceAvailable(const std::string& path) {
  struct statvfs fs {};
  if (statvfs(path.c_str(), &fs) != 0) {
    return ErrnoStatus(fmt::format("--ssd-path {}: statvfs", path), errno);
  }
  uint64_t existing = 0;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(path, error)) {
    if (entry.path().filename().string().starts_with("orbitkv-ssd-")) {
      struct stat st {};
      if (stat(entry.path().c_str(), &st) == 0) existing += static_cast<uint64_t>(st.st_blocks) * 512;
    }
  }
  return static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize + existing;
}

}  // namespace

core::BlockCacheOptions CacheOptionsFor(const ManagerConfig& config) {
  core::BlockCacheOptions options;
  options.pool.capacity_bytes = config.dram_bytes;
  options.pool.slab_bytes = config.slab_bytes;
  options.pool.numa_nodes = ParseNumaNodes(config.numa);
  options.pool.pin_mode = config.allow_unpinned ? core::PinMode::kAllowUnpinned : core::PinMode::kRequireLocked;
  options.query_budget_bytes = config.query_budget_bytes;
  options.query_instance_budget_bytes = config.query_instance_budget_bytes;
  options.transfer_budget_bytes = config.transfer_budget_bytes;
  options.transfer_peer_budget_bytes = config.transfer_peer_budget_bytes;
  options.journal_bytes = config.inventory_journal_bytes;
  // Only distributed mode streams the inventory to a catalog; a single-host Manager keeps none.
  options.record_inventory = !config.etcd_endpoints.empty();
  options.table.expected_blocks = std::max<uint64_t>(config.dram_bytes / (256 << 10), 1024);
  return options;
}

Result<core::SsdTierOptions> SsdOptionsFor(const ManagerConfig& config) {
  core::SsdTierOptions options;
  options.store.directory = config.ssd_path;
  std::error_code error;
  std::filesystem::create_directories(config.ssd_path, error);
  if (error) {
    return Status::InvalidArgument(
        fmt::format("--ssd-path {}: cannot create it: {}", config.ssd_path, error.message()));
  }
  ORBITKV_ASSIGN_OR_RETURN(uint64_t available, SsdSpaceAvailable(config.ssd_path));
  const uint64_t limit = available / 10 * 9;
  uint64_t capacity = config.ssd_capacity_bytes != 0 ? config.ssd_capacity_bytes : (64ull << 30);
  if (capacity > limit) {
    if (config.ssd_capacity_bytes != 0) {
      return Status::ResourceExhausted(
          fmt::format("--ssd-capacity {} MiB does not fit: the file system of {} has {} MiB available (the "
                      "tier takes at most 90% of it); give a smaller --ssd-capacity",
                      capacity >> 20, config.ssd_path, available >> 20));
    }
    capacity = limit;
  }
  options.store.capacity_bytes = capacity;
  options.store.file_count = config.ssd_files;
  if (options.store.file_count == 0) {
    options.store.file_count = static_cast<uint32_t>(std::clamp<uint64_t>(capacity / (64ull << 30), 1, 16));
  }
  options.store.backend = *storage::ParseDeviceBackend(config.ssd_backend);
  options.store.recover = config.ssd_recover;
  options.store.verify_on_open = config.ssd_verify == "eager";
  options.store.write_staging = *storage::ParseWriteStaging(config.ssd_write_staging);
  options.policy =
      config.ssd_policy == "write-through" ? core::SsdWritePolicy::kWriteThrough : core::SsdWritePolicy::kWriteBack;
  options.min_frequency = config.ssd_min_frequency;
  options.write_bytes_per_second = config.ssd_write_budget_bytes;
  options.queue_bytes =
      config.ssd_queue_bytes != 0 ? config.ssd_queue_bytes : std::min<uint64_t>(config.dram_bytes / 8, 1ull << 30);
  return options;
}

CacheServiceOptions ServiceOptionsFor(const ManagerConfig& config) {
  CacheServiceOptions options;
  options.max_operations = config.max_operations;
  options.max_loading = config.max_loading;
  options.loading_hold = std::chrono::seconds(config.loading_hold_seconds);
  options.ssd_load_deadline = std::chrono::seconds(config.ssd_load_deadline_seconds);
  options.ssd_write_through = config.ssd_policy == "write-through";
  return options;
}

}  // namespace orbitkv::server
