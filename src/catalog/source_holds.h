// SourceHolds: the source side of a remote fetch (seed 000, "Transfer lifetime and resource control"). A
// requesting Manager names the exact replica versions a lookup told it about; the source pins those
// versions and nothing else (BlockTable::PinExact checks every generation and insertion sequence under the
// table's shard locks before pinning), charges the whole allocations to the transfer budget (global, per peer, at
// most 1024 sessions) and issues a transfer grant over exactly the pinned bytes. A rejection pins nothing, grants
// nothing and creates no session.
//
// A hold ends only through the transport: Release, the grant's deadline, or the requester leaving the member view
// revoke the grant (the requester's endpoints are force-closed when it left), and the pins and the charge go only
// once the transfer engine says nothing of the grant is in flight any more (drained). Until then a hold whose
// deadline passed or whose requester vanished is *quarantined*: still pinned and charged, and counted apart.
// There is no timeout-only reclamation. Duplicate Authorize (same requester start and request id) returns the
// same grant; Release is idempotent.
//
// Thread safety: every method is safe from any thread. Authorizations run one at a time; the issuer is never called
// under the holds' lock (its drained callbacks may run on any thread, also inline).
#ifndef ORBITKV_CATALOG_SOURCE_HOLDS_H_
#define ORBITKV_CATALOG_SOURCE_HOLDS_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "base/clock.h"
#include "base/mutex.h"
#include "base/result.h"
#include "base/stats_visitor.h"
#include "base/thread_annotations.h"
#include "catalog/hold_lifecycle.h"
#include "core/block_table.h"
#include "core/budget.h"
#include "core/slab_pool.h"
#include "state/state_key.h"

