// The torch objects csrc/load/ works with, taken as Python objects (bind_torch, called by
// zerofast/native/loader.py once the module is imported) instead of torch's C++ headers: this
// half of the core then depends on the CPython ABI alone and loads beside any torch, and the
// tensors it makes are made by the running torch's own Python API, as the reference makes them.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <deque>

#include "dlpack_tensor.h"
#include "py_own.h"

namespace zerofast::load {

struct TorchKit {
  PyObject* tensor_type = nullptr;     // torch.Tensor
  PyObject* parameter_type = nullptr;  // torch.nn.Parameter
  PyObject* dtype_type = nullptr;      // torch.dtype
  PyObject* size_type = nullptr;       // torch.Size (a tuple subclass: filled item by item)
  PyObject* strided = nullptr;         // torch.strided
  PyObject* empty_of = nullptr;        // dtype -> torch.empty(0, dtype=dtype): a prototype per dtype
  PyObject* tensor_new = nullptr;      // torch.Tensor.new: proto.new() is a fresh empty tensor of its dtype
  PyObject* tensor_set = nullptr;      // torch.Tensor.set_
  PyObject* empty_bytes = nullptr;     // n -> torch.empty(n, dtype=torch.uint8)
  PyObject* empty_longs = nullptr;     // n -> torch.empty(n, dtype=torch.int64)
  PyObject* restrided = nullptr;       // torch.ops.zerofast.restrided.default (csrc/cpu/restrided.cpp)
  // torch._C.StorageBase's own subscript: UntypedStorage.__getitem__ is a Python method that
  // checks for a meta storage (a file mapping never is one) and then calls this.
  PyObject* from_dlpack = nullptr;     // torch._C._from_dlpack: a tensor from a "dltensor" capsule
  PyObject* dlpack_probe = nullptr;    // dtype -> torch.empty(1, dtype=dtype).__dlpack__()
  PyTypeObject* storage_base = nullptr;
  binaryfunc storage_subscript = nullptr;
};

// The bound objects (references held for the process's life: the module is never unloaded).
inline TorchKit& torch_kit() {
  static TorchKit kit;
  return kit;
}

// The bound kit; a reader called before bind_torch declines (the Python reader then reads).
inline const TorchKit& bound_kit() {
  const TorchKit& kit = torch_kit();
  if (!kit.tensor_set) throw Declined("torch objects not bound (bind_torch)");
  return kit;
}

// A Python int's value where it fits int64; declines otherwise.
inline int64_t int64_of(PyObject* p, const char* what) {
  if (!p || !PyLong_Check(p)) throw Declined(what);
  int overflow = 0;
  const long long x = PyLong_AsLongLongAndOverflow(p, &overflow);
  if (overflow || (x == -1 && PyErr_Occurred())) decline_py(what);
  return x;
}

// The names the readers ask torch's objects for, interned once: `o.name()` then builds no str
// and finds the method by a hash already computed (the twin asks each tensor a dozen of them).
struct Names {
  PyObject *data_ptr, *nbytes, *untyped_storage, *storage_offset, *stride, *is_conj, *is_neg, *requires_grad, *is_cpu,
      *layout, *dtype, *shape;
};

inline const Names& names() {
  static const Names n{PyUnicode_InternFromString("data_ptr"), PyUnicode_InternFromString("nbytes"),
                       PyUnicode_InternFromString("untyped_storage"), PyUnicode_InternFromString("storage_offset"),
                       PyUnicode_InternFromString("stride"), PyUnicode_InternFromString("is_conj"),
                       PyUnicode_InternFromString("is_neg"), PyUnicode_InternFromString("requires_grad"),
                       PyUnicode_InternFromString("is_cpu"), PyUnicode_InternFromString("layout"),
                       PyUnicode_InternFromString("dtype"), PyUnicode_InternFromString("shape")};
  return n;
}

inline pybind11::object call_method(PyObject* o, PyObject* name) {  // o.name()
  return own(PyObject_VectorcallMethod(name, &o, 1, nullptr), "method");
}

inline pybind11::object get_attr(PyObject* o, PyObject* name) {  // o.name
  return own(PyObject_GetAttr(o, name), "attribute");
}

// `nbytes` of storage `mapping` (a CPU torch._C.StorageBase) from `offset`:
// mapping[offset:offset + nbytes], a storage of its own sharing the mapping's memory and keeping
// it alive, as the Python reference cuts them.
inline pybind11::object cut(PyObject* mapping, int64_t offset, int64_t nbytes) {
  pybind11::object lo = own(PyLong_FromLongLong(offset), "int");
  pybind11::object hi = own(PyLong_FromLongLong(offset + nbytes), "int");
  pybind11::object range = own(PySlice_New(lo.ptr(), hi.ptr(), nullptr), "slice");
  const TorchKit& kit = bound_kit();
  if (!PyObject_TypeCheck(mapping, kit.storage_base)) throw Declined("the mapping is not a storage");
  return own(kit.storage_subscript(mapping, range.ptr()), "storage");
}

// proto.new().set_(storage, offset, size, stride): what torch.empty(0, dtype=...).set_(...)
// makes (the reference's rebuild), with the dtype taken from `proto` instead of parsed again;
// both through vectorcall, no Python frame. `size` and `stride`: sequences of ints.
inline pybind11::object tensor_over(PyObject* proto, PyObject* storage, int64_t offset, PyObject* size,
                                    PyObject* stride) {
  const TorchKit& kit = bound_kit();
  PyObject* self[] = {proto};
  pybind11::object t = own(PyObject_Vectorcall(kit.tensor_new, self, 1, nullptr), "tensor");
  pybind11::object at = own(PyLong_FromLongLong(offset), "int");
  PyObject* args[] = {t.ptr(), storage, at.ptr(), size, stride};
  return own(PyObject_Vectorcall(kit.tensor_set, args, 5, nullptr), "tensor");
}

// What tensors of one dtype are made with, found once per process (dtypes are torch's
// singletons; every file of a thousand-file save asks for the same few).
struct DtypeInfo {
  PyObject* dtype;  // the references are held for the process's life
  PyObject* proto;  // an empty tensor of it: proto.new() is a fresh one
  int64_t itemsize;
  bool dl;  // torch exports it through DLPack, as dl_dtype (so imports it back)
  dlpack::DataType dl_dtype;
};

// The DLPack code torch gives `dtype`, asked of a one-element tensor's export; false for a
// dtype DLPack lacks (the probe raises).
inline bool dlpack_code(PyObject* dtype, dlpack::DataType* out) {
  PyObject* probe = PyObject_CallOneArg(bound_kit().dlpack_probe, dtype);
  const bool found = probe && dlpack::dtype_of(probe, out);
  Py_XDECREF(probe);
  PyErr_Clear();
  return found;
}

inline const DtypeInfo& dtype_info(PyObject* dtype) {  // with the GIL
  static std::deque<DtypeInfo> known;  // a deque: references to its items stay valid
  for (const DtypeInfo& d : known)
    if (d.dtype == dtype) return d;
  const TorchKit& kit = bound_kit();
  if (Py_TYPE(dtype) != reinterpret_cast<PyTypeObject*>(kit.dtype_type)) throw Declined("not a torch.dtype");
  pybind11::object itemsize = own(PyObject_GetAttrString(dtype, "itemsize"), "itemsize");
  pybind11::object proto = own(PyObject_CallOneArg(kit.empty_of, dtype), "empty tensor");
  DtypeInfo d{dtype, nullptr, int64_of(itemsize.ptr(), "itemsize"), false, {}};
  d.dl = dlpack_code(dtype, &d.dl_dtype);
  Py_INCREF(dtype);
  d.proto = proto.release().ptr();
  known.push_back(d);
  return known.back();
}

// The tensors imported through DLPack over one file mapping (see dlpack_tensor.h), for the
// unpickler and the twin copier alike: the mapping's address is asked and its keeper made at the
// first import, and this object's count of the keeper is dropped with it (the GIL held).
class MappingImports {
 public:
  explicit MappingImports(PyObject* mapping) : mapping_(mapping) {}
  ~MappingImports() {
    if (keeper_) dlpack::release(keeper_);
  }
  MappingImports(const MappingImports&) = delete;
  MappingImports& operator=(const MappingImports&) = delete;

  // A tensor of `ndim` sizes and strides (elements) over the mapping's bytes from offset `at`.
  pybind11::object tensor(const DtypeInfo& dtype, int64_t at, size_t ndim, const int64_t* size,
                          const int64_t* stride) {
    const TorchKit& kit = bound_kit();
    if (!keeper_) {
      if (!PyObject_TypeCheck(mapping_, kit.storage_base)) throw Declined("the mapping is not a storage");
      pybind11::object address = call_method(mapping_, names().data_ptr);
      data_ = reinterpret_cast<uint8_t*>(uintptr_t(int64_of(address.ptr(), "data_ptr")));
      keeper_ = new dlpack::Keeper(mapping_);
    }
    pybind11::object cap = own(dlpack::capsule(keeper_, data_ + at, dtype.dl_dtype, ndim, size, stride), "capsule");
    PyObject* arg[] = {cap.ptr()};
    return own(PyObject_Vectorcall(kit.from_dlpack, arg, 1, nullptr), "from_dlpack");
  }

 private:
  PyObject* mapping_;  // the file's UntypedStorage (the caller keeps it alive until the keeper holds it)
  uint8_t* data_ = nullptr;
  dlpack::Keeper* keeper_ = nullptr;
};


}  // namespace zerofast::load
