#include "catalog/discovery.h"

#include <algorithm>
#include <atomic>
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
  // The unknown keys from the first unknown one on, grouped by catalog host (order kept within a host).
  std::map<std::string, std::vector<state::StateKey>> by_host;
  for (size_t i = known; i < keys.size(); ++i) {
    if (!index_->Find(keys[i]).empty()) continue;
    by_host[options_.host_of(keys[i])].push_back(keys[i]);
  }
  std::vector<std::string> hosts;
  for (const auto& [host, host_keys] : by_host) {
    if (BreakerOpen(host, start)) {
      outcome.skipped_hosts.push_back(host);
    } else {
      hosts.push_back(host);
    }
  }
  // At most max_hosts hosts in flight: each worker takes the next host and sends its batches in order.
  std::atomic<size_t> next_host{0};
  std::atomic<size_t> rpcs{0};
  std::atomic<size_t> in_flight{0}, max_in_flight{0};
  Mutex failed_mu;
  std::vector<std::string> failed, refused;
  auto work = [&] {
    for (size_t h = next_host.fetch_add(1); h < hosts.size(); h = next_host.fetch_add(1)) {
      const std::vector<state::StateKey>& host_keys = by_host.at(hosts[h]);
      const size_t now_in_flight = in_flight.fetch_add(1) + 1;
      for (size_t seen = max_in_flight.load(); now_in_flight > seen &&
                                               !max_in_flight.compare_exchange_weak(seen, now_in_flight);) {
      }
      for (size_t at = 0; at < host_keys.size(); at += options_.max_keys_per_rpc) {
        if (deadline.Expired()) break;
        const size_t n = std::min(options_.max_keys_per_rpc, host_keys.size() - at);
        const std::span<const state::StateKey> batch(host_keys.data() + at, n);
        rpcs.fetch_add(1, std::memory_order_relaxed);
        Result<std::vector<LookupRow>> rows = transport_->Lookup(hosts[h], batch, deadline);
        if (!rows.ok() && IsRouteRefusal(rows.status())) {  // it answered: the next discovery asks it again
          MutexLock lock(&failed_mu);
          refused.push_back(hosts[h]);
          break;
        }
        if (!rows.ok() || rows->size() != n) {  // down, too slow or malformed: skip it for a while
          ORBITKV_LOG_WARN("discovery: catalog host '{}' {}: its shards are not asked for {} ms",
                           hosts[h],
                           rows.ok() ? fmt::format("answered {} rows for {} keys", rows->size(), n)
                                     : fmt::format("failed ({})", rows.status().ToString()),
                           options_.breaker_open.count());
          Trip(hosts[h], options_.now());
          MutexLock lock(&failed_mu);
          failed.push_back(hosts[h]);
          break;
        }
        for (size_t i = 0; i < n; ++i) index_->Insert(batch[i], (*rows)[i].candidates);
      }
      in_flight.fetch_sub(1);
    }
  };
  const size_t workers = std::min(options_.max_hosts, hosts.size());
  std::vector<std::thread> threads;
  for (size_t w = 1; w < workers; ++w) threads.emplace_back(work);
  if (workers > 0) work();
  for (std::thread& t : threads) t.join();
  outcome.rpcs = rpcs.load();
  {
    MutexLock lock(&failed_mu);
    outcome.failed_hosts = std::move(failed);
    outcome.refused_hosts = std::move(refused);
  }
  outcome.known_prefix = index_->KnownPrefix(keys);
  {
    MutexLock lock(&mu_);
    stats_.rpcs += outcome.rpcs;
    stats_.skipped_hosts += outcome.skipped_hosts.size();
    stats_.failed_hosts += outcome.failed_hosts.size();
    stats_.refused_hosts += outcome.refused_hosts.size();
    stats_.max_hosts_in_flight = std::max<uint64_t>(stats_.max_hosts_in_flight, max_in_flight.load());
  }
  return outcome;
}

Discovery::Stats Discovery::GetStats() const {
  MutexLock lock(&mu_);
  return stats_;
}

}  // namespace orbitkv::catalog
