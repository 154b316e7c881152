// Hot operations: query, restore, save, release, ping, stats.
//
// Queries and releases are answered inline on the dispatcher. Restores and saves become one copy
// batch each; the copy engine's completion posts the reply, so the dispatcher never waits on bytes.
// A request that is malformed (undecodable payload) poisons the session; a well-formed request that
// cannot be served (unknown instance, stale lease, full budget, page out of range) gets an error
// reply and the session continues.
#include <cstring>

#include "base/clock.h"
#include "base/logging.h"
#include "channel/messages.h"
#include "server/manager.h"
#include "server/manager_internal.h"

namespace orbitkv::server {
namespace {

using channel::Opcode;

bool SameNamespace(const state::StateKey& key, const std::array<uint8_t, 32>& digest) {
  return std::memcmp(key.ns().digest().bytes.data(), digest.data(), 32) == 0;
}

Result<std::shared_ptr<Manager::Group>> FindGroup(Manager::Instance& instance, uint32_t group) {
  MutexLock lock(&instance.mu);
  auto it = instance.groups.find(group);
  if (it == instance.groups.end()) {
    return Status::NotFound(
        fmt::format("group {} of instance {} is not registered", group, instance.id));
  }
  return it->second;
}

// Appends the fragments of one block (page `page` of `group`) at `pool`, one per buffer.
void AppendBlockFragments(const Manager::Group& group, uint32_t page, uint8_t* pool,
                          std::vector<core::CopyFragment>* fragments) {
  uint64_t offset = 0;
  for (const Manager::Group::Buffer& buffer : group.buffers) {
    fragments->push_back(
        core::CopyFragment{buffer.id, buffer.layout.base_offset + page * buffer.layout.page_stride,
                           pool + offset, buffer.layout.page_bytes});
    offset += buffer.layout.page_bytes;
  }
}

}  // namespace

bool Manager::TryBeginOperation() {
  if (operations_.fetch_add(1, std::memory_order_relaxed) >= config_.max_operations) {
    operations_.fetch_sub(1, std::memory_order_relaxed);
    operation_rejections_->Increment();
    return false;
  }
  operations_active_->Add(1);
  return true;
}

void Manager::EndOperation() {
  operations_.fetch_sub(1, std::memory_order_relaxed);
  operations_active_->Add(-1);
}

Status Manager::HandleRequest(const std::shared_ptr<Session>& session,
                              channel::InboundRequest& request) {
  const channel::Descriptor& d = request.descriptor;
  switch (request.opcode()) {
    case Opcode::kPing:
      return session->channel->Reply(d, StatusCode::kOk, incarnation_, 0);
    case Opcode::kQuery:
      return HandleQuery(*session, request);
    case Opcode::kRestore:
      return HandleRestore(session, request);
    case Opcode::kSave:
      return HandleSave(session, request);
    case Opcode::kRelease:
      return HandleRelease(*session, request);
    case Opcode::kCancel:
      // Every operation today completes on its own (no Loading yet): there is nothing to cancel.
      return session->channel->ReplyError(
          d, Status::NotFound("no cancellable operation with that id"));
    case Opcode::kStats:
      return HandleStats(*session, request);
  }
  return Status::InvalidArgument(fmt::format("unknown opcode {}", d.opcode));
}

Status Manager::HandleQuery(Session& session, const channel::InboundRequest& request) {
  Stopwatch watch;
  ORBITKV_ASSIGN_OR_RETURN(channel::QueryRequest query,
                           channel::DecodeQuery(request.descriptor, request.payload));
  const channel::Descriptor& d = request.descriptor;
  Result<std::shared_ptr<Instance>> instance = InstanceFor(session, query.instance);
  if (!instance.ok()) return session.channel->ReplyError(d, instance.status());
  Result<std::shared_ptr<Group>> group = FindGroup(**instance, query.group);
  if (!group.ok()) return session.channel->ReplyError(d, group.status());
  // Keys are built in the instance's namespace: an engine can only ever ask for its own model's
  // blocks.
  state::Digest256 digest;
  std::memcpy(digest.bytes.data(), (*instance)->namespace_digest.data(), 32);
  const state::StateNamespace ns(digest);
  std::vector<state::StateKey> keys;
  Status built =
      state::StateKey::AppendChain(ns, query.group, query.first_token, query.page_tokens,
                                   query.natives, query.native_bytes, query.key_version, &keys);
  if (!built.ok()) return session.channel->ReplyError(d, built);
  Result<core::QueryResult> result = cache_->Query(query.instance, keys, (*group)->padded_bytes);
  query_latency_->Observe(watch.ElapsedSeconds());
  if (!result.ok()) return session.channel->ReplyError(d, result.status());
  if (!result->lease.has_value()) {
    return session.channel->Reply(d, StatusCode::kOk,
                                  static_cast<uint64_t>(channel::QueryOutcome::kMiss) << 32, 0);
  }
  return session.channel->Reply(
      d, StatusCode::kOk, static_cast<uint64_t>(channel::QueryOutcome::kHit) << 32 | result->hits,
      result->lease->Pack());
}

Status Manager::HandleRelease(Session& session, const channel::InboundRequest& request) {
  ORBITKV_ASSIGN_OR_RETURN(channel::ReleaseRequest release,
                           channel::DecodeRelease(request.descriptor, request.payload));
  Result<std::shared_ptr<Instance>> instance = InstanceFor(session, release.instance);
  if (!instance.ok()) return session.channel->ReplyError(request.descriptor, instance.status());
  Status status = cache_->ReleaseLease(release.instance, core::LeaseId::Unpack(release.lease));
  if (!status.ok()) return session.channel->ReplyError(request.descriptor, status);
  return session.channel->Reply(request.descriptor, StatusCode::kOk, 0, 0);
}

Status Manager::HandleRestore(const std::shared_ptr<Session>& session,
                              const channel::InboundRequest& request) {
  ORBITKV_ASSIGN_OR_RETURN(channel::RestoreRequest restore,
                           channel::DecodeRestore(request.descriptor, request.payload));
  const channel::Descriptor d = request.descriptor;
  Result<std::shared_ptr<Instance>> instance = InstanceFor(*session, restore.instance);
  if (!instance.ok()) return session->channel->ReplyError(d, instance.status());
  Result<std::shared_ptr<Group>> group = FindGroup(**instance, restore.group);
  if (!group.ok()) return session->channel->ReplyError(d, group.status());
  if (!TryBeginOperation()) {
    return session->channel->ReplyError(
        d, Status::ResourceExhausted(
               "too many restores and saves in flight; retry (the lease is still valid)"));
  }
  // From here the lease is consumed: its pins end with this operation, whatever happens.
  Result<core::LeaseUse> use =
      cache_->ConsumeLease(restore.instance, core::LeaseId::Unpack(restore.lease));
  if (!use.ok()) {
    EndOperation();
    return session->channel->ReplyError(d, use.status());
  }
  auto lease = std::make_shared<core::LeaseUse>(std::move(*use));
  const Group& g = **group;
  Status invalid;
  if (restore.pages.size() > lease->pins().size()) {
    invalid =
        Status::InvalidArgument(fmt::format("restore names {} pages but the lease holds {} blocks",
                                            restore.pages.size(), lease->pins().size()));
  }
  core::CopyBatch batch;
  batch.direction = core::CopyDirection::kRestore;
  uint64_t bytes = 0;
  for (size_t i = 0; invalid.ok() && i < restore.pages.size(); ++i) {
    if (restore.pages[i] == channel::kSkipPage) continue;
    if (restore.pages[i] >= g.num_pages) {
      invalid = Status::InvalidArgument(fmt::format(
          "destination page {} is beyond the group's {} pages", restore.pages[i], g.num_pages));
      break;
    }
    const core::BlockPin& pin = lease->pins()[i];
    if (pin.bytes() != g.block_bytes) {
      invalid = Status::FailedPrecondition(
          fmt::format("leased block {} has {} bytes but the group's pages hold {}", i, pin.bytes(),
                      g.block_bytes));
      break;
    }
    // The copy engine only reads from the pool on restore.
    AppendBlockFragments(g, restore.pages[i], const_cast<uint8_t*>(pin.data()), &batch.fragments);
    bytes += pin.bytes();
  }
  if (!invalid.ok() || batch.fragments.empty()) {
    EndOperation();
    if (!invalid.ok()) return session->channel->ReplyError(d, invalid);
    return session->channel->Reply(d, StatusCode::kOk, 0, 0);
  }
  std::shared_ptr<channel::ServerSession> channel = session->channel;
  std::shared_ptr<Group> keep_group = *group;
  Status submitted = copy_engine_->Submit(std::move(batch), [this, channel, d, lease, keep_group,
                                                             bytes](Status status) {
    lease->Reset();  // the copy drained: pins and reservation go back before the engine hears of it
    if (status.ok()) restored_bytes_->Increment(bytes);
    Status replied =
        status.ok() ? channel->Reply(d, StatusCode::kOk, bytes, 0) : channel->ReplyError(d, status);
    if (!replied.ok())
      ORBITKV_LOG_DEBUG("manager: restore reply not delivered: {}", replied.ToString());
    EndOperation();
  });
  if (!submitted.ok()) {
    EndOperation();
    return session->channel->ReplyError(d, submitted);
  }
  return Status::Ok();
}

Status Manager::HandleSave(const std::shared_ptr<Session>& session,
                           const channel::InboundRequest& request) {
  ORBITKV_ASSIGN_OR_RETURN(channel::SaveRequest save,
                           channel::DecodeSave(request.descriptor, request.payload));
  const channel::Descriptor d = request.descriptor;
  Result<std::shared_ptr<Instance>> instance = InstanceFor(*session, save.instance);
  if (!instance.ok()) return session->channel->ReplyError(d, instance.status());
  Result<std::shared_ptr<Group>> group = FindGroup(**instance, save.group);
  if (!group.ok()) return session->channel->ReplyError(d, group.status());
  const Group& g = **group;
  for (const channel::SaveItem& item : save.items) {
    if (!SameNamespace(item.key, (*instance)->namespace_digest) || item.key.group() != save.group) {
      return session->channel->ReplyError(
          d, Status::InvalidArgument(
                 "a saved key belongs to another namespace or group than its instance"));
    }
    if (item.page >= g.num_pages) {
      return session->channel->ReplyError(
          d, Status::InvalidArgument(fmt::format("source page {} is beyond the group's {} pages",
                                                 item.page, g.num_pages)));
    }
  }
  if (!TryBeginOperation()) {
    return session->channel->ReplyError(
        d, Status::ResourceExhausted("too many restores and saves in flight; retry"));
  }
  auto writers = std::make_shared<std::vector<core::BlockWriter>>();
  core::CopyBatch batch;
  batch.direction = core::CopyDirection::kSave;
  uint64_t skipped = 0;
  for (const channel::SaveItem& item : save.items) {
    Result<core::BlockWriter> writer = cache_->Prepare(item.key, g.block_bytes);
    if (!writer.ok()) {
      // Already resident or being written by someone else: nothing to copy. A full pool: skip, the
      // engine keeps its pages and the cache simply misses this block later.
      ++skipped;
      continue;
    }
    AppendBlockFragments(g, item.page, writer->data(), &batch.fragments);
    writers->push_back(std::move(*writer));
  }
  save_skipped_->Increment(skipped);
  if (writers->empty()) {
    EndOperation();
    return session->channel->Reply(d, StatusCode::kOk, 0, skipped);
  }
  std::shared_ptr<channel::ServerSession> channel = session->channel;
  std::shared_ptr<Group> keep_group = *group;
  const uint64_t bytes = writers->size() * g.block_bytes;
  Status submitted = copy_engine_->Submit(
      std::move(batch), [this, channel, d, writers, keep_group, skipped, bytes](Status status) {
        uint64_t written = 0;
        if (status.ok()) {
          for (core::BlockWriter& writer : *writers) {
            cache_->Seal(writer);
            ++written;
          }
          saved_bytes_->Increment(bytes);
        }
        writers->clear();  // unsealed writers abort and free their memory
        Status replied = status.ok() ? channel->Reply(d, StatusCode::kOk, written, skipped)
                                     : channel->ReplyError(d, status);
        if (!replied.ok())
          ORBITKV_LOG_DEBUG("manager: save reply not delivered: {}", replied.ToString());
        EndOperation();
      });
  if (!submitted.ok()) {
    writers->clear();
    EndOperation();
    return session->channel->ReplyError(d, submitted);
  }
  return Status::Ok();
}

Status Manager::HandleStats(Session& session, const channel::InboundRequest& request) {
  const core::PoolStats pool = cache_->pool().Stats();
  const core::BlockTableStats table = cache_->table().Stats();
  const std::string json = fmt::format(
      "{{\"incarnation\": {}, \"pool_capacity_bytes\": {}, \"pool_allocated_bytes\": {}, "
      "\"resident_blocks\": {}, "
      "\"resident_bytes\": {}, \"pinned_blocks\": {}, \"leases_active\": {}, "
      "\"query_reserved_bytes\": {}, "
      "\"operations_active\": {}, \"hits\": {}, \"misses\": {}, \"evictions\": {}{}}}",
      incarnation_, pool.capacity_bytes, pool.allocated_bytes, table.resident_blocks,
      table.resident_bytes, table.pinned_blocks, cache_->leases().active(),
      cache_->query_budget().reserved_bytes(), operations_.load(std::memory_order_relaxed),
      metrics_.GetCounter("orbitkv_cache_hits_total", "").Value(),
      metrics_.GetCounter("orbitkv_cache_misses_total", "").Value(),
      metrics_.GetCounter("orbitkv_cache_evictions_total", "", {{"tier", "dram"}}).Value(),
      MembershipJson());
  return session.channel->Reply(
      request.descriptor, StatusCode::kOk, 0, 0,
      std::span(reinterpret_cast<const uint8_t*>(json.data()), json.size()));
}

}  // namespace orbitkv::server
