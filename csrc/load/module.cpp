// The Python module that carries the core: importing it (zerofast/native/loader.py) loads this
// library, registering the ops of csrc/zerofast.cpp, and gives the rank-file readers of
// zerofast/load/ their native halves. Which devices have kernels is asked of torch's dispatcher
// from Python (zerofast/native/proof.py: kernel_devices), not here. Nothing here includes a torch
// header: the torch objects the readers need are handed in once (bind_torch).
#include <pybind11/pybind11.h>

#include <string>

#include "shapes.h"
#include "torch_kit.h"
#include "twin.h"
#include "unpickle.h"
#include "zip_directory.h"

#ifndef ZEROFAST_TORCH_VERSION
#define ZEROFAST_TORCH_VERSION "unknown"
#endif

namespace {

// Keeps the loader's torch objects for the process's life (see torch_kit.h); a second call
// (another import of the same library) replaces them.
void bind_torch(const pybind11::dict& kit) {
  auto take = [&kit](const char* name) {
    pybind11::object o = kit[name];
    return o.release().ptr();
  };
  zerofast::load::TorchKit k;
  k.tensor_type = take("tensor_type");
  k.parameter_type = take("parameter_type");
  k.dtype_type = take("dtype_type");
  k.size_type = take("size_type");
  k.strided = take("strided");
  k.empty_of = take("empty_of");
  k.tensor_new = take("tensor_new");
  k.tensor_set = take("tensor_set");
  k.empty_bytes = take("empty_bytes");
  k.empty_longs = take("empty_longs");
  k.restrided = take("restrided");
  k.from_dlpack = take("from_dlpack");
  k.dlpack_probe = take("dlpack_probe");
  PyObject* storage_base = take("storage_base");
  auto* base = reinterpret_cast<PyTypeObject*>(storage_base);
  if (!PyType_Check(storage_base) || !base->tp_as_mapping || !base->tp_as_mapping->mp_subscript)
    throw pybind11::type_error("bind_torch: expected torch._C.StorageBase");
  k.storage_base = base;
  k.storage_subscript = base->tp_as_mapping->mp_subscript;
  if (!PyType_Check(k.tensor_type) || !PyType_Check(k.parameter_type) || !PyType_Check(k.dtype_type) ||
      !PyType_Check(k.size_type) || !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(k.size_type), &PyTuple_Type))
    throw pybind11::type_error("bind_torch: expected torch's types");
  zerofast::load::torch_kit() = k;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bind_torch", &bind_torch, pybind11::arg("kit"),
        "Hand the readers the running torch's objects they use (zerofast/native/torch_kit.py)");
  m.def("torch_version", [] { return std::string(ZEROFAST_TORCH_VERSION); },
        "torch version this extension was compiled against");
  zerofast::load::register_zip_directory(m);
  zerofast::load::register_unpickle(m);
  zerofast::load::register_twin(m);
  zerofast::load::register_shapes(m);
}
