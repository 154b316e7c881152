// StateDescriptor and StateBundle: the evidence that a set of stored blocks forms a complete recovery point.
//
// A descriptor names one stored piece of state: its namespace, recovery group, component and token span. A
// bundle gathers the descriptors leased for one boundary; CheckCovers() accepts it only when every range of the
// compiled RecoveryDemand is covered by descriptors of the right namespace and group. A partial bundle is never
// restored: the engine recomputes instead.
#ifndef ORBITKV_STATE_BUNDLE_H_
#define ORBITKV_STATE_BUNDLE_H_

#include <vector>

#include "base/status.h"
#include "state/component.h"
#include "state/recovery.h"
#include "state/state_key.h"

namespace orbitkv::state {

struct StateDescriptor {
  StateNamespace ns;
  uint32_t group = 0;
  StateComponent component = StateComponent::kAttentionKv;
  TokenRange span;

  // The descriptor of the block a key names.
  static StateDescriptor ForKey(const StateKey& key, StateComponent component) {
    return {key.ns(), key.group(), component, key.span()};
  }
};

struct StateBundle {
  StateNamespace ns;
  std::vector<StateDescriptor> parts;

  // OK when every non-empty range of `demand` is covered by the union of this bundle's spans for that group.
  // InvalidArgument on a namespace mismatch (bundle or any part); NotFound naming the first uncovered token
  // range otherwise.
  Status CheckCovers(const RecoveryDemand& demand) const;
};

}  // namespace orbitkv::state

#endif  // ORBITKV_STATE_BUNDLE_H_
