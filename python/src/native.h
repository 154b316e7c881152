// Shared pieces of the orbitkv._native extension: the error type Python sees and the Status -> exception bridge.
#ifndef ORBITKV_PYTHON_NATIVE_H_
#define ORBITKV_PYTHON_NATIVE_H_

#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

#include "base/result.h"

namespace orbitkv::python {

// Thrown only inside binding code and translated to orbitkv.OrbitKVError (a ValueError) with a `code` attribute
// holding the status code name; OrbitKV's C++ code itself never throws.
class StatusError : public std::runtime_error {
 public:
  explicit StatusError(const Status& status) : std::runtime_error(status.ToString()), status_(status) {}
  const Status& status() const { return status_; }

 private:
  Status status_;
};

inline void ThrowIfError(const Status& status) {
  if (!status.ok()) throw StatusError(status);
}

template <typename T>
T ValueOrThrow(Result<T> result) {
  if (!result.ok()) throw StatusError(result.status());
  return std::move(result).value();
}

void BindState(pybind11::module_& m);
void BindClient(pybind11::module_& m);

}  // namespace orbitkv::python

#endif  // ORBITKV_PYTHON_NATIVE_H_
