// Fuzzes StateKey::Decode: any accepted input must re-encode to exactly the same bytes (the encoding is
// canonical, so two byte strings never decode to one key), and Hash64/ShardOf must work on it.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>

#include "state/state_key.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using orbitkv::state::StateKey;
  auto key = StateKey::Decode(std::span<const uint8_t>(data, size));
  if (!key.ok()) return 0;
  auto again = key->Encode();
  if (size != again.size() || std::memcmp(again.data(), data, size) != 0) std::abort();
  auto round = StateKey::Decode(again);
  if (!round.ok() || !(*round == *key) || round->Hash64() != key->Hash64()) std::abort();
  if (orbitkv::state::ShardOf(*key, 16) >= 16) std::abort();
  return 0;
}
