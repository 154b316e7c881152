// Discovery: a requesting Manager's bounded lookup of who holds the blocks it misses (seed 000, "Implemented discovery
// behavior"; requester side). Keys the candidate index already knows cost nothing (a warm query makes no RPC); the
// unknown ones are grouped by their shard's catalog copies (each shard has up to --catalog-replicas copies on distinct
// hosts), sent in batches of at most `max_keys_per_rpc`, with at most `max_hosts` hosts asked at once (hedges aside)
// and one total time budget.
//
// A shard's copies are ordered by breaker state, then copies not overtaken by a hedge lately, then copies not seen
// incomplete lately, then a rotation that spreads requesters over the copies. The first copy is asked; when it has
// not answered within `hedge_after` and a later copy is left, that copy is asked too with the first still in flight
// (a hedge), the first answer for a key wins and a call no longer needed is cancelled. Every copy but the last one
// left gets at most `copy_deadline` (then it counts as failed), the last one the rest of the budget. So a dead or
// blackholed catalog host costs a lookup about `hedge_after`, not the budget. A host that fails or times out opens
// its breaker: later discoveries skip it at once (for `breaker_open`). Rows with candidates are learnt by the index;
// an empty row from a complete copy is authoritative (no other copy is asked for that key), one from an incomplete
// copy is not (the next copy is asked); empty rows are never cached. Never one RPC per block, never a broadcast.
//
// Concurrent misses of the same prefix share one lookup: a caller whose first unknown key is being looked up waits
// for that lookup (within its own budget) and reads the index again; when it brought nothing new, it looks up
// itself (empty rows prove nothing: there is no negative-result coalescing).
//
// Thread safety: Discover may be called from any thread (breakers and lookups in flight are shared under a mutex).
#ifndef ORBITKV_CATALOG_DISCOVERY_H_
#define ORBITKV_CATALOG_DISCOVERY_H_

#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "base/clock.h"
#include "base/flights.h"
#include "base/mutex.h"
#include "base/result.h"
#include "base/thread_annotations.h"
#include "catalog/candidate_index.h"

namespace orbitkv::catalog {

struct LookupRow {
  std::vector<Candidate> candidates;
  bool placed_here = false;
  bool complete = false;
};

// Lets Discovery cancel a lookup call it no longer needs (a hedge answered first). The transport arms it with how
// to cancel the call it is about to make (gRPC: ClientContext::TryCancel) and disarms it when the call returned.
class CallCancel {
 public:
  // False when Cancel() came first: then the call is not made.
  bool Arm(std::function<void()> cancel) EXCLUDES(mu_);
  void Disarm() EXCLUDES(mu_);
  void Cancel() EXCLUDES(mu_);
  bool cancelled() const EXCLUDES(mu_);

 private:
  mutable Mutex mu_;
  bool cancelled_ GUARDED_BY(mu_) = false;
  std::function<void()> cancel_ GUARDED_BY(mu_);
};

// How the requester reaches catalog hosts (Peer.Lookup in a Manager; in process in the unit tests). Rows align
// with `keys`. `cancel` may be null; a cancelled call returns CANCELLED soon.
class LookupTransport {
 public:
  virtual ~LookupTransport() = default;
  virtual Result<std::vector<LookupRow>> Lookup(const std::string& host, std::span<const state::StateKey> keys,
                                                Deadline deadline, CallCancel* cancel) = 0;
};

// Whether `status` is membership skew rather than a host that is down or too slow: a peer's quick refusal by its
// route check (it answered), or this side's view not showing the host as a live member now (NOT_FOUND: no RPC was
// made). Both settle as the views catch up: right after a Manager registered again its peers' views may not show
// its new start for a moment, and a peer that is registering again itself is briefly no member at all.
inline bool IsRouteRefusal(const Status& status) {
  return status.code() == StatusCode::kPermissionDenied || status.code() == StatusCode::kFailedPrecondition ||
         status.code() == StatusCode::kNotFound ||
         (status.code() == StatusCode::kUnavailable && status.reason() == StatusReason::kViewIncomplete);
}

class Discovery {
 public:
  struct Options {
    size_t max_keys_per_rpc = 128;
    size_t max_hosts = 4;  // --discovery-max-hosts
    std::chrono::milliseconds budget{3000};
    std::chrono::milliseconds breaker_open{5000};
    // How long a copy that is not the last one left may take before it counts as failed.
    std::chrono::milliseconds copy_deadline{300};
    // How long an RPC to a copy that is not the last one left may take before the next copy is asked beside it (a
    // hedge; --discovery-hedge-ms): at least this, and at least 3x that host's recent answer time, or
    // `hedge_unsampled` while it has not answered yet. A healthy lookup takes about a millisecond in a data centre.
    std::chrono::milliseconds hedge_after{5};
    std::chrono::milliseconds hedge_unsampled{100};
    // The catalog hosts keeping a key's shard, in placement order (all keys of one shard get the same list).
    std::function<std::vector<std::string>(const state::StateKey&)> copies_of;
    // How many of copies_of's first copies are the committed ones (the rest: the new copies of a shard that moves
    // to the next placement). The rotation spreads requesters within each group, so the still-filling new copies
    // are asked only after the committed ones. Unset: one group.
    std::function<size_t(const state::StateKey&)> committed_copies_of;
    // Or, with one copy a shard: the catalog host a key's shard is placed on (used when copies_of is empty).
    std::function<std::string(const state::StateKey&)> host_of;
    // Spreads requesters over a shard's copies (e.g. a hash of the requester's Node ID), and with shard_of a
    // requester's shards over their copies: a shard's copies are rotated by (rotation + shard_of(key)).
    uint64_t rotation = 0;
    std::function<uint32_t(const state::StateKey&)> shard_of;
    std::function<MonoTime()> now = [] { return MonoNow(); };
  };
  struct Outcome {
    size_t rpcs = 0;                         // Lookup RPCs sent
    size_t known_prefix = 0;                 // keys, from the first, with candidates now
    std::vector<std::string> skipped_hosts;  // breakers open: not asked
    std::vector<std::string> failed_hosts;   // asked, failed or too slow: breakers opened
    std::vector<std::string> refused_hosts;  // answered with a route refusal (IsRouteRefusal): no breaker
    size_t failovers = 0;    // shards whose keys went to another copy after one failed, was slow or incomplete
    size_t hedges = 0;       // calls that were slow and had their keys' next copies asked beside them
    bool coalesced = false;  // answered by another caller's lookup of the same prefix
  };

