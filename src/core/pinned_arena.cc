#include "core/pinned_arena.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <hwloc.h>
#include <numa.h>
#include <numaif.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "base/check.h"
#include "base/logging.h"

namespace orbitkv::core {
namespace {

constexpr std::string_view kDefaultArenaName = "orbitkv-arena";

std::string FormatLimit(rlim_t bytes) {
  if (bytes == RLIM_INFINITY) return "unlimited";
  return fmt::format("{} KiB", bytes / 1024);
}

// Bytes the process has mlocked already (VmLck), which count against RLIMIT_MEMLOCK together with a
// new lock. Read only on the failure path; 0 when /proc is unavailable.
uint64_t LockedBytesOfProcess() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.starts_with("VmLck:")) return std::strtoull(line.c_str() + 6, nullptr, 10) * 1024;
  }
  return 0;
}

// Checks that `node` can back an arena. Sets *bind to whether mbind is needed: a kernel without
// NUMA support has only node 0, which needs no binding.
Status ValidateNode(int node, bool* bind) {
  *bind = false;
  if (node == -1) return Status::Ok();
  if (node < -1) return Status::InvalidArgument(fmt::format("NUMA node {} is not a node (use -1 for none)", node));
  if (numa_available() < 0) {
    if (node == 0) return Status::Ok();
    return Status::InvalidArgument(
        fmt::format("NUMA node {} requested, but the kernel has no NUMA support (only node 0 exists)", node));
  }
  if (node > numa_max_node() || numa_bitmask_isbitset(numa_all_nodes_ptr, static_cast<unsigned>(node)) == 0 ||
      numa_node_size64(node, nullptr) <= 0) {
    return Status::InvalidArgument(
        fmt::format("NUMA node {} has no memory this process may use (see MemoryNumaNodes())", node));
  }
  *bind = true;
  return Status::Ok();
}

// MPOL_BIND on a shared mapping sets the policy of the memfd's pages themselves, so it must come
// before the first touch: pages placed earlier would stay where they are.
Status BindToNode(uint8_t* data, uint64_t bytes, int node) {
  constexpr size_t kBitsPerWord = sizeof(unsigned long) * CHAR_BIT;  // NOLINT(google-runtime-int): mbind's type.
  std::vector<unsigned long> mask(static_cast<size_t>(node) / kBitsPerWord + 1,
                                  0);  // NOLINT(google-runtime-int)
  mask[static_cast<size_t>(node) / kBitsPerWord] |= 1UL << (static_cast<size_t>(node) % kBitsPerWord);
  // The kernel reads maxnode - 1 bits (a historical off-by-one that libnuma also compensates for).
  if (mbind(data, bytes, MPOL_BIND, mask.data(), mask.size() * kBitsPerWord + 1, 0) != 0) {
    return ErrnoStatus(fmt::format("mbind to NUMA node {}", node), errno);
  }
  return Status::Ok();
}

// Allocates every page now so that neither the hot path nor a GPU copy ever takes a page fault.
Status Populate(uint8_t* data, uint64_t bytes, int node) {
#ifdef MADV_POPULATE_WRITE
  int rc;
  do {
    rc = madvise(data, bytes, MADV_POPULATE_WRITE);
  } while (rc != 0 && errno == EINTR);
  if (rc == 0) return Status::Ok();
  const int err = errno;
  if (err != EINVAL) {
    if (err == ENOMEM || err == EFAULT) {
      return Status::ResourceExhausted(fmt::format("cannot populate {} bytes{}: {}", bytes,
                                                   node >= 0 ? fmt::format(" on NUMA node {}", node) : "",
                                                   ErrnoStatus("madvise(MADV_POPULATE_WRITE)", err).message()));
    }
    return ErrnoStatus("madvise(MADV_POPULATE_WRITE)", err);
  }
  // EINVAL: a kernel older than 5.14; touch each page instead.
#endif
  volatile uint8_t* bytes_to_touch = data;
  for (uint64_t offset = 0; offset < bytes; offset += kArenaPageBytes) bytes_to_touch[offset] = 0;
  return Status::Ok();
}

Status LockFailure(const std::string& name, uint64_t bytes, int err) {
  struct rlimit limit {};
  std::string current = "unknown";
  if (getrlimit(RLIMIT_MEMLOCK, &limit) == 0) {
    current = fmt::format("{} (hard limit {})", FormatLimit(limit.rlim_cur), FormatLimit(limit.rlim_max));
  }
  const uint64_t already_locked = LockedBytesOfProcess();
  const uint64_t needed_kib = (already_locked + bytes + 1023) / 1024;
  return Status::ResourceExhausted(fmt::format(
      "pinned arena '{}': cannot lock {} bytes ({} KiB) in memory: {}; RLIMIT_MEMLOCK is {} and "
      "the process already has {} KiB locked; raise `ulimit -l` to at least {} KiB (or "
      "unlimited), give the process CAP_IPC_LOCK, or start with --allow-unpinned for development",
      name, bytes, bytes / 1024, ErrnoStatus("mlock", err).message(), current, already_locked / 1024, needed_kib));
}

