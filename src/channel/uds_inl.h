// Template part of uds.h.
#ifndef ORBITKV_CHANNEL_UDS_INL_H_
#define ORBITKV_CHANNEL_UDS_INL_H_

#include <fmt/format.h>

#include <cstring>
#include <type_traits>

namespace orbitkv::channel {

template <typename T>
Result<T> BodyAs(const Frame& frame, bool allow_trailing) {
  static_assert(std::is_trivially_copyable_v<T>);
  const bool size_ok = allow_trailing ? frame.body.size() >= sizeof(T) : frame.body.size() == sizeof(T);
  if (!size_ok) {
    return Status::InvalidArgument(fmt::format("frame type {} has a {}-byte body, expected {}{}", frame.header.type,
                                               frame.body.size(), allow_trailing ? "at least " : "", sizeof(T)));
  }
  T value;
  std::memcpy(&value, frame.body.data(), sizeof(T));
  return value;
}

}  // namespace orbitkv::channel

#endif  // ORBITKV_CHANNEL_UDS_INL_H_