  // Totals since construction, for status and metrics.
  struct Stats {
    uint64_t rpcs = 0;
    uint64_t skipped_hosts = 0;        // hosts not asked because their breaker was open
    uint64_t failed_hosts = 0;         // hosts that failed or were too slow (breaker opened)
    uint64_t refused_hosts = 0;        // hosts that refused by their route check (membership skew): no breaker
    uint64_t failovers = 0;            // shard lookups that moved on to another copy
    uint64_t hedges = 0;               // slow calls hedged (their keys' next copies asked beside them)
    uint64_t coalesced = 0;            // discoveries answered by another caller's lookup
    uint64_t max_hosts_in_flight = 0;  // the most hosts one discovery asked at once, hedges aside
  };

  Discovery(Options options, CandidateIndex* index, LookupTransport* transport);
  // Closes every breaker (this Manager registered again: what failed before says nothing of its new start).
  void ResetBreakers() EXCLUDES(mu_);

  // Looks up the keys of `keys` the index does not know (from the first unknown one on), within the budget.
  Outcome Discover(std::span<const state::StateKey> keys) EXCLUDES(mu_);
  Stats GetStats() const EXCLUDES(mu_);

 private:
  class Run;  // one lookup's calls (discovery.cc)

  bool BreakerOpen(const std::string& host, MonoTime now) EXCLUDES(mu_);
  // `copies` in the order to ask them (breakers closed first, then those not overtaken by a hedge lately, then those
  // not seen incomplete lately, then the rotation).
  std::vector<std::string> Order(std::vector<std::string> copies, size_t committed, const std::string& shard,
                                 uint64_t turn, MonoTime now) EXCLUDES(mu_);
  void Trip(const std::string& host, MonoTime now) EXCLUDES(mu_);
  // `host`'s call was overtaken by its hedge: later lookups ask it after the other copies for a while.
  void MarkSlow(const std::string& host, MonoTime now) EXCLUDES(mu_);
  void NoteIncomplete(const std::string& host, const std::map<std::string, bool>& complete_by_shard, MonoTime now)
      EXCLUDES(mu_);
  // An RPC to `host` answered after `took`; how long one may take before it is hedged.
  void NoteLatency(const std::string& host, MonoClock::duration took) EXCLUDES(mu_);
  MonoClock::duration HedgeDelay(const std::string& host) EXCLUDES(mu_);

  const Options options_;
  CandidateIndex* const index_;
  LookupTransport* const transport_;
  mutable Mutex mu_;
  std::map<std::string, MonoTime> open_until_ GUARDED_BY(mu_);
  std::map<std::string, MonoTime> slow_until_ GUARDED_BY(mu_);          // overtaken by a hedge until then
  std::map<std::string, MonoClock::duration> latency_ GUARDED_BY(mu_);  // moving average of answered RPCs
  // (host, shard) -> until when that copy counts as incomplete for the shard (its last answer
  // was; for breaker_open, so that a copy once incomplete is preferred again later and so asked again).
  std::map<std::pair<std::string, std::string>, MonoTime> incomplete_until_ GUARDED_BY(mu_);
  Stats stats_ GUARDED_BY(mu_);
  // Lookups in flight, by the first key they look up.
  Flights<state::StateKey, state::StateKeyHash> flights_;
};

}  // namespace orbitkv::catalog

#endif  // ORBITKV_CATALOG_DISCOVERY_H_
