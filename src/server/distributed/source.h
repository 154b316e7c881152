// The source: what this Manager serves to peers that fetch from it (seed 000, "Transfer lifetime and resource
// control"). It owns the transfer grant issuer over the pool's registered arenas, the holds (pins charged to the
// transfer budget, each under one grant) and, with an SSD tier, the staging budget that SSD-resident blocks are read
// into DRAM under before they are granted. SourceUpkeep is its maintenance thread: it expires grants whose deadline
// passed and revokes those of requesters that left the member view.
//
// Lifetime: the holds must outlive the transfer engine (the engine's drained callbacks end them), while SourceUpkeep
// (which revokes through the engine) must stop before it; the cluster link declares them in that order.
//
// Thread safety: every method is safe from any thread.
#ifndef ORBITKV_SERVER_DISTRIBUTED_SOURCE_H_
#define ORBITKV_SERVER_DISTRIBUTED_SOURCE_H_

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "base/metrics.h"
#include "base/stats_visitor.h"
#include "catalog/source_holds.h"
#include "catalog/transfer_grants.h"
#include "cluster/member_view.h"
#include "core/block_cache.h"
#include "core/budget.h"
#include "core/ssd_tier.h"
#include "server/config.h"
#include "transfer/transfer_engine.h"

namespace orbitkv::server {

class Source {
 public:
  // `cache`, `ssd` (may be null: DRAM blocks only), `engine` and `metrics` must outlive the source's use of them;
  // `arenas[i]` is the transfer region of pool arena i.
  Source(const ManagerConfig& config, core::BlockCache* cache, core::SsdTier* ssd, transfer::TransferEngine* engine,
         std::vector<transfer::RegionHandle> arenas, MetricsRegistry* metrics);
  Source(const Source&) = delete;
  Source& operator=(const Source&) = delete;

  catalog::SourceHolds* holds() { return holds_.get(); }
  // The holds' figures: the source_* stats keys and orbitkv_source_* metrics.
  void VisitStats(StatsVisitor& v) const { holds_->VisitStats(v); }

  // The registration lapsed: every grant this source gave goes (quarantined until drained), and no new one is
  // given until OnRegistered.
  void OnLapsed(const std::string& cause);
  // A new registration: grants again.
  void OnRegistered();

 private:
  catalog::TransferGrantIssuer issuer_;
  std::unique_ptr<core::Budget> ssd_staging_;  // before the holds that charge it
  std::unique_ptr<catalog::SourceHolds> holds_;
};

// The source's maintenance thread, every `period`: grants past their deadline end, and those of requesters the member
// view no longer shows (another start of the node, or gone) are revoked. While the view is incomplete nobody counts
// as gone.
class SourceUpkeep {
 public:
  SourceUpkeep(catalog::SourceHolds* holds, const cluster::MemberView* view,
               std::chrono::milliseconds period = std::chrono::milliseconds(100));
  ~SourceUpkeep();
  SourceUpkeep(const SourceUpkeep&) = delete;
  SourceUpkeep& operator=(const SourceUpkeep&) = delete;

 private:
  void Run();

  catalog::SourceHolds* const holds_;
  const cluster::MemberView* const view_;
  const std::chrono::milliseconds period_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace orbitkv::server

#endif  // ORBITKV_SERVER_DISTRIBUTED_SOURCE_H_
