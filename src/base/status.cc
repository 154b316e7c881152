#include "base/status.h"

#include <array>

namespace orbitkv {
namespace {

constexpr std::array<std::string_view, kMaxStatusCode + 1> kCodeNames = {
    "OK",        "CANCELLED",       "UNKNOWN",           "INVALID_ARGUMENT",   "DEADLINE_EXCEEDED",
    "NOT_FOUND", "ALREADY_EXISTS",  "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
    "ABORTED",   "OUT_OF_RANGE",    "UNIMPLEMENTED",     "INTERNAL",           "UNAVAILABLE",
    "DATA_LOSS", "UNAUTHENTICATED",
};

}  // namespace

std::string_view StatusReasonName(StatusReason reason) {
  switch (reason) {
    case StatusReason::kNone:
      return "none";
    case StatusReason::kEtcd:
      return "etcd";
    case StatusReason::kPeerProtocolVersion:
      return "peer-protocol-version";
    case StatusReason::kViewIncomplete:
      return "view-incomplete";
  }
  return "unknown";
}

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

Status::Status(const Status& other) : rep_(other.rep_ ? std::make_unique<Rep>(*other.rep_) : nullptr) {}

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
  return Status(rep_->code, message).WithReason(rep_->reason);
}

Status Status::WithReason(StatusReason reason) const {
  Status out(*this);
  if (out.rep_) out.rep_->reason = reason;
  return out;
}

std::ostream& operator<<(std::ostream& os, const Status& status) { return os << status.ToString(); }
std::ostream& operator<<(std::ostream& os, StatusCode code) { return os << StatusCodeName(code); }

}  // namespace orbitkv
