// RuntimeId: the one identity of a running Manager, new at every start.
//
// A random RFC 4122 version-4 UUID. Everything that must tell one run of a Manager from the next
// is bound to it: the residency inventory's incarnation (its first 64 bits: sequences are per
// (incarnation, shard)), the membership record in etcd, the transfer engine and every peer RPC.
// Peers that see a new RuntimeId for a Node ID know the old run's state is gone. Shown by
// `orbitkv status` and as orbitkv_runtime_info{runtime_uuid=...} on /metrics.
//
// Thread safety: a value type.
#ifndef ORBITKV_BASE_RUNTIME_ID_H_
#define ORBITKV_BASE_RUNTIME_ID_H_

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "base/result.h"

namespace orbitkv {

class RuntimeId {
 public:
  // A fresh random id (getrandom(2)).
  static RuntimeId New();
  // The lower-case "8-4-4-4-12" form; InvalidArgument for anything else (also upper case, or a
  // UUID that is not version 4).
  static Result<RuntimeId> Parse(std::string_view text);

  // Lower-case "8-4-4-4-12".
  std::string ToString() const;
  // The first 64 bits, big-endian; never 0 (a version-4 UUID has bits set in its first 64).
  uint64_t incarnation() const;
  const std::array<uint8_t, 16>& bytes() const { return bytes_; }

  friend bool operator==(const RuntimeId&, const RuntimeId&) = default;

 private:
  RuntimeId() = default;
  std::array<uint8_t, 16> bytes_{};
};

}  // namespace orbitkv

#endif  // ORBITKV_BASE_RUNTIME_ID_H_
