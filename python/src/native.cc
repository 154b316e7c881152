#include "native.h"

namespace py = pybind11;

PYBIND11_MODULE(_native, m) {
  m.doc() = "OrbitKV native bindings: state identity, recovery planning and the Manager client.";
  // OrbitKVError (a ValueError) for every failure, with subclasses for the ones callers handle
  // differently. Each carries `code`, the status code name.
  static py::exception<orbitkv::python::StatusError> error(m, "OrbitKVError", PyExc_ValueError);
  static py::object unavailable = py::reinterpret_steal<py::object>(
      PyErr_NewExceptionWithDoc("orbitkv._native.ManagerUnavailable",
                                "The Manager is not running, stopped, or closed this session.", error.ptr(), nullptr));
  static py::object timeout = py::reinterpret_steal<py::object>(PyErr_NewExceptionWithDoc(
      "orbitkv._native.OrbitKVTimeout", "A call did not complete within its timeout; its memory stays owned.",
      error.ptr(), nullptr));
  static py::object busy = py::reinterpret_steal<py::object>(PyErr_NewExceptionWithDoc(
      "orbitkv._native.OrbitKVBusy", "Backpressure: a budget or queue is full right now; retry later.", error.ptr(),
      nullptr));
  m.attr("ManagerUnavailable") = unavailable;
  m.attr("OrbitKVTimeout") = timeout;
  m.attr("OrbitKVBusy") = busy;
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const orbitkv::python::StatusError& e) {
      py::handle type = error;
      switch (e.status().code()) {
        case orbitkv::StatusCode::kUnavailable:
          type = unavailable;
          break;
        case orbitkv::StatusCode::kDeadlineExceeded:
          type = timeout;
          break;
        case orbitkv::StatusCode::kResourceExhausted:
          type = busy;
          break;
        default:
          break;
      }
      py::object exc = type(py::str(e.what()));
      exc.attr("code") = py::str(std::string(orbitkv::StatusCodeName(e.status().code())));
      PyErr_SetObject(type.ptr(), exc.ptr());
    }
  });
  orbitkv::python::BindState(m);
  orbitkv::python::BindClient(m);
}
