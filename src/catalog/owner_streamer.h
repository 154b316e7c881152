// OwnerStreamer: the sending side of one stream, (this Manager's runtime, one logical shard) to one
// catalog host. It subscribes to the shard's inventory journal and keeps the catalog's slice equal to
// the owner's inventory: deltas in sequence order while the catalog follows, and the snapshot cut of
// seed 000 whenever it cannot (a gap the journal no longer covers, a RESYNC, a new catalog start, a
// journal that dropped records this subscriber had not acknowledged):
//   1. w0 = Watermark; Begin(w0, expected = Size);
//   2. Scan pages with a stable key cursor (bounded pages; the inventory's shard mutex only, never a
//      payload lock), each sent as a Page;
//   3. w1 = Watermark; End(w1, every journal record in (w0, w1]);
//   4. on ACK, CommitSnapshot(shard, subscriber, w1): Aborted means a record was dropped after the
//      cut, so the snapshot starts again.
// An interval the journal no longer holds (OutOfRange) aborts the snapshot; it is retried with
// exponential backoff, and after `snapshot_attempts` failed tries in a row the stream reports that
// it does not converge (converged() false, counted) while it keeps trying at the longest backoff.
// Nothing here ever makes a local Publish wait: the journal is bounded and never blocks on us.
//
// Step() does one unit of work (a delta round trip, or a whole snapshot), so tests drive it
// deterministically; Run() is the production loop on its own thread, woken by the journal's change
// notification and batching for `batch_delay`.
//
// Thread safety: Step/Run from one thread; the statistics accessors from any.
#ifndef ORBITKV_CATALOG_OWNER_STREAMER_H_
#define ORBITKV_CATALOG_OWNER_STREAMER_H_

#include <atomic>
#include <chrono>
#include <random>
#include <string>

#include "base/clock.h"
#include "base/result.h"
#include "catalog/catalog_messages.h"
#include "core/inventory.h"

namespace orbitkv::catalog {

// How owners reach catalog hosts: the peer gRPC service in a Manager, a CatalogStore directly in the
// unit tests. An error status means the message may or may not have arrived (resending is safe:
// receivers deduplicate).
class CatalogTransport {
 public:
  virtual ~CatalogTransport() = default;
  virtual Result<CatalogReply> Deliver(const std::string& catalog_node, const CatalogMessage& message) = 0;
};

class OwnerStreamer {
 public:
  struct Options {
    std::string owner_node;
    std::string owner_runtime;
    int64_t owner_epoch = 0;  // the owner's registration epoch, carried in every message's StreamId
    uint32_t shard = 0;
    std::string catalog_node;
    size_t max_batch_records = 4096;
    // Records a snapshot page carries, and so what one Scan holds the inventory shard's mutex for: 512 keeps a
    // page's hold near 4 % of a walk over a 250,000-record shard (scripts/bench catalog) while a 250,000-record
    // snapshot is still under 500 pages.
    size_t page_records = 512;
    std::chrono::milliseconds batch_delay{2};
    std::chrono::milliseconds backoff_min{10};
    std::chrono::milliseconds backoff_max{2000};
    int snapshot_attempts = 8;  // failed snapshots in a row before the stream says it does not converge
    // An idle stream sends a heartbeat (an empty delta naming its acknowledged sequence) this often, so a
    // catalog host that restarted or fell behind is repaired without new writes.
    std::chrono::milliseconds heartbeat_interval{1000};
  };
  enum class State { kSnapshot, kStreaming, kBackoff, kStopped };

  // Subscribes to the shard (a new subscriber snapshots first). `inventory` and `transport` must
  // outlive the streamer.
  static Result<std::unique_ptr<OwnerStreamer>> Create(Options options, core::ResidencyInventory* inventory,
                                                       CatalogTransport* transport);
  ~OwnerStreamer();

  // One unit of work; true when it did something (a caller loops until false to drain).
  bool Step();
  // Sends a heartbeat now (while streaming); true when it sent one.
  bool Heartbeat();
  // Streams until `stop` is set (checked at least every 100 ms).
  void Run(const std::atomic<bool>& stop);
  // The owner registered again without a restart (the same inventory, so the same start): its messages name the
  // new registration and go through `transport`, and the stream continues where it was (its subscriber, its
  // acknowledged sequence). Only while Run/Step are not running (the caller joined the thread).
  void Rebind(const std::string& owner_runtime, int64_t owner_epoch, CatalogTransport* transport);

  State state() const { return state_.load(std::memory_order_relaxed); }
  bool converged() const { return failed_snapshots_.load(std::memory_order_relaxed) < options_.snapshot_attempts; }
  uint64_t acknowledged() const { return acked_.load(std::memory_order_relaxed); }
  uint64_t snapshots() const { return snapshots_.load(std::memory_order_relaxed); }
  // Inventory records sent in snapshot pages (a whole view resent each time), since creation.
  uint64_t snapshot_records() const { return snapshot_records_.load(std::memory_order_relaxed); }
  uint64_t snapshot_aborts() const { return snapshot_aborts_.load(std::memory_order_relaxed); }
  uint64_t gaps() const { return gaps_.load(std::memory_order_relaxed); }
  const Options& options() const { return options_; }

 private:
  OwnerStreamer(Options options, core::ResidencyInventory* inventory, CatalogTransport* transport,
                core::InventorySubscriber subscriber);
  StreamId Id() const;  // the stream this streamer feeds, as its messages name it
  bool Snapshot();
  bool Stream(uint64_t after);
  // Handles a reply that is not an ACK; returns false when the caller must stop this unit of work.
  void OnTrouble(const Result<CatalogReply>& reply, bool in_snapshot);
  void Backoff(State resume);

  const Options options_;
  core::ResidencyInventory* const inventory_;
  const core::InventorySubscriber subscriber_;
  // The registration the messages name, and the transport they take: Rebind changes them between runs.
  std::string owner_runtime_;
  int64_t owner_epoch_ = 0;
  CatalogTransport* transport_;
  uint64_t catalog_incarnation_ = 0;
  std::chrono::milliseconds backoff_{0};
  std::minstd_rand jitter_{std::random_device{}()};
  MonoTime backoff_until_{};
  State resume_ = State::kSnapshot;  // what follows the backoff
  std::atomic<State> state_{State::kSnapshot};
  std::atomic<uint64_t> acked_{0};
  std::atomic<uint64_t> snapshots_{0};
  std::atomic<uint64_t> snapshot_records_{0};
  std::atomic<uint64_t> snapshot_aborts_{0};
  std::atomic<uint64_t> gaps_{0};
  std::atomic<int> failed_snapshots_{0};
};

CatalogRecord ToCatalogRecord(const core::ResidencyRecord& record);

}  // namespace orbitkv::catalog

#endif  // ORBITKV_CATALOG_OWNER_STREAMER_H_
