#include "cluster/member_record.h"

#include <fmt/format.h>

#include <array>

#include "base/check.h"
#include "base/runtime_id.h"
#include "cluster/cluster_keys.h"
#include "cluster/flat_json.h"

namespace orbitkv::cluster {

Status ValidateEndpoint(std::string_view what, std::string_view endpoint) {
  if (endpoint.empty() || endpoint.size() > 255) {
    return Status::InvalidArgument(fmt::format("{} must be 1..255 bytes of host:port", what));
  }
  for (char c : endpoint) {
    if (c <= ' ' || c > '~' || c == '"' || c == '\\' || c == ',' || c == '/') {
      return Status::InvalidArgument(fmt::format("{} '{}' is not a host:port", what, endpoint));
    }
  }
  const size_t colon = endpoint.rfind(':');
  if (colon == std::string_view::npos || colon == 0 || colon + 1 == endpoint.size()) {
    return Status::InvalidArgument(fmt::format("{} '{}' is not a host:port", what, endpoint));
  }
  const std::string_view host = endpoint.substr(0, colon);
  if (host.find(':') != std::string_view::npos && !(host.front() == '[' && host.back() == ']')) {
    return Status::InvalidArgument(fmt::format("{} '{}': write an IPv6 host as [addr]:port", what, endpoint));
  }
  const std::string_view port = endpoint.substr(colon + 1);
  uint32_t value = 0;
  for (char c : port) {
    if (c < '0' || c > '9' || port.size() > 5) {
      return Status::InvalidArgument(fmt::format("{} '{}' has a bad port", what, endpoint));
    }
    value = value * 10 + static_cast<uint32_t>(c - '0');
  }
  if (value == 0 || value > 65535) {
    return Status::InvalidArgument(fmt::format("{} '{}': port must be 1..65535", what, endpoint));
  }
  return Status::Ok();
}

bool IsRuntimeUuid(std::string_view text) {
  if (text.size() != 36) return false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (i == 8 || i == 13 || i == 18 || i == 23) {
      if (c != '-') return false;
    } else if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) {
      return false;
    }
  }
  return true;
}

std::string NewRuntimeUuid() { return RuntimeId::New().ToString(); }

namespace {

// 16 lower-case hex digits.
Result<uint64_t> ParseIncarnation(std::string_view hex) {
  uint64_t value = 0;
  if (hex.size() != 16)
    return Status::InvalidArgument(fmt::format("member incarnation '{}' is not 16 hex digits", hex));
  for (char c : hex) {
    const int digit = c >= '0' && c <= '9' ? c - '0' : (c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1);
    if (digit < 0) return Status::InvalidArgument(fmt::format("member incarnation '{}' is not 16 hex digits", hex));
    value = value << 4 | static_cast<uint64_t>(digit);
  }
  return value;
}

}  // namespace

Status ValidateMemberRecord(const MemberRecord& record) {
  ORBITKV_RETURN_IF_ERROR(ValidateName("member record cluster", record.cluster));
  ORBITKV_RETURN_IF_ERROR(ValidateName("member record node", record.node_id));
  if (record.epoch < 1) return Status::InvalidArgument(fmt::format("member epoch {} is below 1", record.epoch));
  ORBITKV_RETURN_IF_ERROR(ValidateEndpoint("member endpoint", record.endpoint));
  if (!IsRuntimeUuid(record.runtime_uuid)) {
    return Status::InvalidArgument(
        fmt::format("member runtime UUID '{}' is not a lower-case UUID", record.runtime_uuid));
  }
  return Status::Ok();
}

std::string EncodeMemberRecord(const MemberRecord& record) {
  ORBITKV_CHECK_MSG(ValidateMemberRecord(record).ok(), "encoding an invalid member record: {}",
                    ValidateMemberRecord(record).ToString());
  return FlatJsonWriter()
      .Add("v", kMemberRecordVersion)
      .Add("cluster", record.cluster)
      .Add("node", record.node_id)
      .Add("epoch", record.epoch)
      .Add("endpoint", record.endpoint)
      .Add("uuid", record.runtime_uuid)
      .Add("incarnation", fmt::format("{:016x}", record.incarnation))
      .Finish();
}

Result<MemberRecord> DecodeMemberRecord(std::string_view cluster, std::string_view node_id, std::string_view bytes) {
  if (bytes.size() > kMaxMemberRecordBytes) {
    return Status::OutOfRange(fmt::format("member record for '{}' is {} bytes; the limit is {}", node_id, bytes.size(),
                                          kMaxMemberRecordBytes));
  }
  ORBITKV_ASSIGN_OR_RETURN(FlatJsonObject json, ParseVersioned(bytes, kMemberRecordVersion, "member record"));
  MemberRecord record;
  ORBITKV_ASSIGN_OR_RETURN(record.cluster, json.GetString("cluster"));
  ORBITKV_ASSIGN_OR_RETURN(record.node_id, json.GetString("node"));
  ORBITKV_ASSIGN_OR_RETURN(record.epoch, json.GetInt("epoch"));
  ORBITKV_ASSIGN_OR_RETURN(record.endpoint, json.GetString("endpoint"));
  ORBITKV_ASSIGN_OR_RETURN(record.runtime_uuid, json.GetString("uuid"));
  if (json.Has("incarnation")) {
    ORBITKV_ASSIGN_OR_RETURN(const std::string hex, json.GetString("incarnation"));
    ORBITKV_ASSIGN_OR_RETURN(record.incarnation, ParseIncarnation(hex));
  }
  ORBITKV_RETURN_IF_ERROR(ValidateMemberRecord(record));
  if (record.cluster != cluster || record.node_id != node_id) {
    return Status::InvalidArgument(fmt::format("member record names {}/{} but is stored under {}/{}", record.cluster,
                                               record.node_id, cluster, node_id));
  }
  return record;
}

}  // namespace orbitkv::cluster
