#include "catalog/candidate_index.h"

#include <algorithm>

namespace orbitkv::catalog {

CandidateIndex::CandidateIndex(Options options) : options_(std::move(options)) {}

uint64_t CandidateIndex::Charge(const std::vector<Candidate>& candidates) {
  uint64_t bytes = state::StateKey::kEncodedSize + 64;  // the key and the entry's own bookkeeping
  for (const Candidate& c : candidates) bytes += c.owner_node.size() + c.runtime_uuid.size() + 40;
  return bytes;
}

void CandidateIndex::Erase(Lru::iterator it) {
  stats_.bytes -= it->charge;
  by_key_.erase(it->key);
  lru_.erase(it);
}

void CandidateIndex::Clear() {
  MutexLock lock(&mu_);
  while (!lru_.empty()) Erase(lru_.begin());
  stats_.entries = 0;
}

void CandidateIndex::EvictOverBudget() {
  while (stats_.bytes > options_.budget_bytes && !lru_.empty()) {
    Erase(std::prev(lru_.end()));
    ++stats_.evictions;
  }
  stats_.entries = lru_.size();
}

void CandidateIndex::Insert(const state::StateKey& key, const std::vector<Candidate>& candidates) {
  if (candidates.empty()) return;  // misses are not cached
  const MonoTime now = options_.now();
  MutexLock lock(&mu_);
  std::vector<Candidate> merged;
  if (auto it = by_key_.find(key); it != by_key_.end()) {
    if (it->second->expires > now) merged = std::move(it->second->candidates);
    Erase(it->second);
  }
  for (const Candidate& c : candidates) {
    // The same owner start and tier: the newer evidence (the owner's greater insertion sequence) wins, whichever
    // answer arrived last (a slow lookup's older row must not replace a newer one).
    auto same = std::find_if(merged.begin(), merged.end(), [&](const Candidate& old) {
      return old.owner_node == c.owner_node && old.runtime_uuid == c.runtime_uuid && old.tier == c.tier;
    });
    if (same != merged.end()) {
      if (same->sequence > c.sequence) continue;
      merged.erase(same);
    }
    merged.push_back(c);
  }
  if (merged.size() > kMaxCandidatesPerKey) {  // keep the most recently learnt
    merged.erase(merged.begin(), merged.end() - static_cast<std::ptrdiff_t>(kMaxCandidatesPerKey));
  }
  const uint64_t charge = Charge(merged);
  lru_.push_front(Entry{key, std::move(merged), now + options_.ttl, charge});
  by_key_[key] = lru_.begin();
  stats_.bytes += charge;
  EvictOverBudget();
}

std::vector<Candidate> CandidateIndex::Find(const state::StateKey& key) {
  const MonoTime now = options_.now();
  MutexLock lock(&mu_);
  auto it = by_key_.find(key);
  if (it == by_key_.end()) {
    ++stats_.misses;
    return {};
  }
  if (it->second->expires <= now) {
    Erase(it->second);
    stats_.entries = lru_.size();
    ++stats_.misses;
    return {};
  }
  lru_.splice(lru_.begin(), lru_, it->second);  // most recently used; the TTL stays as it was
  ++stats_.hits;
  return it->second->candidates;
}

size_t CandidateIndex::KnownPrefix(std::span<const state::StateKey> keys) {
  const MonoTime now = options_.now();
  MutexLock lock(&mu_);
  size_t known = 0;
  for (const state::StateKey& key : keys) {
    auto it = by_key_.find(key);
    if (it == by_key_.end() || it->second->expires <= now) break;
    lru_.splice(lru_.begin(), lru_, it->second);
    ++known;
  }
  return known;
}

void CandidateIndex::Remove(const state::StateKey& key, const std::string& owner_node, const std::string& runtime_uuid,
                            uint64_t generation, uint64_t sequence) {
  MutexLock lock(&mu_);
  auto it = by_key_.find(key);
  if (it == by_key_.end()) return;
  Entry& entry = *it->second;
  std::erase_if(entry.candidates, [&](const Candidate& c) {
    return c.owner_node == owner_node && c.runtime_uuid == runtime_uuid && c.generation == generation &&
           c.sequence == sequence;
  });
  if (entry.candidates.empty()) {
    Erase(it->second);
  } else {
    const uint64_t charge = Charge(entry.candidates);
    stats_.bytes = stats_.bytes - entry.charge + charge;
    entry.charge = charge;
  }
  stats_.entries = lru_.size();
}

CandidateIndex::Stats CandidateIndex::GetStats() const {
  MutexLock lock(&mu_);
  return stats_;
}

}  // namespace orbitkv::catalog