// mlock(2) through the raw system call: the sanitizer runtimes intercept mlock/munlock as no-ops,
// which would make sanitizer builds report arenas as locked that are not (and hide the
// RLIMIT_MEMLOCK failure path).
int LockRange(uint8_t* data, uint64_t bytes) { return static_cast<int>(syscall(SYS_mlock, data, bytes)); }

struct TopologyDeleter {
  void operator()(hwloc_topology_t topology) const { hwloc_topology_destroy(topology); }
};
using TopologyPtr = std::unique_ptr<hwloc_topology, TopologyDeleter>;

// Loads the machine topology; with_pci keeps PCI devices (slower: it walks sysfs).
Result<TopologyPtr> LoadTopology(bool with_pci) {
  hwloc_topology_t raw = nullptr;
  if (hwloc_topology_init(&raw) != 0) return Status::Internal("hwloc_topology_init failed");
  TopologyPtr topology(raw);
  if (with_pci && hwloc_topology_set_io_types_filter(raw, HWLOC_TYPE_FILTER_KEEP_IMPORTANT) != 0) {
    return Status::Internal("hwloc_topology_set_io_types_filter failed");
  }
  if (hwloc_topology_load(raw) != 0) return ErrnoStatus("hwloc_topology_load", errno);
  return topology;
}

std::vector<int> MemoryNodesFromHwloc() {
  std::vector<int> nodes;
  Result<TopologyPtr> topology = LoadTopology(/*with_pci=*/false);
  if (!topology.ok()) return nodes;
  hwloc_topology_t topo = topology->get();
  const int count = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_NUMANODE);
  for (int i = 0; i < count; ++i) {
    hwloc_obj_t node = hwloc_get_obj_by_type(topo, HWLOC_OBJ_NUMANODE, static_cast<unsigned>(i));
    if (node != nullptr && node->attr != nullptr && node->attr->numanode.local_memory > 0) {
      nodes.push_back(static_cast<int>(node->os_index));
    }
  }
  return nodes;
}

std::vector<int> MemoryNodesFromLibnuma() {
  std::vector<int> nodes;
  if (numa_available() < 0) return nodes;
  for (int node = 0; node <= numa_max_node(); ++node) {
    if (numa_bitmask_isbitset(numa_all_nodes_ptr, static_cast<unsigned>(node)) != 0 &&
        numa_node_size64(node, nullptr) > 0) {
      nodes.push_back(node);
    }
  }
  return nodes;
}

// Parses 1..max_digits hex digits into *value.
bool ParseHex(std::string_view text, size_t max_digits, unsigned* value) {
  if (text.empty() || text.size() > max_digits) return false;
  *value = 0;
  for (char c : text) {
    unsigned digit;
    if (c >= '0' && c <= '9') {
      digit = static_cast<unsigned>(c - '0');
    } else if (c >= 'a' && c <= 'f') {
      digit = static_cast<unsigned>(c - 'a' + 10);
    } else if (c >= 'A' && c <= 'F') {
      digit = static_cast<unsigned>(c - 'A' + 10);
    } else {
      return false;
    }
    *value = *value * 16 + digit;
  }
  return true;
}

struct PciAddress {
  unsigned domain = 0, bus = 0, device = 0, function = 0;
};

// "[domain:]bus:device.function": domain up to 8 hex digits (nvidia-smi prints 8), bus 2, device 2
// (< 0x20), function 1 (< 8).
bool ParsePciBusId(std::string_view text, PciAddress* address) {
  const size_t dot = text.rfind('.');
  if (dot == std::string_view::npos) return false;
  if (!ParseHex(text.substr(dot + 1), 1, &address->function) || address->function > 7) return false;
  std::string_view rest = text.substr(0, dot);
  const size_t colon = rest.rfind(':');
  if (colon == std::string_view::npos) return false;
  if (!ParseHex(rest.substr(colon + 1), 2, &address->device) || address->device > 0x1f) return false;
  rest = rest.substr(0, colon);
  const size_t domain_colon = rest.rfind(':');
  if (domain_colon == std::string_view::npos) return ParseHex(rest, 2, &address->bus);
  return ParseHex(rest.substr(domain_colon + 1), 2, &address->bus) &&
         ParseHex(rest.substr(0, domain_colon), 8, &address->domain);
}

}  // namespace

