// The messages between an owner (a Manager streaming one logical shard of its residency inventory)
// and a catalog host (a Manager keeping that shard's evidence), independent of how they travel: the
// in-process transport of the unit tests passes them as they are, the peer gRPC service maps them to
// orbitkv.peer.v1. Seed 000, "Inventory, replication and recovery".
//
// A stream is one (owner runtime incarnation, shard) to one catalog host start. Deltas carry the
// owner's journal records in sequence order, contiguously from the receiver's applied sequence + 1;
// a snapshot is Begin (start watermark and the expected record count, so the receiver can reserve
// its budget), pages of current replicas with their versions, then every journal record after the
// start watermark through the end watermark (in interval pages, the last ones in End); the receiver
// installs the view only then. A delta batch without records is a heartbeat: first_sequence - 1 is
// the owner's watermark, so an idle owner learns that a catalog restarted or fell behind.
#ifndef ORBITKV_CATALOG_CATALOG_MESSAGES_H_
#define ORBITKV_CATALOG_CATALOG_MESSAGES_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "state/state_key.h"

namespace orbitkv::catalog {

// One residence as evidence: a record of the owner's journal (present or removed) or of its current
// view (present). `version` is the owner's sequence of the record that created it.
struct CatalogRecord {
  state::StateKey key;
  uint8_t tier = 1;  // core::Tier
  bool present = true;
  uint64_t version = 0;
  uint64_t generation = 0;
  uint64_t bytes = 0;
  friend bool operator==(const CatalogRecord&, const CatalogRecord&) = default;
};

// Which stream a message belongs to, and which receiver start it was meant for.
struct StreamId {
  std::string owner_node;
  std::string owner_runtime;  // the owner's runtime UUID
  uint32_t shard = 0;
  uint64_t catalog_incarnation = 0;  // the receiver start the owner addresses (0: not known yet)
  // The owner's registration epoch (its member record's; over gRPC the route's source_epoch): a slice never
  // moves to an older one, whatever order messages arrive in.
  int64_t owner_epoch = 0;
  // The owner's start: its inventory incarnation (cluster/member_record.h), the same across its registrations, so
  // a registration made again without a restart continues its slices; 0: not said (then the runtime is the start).
  uint64_t owner_incarnation = 0;
};

struct DeltaBatch {
  StreamId stream;
  uint64_t first_sequence = 0;         // == records.front().version
  std::vector<CatalogRecord> records;  // contiguous sequences
  // How long before sending the owner applied the oldest record (its update lag so far, on its own clock).
  uint64_t oldest_age_us = 0;
};

struct SnapshotBegin {
  StreamId stream;
  uint64_t snapshot_id = 0;       // the owner's, unique per stream
  uint64_t start_watermark = 0;   // w0: the interval is (w0, w1]
  uint64_t expected_records = 0;  // the owner's current view size (a reservation hint)
};

struct SnapshotPage {
  StreamId stream;
  uint64_t snapshot_id = 0;
  std::vector<CatalogRecord> records;  // current replicas, each with its version
  // Instead: the next records of the interval (w0, w1], in sequence order (a long interval travels in
  // several pages, each within the message limit).
  bool interval = false;
};

struct SnapshotEnd {
  StreamId stream;
  uint64_t snapshot_id = 0;
  uint64_t end_watermark = 0;           // w1
  std::vector<CatalogRecord> interval;  // the interval's records not sent in interval pages, in order
};

// The receiver's answer to any of them.
struct CatalogReply {
  enum class Kind : uint8_t {
    kAck,         // applied through `applied_sequence`
    kGap,         // a delta that does not follow `applied_sequence`: resend from there or snapshot
    kResync,      // no baseline for this stream here (unknown stream, new catalog start, a conflict
                  // or an aborted snapshot): send a snapshot
    kRetryLater,  // no budget now: back off, then snapshot again
    kRefused,     // the owner is not a live member (fenced, expired, an old start): stop
  };
  Kind kind = Kind::kAck;
  uint64_t applied_sequence = 0;
  uint64_t catalog_incarnation = 0;  // the receiver's start (an owner that saw another resyncs)
  std::string reason;
};

std::string_view CatalogReplyName(CatalogReply::Kind kind);

// Any message of a stream.
using CatalogMessage = std::variant<DeltaBatch, SnapshotBegin, SnapshotPage, SnapshotEnd>;

}  // namespace orbitkv::catalog

#endif  // ORBITKV_CATALOG_CATALOG_MESSAGES_H_
