#include "catalog/peer_directory.h"

#include <algorithm>
#include <atomic>
#include <random>
#include <set>
#include <thread>
#include <utility>

#include "base/logging.h"
#include "catalog/peer_service.h"

namespace orbitkv::catalog {

std::string_view PeerHealthName(PeerDirectory::Health health) {
  switch (health) {
    case PeerDirectory::Health::kUnknown:
      return "unknown";
    case PeerDirectory::Health::kHealthy:
      return "healthy";
    case PeerDirectory::Health::kUnreachable:
      return "unreachable";
    case PeerDirectory::Health::kIncompatible:
      return "incompatible";
  }
  return "unknown";
}

PeerDirectory::PeerDirectory(Options options, const cluster::MemberView* members)
    : options_(std::move(options)), self_(options_.self), members_(members) {}

PeerDirectory::~PeerDirectory() { Stop(); }

void PeerDirectory::Stop() {
  std::thread thread;
  {
    MutexLock lock(&mu_);
    stopping_ = true;
    thread.swap(thread_);
  }
  wake_.notify_all();
  if (thread.joinable()) thread.join();
}

void PeerDirectory::Start() {
  MutexLock lock(&mu_);
  if (thread_.joinable() || stopping_) return;
  thread_ = std::thread([this] { Loop(); });
}

std::shared_ptr<peer::v1::Peer::Stub> PeerDirectory::StubFor(const std::string& endpoint) {
  MutexLock lock(&mu_);
  auto& stub = stubs_[endpoint];
  if (stub == nullptr) stub = NewPeerStub(endpoint, options_.credentials);
  return stub;  // shared: a probe in flight keeps its stub when ProbeAll drops a departed member's
}

PeerDirectory::Peer PeerDirectory::Probe(const cluster::Member& member) {
  Peer peer;
  peer.node_id = member.record.node_id;
  peer.runtime_uuid = member.record.runtime_uuid;
  peer.endpoint = member.record.endpoint;
  if (peer.endpoint.empty()) {
    peer.health = Health::kUnreachable;
    peer.reason = "its member record names no peer endpoint (started without --peer-endpoint)";
    return peer;
  }
  peer::v1::HealthRequest request;
  *request.mutable_route() = MakeRoute(self_.Get(), member.record);
  request.mutable_route()->set_protocol_version(options_.protocol_version);
  peer::v1::HealthResponse response;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + options_.rpc_timeout);
  probes_sent_.fetch_add(1, std::memory_order_relaxed);
  const grpc::Status status = StubFor(peer.endpoint)->Health(&context, request, &response);
  if (status.ok() && response.protocol_version() != options_.protocol_version) {
    peer.health = Health::kIncompatible;
    peer.reason = fmt::format("node '{}' speaks orbitkv.peer v{}, this Manager v{}", peer.node_id,
                              response.protocol_version(), options_.protocol_version);
  } else if (status.ok() && response.runtime_uuid() != member.record.runtime_uuid) {
    peer.health = Health::kUnreachable;
    peer.reason = fmt::format("{} answers as runtime {}, not the registered {}", peer.endpoint, response.runtime_uuid(),
                              member.record.runtime_uuid);
  } else if (status.ok()) {
    peer.health = Health::kHealthy;
    peer.transfer_address = response.ucx_worker_address();
    peer.capabilities.assign(response.capabilities().begin(), response.capabilities().end());
  } else if (FromGrpc(status).reason() == StatusReason::kPeerProtocolVersion) {
    peer.health = Health::kIncompatible;
    peer.reason = fmt::format("node '{}' refuses this Manager's orbitkv.peer v{}: {}", peer.node_id,
                              options_.protocol_version, status.error_message());
  } else {
    peer.health = Health::kUnreachable;
    peer.reason = FromGrpc(status).ToString();
  }
  return peer;
}

void PeerDirectory::Use(const std::string& node) {
  if (node == options_.self.node_id) return;
  MutexLock lock(&use_mu_);
  used_[node] = std::chrono::steady_clock::now();
}

