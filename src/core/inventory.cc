#include "core/inventory.h"

#include <algorithm>
#include <utility>

#include "base/check.h"
#include "base/logging.h"

namespace orbitkv::core {
namespace {

Status NotRecording() {
  return Status::FailedPrecondition(
      "this residency inventory keeps no journal: it belongs to a Manager without a catalog "
      "(single-host; distributed mode records it)");
}

}  // namespace

const char* TierName(Tier tier) {
  switch (tier) {
    case Tier::kDram:
      return "dram";
    case Tier::kSsd:
      return "ssd";
  }
  return "unknown";
}

const char* TransitionCauseName(TransitionCause cause) {
  switch (cause) {
    case TransitionCause::kAdmit:
      return "admit";
    case TransitionCause::kReplace:
      return "replace";
    case TransitionCause::kEvict:
      return "evict";
    case TransitionCause::kRestore:
      return "restore";
    case TransitionCause::kCleanup:
      return "cleanup";
  }
  return "unknown";
}

Result<std::unique_ptr<ResidencyInventory>> ResidencyInventory::Create(const Options& options,
                                                                       MetricsRegistry* metrics) {
  if (options.shards == 0) return Status::InvalidArgument("inventory needs at least one shard");
  if (options.journal_bytes / options.shards < kRecordCharge) {
    return Status::InvalidArgument(
        fmt::format("inventory journal of {} bytes cannot hold one {}-byte record in each of {} shards",
                    options.journal_bytes, kRecordCharge, options.shards));
  }
  ORBITKV_CHECK(metrics != nullptr);
  return std::unique_ptr<ResidencyInventory>(new ResidencyInventory(options, metrics));
}

ResidencyInventory::ResidencyInventory(const Options& options, MetricsRegistry* metrics)
    : incarnation_(options.incarnation),
      record_(options.record),
      journal_records_per_shard_(options.journal_bytes / options.shards / kRecordCharge) {
  shards_.reserve(options.shards);
  for (uint32_t i = 0; i < options.shards; ++i) shards_.push_back(std::make_unique<Shard>());
  records_total_ = &metrics->GetCounter("orbitkv_inventory_records_total",
                                        "Residency transitions recorded in the inventory journal");
  resync_total_ =
      &metrics->GetCounter("orbitkv_inventory_resync_total",
                           "Times a subscriber of a journal shard had a record it had not acknowledged dropped, and "
                           "must resync");
  journal_records_ =
      &metrics->GetGauge("orbitkv_inventory_journal_records", "Records retained in the inventory journals");
}

uint32_t ResidencyInventory::ShardFor(const state::StateKey& key) const {
  // Without a catalog the placement need not match other hosts': the in-process hash spreads the
  // shard mutexes as well, without the SHA-256.
  return record_ ? state::ShardOf(key, shard_count()) : static_cast<uint32_t>(key.Hash64() % shard_count());
}

uint64_t ResidencyInventory::Apply(uint32_t shard_index, const state::StateKey& key, Tier tier, bool present,
                                   TransitionCause cause, uint64_t generation, uint64_t bytes) {
  ORBITKV_CHECK(shard_index < shards_.size());
  Shard& shard = *shards_[shard_index];
  MutexLock lock(&shard.mu);
  const uint64_t sequence = ++shard.last_sequence;
  if (record_) RecordLocked(shard_index, shard, sequence, key, tier, present, cause, generation, bytes);
  if (shard.waiters > 0) shard.changed.notify_all();
  return sequence;
}

void ResidencyInventory::RecordLocked(uint32_t shard_index, Shard& shard, uint64_t sequence, const state::StateKey& key,
                                      Tier tier, bool present, TransitionCause cause, uint64_t generation,
                                      uint64_t bytes) {
  const ViewKey view_key{key, tier, ScanHash(key, tier)};
  auto& bucket = shard.view[BucketOf(view_key.hash)];
  if (present) {
    shard.view_size += bucket.insert_or_assign(view_key, ViewValue{generation, bytes, sequence}).second ? 1 : 0;
  } else {
    auto it = bucket.find(view_key);
    ORBITKV_CHECK_MSG(it != bucket.end(), "inventory: removing {} residence of {} that it does not hold",
                      TierName(tier), key.ToString());
    bucket.erase(it);
    --shard.view_size;
  }
  int64_t retained_delta = 1;
  if (shard.journal.size() >= journal_records_per_shard_) {
    DropOldestLocked(shard_index, shard);
    retained_delta = 0;
  }
  shard.journal.push_back(ResidencyRecord{sequence, key, tier, present, cause, generation, bytes, MonoNow()});
  records_total_->Increment();
  if (retained_delta != 0) journal_records_->Add(static_cast<double>(retained_delta));
}

void ResidencyInventory::DropOldestLocked(uint32_t shard_index, Shard& shard) {
  const uint64_t dropped = shard.journal.front().sequence;
  for (auto& [id, subscription] : shard.subscribers) {
    if (subscription.acked_sequence >= dropped || subscription.resync) continue;
    // This subscriber never saw the record: only a snapshot can tell it what the journal lost.
    subscription.resync = true;
    resync_total_->Increment();
    ORBITKV_LOG_WARN(
        "inventory shard {}: journal full ({} records), subscriber {} (acknowledged {}) must "
        "resync",
        shard_index, shard.journal.size(), id, subscription.acked_sequence);
  }
  shard.journal.pop_front();
}

Result<JournalRead> ResidencyInventory::ReadJournal(uint32_t shard_index, uint64_t after_sequence,
                                                    size_t max_records) const {
  return ReadJournal(shard_index, 0, after_sequence, max_records);
}

Result<JournalRead> ResidencyInventory::ReadJournal(uint32_t shard_index, InventorySubscriber subscriber,
                                                    uint64_t after_sequence, size_t max_records) const {
  if (shard_index >= shards_.size()) {
    return Status::InvalidArgument(fmt::format("inventory shard {} out of range", shard_index));
  }
  if (!record_) return NotRecording();
  const Shard& shard = *shards_[shard_index];
  MutexLock lock(&shard.mu);
  if (after_sequence > shard.last_sequence) {
    return Status::InvalidArgument(fmt::format("inventory shard {}: sequence {} is beyond the watermark {}",
                                               shard_index, after_sequence, shard.last_sequence));
  }
  JournalRead read;
  read.watermark = shard.last_sequence;
  if (subscriber != 0) {
    auto it = shard.subscribers.find(subscriber);
    if (it == shard.subscribers.end()) {
      return Status::NotFound(fmt::format("inventory shard {}: no subscriber {}", shard_index, subscriber));
    }
    read.resync_required = it->second.resync;
  }
  if (after_sequence == shard.last_sequence) return read;
  // Records are contiguous in sequence, so the first wanted one is at a computable index.
  const uint64_t oldest = shard.journal.empty() ? shard.last_sequence + 1 : shard.journal.front().sequence;
  if (after_sequence + 1 < oldest) {
    return Status::OutOfRange(
        fmt::format("inventory shard {}: records after {} were dropped (oldest retained {}); take a snapshot",
                    shard_index, after_sequence, oldest));
  }
  const size_t begin = static_cast<size_t>(after_sequence + 1 - oldest);
  const size_t end = std::min(shard.journal.size(), begin + max_records);
  read.records.assign(shard.journal.begin() + static_cast<std::ptrdiff_t>(begin),
                      shard.journal.begin() + static_cast<std::ptrdiff_t>(end));
  return read;
}

Result<InventorySubscriber> ResidencyInventory::Subscribe(uint32_t shard_index) {
  if (shard_index >= shards_.size()) {
    return Status::InvalidArgument(fmt::format("inventory shard {} out of range", shard_index));
  }
  if (!record_) return NotRecording();
  Shard& shard = *shards_[shard_index];
  MutexLock lock(&shard.mu);
  const InventorySubscriber id = shard.next_subscriber++;
  shard.subscribers.emplace(id, Subscription{});
  return id;
}

void ResidencyInventory::Unsubscribe(uint32_t shard_index, InventorySubscriber subscriber) {
  ORBITKV_CHECK(shard_index < shards_.size());
  Shard& shard = *shards_[shard_index];
  MutexLock lock(&shard.mu);
  shard.subscribers.erase(subscriber);
}

void ResidencyInventory::Acknowledge(uint32_t shard_index, InventorySubscriber subscriber, uint64_t sequence) {
  ORBITKV_CHECK(shard_index < shards_.size());
  Shard& shard = *shards_[shard_index];
  MutexLock lock(&shard.mu);
  auto it = shard.subscribers.find(subscriber);
  if (it == shard.subscribers.end()) return;
  it->second.acked_sequence = std::max(it->second.acked_sequence, std::min(sequence, shard.last_sequence));
  // Retention follows the slowest live subscriber: what every one of them acknowledged goes.
  uint64_t slowest = UINT64_MAX;
  for (const auto& [id, subscription] : shard.subscribers) {
    slowest = std::min(slowest, subscription.acked_sequence);
  }
  size_t trimmed = 0;
  while (!shard.journal.empty() && shard.journal.front().sequence <= slowest) {
    shard.journal.pop_front();
    ++trimmed;
  }
  if (trimmed != 0) journal_records_->Add(-static_cast<double>(trimmed));
}

bool ResidencyInventory::resync_required(uint32_t shard_index, InventorySubscriber subscriber) const {
  ORBITKV_CHECK(shard_index < shards_.size());
  const Shard& shard = *shards_[shard_index];
  MutexLock lock(&shard.mu);
  auto it = shard.subscribers.find(subscriber);
  return it == shard.subscribers.end() || it->second.resync;
}

Status ResidencyInventory::CommitSnapshot(uint32_t shard_index, InventorySubscriber subscriber,
                                          uint64_t end_watermark) {
  if (shard_index >= shards_.size()) {
    return Status::InvalidArgument(fmt::format("inventory shard {} out of range", shard_index));
  }
  Shard& shard = *shards_[shard_index];
  MutexLock lock(&shard.mu);
  auto it = shard.subscribers.find(subscriber);
  if (it == shard.subscribers.end()) {
    return Status::NotFound(fmt::format("inventory shard {}: no subscriber {}", shard_index, subscriber));
  }
  if (end_watermark > shard.last_sequence) {
    return Status::InvalidArgument(fmt::format("inventory shard {}: snapshot end {} is beyond the watermark {}",
                                               shard_index, end_watermark, shard.last_sequence));
  }
  const uint64_t oldest = shard.journal.empty() ? shard.last_sequence + 1 : shard.journal.front().sequence;
  if (oldest > end_watermark + 1) {
    // A record after the cut is gone: committing would hide it from this subscriber for good.
    it->second.resync = true;
    return Status::Aborted(
        fmt::format("inventory shard {}: records after the snapshot's end {} were dropped (oldest retained "
                    "{}); take the snapshot again",
                    shard_index, end_watermark, oldest));
  }
  it->second.acked_sequence = end_watermark;
  it->second.resync = false;
  return Status::Ok();
}

bool ResidencyInventory::WaitForChange(uint32_t shard_index, uint64_t after_sequence, Deadline deadline) const {
  ORBITKV_CHECK(shard_index < shards_.size());
  const Shard& shard = *shards_[shard_index];
  MutexLock lock(&shard.mu);
  while (shard.last_sequence <= after_sequence) {
    if (deadline.Expired()) return false;
    ++shard.waiters;
    if (deadline.IsInfinite()) {
      shard.changed.wait(shard.mu);
    } else {
      shard.changed.wait_until(shard.mu, deadline.when());
    }
    --shard.waiters;
  }
  return true;
}

InventoryPage ResidencyInventory::Scan(uint32_t shard_index, const InventoryCursor* after, size_t max_records) const {
  ORBITKV_CHECK(shard_index < shards_.size());
  ORBITKV_CHECK(max_records >= 1);
  const Shard& shard = *shards_[shard_index];
  // The scan order: (hash, key, tier); buckets are hash ranges in that order.
  using Entry = std::pair<const ViewKey, ViewValue>;
  const auto before = [](const ViewKey& a, const ViewKey& b) {
    if (a.hash != b.hash) return a.hash < b.hash;
    if (auto c = a.key <=> b.key; c != 0) return c < 0;
    return a.tier < b.tier;
  };
  InventoryPage page;
  std::optional<ViewKey> cursor;
  if (after != nullptr) cursor = ViewKey{after->key, after->tier, ScanHash(after->key, after->tier)};
  // Whole buckets from the cursor's on, each sorted, until one record more than the page (it tells whether the
  // scan goes on) or the last bucket. Sorted by hash alone first (contiguous, no key loads): keys are compared
  // only where hashes are equal. The buffers are allocated before the mutex is taken.
  std::vector<std::pair<uint64_t, const Entry*>> found;
  found.reserve(2 * max_records + 1024);
  page.records.reserve(max_records);
  MutexLock lock(&shard.mu);
  page.watermark = shard.last_sequence;
  for (size_t b = cursor ? BucketOf(cursor->hash) : 0; b < kViewBuckets && found.size() <= max_records; ++b) {
    const size_t first = found.size();
    for (const Entry& entry : shard.view[b]) {
      if (!cursor || before(*cursor, entry.first)) found.emplace_back(entry.first.hash, &entry);
    }
    std::sort(found.begin() + static_cast<std::ptrdiff_t>(first), found.end(), [&](const auto& x, const auto& y) {
      return x.first != y.first ? x.first < y.first : before(x.second->first, y.second->first);
    });
  }
  const bool more = found.size() > max_records;
  if (more) found.resize(max_records);
  for (const auto& [hash, entry] : found) {
    page.records.push_back(InventoryRecord{entry->first.key, entry->first.tier, entry->second.generation,
                                           entry->second.bytes, entry->second.version});
  }
  if (more) page.next = InventoryCursor{page.records.back().key, page.records.back().tier};
  return page;
}

uint64_t ResidencyInventory::Watermark(uint32_t shard_index) const {
  ORBITKV_CHECK(shard_index < shards_.size());
  const Shard& shard = *shards_[shard_index];
  MutexLock lock(&shard.mu);
  return shard.last_sequence;
}

size_t ResidencyInventory::Size(uint32_t shard_index) const {
  ORBITKV_CHECK(shard_index < shards_.size());
  const Shard& shard = *shards_[shard_index];
  MutexLock lock(&shard.mu);
  return shard.view_size;
}

uint64_t ResidencyInventory::ReplicaCount(Tier tier) const {
  uint64_t count = 0;
  for (const auto& shard : shards_) {
    MutexLock lock(&shard->mu);
    for (const auto& bucket : shard->view) {
      for (const auto& [key, value] : bucket) count += key.tier == tier ? 1 : 0;
    }
  }
  return count;
}

}  // namespace orbitkv::core
