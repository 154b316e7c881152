#include "server/distributed/catalog_host.h"

#include <algorithm>
#include <set>

#include "base/check.h"
#include "base/clock.h"
#include "base/logging.h"
#include "cluster/placement.h"
#include "fmt/format.h"
#include "fmt/ranges.h"
#include "server/distributed/node_identity.h"

namespace orbitkv::server {

CatalogHost::CatalogHost(Options options, const cluster::MemberView* view, const cluster::LivePlacement* live,
                         core::ResidencyInventory* inventory)
    : options_(std::move(options)), view_(view), live_(live), inventory_(inventory) {
  catalog::CatalogStore::Options store;
  store.incarnation = options_.incarnation;
  store.budget_bytes = options_.budget_bytes;
  catalog::FollowMemberView(view, &store);
  store.num_shards = cluster::kNumShards;
  store.hosts = [live, node = options_.node_id](uint32_t shard) { return live->Get()->Hosts(shard, node); };
  store_ = std::make_unique<catalog::CatalogStore>(std::move(store));
}

CatalogHost::~CatalogHost() {
  StopStreams();
  stop_.store(true, std::memory_order_release);
  if (maintenance_.joinable()) maintenance_.join();
}

Status CatalogHost::StartStreams(std::shared_ptr<grpc::ChannelCredentials> credentials,
                                 const cluster::MemberRecord& self) {
  std::vector<std::unique_ptr<Stream>> gone;
  Status synced = Status::Ok();
  {
    MutexLock lock(&streams_mu_);
    ORBITKV_CHECK_MSG(!transport_, "owner streams started twice");
    streams_stop_.store(false, std::memory_order_release);
    transport_ = std::make_shared<catalog::GrpcCatalogTransport>(PeerIdentityOf(self, *live_), view_,
                                                                 std::move(credentials), store_.get());
    owner_ = self;
    // Paused streams continue as this registration: the same inventory, so the same start.
    for (auto& [where, stream] : streams_) {
      stream->streamer->Rebind(self.runtime_uuid, self.epoch, transport_.get());
      stream->transport = transport_;
      stream->stop.store(false, std::memory_order_release);
      Stream* raw = stream.get();
      raw->thread = std::thread([raw] { raw->streamer->Run(raw->stop); });
      ++continued_;
    }
    synced = SyncStreams(&gone);
  }
  RetireStreams(std::move(gone));
  ORBITKV_RETURN_IF_ERROR(synced);
  if (!maintenance_.joinable()) maintenance_ = std::thread([this] { Maintain(); });
  return Status::Ok();
}

void CatalogHost::RetireStreams(std::vector<std::unique_ptr<Stream>> gone) {
  // Joined without streams_mu_: a stream stuck in a call to a copy that does not answer takes up to that call's
  // deadline to see its stop flag, and nothing that reads the figures (orbitkv stats) waits for it (issue 84).
  for (const std::unique_ptr<Stream>& stream : gone) {
    if (stream->thread.joinable()) stream->thread.join();
  }
  MutexLock lock(&streams_mu_);
  for (const std::unique_ptr<Stream>& stream : gone) {
    // What they sent between their removal (counted then) and their end.
    snapshots_before_ += stream->streamer->snapshots() - stream->counted_snapshots;
    snapshot_records_before_ += stream->streamer->snapshot_records() - stream->counted_snapshot_records;
  }
}

void CatalogHost::JoinStreams() {
  streams_stop_.store(true, std::memory_order_release);
  for (auto& [where, stream] : streams_) stream->stop.store(true, std::memory_order_release);
  for (auto& [where, stream] : streams_) {
    if (stream->thread.joinable()) stream->thread.join();
  }
  if (transport_) stream_bytes_before_ += transport_->bytes_sent();
  transport_.reset();  // the paused streams' pointer to it is replaced before they run again (Rebind)
}

void CatalogHost::PauseStreams() {
  MutexLock lock(&streams_mu_);
  JoinStreams();
}

void CatalogHost::StopStreams() {
  MutexLock lock(&streams_mu_);
  JoinStreams();
  for (auto& [where, stream] : streams_) {
    snapshots_before_ += stream->streamer->snapshots();  // the figure counts since start, across registrations
    snapshot_records_before_ += stream->streamer->snapshot_records();
  }
  streams_.clear();  // unsubscribes from the inventory
}

std::vector<std::string> CatalogHost::CatalogLines(uint32_t shard) const {
  std::vector<std::string> lines;
  for (const std::string& owner : store_->Owners(shard)) {
    for (const catalog::CatalogRecord& r : store_->Dump(shard, owner)) {
      const auto key = r.key.Encode();
      lines.push_back(
          fmt::format("{} {:02x} {} {} {} {}", owner, fmt::join(key, ""), r.tier, r.version, r.generation, r.bytes));
    }
  }
  return lines;
}

std::vector<std::string> CatalogHost::CatalogStatusLines() const {
  std::vector<std::string> lines;
  std::map<uint32_t, catalog::CatalogStore::ShardStatus> known;
  for (const auto& s : store_->Status()) known[s.shard] = s;
  const std::shared_ptr<const cluster::LivePlacement::State> live = live_->Get();
  for (uint32_t shard = 0; shard < cluster::kNumShards; ++shard) {
    if (!live->Hosts(shard, options_.node_id)) continue;
    const auto it = known.find(shard);
    catalog::CatalogStore::ShardStatus s = it == known.end() ? catalog::CatalogStore::ShardStatus{} : it->second;
    if (it == known.end()) s.complete = false;  // Status names every shard placed here: not one of them
    lines.push_back(fmt::format("{} {} {} {} {} {:.1f} {}", shard, s.owners, s.records, s.bytes,
                                s.complete ? "complete" : "incomplete", s.lag_ms,
                                s.last_repair_s < 0 ? std::string("never") : fmt::format("{:.1f}", s.last_repair_s)));
  }
  return lines;
}

CatalogHost::Summary CatalogHost::Summarize() const {
  Summary sum;
  for (const auto& shard : store_->Status()) {
    sum.records += shard.records;
    sum.incomplete += shard.complete ? 0 : 1;
    sum.lag_ms = std::max(sum.lag_ms, shard.lag_ms);
    if (shard.last_repair_s >= 0) {
      sum.last_repair_s =
          sum.last_repair_s < 0 ? shard.last_repair_s : std::min(sum.last_repair_s, shard.last_repair_s);
    }
  }
  sum.bytes = store_->used_bytes();
  const std::shared_ptr<const cluster::LivePlacement::State> live = live_->Get();
  for (uint32_t shard = 0; shard < cluster::kNumShards; ++shard) {
    sum.hosted += live->Hosts(shard, options_.node_id) ? 1 : 0;
    sum.inventory_records += inventory_->Size(shard);
  }
  sum.incomplete_shard_ms = incomplete_ms_.load(std::memory_order_relaxed);
  MutexLock lock(&streams_mu_);
  sum.streams = streams_.size();
  sum.stream_bytes = stream_bytes_before_ + (transport_ ? transport_->bytes_sent() : 0);
  for (const auto& [where, stream] : streams_) {
    const catalog::OwnerStreamer& s = *stream->streamer;
    sum.converged += s.converged() ? 1 : 0;
    sum.streaming += s.state() == catalog::OwnerStreamer::State::kStreaming ? 1 : 0;
    sum.snapshots += s.snapshots();
    sum.snapshot_records += s.snapshot_records();
  }
  sum.snapshots += snapshots_before_;
  sum.snapshot_records += snapshot_records_before_;
  sum.continued = continued_;
  return sum;
}

Status CatalogHost::SyncStreams(std::vector<std::unique_ptr<Stream>>* gone) {
  if (!transport_) return Status::Ok();
  const std::shared_ptr<const cluster::LivePlacement::State> live = live_->Get();
  std::set<std::pair<uint32_t, std::string>> wanted;
  for (uint32_t shard = 0; shard < cluster::kNumShards; ++shard) {
    for (const std::string& copy : live->PublishCopies(shard)) wanted.emplace(shard, copy);
  }
  for (auto it = streams_.begin(); it != streams_.end();) {
    if (wanted.contains(it->first)) {
      ++it;
      continue;
    }
    Stream& stream = *it->second;
    stream.stop.store(true, std::memory_order_release);
    // Counted now, so the figures never go back while it ends (RetireStreams adds what it sends meanwhile).
    stream.counted_snapshots = stream.streamer->snapshots();
    stream.counted_snapshot_records = stream.streamer->snapshot_records();
    snapshots_before_ += stream.counted_snapshots;
    snapshot_records_before_ += stream.counted_snapshot_records;
    gone->push_back(std::move(it->second));
    it = streams_.erase(it);
  }
  for (const auto& [shard, copy] : wanted) {
    if (streams_.contains({shard, copy})) continue;
    // Every copy of a shard is built from the owners' streams alone: one stream per (shard, copy), each with its
    // own journal subscriber.
    catalog::OwnerStreamer::Options options;
    options.owner_node = owner_.node_id;
    options.owner_runtime = owner_.runtime_uuid;
    options.owner_epoch = owner_.epoch;
    options.shard = shard;
    options.catalog_node = copy;
    ORBITKV_ASSIGN_OR_RETURN(std::unique_ptr<catalog::OwnerStreamer> streamer,
                             catalog::OwnerStreamer::Create(options, inventory_, transport_.get()));
    auto stream = std::make_unique<Stream>();
    stream->streamer = std::move(streamer);
    stream->transport = transport_;
    Stream* raw = stream.get();
    raw->thread = std::thread([raw] { raw->streamer->Run(raw->stop); });
    streams_.emplace(std::make_pair(shard, copy), std::move(stream));
  }
  return Status::Ok();
}

void CatalogHost::VisitStats(StatsVisitor& v) const {
  const Summary s = Summarize();
  v.Gauge("catalog_shards_hosted", static_cast<int64_t>(s.hosted));
  v.Gauge("catalog_records", static_cast<int64_t>(s.records),
          {"orbitkv_catalog_records", "Residences this catalog host holds as evidence"});
  v.Gauge("catalog_bytes", static_cast<int64_t>(s.bytes),
          {"orbitkv_catalog_bytes", "Bytes charged to --catalog-budget on this catalog host"});
  v.Gauge("catalog_incomplete_shards", static_cast<int64_t>(s.incomplete),
          {"orbitkv_catalog_incomplete_shards",
           "Shards placed here whose evidence is incomplete (a live owner without a baseline: rebuilding, over "
           "budget, or after this catalog host restarted)"});
  v.Counter("catalog_incomplete_shard_ms", s.incomplete_shard_ms);
  v.Real("", static_cast<double>(s.incomplete_shard_ms) / 1000, 3,
         {"orbitkv_catalog_incomplete_seconds_total",
          "Shard-seconds the shards placed here were incomplete (only grows; their misses are not authoritative)"});
  v.Gauge("catalog_streams", static_cast<int64_t>(s.streams));
  v.Gauge("catalog_streams_streaming", static_cast<int64_t>(s.streaming));
  v.Gauge("catalog_streams_converged", static_cast<int64_t>(s.converged),
          {"orbitkv_catalog_streams_converged",
           "This Manager's owner streams that converge (one per shard and copy: 16 x --catalog-replicas)"});
  v.Gauge("catalog_stream_snapshots", static_cast<int64_t>(s.snapshots),
          {"orbitkv_catalog_stream_snapshots", "Snapshots this Manager's owner streams sent (since start)"});
  v.Counter("catalog_stream_snapshot_records", s.snapshot_records,
            {"orbitkv_catalog_stream_snapshot_records_total",
             "Inventory records this Manager's owner streams sent in snapshots (each one resends a whole shard's "
             "view; since start)"});
  v.Counter("catalog_streams_continued", s.continued,
            {"orbitkv_catalog_streams_continued_total",
             "Owner streams that continued from their acknowledged sequence after this Manager registered again "
             "without a restart (no snapshot)"});
  v.Gauge("inventory_records", static_cast<int64_t>(s.inventory_records));
  v.Counter("catalog_owner_continuations", store_->continuations(),
            {"orbitkv_catalog_owner_continuations_total",
             "Owner slices here that followed their owner to a registration made again without a restart (kept "
             "with their baselines, not rebuilt)"});
  v.Counter("catalog_stream_bytes_sent", s.stream_bytes);
  v.Gauge("", static_cast<int64_t>(s.lag_ms),
          {"orbitkv_catalog_update_lag_ms",
           "Largest update lag of the owners' last deltas over the shards placed here (ms, owner side: the oldest "
           "record's age when sent)"});
  v.Gauge("", static_cast<int64_t>(s.last_repair_s),
          {"orbitkv_catalog_seconds_since_repair",
           "Seconds since the most recent snapshot installed on this catalog host"});
}

void CatalogHost::Maintain() {
  MonoTime last = MonoNow();
  size_t incomplete = 0;  // as of the last round: the state the time since then is charged to
  constexpr auto kTick = std::chrono::milliseconds(50);
  while (!stop_.load(std::memory_order_acquire)) {
    FollowPlacement();
    store_->DropDeadOwners();
    const MonoTime now = MonoNow();
    const double seconds = std::chrono::duration<double>(now - last).count() * static_cast<double>(incomplete);
    incomplete_ms_.fetch_add(static_cast<uint64_t>(seconds * 1000), std::memory_order_relaxed);
    last = now;
    incomplete = 0;
    for (const auto& shard : store_->Status()) incomplete += shard.complete ? 0 : 1;
    // Between rounds, a placement change is followed within a tick.
    for (auto waited = std::chrono::milliseconds(0);
         waited < options_.maintenance_period && !stop_.load(std::memory_order_acquire); waited += kTick) {
      std::this_thread::sleep_for(kTick);
      if (live_->version() != followed_version_.load(std::memory_order_acquire)) FollowPlacement();
    }
  }
}

void CatalogHost::FollowPlacement() {
  const uint64_t version = live_->version();
  if (version == followed_version_.load(std::memory_order_acquire)) return;
  {
    std::vector<std::unique_ptr<Stream>> gone;
    Status synced = Status::Ok();
    {
      MutexLock lock(&streams_mu_);
      // With no registration streaming now, the next StartStreams follows the placement.
      if (!streams_stop_.load(std::memory_order_acquire)) synced = SyncStreams(&gone);
    }
    RetireStreams(std::move(gone));
    if (!synced.ok()) {
      ORBITKV_LOG_ERROR("manager: the catalog streams did not follow the placement: {}", synced.ToString());
      return;  // tried again on the next round
    }
  }
  if (const size_t dropped = store_->DropUnhosted(); dropped > 0) {
    ORBITKV_LOG_INFO("manager: dropped {} catalog slice(s) of shards no longer placed on node {}", dropped,
                     options_.node_id);
  }
  followed_version_.store(version, std::memory_order_release);
}

}  // namespace orbitkv::server