void PeerDirectory::ProbeAll() {
  const cluster::MemberView::Snapshot view = members_->Read();
  if (!view.complete) return;  // keep what we knew; the view is refreshed first
  // Whom to probe: every member without always_probe; else the catalog hosts and the peers used lately.
  std::vector<const cluster::Member*> others;
  std::set<std::string> always;  // probed every round, before the others
  if (!options_.always_probe) {
    for (const cluster::Member& member : view.members) {
      if (member.record.node_id != options_.self.node_id /* the node never changes */) others.push_back(&member);
    }
  } else {
    for (std::string& node : options_.always_probe()) always.insert(std::move(node));
    std::set<std::string> wanted = always;
    {
      const auto now = std::chrono::steady_clock::now();
      MutexLock lock(&use_mu_);
      for (auto it = used_.begin(); it != used_.end();) {
        if (now - it->second > options_.use_window) {
          it = used_.erase(it);
        } else {
          wanted.insert(it->first);
          ++it;
        }
      }
    }
    wanted.erase(options_.self.node_id);
    for (const cluster::Member& member : view.members) {
      if (wanted.count(member.record.node_id) != 0) others.push_back(&member);
    }
  }
  // At most max_probes_per_round a round: first the catalog hosts and the peers whose start or endpoint changed
  // since they were last probed (or never were), then the others from where the last round stopped.
  std::map<std::string, const cluster::Member*> due;  // the peers talked to, probed this round or not
  for (const cluster::Member* member : others) due.emplace(member->record.node_id, member);
  const size_t bound = std::max<size_t>(options_.max_probes_per_round, 1);
  if (others.size() > bound) {
    std::vector<const cluster::Member*> first, rest;
    size_t from = 0;
    {
      MutexLock lock(&mu_);
      for (const cluster::Member* member : others) {
        auto known = peers_.find(member->record.node_id);
        const bool changed = known == peers_.end() || known->second.runtime_uuid != member->record.runtime_uuid ||
                             known->second.endpoint != member->record.endpoint;
        (always.count(member->record.node_id) != 0 || changed ? first : rest).push_back(member);
      }
      if (!rest.empty()) {
        from = cursor_ % rest.size();
        cursor_ = (from + bound) % rest.size();
      }
    }
    std::vector<const cluster::Member*> round;
    for (size_t i = 0; i < first.size() && round.size() < bound; ++i) round.push_back(first[i]);
    for (size_t i = 0; i < rest.size() && round.size() < bound; ++i) round.push_back(rest[(from + i) % rest.size()]);
    others = std::move(round);
  }
  // In parallel, at most max_probes_in_flight at once: each worker takes the next member.
  std::vector<Peer> results(others.size());
  std::atomic<size_t> next{0}, in_flight{0};
  auto work = [&] {
    for (size_t i = next.fetch_add(1); i < others.size(); i = next.fetch_add(1)) {
      const size_t now = in_flight.fetch_add(1) + 1;
      for (size_t seen = max_probes_seen_.load(); now > seen && !max_probes_seen_.compare_exchange_weak(seen, now);) {
      }
      results[i] = Probe(*others[i]);
      in_flight.fetch_sub(1);
    }
  };
  const size_t workers = std::min(std::max<size_t>(options_.max_probes_in_flight, 1), others.size());
  std::vector<std::thread> threads;
  for (size_t w = 1; w < workers; ++w) threads.emplace_back(work);
  if (workers > 0) work();
  for (std::thread& t : threads) t.join();
  MutexLock lock(&mu_);
  std::map<std::string, Peer> probed;
  for (size_t i = 0; i < others.size(); ++i) probed.emplace(others[i]->record.node_id, std::move(results[i]));
  // Those still talked to but not probed this round keep what an earlier round learnt of the same start.
  for (auto& [node, peer] : peers_) {
    auto member = due.find(node);
    if (probed.count(node) == 0 && member != due.end() && member->second->record.runtime_uuid == peer.runtime_uuid &&
        member->second->record.endpoint == peer.endpoint) {
      probed.emplace(node, peer);
    }
  }
  for (const auto& [node, peer] : probed) {
    auto before = peers_.find(node);
    const bool changed = before == peers_.end() || before->second.health != peer.health ||
                         before->second.runtime_uuid != peer.runtime_uuid;
    if (changed && peer.health == Health::kIncompatible) {
      ORBITKV_LOG_WARN(
          "manager: remote work is off: {} (local service continues; run one OrbitKV version "
          "across the cluster)",
          peer.reason);
    } else if (changed && before != peers_.end() && before->second.health == Health::kIncompatible) {
      ORBITKV_LOG_INFO("manager: node '{}' speaks this protocol version again", node);
    }
  }
  peers_ = std::move(probed);
  bool incompatible = false;
  std::set<std::string> endpoints;
  for (const auto& [node, peer] : peers_) {
    incompatible = incompatible || peer.health == Health::kIncompatible;
    endpoints.insert(peer.endpoint);
  }
  incompatible_.store(incompatible, std::memory_order_release);
  // Channels of peers no longer talked to are closed; at most one per peer remains.
  for (auto it = stubs_.begin(); it != stubs_.end();) {
    it = endpoints.count(it->first) != 0 ? std::next(it) : stubs_.erase(it);
  }
}

