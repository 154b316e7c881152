// What the Manager knows of each engine: its registered instances and their KV groups.
//
// An engine registers an instance (its namespace: model, weights, tokenizer, layout, rank) and
// then one or more groups of KV buffers. A KvGroup says where page p of each buffer lives (mapped
// from the engine's shared memory, in the engine process, or in its GPU) and which copy engine
// reaches it; an EngineInstance holds its groups. Both are shared: in-flight copies hold a
// reference to their group, so its mappings outlive the instance until every copy drained. The
// owner of an instance is an opaque id (the Manager uses its control session's id): only that
// owner may use it.
//
// Thread safety: InstanceTable and EngineInstance's groups are safe from any thread; a KvGroup is
// immutable once added to its instance.
#ifndef ORBITKV_SERVER_ENGINE_STATE_H_
#define ORBITKV_SERVER_ENGINE_STATE_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <unordered_map>
#include <vector>

#include "base/mutex.h"
#include "base/result.h"
#include "base/thread_annotations.h"
#include "channel/wire.h"
#include "core/copy_engine.h"
#include "state/namespace.h"

namespace orbitkv::server {

struct KvGroup {
  struct Buffer {
    uint8_t* base = nullptr;  // shared memory only: the Manager's mapping (unmapped by ~KvGroup)
    uint64_t bytes = 0;
    channel::BufferDescriptor layout{};
    core::BufferId id;
  };
  KvGroup() = default;
  ~KvGroup();
  KvGroup(const KvGroup&) = delete;
  KvGroup& operator=(const KvGroup&) = delete;

  // Appends the fragments of one block (page `page`) at `pool`, one per buffer in
  // [first_buffer, first_buffer + buffer_count); returns their bytes.
  uint64_t AppendFragments(uint32_t page, uint8_t* pool, std::vector<core::CopyFragment>* out, size_t first_buffer = 0,
                           size_t buffer_count = SIZE_MAX) const;

  uint32_t group = 0;
  uint32_t num_pages = 0;
  channel::BufferKind kind = channel::BufferKind::kSharedMemory;
  // The copy engine its buffers are registered with; outlives every group.
  core::CopyEngine* engine = nullptr;
  uint64_t block_bytes = 0;   // sum of page_bytes over buffers: one block
  uint64_t padded_bytes = 0;  // block_bytes rounded up to 4 KiB: what a query charges per block
  std::vector<Buffer> buffers;
};

struct EngineInstance {
  EngineInstance(uint64_t instance_id, const state::StateNamespace& instance_ns, uint64_t owner_id,
                 std::string identity_label = {})
      : id(instance_id), ns(instance_ns), owner(owner_id), label(std::move(identity_label)) {}

  // The group, or NotFound naming it.
  Result<std::shared_ptr<const KvGroup>> FindGroup(uint32_t group) const EXCLUDES(mu);
  // AlreadyExists when the group id is taken.
  Status AddGroup(std::shared_ptr<KvGroup> group) EXCLUDES(mu);
  // Hands every group to the caller (cleanup).
  std::map<uint32_t, std::shared_ptr<KvGroup>> TakeGroups() EXCLUDES(mu);

  const uint64_t id;
  const state::StateNamespace ns;  // keys of this instance are built in it
  const uint64_t owner;
  // What the engine says it is (model, weights, rank), for `orbitkv status`; empty when it said nothing.
  const std::string label;
  // Release/acquire: set before cleanup starts; operations started later see it and refuse.
  std::atomic<bool> retired{false};

 private:
  mutable Mutex mu;
  std::map<uint32_t, std::shared_ptr<KvGroup>> groups_ GUARDED_BY(mu);
};

class InstanceTable {
 public:
  // Registers `id` for `owner`; registering the same id again with the same namespace is a no-op.
  // AlreadyExists when another owner has it or the namespace differs.
  Result<bool> Register(uint64_t owner, uint64_t id, const state::StateNamespace& ns, std::string label = {})
      EXCLUDES(mu_);
  struct Description {
    uint64_t id;
    uint64_t owner;
    std::string label;
  };
  // Every registered instance, ordered by id.
  std::vector<Description> Describe() const EXCLUDES(mu_);
  // The instance if `owner` registered it: NotFound, or PermissionDenied for another owner's.
  Result<std::shared_ptr<EngineInstance>> Find(uint64_t owner, uint64_t id) const EXCLUDES(mu_);
  // Removes and returns the instance (the same errors as Find).
  Result<std::shared_ptr<EngineInstance>> Remove(uint64_t owner, uint64_t id) EXCLUDES(mu_);
  // Removes and returns every instance of `owner`.
  std::vector<std::shared_ptr<EngineInstance>> RemoveOwner(uint64_t owner) EXCLUDES(mu_);
  size_t size() const EXCLUDES(mu_);
  void Clear() EXCLUDES(mu_);

 private:
  using Map = std::unordered_map<uint64_t, std::shared_ptr<EngineInstance>>;
  // NotFound for end(), PermissionDenied for another owner's instance.
  Status CheckOwnerLocked(uint64_t owner, uint64_t id, Map::const_iterator it) const REQUIRES(mu_);

  mutable Mutex mu_;
  Map instances_ GUARDED_BY(mu_);
};

}  // namespace orbitkv::server

#endif  // ORBITKV_SERVER_ENGINE_STATE_H_
