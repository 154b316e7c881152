#include "core/ssd_tier.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <optional>

#include "base/clock.h"
#include "base/logging.h"
#include "storage/record.h"

namespace orbitkv::core {

// One Load(): the keys it waits for and how each ended.
struct SsdTier::LoadJob {
  // Per key of the prefix, a pin on its DRAM block once it is there; written by waiters before
  // `remaining`.
  std::vector<BlockPin> pins;
  // Acq_rel: the waiter that brings it to zero sees every other waiter's pin.
  std::atomic<size_t> remaining{0};
  LoadDone done;

  void Finish() {
    size_t loaded = 0;
    while (loaded < pins.size() && pins[loaded].valid()) ++loaded;
    // Pins past the first gap protect nothing the caller can use: they go with the job.
    pins.resize(loaded);
    done(std::move(pins));
  }
};

Result<std::unique_ptr<SsdTier>> SsdTier::Create(const SsdTierOptions& options, BlockCache* cache,
                                                 MetricsRegistry* metrics) {
  if (options.writer_threads == 0 || options.reader_threads == 0 || options.writes_in_flight < options.writer_threads) {
    return Status::InvalidArgument(
        "the SSD tier needs at least one writer and one reader thread, and a write in flight per "
        "writer");
  }
  std::vector<storage::RecoveredRecord> recovered;
  storage::ScanReport report;
  ORBITKV_ASSIGN_OR_RETURN(std::unique_ptr<storage::SsdStore> store,
                           storage::SsdStore::Open(options.store, &recovered, &report));
  // Payloads go straight between the pool's arenas and the device: register them (io_uring fixed
  // buffers) so the kernel does not map their pages on every request.
  std::vector<std::span<uint8_t>> arenas;
  for (size_t i = 0; i < cache->pool().arena_count(); ++i) {
    const PinnedArena& arena = cache->pool().arena(i);
    arenas.emplace_back(arena.data(), arena.size());
  }
  ORBITKV_RETURN_IF_ERROR(store->RegisterMemory(arenas));
  std::unique_ptr<SsdTier> tier(new SsdTier(options, cache, metrics, std::move(store)));
  tier->scan_report_ = report;
  tier->Recover(std::move(recovered));
  SsdTier* raw = tier.get();
  if (options.policy == SsdWritePolicy::kWriteBack) {
    cache->table().SetEvictionListener(
        [raw](const state::StateKey& key, BlockPin pin) { raw->Enqueue(key, std::move(pin)); });
  }
  for (uint32_t i = 0; i < options.writer_threads; ++i) {
    // writes_in_flight spread over the writers (the first ones take the remainder).
    const uint32_t depth = options.writes_in_flight / options.writer_threads +
                           (i < options.writes_in_flight % options.writer_threads ? 1 : 0);
    tier->threads_.emplace_back([raw, depth] { raw->WriterLoop(depth); });
  }
  for (uint32_t i = 0; i < options.reader_threads; ++i) {
    tier->threads_.emplace_back([raw] { raw->ReaderLoop(); });
  }
  return tier;
}

SsdTier::SsdTier(const SsdTierOptions& options, BlockCache* cache, MetricsRegistry* metrics,
                 std::unique_ptr<storage::SsdStore> store)
    : options_(options), cache_(cache), store_(std::move(store)) {
  writes_ = &metrics->GetCounter("orbitkv_ssd_writes_total", "Records written to the SSD tier.");
  written_bytes_ = &metrics->GetCounter("orbitkv_ssd_written_bytes_total", "Payload bytes written to SSD.");
  reads_ = &metrics->GetCounter("orbitkv_ssd_reads_total", "Records read back from the SSD tier.");
  read_bytes_ = &metrics->GetCounter("orbitkv_ssd_read_bytes_total", "Payload bytes read back from SSD.");
  verify_failures_ = &metrics->GetCounter("orbitkv_ssd_verify_failures_total",
                                          "SSD reads whose record was torn, corrupted or reused: served as a miss.");
  queue_drops_ = &metrics->GetCounter("orbitkv_ssd_writeback_dropped_total",
                                      "Evicted blocks not written because the queue was full.");
  filtered_ =
      &metrics->GetCounter("orbitkv_ssd_admission_filtered_total", "Evicted blocks not written: accessed too rarely.");
  write_errors_ = &metrics->GetCounter("orbitkv_ssd_write_errors_total", "SSD writes the device failed.");
  evictions_ = &metrics->GetCounter("orbitkv_cache_evictions_total", "", {{"tier", "ssd"}});
  used_bytes_ = &metrics->GetGauge("orbitkv_ssd_used_bytes", "SSD bytes holding records.");
  records_gauge_ = &metrics->GetGauge("orbitkv_ssd_records", "Records on the SSD tier.");
  admissions_enabled_gauge_ = &metrics->GetGauge(
      "orbitkv_ssd_admissions_enabled", "1 while the SSD tier accepts new blocks; 0 after a device write error.");
  admissions_enabled_gauge_->Set(1);
  metrics->GetGauge("orbitkv_ssd_capacity_bytes", "SSD tier capacity.")
      .Set(static_cast<double>(store_->capacity_bytes()));
  refilled_ = MonoNow();
}

SsdTier::~SsdTier() { Shutdown(); }

void SsdTier::Recover(std::vector<storage::RecoveredRecord> records) {
  // Oldest first, so the FIFO evicts in write order and a key found twice keeps its newest record.
  std::sort(records.begin(), records.end(), [](const auto& a, const auto& b) { return a.write_epoch < b.write_epoch; });
  MutexLock lock(&mu_);
  for (storage::RecoveredRecord& record : records) {
    auto it = live_.find(record.key);
    if (it != live_.end()) {
      store_->Release(it->second.locator, it->second.bytes);
      live_.erase(it);
    }
    const uint64_t generation =
        cache_->table().PublishSsd(record.key, record.locator, record.payload_bytes, TransitionCause::kRestore);
    live_[record.key] = Live{generation, record.locator, record.payload_bytes};
    fifo_.push_back(FifoEntry{record.key, generation});
  }
  recovered_records_ = live_.size();
  records_gauge_->Set(static_cast<double>(live_.size()));
  used_bytes_->Set(static_cast<double>(store_->allocated_bytes()));
}

void SsdTier::OnSealed(const state::StateKey& key) {
  if (options_.policy != SsdWritePolicy::kWriteThrough) return;
  Result<BlockPin> pin = cache_->table().Pin(key);
  if (pin.ok()) Enqueue(key, std::move(*pin));
}

void SsdTier::Enqueue(const state::StateKey& key, BlockPin pin) {
  if (!admissions_enabled_.load(std::memory_order_acquire)) return;
  if (options_.policy == SsdWritePolicy::kWriteBack && options_.min_frequency > 1 &&
      cache_->table().Frequency(key) < options_.min_frequency) {
    filtered_->Increment();
    return;
  }
  if (cache_->table().FindSsd(key).has_value()) return;  // already on SSD
  const uint64_t bytes = pin.bytes();
  {
    MutexLock lock(&mu_);
    if (stopping_) return;
    if (queued_bytes_ + bytes > options_.queue_bytes) {
      queue_drops_->Increment();
      return;
    }
    queued_bytes_ += bytes;
    write_queue_.push_back(WriteJob{key, std::move(pin)});
  }
  write_cv_.notify_one();
}

std::optional<SsdTier::WriteJob> SsdTier::TakeJob(bool wait) {
  std::optional<WriteJob> job;
  MutexLock lock(&mu_);
  while (wait && write_queue_.empty() && !stopping_) write_cv_.wait(mu_);
  if (write_queue_.empty()) return job;
  job.emplace(std::move(write_queue_.front()));
  write_queue_.pop_front();
  queued_bytes_ -= job->pin.bytes();
  ++writes_in_flight_;
  return job;
}

void SsdTier::EndJob(std::optional<WriteJob>& job) {
  job.reset();  // the evicted DRAM block is freed here
  {
    MutexLock lock(&mu_);
    --writes_in_flight_;
  }
  idle_cv_.notify_all();
}

void SsdTier::WriterLoop(uint32_t depth) {
  Result<std::unique_ptr<storage::SsdStore::Writer>> created = store_->NewWriter(depth);
  if (!created.ok()) {
    // No way to write (the ring could not be set up): stop admissions and drop what is queued.
    DisableAdmissions(created.status());
    for (std::optional<WriteJob> job = TakeJob(true); job.has_value(); job = TakeJob(true)) {
      EndJob(job);
    }
    return;
  }
  storage::SsdStore::Writer& writer = **created;
  // Start() and Wait() fail only when called out of turn, which this loop never does.
  const auto must = [](const Status& status) { ORBITKV_CHECK_MSG(status.ok(), "SSD writer: {}", status.ToString()); };
  // Jobs whose record is prepared or at the disk, by tag.
  std::map<uint64_t, std::optional<WriteJob>> active;
  uint64_t next_tag = 0;
  std::optional<uint64_t> prepared;
  for (;;) {
    if (!prepared.has_value()) {
      // Wait for work only when nothing is in flight; otherwise a completion is what to wait for.
      std::optional<WriteJob> job = TakeJob(/*wait=*/writer.in_flight() == 0);
      if (job.has_value()) {
        const uint64_t tag = next_tag++;
        if (PrepareJob(writer, *job, tag)) {
          active.emplace(tag, std::move(job));
          prepared = tag;
        } else {
          EndJob(job);
        }
        continue;
      }
      if (writer.in_flight() == 0) return;  // stopping, and everything is written
    }
    if (prepared.has_value() && writer.in_flight() < writer.depth()) {
      must(writer.Start());
      prepared.reset();
      continue;
    }
    Result<storage::SsdStore::Writer::Done> done = writer.Wait();
    must(done.status());
    // The prepared record takes the freed place at once, before this one is published.
    if (prepared.has_value()) {
      must(writer.Start());
      prepared.reset();
    }
    auto it = active.find(done->tag);
    ORBITKV_CHECK(it != active.end());
    FinishJob(*it->second, done->locator);
    EndJob(it->second);
    active.erase(it);
  }
}

void SsdTier::SpendWriteBudget(uint64_t bytes) {
  if (options_.write_bytes_per_second == 0) return;
  const double rate = static_cast<double>(options_.write_bytes_per_second);
  MutexLock lock(&mu_);
  for (;;) {
    const MonoTime now = MonoNow();
    const double elapsed = std::chrono::duration<double>(now - refilled_).count();
    refilled_ = now;
    // The bucket holds at most one second of budget, so an idle period does not allow a burst
    // larger than that.
    tokens_ = std::min(rate, tokens_ + elapsed * rate);
    if (tokens_ >= static_cast<double>(bytes) || tokens_ >= rate || stopping_) {
      tokens_ -= static_cast<double>(bytes);
      return;
    }
    const double wait = (static_cast<double>(bytes) - tokens_) / rate;
    write_cv_.wait_for(mu_, std::chrono::duration<double>(std::min(wait, 0.1)));
  }
}

bool SsdTier::PrepareJob(storage::SsdStore::Writer& writer, WriteJob& job, uint64_t tag) {
  if (!admissions_enabled_.load(std::memory_order_acquire)) return false;
  if (cache_->table().FindSsd(job.key).has_value()) return false;
  SpendWriteBudget(job.pin.bytes());
  const std::span<const uint8_t> payload(job.pin.data(), job.pin.bytes());
  // Pool blocks are 4 KiB-aligned and their memory is rounded up to 4 KiB: written in place.
  const uint64_t capacity = storage::PaddedPayloadBytes(payload.size());
  Status prepared = writer.Prepare(job.key, payload, capacity, tag);
  // A full store makes room by evicting its oldest records, a few times at most.
  for (int attempt = 0; prepared.code() == StatusCode::kResourceExhausted && attempt < 8; ++attempt) {
    if (!EvictOldest(storage::RecordBytes(payload.size()))) break;
    prepared = writer.Prepare(job.key, payload, capacity, tag);
  }
  if (prepared.ok()) return true;
  if (prepared.code() != StatusCode::kResourceExhausted) {
    write_errors_->Increment();
    DisableAdmissions(prepared);
  }
  return false;
}

void SsdTier::FinishJob(WriteJob& job, const Result<uint64_t>& locator) {
  if (!locator.ok()) {
    write_errors_->Increment();
    DisableAdmissions(locator.status());
    return;
  }
  const uint64_t bytes = job.pin.bytes();
  writes_->Increment();
  written_bytes_->Increment(bytes);
  const uint64_t generation = cache_->table().PublishSsd(job.key, *locator, bytes, TransitionCause::kAdmit);
  MutexLock lock(&mu_);
  auto it = live_.find(job.key);
  if (it != live_.end()) {
    // Another writer won the race for the same key: PublishSsd replaced its residence, so its
    // extent is ours to free.
    store_->Release(it->second.locator, it->second.bytes);
  }
  live_[job.key] = Live{generation, *locator, bytes};
  fifo_.push_back(FifoEntry{job.key, generation});
  records_gauge_->Set(static_cast<double>(live_.size()));
  used_bytes_->Set(static_cast<double>(store_->allocated_bytes()));
}

bool SsdTier::EvictOldest(uint64_t bytes) {
  uint64_t freed = 0;
  std::vector<FifoEntry> victims;
  {
    MutexLock lock(&mu_);
    while (freed < bytes && !fifo_.empty()) {
      FifoEntry entry = std::move(fifo_.front());
      fifo_.pop_front();
      auto it = live_.find(entry.key);
      if (it == live_.end() || it->second.generation != entry.generation) continue;  // gone
      freed += storage::RecordBytes(it->second.bytes);
      store_->Release(it->second.locator, it->second.bytes);
      live_.erase(it);
      victims.push_back(std::move(entry));
    }
    records_gauge_->Set(static_cast<double>(live_.size()));
    used_bytes_->Set(static_cast<double>(store_->allocated_bytes()));
  }
  for (const FifoEntry& victim : victims) {
    (void)cache_->table().DropSsd(victim.key, victim.generation, TransitionCause::kEvict);
    evictions_->Increment();
  }
  return !victims.empty();
}

void SsdTier::Forget(const state::StateKey& key, uint64_t generation, TransitionCause cause) {
  {
    MutexLock lock(&mu_);
    auto it = live_.find(key);
    if (it == live_.end() || it->second.generation != generation) return;
    store_->Release(it->second.locator, it->second.bytes);
    live_.erase(it);
    records_gauge_->Set(static_cast<double>(live_.size()));
    used_bytes_->Set(static_cast<double>(store_->allocated_bytes()));
  }
  (void)cache_->table().DropSsd(key, generation, cause);
}

void SsdTier::DisableAdmissions(const Status& why) {
  if (admissions_enabled_.exchange(false, std::memory_order_acq_rel)) {
    ORBITKV_LOG_ERROR(
        "ssd: a write failed ({}); new SSD admissions are disabled until the Manager restarts. "
        "Blocks already on SSD are still served and DRAM service continues.",
        why.ToString());
    admissions_enabled_gauge_->Set(0);
  }
}

Status SsdTier::Load(std::vector<state::StateKey> keys, LoadDone done) {
  std::vector<Residence> tiers;
  const size_t prefix = cache_->table().LookupPrefixTiers(keys, &tiers);
  auto job = std::make_shared<LoadJob>();
  job->pins.resize(prefix);
  job->done = std::move(done);
  std::vector<size_t> to_read;
  for (size_t i = 0; i < prefix; ++i) {
    if (tiers[i] == Residence::kDram) {
      // Pinned now, so the reads of the others cannot evict it; gone meanwhile, it is read.
      Result<BlockPin> pin = cache_->table().Pin(keys[i]);
      if (pin.ok()) {
        job->pins[i] = std::move(*pin);
        continue;
      }
      if (!cache_->table().FindSsd(keys[i]).has_value()) break;  // a gap: the prefix ends here
    }
    to_read.push_back(i);
  }
  {
    MutexLock lock(&mu_);
    if (stopping_) return Status::Unavailable("the SSD tier is shutting down");
  }
  // One extra count held by this function, so the job cannot finish while waiters are attached.
  job->remaining.store(to_read.size() + 1, std::memory_order_relaxed);
  size_t queued = 0;
  for (size_t i : to_read) {
    const bool leader = cache_->coalescer().Join(keys[i], [this, job, i, key = keys[i]](const Status& status) {
      // Pinned as the read completes (on the reader that sealed it, before any other of its
      // reads): a block evicted in between is left out, and the prefix ends before it.
      if (status.ok()) {
        Result<BlockPin> pin = cache_->table().Pin(key);
        if (pin.ok()) job->pins[i] = std::move(*pin);
      }
      if (job->remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) job->Finish();
    });
    if (leader) {
      MutexLock lock(&mu_);
      read_queue_.push_back(ReadTask{keys[i]});
      ++queued;
    }
  }
  if (queued > 0) read_cv_.notify_all();
  if (job->remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) job->Finish();
  return Status::Ok();
}

void SsdTier::ReaderLoop() {
  storage::AlignedBuffer staging;
  std::vector<ReadTask> tasks;
  for (;;) {
    tasks.clear();
    {
      MutexLock lock(&mu_);
      // Readers drain every queued read before exiting, so every Load's callback runs.
      while (read_queue_.empty() && !stopping_) read_cv_.wait(mu_);
      if (read_queue_.empty()) return;
      // A few at once: their records are read as one batch per file, in offset order.
      while (!read_queue_.empty() && tasks.size() < kReadBatch) {
        tasks.push_back(std::move(read_queue_.front()));
        read_queue_.pop_front();
      }
    }
    ReadMany(tasks, &staging);
  }
}

void SsdTier::ReadMany(std::vector<ReadTask>& tasks, storage::AlignedBuffer* staging) {
  struct Pending {
    size_t task;
    SsdResidence residence;
    BlockWriter writer;
  };
  std::vector<Pending> pending;
  // Pins on the blocks sealed here, held until every waiter pinned its own (Complete): another
  // reader's Prepare cannot evict a block between its seal and its waiters.
  std::vector<BlockPin> sealed;
  std::vector<storage::SsdStore::BatchRead> reads;
  std::vector<Status> statuses(tasks.size());
  for (size_t t = 0; t < tasks.size(); ++t) {
    const state::StateKey& key = tasks[t].key;
    std::optional<SsdResidence> residence = cache_->table().FindSsd(key);
    if (!residence.has_value()) {
      statuses[t] = Status::NotFound("the block left the SSD tier");
      continue;
    }
    // The DRAM block first, so the payload is read straight into it; an error aborts the writer.
    Result<BlockWriter> writer = cache_->Prepare(key, residence->bytes);
    if (!writer.ok()) {
      // Already in DRAM (a save or another load won): the block is there, which is what was asked.
      statuses[t] = writer.status().code() == StatusCode::kAlreadyExists ? Status::Ok() : writer.status();
      continue;
    }
    pending.push_back(Pending{t, *residence, std::move(*writer)});
  }
  for (Pending& p : pending) {
    reads.push_back(storage::SsdStore::BatchRead{
        &tasks[p.task].key, p.residence.locator, p.residence.bytes,
        std::span<uint8_t>(p.writer.data(), storage::PaddedPayloadBytes(p.residence.bytes)), Status::Ok()});
  }
  store_->ReadBatch(reads, staging);
  for (size_t i = 0; i < pending.size(); ++i) {
    Pending& p = pending[i];
    const Status& read = reads[i].status;
    if (read.ok()) {
      reads_->Increment();
      read_bytes_->Increment(p.residence.bytes);
      cache_->Seal(p.writer, TransitionCause::kRestore, &sealed.emplace_back());
    } else if (read.code() == StatusCode::kDataLoss) {
      verify_failures_->Increment();
      ORBITKV_LOG_WARN("ssd: {}; served as a miss and dropped", read.message());
      Forget(tasks[p.task].key, p.residence.generation, TransitionCause::kCleanup);
    }
    statuses[p.task] = read;
  }
  pending.clear();  // unsealed writers abort: nothing of a bad read is ever published
  for (size_t t = 0; t < tasks.size(); ++t) cache_->coalescer().Complete(tasks[t].key, statuses[t]);
  BlockPin::ReleaseAll(&sealed);
}

SsdTier::PersistReport SsdTier::PersistDram(MonoTime deadline,
                                            const std::function<void(const PersistReport&)>& progress) {
  Stopwatch watch;
  PersistReport report;
  const uint64_t writes_before = writes_->Value();
  const uint64_t bytes_before = written_bytes_->Value();
  const auto update = [&] {
    report.written = writes_->Value() - writes_before;
    report.written_bytes = written_bytes_->Value() - bytes_before;
    report.seconds = watch.ElapsedSeconds();
  };
  MonoTime next_progress = MonoNow() + std::chrono::seconds(2);
  const auto maybe_progress = [&] {
    if (!progress || MonoNow() < next_progress) return;
    next_progress = MonoNow() + std::chrono::seconds(2);
    update();
    progress(report);
  };
  const uint32_t min_frequency = options_.policy == SsdWritePolicy::kWriteBack ? options_.min_frequency : 0;
  const std::vector<state::StateKey> keys = cache_->table().DramOnlyKeys(min_frequency);
  report.candidates = keys.size();
  bool stop = false;
  for (size_t i = 0; i < keys.size() && !stop; ++i) {
    if (!admissions_enabled_.load(std::memory_order_acquire)) break;
    Result<BlockPin> pin = cache_->table().Pin(keys[i]);
    if (!pin.ok()) continue;  // evicted meanwhile (and written back then, if admitted)
    const uint64_t bytes = pin->bytes();
    for (bool queued = false; !queued && !stop;) {
      {
        MutexLock lock(&mu_);
        if (stopping_ || MonoNow() >= deadline) {
          report.timed_out = !stopping_;
          stop = true;
        } else if (queued_bytes_ == 0 || queued_bytes_ + bytes <= options_.queue_bytes) {
          // Unlike evictions, a full queue is waited for rather than dropped.
          queued_bytes_ += bytes;
          write_queue_.push_back(WriteJob{keys[i], std::move(*pin)});
          ++report.queued;
          queued = true;
        } else {
          idle_cv_.wait_for(mu_, std::chrono::milliseconds(10));
        }
      }
      if (queued) write_cv_.notify_one();
      maybe_progress();
    }
  }
  for (bool drained = false; !drained;) {
    {
      MutexLock lock(&mu_);
      drained = write_queue_.empty() && writes_in_flight_ == 0;
      if (!drained && MonoNow() >= deadline) {
        report.timed_out = true;
        break;
      }
      if (!drained) idle_cv_.wait_for(mu_, std::chrono::milliseconds(10));
    }
    maybe_progress();
  }
  update();
  return report;
}

void SsdTier::Flush() {
  MutexLock lock(&mu_);
  while (!write_queue_.empty() || writes_in_flight_ > 0) idle_cv_.wait(mu_);
}

void SsdTier::Shutdown() {
  std::call_once(shutdown_once_, [this] {
    std::deque<WriteJob> dropped;
    {
      MutexLock lock(&mu_);
      stopping_ = true;
      dropped.swap(write_queue_);
      queued_bytes_ = 0;
    }
    write_cv_.notify_all();
    read_cv_.notify_all();
    idle_cv_.notify_all();
    dropped.clear();  // their DRAM pins go
    for (std::thread& thread : threads_) thread.join();
    threads_.clear();
    if (options_.policy == SsdWritePolicy::kWriteBack) {
      cache_->table().SetEvictionListener(nullptr);
    }
  });
}

SsdTierStats SsdTier::Stats() const {
  SsdTierStats stats;
  stats.capacity_bytes = store_->capacity_bytes();
  stats.used_bytes = store_->allocated_bytes();
  {
    MutexLock lock(&mu_);
    stats.records = live_.size();
  }
  stats.recovered_records = recovered_records_;
  stats.writes = writes_->Value();
  stats.written_bytes = written_bytes_->Value();
  stats.reads = reads_->Value();
  stats.read_bytes = read_bytes_->Value();
  stats.verify_failures = verify_failures_->Value();
  stats.queue_drops = queue_drops_->Value();
  stats.filtered = filtered_->Value();
  stats.write_errors = write_errors_->Value();
  stats.admissions_enabled = admissions_enabled_.load(std::memory_order_acquire);
  stats.registered_io = store_->registered_requests();
  return stats;
}

}  // namespace orbitkv::core
