#include "catalog/discovery.h"

#include <algorithm>
#include <atomic>
#include <set>
#include <thread>

#include <fmt/format.h>

#include "base/logging.h"

namespace orbitkv::catalog {

Discovery::Discovery(Options options, CandidateIndex* index, LookupTransport* transport)
    : options_(std::move(options)), index_(index), transport_(transport) {}

bool Discovery::BreakerOpen(const std::string& host, MonoTime now) {
  MutexLock lock(&mu_);
  auto it = open_until_.find(host);
  return it != open_until_.end() && now < it->second;
}

std::vector<std::string> Discovery::Order(std::vector<std::string> copies, const std::string& shard, uint64_t turn,
                                          MonoTime now) {
  if (copies.size() <= 1) return copies;
  // The rotation first (per requester and shard), then a stable sort by breaker (closed first) and by whether the
  // copy answered incomplete for this shard lately.
  const std::string& first = shard;
  std::rotate(copies.begin(), copies.begin() + static_cast<std::ptrdiff_t>(turn % copies.size()), copies.end());
  std::vector<std::pair<int, std::string>> ranked;  // (rank, host): stable-sorted by rank below
  {
    MutexLock lock(&mu_);
    for (std::string& host : copies) {
      auto open = open_until_.find(host);
      const bool broken = open != open_until_.end() && now < open->second;
      auto seen = incomplete_until_.find({host, first});
      const bool incomplete = seen != incomplete_until_.end() && now < seen->second;
      ranked.emplace_back((broken ? 2 : 0) + (incomplete ? 1 : 0), std::move(host));
    }
  }
  std::stable_sort(ranked.begin(), ranked.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  for (size_t i = 0; i < ranked.size(); ++i) copies[i] = std::move(ranked[i].second);
  return copies;
}

void Discovery::ResetBreakers() {
  MutexLock lock(&mu_);
  open_until_.clear();
}

void Discovery::Trip(const std::string& host, MonoTime now) {
  MutexLock lock(&mu_);
  open_until_[host] = now + options_.breaker_open;
}

Discovery::Outcome Discovery::Discover(std::span<const state::StateKey> keys) {
  Outcome outcome;
  size_t known = index_->KnownPrefix(keys);
  if (known == keys.size()) {  // warm: nothing to ask
    outcome.known_prefix = known;
    return outcome;
  }
  // Concurrent misses of the same prefix (the same first unknown key) share one lookup: a later one waits for it
  // (at most one budget) and checks the index again. When that left keys unknown for it, it looks them up itself
  // (an empty result proves nothing).
  std::optional<Flights<state::StateKey, state::StateKeyHash>::Ticket> flight =
      flights_.WaitOrStart(keys[known], Deadline::After(options_.budget));
  if (!flight.has_value()) {
    const size_t now_known = index_->KnownPrefix(keys);
    if (now_known == keys.size()) {
      MutexLock lock(&mu_);
      ++stats_.coalesced;
      outcome.coalesced = true;
      outcome.known_prefix = now_known;
      return outcome;
    }
    known = now_known;
    flight.emplace(flights_.Start(keys[known]));
  }
  // The budget of this lookup, counted after coalescing.
  const Deadline deadline = Deadline::After(options_.budget);
  const MonoTime start = options_.now();
  // The unknown keys from the first unknown one on, each with its shard's copies in the order to ask them.
  struct Pending {
    state::StateKey key;
    std::string shard;  // names the key's shard (its number with shard_of, else its first copy in placement order)
    std::vector<std::string> copies;  // in the order to ask them
    size_t next = 0;  // the copy to ask next
  };
  std::vector<Pending> pending;
  for (size_t i = known; i < keys.size(); ++i) {
    if (!index_->Find(keys[i]).empty()) continue;
    std::vector<std::string> copies =
        options_.copies_of ? options_.copies_of(keys[i]) : std::vector<std::string>{options_.host_of(keys[i])};
    std::string shard = options_.shard_of ? std::to_string(options_.shard_of(keys[i])) : copies.front();
    const uint64_t turn = options_.rotation + std::hash<std::string>{}(shard);
    pending.push_back(Pending{keys[i], shard, Order(std::move(copies), shard, turn, start), 0});
  }
  std::set<std::string> skipped;
  std::vector<std::string> failed, refused;
  std::set<std::string> failed_over;  // shards (by their first copy) whose keys went on to another copy
  std::atomic<size_t> rpcs{0};
  std::atomic<size_t> max_in_flight{0};
  // Rounds: each key's next copy whose breaker is closed; keys grouped by that host and sent in batches, at most
  // max_hosts hosts in flight. A key whose copy failed, was too slow or answered incomplete without a holder goes on
  // to its next copy in the next round.
  for (size_t round = 0; !pending.empty() && !deadline.Expired(); ++round) {
    std::map<std::string, std::vector<size_t>> by_host;  // host -> indexes into pending, in key order
    const MonoTime now = options_.now();
    for (size_t i = 0; i < pending.size(); ++i) {
      Pending& p = pending[i];
      while (p.next < p.copies.size() && BreakerOpen(p.copies[p.next], now)) skipped.insert(p.copies[p.next++]);
      if (p.next == p.copies.size()) continue;
      by_host[p.copies[p.next]].push_back(i);
      if (round > 0) failed_over.insert(p.shard);
    }
    if (by_host.empty()) break;
    std::vector<std::pair<std::string, std::vector<size_t>>> hosts(by_host.begin(), by_host.end());
    std::vector<size_t> again;  // pending keys to ask their next copy
    Mutex again_mu;
    std::atomic<size_t> next_host{0};
    std::atomic<size_t> in_flight{0};
    auto work = [&] {
      for (size_t h = next_host.fetch_add(1); h < hosts.size(); h = next_host.fetch_add(1)) {
        const std::string& host = hosts[h].first;
        const std::vector<size_t>& mine = hosts[h].second;
        const size_t now_in_flight = in_flight.fetch_add(1) + 1;
        for (size_t seen = max_in_flight.load(); now_in_flight > seen &&
                                                 !max_in_flight.compare_exchange_weak(seen, now_in_flight);) {
        }
        // A copy that is the last one left for some key (no later copy with a closed breaker) gets the whole budget;
        // otherwise each RPC gets the per-copy deadline, so a copy that does not answer costs at most that before
        // the next copy is asked.
        bool last_for_some = false;
        for (size_t i : mine) {
          bool later = false;
          for (size_t c = pending[i].next + 1; c < pending[i].copies.size() && !later; ++c) {
            later = !BreakerOpen(pending[i].copies[c], options_.now());
          }
          last_for_some = last_for_some || !later;
        }
        std::vector<size_t> retry;
        std::map<std::string, bool> complete;  // shard -> every row of it from this host was complete
        for (size_t at = 0; at < mine.size(); at += options_.max_keys_per_rpc) {
          const size_t n = std::min(options_.max_keys_per_rpc, mine.size() - at);
          if (deadline.Expired()) break;
          const Deadline rpc_deadline =
              last_for_some
                  ? deadline
                  : Deadline::At(std::min(deadline.when(), Deadline::After(options_.copy_deadline).when()));
          std::vector<state::StateKey> batch;
          batch.reserve(n);
          for (size_t k = 0; k < n; ++k) batch.push_back(pending[mine[at + k]].key);
          rpcs.fetch_add(1, std::memory_order_relaxed);
          Result<std::vector<LookupRow>> rows = transport_->Lookup(host, batch, rpc_deadline);
          if (!rows.ok() || rows->size() != n) {
            if (!rows.ok() && IsRouteRefusal(rows.status())) {  // it answered: the next discovery asks it again
              MutexLock lock(&again_mu);
              refused.push_back(host);
            } else {  // down, too slow or malformed: skip it for a while
              ORBITKV_LOG_WARN("discovery: catalog host '{}' {}: not asked for {} ms{}", host,
                               rows.ok() ? fmt::format("answered {} rows for {} keys", rows->size(), n)
                                         : fmt::format("failed ({})", rows.status().ToString()),
                               options_.breaker_open.count(),
                               last_for_some ? "" : "; its shards' other copies are asked");
              Trip(host, options_.now());
              MutexLock lock(&again_mu);
              failed.push_back(host);
            }
            for (size_t k = at; k < mine.size(); ++k) retry.push_back(mine[k]);
            break;
          }
          for (size_t k = 0; k < n; ++k) {
            const LookupRow& row = (*rows)[k];
            if (!row.candidates.empty()) {
              index_->Insert(batch[k], row.candidates);
            } else if (!row.complete) {
              retry.push_back(mine[at + k]);  // a miss from an incomplete copy proves nothing: ask the next one
            }
            auto [it, fresh] = complete.emplace(pending[mine[at + k]].shard, row.complete);
            if (!fresh) it->second = it->second && row.complete;
          }
        }
        {
          const MonoTime until = options_.now() + options_.breaker_open;
          MutexLock lock(&mu_);
          for (const auto& [shard, whole] : complete) incomplete_until_[{host, shard}] = whole ? MonoTime{} : until;
        }
        MutexLock lock(&again_mu);
        again.insert(again.end(), retry.begin(), retry.end());
        in_flight.fetch_sub(1);
      }
    };
    const size_t workers = std::min(options_.max_hosts, hosts.size());
    std::vector<std::thread> threads;
    for (size_t w = 1; w < workers; ++w) threads.emplace_back(work);
    if (workers > 0) work();
    for (std::thread& t : threads) t.join();
    std::sort(again.begin(), again.end());
    std::vector<Pending> next_round;
    for (size_t i : again) {
      Pending p = std::move(pending[i]);
      ++p.next;
      next_round.push_back(std::move(p));
    }
    pending = std::move(next_round);
  }
  outcome.rpcs = rpcs.load();
  outcome.skipped_hosts.assign(skipped.begin(), skipped.end());
  outcome.failed_hosts = std::move(failed);
  outcome.refused_hosts = std::move(refused);
  outcome.failovers = failed_over.size();
  outcome.known_prefix = index_->KnownPrefix(keys);
  {
    MutexLock lock(&mu_);
    stats_.rpcs += outcome.rpcs;
    stats_.skipped_hosts += outcome.skipped_hosts.size();
    stats_.failed_hosts += outcome.failed_hosts.size();
    stats_.refused_hosts += outcome.refused_hosts.size();
    stats_.failovers += outcome.failovers;
    stats_.max_hosts_in_flight = std::max<uint64_t>(stats_.max_hosts_in_flight, max_in_flight.load());
  }
  return outcome;
}

Discovery::Stats Discovery::GetStats() const {
  MutexLock lock(&mu_);
  return stats_;
}

}  // namespace orbitkv::catalog
