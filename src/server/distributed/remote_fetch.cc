#include "server/distributed/remote_fetch.h"

#include <future>
#include <random>

#include "base/logging.h"
#include "transfer/descriptor.h"

namespace orbitkv::server {
namespace {

uint64_t RandomBase() {
  std::random_device device;
  return (static_cast<uint64_t>(device()) << 32 | device()) & ~0xffffffull;
}

}  // namespace

RemoteFetcher::RemoteFetcher(Options options, core::BlockCache* cache, catalog::CandidateIndex* index,
                             catalog::Discovery* discovery, catalog::SourceTransport* sources,
                             transfer::TransferEngine* engine, std::vector<transfer::RegionHandle> arenas,
                             MetricsRegistry* metrics)
    : options_(std::move(options)),
      cache_(cache),
      index_(index),
      discovery_(discovery),
      sources_(sources),
      engine_(engine),
      arenas_(std::move(arenas)),
      next_request_(RandomBase()) {
  core::Budget::Options staging;
  staging.name = "remote_staging";
  staging.global_bytes =
      options_.staging_budget_bytes != 0 ? options_.staging_budget_bytes : cache_->pool().Stats().capacity_bytes / 4;
  staging_ = std::make_unique<core::Budget>(std::move(staging), metrics);
  for (size_t i = 0; i < options_.threads; ++i) threads_.emplace_back([this] { Work(); });
}

RemoteFetcher::~RemoteFetcher() { Stop(); }

void RemoteFetcher::Stop() {
  std::deque<Job> left;
  {
    MutexLock lock(&mu_);
    stop_ = true;
    left.swap(queue_);
  }
  wake_.notify_all();
  for (std::thread& t : threads_) {
    if (t.joinable()) t.join();
  }
  for (Job& job : left) job.done({});
}

std::optional<LoadingStage> RemoteFetcher::Stage(std::vector<state::StateKey> keys) {
  if (keys.empty() || (options_.can_work && !options_.can_work())) return std::nullopt;
  LoadingStage stage;
  stage.name = "remote";
  stage.span = keys.size();
  stage.deadline = options_.deadline;
  stage.start = [this, keys = std::move(keys)](LoadingStage::Done done,
                                               LoadingStage::Progress progress) mutable -> Status {
    {
      MutexLock lock(&mu_);
      if (!stop_ && queue_.size() < options_.max_queued) {
        queue_.push_back(
            Job{std::move(keys), Deadline::After(options_.deadline), std::move(done), std::move(progress)});
        wake_.notify_one();
        return Status::Ok();
      }
    }
    // Stopping, or too many fetches waiting: this one completes at once with nothing fetched (the local answer).
    done({});
    return Status::Ok();
  };
  return stage;
}

void RemoteFetcher::Work() {
  for (;;) {
    Job job;
    {
      MutexLock lock(&mu_);
      while (!stop_ && queue_.empty()) wake_.wait(mu_);
      if (stop_ && queue_.empty()) return;
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    std::optional<Fetched> fetched;
    std::vector<core::BlockPin> pins = Fetch(job, &fetched);
    job.done(std::move(pins));  // the engine's op completes first; the source's release follows
    if (fetched.has_value()) ReleaseGrant(fetched->authorized, fetched->request_id);
  }
}

std::pair<uint32_t, uint64_t> RemoteFetcher::Locate(const uint8_t* data) const {
  core::PinnedPool& pool = cache_->pool();
  for (uint32_t i = 0; i < pool.arena_count(); ++i) {
    const uint8_t* base = pool.arena(i).data();
    if (data >= base && data < base + pool.arena(i).size()) return {i, static_cast<uint64_t>(data - base)};
  }
  ORBITKV_CHECK(false && "a pool block outside the pool's arenas");
  return {0, 0};
}

std::vector<core::BlockPin> RemoteFetcher::Fetch(const Job& job, std::optional<Fetched>* fetched) {
  counts_.fetches.fetch_add(1, std::memory_order_relaxed);
  std::vector<core::BlockPin> pins;
  // What is resident at the front needs no fetch.
  size_t local = cache_->table().PinPrefix(job.keys, &pins);
  if (local == job.keys.size() || job.deadline.Expired()) return pins;
  // A fetch that waited in the queue asks again: the registration may have lapsed, or the view gone incomplete,
  // since its stage was made.
  if (options_.can_work && !options_.can_work()) return pins;
  // Another stage fetching from the same first key: wait for it, then take what it brought.
  std::optional<Flights<state::StateKey, state::StateKeyHash>::Ticket> flight =
      flights_.WaitOrStart(job.keys[local], job.deadline);
  if (!flight.has_value()) {
    counts_.shared.fetch_add(1, std::memory_order_relaxed);
    local += cache_->table().PinPrefix(std::span(job.keys).subspan(local), &pins);
    if (local == job.keys.size() || job.deadline.Expired()) return pins;
    flight.emplace(flights_.Start(job.keys[local]));
  }
  const std::span<const state::StateKey> rest(job.keys.data() + local, job.keys.size() - local);
  const catalog::Discovery::Outcome learnt = discovery_->Discover(rest);
  counts_.discovery_rpcs.fetch_add(learnt.rpcs, std::memory_order_relaxed);
  // One grant after another while a source says more of its span is coming (a span it reads from its SSD is
  // granted piece by piece, so this side reads one piece while the source reads the next): each grant but the
  // last is released as soon as it was read; the last one after the engine's operation completed.
  for (;;) {
    const std::span<const state::StateKey> todo(job.keys.data() + pins.size(), job.keys.size() - pins.size());
    catalog::AuthorizeOptions authorize;
    authorize.self_node = options_.self_node;
    authorize.request_id = next_request_.fetch_add(1, std::memory_order_relaxed);
    authorize.lifetime = std::chrono::duration_cast<std::chrono::milliseconds>(job.deadline.Remaining()) +
                         std::chrono::milliseconds(1000);
    authorize.deadline = job.deadline;
    ExcludeOpenSources(&authorize);
    catalog::AuthorizeOutcome outcome = catalog::AuthorizeBest(todo, *index_, *sources_, authorize);
    counts_.authorizations.fetch_add(outcome.attempts + outcome.polls, std::memory_order_relaxed);
    counts_.rejections.fetch_add(outcome.rejections, std::memory_order_relaxed);
    counts_.authorize_polls.fetch_add(outcome.polls, std::memory_order_relaxed);
    counts_.source_backpressure.fetch_add(outcome.backpressure, std::memory_order_relaxed);
    counts_.source_missing.fetch_add(outcome.missing, std::memory_order_relaxed);
    if (!outcome.authorized.has_value()) {
      if (todo.size() == rest.size()) {  // nothing at all came from a peer
        counts_.no_source.fetch_add(1, std::memory_order_relaxed);
      }
      if (!outcome.last_error.ok()) {
        ORBITKV_LOG_DEBUG("remote: no source for {} blocks: {}", todo.size(), outcome.last_error.ToString());
      }
      return pins;
    }
    ORBITKV_LOG_DEBUG(
        "remote: {} of {} blocks granted by {} ({} planned after {} local; {} discovery RPCs, {} "
        "authorizations, {} polls, {} rejected)",
        outcome.authorized->reply.grant.granted, todo.size(), outcome.authorized->span.node,
        outcome.authorized->span.versions.size(), pins.size(), learnt.rpcs, outcome.attempts, outcome.polls,
        outcome.rejections);
    // The reads end a little before the stage's deadline, so what arrived is reported while the op still waits.
    const Deadline reads = job.deadline.Remaining() > std::chrono::milliseconds(500)
                               ? Deadline::At(job.deadline.when() - std::chrono::milliseconds(250))
                               : job.deadline;
    const MonoTime started = MonoNow();
    const size_t before = pins.size();
    const bool transferred = ReadGranted(*outcome.authorized, reads, &pins, job.progress);
    const catalog::SourceGrant& grant = outcome.authorized->reply.grant;
    if (pins.size() > before) {
      counts_.fetch_ns.fetch_add(
          static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(MonoNow() - started).count()),
          std::memory_order_relaxed);
    }
    uint64_t from_ssd = 0;
    for (size_t i = 0; i < pins.size() - before && i < outcome.authorized->span.versions.size(); ++i) {
      from_ssd += outcome.authorized->span.versions[i].tier == catalog::kSourceSsd ? 1 : 0;
    }
    counts_.fetched_ssd_blocks.fetch_add(from_ssd, std::memory_order_relaxed);
    if (!transferred) {
      MutexLock lock(&mu_);
      source_open_until_[{outcome.authorized->span.node, outcome.authorized->span.runtime}] =
          MonoNow() + options_.source_breaker;
    }
    const bool more = transferred && grant.stop == catalog::SourceOutcome::kMore &&
                      pins.size() == before + grant.granted && pins.size() < job.keys.size() && !reads.Expired();
    if (!more) {
      *fetched = Fetched{std::move(*outcome.authorized), authorize.request_id};
      return pins;
    }
    ReleaseGrant(*outcome.authorized, authorize.request_id);
  }
}

void RemoteFetcher::ExcludeOpenSources(catalog::AuthorizeOptions* authorize) {
  MutexLock lock(&mu_);
  const MonoTime now = MonoNow();
  for (auto it = source_open_until_.begin(); it != source_open_until_.end();) {
    if (it->second <= now) {
      it = source_open_until_.erase(it);
    } else {
      authorize->excluded.insert(it->first);
      counts_.sources_skipped.fetch_add(1, std::memory_order_relaxed);
      ++it;
    }
  }
}

struct RemoteFetcher::GrantedRead {
  // One batch: consecutive blocks, their writers and the staging charge; it completes through `result`.
  struct Batch {
    std::vector<core::BlockWriter> writers;
    std::vector<core::BudgetTicket> staging;  // one per prepared block, until sealed or aborted
    MonoTime submitted;
    // Shared with the engine's callback: set_value may still be returning there when the worker's get() returns.
    std::shared_ptr<std::promise<transfer::BatchResult>> result =
        std::make_shared<std::promise<transfer::BatchResult>>();
    std::future<transfer::BatchResult> done;
    uint64_t bytes = 0;
    bool started = false;
  };
  const catalog::Authorized& authorized;
  Deadline deadline;
  std::vector<transfer::RegionDescriptor> remotes;
  uint64_t max_fragment = 0;
  size_t max_fragments = 0;
  size_t granted = 0;
  std::deque<std::unique_ptr<Batch>> in_flight;
  size_t next = 0;       // next granted block to prepare
  bool stopped = false;  // no more batches start (nothing left, no room, or a failure)
  bool failure = false;  // a batch failed: it and every later one are dropped
};

bool RemoteFetcher::StartBatch(GrantedRead& read) {
  const catalog::SourceGrant& grant = read.authorized.reply.grant;
  const catalog::Authorized& authorized = read.authorized;
  if (read.stopped || read.next >= read.granted || read.deadline.Expired()) return false;
  auto batch = std::make_unique<GrantedRead::Batch>();
  transfer::ReadBatchRequest request;
  request.peer = authorized.reply.ucx_address;
  request.grant = grant.grant_id;
  if (grant.grant_secret.size() == request.grant_secret.size()) {
    std::copy(grant.grant_secret.begin(), grant.grant_secret.end(), request.grant_secret.begin());
  }
  request.remotes = read.remotes;
  request.deadline = read.deadline;
  request.verify_checksum = true;
  while (read.next < read.granted) {
    const size_t next = read.next;
    const catalog::SourceGrant::Block& block = grant.blocks[next];
    if (block.bytes == 0 || (next < authorized.span.bytes.size() && block.bytes != authorized.span.bytes[next])) {
      ORBITKV_LOG_WARN("remote: {} granted block {} with {} bytes, the lookup said {}: not fetched",
                       authorized.span.node, next, block.bytes,
                       next < authorized.span.bytes.size() ? authorized.span.bytes[next] : 0);
      read.stopped = true;
      break;
    }
    const size_t pieces = static_cast<size_t>(1 + (block.bytes - 1) / read.max_fragment);
    if (!batch->writers.empty() && (batch->bytes + block.bytes > options_.max_batch_bytes ||
                                    request.fragments.size() + pieces > read.max_fragments)) {
      break;
    }
    const uint64_t class_bytes = cache_->pool().ClassBytes(block.bytes);
    Result<core::BudgetTicket> ticket = staging_->TryReserve(0, class_bytes);
    if (!ticket.ok()) {
      if (batch->writers.empty()) read.stopped = true;  // no staging room at all: stop the prefix here
      break;
    }
    Result<core::BlockWriter> writer = cache_->Prepare(authorized.span.versions[next].key, block.bytes);
    if (!writer.ok()) {
      // Already resident (another fetch or a save won), being written, or no room: the prefix stops here
      // (a later query finds what the other writer sealed).
      read.stopped = true;
      break;
    }
    batch->staging.push_back(std::move(*ticket));
    const auto [arena, offset] = Locate(writer->data());
    for (uint64_t at = 0; at < block.bytes; at += read.max_fragment) {
      transfer::Fragment fragment;
      fragment.remote = block.region;
      fragment.remote_offset = block.offset + at;
      fragment.local = arenas_[arena];
      fragment.local_offset = offset + at;
      fragment.length = std::min(read.max_fragment, block.bytes - at);
      request.fragments.push_back(fragment);
    }
    batch->bytes += block.bytes;
    batch->writers.push_back(std::move(*writer));
    ++read.next;
  }
  if (batch->writers.empty()) {
    read.stopped = true;
    return false;
  }
  batch->done = batch->result->get_future();
  Result<uint64_t> id = engine_->ReadBatch(
      std::move(request), [result = batch->result](const transfer::BatchResult& r) { result->set_value(r); });
  if (!id.ok()) {
    ORBITKV_LOG_WARN("remote: reading from {}: {}", authorized.span.node, id.status().ToString());
    read.stopped = read.failure = true;
    return false;  // `batch` (its writers abort, its charge returns) goes here: nothing was sent
  }
  batch->started = true;
  batch->submitted = MonoNow();
  read.in_flight.push_back(std::move(batch));
  return true;
}

bool RemoteFetcher::ReadGranted(const catalog::Authorized& authorized, Deadline deadline,
                                std::vector<core::BlockPin>* pins, const LoadingStage::Progress& progress) {
  const catalog::SourceGrant& grant = authorized.reply.grant;
  GrantedRead read{authorized, deadline};
  for (const auto& bytes : grant.regions) {
    Result<transfer::RegionDescriptor> descriptor = transfer::DecodeDescriptor(bytes);
    if (!descriptor.ok()) {
      ORBITKV_LOG_WARN("remote: {} sent a bad region descriptor: {}", authorized.span.node,
                       descriptor.status().ToString());
      counts_.failed.fetch_add(1, std::memory_order_relaxed);
      return false;
    }
    read.remotes.push_back(std::move(*descriptor));
  }
  const transfer::Capabilities caps = engine_->GetCapabilities();
  // Fragments of at most 1 MiB: the source checksums and sends one while the next is read (a 2.25 MiB block in
  // one fragment serializes both).
  read.max_fragment = std::min<uint64_t>(options_.max_fragment_bytes,
                                         caps.max_fragment_bytes != 0 ? caps.max_fragment_bytes : UINT64_MAX);
  read.max_fragments = caps.max_fragments_per_batch != 0 ? caps.max_fragments_per_batch : SIZE_MAX;
  read.granted = std::min(grant.granted, authorized.span.versions.size());
  uint64_t fetched_blocks = 0, fetched_bytes = 0;

  while (read.in_flight.size() < options_.batches_in_flight && StartBatch(read)) {
  }
  while (!read.in_flight.empty()) {
    std::unique_ptr<GrantedRead::Batch> batch = std::move(read.in_flight.front());
    read.in_flight.pop_front();
    // The engine always completes a started batch (its deadline is finite): wait for it, whatever happened.
    const transfer::BatchResult result = batch->done.get();
    ORBITKV_LOG_DEBUG("remote: batch of {} blocks ({} bytes) from {} done in {:.2f} ms: {}", batch->writers.size(),
                      batch->bytes, authorized.span.node,
                      std::chrono::duration<double, std::milli>(MonoNow() - batch->submitted).count(),
                      result.status.ToString());
    if (!read.failure && result.status.ok() && result.bytes == batch->bytes) {
      for (core::BlockWriter& writer : batch->writers) {
        core::BlockPin pin;
        cache_->Seal(writer, core::TransitionCause::kRestore, &pin);
        pins->push_back(std::move(pin));
      }
      fetched_blocks += batch->writers.size();
      fetched_bytes += batch->bytes;
      while (read.in_flight.size() < options_.batches_in_flight && StartBatch(read)) {
      }
      // After the next batch started: a waiting engine restores this one while that one moves.
      if (progress) progress(pins->size());
    } else {
      if (!read.failure) {
        ORBITKV_LOG_WARN("remote: a batch of {} blocks from {} failed: {} ({} of {} bytes)", batch->writers.size(),
                         authorized.span.node, result.status.ToString(), result.bytes, batch->bytes);
      }
      read.stopped = read.failure = true;  // the prefix stops here; later batches are drained and dropped
    }
    // `batch` goes: unsealed writers abort, the staging charge returns (sealed ones were charged until now).
  }
  counts_.fetched_blocks.fetch_add(fetched_blocks, std::memory_order_relaxed);
  counts_.fetched_bytes.fetch_add(fetched_bytes, std::memory_order_relaxed);
  if (read.failure) counts_.failed.fetch_add(1, std::memory_order_relaxed);
  return !read.failure;
}

void RemoteFetcher::ReleaseGrant(const catalog::Authorized& authorized, uint64_t request_id) {
  // By grant id, so the release needs neither side's member view. In a Manager `sources_` is the release queue
  // (catalog/release_queue.h): this returns at once and the queue's own workers retry; a source that never hears
  // it revokes the grant at its deadline, or when this Manager leaves the member view.
  Result<bool> released =
      sources_->Release(authorized.span.node, authorized.span.runtime, request_id, authorized.reply.grant.grant_id,
                        authorized.reply.grant.grant_secret, Deadline::After(std::chrono::seconds(2)));
  if (!released.ok() && released.status().code() != StatusCode::kNotFound) {
    ORBITKV_LOG_WARN("remote: releasing grant {:x} at {}: {} (it expires there)", authorized.reply.grant.grant_id,
                     authorized.span.node, released.status().ToString());
  }
}

RemoteFetcher::Stats RemoteFetcher::GetStats() const {
  const auto read = [](const std::atomic<uint64_t>& count) { return count.load(std::memory_order_relaxed); };
  Stats stats;
  stats.fetches = read(counts_.fetches);
  stats.fetched_blocks = read(counts_.fetched_blocks);
  stats.fetched_bytes = read(counts_.fetched_bytes);
  stats.no_source = read(counts_.no_source);
  stats.failed = read(counts_.failed);
  stats.authorizations = read(counts_.authorizations);
  stats.rejections = read(counts_.rejections);
  stats.staging_bytes = staging_->reserved_bytes();
  stats.discovery_rpcs = read(counts_.discovery_rpcs);
  stats.shared = read(counts_.shared);
  stats.sources_skipped = read(counts_.sources_skipped);
  stats.fetch_seconds = static_cast<double>(read(counts_.fetch_ns)) / 1e9;
  stats.fetched_ssd_blocks = read(counts_.fetched_ssd_blocks);
  stats.authorize_polls = read(counts_.authorize_polls);
  stats.source_backpressure = read(counts_.source_backpressure);
  stats.source_missing = read(counts_.source_missing);
  return stats;
}

void RemoteFetcher::VisitStats(StatsVisitor& v) const {
  const Stats s = GetStats();
  v.Counter("remote_fetches", s.fetches, {"orbitkv_remote_fetches_total", "Remote stages of Loading operations run"});
  v.Counter("remote_fetched_blocks", s.fetched_blocks);
  v.Counter("remote_fetched_bytes", s.fetched_bytes,
            {"orbitkv_remote_fetched_bytes_total", "Bytes read from peers into DRAM blocks (verified and sealed)"});
  v.Counter(
      "remote_no_source", s.no_source,
      {"orbitkv_remote_no_source_total", "Remote stages that found no peer granting the next block (a local answer)"});
  v.Counter("remote_fetch_failures", s.failed,
            {"orbitkv_remote_fetch_failures_total",
             "Remote stages whose transfer failed part-way (the prefix stopped there)"});
  v.Gauge("remote_staging_bytes", static_cast<int64_t>(s.staging_bytes),
          {"orbitkv_remote_staging_bytes", "Pool bytes of blocks being fetched from peers, not sealed yet"});
  v.Counter("discovery_rpcs", s.discovery_rpcs,
            {"orbitkv_discovery_rpcs_total", "Catalog Lookup RPCs this Manager sent to learn who holds missed blocks"});
  v.Counter("source_authorizations", s.authorizations,
            {"orbitkv_source_authorizations_total", "Authorize RPCs this Manager sent to sources"});
  v.Counter("candidate_rejections", s.rejections,
            {"orbitkv_candidate_rejections_total",
             "Authorizations a source refused (stale or not in DRAM): stale candidates"});
  v.Counter("remote_ssd_fetched_blocks", s.fetched_ssd_blocks);
  v.Counter("remote_authorize_polls", s.authorize_polls);
  v.Counter("remote_ssd_backpressure", s.source_backpressure);
  v.Counter("remote_ssd_missing", s.source_missing);
  v.Counter("remote_fetches_shared", s.shared);
  v.Real("remote_fetch_seconds", s.fetch_seconds, 6);
  v.Counter("remote_sources_skipped", s.sources_skipped);
}

}  // namespace orbitkv::server
