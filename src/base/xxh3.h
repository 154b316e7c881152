// Xxh3 / Xxh3Update: XXH3-64 at the widest vectors the CPU has, for the checksums over bulk data
// (transfer fragments, SSD records).
//
// libxxhash's plain XXH3_64bits runs the vector width it was compiled for, SSE2 in Debian's build:
// 5.9 GB/s over cold data on the 2-core VM, 11.6 right after a copy. Its *_dispatch entry points
// pick AVX2 or AVX-512 at run time: 13.0 and 19.5 GB/s there. The hash is the same either way
// (XXH3 defines one result for every implementation). Built with ORBITKV_XXH3_DISPATCH where the
// library has them (cmake/OrbitKVDependencies.cmake); link orbitkv::xxh3 to include this.
//
// Thread safety: any thread. The dispatch table is chosen once, under a function-local static, so
// that no two threads choose it at once (libxxhash's own first-call check is an unsynchronized
// store).
#ifndef ORBITKV_BASE_XXH3_H_
#define ORBITKV_BASE_XXH3_H_

#include <xxhash.h>

#include <cstddef>
#include <cstdint>

#if ORBITKV_XXH3_DISPATCH
// Keep XXH3_64bits and friends the plain functions (the header would otherwise redefine them to the
// dispatched ones): only Xxh3 / Xxh3Update dispatch.
#define XXH_DISPATCH_DISABLE_REPLACE 1
#include <xxh_x86dispatch.h>
#endif

namespace orbitkv {

#if ORBITKV_XXH3_DISPATCH
namespace xxh3_internal {
inline void ChooseOnce() {
  static const bool chosen = [] {
    (void)XXH3_64bits_dispatch("", 0);
    if (XXH3_state_t* state = XXH3_createState(); state != nullptr) {  // the update's table too
      XXH3_64bits_reset(state);
      XXH3_64bits_update_dispatch(state, "", 0);
      XXH3_freeState(state);
    }
    return true;
  }();
  (void)chosen;
}
}  // namespace xxh3_internal
#endif

inline uint64_t Xxh3(const void* data, size_t length) {
#if ORBITKV_XXH3_DISPATCH
  xxh3_internal::ChooseOnce();
  return XXH3_64bits_dispatch(data, length);
#else
  return XXH3_64bits(data, length);
#endif
}

// Adds bytes to a streaming XXH3-64 state (XXH3_64bits_reset first, XXH3_64bits_digest after).
inline void Xxh3Update(XXH3_state_t* state, const void* data, size_t length) {
#if ORBITKV_XXH3_DISPATCH
  xxh3_internal::ChooseOnce();
  XXH3_64bits_update_dispatch(state, data, length);
#else
  XXH3_64bits_update(state, data, length);
#endif
}

}  // namespace orbitkv

#endif  // ORBITKV_BASE_XXH3_H_