namespace orbitkv::catalog {

// The transfer engine as the source sees it (UcxTransferEngine in a Manager; a recording fake in unit tests).
// The size of a grant's secret (transfer::GrantSecret).
inline constexpr size_t kGrantSecretBytes = 16;

class GrantIssuer {
 public:
  struct Range {
    uint32_t arena = 0;  // index of the pool arena (registered as a transfer region)
    uint64_t offset = 0;
    uint64_t bytes = 0;
  };
  virtual ~GrantIssuer() = default;
  // A grant for `peer` (the requester's runtime UUID) over `ranges`: its id and its secret (kGrantSecretBytes).
  struct Issued {
    uint64_t id = 0;
    std::string secret;
  };
  virtual Result<Issued> Grant(const std::string& peer, const std::vector<Range>& ranges) = 0;
  // Revokes one grant; `drained` runs once nothing under it is in flight (maybe inline).
  virtual Status Revoke(uint64_t grant, std::function<void()> drained) = 0;
  // Revokes every grant of `peer` and force-closes its endpoints; `drained` as above.
  virtual Status RevokePeer(const std::string& peer, std::function<void()> drained) = 0;
  // The encoded region descriptor of pool arena `arena` (what the requester reads through).
  virtual Result<std::vector<uint8_t>> Describe(uint32_t arena) = 0;
};

enum class SourceOutcome : uint8_t {
  kGranted = 0,
  kStale = 1,      // absent, or held in another version than asked for
  kNotInDram = 2,  // held on SSD only, and this source prepares no SSD blocks (no SSD tier)
  // SSD-resident blocks being read into DRAM here; ask again with the same request id after
  // SourceGrant::retry_after.
  kPending = 3,
  kBackpressure = 4,  // this source's SSD staging budget is full now: ask another source, or recompute
  kMissing = 5,       // the SSD record failed its read or its checksum here: never served
  // As a grant's `stop` only: the rest of the span is still being read into DRAM here; ask for it again (a new
  // request) once this grant was read.
  kMore = 6,
};
std::string_view SourceOutcomeName(SourceOutcome outcome);

// The tiers a lookup names (core::Tier).
inline constexpr uint8_t kSourceDram = 1;
inline constexpr uint8_t kSourceSsd = 2;

struct SourceBlockVersion {
  state::StateKey key;
  uint64_t generation = 0;
  uint64_t sequence = 0;
  uint8_t tier = kSourceDram;  // the residence the lookup named: DRAM, or SSD (prepared into DRAM first)
};

struct AuthorizeArgs {
  std::string peer_node;
  std::string peer_runtime;
  uint64_t request_id = 0;
  std::vector<SourceBlockVersion> blocks;
  uint64_t byte_limit = 0;  // 0: no limit beyond the budgets
  std::chrono::milliseconds lifetime{10000};
  // A pending answer (SSD blocks being read here) is held back until the first piece is in DRAM, at most
  // Options::pending_wait and never past this (the RPC's deadline, less a margin for the answer's way back).
  MonoTime answer_by = MonoTime::max();
};

struct SourceGrant {
  SourceOutcome outcome = SourceOutcome::kGranted;
  size_t granted = 0;                            // blocks pinned, from the first
  SourceOutcome stop = SourceOutcome::kGranted;  // why block `granted` was not pinned
  uint64_t grant_id = 0;
  std::string grant_secret;                   // kGrantSecretBytes, for the requester alone
  std::vector<std::vector<uint8_t>> regions;  // encoded descriptors; blocks index into it
  struct Block {
    uint32_t region = 0;
    uint64_t offset = 0;
    uint64_t bytes = 0;
  };
  std::vector<Block> blocks;
  std::chrono::milliseconds lifetime{0};
  std::chrono::milliseconds retry_after{0};  // kPending: when to ask again
};

class SourceHolds {
 public:
  static constexpr size_t kMaxBlocks = 1024;
  // How SSD-resident blocks are read into DRAM (SsdTier::Load in a Manager): the SSD-only keys read with
  // the tier's coalesced path, verified and sealed into DRAM; `done` gets pins on the prefix of `keys` now in DRAM,
  // on another thread (or this one). An error: nothing was started, and `done` is never called.
  using SsdLoader = std::function<Status(std::vector<state::StateKey> keys,
                                         std::function<void(std::vector<core::BlockPin> pins)> done)>;
  struct Options {
    std::chrono::milliseconds max_lifetime{30000};  // a grant's deadline is capped at this
    std::function<MonoTime()> now = [] { return MonoNow(); };
    // Null: SSD residences are refused (kNotInDram). With it, `ssd_staging` (required) is charged the bytes of a
    // preparation from its start until its grant drained (--remote-ssd-staging-budget).
    SsdLoader load_ssd;
    core::Budget* ssd_staging = nullptr;
    std::chrono::milliseconds retry_after{2};
    // A preparation reads its span in pieces of at most this many bytes, all started at once: the first piece is
    // granted as soon as it is in DRAM (stop kMore), so the requester reads it while the rest is read from SSD.
    uint64_t prepare_piece_bytes = 16ull << 20;
    // The first piece of a new preparation is at most this (then each piece twice the last, up to
    // prepare_piece_bytes): the requester's first read starts after one small SSD read, not a whole piece's.
    uint64_t first_piece_bytes = 4ull << 20;
    // An authorization that would answer kPending waits up to this for its first piece to be in DRAM and answers
    // the grant instead (no poll, no sleep on the requester's side); 0 answers kPending at once.
    std::chrono::milliseconds pending_wait{20};
  };
  struct Stats {
    uint64_t sessions = 0;      // holds alive (pinned), quarantined or not
    uint64_t pinned_bytes = 0;  // bytes of pinned blocks (allocations) over every hold
    uint64_t quarantined = 0;   // holds whose deadline passed or requester vanished, not yet drained
    uint64_t quarantined_bytes = 0;
    uint64_t granted = 0;   // Authorize calls that granted (duplicates not counted)
    uint64_t released = 0;  // holds freed after draining
    uint64_t rejected = 0;  // authorizations refused (stale, not in DRAM, no room), and by reason:
    uint64_t rejected_stale = 0, rejected_not_in_dram = 0, rejected_exhausted = 0, rejected_ssd_backpressure = 0,
             rejected_ssd_missing = 0;
    uint64_t release_secret_refusals = 0;  // releases by grant id without the grant's secret (nothing released)
    // SSD preparations started, in progress now, granted, refused for staging room, found missing (a
    // read or checksum failure), and the blocks and bytes read from SSD for peers.
    uint64_t ssd_preparations = 0;
    uint64_t ssd_preparing = 0;
    uint64_t ssd_granted = 0;
    uint64_t ssd_backpressure = 0;
    uint64_t ssd_missing = 0;
    uint64_t ssd_prepared_blocks = 0;
    uint64_t ssd_prepared_bytes = 0;
    uint64_t ssd_staging_bytes = 0;  // charged now
  };

