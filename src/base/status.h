// Status: the outcome of an operation that can fail, without exceptions.
//
// A Status is either OK or carries a code from gRPC's canonical set plus a human-readable message. The code fits
// in one byte so it can travel in wire descriptors and disk records unchanged. OK is the cheap path: an OK Status
// holds no allocation. Conventions (STYLE.md): NotFound for a miss, ResourceExhausted for a full pool or ring,
// Unavailable for a gone peer, Aborted for a lost race or stale epoch, DataLoss for a checksum failure. A broken
// invariant is a CHECK crash, never a Status.
//
// Thread safety: a Status is a value; distinct objects may be used from distinct threads.
#ifndef ORBITKV_BASE_STATUS_H_
#define ORBITKV_BASE_STATUS_H_

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <string_view>

namespace orbitkv {

// Values match grpc::StatusCode so that a code maps across gRPC boundaries without a table.
enum class StatusCode : uint8_t {
  kOk = 0,
  kCancelled = 1,
  kUnknown = 2,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kNotFound = 5,
  kAlreadyExists = 6,
  kPermissionDenied = 7,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kAborted = 10,
  kOutOfRange = 11,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
  kDataLoss = 15,
  kUnauthenticated = 16,
};
inline constexpr uint8_t kMaxStatusCode = 16;
static_assert(sizeof(StatusCode) == 1, "StatusCode travels as one byte");

// "NOT_FOUND", "DATA_LOSS", ... as gRPC spells them; "UNKNOWN_CODE(n)" is never returned for a valid enum.
std::string_view StatusCodeName(StatusCode code);

// Maps a wire byte back to a code; values above kMaxStatusCode become kUnknown.
StatusCode StatusCodeFromByte(uint8_t value);

// Why an error happened, in a form code may decide on; the message is for people and is never parsed. Only the
// few reasons that callers branch on have a value, each naming who sets it and who reads it. A reason travels with
// the Status through WithContext and copies, and across the peer protocol (catalog/peer_service.h).
enum class StatusReason : uint8_t {
  kNone = 0,
  // etcd, or reaching it, gave this error (cluster/etcd_client.cc): the membership supervisor retries a
  // registration that failed so, whatever the code, while this Manager's own verdicts (another runtime holds the
  // Node ID, the placement regressed) fence it.
  kEtcd = 1,
  // A peer refused a request for another orbitkv.peer protocol version (catalog/route.cc): the peer directory turns
  // remote work off until that member speaks this version again.
  kPeerProtocolVersion = 2,
  // A member view is incomplete (cluster/member_view.cc on this side, a peer's route check on the other): membership
  // skew that settles by itself, so discovery opens no breaker for it.
  kViewIncomplete = 3,
};
inline constexpr uint8_t kMaxStatusReason = 3;
std::string_view StatusReasonName(StatusReason reason);

class [[nodiscard]] Status {
 public:
  // OK.
  Status() noexcept = default;
  Status(StatusCode code, std::string_view message);

  Status(const Status& other);
  Status& operator=(const Status& other);
  Status(Status&&) noexcept = default;
  Status& operator=(Status&&) noexcept = default;
  ~Status() = default;

  static Status Ok() { return Status(); }
  static Status Cancelled(std::string_view msg) { return {StatusCode::kCancelled, msg}; }
  static Status Unknown(std::string_view msg) { return {StatusCode::kUnknown, msg}; }
  static Status InvalidArgument(std::string_view msg) { return {StatusCode::kInvalidArgument, msg}; }
  static Status DeadlineExceeded(std::string_view msg) { return {StatusCode::kDeadlineExceeded, msg}; }
  static Status NotFound(std::string_view msg) { return {StatusCode::kNotFound, msg}; }
  static Status AlreadyExists(std::string_view msg) { return {StatusCode::kAlreadyExists, msg}; }
  static Status PermissionDenied(std::string_view msg) { return {StatusCode::kPermissionDenied, msg}; }
  static Status ResourceExhausted(std::string_view msg) { return {StatusCode::kResourceExhausted, msg}; }
  static Status FailedPrecondition(std::string_view msg) { return {StatusCode::kFailedPrecondition, msg}; }
  static Status Aborted(std::string_view msg) { return {StatusCode::kAborted, msg}; }
  static Status OutOfRange(std::string_view msg) { return {StatusCode::kOutOfRange, msg}; }
  static Status Unimplemented(std::string_view msg) { return {StatusCode::kUnimplemented, msg}; }
  static Status Internal(std::string_view msg) { return {StatusCode::kInternal, msg}; }
  static Status Unavailable(std::string_view msg) { return {StatusCode::kUnavailable, msg}; }
  static Status DataLoss(std::string_view msg) { return {StatusCode::kDataLoss, msg}; }
  static Status Unauthenticated(std::string_view msg) { return {StatusCode::kUnauthenticated, msg}; }

  bool ok() const { return rep_ == nullptr; }
  StatusCode code() const { return rep_ ? rep_->code : StatusCode::kOk; }
  // Empty for OK.
  std::string_view message() const { return rep_ ? std::string_view{rep_->message} : std::string_view{}; }

  // "OK" or "NOT_FOUND: key 3f.. is not resident".
  std::string ToString() const;

  // Returns a copy whose message is "<context>: <message>" (the reason kept); OK stays OK.
  Status WithContext(std::string_view context) const;

  // kNone for OK and for errors without one.
  StatusReason reason() const { return rep_ ? rep_->reason : StatusReason::kNone; }
  // Returns a copy with `reason`; OK stays OK.
  Status WithReason(StatusReason reason) const;

  friend bool operator==(const Status& a, const Status& b) {
    return a.code() == b.code() && a.message() == b.message();
  }

 private:
  struct Rep {
    StatusCode code;
    std::string message;
    StatusReason reason = StatusReason::kNone;
  };
  // Null means OK, so the success path never allocates.
  std::unique_ptr<Rep> rep_;
};

std::ostream& operator<<(std::ostream& os, const Status& status);
std::ostream& operator<<(std::ostream& os, StatusCode code);

}  // namespace orbitkv

// Evaluates an expression yielding Status (or Result<T>) and returns its Status from the calling function when
// it is not OK.
#define ORBITKV_RETURN_IF_ERROR(expr)                                          \
  do {                                                                         \
    ::orbitkv::Status orbitkv_status_ = ::orbitkv::internal::ToStatus((expr)); \
    if (!orbitkv_status_.ok()) return orbitkv_status_;                         \
  } while (false)

namespace orbitkv::internal {
inline const Status& ToStatus(const Status& s) { return s; }
inline Status ToStatus(Status&& s) { return std::move(s); }
}  // namespace orbitkv::internal

#endif  // ORBITKV_BASE_STATUS_H_
