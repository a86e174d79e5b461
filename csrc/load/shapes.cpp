// See shapes.h.
#include "shapes.h"

#include <climits>

#include "torch_kit.h"

namespace py = pybind11;

namespace zerofast::load {
namespace {

constexpr Py_ssize_t kMaxShapeDims = 64;

// `value` as records._shape returns it (a new reference to an exact tuple), or null where that
// check would refuse it or this pass does not know the type (a subclass: Python decides).
PyObject* plain_shape(PyObject* value) {
  PyTypeObject* type = Py_TYPE(value);
  auto* size_type = reinterpret_cast<PyTypeObject*>(torch_kit().size_type);  // null before bind_torch: not matched
  if (type != &PyTuple_Type && type != &PyList_Type && type != size_type) return nullptr;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(value);
  if (n > kMaxShapeDims) return nullptr;
  PyObject** dims = PySequence_Fast_ITEMS(value);
  long long product = 1;
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!PyLong_CheckExact(dims[i])) return nullptr;  // bool too: type(d) is not int
    int overflow = 0;
    const long long d = PyLong_AsLongLongAndOverflow(dims[i], &overflow);
    if (overflow || d < 0) return nullptr;  // past int64, or negative (an error: none is raised here)
    // The product only grows, so stopping at the first factor past 2**63 - 1 is the same verdict.
    if (d > 1 && product > LLONG_MAX / d) return nullptr;
    if (d > 1) product *= d;
  }
  if (type == &PyTuple_Type) {
    Py_INCREF(value);
    return value;
  }
  return type == &PyList_Type ? PyList_AsTuple(value) : PyTuple_GetSlice(value, 0, n);  // an exact tuple
}

// records._shapes(mapping) of a dict or OrderedDict (keys in its own iteration order), or None.
py::object plain_shapes(py::handle mapping) {
  PyObject* m = mapping.ptr();
  if (!PyDict_Check(m)) return py::none();
  py::object out = py::reinterpret_steal<py::object>(PyDict_New());
  py::object keys = py::reinterpret_steal<py::object>(PyObject_GetIter(m));
  if (!out || !keys) throw py::error_already_set();
  while (PyObject* key = PyIter_Next(keys.ptr())) {
    py::object k = py::reinterpret_steal<py::object>(key);
    if (!PyUnicode_CheckExact(key)) return py::none();
    PyObject* value = PyDict_GetItemWithError(m, key);  // borrowed; the dict's own slot
    if (!value) {
      if (PyErr_Occurred()) throw py::error_already_set();
      return py::none();
    }
    py::object shape = py::reinterpret_steal<py::object>(plain_shape(value));
    if (!shape) {
      if (PyErr_Occurred()) throw py::error_already_set();
      return py::none();
    }
    if (PyDict_SetItem(out.ptr(), key, shape.ptr()) < 0) throw py::error_already_set();
  }
  if (PyErr_Occurred()) throw py::error_already_set();
  return out;
}

}  // namespace

void register_shapes(py::module_& m) {
  m.def("plain_shapes", &plain_shapes, py::arg("mapping"),
        "records._shapes of a mapping whose shapes all pass by type and range: a dict of exact tuples, else None");
}

}  // namespace zerofast::load
