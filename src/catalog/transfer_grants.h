// TransferGrantIssuer: SourceHolds' GrantIssuer over a transfer engine whose regions are the pool's arenas (region
// i = arena i): grants over pinned blocks, revocations, the arenas' descriptors. Header-only: its users link the
// transfer module (the Manager's cluster link, the discovery benchmark).
#ifndef ORBITKV_CATALOG_TRANSFER_GRANTS_H_
#define ORBITKV_CATALOG_TRANSFER_GRANTS_H_

#include <string>
#include <utility>
#include <vector>

#include "catalog/source_holds.h"
#include "transfer/descriptor.h"
#include "transfer/transfer_engine.h"

namespace orbitkv::catalog {

class TransferGrantIssuer final : public GrantIssuer {
 public:
  TransferGrantIssuer(transfer::TransferEngine* engine, std::vector<transfer::RegionHandle> arenas)
      : engine_(engine), arenas_(std::move(arenas)) {}
  Result<Issued> Grant(const std::string& peer, const std::vector<Range>& ranges) override {
    transfer::GrantRequest request;
    request.peer = peer;
    for (const Range& r : ranges) {
      if (r.arena >= arenas_.size()) return Status::Internal("a pinned block outside the registered pool");
      request.ranges.push_back({arenas_[r.arena], r.offset, r.bytes});
    }
    ORBITKV_ASSIGN_OR_RETURN(transfer::IssuedGrant issued, engine_->CreateGrant(std::move(request)));
    return Issued{issued.id, std::string(issued.secret.begin(), issued.secret.end())};
  }
  Status Revoke(uint64_t grant, std::function<void()> drained) override {
    return engine_->RevokeGrant(grant, std::move(drained));
  }
  Status RevokePeer(const std::string& peer, std::function<void()> drained) override {
    return engine_->RevokePeer(peer, std::move(drained));
  }
  Result<std::vector<uint8_t>> Describe(uint32_t arena) override {
    if (arena >= arenas_.size()) return Status::Internal("a pinned block outside the registered pool");
    ORBITKV_ASSIGN_OR_RETURN(transfer::RegionDescriptor descriptor, engine_->ExportRegion(arenas_[arena]));
    return transfer::EncodeDescriptor(descriptor);
  }

 private:
  transfer::TransferEngine* const engine_;
  const std::vector<transfer::RegionHandle> arenas_;
};

}  // namespace orbitkv::catalog

#endif  // ORBITKV_CATALOG_TRANSFER_GRANTS_H_
