// A tensor over a file mapping's bytes made in one call of torch's own DLPack import
// (torch._C._from_dlpack), for the unpickler's common case: a tensor at offset 0 that spans its
// whole storage entry. torch then makes the StorageImpl (sized to the tensor's extent: the
// entry's bytes) and the tensor together, without a Python storage object or a set_ call: a
// third of the per-tensor cost of mapping[offset:offset + nbytes] and proto.new().set_(...).
//
// DLPack is a C ABI of its own (dmlc/dlpack, "dltensor" capsules, the unversioned form every
// torch since 1.x imports); its structs are declared here as that ABI lays them out, not
// taken from a header. The tensors keep the mapping alive through one counted keeper per file.
#pragma once

#include <pybind11/pybind11.h>

#include <atomic>
#include <cstdint>
#include <new>

namespace zerofast::load::dlpack {

struct Device {
  int32_t type;  // 1: kDLCPU
  int32_t id;
};
struct DataType {
  uint8_t code, bits;
  uint16_t lanes;
};
struct Tensor {
  void* data;
  Device device;
  int32_t ndim;
  DataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct Managed {
  Tensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(Managed*);
};

constexpr const char* kCapsule = "dltensor";  // renamed "used_dltensor" by the importer

// The file mapping (a Python object), held once for all the tensors over it: the last one to go
// drops it, taking the GIL (torch may free a storage on a thread without it; numpy's DLPack
// deleter does the same). At interpreter exit the reference is left: Python is gone.
struct Keeper {
  std::atomic<int64_t> holders{1};
  PyObject* mapping;
  explicit Keeper(PyObject* m) : mapping(m) { Py_INCREF(m); }
};

inline void release(Keeper* k) {
  if (k->holders.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  if (Py_IsInitialized()) {
    PyGILState_STATE state = PyGILState_Ensure();
    Py_DECREF(k->mapping);
    PyGILState_Release(state);
  }
  delete k;
}

// One exported tensor: the Managed record, its keeper, then its shape and strides.
struct Export {
  Managed managed;
  Keeper* keeper;
  int64_t dims[1];  // 2 * ndim of them, allocated past the struct
};

inline void delete_export(Managed* m) {
  auto* e = static_cast<Export*>(m->manager_ctx);
  Keeper* k = e->keeper;
  ::operator delete(e);
  release(k);
}

inline void capsule_gone(PyObject* capsule) {  // never imported: the export is ours to free
  if (!PyCapsule_IsValid(capsule, kCapsule)) return;
  auto* m = static_cast<Managed*>(PyCapsule_GetPointer(capsule, kCapsule));
  if (m) m->deleter(m);
}

// A "dltensor" capsule of `ndim` sizes and strides (elements) over `data`; null with a Python
// error set where it cannot be made.
inline PyObject* capsule(Keeper* keeper, void* data, DataType dtype, size_t ndim, const int64_t* size,
                         const int64_t* stride) {
  void* raw = ::operator new(sizeof(Export) + sizeof(int64_t) * (2 * ndim), std::nothrow);
  if (!raw) return PyErr_NoMemory();
  auto* e = static_cast<Export*>(raw);
  for (size_t i = 0; i < ndim; ++i) e->dims[i] = size[i], e->dims[ndim + i] = stride[i];
  e->managed = Managed{Tensor{data, Device{1, 0}, int32_t(ndim), dtype, e->dims, e->dims + ndim, 0}, e, &delete_export};
  e->keeper = keeper;
  keeper->holders.fetch_add(1, std::memory_order_relaxed);
  PyObject* cap = PyCapsule_New(&e->managed, kCapsule, &capsule_gone);
  if (!cap) delete_export(&e->managed);
  return cap;
}

// The DLPack dtype a capsule torch exported describes (what torch imports back as that dtype);
// false where it is not an unversioned capsule of one lane.
inline bool dtype_of(PyObject* cap, DataType* out) {
  if (!PyCapsule_IsValid(cap, kCapsule)) return false;
  auto* m = static_cast<Managed*>(PyCapsule_GetPointer(cap, kCapsule));
  if (!m || m->dl_tensor.dtype.lanes != 1) return false;
  *out = m->dl_tensor.dtype;
  return true;
}

}  // namespace zerofast::load::dlpack
