#include "native.h"

namespace py = pybind11;

PYBIND11_MODULE(_native, m) {
  m.doc() = "OrbitKV native bindings (state identity and recovery planning).";
  static py::exception<orbitkv::python::StatusError> error(m, "OrbitKVError", PyExc_ValueError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const orbitkv::python::StatusError& e) {
      py::object exc = py::handle(error.ptr())(py::str(e.what()));
      exc.attr("code") = py::str(std::string(orbitkv::StatusCodeName(e.status().code())));
      PyErr_SetObject(error.ptr(), exc.ptr());
    }
  });
  orbitkv::python::BindState(m);
}
