// Result<T>: a value of type T or the non-OK Status that explains why there is none.
//
// Fallible construction in OrbitKV is a static Create() returning Result<T> (no exceptions). Accessing the value
// of a Result that holds an error is a broken invariant and CHECK-fails with the status in the message; test
// ok() first, or use ORBITKV_ASSIGN_OR_RETURN.
#ifndef ORBITKV_BASE_RESULT_H_
#define ORBITKV_BASE_RESULT_H_

#include <type_traits>
#include <utility>
#include <variant>

#include "base/check.h"
#include "base/status.h"

namespace orbitkv {

template <typename T>
class [[nodiscard]] Result {
  static_assert(!std::is_same_v<std::decay_t<T>, Status>, "Result<Status> is meaningless; return Status");

 public:
  // Implicit so that `return value;` and `return Status::NotFound(...)` both read naturally.
  Result(const T& value) : rep_(std::in_place_index<1>, value) {}            // NOLINT(google-explicit-constructor)
  Result(T&& value) : rep_(std::in_place_index<1>, std::move(value)) {}      // NOLINT
  Result(Status status) : rep_(std::in_place_index<0>, std::move(status)) {  // NOLINT
    ORBITKV_CHECK_MSG(!std::get<0>(rep_).ok(), "Result constructed from an OK Status without a value");
  }
  template <typename U>
  requires(std::is_constructible_v<T, U&&> && !std::is_same_v<std::decay_t<U>, T> &&
           !std::is_same_v<std::decay_t<U>, Status> && !std::is_same_v<std::decay_t<U>, Result>) Result(U&& value)
      : rep_(std::in_place_index<1>, T(std::forward<U>(value))) {}  // NOLINT

  bool ok() const { return rep_.index() == 1; }

  // OK when a value is present.
  Status status() const { return ok() ? Status() : std::get<0>(rep_); }

  const T& value() const& {
    CheckHasValue();
    return std::get<1>(rep_);
  }
  T& value() & {
    CheckHasValue();
    return std::get<1>(rep_);
  }
  T&& value() && {
    CheckHasValue();
    return std::get<1>(std::move(rep_));
  }
  const T& operator*() const& { return value(); }
  T& operator*() & { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  const T* operator->() const { return &value(); }
  T* operator->() { return &value(); }

  template <typename U>
  T value_or(U&& fallback) const& {
    return ok() ? std::get<1>(rep_) : static_cast<T>(std::forward<U>(fallback));
  }

 private:
  void CheckHasValue() const {
    ORBITKV_CHECK_MSG(ok(), "value() on an error Result: {}", std::get<0>(rep_).ToString());
  }

  std::variant<Status, T> rep_;
};

namespace internal {
template <typename T>
Status ToStatus(const Result<T>& r) {
  return r.status();
}
}  // namespace internal

}  // namespace orbitkv

#define ORBITKV_CONCAT_INNER_(a, b) a##b
#define ORBITKV_CONCAT_(a, b) ORBITKV_CONCAT_INNER_(a, b)

// `ORBITKV_ASSIGN_OR_RETURN(auto x, MakeX());` declares or assigns lhs from a Result, or returns its Status.
#define ORBITKV_ASSIGN_OR_RETURN(lhs, expr) \
  ORBITKV_ASSIGN_OR_RETURN_IMPL_(ORBITKV_CONCAT_(orbitkv_result_, __COUNTER__), lhs, expr)
// NOLINTBEGIN(bugprone-macro-parentheses): lhs may be a declaration ("auto x"), which parentheses would break.
#define ORBITKV_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                   \
  if (!tmp.ok()) return tmp.status();                  \
  lhs = std::move(tmp).value()
// NOLINTEND(bugprone-macro-parentheses)

#endif  // ORBITKV_BASE_RESULT_H_