  // `table`, `pool`, `budget` and `issuer` must outlive the holds.
  SourceHolds(Options options, core::BlockTable* table, core::PinnedPool* pool, core::Budget* budget,
              GrantIssuer* issuer);
  // Revokes what is still held and waits for nothing: remaining pins go with the holds (the transfer engine must
  // be stopped first, so nothing reads them any more).
  ~SourceHolds();

  // Pins the longest prefix of `args.blocks` held in exactly the named versions (within the byte limit) and grants
  // reads of it. kStale/kNotInDram with nothing pinned when the first block is not held so (counted as a
  // rejection). A span whose first block is named on SSD (and held there in that generation) is
  // prepared: staging credit charged, the SSD blocks read into DRAM (load_ssd), kPending answered; asked again with
  // the same request id, it answers kPending until the blocks are in DRAM, then the grant of the prefix that made
  // it (kMissing when none did), or kBackpressure at once when the staging budget is full. ResourceExhausted (nothing
  // pinned) past the transfer budget, the peer's budget or the session limit; InvalidArgument for no blocks or more
  // than kMaxBlocks; the issuer's error otherwise. A kPending answer is first held back up to Options::pending_wait
  // (not past args.answer_by) while the first piece is read, and becomes the grant (or kMissing) if it is read by then.
  Result<SourceGrant> Authorize(const AuthorizeArgs& args) EXCLUDES(authorize_mu_, mu_);
  // Ends the hold `request_id` of `peer_runtime`: revoke, drain, free. False when there is none (already released
  // or never granted).
  bool Release(const std::string& peer_runtime, uint64_t request_id) EXCLUDES(mu_);
  // Ends the hold whose grant is `grant_id`, if `peer_node` holds it: the release by grant id alone (a requester
  // that registered again, or whose view or this one is incomplete). False when there is none.
  // The release must present the grant's secret (compared in constant time); one that does not is refused, counted
  // (Stats::release_secret_refusals) and releases nothing.
  bool ReleaseGrant(const std::string& peer_node, uint64_t grant_id, const std::string& grant_secret) EXCLUDES(mu_);
  // Quarantines and revokes holds past their deadline. Returns how many it revoked.
  size_t ExpireDue() EXCLUDES(mu_);
  // Quarantines and revokes every hold not being revoked yet (this Manager's registration ended: its grants belong
  // to a start of it that peers no longer address). The pins go once each grant drained, as ever; holds granted
  // later are not affected and never wait for these. With `stop_accepting`, Authorize refuses (FailedPrecondition)
  // until Accept(): an authorization already past the peer service's remote-work check cannot slip in after the
  // revocation. Returns how many it revoked.
  size_t RevokeAll(std::string_view why, bool stop_accepting = false) EXCLUDES(authorize_mu_, mu_);
  // Grants again after RevokeAll(..., true) (a new registration).
  void Accept() EXCLUDES(authorize_mu_);
  // Quarantines and revokes every hold of requesters `alive` says are gone (it gets node and runtime); their
  // endpoints are force-closed (GrantIssuer::RevokePeer). Returns how many requesters.
  size_t DropVanished(const std::function<bool(const std::string& node, const std::string& runtime)>& alive)
      EXCLUDES(authorize_mu_, mu_);
  Stats GetStats() const EXCLUDES(mu_);
  // The source_* stats keys and the orbitkv_source_* metrics (rejections by reason).
  void VisitStats(StatsVisitor& v) const EXCLUDES(mu_);

