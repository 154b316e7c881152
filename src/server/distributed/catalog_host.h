// The catalog host: the part of this Manager that keeps catalog evidence (docs/catalog.md). It owns
//   - the store for the shards the live placement puts here (present on every Manager: a node added to the catalog
//     set starts hosting without a restart; the peer service serves lookups from it),
//   - this Manager's owner streams, one per shard and copy the live placement publishes to (this Manager's own store
//     directly, the others over orbitkv.peer.v1), each with its own journal subscriber so a slow or dead copy resyncs
//     alone; a lapse pauses them (PauseStreams) and the registration made again continues them (StartStreams),
//     since the inventory and so the owner's start did not change (issue 69),
//   - a maintenance thread that follows the placement (streams to the copies of both generations while a change
//     moves, slices of retired copies dropped), drops the slices of owners the member view no longer holds, and
//     charges the time shards stay incomplete.
// Its figures are read when visited (VisitStats): the catalog_* stats keys and orbitkv_catalog_* metrics.
//
// Thread safety: every method is safe from any thread. `view`, `live` and `inventory` must outlive it.
#ifndef ORBITKV_SERVER_DISTRIBUTED_CATALOG_HOST_H_
#define ORBITKV_SERVER_DISTRIBUTED_CATALOG_HOST_H_

#include "catalog/catalog_grpc.h"  // first: it brings gRPC in

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "base/mutex.h"
#include "base/stats_visitor.h"
#include "base/thread_annotations.h"
#include "catalog/catalog_store.h"
#include "catalog/owner_streamer.h"
#include "cluster/live_placement.h"
#include "cluster/member_record.h"
#include "cluster/member_view.h"
#include "core/inventory.h"

namespace orbitkv::server {

class CatalogHost {
 public:
  struct Options {
    std::string node_id;
    uint64_t incarnation = 0;   // this Manager's start: owners address it
    uint64_t budget_bytes = 0;  // --catalog-budget
    std::chrono::milliseconds maintenance_period{500};
  };
  // The figures `orbitkv stats` and the gauges show, over the shards placed here and this Manager's own streams.
  struct Summary {
    size_t records = 0, incomplete = 0, converged = 0, streaming = 0, streams = 0;
    uint64_t stream_bytes = 0;  // catalog stream messages this Manager sent to other hosts' copies
    uint64_t bytes = 0, snapshots = 0, snapshot_records = 0, continued = 0;
    double lag_ms = 0, last_repair_s = -1;
    size_t hosted = 0;                 // shards the live placement puts here
    size_t inventory_records = 0;      // this Manager's residency inventory, over all shards
    uint64_t incomplete_shard_ms = 0;  // shard-milliseconds the shards placed here were incomplete (only grows)
  };

  CatalogHost(Options options, const cluster::MemberView* view, const cluster::LivePlacement* live,
              core::ResidencyInventory* inventory);
  // Stops the streams and the maintenance thread.
  ~CatalogHost();
  CatalogHost(const CatalogHost&) = delete;
  CatalogHost& operator=(const CatalogHost&) = delete;

  catalog::CatalogStore* store() const { return store_.get(); }

  // Starts the owner streams of the registration `self`, and the maintenance thread the first time: streams paused
  // by a lapse continue as the new registration from where they were (their subscribers and acknowledged
  // sequences: the catalog keeps their slices, the same start), new ones snapshot their shard first. The streams
  // must be paused or stopped (or never started).
  Status StartStreams(std::shared_ptr<grpc::ChannelCredentials> credentials, const cluster::MemberRecord& self);
  // Joins the owner streams' threads and keeps the streams (a lapse: the registration made again continues them).
  // Idempotent.
  void PauseStreams();
  // Stops and joins the owner streams, and lets them go (their journal subscriptions too).
  void StopStreams();

  // `orbitkv catalog dump SHARD` and `orbitkv catalog status` lines (cluster_link.h).
  std::vector<std::string> CatalogLines(uint32_t shard) const;
  std::vector<std::string> CatalogStatusLines() const;
  Summary Summarize() const;
  void VisitStats(StatsVisitor& v) const;

 private:
  // One owner stream and its thread.
  struct Stream {
    // The transport it sends through, kept while it runs: a stream being retired outside the lock may still be in a
    // call after the host let the transport go (PauseStreams, StopStreams).
    std::shared_ptr<catalog::GrpcCatalogTransport> transport;
    std::unique_ptr<catalog::OwnerStreamer> streamer;
    std::atomic<bool> stop{false};
    std::thread thread;
    uint64_t counted_snapshots = 0, counted_snapshot_records = 0;  // added to the totals when it was removed
  };

  // Makes the owner streams those the live placement publishes to now: starts the missing ones, and flags those no
  // longer wanted (a retired or aborted copy) to stop and moves them to `gone`, for RetireStreams once the lock is
  // released. Nothing while no registration streams.
  Status SyncStreams(std::vector<std::unique_ptr<Stream>>* gone) REQUIRES(streams_mu_);
  // Joins streams SyncStreams removed and adds what they sent until they ended.
  void RetireStreams(std::vector<std::unique_ptr<Stream>> gone) EXCLUDES(streams_mu_);
  // Stops and joins every stream's thread and lets the transport go (PauseStreams, StopStreams).
  void JoinStreams() REQUIRES(streams_mu_);
  void Maintain();
  // The placement changed: the streams follow it, and the slices of copies retired here go.
  void FollowPlacement();

  const Options options_;
  const cluster::MemberView* const view_;
  const cluster::LivePlacement* const live_;
  core::ResidencyInventory* const inventory_;
  std::unique_ptr<catalog::CatalogStore> store_;
  // The owner streams of the current registration (stopped and made anew when it registers again), by (shard, copy).
  mutable Mutex streams_mu_;
  std::shared_ptr<catalog::GrpcCatalogTransport> transport_ GUARDED_BY(streams_mu_);
  cluster::MemberRecord owner_ GUARDED_BY(streams_mu_);  // the registration the streams send as
  std::map<std::pair<uint32_t, std::string>, std::unique_ptr<Stream>> streams_ GUARDED_BY(streams_mu_);
  uint64_t stream_bytes_before_ GUARDED_BY(streams_mu_) = 0;  // sent by the streams of earlier registrations
  uint64_t snapshots_before_ GUARDED_BY(streams_mu_) = 0;     // sent by streams stopped since
  uint64_t snapshot_records_before_ GUARDED_BY(streams_mu_) = 0;
  uint64_t continued_ GUARDED_BY(streams_mu_) = 0;  // streams continued by a registration made again
  std::atomic<uint64_t> followed_version_{0};       // the live placement's version the streams and the store follow
  std::atomic<bool> streams_stop_{false};
  std::atomic<uint64_t> incomplete_ms_{0};  // shard-milliseconds incomplete
  std::atomic<bool> stop_{false};
  std::thread maintenance_;
};

}  // namespace orbitkv::server

#endif  // ORBITKV_SERVER_DISTRIBUTED_CATALOG_HOST_H_
