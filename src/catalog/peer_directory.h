// PeerDirectory: the sending half of orbitkv.peer.v1 in a distributed Manager. It probes the current
// start of the peers this Manager talks to with Health, on its own thread, every probe interval
// (jittered to 80-120 %, so Managers do not probe in lockstep) and whenever the member view changes,
// with one gRPC channel each (this Manager's client certificate under mutual TLS). Issue 70: not the
// whole fleet. The peers it talks to are the catalog hosts (options.always_probe: every Manager
// streams to them and looks up at them) and those that used it within `use_window` (Use: their
// requests reached this Manager's PeerService); at most `max_probes_per_round` a round, the rest in
// the next rounds, in parallel, at most `max_probes_in_flight` at once. A member it does not talk to
// is not probed at all: probes per Manager do not grow with the fleet. What it learns (per peer:
// healthy, unreachable or incompatible, its transfer address and capabilities) is for `orbitkv
// status` and the stats.
//
// A peer it talks to that speaks another protocol version (its Health answers another version, or
// it refuses this one with FAILED_PRECONDITION) turns remote work off: incompatibility() says which
// peer and why, the Manager shows it in `orbitkv status`, and local service continues. It clears when
// that member's start speaks this version again, leaves the cluster or is no longer talked to. A peer
// of another version this Manager does not talk to changes nothing here; any request between the two
// is refused by the route check (peer_refused) and fails only that call. An unreachable peer is only
// that peer's state: it does not stop remote work with the others. incompatibility() reads an atomic
// first: the remote-work check on the query path takes no lock while everything is compatible.
//
// Thread safety: every method is safe from any thread.
#ifndef ORBITKV_CATALOG_PEER_DIRECTORY_H_
#define ORBITKV_CATALOG_PEER_DIRECTORY_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "base/mutex.h"
#include "base/stats_visitor.h"
#include "base/thread_annotations.h"
#include "catalog/peer_grpc.h"
#include "catalog/route.h"

namespace orbitkv::catalog {

class PeerDirectory {
 public:
  struct Options {
    PeerIdentity self;
    // Client credentials for peers (mutual TLS); null: insecure channels.
    std::shared_ptr<grpc::ChannelCredentials> credentials;
    std::chrono::milliseconds probe_interval{2000};
    std::chrono::milliseconds rpc_timeout{1000};
    size_t max_probes_in_flight = 16;
    // The members always probed (the catalog hosts of the placement); null: every member (a full mesh).
    std::function<std::vector<std::string>()> always_probe;
    // How long a peer that used this Manager (Use) stays probed, and the probes one round sends at most.
    std::chrono::milliseconds use_window{60000};
    size_t max_probes_per_round = 64;
    // The protocol version this Manager speaks (a test may pretend another).
    uint32_t protocol_version = kPeerProtocolVersion;
  };
  enum class Health { kUnknown, kHealthy, kUnreachable, kIncompatible };
  struct Peer {
    std::string node_id;
    std::string runtime_uuid;
    std::string endpoint;
    Health health = Health::kUnknown;
    std::string transfer_address;  // its UCX engine (Health's ucx_worker_address)
    std::vector<std::string> capabilities;
    std::string reason;  // why it is unreachable or incompatible
  };

  PeerDirectory(Options options, const cluster::MemberView* members);
  ~PeerDirectory();
  PeerDirectory(const PeerDirectory&) = delete;
  PeerDirectory& operator=(const PeerDirectory&) = delete;

  // This Manager registered again: probes name its new start.
  void SetSelf(PeerIdentity self) { self_.Set(std::move(self)); }
  // Starts the probing thread (probes at once, then every interval and on view changes).
  void Start() EXCLUDES(mu_);
  // Stops probing (what it learnt stays readable). Idempotent.
  void Stop() EXCLUDES(mu_);
  // Probes once, now, on the calling thread: the peers this Manager talks to (every member without always_probe), at
  // most max_probes_per_round of them.
  void ProbeAll() EXCLUDES(mu_);
  // `node` talked to this Manager (a request its PeerService admitted): probed for use_window from now.
  void Use(const std::string& node) EXCLUDES(use_mu_);
  // Health RPCs sent since construction.
  uint64_t probes_sent() const { return probes_sent_.load(std::memory_order_relaxed); }

  // Empty while no peer is incompatible; else which peer speaks what, and that remote work is off.
  std::string incompatibility() const EXCLUDES(mu_);
  std::vector<Peer> Peers() const EXCLUDES(mu_);
  // The most probes one round had in flight at once (since construction).
  size_t max_probes_seen() const { return max_probes_seen_.load(std::memory_order_relaxed); }
  // The peers by health (peers_healthy, _unreachable, _incompatible) and why remote work is off.
  void VisitStats(StatsVisitor& v) const EXCLUDES(mu_);

 private:
  Peer Probe(const cluster::Member& member) EXCLUDES(mu_);
  std::shared_ptr<peer::v1::Peer::Stub> StubFor(const std::string& endpoint) EXCLUDES(mu_);
  void Loop() EXCLUDES(mu_);

  const Options options_;
  SelfIdentity self_;  // options_.self, then the identity of each registration made again
  const cluster::MemberView* const members_;
  mutable Mutex mu_;
  std::condition_variable_any wake_;
  bool stopping_ GUARDED_BY(mu_) = false;
  std::map<std::string, Peer> peers_ GUARDED_BY(mu_);  // by node id: the members of the last probe
  std::map<std::string, std::shared_ptr<peer::v1::Peer::Stub>> stubs_ GUARDED_BY(mu_);  // by endpoint
  std::thread thread_;
  std::atomic<size_t> max_probes_seen_{0};
  std::atomic<uint64_t> probes_sent_{0};
  std::atomic<bool> incompatible_{false};  // some peer in peers_ is kIncompatible
  size_t cursor_ GUARDED_BY(mu_) = 0;      // where the next round starts when more are due than one round sends
  Mutex use_mu_;
  std::map<std::string, std::chrono::steady_clock::time_point> used_ GUARDED_BY(use_mu_);
};

std::string_view PeerHealthName(PeerDirectory::Health health);

}  // namespace orbitkv::catalog

#endif  // ORBITKV_CATALOG_PEER_DIRECTORY_H_
