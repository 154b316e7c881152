#include "base/status.h"

#include <array>

namespace orbitkv {
namespace {

constexpr std::array<std::string_view, kMaxStatusCode + 1> kCodeNames = {
    "OK",        "CANCELLED",         "UNKNOWN",          "INVALID_ARGUMENT", "DEADLINE_EXCEEDED",
    "NOT_FOUND", "ALREADY_EXISTS",    "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
    "ABORTED",   "OUT_OF_RANGE",      "UNIMPLEMENTED",    "INTERNAL",         "UNAVAILABLE",
    "DATA_LOSS", "UNAUTHENTICATED",
};

}  // namespace

std::string_view StatusCodeName(StatusCode code) {
  const auto index = static_cast<uint8_t>(code);
  return index <= kMaxStatusCode ? kCodeNames[index] : std::string_view("UNKNOWN");
}

StatusCode StatusCodeFromByte(uint8_t value) {
  return value <= kMaxStatusCode ? static_cast<StatusCode>(value) : StatusCode::kUnknown;
}

Status::Status(StatusCode code, std::string_view message) {
  // An "error" with code OK would be indistinguishable from success; keep OK allocation-free instead.
  if (code != StatusCode::kOk) rep_ = std::make_unique<Rep>(Rep{code, std::string(message)});
}

Status::Status(const Status& other)
    : rep_(other.rep_ ? std::make_unique<Rep>(*other.rep_) : nullptr) {}

Status& Status::operator=(const Status& other) {
  if (this != &other) rep_ = other.rep_ ? std::make_unique<Rep>(*other.rep_) : nullptr;
  return *this;
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string out(StatusCodeName(rep_->code));
  if (!rep_->message.empty()) {
    out += ": ";
    out += rep_->message;
  }
  return out;
}

Status Status::WithContext(std::string_view context) const {
  if (ok()) return *this;
  std::string message(context);
  message += ": ";
  message += rep_->message;
  return Status(rep_->code, message);
}

std::ostream& operator<<(std::ostream& os, const Status& status) { return os << status.ToString(); }
std::ostream& operator<<(std::ostream& os, StatusCode code) { return os << StatusCodeName(code); }

}  // namespace orbitkv
