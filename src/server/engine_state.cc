#include "server/engine_state.h"

#include <sys/mman.h>

#include <fmt/format.h>

namespace orbitkv::server {

KvGroup::~KvGroup() {
  for (Buffer& buffer : buffers) {
    if (buffer.base != nullptr) munmap(buffer.base, buffer.bytes);
  }
}

uint64_t KvGroup::AppendFragments(uint32_t page, uint8_t* pool, std::vector<core::CopyFragment>* out,
                                  size_t first_buffer, size_t buffer_count) const {
  uint64_t offset = 0;
  uint64_t bytes = 0;
  for (size_t b = 0; b < buffers.size(); ++b) {
    const Buffer& buffer = buffers[b];
    if (b >= first_buffer && b - first_buffer < buffer_count) {
      out->push_back(core::CopyFragment{buffer.id, buffer.layout.base_offset + page * buffer.layout.page_stride,
                                        pool + offset, buffer.layout.page_bytes});
      bytes += buffer.layout.page_bytes;
    }
    offset += buffer.layout.page_bytes;
  }
  return bytes;
}

Result<std::shared_ptr<const KvGroup>> EngineInstance::FindGroup(uint32_t group) const {
  MutexLock lock(&mu);
  auto it = groups_.find(group);
  if (it == groups_.end()) {
    return Status::NotFound(fmt::format("group {} of instance {} is not registered", group, id));
  }
  return std::shared_ptr<const KvGroup>(it->second);
}

Status EngineInstance::AddGroup(std::shared_ptr<KvGroup> group) {
  MutexLock lock(&mu);
  if (groups_.count(group->group) != 0) {
    return Status::AlreadyExists(fmt::format("group {} of instance {} is already registered", group->group, id));
  }
  const uint32_t key = group->group;
  groups_.emplace(key, std::move(group));
  return Status::Ok();
}

std::map<uint32_t, std::shared_ptr<KvGroup>> EngineInstance::TakeGroups() {
  std::map<uint32_t, std::shared_ptr<KvGroup>> groups;
  MutexLock lock(&mu);
  groups.swap(groups_);
  return groups;
}

Result<bool> InstanceTable::Register(uint64_t owner, uint64_t id, const state::StateNamespace& ns, std::string label) {
  MutexLock lock(&mu_);
  auto it = instances_.find(id);
  if (it != instances_.end()) {
    if (it->second->owner != owner) {
      return Status::AlreadyExists(
          fmt::format("instance {} is registered by another live session; pick another instance id or stop "
                      "that engine first",
                      id));
    }
    if (!(it->second->ns == ns)) {
      return Status::AlreadyExists(fmt::format("instance {} is already registered with another namespace", id));
    }
    return false;  // idempotent
  }
  instances_.emplace(id, std::make_shared<EngineInstance>(id, ns, owner, std::move(label)));
  return true;
}

std::vector<InstanceTable::Description> InstanceTable::Describe() const {
  std::vector<Description> out;
  {
    MutexLock lock(&mu_);
    out.reserve(instances_.size());
    for (const auto& [id, instance] : instances_) out.push_back({id, instance->owner, instance->label});
  }
  std::sort(out.begin(), out.end(), [](const Description& a, const Description& b) { return a.id < b.id; });
  return out;
}

Status InstanceTable::CheckOwnerLocked(uint64_t owner, uint64_t id, Map::const_iterator it) const {
  if (it == instances_.end()) {
    return Status::NotFound(fmt::format("instance {} is not registered", id));
  }
  if (it->second->owner != owner) {
    return Status::PermissionDenied(fmt::format("instance {} belongs to another session", id));
  }
  return Status::Ok();
}

Result<std::shared_ptr<EngineInstance>> InstanceTable::Find(uint64_t owner, uint64_t id) const {
  MutexLock lock(&mu_);
  auto it = instances_.find(id);
  ORBITKV_RETURN_IF_ERROR(CheckOwnerLocked(owner, id, it));
  return it->second;
}

Result<std::shared_ptr<EngineInstance>> InstanceTable::Remove(uint64_t owner, uint64_t id) {
  MutexLock lock(&mu_);
  auto it = instances_.find(id);
  ORBITKV_RETURN_IF_ERROR(CheckOwnerLocked(owner, id, it));
  std::shared_ptr<EngineInstance> instance = std::move(it->second);
  instances_.erase(it);
  return instance;
}

std::vector<std::shared_ptr<EngineInstance>> InstanceTable::RemoveOwner(uint64_t owner) {
  std::vector<std::shared_ptr<EngineInstance>> removed;
  MutexLock lock(&mu_);
  for (auto it = instances_.begin(); it != instances_.end();) {
    if (it->second->owner == owner) {
      removed.push_back(std::move(it->second));
      it = instances_.erase(it);
    } else {
      ++it;
    }
  }
  return removed;
}

size_t InstanceTable::size() const {
  MutexLock lock(&mu_);
  return instances_.size();
}

void InstanceTable::Clear() {
  MutexLock lock(&mu_);
  instances_.clear();
}

}  // namespace orbitkv::server
