// CandidateIndex: what a distributed Manager remembers of who holds which blocks, so a warm query never waits for the
// directory (seed 000, "Query path and bounded subscriptions"). Exact StateKey -> up to four candidates (owner node,
// runtime UUID, tier, generation, insertion sequence, bytes), learnt from catalog lookups:
//  - an LRU bounded by a logical byte budget (16 MiB by default: the key's encoding and each candidate's
//    strings and fields), evicting the least recently used key first;
//  - a TTL (5 s by default) counted from insertion: reads do not extend it, so a stale candidate ages out even
//    while it is read;
//  - misses are not cached (an empty lookup row does not prove absence; a key without candidates has no entry);
//  - a source's rejection removes only the rejected candidate versions (Remove), never the key's other ones.
// Nothing here calls the network: callers look up what is missing and Insert the rows.
//
// Thread safety: every method is safe from any thread (one mutex; each call is O(candidates of its keys)).
#ifndef ORBITKV_CATALOG_CANDIDATE_INDEX_H_
#define ORBITKV_CATALOG_CANDIDATE_INDEX_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <list>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "base/clock.h"
#include "base/mutex.h"
#include "base/thread_annotations.h"
#include "state/state_key.h"

namespace orbitkv::catalog {

struct Candidate {
  std::string owner_node;
  std::string runtime_uuid;
  uint8_t tier = 1;  // core::Tier
  uint64_t generation = 0;
  uint64_t sequence = 0;  // the owner's insertion sequence of the replica (its record version)
  uint64_t bytes = 0;
  friend bool operator==(const Candidate&, const Candidate&) = default;
};

class CandidateIndex {
 public:
  static constexpr size_t kMaxCandidatesPerKey = 4;
  struct Options {
    uint64_t budget_bytes = 16ull << 20;
    std::chrono::milliseconds ttl{5000};
    // The clock (tests pass their own).
    std::function<MonoTime()> now = [] { return MonoNow(); };
  };
  struct Stats {
    uint64_t entries = 0;
    uint64_t bytes = 0;
    uint64_t hits = 0;    // Find calls that returned candidates
    uint64_t misses = 0;  // Find calls that returned none (unknown or expired)
    uint64_t evictions = 0;
  };

  explicit CandidateIndex(Options options);

  // Learns `candidates` for `key` (a lookup row): they join the key's fresh ones, a candidate of the same owner
  // start and tier replacing the older one; at most four are kept (the most recently learnt). The key's TTL
  // starts again. An empty row changes nothing (misses are not cached).
  void Insert(const state::StateKey& key, const std::vector<Candidate>& candidates) EXCLUDES(mu_);
  // The key's candidates while fresh; none when unknown or expired (an expired key is dropped). A hit makes the
  // key the most recently used, without extending its TTL.
  std::vector<Candidate> Find(const state::StateKey& key) EXCLUDES(mu_);
  // How many of `keys`, from the first, have fresh candidates (the span a warm query can plan without the
  // directory).
  size_t KnownPrefix(std::span<const state::StateKey> keys) EXCLUDES(mu_);
  // A source rejected this exact version: drop it (and the key when it was the last one).
  void Remove(const state::StateKey& key, const std::string& owner_node, const std::string& runtime_uuid,
              uint64_t generation, uint64_t sequence) EXCLUDES(mu_);
  // Forgets every candidate (this Manager registered again: what it learnt named peers' starts of before).
  void Clear() EXCLUDES(mu_);
  Stats GetStats() const EXCLUDES(mu_);

  // The logical bytes an entry is charged.
  static uint64_t Charge(const std::vector<Candidate>& candidates);

 private:
  struct Entry {
    state::StateKey key;
    std::vector<Candidate> candidates;
    MonoTime expires;
    uint64_t charge = 0;
  };
  using Lru = std::list<Entry>;  // front: most recently used

  void Erase(Lru::iterator it) REQUIRES(mu_);
  void EvictOverBudget() REQUIRES(mu_);

  const Options options_;
  mutable Mutex mu_;
  Lru lru_ GUARDED_BY(mu_);
  std::unordered_map<state::StateKey, Lru::iterator, state::StateKeyHash> by_key_ GUARDED_BY(mu_);
  Stats stats_ GUARDED_BY(mu_);
};

}  // namespace orbitkv::catalog

#endif  // ORBITKV_CATALOG_CANDIDATE_INDEX_H_
