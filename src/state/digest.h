// Digest256: a 32-byte SHA-256 digest, and the SHA-256 helper the state library uses (OpenSSL's libcrypto).
#ifndef ORBITKV_STATE_DIGEST_H_
#define ORBITKV_STATE_DIGEST_H_

#include <array>
#include <compare>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "base/result.h"

namespace orbitkv::state {

struct Digest256 {
  std::array<uint8_t, 32> bytes{};

  // 64 lowercase hex digits.
  std::string ToHex() const;
  // Accepts exactly 64 hex digits (either case).
  static Result<Digest256> FromHex(std::string_view hex);
  bool IsZero() const;

  friend auto operator<=>(const Digest256&, const Digest256&) = default;
};

// Incremental SHA-256. Update() any number of times, then Finish() once.
class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;

  Sha256& Update(std::span<const uint8_t> data);
  Sha256& Update(std::string_view data);
  Digest256 Finish();

  static Digest256 Of(std::span<const uint8_t> data);
  static Digest256 Of(std::string_view data);

 private:
  struct Ctx;
  std::unique_ptr<Ctx> ctx_;
};

}  // namespace orbitkv::state

#endif  // ORBITKV_STATE_DIGEST_H_