void PeerDirectory::Loop() {
  uint64_t generation = 0;
  auto last = std::chrono::steady_clock::now() - options_.probe_interval;
  std::chrono::milliseconds interval = options_.probe_interval;
  std::minstd_rand jitter{std::random_device{}()};
  for (;;) {
    {
      MutexLock lock(&mu_);
      if (stopping_) return;
    }
    const uint64_t now_generation = members_->Read().generation;
    const auto now = std::chrono::steady_clock::now();
    if (now_generation != generation || now - last >= interval) {
      generation = now_generation;
      last = now;
      // The next round after 80-120 % of the interval.
      std::uniform_int_distribution<int64_t> spread(options_.probe_interval.count() * 8 / 10,
                                                    options_.probe_interval.count() * 12 / 10);
      interval = std::chrono::milliseconds(spread(jitter));
      ProbeAll();
    }
    MutexLock lock(&mu_);
    if (stopping_) return;
    wake_.wait_for(mu_, std::min<std::chrono::milliseconds>(options_.probe_interval, std::chrono::milliseconds(200)));
  }
}

std::string PeerDirectory::incompatibility() const {
  if (!incompatible_.load(std::memory_order_acquire)) return "";  // the query path's check: no lock
  MutexLock lock(&mu_);
  for (const auto& [node, peer] : peers_) {
    if (peer.health == Health::kIncompatible) return peer.reason;
  }
  return "";
}

std::vector<PeerDirectory::Peer> PeerDirectory::Peers() const {
  MutexLock lock(&mu_);
  std::vector<Peer> out;
  for (const auto& [node, peer] : peers_) out.push_back(peer);
  return out;
}

void PeerDirectory::VisitStats(StatsVisitor& v) const {
  size_t counts[4] = {};
  std::string reason;
  {
    MutexLock lock(&mu_);
    for (const auto& [node, peer] : peers_) counts[static_cast<int>(peer.health)] += 1;
    for (const auto& [node, peer] : peers_) {
      if (peer.health == Health::kIncompatible) {
        reason = peer.reason;
        break;
      }
    }
  }
  v.Gauge("peers_healthy", static_cast<int64_t>(counts[static_cast<int>(Health::kHealthy)]));
  v.Gauge("peers_unreachable", static_cast<int64_t>(counts[static_cast<int>(Health::kUnreachable)]));
  v.Gauge("peers_incompatible", static_cast<int64_t>(counts[static_cast<int>(Health::kIncompatible)]));
  v.Text("remote_work_off_reason", reason);
  v.Counter("peer_probes", probes_sent(),
            {"orbitkv_peer_probes_total", "Health probes this Manager sent to the peers it talks to"});
}

}  // namespace orbitkv::catalog
