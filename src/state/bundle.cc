#include "state/bundle.h"

#include <fmt/format.h>

#include <algorithm>

namespace orbitkv::state {

Status StateBundle::CheckCovers(const RecoveryDemand& demand) const {
  if (ns != demand.ns) {
    return Status::InvalidArgument(
        fmt::format("bundle namespace {} does not match demand namespace {}", ns.ShortHex(), demand.ns.ShortHex()));
  }
  for (const StateDescriptor& part : parts) {
    if (part.ns != ns) {
      return Status::InvalidArgument(
          fmt::format("bundle part of group {} has foreign namespace {}", part.group, part.ns.ShortHex()));
    }
  }
  for (const GroupRange& range : demand.ranges) {
    if (range.empty()) continue;
    std::vector<TokenRange> spans;
    for (const StateDescriptor& part : parts) {
      if (part.group == range.group && !part.span.empty()) spans.push_back(part.span);
    }
    std::sort(spans.begin(), spans.end());
    // Sweep: extend the covered frontier from range.begin while spans touch or overlap it.
    uint64_t frontier = range.begin;
    for (const TokenRange& s : spans) {
      if (s.begin > frontier) break;
      frontier = std::max(frontier, s.end);
      if (frontier >= range.end) break;
    }
    if (frontier < range.end) {
      return Status::NotFound(
          fmt::format("bundle does not cover group {} tokens [{}, {})", range.group, frontier, range.end));
    }
  }
  return Status::Ok();
}

}  // namespace orbitkv::state
