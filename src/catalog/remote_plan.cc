#include "catalog/remote_plan.h"

#include <algorithm>
#include <map>
#include <thread>

#include "fmt/format.h"

namespace orbitkv::catalog {
namespace {

constexpr uint8_t kDramTier = 1;  // core::Tier::kDram
constexpr uint8_t kSsdTier = 2;   // core::Tier::kSsd

using Source = std::pair<std::string, std::string>;  // (node, runtime)

}  // namespace

std::optional<PlannedSpan> PlanSpan(std::span<const state::StateKey> keys, CandidateIndex& index,
                                    const std::string& self_node, const std::set<Source>& excluded) {
  if (keys.empty()) return std::nullopt;
  // Sources still covering every key so far, with their versions; a source drops out at its first gap.
  struct Run {
    std::vector<SourceBlockVersion> versions;
    std::vector<uint64_t> bytes;
    size_t ssd = 0;  // blocks named on the source's SSD (read into its DRAM before they are granted)
  };
  std::map<Source, Run> running;
  std::map<Source, Run> finished;
  const size_t n = std::min(keys.size(), SourceHolds::kMaxBlocks);  // what one authorization may name
  for (size_t i = 0; i < n; ++i) {
    // Find returns copies: `found` keeps them alive for this step.
    std::vector<Candidate> found = index.Find(keys[i]);
    // Per source its DRAM replica, else its SSD one (a source's own DRAM copy of a key is served at once).
    std::map<Source, const Candidate*> here;
    for (const Candidate& c : found) {
      if ((c.tier != kDramTier && c.tier != kSsdTier) || c.owner_node == self_node) continue;
      Source source{c.owner_node, c.runtime_uuid};
      if (excluded.count(source) != 0) continue;
      auto [at, added] = here.emplace(std::move(source), &c);
      if (!added && c.tier == kDramTier) at->second = &c;
    }
    if (i == 0) {
      for (const auto& [source, c] : here) running[source];
    }
    for (auto it = running.begin(); it != running.end();) {
      auto at = here.find(it->first);
      if (at == here.end()) {
        finished.insert(*it);
        it = running.erase(it);
      } else {
        it->second.versions.push_back({keys[i], at->second->generation, at->second->sequence, at->second->tier});
        it->second.bytes.push_back(at->second->bytes);
        it->second.ssd += at->second->tier == kSsdTier ? 1 : 0;
        ++it;
      }
    }
    if (running.empty()) break;
  }
  for (auto& entry : running) finished.insert(std::move(entry));
  // The longest span; of equal ones the one with fewer blocks on SSD (peer DRAM before peer SSD), and std::map
  // order makes the smallest (node, runtime) win a tie.
  const std::pair<const Source, Run>* best = nullptr;
  for (const auto& entry : finished) {
    if (entry.second.versions.empty()) continue;
    if (best == nullptr || entry.second.versions.size() > best->second.versions.size() ||
        (entry.second.versions.size() == best->second.versions.size() && entry.second.ssd < best->second.ssd)) {
      best = &entry;
    }
  }
  if (best == nullptr) return std::nullopt;
  return PlannedSpan{best->first.first, best->first.second, best->second.versions, best->second.bytes};
}

AuthorizeOutcome AuthorizeBest(std::span<const state::StateKey> keys, CandidateIndex& index, SourceTransport& transport,
                               const AuthorizeOptions& options) {
  AuthorizeOutcome outcome;
  std::set<Source> excluded = options.excluded;
  for (size_t attempt = 0; attempt <= options.max_alternatives; ++attempt) {
    if (options.deadline.Expired()) {
      outcome.last_error = Status::DeadlineExceeded("no source granted the blocks within the fetch's deadline");
      break;
    }
    std::optional<PlannedSpan> span = PlanSpan(keys, index, options.self_node, excluded);
    if (!span.has_value()) break;
    ++outcome.attempts;
    const Source source{span->node, span->runtime};
    const Deadline rpc = Deadline::At(std::min(options.deadline.when(), Deadline::After(options.rpc_timeout).when()));
    Result<SourceReply> reply = transport.Authorize(span->node, span->runtime, options.request_id, span->versions,
                                                    options.byte_limit, options.lifetime, rpc);
    // SSD blocks being read into the source's DRAM: ask again, same request id, until granted (or
    // missing) within the deadline; backing off from the source's hint to 5 ms (a 16 MiB piece reads in about that).
    std::chrono::milliseconds wait{1};
    while (reply.ok() && reply->grant.outcome == SourceOutcome::kPending) {
      ++outcome.polls;
      wait = std::clamp(std::max(wait * 2, reply->grant.retry_after), std::chrono::milliseconds(1),
                        std::chrono::milliseconds(5));
      if (options.deadline.Remaining() <= wait) {
        reply = Status::DeadlineExceeded("the source was still reading the blocks from its SSD at the deadline");
        break;
      }
      std::this_thread::sleep_for(wait);
      const Deadline again =
          Deadline::At(std::min(options.deadline.when(), Deadline::After(options.rpc_timeout).when()));
      reply = transport.Authorize(span->node, span->runtime, options.request_id, span->versions, options.byte_limit,
                                  options.lifetime, again);
    }
    if (!reply.ok()) {
      ++outcome.failures;
      outcome.last_error = reply.status().WithContext(fmt::format("authorizing at {}", span->node));
      excluded.insert(source);
      // A source that is gone or refuses the request outright: its versions in this span are not to be tried
      // again from this index. A busy one (ResourceExhausted) keeps them: it may have room next time.
      if (reply.status().code() != StatusCode::kResourceExhausted) {
        for (const SourceBlockVersion& v : span->versions) {
          index.Remove(v.key, span->node, span->runtime, v.generation, v.sequence);
        }
      }
      // The source may have granted after this side gave up (too slow, connection lost): tell it, best effort,
      // so the hold does not wait out its deadline there.
      if (reply.status().code() == StatusCode::kDeadlineExceeded || reply.status().code() == StatusCode::kUnavailable ||
          reply.status().code() == StatusCode::kCancelled) {
        (void)transport.Release(span->node, span->runtime, options.request_id, /*grant_id=*/0,
                                /*grant_secret=*/"", Deadline::After(std::chrono::milliseconds(200)));
      }
      continue;
    }
    const SourceGrant& grant = reply->grant;
    if (grant.outcome == SourceOutcome::kBackpressure) {
      // No staging room there now: another source, or the local answer. Its candidates stay (room comes back).
      ++outcome.rejections;
      ++outcome.backpressure;
      excluded.insert(source);
      continue;
    }
    if (grant.outcome != SourceOutcome::kGranted || grant.granted == 0) {
      outcome.missing += grant.outcome == SourceOutcome::kMissing ? 1 : 0;
      ++outcome.rejections;
      excluded.insert(source);
      const SourceBlockVersion& refused = span->versions[0];
      index.Remove(refused.key, span->node, span->runtime, refused.generation, refused.sequence);
      continue;
    }
    if (grant.granted < span->versions.size() && grant.stop != SourceOutcome::kGranted &&
        grant.stop != SourceOutcome::kMore) {
      // The source holds the block after the granted prefix in another version (or not in DRAM): forget it.
      const SourceBlockVersion& refused = span->versions[grant.granted];
      index.Remove(refused.key, span->node, span->runtime, refused.generation, refused.sequence);
    }
    outcome.authorized = Authorized{std::move(*span), std::move(*reply)};
    break;
  }
  return outcome;
}

}  // namespace orbitkv::catalog
