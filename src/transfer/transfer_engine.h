// TransferEngine: moves KV bytes between hosts' Managers by pulling scattered fragments of a peer's
// registered memory into local registered memory, one completion per batch.
//
// A process registers the memory it serves or receives into (the pool's arenas) once, as (base,
// length) regions, and exports a compact RegionDescriptor per region
// (docs/formats/transfer_descriptor.md). A requester that holds a peer's address and descriptors
// (the catalog's source authorization reply carries them) issues ReadBatch: many (remote region,
// remote offset, length) -> (local region, local offset) fragments, completed once, with an
// optional xxh3 checksum of every fragment verified by the requester (on by default).
//
// Lifetime contract (seed 000, "Transfer lifetime and resource control"):
//  - A batch pins its local regions from ReadBatch until its completion runs: UnregisterRegion of a
//  pinned region
//    fails with FailedPrecondition. The completion runs only after the transport has reported every
//    submitted operation of the batch complete or failed, so when it runs nothing can write the
//    destination any more.
//  - The serving side pins its source regions from a request's arrival until every send of it is
//  terminal.
//  - Cancel stops unsubmitted work and drains submitted work; the completion then reports
//  Cancelled.
//  - Every batch has a finite deadline. At the deadline the batch stops taking data; when transfers
//  are still in
//    flight the engine revokes them by closing the endpoint (which fails every operation on it)
//    instead of releasing memory on a timer.
//  - A peer that disappears fails its batches with Unavailable once their operations drained.
//
// Thread safety: every method may be called from any thread. Completions run on an engine-owned
// thread; they must not block, and may call back into the engine (e.g. issue the next ReadBatch).
#ifndef ORBITKV_TRANSFER_TRANSFER_ENGINE_H_
#define ORBITKV_TRANSFER_TRANSFER_ENGINE_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "base/clock.h"
#include "base/result.h"
#include "base/status.h"
#include "transfer/descriptor.h"

namespace orbitkv::transfer {

// A locally registered region: an index into the engine's region table plus the generation it was
// registered under, so a handle kept past UnregisterRegion is detected (NotFound) instead of
// reaching reused memory.
struct RegionHandle {
  uint32_t index = 0;
  uint32_t generation = 0;
  friend bool operator==(const RegionHandle&, const RegionHandle&) = default;
};

// How a requester pulls bytes.
enum class PullMode : uint8_t {
  // Per peer: kRma when the transport UCX chose for that peer has native RMA lanes (rc/dc verbs,
  // cma, ...),
  // otherwise kActiveMessage (tcp, where UCX's RMA is an emulation measured at 0.07 GB/s).
  kAuto = 0,
  // One-sided gets with the peer's rkeys; the source's CPU is involved only for the checksum.
  kRma = 1,
  // The requester asks; the source pushes every fragment as an active message (rendezvous for large
  // ones),
  // landing directly in the requester's destination.
  kActiveMessage = 2,
};
std::string_view PullModeName(PullMode mode);

// One fragment of a batch: `length` bytes at `remote_offset` of remote region `remote` (an index
// into ReadBatchRequest::remotes) land at `local_offset` of local region `local`.
struct Fragment {
  uint32_t remote = 0;
  uint64_t remote_offset = 0;
  RegionHandle local;
  uint64_t local_offset = 0;
  uint64_t length = 0;
};

// A grant's secret, and what CreateGrant returns.
using GrantSecret = std::array<uint8_t, 16>;
struct IssuedGrant {
  uint64_t id = 0;
  GrantSecret secret{};
};

struct ReadBatchRequest {
  // The peer's address as its engine reports it (ListenAddress()).
  std::string peer;
  // The grant the source issued for these bytes (CreateGrant on the source, handed over by the
  // catalog's source authorization). 0: none, which a source that requires grants refuses.
  uint64_t grant = 0;
  // That grant's secret (IssuedGrant::secret): without it the source serves nothing under the grant.
  GrantSecret grant_secret{};
  // Decoded descriptors of the peer's regions this batch reads from.
  std::vector<RegionDescriptor> remotes;
  std::vector<Fragment> fragments;
  // Must be finite: a batch that could wait forever would hold its destination forever.
  Deadline deadline = Deadline::Infinite();
  // Verify an xxh3 checksum of every fragment against the source's (DataLoss on mismatch).
  bool verify_checksum = true;
  // kAuto follows the engine's default mode for this peer.
  PullMode mode = PullMode::kAuto;
};

struct BatchResult {
  uint64_t batch_id = 0;
  // OK: every fragment landed (and matched its checksum when verified). Cancelled,
  // DeadlineExceeded, Unavailable (peer gone or endpoint closed), DataLoss (checksum), or the
  // source's refusal (NotFound/OutOfRange/InvalidArgument for a stale or malformed descriptor).
  Status status;
  uint64_t bytes = 0;
  PullMode mode = PullMode::kAuto;
  // The checksum the source computed (when verify_checksum), for callers that store it.
  uint64_t source_checksum = 0;
  bool checksum_verified = false;
};

using BatchCallback = std::function<void(const BatchResult&)>;

// Source side: the only bytes a peer may read. A source created with grants required serves a read
// request only when it names a live grant and every fragment lies inside one of the grant's ranges
// (same region index and generation, byte range included), checked per fragment.
struct GrantRange {
  RegionHandle region;
  uint64_t offset = 0;
  uint64_t length = 0;
};
struct GrantRequest {
  // Whom it is for (the requester's node id or runtime UUID): RevokePeer revokes by this name.
  std::string peer;
  std::vector<GrantRange> ranges;
};
// Runs once, on the engine's thread, when nothing of a revoked grant is in flight any more.
using DrainedCallback = std::function<void()>;

struct Capabilities {
  // The transports UCX was allowed to use (UCX_TLS), as configured; empty means UCX's default.
  std::string transports;
  PullMode default_mode = PullMode::kAuto;
  bool checksum = true;
  // Reads are served only inside grants; RMA is then off (descriptors carry no rkey).
  bool grants_required = false;
  size_t max_fragments_per_batch = 0;
  uint64_t max_fragment_bytes = 0;
};

// Counts the engine exposes for leak checks and metrics; a snapshot.
struct EngineStats {
  uint64_t live_batches = 0;      // ReadBatch accepted, completion not yet run.
  uint64_t serving_requests = 0;  // Source side: requests whose sends are not all terminal.
  uint64_t registered_regions = 0;
  uint64_t pinned_regions = 0;         // Regions with a non-zero pin count (either side).
  uint64_t peer_endpoints = 0;         // Pooled outgoing endpoints.
  uint64_t live_grants = 0;            // Issued and not yet drained after their revocation.
  uint64_t grant_secret_refusals = 0;  // Read requests naming a live grant without its secret (nothing served).
};

class TransferEngine {
 public:
  virtual ~TransferEngine() = default;