 private:
  struct Hold {
    std::string peer_node;
    SourceGrant grant;
    std::vector<core::BlockPin> pins;
    core::BudgetTicket ticket;
    core::BudgetTicket staging;  // an SSD preparation's, until it drained
    uint64_t bytes = 0;          // allocation bytes pinned
    MonoTime deadline;
    HoldPhase phase = HoldPhase::kGranted;  // stepped by hold_lifecycle.h's Step only
  };
  using HoldKey = std::pair<std::string, uint64_t>;  // (requester runtime, request id)

  // Authorize without the wait for a pending preparation.
  Result<SourceGrant> AuthorizeNow(const AuthorizeArgs& args) EXCLUDES(authorize_mu_, mu_);
  // The issuer said the grant drained: free the hold.
  void Drained(const HoldKey& key) EXCLUDES(mu_);
  // A span named on SSD: starts its preparation (or answers why not); `read_ahead`: the later pieces are
  // read too (not when an earlier preparation of the span does so already).
  Result<SourceGrant> Prepare(const AuthorizeArgs& args, const HoldKey& key, bool read_ahead) REQUIRES(authorize_mu_)
      EXCLUDES(mu_);
  // The first piece of the preparation of `key` is read, `pins` on its prefix now in DRAM: grant it with `stop` as
  // the reason it ends there (kMore: later pieces are being read), or record it missing when nothing made it.
  // `counted`: as StartReading said for the piece.
  void Prepared(const HoldKey& key, std::vector<core::BlockPin> pins, SourceOutcome stop,
                const std::vector<bool>& counted) EXCLUDES(mu_);
  // reading_: `keys` are being read from now on. Returns which of them this read brings from SSD itself (and counts
  // as read for peers): not those in DRAM already, nor those whose read another preparation started (a
  // continuation's, or another requester's of the same span).
  std::vector<bool> StartReading(const std::vector<state::StateKey>& keys) EXCLUDES(mu_);
  // reading_: `keys` were read (or their read was not started).
  void UnmarkReading(const std::vector<state::StateKey>& keys) EXCLUDES(mu_);
  // ssd_prepared_blocks/_bytes: the blocks of `pins` StartReading called fresh.
  void CountPrepared(const std::vector<core::BlockPin>& pins, const std::vector<bool>& fresh) EXCLUDES(mu_);
  // Grants `pins` to `peer_runtime` into `grant` (regions, blocks, id, secret); the issuer is called here.
  Status Issue(const std::string& peer_runtime, const std::vector<core::BlockPin>& pins, SourceGrant* grant);
  void Revoke(const HoldKey& key, uint64_t grant);
  void Reject(SourceOutcome why);
  void UpdateGauges() REQUIRES(mu_);

  const Options options_;
  core::BlockTable* const table_;
  core::PinnedPool* const pool_;
  core::Budget* const budget_;
  GrantIssuer* const issuer_;

  Mutex authorize_mu_;  // before mu_
  bool accepting_ GUARDED_BY(authorize_mu_) = true;
  mutable Mutex mu_;
  std::map<HoldKey, Hold> holds_ GUARDED_BY(mu_);
  std::condition_variable_any prepared_;  // a preparation ended (granted, missing) or its hold went
  // The keys of the SSD reads preparations started and that have not completed (a count per key): a
  // request whose span starts inside one continues that preparation (whole pieces, no second read-ahead).
  std::unordered_map<state::StateKey, uint32_t, state::StateKeyHash> reading_ GUARDED_BY(mu_);
  Stats stats_ GUARDED_BY(mu_);
};

}  // namespace orbitkv::catalog

#endif  // ORBITKV_CATALOG_SOURCE_HOLDS_H_
