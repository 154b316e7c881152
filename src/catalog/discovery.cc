#include "catalog/discovery.h"

#include <algorithm>
#include <atomic>
#include <list>
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

std::vector<std::string> Discovery::Order(std::vector<std::string> copies, size_t committed, const std::string& shard,
                                          uint64_t turn, MonoTime now) {
  if (copies.size() <= 1) return copies;
  // The rotation first (per requester and shard, within the committed copies and within the new ones of a moving
  // shard, which stay behind them), then a stable sort by breaker (closed first), by whether a hedge overtook the
  // copy lately and by whether it answered incomplete for this shard lately.
  const std::string& first = shard;
  committed = std::min(committed, copies.size());
  const auto rotate = [turn](auto begin, auto end) {
    if (end - begin > 1) std::rotate(begin, begin + static_cast<std::ptrdiff_t>(turn % (end - begin)), end);
  };
  rotate(copies.begin(), copies.begin() + static_cast<std::ptrdiff_t>(committed));
  rotate(copies.begin() + static_cast<std::ptrdiff_t>(committed), copies.end());
  std::vector<std::pair<int, std::string>> ranked;  // (rank, host): stable-sorted by rank below
  {
    MutexLock lock(&mu_);
    for (std::string& host : copies) {
      auto open = open_until_.find(host);
      const bool broken = open != open_until_.end() && now < open->second;
      auto slow = slow_until_.find(host);
      const bool overtaken = slow != slow_until_.end() && now < slow->second;
      auto seen = incomplete_until_.find({host, first});
      const bool incomplete = seen != incomplete_until_.end() && now < seen->second;
      ranked.emplace_back((broken ? 4 : 0) + (overtaken ? 2 : 0) + (incomplete ? 1 : 0), std::move(host));
    }
  }
  std::stable_sort(ranked.begin(), ranked.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  for (size_t i = 0; i < ranked.size(); ++i) copies[i] = std::move(ranked[i].second);
  return copies;
}

void Discovery::ResetBreakers() {
  MutexLock lock(&mu_);
  open_until_.clear();
  slow_until_.clear();
}

void Discovery::Trip(const std::string& host, MonoTime now) {
  MutexLock lock(&mu_);
  open_until_[host] = now + options_.breaker_open;
}

void Discovery::MarkSlow(const std::string& host, MonoTime now) {
  MutexLock lock(&mu_);
  slow_until_[host] = now + options_.breaker_open;
}

void Discovery::NoteIncomplete(const std::string& host, const std::map<std::string, bool>& complete_by_shard,
                               MonoTime now) {
  const MonoTime until = now + options_.breaker_open;
  MutexLock lock(&mu_);
  for (const auto& [shard, whole] : complete_by_shard) incomplete_until_[{host, shard}] = whole ? MonoTime{} : until;
}

void Discovery::NoteLatency(const std::string& host, MonoClock::duration took) {
  MutexLock lock(&mu_);
  auto [it, fresh] = latency_.emplace(host, took);
  if (!fresh) it->second = (it->second * 4 + took) / 5;
}

MonoClock::duration Discovery::HedgeDelay(const std::string& host) {
  MonoClock::duration floor = options_.hedge_after;
  MutexLock lock(&mu_);
  auto it = latency_.find(host);
  if (it == latency_.end()) return std::max<MonoClock::duration>(floor, options_.hedge_unsampled);
  return std::max<MonoClock::duration>(floor, it->second * 3);
}

bool CallCancel::Arm(std::function<void()> cancel) {
  MutexLock lock(&mu_);
  if (cancelled_) return false;
  cancel_ = std::move(cancel);
  return true;
}

void CallCancel::Disarm() {
  MutexLock lock(&mu_);
  cancel_ = nullptr;
}

void CallCancel::Cancel() {
  MutexLock lock(&mu_);
  if (cancelled_) return;
  cancelled_ = true;
  if (cancel_) cancel_();
}

bool CallCancel::cancelled() const {
  MutexLock lock(&mu_);
  return cancelled_;
}

// One lookup: its keys, each with its shard's copies in the order to ask them, and the calls asking them. Go() runs
// on the caller's thread and launches the calls (each on a thread of its own, its keys in batches), hedges the slow
// ones, cancels those no longer needed and returns when every key is answered or out of copies, or the budget is
// spent; it joins every call's thread before it returns.
class Discovery::Run {
 public:
  struct Key {
    state::StateKey key;
    std::string shard;  // names the key's shard (its number with shard_of, else its first copy in placement order)
    std::vector<std::string> copies;  // in the order to ask them
    size_t next = 0;                  // the copy to ask next
    size_t asked = 0;                 // calls that asked for it so far
    int in_flight = 0;                // calls asking for it now
    bool resolved = false;            // holders learnt, or a complete copy's miss
    bool hedge = false;               // its call is slow: ask its next copy beside it
  };

  Run(Discovery* discovery, Deadline deadline, std::vector<Key> keys)
      : d_(discovery), deadline_(deadline), keys_(std::move(keys)) {}

  void Go() EXCLUDES(mu_);

  size_t rpcs() const { return rpcs_.load(); }
  size_t max_in_flight() const { return max_in_flight_; }
  // Only after Go() returned.
  std::vector<std::string> skipped() const NO_THREAD_SAFETY_ANALYSIS { return {skipped_.begin(), skipped_.end()}; }
  std::vector<std::string> failed() const NO_THREAD_SAFETY_ANALYSIS { return failed_; }
  std::vector<std::string> refused() const NO_THREAD_SAFETY_ANALYSIS { return refused_; }
  size_t failovers() const NO_THREAD_SAFETY_ANALYSIS { return failed_over_.size(); }
  size_t hedges() const NO_THREAD_SAFETY_ANALYSIS { return hedges_; }

 private:
  struct Call {
    std::string host;
    std::vector<size_t> keys;  // indexes into keys_, in key order
    bool has_later = false;    // some key has a later copy: the per-copy deadline applies, and hedging
    bool is_hedge = false;     // launched as a hedge: not counted against max_hosts
    MonoTime rpc_started;      // guarded by mu_: when its RPC in flight was sent (hedges count from there)
    bool hedged = false;       // guarded by mu_: its keys' next copies were asked beside it
    bool timed_out = false;    // guarded by mu_: still out when the budget ran out (cancelled, and it counts as failed)
    bool done = false;         // guarded by mu_
    CallCancel cancel;
    std::thread thread;
  };

  void Ask(Call* call) EXCLUDES(mu_);
  // Launches what can be asked now; false when nothing is left to ask or wait for.
  bool Launch(MonoTime now) REQUIRES(mu_);
  void Start(std::string host, std::vector<size_t> keys, bool is_hedge) REQUIRES(mu_);
  // `call` no longer asks for keys_[keys[from..]].
  void Release(const Call& call, size_t from) REQUIRES(mu_);

  Discovery* const d_;
  const Options& options() const { return d_->options_; }
  const Deadline deadline_;
  Mutex mu_;
  std::condition_variable_any wake_;
  std::vector<Key> keys_ GUARDED_BY(mu_);
  std::list<Call> calls_ GUARDED_BY(mu_);  // a list: each call's thread holds a pointer to its Call
  size_t primaries_running_ GUARDED_BY(mu_) = 0;
  size_t max_in_flight_ = 0;  // written under mu_, read after Go()
  std::set<std::string> skipped_ GUARDED_BY(mu_);
  std::vector<std::string> failed_ GUARDED_BY(mu_);
  std::vector<std::string> refused_ GUARDED_BY(mu_);
  std::set<std::string> failed_over_ GUARDED_BY(mu_);  // shards whose keys were asked of more than one copy
  size_t hedges_ GUARDED_BY(mu_) = 0;
  std::atomic<size_t> rpcs_{0};
};

void Discovery::Run::Release(const Call& call, size_t from) {
  for (size_t at = from; at < call.keys.size(); ++at) --keys_[call.keys[at]].in_flight;
}

void Discovery::Run::Start(std::string host, std::vector<size_t> keys, bool is_hedge) {
  Call& call = calls_.emplace_back();
  call.host = std::move(host);
  call.keys = std::move(keys);
  call.is_hedge = is_hedge;
  call.rpc_started = MonoNow();
  const MonoTime now = options().now();
  for (size_t i : call.keys) {
    Key& k = keys_[i];
    if (k.asked > 0) failed_over_.insert(k.shard);
    ++k.asked;
    ++k.in_flight;
    k.hedge = false;
    // A later copy with a closed breaker: this one gets the per-copy deadline and may be hedged.
    for (size_t c = k.next; c < k.copies.size() && !call.has_later; ++c) {
      call.has_later = !d_->BreakerOpen(k.copies[c], now);
    }
  }
  if (!is_hedge) ++primaries_running_;
  max_in_flight_ = std::max(max_in_flight_, primaries_running_);
  call.thread = std::thread([this, c = &call] { Ask(c); });
}

bool Discovery::Run::Launch(MonoTime now) {
  std::map<std::string, std::vector<size_t>> primary, hedge;  // host -> keys, in key order
  bool open = false;                                          // some key is being asked or can still be asked
  for (size_t i = 0; i < keys_.size(); ++i) {
    Key& k = keys_[i];
    if (k.resolved) continue;
    if (k.in_flight == 0 || k.hedge) {
      while (k.next < k.copies.size() && d_->BreakerOpen(k.copies[k.next], now)) {
        skipped_.insert(k.copies[k.next++]);
      }
      if (k.next < k.copies.size()) {
        (k.in_flight == 0 ? primary : hedge)[k.copies[k.next]].push_back(i);
      } else {
        k.hedge = false;  // no copy left to hedge with
      }
    }
    open = open || k.in_flight > 0 || k.next < k.copies.size();
  }
  for (auto& [host, keys] : hedge) {
    for (size_t i : keys) ++keys_[i].next;
    Start(host, std::move(keys), /*is_hedge=*/true);
  }
  for (auto& [host, keys] : primary) {
    if (primaries_running_ >= options().max_hosts) break;  // the rest once a call ends
    for (size_t i : keys) ++keys_[i].next;
    Start(host, std::move(keys), /*is_hedge=*/false);
  }
  return open;
}

void Discovery::Run::Go() {
  {
    MutexLock lock(&mu_);
    while (!deadline_.Expired()) {
      const MonoTime now = MonoNow();
      // Slow calls are hedged: their keys' next copies are asked beside them.
      for (Call& call : calls_) {
        if (call.done || !call.has_later || call.hedged || now < call.rpc_started + d_->HedgeDelay(call.host)) {
          continue;
        }
        call.hedged = true;
        ++hedges_;
        for (size_t i : call.keys) {
          if (!keys_[i].resolved && keys_[i].in_flight > 0) keys_[i].hedge = true;
        }
      }
      // A call whose keys were all answered by others is cancelled; one overtaken by its hedge marks its host slow.
      for (Call& call : calls_) {
        if (call.done || call.cancel.cancelled()) continue;
        bool answered = true;
        for (size_t i : call.keys) answered = answered && keys_[i].resolved;
        if (answered) {
          if (call.hedged) d_->MarkSlow(call.host, options().now());
          call.cancel.Cancel();
        }
      }
      if (!Launch(options().now())) break;  // every key answered, or out of copies
      // Until a call ends (it notifies), the next hedge is due, or the budget ends.
      MonoTime wake = deadline_.when();
      for (const Call& call : calls_) {
        if (!call.done && call.has_later && !call.hedged) {
          wake = std::min(wake, call.rpc_started + d_->HedgeDelay(call.host));
        }
      }
      wake_.wait_until(mu_, wake);
    }
    // The lookup is over: calls still out are not needed. Those still out because the budget ran out were too slow
    // (they fail, as they would have at their own deadline); the others were overtaken.
    const bool out_of_time = deadline_.Expired();
    for (Call& call : calls_) {
      if (call.done) continue;
      call.timed_out = out_of_time;
      call.cancel.Cancel();
    }
  }
  // Calls cancelled (or past their deadline) return soon; wait for all (their threads use this Run). Spliced out
  // of calls_ under the lock: the nodes, which the threads point to, stay where they are.
  std::list<Call> calls;
  {
    MutexLock lock(&mu_);
    calls.splice(calls.end(), calls_);
  }
  for (Call& call : calls) call.thread.join();
}

void Discovery::Run::Ask(Call* call) {
  const std::string& host = call->host;
  std::map<std::string, bool> complete;  // shard -> every row of it from this host was complete
  size_t at = 0;
  while (true) {
    std::vector<size_t> batch_keys;
    std::vector<state::StateKey> batch;
    {
      MutexLock lock(&mu_);
      for (; at < call->keys.size() && batch.size() < options().max_keys_per_rpc; ++at) {
        Key& k = keys_[call->keys[at]];
        if (k.resolved) {  // answered by another copy meanwhile
          --k.in_flight;
          continue;
        }
        batch_keys.push_back(call->keys[at]);
        batch.push_back(k.key);
      }
      if (batch.empty() || deadline_.Expired() || call->cancel.cancelled()) {
        for (size_t i : batch_keys) --keys_[i].in_flight;
        Release(*call, at);
        break;
      }
      call->rpc_started = MonoNow();
    }
    const MonoTime sent = MonoNow();
    const Deadline rpc_deadline =
        call->has_later ? Deadline::At(std::min(deadline_.when(), Deadline::After(options().copy_deadline).when()))
                        : deadline_;
    rpcs_.fetch_add(1);
    Result<std::vector<LookupRow>> rows = d_->transport_->Lookup(host, batch, rpc_deadline, &call->cancel);
    if (rows.ok()) d_->NoteLatency(host, MonoNow() - sent);
    MutexLock lock(&mu_);
    if (!rows.ok() || rows->size() != batch.size()) {
      if (call->timed_out) {
        rows = Status::DeadlineExceeded("no answer within the lookup's budget");
      }
      if (call->cancel.cancelled() && !call->timed_out) {
        // Cancelled here: another copy answered, or the lookup is over. Says nothing of the host.
      } else if (!rows.ok() && IsRouteRefusal(rows.status())) {  // it answered: the next discovery asks it again
        if (std::find(refused_.begin(), refused_.end(), host) == refused_.end()) refused_.push_back(host);
      } else {  // down, too slow or malformed: skip it for a while
        ORBITKV_LOG_WARN("discovery: catalog host '{}' {}: not asked for {} ms{}", host,
                         rows.ok() ? fmt::format("answered {} rows for {} keys", rows->size(), batch.size())
                                   : fmt::format("failed ({})", rows.status().ToString()),
                         options().breaker_open.count(), call->has_later ? "; its shards' other copies are asked" : "");
        d_->Trip(host, options().now());
        if (std::find(failed_.begin(), failed_.end(), host) == failed_.end()) failed_.push_back(host);
      }
      for (size_t i : batch_keys) --keys_[i].in_flight;
      Release(*call, at);
      break;
    }
    for (size_t k = 0; k < batch.size(); ++k) {
      const LookupRow& row = (*rows)[k];
      Key& key = keys_[batch_keys[k]];
      if (!row.candidates.empty()) {
        d_->index_->Insert(batch[k], row.candidates);
        key.resolved = true;
      } else if (row.complete) {
        key.resolved = true;  // a complete copy's miss is authoritative
      }                       // else a miss from an incomplete copy proves nothing: its next copy is asked
      --key.in_flight;
      auto [it, fresh] = complete.emplace(key.shard, row.complete);
      if (!fresh) it->second = it->second && row.complete;
    }
    wake_.notify_all();
  }
  d_->NoteIncomplete(host, complete, options().now());
  MutexLock lock(&mu_);
  call->done = true;
  if (!call->is_hedge) --primaries_running_;
  wake_.notify_all();
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
  std::vector<Run::Key> pending;
  for (size_t i = known; i < keys.size(); ++i) {
    if (!index_->Find(keys[i]).empty()) continue;
    std::vector<std::string> copies =
        options_.copies_of ? options_.copies_of(keys[i]) : std::vector<std::string>{options_.host_of(keys[i])};
    std::string shard = options_.shard_of ? std::to_string(options_.shard_of(keys[i])) : copies.front();
    const uint64_t turn = options_.rotation + std::hash<std::string>{}(shard);
    const size_t committed = options_.committed_copies_of ? options_.committed_copies_of(keys[i]) : copies.size();
    std::vector<std::string> ordered = Order(std::move(copies), committed, shard, turn, start);
    pending.push_back(Run::Key{.key = keys[i], .shard = std::move(shard), .copies = std::move(ordered)});
  }
  Run run(this, deadline, std::move(pending));
  run.Go();
  outcome.rpcs = run.rpcs();
  outcome.skipped_hosts = run.skipped();
  outcome.failed_hosts = run.failed();
  outcome.refused_hosts = run.refused();
  outcome.failovers = run.failovers();
  outcome.hedges = run.hedges();
  outcome.known_prefix = index_->KnownPrefix(keys);
  {
    MutexLock lock(&mu_);
    stats_.rpcs += outcome.rpcs;
    stats_.skipped_hosts += outcome.skipped_hosts.size();
    stats_.failed_hosts += outcome.failed_hosts.size();
    stats_.refused_hosts += outcome.refused_hosts.size();
    stats_.failovers += outcome.failovers;
    stats_.hedges += outcome.hedges;
    stats_.max_hosts_in_flight = std::max<uint64_t>(stats_.max_hosts_in_flight, run.max_in_flight());
  }
  return outcome;
}

Discovery::Stats Discovery::GetStats() const {
  MutexLock lock(&mu_);
  return stats_;
}

}  // namespace orbitkv::catalog
