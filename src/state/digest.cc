#include "state/digest.h"

#include <openssl/evp.h>

#include "base/check.h"

namespace orbitkv::state {
namespace {

const EVP_MD* Sha256Md() {
  // Fetched once: an implicit fetch on every call costs more than hashing a StateKey.
  static const EVP_MD* md = EVP_MD_fetch(nullptr, "SHA256", nullptr);
  ORBITKV_CHECK_MSG(md != nullptr, "libcrypto has no SHA256");
  return md;
}

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

std::string Digest256::ToHex() const {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(64, '0');
  for (size_t i = 0; i < bytes.size(); ++i) {
    out[2 * i] = kDigits[bytes[i] >> 4];
    out[2 * i + 1] = kDigits[bytes[i] & 0xf];
  }
  return out;
}

Result<Digest256> Digest256::FromHex(std::string_view hex) {
  if (hex.size() != 64) {
    return Status::InvalidArgument("digest must be 64 hex digits, got " + std::to_string(hex.size()) + " characters");
  }
  Digest256 d;
  for (size_t i = 0; i < d.bytes.size(); ++i) {
    int hi = HexValue(hex[2 * i]);
    int lo = HexValue(hex[2 * i + 1]);
    if (hi < 0 || lo < 0)
      return Status::InvalidArgument("digest has a non-hex character near offset " + std::to_string(2 * i));
    d.bytes[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return d;
}

bool Digest256::IsZero() const {
  for (uint8_t b : bytes) {
    if (b != 0) return false;
  }
  return true;
}

struct Sha256::Ctx {
  EVP_MD_CTX* md_ctx;
};

Sha256::Sha256() : ctx_(std::make_unique<Ctx>(Ctx{EVP_MD_CTX_new()})) {
  ORBITKV_CHECK(ctx_->md_ctx != nullptr);
  ORBITKV_CHECK(EVP_DigestInit_ex(ctx_->md_ctx, Sha256Md(), nullptr) == 1);
}

Sha256::~Sha256() { EVP_MD_CTX_free(ctx_->md_ctx); }

Sha256& Sha256::Update(std::span<const uint8_t> data) {
  ORBITKV_CHECK(EVP_DigestUpdate(ctx_->md_ctx, data.data(), data.size()) == 1);
  return *this;
}

Sha256& Sha256::Update(std::string_view data) {
  return Update(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(data.data()), data.size()));
}

Digest256 Sha256::Finish() {
  Digest256 d;
  unsigned int len = 0;
  ORBITKV_CHECK(EVP_DigestFinal_ex(ctx_->md_ctx, d.bytes.data(), &len) == 1 && len == d.bytes.size());
  return d;
}

Digest256 Sha256::Of(std::span<const uint8_t> data) {
  // One context per thread, reused: EVP_Digest allocates, initialises and frees a context on every
  // call, which costs more than hashing a 145-byte key with the SHA extensions (ShardOf runs once
  // per saved block).
  struct ThreadCtx {
    EVP_MD_CTX* ctx = EVP_MD_CTX_new();
    ~ThreadCtx() { EVP_MD_CTX_free(ctx); }
  };
  thread_local ThreadCtx local;
  ORBITKV_CHECK(local.ctx != nullptr);
  Digest256 d;
  unsigned int len = 0;
  ORBITKV_CHECK(EVP_DigestInit_ex2(local.ctx, Sha256Md(), nullptr) == 1 &&
                EVP_DigestUpdate(local.ctx, data.data(), data.size()) == 1 &&
                EVP_DigestFinal_ex(local.ctx, d.bytes.data(), &len) == 1 && len == d.bytes.size());
  return d;
}

Digest256 Sha256::Of(std::string_view data) {
  return Of(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(data.data()), data.size()));
}

}  // namespace orbitkv::state
