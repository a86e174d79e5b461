// Tensors over storages that other tensors already hold, made many at a time: one call of the
// op zerofast::restrided (csrc/cpu/restrided.cpp) per batch, instead of a Tensor.new and a
// Tensor.set_ through Python apiece (about 1.4 us each, most of reading a file of 20k views of
// flat buffers). The unpickler and the twin copier collect a batch, make it, and then set the
// tensors where they go.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
#include <unordered_map>
#include <vector>

#include "py_own.h"
#include "torch_kit.h"

namespace zerofast::load {

constexpr size_t kMaxDims = 64;  // the readers' bound on a tensor's dimensions

// A tensor's sizes or strides: at most kMaxDims of them.
struct Dims {
  int64_t v[kMaxDims];
  size_t n = 0;
  size_t size() const { return n; }
  int64_t operator[](size_t i) const { return v[i]; }
};

// A 1-D tensor of `numel` elements over the whole of `storage`: the base the tensors sharing it
// are made from, holding the storage for them.
inline pybind11::object whole_storage_tensor(const DtypeInfo& dtype, PyObject* storage, int64_t numel) {
  pybind11::object n = own(PyLong_FromLongLong(numel), "int");
  pybind11::object sizes = own(PyTuple_Pack(1, n.ptr()), "tuple");
  pybind11::object strides = own(Py_BuildValue("(i)", 1), "tuple");
  return tensor_over(dtype.proto, storage, 0, sizes.ptr(), strides.ptr());
}

class RestrideBatch {
 public:
  // A tensor over `base`'s storage (borrowed: the caller keeps it alive until make()), checked
  // by the caller to lie inside it; `offset`, sizes and strides in elements of base's dtype.
  void add(PyObject* base, int64_t offset, size_t ndim, const int64_t* size, const int64_t* stride) {
    auto slot = slot_of_.try_emplace(base, int64_t(bases_.size()));
    if (slot.second) bases_.push_back(base);
    layout_.insert(layout_.end(), {slot.first->second, offset, int64_t(ndim)});
    layout_.insert(layout_.end(), size, size + ndim);
    layout_.insert(layout_.end(), stride, stride + ndim);
    ++count_;
  }

  size_t size() const { return count_; }

  // The tensors added since the last call, in order, as a Python list (empty when none).
  pybind11::object make() {
    const TorchKit& kit = bound_kit();
    pybind11::object bases = own(PyList_New(Py_ssize_t(bases_.size())), "list");
    for (size_t i = 0; i < bases_.size(); ++i) {
      Py_INCREF(bases_[i]);
      PyList_SET_ITEM(bases.ptr(), Py_ssize_t(i), bases_[i]);
    }
    pybind11::object n = own(PyLong_FromSize_t(layout_.size()), "int");
    pybind11::object layout = own(PyObject_CallOneArg(kit.empty_longs, n.ptr()), "layout");
    pybind11::object address = call_method(layout.ptr(), names().data_ptr);
    if (!layout_.empty())
      std::memcpy(reinterpret_cast<void*>(uintptr_t(int64_of(address.ptr(), "data_ptr"))), layout_.data(),
                  layout_.size() * sizeof(int64_t));
    PyObject* args[] = {bases.ptr(), layout.ptr()};
    pybind11::object made = own(PyObject_Vectorcall(kit.restrided, args, 2, nullptr), "restrided");
    if (!PyList_CheckExact(made.ptr()) || size_t(PyList_GET_SIZE(made.ptr())) != count_)
      throw Declined("restrided made other than one tensor per record");
    bases_.clear();
    slot_of_.clear();
    layout_.clear();
    count_ = 0;
    return made;
  }

 private:
  std::vector<PyObject*> bases_;
  std::unordered_map<PyObject*, int64_t> slot_of_;
  std::vector<int64_t> layout_;  // the records (see the op's schema in csrc/zerofast.cpp)
  size_t count_ = 0;
};

}  // namespace zerofast::load
