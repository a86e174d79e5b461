// Taking ownership of a new reference from the CPython API, for the readers of csrc/load/ that
// build Python objects (twin.cpp, unpickle.cpp): a failed call declines the file rather than
// raising, so the Python reader decides and words the error.
#pragma once

#include <pybind11/pybind11.h>

#include "pickle_scan.h"

namespace zerofast::load {

[[noreturn]] inline void decline_py(const char* what) {
  PyErr_Clear();
  throw Declined(what);
}

inline pybind11::object own(PyObject* p, const char* what) {
  if (!p) decline_py(what);
  return pybind11::reinterpret_steal<pybind11::object>(p);
}

}  // namespace zerofast::load