  // Registers [base, base+length) for serving and receiving. InvalidArgument for a null or empty
  // range, ResourceExhausted when the region table is full, the transport's error otherwise. The
  // caller keeps the memory mapped until UnregisterRegion succeeds.
  virtual Result<RegionHandle> RegisterRegion(void* base, size_t length) = 0;

  // NotFound for an unknown or stale handle; FailedPrecondition while a batch or a served request
  // pins it.
  virtual Status UnregisterRegion(RegionHandle region) = 0;

  // The descriptor a peer needs to read this region (its rkey included). NotFound for a stale
  // handle.
  virtual Result<RegionDescriptor> ExportRegion(RegionHandle region) = 0;

  // Starts a batch. Validation errors (bad bounds, stale local handle, empty or oversized batch,
  // infinite deadline) are returned here and `done` is not called; otherwise `done` runs exactly
  // once.
  virtual Result<uint64_t> ReadBatch(ReadBatchRequest request, BatchCallback done) = 0;

  // Asks a live batch to stop; its completion still runs (Cancelled, or its earlier outcome).
  // NotFound when the batch already completed.
  virtual Status Cancel(uint64_t batch_id) = 0;

  // Issues a grant: a random 64-bit id (never 0) and a random 128-bit secret, the requester's capability (hand
  // both over only on an authenticated channel, to the requester alone: a read presenting the id without the
  // secret is refused). Its ranges pin their regions (UnregisterRegion fails) until it is revoked and drained.
  // InvalidArgument for an empty or malformed range list, NotFound for a stale region, OutOfRange for a range
  // outside its region.
  virtual Result<IssuedGrant> CreateGrant(GrantRequest request) = 0;
  // Revokes a grant: from now on no request or unsent fragment under it is served; `drained` runs
  // once its sends in flight are terminal (nothing is reclaimed on a timer alone). NotFound for an
  // unknown or already revoked grant.
  virtual Status RevokeGrant(uint64_t grant, DrainedCallback drained) = 0;
  // Revokes every grant issued for `peer` and force-closes the endpoints their requests came in on
  // (which fails the fragments in flight at once); `drained` runs when all of them drained (at once,
  // on the engine's thread, when the peer has none).
  virtual Status RevokePeer(const std::string& peer, DrainedCallback drained) = 0;

  // "ip:port" peers connect to.
  virtual std::string ListenAddress() const = 0;
  virtual Capabilities GetCapabilities() const = 0;
  virtual EngineStats Stats() const = 0;
};

}  // namespace orbitkv::transfer

#endif  // ORBITKV_TRANSFER_TRANSFER_ENGINE_H_
