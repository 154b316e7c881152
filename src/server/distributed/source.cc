#include "server/distributed/source.h"

#include <functional>
#include <utility>

#include "fmt/format.h"

namespace orbitkv::server {

Source::Source(const ManagerConfig& config, core::BlockCache* cache, core::SsdTier* ssd,
               transfer::TransferEngine* engine, std::vector<transfer::RegionHandle> arenas, MetricsRegistry* metrics)
    : issuer_(engine, std::move(arenas)) {
  catalog::SourceHolds::Options options;
  if (ssd != nullptr) {
    // SSD-resident blocks are served too: read into DRAM through the SSD tier's coalesced, verified path before they
    // are granted, within a staging budget of their own.
    const uint64_t staging = config.remote_ssd_staging_budget_bytes != 0 ? config.remote_ssd_staging_budget_bytes
                                                                         : cache->pool().Stats().capacity_bytes / 8;
    ssd_staging_ = std::make_unique<core::Budget>(
        core::Budget::Options{.name = "remote_ssd_staging", .global_bytes = staging}, metrics);
    options.ssd_staging = ssd_staging_.get();
    options.load_ssd = [ssd](std::vector<state::StateKey> keys, std::function<void(std::vector<core::BlockPin>)> done) {
      return ssd->Load(std::move(keys), std::move(done));
    };
  }
  holds_ = std::make_unique<catalog::SourceHolds>(std::move(options), &cache->table(), &cache->pool(),
                                                  &cache->transfer_budget(), &issuer_);
}

void Source::OnLapsed(const std::string& cause) {
  holds_->RevokeAll(fmt::format("the registration ended: {}", cause), /*stop_accepting=*/true);
}

void Source::OnRegistered() {
  holds_->RevokeAll("registered again");  // none normally: no grant is given while remote work is off
  holds_->Accept();
}

SourceUpkeep::SourceUpkeep(catalog::SourceHolds* holds, const cluster::MemberView* view,
                           std::chrono::milliseconds period)
    : holds_(holds), view_(view), period_(period), thread_([this] { Run(); }) {}

SourceUpkeep::~SourceUpkeep() {
  stop_.store(true, std::memory_order_release);
  if (thread_.joinable()) thread_.join();
}

void SourceUpkeep::Run() {
  const cluster::MemberView* view = view_;
  const auto alive = [view](const std::string& node, const std::string& runtime) {
    Result<cluster::Member> member = view->Find(node);
    if (member.status().code() == StatusCode::kUnavailable) return true;  // view incomplete: decide later
    return member.ok() && member->record.runtime_uuid == runtime;
  };
  while (!stop_.load(std::memory_order_acquire)) {
    holds_->ExpireDue();
    holds_->DropVanished(alive);
    std::this_thread::sleep_for(period_);
  }
}

}  // namespace orbitkv::server
