// PinnedArena: a contiguous region of host memory, NUMA-bound, populated and locked at creation.
//
// The memory is a sealed memfd (no shrink, no grow, no further seals) mapped MAP_SHARED, so the
// same pages can later be handed to an engine process by fd. Create() binds the range to the
// requested node before the first touch, populates every page, then mlocks the range, so that after
// Create() returns no access to the arena faults or allocates: the pool's hot path never enters the
// kernel. When locking fails because of RLIMIT_MEMLOCK or a missing CAP_IPC_LOCK, kRequireLocked
// fails with the exact `ulimit -l` needed, and kAllowUnpinned (development only) keeps the
// populated but unlocked memory and says so once in the log.
//
// Invariant: data() points at size() bytes, mapped read/write, for the arena's whole lifetime;
// size() is a non-zero multiple of 4 KiB; locked() tells whether the whole range is mlocked.
//
// Ownership: a PinnedArena is the sole owner of its memfd and mapping (move-only); the destructor
// munlocks, unmaps and closes. Whoever registered the range elsewhere (ArenaRegistrar) must
// unregister it first.
//
// Thread safety: the accessors are const and safe from any thread. The bytes themselves are not
// synchronized: the slab pool above decides who may touch which bytes.
#ifndef ORBITKV_CORE_PINNED_ARENA_H_
#define ORBITKV_CORE_PINNED_ARENA_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "base/result.h"
#include "base/scoped_fd.h"
#include "base/status.h"

namespace orbitkv::core {

// The unit of arena sizes, slab sizes and block alignment (what O_DIRECT SSD writes need).
inline constexpr uint64_t kArenaPageBytes = 4096;

enum class PinMode : uint8_t {
  // Creation fails (ResourceExhausted) when the memory cannot be locked. Production.
  kRequireLocked,
  // Creation keeps unlocked memory when locking fails (one WARN per process). --allow-unpinned.
  kAllowUnpinned,
};

struct ArenaOptions {
  // Non-zero multiple of kArenaPageBytes.
  uint64_t bytes = 0;
  // The NUMA node whose memory backs the arena; -1 leaves placement to the kernel's default policy.
  int numa_node = -1;
  PinMode pin_mode = PinMode::kRequireLocked;
  // Shown as "memfd:<name>" in /proc/<pid>/maps and in error messages; empty means "orbitkv-arena".
  std::string name;
};

class PinnedArena {
 public:
  // Creates, seals, maps, binds, populates and locks an arena of options.bytes. Errors:
  //   InvalidArgument:   bytes is 0 or not a multiple of 4 KiB, or numa_node has no memory.
  //   ResourceExhausted: the memory cannot be populated, or (kRequireLocked) locked; then the
  //                      message names the bytes needed, the current RLIMIT_MEMLOCK and the
  //                      three ways to fix it.
  //   Anything else:     a failing system call, as ErrnoStatus.
  static Result<std::unique_ptr<PinnedArena>> Create(const ArenaOptions& options);

  PinnedArena(PinnedArena&& other) noexcept;
  PinnedArena& operator=(PinnedArena&& other) noexcept;
  PinnedArena(const PinnedArena&) = delete;
  PinnedArena& operator=(const PinnedArena&) = delete;
  ~PinnedArena();

  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  // The node the arena is bound to, or -1 when it was created without binding.
  int numa_node() const { return numa_node_; }
  // False only for a kAllowUnpinned arena whose mlock failed.
  bool locked() const { return locked_; }
  // The sealed memfd behind the mapping; a later handoff dups it.
  const ScopedFd& memfd() const { return memfd_; }
  const std::string& name() const { return name_; }

 private:
  PinnedArena(ScopedFd memfd, uint8_t* data, uint64_t size, int numa_node, std::string name);

  // Unlocks and unmaps (the fd closes with memfd_); leaves the object empty.
  void Release();

  ScopedFd memfd_;
  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
  int numa_node_ = -1;
  bool locked_ = false;
  std::string name_;
};

// The seam through which the GPU module pins arenas for device access (cudaHostRegister). The pool
// calls Register once per arena after the arena is created and Unregister before the arena is
// destroyed.
//
// Thread safety: the pool calls these from the thread that creates or destroys it.
class ArenaRegistrar {
 public:
  virtual ~ArenaRegistrar() = default;

  // Makes [base, base + bytes) usable by the device. An error fails the pool's creation.
  virtual Status Register(uint8_t* base, uint64_t bytes, int numa_node) = 0;
  // Undoes a successful Register of base; called exactly once per successful Register.
  virtual void Unregister(uint8_t* base) = 0;
};

// The NUMA nodes that have memory and that this process may use, ascending: from the hwloc
// topology, or from libnuma when hwloc cannot load one. A kernel without NUMA support reports {0}.
Result<std::vector<int>> MemoryNumaNodes();

// The NUMA node closest to the PCI device "[domain:]bus:device.function" (hex, as CUDA and
// nvidia-smi print it), found through hwloc. Returns -1 when the device is not in the topology or
// its locality is not a single node; InvalidArgument when the string is not a PCI bus id.
Result<int> NumaNodeOfPciDevice(std::string_view pci_bus_id);

}  // namespace orbitkv::core

#endif  // ORBITKV_CORE_PINNED_ARENA_H_
