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

// Appends the fragments of one block (page `page` of `group`) at `pool`, one per buffer in
// [first_buffer, first_buffer + buffer_count); returns their bytes.
uint64_t AppendBlockFragments(const Manager::Group& group, uint32_t page, uint8_t* pool,
                              std::vector<core::CopyFragment>* fragments, size_t first_buffer = 0,
                              size_t buffer_count = SIZE_MAX) {
  uint64_t offset = 0;
  uint64_t bytes = 0;
  for (size_t b = 0; b < group.buffers.size(); ++b) {
    const Manager::Group::Buffer& buffer = group.buffers[b];
    if (b >= first_buffer && b - first_buffer < buffer_count) {
      fragments->push_back(core::CopyFragment{
          buffer.id, buffer.layout.base_offset + page * buffer.layout.page_stride, pool + offset,
          buffer.layout.page_bytes});
      bytes += buffer.layout.page_bytes;
    }
    offset += buffer.layout.page_bytes;
  }
  return bytes;
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
    case Opcode::kRestoreLayers:
      return HandleRestore(session, request);
    case Opcode::kSave:
      return HandleSave(session, request);
    case Opcode::kRelease:
      return HandleRelease(*session, request);
    case Opcode::kCancel:
      return HandleCancel(*session, request);
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
  // Keys past what one lease can hold are never looked at (nor loaded from SSD).
  const size_t max_blocks = cache_->MaxQueryBlocks((*group)->padded_bytes);
  if (keys.size() > max_blocks)
    keys.erase(keys.begin() + static_cast<ptrdiff_t>(max_blocks), keys.end());
  if (keys.empty()) {
    query_latency_->Observe(watch.ElapsedSeconds());
    return session.channel->Reply(d, StatusCode::kOk,
                                  static_cast<uint64_t>(channel::QueryOutcome::kMiss) << 32, 0);
  }
  const LoadingKey chain{query.instance, query.group, keys.back().Hash64() ^ keys.size()};
  // Whether this chain's load had completed before the lookup below: then its pins keep every
  // block it loaded resident during the lookup. (One completing meanwhile counts as running.)
  bool loaded = false;
  if (ssd_ != nullptr) {
    MutexLock lock(&loading_mu_);
    loaded = LoadCompletedLocked(chain);
  }
  Result<core::QueryResult> result = cache_->Query(query.instance, keys, (*group)->padded_bytes);
  // A chain whose load had completed is answered with what is in DRAM, even when the load stopped
  // short (DRAM full of pinned blocks, a bad record): loading again would stop at the same place,
  // and the engine would hear Loading forever.
  const bool load = !loaded && result.ok() && ssd_ != nullptr && result->hits < keys.size() &&
                    cache_->table().FindSsd(keys[result->hits]).has_value();
  std::vector<core::BlockPin> released;  // let go after the lock, once the lease pins the blocks
  if (ssd_ != nullptr) {
    MutexLock lock(&loading_mu_);
    // Answered without Loading: nobody will take what the chain's load holds or brings.
    if (!load) ForgetChainLocked(chain, &released);
    SweepHeldLocked(&released);
  }
  if (load) {
    // The prefix continues on SSD: load it into DRAM and let the engine ask again. The DRAM part's
    // lease goes back; the next query leases the whole prefix at once.
    if (result->lease.has_value()) {
      (void)cache_->ReleaseLease(query.instance, *result->lease);
    }
    Result<uint64_t> op = StartLoading(session, chain, std::move(keys));
    query_latency_->Observe(watch.ElapsedSeconds());
    if (!op.ok()) return session.channel->ReplyError(d, op.status());
    return session.channel->Reply(
        d, StatusCode::kOk, static_cast<uint64_t>(channel::QueryOutcome::kLoading) << 32, *op);
  }
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

Result<uint64_t> Manager::StartLoading(const Session& session, const LoadingKey& index,
                                       std::vector<state::StateKey> keys) {
  uint64_t id = 0;
  std::vector<core::BlockPin> released;
  {
    MutexLock lock(&loading_mu_);
    auto found = loading_index_.find(index);
    if (found != loading_index_.end()) return found->second;  // the engine asked again: same op
    uint32_t& outstanding = loading_per_session_[session.owner_id];
    if (outstanding >= config_.max_loading) {
      return Status::ResourceExhausted(fmt::format(
          "{} Loading operations are outstanding on this session (--max-loading); retry",
          outstanding));
    }
    ++outstanding;
    id = next_loading_id_++;
    loading_.emplace(id, LoadingOp{session.owner_id, index.instance, index.group, index.chain});
    loading_index_.emplace(index, id);
  }
  loading_started_->Increment();
  loading_active_->Add(1);
  Status started = ssd_->Load(std::move(keys), [this, id](std::vector<core::BlockPin> pins) {
    // The blocks that could be loaded are in DRAM now, pinned until the engine's next query
    // leases them. The op may already be gone (cancelled, its instance cleaned up): the pins go.
    std::vector<core::BlockPin> unused;
    MutexLock lock(&loading_mu_);
    auto it = loading_.find(id);
    if (it == loading_.end()) {
      unused = std::move(pins);
      return;
    }
    loading_active_->Add(-1);
    loading_held_->Add(static_cast<double>(pins.size()));
    it->second.held = std::move(pins);
    it->second.completed = true;
    it->second.completed_at = MonoNow();
  });
  if (!started.ok()) {
    MutexLock lock(&loading_mu_);
    if (auto it = loading_.find(id); it != loading_.end()) ForgetLoadingLocked(it, &released);
    return started;
  }
  return id;
}

bool Manager::LoadCompletedLocked(const LoadingKey& chain) {
  auto found = loading_index_.find(chain);
  if (found == loading_index_.end()) return false;
  auto it = loading_.find(found->second);
  return it != loading_.end() && it->second.completed;
}

void Manager::ForgetChainLocked(const LoadingKey& chain, std::vector<core::BlockPin>* released) {
  auto found = loading_index_.find(chain);
  if (found == loading_index_.end()) return;
  if (auto it = loading_.find(found->second); it != loading_.end()) {
    ForgetLoadingLocked(it, released);
  }
}

void Manager::SweepHeldLocked(std::vector<core::BlockPin>* released) {
  const MonoTime now = MonoNow();
  if (now - last_hold_sweep_ < std::chrono::seconds(1)) return;
  last_hold_sweep_ = now;
  for (auto it = loading_.begin(); it != loading_.end();) {
    const bool expired = it->second.completed &&
                         now - it->second.completed_at >
                             std::chrono::seconds(config_.loading_hold_seconds);
    it = expired ? ForgetLoadingLocked(it, released) : std::next(it);
  }
}

Manager::LoadingMap::iterator Manager::ForgetLoadingLocked(LoadingMap::iterator it,
                                                           std::vector<core::BlockPin>* released) {
  loading_held_->Add(-static_cast<double>(it->second.held.size()));
  for (core::BlockPin& pin : it->second.held) released->push_back(std::move(pin));
  loading_index_.erase(LoadingKey{it->second.instance, it->second.group, it->second.chain});
  if (--loading_per_session_[it->second.session] == 0) {
    loading_per_session_.erase(it->second.session);
  }
  if (!it->second.completed) loading_active_->Add(-1);
  return loading_.erase(it);
}

void Manager::DropLoadingOf(uint64_t instance) {
  std::vector<core::BlockPin> released;
  MutexLock lock(&loading_mu_);
  for (auto it = loading_.begin(); it != loading_.end();) {
    it = it->second.instance == instance ? ForgetLoadingLocked(it, &released) : std::next(it);
  }
}

Status Manager::HandleCancel(Session& session, const channel::InboundRequest& request) {
  ORBITKV_ASSIGN_OR_RETURN(channel::ReleaseRequest cancel,
                           channel::DecodeRelease(request.descriptor, request.payload));
  Result<std::shared_ptr<Instance>> instance = InstanceFor(session, cancel.instance);
  if (!instance.ok()) return session.channel->ReplyError(request.descriptor, instance.status());
  std::vector<core::BlockPin> released;
  {
    MutexLock lock(&loading_mu_);
    auto it = loading_.find(cancel.lease);
    if (it == loading_.end() || it->second.instance != cancel.instance) {
      return session.channel->ReplyError(
          request.descriptor,
          Status::NotFound("no Loading operation with that id for this instance (it completed "
                           "or was cancelled)"));
    }
    // The reads drain on their own; what they bring into DRAM stays cached for later queries.
    ForgetLoadingLocked(it, &released);
  }
  return session.channel->Reply(request.descriptor, StatusCode::kOk, 0, 0);
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
  const Group& g = **group;
  if (restore.layers && (restore.first_buffer >= g.buffers.size() ||
                         restore.buffer_count > g.buffers.size() - restore.first_buffer)) {
    EndOperation();
    return session->channel->ReplyError(
        d, Status::InvalidArgument(
               fmt::format("layer restore of buffers [{}, +{}) but the group has {} buffers",
                           restore.first_buffer, restore.buffer_count, g.buffers.size())));
  }
  // A whole restore (or the last part of a layer-wise one) consumes the lease: its pins end with
  // this operation, whatever happens. An earlier part copies under pins of its own and leaves the
  // lease for the next part.
  std::shared_ptr<core::LeaseUse> lease;
  if (restore.consume_lease) {
    Result<core::LeaseUse> use =
        cache_->ConsumeLease(restore.instance, core::LeaseId::Unpack(restore.lease));
    if (!use.ok()) {
      EndOperation();
      return session->channel->ReplyError(d, use.status());
    }
    lease = std::make_shared<core::LeaseUse>(std::move(*use));
  } else {
    Result<std::vector<core::BlockPin>> pins =
        cache_->BorrowLease(restore.instance, core::LeaseId::Unpack(restore.lease));
    if (!pins.ok()) {
      EndOperation();
      return session->channel->ReplyError(d, pins.status());
    }
    lease =
        std::make_shared<core::LeaseUse>(std::move(*pins), core::BudgetTicket(), restore.instance);
  }
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
    bytes +=
        restore.layers
            ? AppendBlockFragments(g, restore.pages[i], const_cast<uint8_t*>(pin.data()),
                                   &batch.fragments, restore.first_buffer, restore.buffer_count)
            : AppendBlockFragments(g, restore.pages[i], const_cast<uint8_t*>(pin.data()),
                                   &batch.fragments);
  }
  if (!invalid.ok() || batch.fragments.empty()) {
    EndOperation();
    if (!invalid.ok()) return session->channel->ReplyError(d, invalid);
    return session->channel->Reply(d, StatusCode::kOk, 0, 0);
  }
  std::shared_ptr<channel::ServerSession> channel = session->channel;
  std::shared_ptr<Group> keep_group = *group;
  Status submitted = g.engine->Submit(std::move(batch), [this, channel, d, lease, keep_group,
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
  // With --ssd-policy write-through, the keys of the writers (in order) to queue for SSD once
  // sealed.
  auto through_keys = std::make_shared<std::vector<state::StateKey>>();
  const bool write_through = ssd_ != nullptr && config_.ssd_policy == "write-through";
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
    if (write_through) through_keys->push_back(item.key);
  }
  save_skipped_->Increment(skipped);
  if (writers->empty()) {
    EndOperation();
    return session->channel->Reply(d, StatusCode::kOk, 0, skipped);
  }
  std::shared_ptr<channel::ServerSession> channel = session->channel;
  std::shared_ptr<Group> keep_group = *group;
  const uint64_t bytes = writers->size() * g.block_bytes;
  Status submitted = g.engine->Submit(
      std::move(batch),
      [this, channel, d, writers, through_keys, keep_group, skipped, bytes](Status status) {
        uint64_t written = 0;
        if (status.ok()) {
          for (size_t i = 0; i < writers->size(); ++i) {
            cache_->Seal((*writers)[i]);
            if (!through_keys->empty()) ssd_->OnSealed((*through_keys)[i]);
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

std::string Manager::SsdJson() const {
  if (ssd_ == nullptr) return ", \"ssd\": null";
  const core::SsdTierStats ssd = ssd_->Stats();
  return fmt::format(
      ", \"ssd\": {{\"capacity_bytes\": {}, \"used_bytes\": {}, \"records\": {}, "
      "\"recovered_records\": {}, \"writes\": {}, \"written_bytes\": {}, \"reads\": {}, "
      "\"read_bytes\": {}, \"verify_failures\": {}, \"writeback_dropped\": {}, "
      "\"admission_filtered\": {}, \"write_errors\": {}, \"admissions_enabled\": {}, "
      "\"registered_io\": {}, \"write_staging\": \"{}\"}}",
      ssd.capacity_bytes, ssd.used_bytes, ssd.records, ssd.recovered_records, ssd.writes,
      ssd.written_bytes, ssd.reads, ssd.read_bytes, ssd.verify_failures, ssd.queue_drops,
      ssd.filtered, ssd.write_errors, ssd.admissions_enabled ? "true" : "false", ssd.registered_io,
      storage::WriteStagingName(ssd_->write_staging()));
}

Status Manager::HandleStats(Session& session, const channel::InboundRequest& request) {
  const core::PoolStats pool = cache_->pool().Stats();
  const core::BlockTableStats table = cache_->table().Stats();
  const std::string json = fmt::format(
      "{{\"incarnation\": {}, \"pool_capacity_bytes\": {}, \"pool_allocated_bytes\": {}, "
      "\"resident_blocks\": {}, "
      "\"resident_bytes\": {}, \"pinned_blocks\": {}, \"leases_active\": {}, "
      "\"query_reserved_bytes\": {}, "
      "\"operations_active\": {}, \"hits\": {}, \"misses\": {}, \"evictions\": {}{}{}}}",
      incarnation_, pool.capacity_bytes, pool.allocated_bytes, table.resident_blocks,
      table.resident_bytes, table.pinned_blocks, cache_->leases().active(),
      cache_->query_budget().reserved_bytes(), operations_.load(std::memory_order_relaxed),
      metrics_.GetCounter("orbitkv_cache_hits_total", "").Value(),
      metrics_.GetCounter("orbitkv_cache_misses_total", "").Value(),
      metrics_.GetCounter("orbitkv_cache_evictions_total", "", {{"tier", "dram"}}).Value(),
      SsdJson(), MembershipJson());
  return session.channel->Reply(
      request.descriptor, StatusCode::kOk, 0, 0,
      std::span(reinterpret_cast<const uint8_t*>(json.data()), json.size()));
}

}  // namespace orbitkv::server
