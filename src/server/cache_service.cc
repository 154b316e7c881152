#include "server/cache_service.h"

#include <fmt/format.h>

#include <algorithm>

#include "base/clock.h"
#include "base/logging.h"
#include "base/mutex.h"
#include "base/thread_annotations.h"

namespace orbitkv::server {
namespace {

// A save's items all belong to the instance's namespace and group and name pages the group has.
Status CheckSaveItems(const channel::SaveRequest& request, const state::StateNamespace& ns, uint32_t num_pages) {
  for (const channel::SaveItem& item : request.items) {
    if (!(item.key.ns() == ns) || item.key.group() != request.group) {
      return Status::InvalidArgument("a saved key belongs to another namespace or group than its instance");
    }
    if (item.page >= num_pages) {
      return Status::InvalidArgument(
          fmt::format("source page {} is beyond the group's {} pages", item.page, num_pages));
    }
  }
  return Status::Ok();
}

}  // namespace

CacheService::CacheService(const CacheServiceOptions& options, core::BlockCache* cache, core::SsdTier* ssd,
                           MetricsRegistry* metrics)
    : options_(options),
      cache_(cache),
      ssd_(ssd),
      loading_(LoadingRegistry::Options{options.max_loading, options.loading_hold, options.wake_sweeper}, metrics),
      operations_active_(&metrics->GetGauge("orbitkv_operations_active", "Restores and saves in flight")),
      operation_rejections_(&metrics->GetCounter("orbitkv_operation_rejections_total",
                                                 "Restores and saves refused because --max-operations were in "
                                                 "flight")),
      restored_bytes_(&metrics->GetCounter("orbitkv_restored_bytes_total", "Bytes copied into engine pages")),
      saved_bytes_(&metrics->GetCounter("orbitkv_saved_bytes_total", "Bytes copied from engine pages and sealed")),
      save_skipped_(&metrics->GetCounter("orbitkv_save_skipped_blocks_total",
                                         "Saved blocks skipped (already resident or in progress)")),
      saves_abandoned_(
          &metrics->GetCounter("orbitkv_saves_abandoned_total",
                               "Saves the engine abandoned (its wait ran out) before the Manager claimed them: never "
                               "sealed")),
      restores_abandoned_(
          &metrics->GetCounter("orbitkv_restores_abandoned_total",
                               "Restores the engine abandoned before the Manager claimed them: its pages never "
                               "written")),
      query_latency_(&metrics->GetHistogram("orbitkv_query_seconds", "Time to answer a query in the Manager",
                                            Histogram::ExponentialBounds(1e-6, 2, 20))),
      restore_latency_(&metrics->GetHistogram(
          "orbitkv_restore_seconds", "Time from a restore request to its copy into the engine's pages completing",
          Histogram::ExponentialBounds(1e-5, 2, 20))),
      restore_submit_latency_(
          &metrics->GetHistogram("orbitkv_restore_submit_seconds",
                                 "Time from a restore request to its (first) copy batch being handed to the copy "
                                 "engine (the lease taken, the fragments built), for the restores "
                                 "orbitkv_restore_seconds counts: the start of that time",
                                 Histogram::ExponentialBounds(1e-6, 2, 20))),
      save_latency_(&metrics->GetHistogram("orbitkv_save_seconds",
                                           "Time from a save request to its blocks being copied and sealed",
                                           Histogram::ExponentialBounds(1e-5, 2, 20))),
      hit_blocks_dram_(&metrics->GetCounter("orbitkv_query_hit_blocks_total",
                                            "Blocks of answered queries by the tier that served "
                                            "them (a Loading op's blocks count once, at the "
                                            "answer after it)",
                                            {{"tier", "dram"}})),
      hit_blocks_ssd_(&metrics->GetCounter("orbitkv_query_hit_blocks_total", "", {{"tier", "ssd"}})),
      hit_blocks_remote_(&metrics->GetCounter("orbitkv_query_hit_blocks_total", "", {{"tier", "remote"}})),
      partial_answers_(
          &metrics->GetCounter("orbitkv_query_partial_answers_total",
                               "Partial hits: the prefix already in DRAM leased to a waiting engine while its chain's "
                               "Loading operation runs on (restored while the rest arrives)")),
      missed_blocks_(&metrics->GetCounter("orbitkv_query_missed_blocks_total",
                                          "Blocks of answered queries found nowhere: the engine recomputes them")),
      hits_(&metrics->GetCounter("orbitkv_cache_hits_total", "")),
      misses_(&metrics->GetCounter("orbitkv_cache_misses_total", "")),
      evictions_(&metrics->GetCounter("orbitkv_cache_evictions_total", "", {{"tier", "dram"}})) {}

CacheService::~CacheService() = default;

Result<CacheService::Target> CacheService::Resolve(uint64_t owner, uint64_t instance, uint32_t group) const {
  Target target;
  ORBITKV_ASSIGN_OR_RETURN(target.instance, instances_.Find(owner, instance));
  ORBITKV_ASSIGN_OR_RETURN(target.group, target.instance->FindGroup(group));
  return target;
}

bool CacheService::TryBeginOperation() {
  if (operations_.fetch_add(1, std::memory_order_relaxed) >= options_.max_operations) {
    operations_.fetch_sub(1, std::memory_order_relaxed);
    operation_rejections_->Increment();
    return false;
  }
  operations_active_->Add(1);
  return true;
}

void CacheService::EndOperation() {
  operations_.fetch_sub(1, std::memory_order_relaxed);
  operations_active_->Add(-1);
}

std::vector<LoadingStage> CacheService::PlanLoading(const std::vector<state::StateKey>& keys, size_t hits) {
  std::vector<LoadingStage> stages;
  size_t local_end = 0;  // where the local stages stop and a remote one would start
  if (ssd_ != nullptr && cache_->OnSsd(keys[hits])) {
    // The SSD stage covers the chain up to the end of its SSD run (all of it in single-host mode):
    // the tier skips the keys already in DRAM and reports pins on the prefix resident once it is
    // done.
    local_end = keys.size();
    if (remote_stage_) {
      local_end = hits;
      while (local_end < keys.size() && cache_->OnSsd(keys[local_end])) ++local_end;
    }
    LoadingStage ssd;
    ssd.name = "ssd";
    ssd.span = local_end;
    ssd.deadline = options_.ssd_load_deadline;
    ssd.start = [tier = ssd_,
                 keys = std::vector<state::StateKey>(keys.begin(), keys.begin() + static_cast<ptrdiff_t>(local_end))](
                    LoadingStage::Done done, LoadingStage::Progress) mutable {
      return tier->Load(std::move(keys), std::move(done));
    };
    stages.push_back(std::move(ssd));
  }
  // The rest may be on a peer (distributed mode): the remote stage pins what is resident at its
  // front and fetches the blocks after it.
  if (remote_stage_ && local_end < keys.size()) {
    std::optional<LoadingStage> remote =
        remote_stage_(std::vector<state::StateKey>(keys.begin() + static_cast<ptrdiff_t>(local_end), keys.end()));
    if (remote.has_value()) stages.push_back(std::move(*remote));
  }
  return stages;
}

Result<channel::QueryReply> CacheService::Query(uint64_t owner, const channel::QueryRequest& request) {
  Stopwatch watch;
  struct Observe {
    Histogram* histogram;
    Stopwatch& watch;
    ~Observe() { histogram->Observe(watch.ElapsedSeconds()); }
  } observe{query_latency_, watch};
  ORBITKV_ASSIGN_OR_RETURN(Target target, Resolve(owner, request.instance, request.group));
  // Keys are built in the instance's namespace: an engine can only ever ask for its own model's
  // blocks.
  std::vector<state::StateKey> keys;
  ORBITKV_RETURN_IF_ERROR(state::StateKey::AppendChain(
      target.instance->ns, request.group, request.first_token, request.page_tokens, request.natives,
      request.native_bytes, request.key_version, &keys, (request.flags & channel::kQueryFixedSpan) != 0));
  // Keys past what one lease can hold are never looked at (nor loaded).
  const size_t max_blocks = cache_->MaxQueryBlocks(target.group->padded_bytes);
  if (keys.size() > max_blocks) keys.erase(keys.begin() + static_cast<ptrdiff_t>(max_blocks), keys.end());
  if (keys.empty()) return channel::QueryReply::Miss();
  const LoadingChain chain{request.instance, request.group, keys.back().Hash64() ^ keys.size()};
  // Whether this chain's load had completed before the lookup: then its pins keep every block it
  // loaded resident during the lookup. (One completing meanwhile counts as running.)
  const std::optional<LoadingRegistry::Origin> origin =
      (ssd_ != nullptr || remote_stage_) ? loading_.CompletedOrigin(chain) : std::nullopt;
  const bool loaded = origin.has_value();
  Result<core::QueryResult> result = cache_->Query(request.instance, keys, target.group->padded_bytes);
  // A partial query while the chain's op runs: the prefix in DRAM now, leased, and the op goes on
  // (the engine restores this part while the rest arrives, then asks again). Counted once, by the
  // chain's final answer.
  if ((request.flags & channel::kQueryPartial) != 0 && !loaded && result.ok() && result->lease.has_value() &&
      result->hits < keys.size() && loading_.Running(chain)) {
    partial_answers_->Increment();
    return channel::QueryReply::Partial(static_cast<uint32_t>(result->hits), result->lease->Pack());
  }
  // A chain whose load completed is answered with what is in DRAM, even when the load stopped
  // short (DRAM full of pinned blocks, a bad record): loading again would stop at the same place,
  // and the engine would hear Loading forever.
  std::vector<LoadingStage> stages;
  if (!loaded && result.ok() && result->hits < keys.size()) stages = PlanLoading(keys, result->hits);
  if (stages.empty()) {
    // Answered without Loading: nobody will take what the chain's load holds or brings (the lease
    // pins it now).
    if (ssd_ != nullptr || remote_stage_) loading_.Forget(chain);
    if (!result.ok()) return result.status();
    CountAnswer(keys.size(), result->lease.has_value() ? result->hits : 0, origin);
    if (!result->lease.has_value()) return channel::QueryReply::Miss();
    return channel::QueryReply::Hit(static_cast<uint32_t>(result->hits), result->lease->Pack());
  }
  // The prefix continues below DRAM: load it and let the engine ask again. The DRAM part's lease
  // goes back; the next query leases the whole prefix at once.
  if (result->lease.has_value()) (void)cache_->ReleaseLease(request.instance, *result->lease);
  ORBITKV_ASSIGN_OR_RETURN(uint64_t op, loading_.Start(owner, chain, std::move(stages), result->hits));
  return channel::QueryReply::Loading(op);
}

void CacheService::CountAnswer(size_t blocks, size_t hits, const std::optional<LoadingRegistry::Origin>& origin) {
  missed_blocks_->Increment(blocks - hits);
  if (!origin.has_value()) {
    hit_blocks_dram_->Increment(hits);
    return;
  }
  // The hits DRAM held when the op started, then each stage's share of the rest (its span, in
  // order from the chain's start); hits past every span were in DRAM too.
  size_t counted = std::min(hits, origin->resident);
  hit_blocks_dram_->Increment(counted);
  size_t stage_end = 0;
  for (const auto& [name, span] : origin->stages) {
    stage_end += span;
    const size_t upto = std::min(hits, stage_end);
    if (upto <= counted) continue;
    Counter* tier = name == "ssd" ? hit_blocks_ssd_ : name == "remote" ? hit_blocks_remote_ : hit_blocks_dram_;
    tier->Increment(upto - counted);
    counted = upto;
  }
  hit_blocks_dram_->Increment(hits - counted);
}

Status CacheService::CheckRestore(const channel::RestoreRequest& request, const KvGroup& group,
                                  const core::LeaseUse& lease) {
  if (request.pages.size() > lease.pins().size()) {
    return Status::InvalidArgument(
        fmt::format("restore names {} pages but the lease holds {} blocks", request.pages.size(), lease.pins().size()));
  }
  for (size_t i = 0; i < request.pages.size(); ++i) {
    if (request.pages[i] == channel::kSkipPage) continue;
    if (request.pages[i] >= group.num_pages) {
      return Status::InvalidArgument(
          fmt::format("destination page {} is beyond the group's {} pages", request.pages[i], group.num_pages));
    }
    if (lease.pins()[i].bytes() != group.block_bytes) {
      return Status::FailedPrecondition(fmt::format("leased block {} has {} bytes but the group's pages hold {}", i,
                                                    lease.pins()[i].bytes(), group.block_bytes));
    }
  }
  return Status::Ok();
}

uint64_t CacheService::RestoreFragments(const channel::RestoreRequest& request, const KvGroup& group,
                                        const core::LeaseUse& lease, size_t begin, size_t end, core::CopyBatch* batch) {
  const size_t first = request.layers ? request.first_buffer : 0;
  const size_t count = request.layers ? request.buffer_count : group.buffers.size();
  batch->fragments.reserve(batch->fragments.size() + (end - begin) * count);
  uint64_t bytes = 0;
  for (size_t i = begin; i < end; ++i) {
    if (request.pages[i] == channel::kSkipPage) continue;
    // The copy engine only reads from the pool on restore.
    bytes += group.AppendFragments(request.pages[i], const_cast<uint8_t*>(lease.pins()[i].data()), &batch->fragments,
                                   first, count);
  }
  return bytes;
}

namespace {

// One restore in flight: its reply, claim and totals, and its batches (one or two), the last of
// which to drain finishes it with the first error.
struct RestoreJoint {
  RestoreJoint(int parts, CacheService::Done<channel::RestoreReply> reply, std::function<void()> claim_finish)
      : done(std::move(reply)), claimed(std::move(claim_finish)), remaining(parts) {}
  // True for the caller that ended the last part; `*outcome` is then the restore's status.
  bool PartDone(const Status& status, Status* outcome) {
    MutexLock lock(&mu);
    if (!status.ok() && error.ok()) error = status;
    if (--remaining > 0) return false;
    *outcome = error;
    return true;
  }
  CacheService::Done<channel::RestoreReply> done;
  std::function<void()> claimed;
  uint64_t total = 0;      // whole before the last batch is submitted (read by the last to drain)
  double handed_over = 0;  // arrival to the first batch's hand-over
  Mutex mu;
  int remaining GUARDED_BY(mu);
  Status error GUARDED_BY(mu);
};

}  // namespace

void CacheService::Restore(uint64_t owner, const channel::RestoreRequest& request, Done<channel::RestoreReply> done,
                           ClaimFn claim) {
  const Stopwatch watch;
  Result<Target> target = Resolve(owner, request.instance, request.group);
  if (!target.ok()) return done(target.status());
  const KvGroup& group = *target->group;
  // A whole restore (or the last part of a layer-wise one) consumes the lease: its pins end with
  // this operation, whatever happens, also when it cannot start (the engine, which may have given
  // up on it, never has to release it). An earlier part copies under pins of its own and leaves the
  // lease for the next part.
  const core::LeaseId id = core::LeaseId::Unpack(request.lease);
  auto refuse = [&](Status status) {
    if (request.consume_lease) (void)cache_->ReleaseLease(request.instance, id);
    done(std::move(status));
  };
  if (request.layers && (request.first_buffer >= group.buffers.size() ||
                         request.buffer_count > group.buffers.size() - request.first_buffer)) {
    return refuse(
        Status::InvalidArgument(fmt::format("layer restore of buffers [{}, +{}) but the group has {} buffers",
                                            request.first_buffer, request.buffer_count, group.buffers.size())));
  }
  if (!TryBeginOperation()) {
    return refuse(
        Status::ResourceExhausted("too many restores and saves in flight; the lease was released: query again"));
  }
  Result<core::LeaseUse> use =
      request.consume_lease ? cache_->ConsumeLease(request.instance, id) : cache_->BorrowLease(request.instance, id);
  if (!use.ok()) {
    EndOperation();
    return done(use.status());
  }
  auto lease = std::make_shared<core::LeaseUse>(std::move(*use));
  // The copy engine's worker wakes while the fragments are built.
  const size_t expected_buffer = request.layers ? request.first_buffer : 0;
  if (expected_buffer < group.buffers.size()) {
    group.engine->Expect(group.buffers[expected_buffer].id, core::CopyDirection::kRestore);
  }
  if (Status valid = CheckRestore(request, group, *lease); !valid.ok()) {
    lease->Reset();
    EndOperation();
    return done(valid);
  }
  const size_t pages = request.pages.size();
  // CacheServiceOptions::restore_lead_pages: a long whole restore is two batches.
  const size_t lead_pages = options_.restore_lead_pages;
  const size_t lead = !request.layers && lead_pages > 0 && pages > 4 * lead_pages ? lead_pages : pages;
  core::CopyBatch batch;
  batch.direction = core::CopyDirection::kRestore;
  uint64_t total = RestoreFragments(request, group, *lease, 0, lead, &batch);
  // Pages past the lead that are all skipped make no second batch.
  bool split = lead < pages && std::any_of(request.pages.begin() + lead, request.pages.end(),
                                           [](uint32_t p) { return p != channel::kSkipPage; });
  if (split && batch.fragments.empty()) {  // nothing to send ahead: one batch of the rest
    total += RestoreFragments(request, group, *lease, lead, pages, &batch);
    split = false;
  }
  if (batch.fragments.empty()) {
    lease->Reset();
    EndOperation();
    return done(channel::RestoreReply{0});
  }
  // The last moment before the engine's pages are written: the engine may have abandoned it.
  if (claim.claim && !claim.claim()) {
    lease->Reset();
    EndOperation();
    restores_abandoned_->Increment();
    return done(
        Status::Aborted("the engine abandoned this restore before it started; nothing was "
                        "written"));
  }
  auto finish = std::make_shared<RestoreJoint>(split ? 2 : 1, std::move(done), claim.finish);
  auto part_done = [this, owner, lease, finish, keep = target->group, watch](Status status) {
    CheckFault(owner, status);
    Status outcome;
    if (!finish->PartDone(status, &outcome)) return;
    // The copy drained: pins, reservation and the operation's slot go back before the engine
    // hears of it (its next request must find them free).
    if (finish->claimed) finish->claimed();
    lease->Reset();
    if (outcome.ok()) {
      restored_bytes_->Increment(finish->total);
      restore_submit_latency_->Observe(finish->handed_over);
      restore_latency_->Observe(watch.ElapsedSeconds());
    }
    EndOperation();
    finish->done(outcome.ok() ? Result<channel::RestoreReply>(
                                    channel::RestoreReply{finish->total, static_cast<uint64_t>(MonoNanos())})
                              : Result<channel::RestoreReply>(outcome));
  };
  // A batch the copy engine refused ends its part with that error (nothing of it was written); the
  // restore still finishes only once every batch it accepted drained.
  const auto submit = [&](core::CopyBatch copy) {
    if (Status submitted = group.engine->Submit(std::move(copy), part_done); !submitted.ok()) {
      part_done(std::move(submitted));
      return false;
    }
    return true;
  };
  finish->handed_over = watch.ElapsedSeconds();
  finish->total = total;
  const bool lead_accepted = submit(std::move(batch));
  if (!split) return;
  // A refused lead ended the first part with its error; the rest, never built, ends the second.
  if (!lead_accepted) return part_done(Status::Ok());
  // The rest, built while the copy engine moves the lead.
  core::CopyBatch rest;
  rest.direction = core::CopyDirection::kRestore;
  finish->total += RestoreFragments(request, group, *lease, lead, pages, &rest);
  submit(std::move(rest));
}

void CacheService::Save(uint64_t owner, const channel::SaveRequest& request, Done<channel::SaveReply> done,
                        ClaimFn claim) {
  const Stopwatch watch;
  Result<Target> target = Resolve(owner, request.instance, request.group);
  if (!target.ok()) return done(target.status());
  const KvGroup& group = *target->group;
  if (Status valid = CheckSaveItems(request, target->instance->ns, group.num_pages); !valid.ok()) {
    return done(valid);
  }
  if (!TryBeginOperation()) {
    return done(Status::ResourceExhausted("too many restores and saves in flight; retry"));
  }
  struct Work {
    std::vector<core::BlockWriter> writers;
    // With write-through, the keys of the writers (in order) to queue for SSD once sealed.
    std::vector<state::StateKey> through_keys;
    Done<channel::SaveReply> done;
  };
  auto work = std::make_shared<Work>();
  const bool write_through = ssd_ != nullptr && options_.ssd_write_through;
  core::CopyBatch batch;
  batch.direction = core::CopyDirection::kSave;
  uint64_t skipped = 0;
  work->writers.reserve(request.items.size());
  batch.fragments.reserve(request.items.size() * group.buffers.size());
  for (const channel::SaveItem& item : request.items) {
    Result<core::BlockWriter> writer = cache_->Prepare(item.key, group.block_bytes);
    if (!writer.ok()) {
      // The save-skip rule: already resident or being written by someone else, nothing to copy; a
      // full pool, skip: the engine keeps its pages and the cache misses this block later.
      ++skipped;
      continue;
    }
    group.AppendFragments(item.page, writer->data(), &batch.fragments);
    work->writers.push_back(std::move(*writer));
    if (write_through) work->through_keys.push_back(item.key);
  }
  save_skipped_->Increment(skipped);
  if (work->writers.empty()) {
    EndOperation();
    return done(channel::SaveReply{0, skipped});
  }
  work->done = std::move(done);
  const uint64_t bytes = work->writers.size() * group.block_bytes;
  Status submitted = group.engine->Submit(std::move(batch), [this, owner, work, keep = target->group, skipped, bytes,
                                                             watch, claim = std::move(claim)](Status status) {
    CheckFault(owner, status);
    // The copy is over; the engine may have given up on it meanwhile and reused its pages, so
    // what was read is sealed only if the Manager claims the save now.
    if (status.ok() && claim.claim && !claim.claim()) {
      saves_abandoned_->Increment();
      status = Status::Aborted(
          "the engine abandoned this save (its wait ran out); nothing of "
          "it is sealed");
    }
    uint64_t written = 0;
    if (status.ok()) {
      cache_->SealAll(work->writers);  // one lock per table shard for the whole save
      for (const state::StateKey& key : work->through_keys) ssd_->OnSealed(key);
      written = work->writers.size();
      saved_bytes_->Increment(bytes);
      save_latency_->Observe(watch.ElapsedSeconds());
    }
    work->writers.clear();  // unsealed writers abort and free their memory
    if (claim.finish) claim.finish();
    EndOperation();
    work->done(status.ok() ? Result<channel::SaveReply>(channel::SaveReply{written, skipped})
                           : Result<channel::SaveReply>(status));
  });
  if (!submitted.ok()) {
    work->writers.clear();
    EndOperation();
    work->done(submitted);
  }
}

void CacheService::CheckFault(uint64_t owner, const Status& status) const {
  // The copy engines report engine memory that vanished under a copy as DATA_LOSS, and nothing
  // else.
  if (status.code() == StatusCode::kDataLoss && options_.on_engine_fault) {
    options_.on_engine_fault(owner, status);
  }
}

Status CacheService::Release(uint64_t owner, const channel::ReleaseRequest& request) {
  ORBITKV_RETURN_IF_ERROR(instances_.Find(owner, request.instance).status());
  return cache_->ReleaseLease(request.instance, core::LeaseId::Unpack(request.lease));
}

Result<bool> CacheService::Cancel(uint64_t owner, const channel::CancelRequest& request) {
  ORBITKV_RETURN_IF_ERROR(instances_.Find(owner, request.instance).status());
  // The reads drain on their own; what they bring into DRAM stays cached for later queries.
  return loading_.Cancel(request.instance, request.op);
}

void CacheService::WaitLoading(uint64_t owner, const channel::WaitLoadingRequest& request,
                               Done<channel::WaitLoadingReply> done) {
  Status owned = instances_.Find(owner, request.instance).status();
  if (!owned.ok()) return done(owned);
  loading_.Wait(
      request.instance, request.op, Deadline::After(std::chrono::milliseconds(request.timeout_ms)),
      [done = std::move(done)](Result<LoadingState> state) {
        if (!state.ok()) return done(state.status());
        done(channel::WaitLoadingReply{state->resident, state->completed});
      },
      request.min_resident);
}

size_t CacheService::RetireInstance(EngineInstance& instance) {
  instance.retired.store(true, std::memory_order_release);
  loading_.DropInstance(instance.id);
  return cache_->CleanupInstance(instance.id);
}

CacheServiceStats CacheService::Stats() const {
  CacheServiceStats stats;
  stats.incarnation = cache_->incarnation();
  stats.cache = cache_->GetStats();
  stats.operations_active = operations_active();
  stats.hits = hits_->Value();
  stats.misses = misses_->Value();
  stats.evictions = evictions_->Value();
  stats.partial_answers = partial_answers_->Value();
  if (ssd_ != nullptr) {
    stats.ssd = ssd_->Stats();
    stats.ssd_write_staging = ssd_->write_staging();
  }
  return stats;
}

std::string CacheServiceStats::ToJson(std::string_view extra) const {
  std::string ssd_json = "null";
  if (ssd.has_value()) {
    ssd_json = fmt::format(
        "{{\"capacity_bytes\": {}, \"used_bytes\": {}, \"records\": {}, "
        "\"recovered_records\": {}, \"writes\": {}, \"written_bytes\": {}, \"reads\": {}, "
        "\"read_bytes\": {}, \"verify_failures\": {}, \"writeback_dropped\": {}, "
        "\"admission_filtered\": {}, \"write_errors\": {}, \"admissions_enabled\": {}, "
        "\"registered_io\": {}, \"write_staging\": \"{}\"}}",
        ssd->capacity_bytes, ssd->used_bytes, ssd->records, ssd->recovered_records, ssd->writes, ssd->written_bytes,
        ssd->reads, ssd->read_bytes, ssd->verify_failures, ssd->queue_drops, ssd->filtered, ssd->write_errors,
        ssd->admissions_enabled ? "true" : "false", ssd->registered_io, storage::WriteStagingName(ssd_write_staging));
  }
  return fmt::format(
      "{{\"incarnation\": {}, \"pool_capacity_bytes\": {}, \"pool_allocated_bytes\": {}, "
      "\"resident_blocks\": {}, \"resident_bytes\": {}, \"pinned_blocks\": {}, "
      "\"leases_active\": {}, \"query_reserved_bytes\": {}, \"operations_active\": {}, "
      "\"hits\": {}, \"misses\": {}, \"evictions\": {}, \"query_partial_answers\": {}, "
      "\"ssd\": {}{}}}",
      incarnation, cache.pool.capacity_bytes, cache.pool.allocated_bytes, cache.table.resident_blocks,
      cache.table.resident_bytes, cache.table.pinned_blocks, cache.leases_active, cache.query_reserved_bytes,
      operations_active, hits, misses, evictions, partial_answers, ssd_json, extra);
}

}  // namespace orbitkv::server
