// What the unpickler knew of each tensor it made, kept with a template's tree (reader.py's
// Template) so that the twin copier (twin.cpp) can make a file's tensors without asking the
// template's tensors their dtype, sizes, strides, offset and storage through Python: eight
// attribute calls and a storage object each, which made copying a 50k-placeholder ZeRO-3
// model-states file slower than reading it.
//
// A recipe holds what reading the file makes, whatever was done to the template's tensor since;
// the tensors are held (a reference each) so that no other object can take one's address.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "torch_kit.h"

namespace zerofast::load {

struct Recipe {
  int64_t entry_at;  // its storage's bytes: the entry's offset in the template's file, and size
  int64_t nbytes;
  const DtypeInfo* dtype;
  int64_t offset;  // the tensor's storage offset, in elements
  size_t ndim;
  size_t dims_at;  // its sizes, then its strides, in Recipes::dims_
};

class Recipes {
 public:
  void add(PyObject* tensor, Recipe r, const int64_t* size, const int64_t* stride) {
    r.dims_at = dims_.size();
    dims_.insert(dims_.end(), size, size + r.ndim);
    dims_.insert(dims_.end(), stride, stride + r.ndim);
    Py_INCREF(tensor);
    held_.push_back(pybind11::reinterpret_steal<pybind11::object>(tensor));
    recipes_.push_back(r);
  }

  // The recipe of `tensor`, or null for one the unpickler did not make. The index is built at
  // the first lookup: a template no twin copies never pays for it.
  const Recipe* find(PyObject* tensor) {
    if (index_.empty() && !held_.empty()) {
      index_.reserve(held_.size());
      for (size_t i = 0; i < held_.size(); ++i) index_.emplace(held_[i].ptr(), i);
    }
    auto found = index_.find(tensor);
    return found == index_.end() ? nullptr : &recipes_[found->second];
  }

  const int64_t* sizes(const Recipe& r) const { return dims_.data() + r.dims_at; }
  const int64_t* strides(const Recipe& r) const { return dims_.data() + r.dims_at + r.ndim; }

 private:
  std::vector<pybind11::object> held_;
  std::vector<Recipe> recipes_;
  std::vector<int64_t> dims_;
  std::unordered_map<PyObject*, size_t> index_;
};

}  // namespace zerofast::load