Result<std::unique_ptr<PinnedArena>> PinnedArena::Create(const ArenaOptions& options) {
  std::string name = options.name.empty() ? std::string(kDefaultArenaName) : options.name;
  if (options.bytes == 0 || options.bytes % kArenaPageBytes != 0) {
    return Status::InvalidArgument(fmt::format("pinned arena '{}': size {} is not a non-zero multiple of {} bytes",
                                               name, options.bytes, kArenaPageBytes));
  }
  if (options.bytes > static_cast<uint64_t>(std::numeric_limits<off_t>::max())) {
    return Status::InvalidArgument(fmt::format("pinned arena '{}': size {} is too large", name, options.bytes));
  }
  bool bind = false;
  ORBITKV_RETURN_IF_ERROR(ValidateNode(options.numa_node, &bind).WithContext("pinned arena '" + name + "'"));

  ScopedFd memfd(memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!memfd.valid()) return ErrnoStatus("memfd_create", errno);
  if (ftruncate(memfd.get(), static_cast<off_t>(options.bytes)) != 0) {
    return ErrnoStatus("ftruncate", errno);
  }
  // The size is fixed for good: a process given the fd can never shrink it under us (SIGBUS).
  if (fcntl(memfd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return ErrnoStatus("fcntl(F_ADD_SEALS)", errno);
  }
  void* mapped = mmap(nullptr, options.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memfd.get(), 0);
  if (mapped == MAP_FAILED) return ErrnoStatus("mmap", errno);
  // From here on the arena owns the mapping, so every early return below unmaps it.
  std::unique_ptr<PinnedArena> arena(
      new PinnedArena(std::move(memfd), static_cast<uint8_t*>(mapped), options.bytes, options.numa_node, name));

  if (bind) {
    ORBITKV_RETURN_IF_ERROR(BindToNode(arena->data_, arena->size_, options.numa_node));
  }
  ORBITKV_RETURN_IF_ERROR(Populate(arena->data_, arena->size_, options.numa_node));

  if (LockRange(arena->data_, arena->size_) == 0) {
    arena->locked_ = true;
    return arena;
  }
  const int err = errno;
  if (err != ENOMEM && err != EPERM && err != EAGAIN) return ErrnoStatus("mlock", err);
  Status failure = LockFailure(name, options.bytes, err);
  if (options.pin_mode == PinMode::kRequireLocked) return failure;
  // Relaxed: the flag only keeps the warning to one line per process; it publishes nothing.
  static std::atomic<bool> warned{false};
  if (!warned.exchange(true, std::memory_order_relaxed)) {
    ORBITKV_LOG_WARN(
        "--allow-unpinned: continuing with unlocked host memory (pages may be swapped or migrated, "
        "and GPU copies from them are slower); {}",
        failure.message());
  }
  return arena;
}

PinnedArena::PinnedArena(ScopedFd memfd, uint8_t* data, uint64_t size, int numa_node, std::string name)
    : memfd_(std::move(memfd)), data_(data), size_(size), numa_node_(numa_node), name_(std::move(name)) {}

PinnedArena::PinnedArena(PinnedArena&& other) noexcept
    : memfd_(std::move(other.memfd_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      numa_node_(std::exchange(other.numa_node_, -1)),
      locked_(std::exchange(other.locked_, false)),
      name_(std::move(other.name_)) {}

PinnedArena& PinnedArena::operator=(PinnedArena&& other) noexcept {
  if (this != &other) {
    Release();
    memfd_ = std::move(other.memfd_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    numa_node_ = std::exchange(other.numa_node_, -1);
    locked_ = std::exchange(other.locked_, false);
    name_ = std::move(other.name_);
  }
  return *this;
}

PinnedArena::~PinnedArena() { Release(); }

void PinnedArena::Release() {
  if (data_ != nullptr) {
    // munmap drops the lock too; munlock first keeps the accounting explicit and its failure is
    // harmless. Raw system call for the reason given at LockRange.
    if (locked_) syscall(SYS_munlock, data_, size_);
    ORBITKV_CHECK_MSG(munmap(data_, size_) == 0, "munmap of pinned arena '{}' failed: {}", name_, std::strerror(errno));
  }
  data_ = nullptr;
  size_ = 0;
  locked_ = false;
  memfd_.Reset();
}

Result<std::vector<int>> MemoryNumaNodes() {
  std::vector<int> nodes = MemoryNodesFromHwloc();
  if (nodes.empty()) nodes = MemoryNodesFromLibnuma();
  if (nodes.empty()) nodes.push_back(0);
  std::sort(nodes.begin(), nodes.end());
  nodes.erase(std::unique(nodes.begin(), nodes.end()), nodes.end());
  return nodes;
}

Result<int> NumaNodeOfPciDevice(std::string_view pci_bus_id) {
  PciAddress address;
  if (!ParsePciBusId(pci_bus_id, &address)) {
    return Status::InvalidArgument(
        fmt::format("'{}' is not a PCI bus id ([domain:]bus:device.function in hex)", pci_bus_id));
  }
  ORBITKV_ASSIGN_OR_RETURN(TopologyPtr topology, LoadTopology(/*with_pci=*/true));
  hwloc_obj_t device =
      hwloc_get_pcidev_by_busid(topology.get(), address.domain, address.bus, address.device, address.function);
  if (device == nullptr) return -1;
  hwloc_obj_t ancestor = hwloc_get_non_io_ancestor_obj(topology.get(), device);
  // A device attached above several nodes (or of unknown locality) is near no node in particular.
  if (ancestor == nullptr || ancestor->nodeset == nullptr || hwloc_bitmap_weight(ancestor->nodeset) != 1) {
    return -1;
  }
  return hwloc_bitmap_first(ancestor->nodeset);
}

}  // namespace orbitkv::core
