// Remote planning in the requesting Manager (seed 000, "Query path", step 4): from the candidate index, the source
// whose DRAM or SSD replicas cover the longest contiguous span of the blocks a query misses (of equal spans the one
// with fewer SSD blocks: peer DRAM before peer SSD; then the smaller node id, then runtime UUID), authorized through
// SourceTransport. A span named on a source's SSD is read into that source's DRAM first; the source answers pending,
// and the requester asks again with the same request id until the grant (or missing) comes, within its deadline; a
// source out of SSD staging room answers backpressure and the next one is asked. A source's rejection removes only the
// candidate versions it refused from the index, and at most `max_alternatives` other sources are tried per fetch, with
// no new directory RPC (another query refreshes the evidence). No candidate, or no source granting, means the local
// answer stands.
//
// Thread safety: AuthorizeBest may be called from any thread (the index is thread-safe; the transport must be).
#ifndef ORBITKV_CATALOG_REMOTE_PLAN_H_
#define ORBITKV_CATALOG_REMOTE_PLAN_H_

#include <chrono>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "base/clock.h"
#include "base/result.h"
#include "catalog/candidate_index.h"
#include "catalog/source_holds.h"

namespace orbitkv::catalog {

// A source's answer to Authorize, as the requester sees it.
struct SourceReply {
  SourceGrant grant;
  std::string ucx_address;
};

// How the requester reaches sources (Peer.Authorize/Release in a Manager).
class SourceTransport {
 public:
  virtual ~SourceTransport() = default;
  virtual Result<SourceReply> Authorize(const std::string& node, const std::string& runtime, uint64_t request_id,
                                        std::span<const SourceBlockVersion> blocks, uint64_t byte_limit,
                                        std::chrono::milliseconds lifetime, Deadline deadline) = 0;
  // True when the source held something under the id. `grant_id` (0: unknown) is the grant the source named,
  // `grant_secret` the secret it returned with it (a release by grant id without it is refused): with them the
  // release needs neither side's member view to be complete, nor this side's start to be the one that was granted.
  virtual Result<bool> Release(const std::string& node, const std::string& runtime, uint64_t request_id,
                               uint64_t grant_id, const std::string& grant_secret, Deadline deadline) = 0;
};

struct PlannedSpan {
  std::string node;
  std::string runtime;
  std::vector<SourceBlockVersion> versions;  // the span, from the first key
  std::vector<uint64_t> bytes;               // each block's size as the lookup named it
};

// The best span over `keys` from the index's DRAM and SSD candidates, leaving out `self_node` and the sources in
// `excluded`; none when no candidate holds keys[0].
std::optional<PlannedSpan> PlanSpan(std::span<const state::StateKey> keys, CandidateIndex& index,
                                    const std::string& self_node,
                                    const std::set<std::pair<std::string, std::string>>& excluded);

struct AuthorizeOptions {
  std::string self_node;
  uint64_t request_id = 0;
  uint64_t byte_limit = 0;
  std::chrono::milliseconds lifetime{10000};
  Deadline deadline = Deadline::After(std::chrono::seconds(3));
  // One Authorize RPC's bound (within the deadline): a stopped source costs this, then the next one is asked.
  std::chrono::milliseconds rpc_timeout{1500};
  size_t max_alternatives = 2;
  // Sources not to ask at all (node, runtime): e.g. whose transfers failed a moment ago.
  std::set<std::pair<std::string, std::string>> excluded;
};

struct Authorized {
  PlannedSpan span;  // as planned (the grant may cover a prefix of it: reply.grant.granted)
  SourceReply reply;
};

struct AuthorizeOutcome {
  std::optional<Authorized> authorized;  // none: no source granted anything (the local answer stands)
  size_t attempts = 0;                   // Authorize RPCs sent
  size_t rejections = 0;                 // stale or not-in-DRAM answers
  size_t failures = 0;                   // RPCs that failed (source gone, busy, too slow)
  size_t polls = 0;                      // Authorize RPCs repeated while a source prepared SSD blocks
  size_t backpressure = 0;               // sources whose SSD staging budget was full
  size_t missing = 0;                    // sources whose SSD records failed their read or checksum
  Status last_error;                     // the last failure, for logs
};

// Plans and authorizes, trying at most options.max_alternatives other sources after the first.
AuthorizeOutcome AuthorizeBest(std::span<const state::StateKey> keys, CandidateIndex& index, SourceTransport& transport,
                               const AuthorizeOptions& options);

}  // namespace orbitkv::catalog

#endif  // ORBITKV_CATALOG_REMOTE_PLAN_H_
