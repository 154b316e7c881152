#include "catalog/owner_streamer.h"

#include <algorithm>
#include <thread>

#include "base/logging.h"

namespace orbitkv::catalog {

CatalogRecord ToCatalogRecord(const core::ResidencyRecord& record) {
  return CatalogRecord{
      record.key, static_cast<uint8_t>(record.tier), record.present, record.sequence, record.generation, record.bytes};
}

Result<std::unique_ptr<OwnerStreamer>> OwnerStreamer::Create(Options options, core::ResidencyInventory* inventory,
                                                             CatalogTransport* transport) {
  if (options.max_batch_records == 0 || options.page_records == 0) {
    return Status::InvalidArgument("owner streamer: batch and page sizes must be positive");
  }
  ORBITKV_ASSIGN_OR_RETURN(core::InventorySubscriber subscriber, inventory->Subscribe(options.shard));
  return std::unique_ptr<OwnerStreamer>(new OwnerStreamer(std::move(options), inventory, transport, subscriber));
}

OwnerStreamer::OwnerStreamer(Options options, core::ResidencyInventory* inventory, CatalogTransport* transport,
                             core::InventorySubscriber subscriber)
    : options_(std::move(options)),
      inventory_(inventory),
      subscriber_(subscriber),
      owner_runtime_(options_.owner_runtime),
      owner_epoch_(options_.owner_epoch),
      transport_(transport) {}

void OwnerStreamer::Rebind(const std::string& owner_runtime, int64_t owner_epoch, CatalogTransport* transport) {
  owner_runtime_ = owner_runtime;
  owner_epoch_ = owner_epoch;
  transport_ = transport;
  // Where it was, at once: streaming resumes from the acknowledged sequence (the catalog answers GAP or RESYNC if
  // it needs more); a snapshot that was due stays due; a refusal of the old registration is forgotten.
  backoff_ = std::chrono::milliseconds(0);
  backoff_until_ = MonoNow();
  if (state_ == State::kStopped) state_ = State::kStreaming;
}

OwnerStreamer::~OwnerStreamer() { inventory_->Unsubscribe(options_.shard, subscriber_); }

namespace {

uint64_t NextSnapshotId() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace

StreamId OwnerStreamer::Id() const {
  return StreamId{options_.owner_node,  owner_runtime_, options_.shard,
                  catalog_incarnation_, owner_epoch_,   inventory_->incarnation()};
}

void OwnerStreamer::Backoff(State resume) {
  backoff_ = std::clamp(backoff_ * 2, options_.backoff_min, options_.backoff_max);
  // Jittered (a uniform half to all of the step): the 16 streams of every owner that lost the same catalog
  // host do not come back in lockstep.
  const double share = 0.5 + 0.5 * std::uniform_real_distribution<double>(0.0, 1.0)(jitter_);
  backoff_until_ = MonoNow() + std::chrono::duration_cast<MonoClock::duration>(backoff_ * share);
  resume_ = resume;
  state_ = State::kBackoff;
}

void OwnerStreamer::OnTrouble(const Result<CatalogReply>& reply, bool in_snapshot) {
  if (in_snapshot) {
    snapshot_aborts_.fetch_add(1, std::memory_order_relaxed);
    if (failed_snapshots_.fetch_add(1, std::memory_order_relaxed) + 1 == options_.snapshot_attempts) {
      ORBITKV_LOG_WARN("catalog: shard {} to '{}' did not converge after {} snapshots (still trying): {}",
                       options_.shard, options_.catalog_node, options_.snapshot_attempts,
                       reply.ok() ? reply->reason : reply.status().ToString());
    }
  }
  if (!reply.ok()) {  // unreachable or slow: back off, then resend (receivers deduplicate) or snapshot again
    Backoff(in_snapshot ? State::kSnapshot : State::kStreaming);
    return;
  }
  if (reply->catalog_incarnation != 0) catalog_incarnation_ = reply->catalog_incarnation;
  switch (reply->kind) {
    case CatalogReply::Kind::kAck:
      break;
    case CatalogReply::Kind::kGap:
      gaps_.fetch_add(1, std::memory_order_relaxed);
      acked_ = reply->applied_sequence;  // resend from what it applied (or snapshot if that is gone)
      state_ = State::kStreaming;
      break;
    case CatalogReply::Kind::kResync:
      state_ = State::kSnapshot;
      if (in_snapshot) Backoff(State::kSnapshot);
      break;
    case CatalogReply::Kind::kRetryLater:
      // A catalog whose member view is incomplete (it or this owner registering again) answers this to a delta or
      // a heartbeat too: streaming resumes from the acknowledged sequence, and the catalog asks for a snapshot
      // only if it needs one.
      Backoff(in_snapshot ? State::kSnapshot : State::kStreaming);
      break;
    case CatalogReply::Kind::kRefused:
      ORBITKV_LOG_WARN("catalog: '{}' refuses shard {} of this start: {}", options_.catalog_node, options_.shard,
                       reply->reason);
      state_ = State::kStopped;
      break;
  }
}

bool OwnerStreamer::Step() {
  switch (state_.load(std::memory_order_relaxed)) {
    case State::kStopped:
      return false;
    case State::kBackoff:
      if (MonoNow() < backoff_until_) return false;
      state_ = resume_;
      return resume_ == State::kSnapshot ? Snapshot() : Stream(acked_.load(std::memory_order_relaxed));
    case State::kSnapshot:
      return Snapshot();
    case State::kStreaming:
      if (inventory_->resync_required(options_.shard, subscriber_)) {
        state_ = State::kSnapshot;
        return Snapshot();
      }
      return Stream(acked_.load(std::memory_order_relaxed));
  }
  return false;
}

bool OwnerStreamer::Stream(uint64_t after) {
  Result<core::JournalRead> read =
      inventory_->ReadJournal(options_.shard, subscriber_, after, options_.max_batch_records);
  if (!read.ok() || read->resync_required) {  // history the catalog lacks is gone: snapshot
    state_ = State::kSnapshot;
    return true;
  }
  if (read->records.empty()) return false;
  DeltaBatch batch;
  batch.stream = Id();
  batch.first_sequence = read->records.front().sequence;
  batch.oldest_age_us = static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(MonoNow() - read->records.front().applied_at).count());
  batch.records.reserve(read->records.size());
  for (const core::ResidencyRecord& r : read->records) batch.records.push_back(ToCatalogRecord(r));
  Result<CatalogReply> reply = transport_->Deliver(options_.catalog_node, batch);
  if (reply.ok() && reply->kind == CatalogReply::Kind::kAck) {
    catalog_incarnation_ = reply->catalog_incarnation;
    acked_ = reply->applied_sequence;
    inventory_->Acknowledge(options_.shard, subscriber_, reply->applied_sequence);
    backoff_ = std::chrono::milliseconds(0);
    return true;
  }
  OnTrouble(reply, /*in_snapshot=*/false);
  return true;
}

bool OwnerStreamer::Snapshot() {
  snapshots_.fetch_add(1, std::memory_order_relaxed);
  // Unique in this process, not only in this streamer: a catalog host keeps an owner's slice across the owner's
  // registrations (the same start), and a streamer made for a new registration must not replay an id it installed.
  const uint64_t id = NextSnapshotId();
  // 1. The start of the cut.
  const uint64_t w0 = inventory_->Watermark(options_.shard);
  SnapshotBegin begin{Id(), id, w0, inventory_->Size(options_.shard)};
  Result<CatalogReply> reply = transport_->Deliver(options_.catalog_node, begin);
  if (reply.ok() && reply->kind == CatalogReply::Kind::kResync && reply->catalog_incarnation != catalog_incarnation_) {
    catalog_incarnation_ = reply->catalog_incarnation;  // a new catalog start: address it and begin again
    begin.stream = Id();
    reply = transport_->Deliver(options_.catalog_node, begin);
  }
  if (!reply.ok() || reply->kind != CatalogReply::Kind::kAck) {
    OnTrouble(reply, true);
    return true;
  }
  catalog_incarnation_ = reply->catalog_incarnation;
  // 2. The current view, in bounded pages with a stable cursor; after each page the interval's changes so far
  //    travel too (interval pages), so the journal need only hold what changes while one page is taken, not a
  //    whole scan's changes.
  uint64_t interval_through = w0;  // the interval (w0, interval_through] has been sent
  SnapshotEnd end{Id(), id, 0, {}};
  // Reads the journal after interval_through up to `upto` into end.interval, sending full chunks as interval
  // pages (all of it with `flush`); false when the snapshot had to stop (already handled).
  const auto send_interval = [&](uint64_t upto, bool flush) {
    while (interval_through < upto) {
      Result<core::JournalRead> read = inventory_->ReadJournal(options_.shard, subscriber_, interval_through,
                                                               std::max<size_t>(options_.max_batch_records, 1));
      if (!read.ok()) {  // the interval overflowed the journal: abort this snapshot, retry later
        OnTrouble(Result<CatalogReply>(CatalogReply{CatalogReply::Kind::kRetryLater, 0, 0,
                                                    "the snapshot's interval overflowed the journal"}),
                  true);
        return false;
      }
      for (const core::ResidencyRecord& r : read->records) {
        if (r.sequence > upto) break;
        end.interval.push_back(ToCatalogRecord(r));
        interval_through = r.sequence;
      }
      if (read->records.empty()) break;
      if (end.interval.size() >= options_.max_batch_records || (flush && !end.interval.empty())) {
        SnapshotPage chunk{Id(), id, std::move(end.interval), /*interval=*/true};
        end.interval.clear();
        Result<CatalogReply> sent = transport_->Deliver(options_.catalog_node, chunk);
        if (!sent.ok() || sent->kind != CatalogReply::Kind::kAck) {
          OnTrouble(sent, true);
          return false;
        }
      }
    }
    return true;
  };
  std::optional<core::InventoryCursor> cursor;
  for (;;) {
    core::InventoryPage page = inventory_->Scan(options_.shard, cursor ? &*cursor : nullptr, options_.page_records);
    SnapshotPage message{Id(), id, {}};
    message.records.reserve(page.records.size());
    for (const core::InventoryRecord& r : page.records) {
      message.records.push_back(
          CatalogRecord{r.key, static_cast<uint8_t>(r.tier), true, r.version, r.generation, r.bytes});
    }
    if (!message.records.empty()) {
      reply = transport_->Deliver(options_.catalog_node, message);
      snapshot_records_.fetch_add(message.records.size(), std::memory_order_relaxed);
      if (!reply.ok() || reply->kind != CatalogReply::Kind::kAck) {
        OnTrouble(reply, true);
        return true;
      }
    }
    if (!page.next) break;
    cursor = page.next;
    if (!send_interval(page.watermark, /*flush=*/true)) return true;
  }
  // 3. The end of the cut and every change in (w0, w1] not sent yet.
  const uint64_t w1 = inventory_->Watermark(options_.shard);
  end.end_watermark = w1;
  if (!send_interval(w1, /*flush=*/false)) return true;
  reply = transport_->Deliver(options_.catalog_node, end);
  if (!reply.ok() || reply->kind != CatalogReply::Kind::kAck) {
    OnTrouble(reply, true);
    return true;
  }
  // 4. Commit: only if nothing after w1 was dropped meanwhile (else the catalog would miss it).
  Status committed = inventory_->CommitSnapshot(options_.shard, subscriber_, w1);
  if (!committed.ok()) {
    OnTrouble(
        Result<CatalogReply>(CatalogReply{CatalogReply::Kind::kResync, 0, catalog_incarnation_, committed.ToString()}),
        true);
    return true;
  }
  acked_ = w1;
  failed_snapshots_ = 0;
  backoff_ = std::chrono::milliseconds(0);
  state_ = State::kStreaming;
  return true;
}

bool OwnerStreamer::Heartbeat() {
  if (state() != State::kStreaming) return false;
  DeltaBatch beat;
  beat.stream = Id();
  beat.first_sequence = acked_.load(std::memory_order_relaxed) + 1;
  Result<CatalogReply> reply = transport_->Deliver(options_.catalog_node, beat);
  if (reply.ok() && reply->kind == CatalogReply::Kind::kAck) return true;
  OnTrouble(reply, /*in_snapshot=*/false);
  return true;
}

void OwnerStreamer::Run(const std::atomic<bool>& stop) {
  MonoTime last_sent = MonoNow();
  while (!stop.load(std::memory_order_acquire)) {
    if (Step()) {
      last_sent = MonoNow();
      continue;
    }
    if (MonoNow() - last_sent >= options_.heartbeat_interval) {  // idle: tell the catalog where we are
      Heartbeat();
      last_sent = MonoNow();
      continue;
    }
    if (state() == State::kStopped) return;
    if (state() == State::kBackoff) {
      std::this_thread::sleep_for(std::min<std::chrono::milliseconds>(backoff_, std::chrono::milliseconds(100)));
      continue;
    }
    // Idle: sleep until the journal moves, then let a few more changes gather into the batch.
    if (inventory_->WaitForChange(options_.shard, acked_.load(std::memory_order_relaxed),
                                  Deadline::After(std::chrono::milliseconds(100)))) {
      std::this_thread::sleep_for(options_.batch_delay);
    }
  }
}

}  // namespace orbitkv::catalog
