// Tensors an op makes and returns as a Tensor[], without torch::stable::Tensor on the way out.
//
// TORCH_BOX returns a std::vector<torch::stable::Tensor> by copying each into a new handle for
// the list, after which the vector drops its own: per output a shared_ptr block and a handle
// made and freed for nothing, a third of zerofast::restrided's time at 20k outputs. An op that
// returns many tensors boxes its result by hand instead: it keeps the handles it made here, and
// hands them to the list as they are.
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/c/shim.h>
#include <torch/csrc/stable/stableivalue_conversions.h>

#include <vector>

#include "../check.h"

namespace zerofast::cpu {

class OwnedHandles {
 public:
  OwnedHandles() = default;
  OwnedHandles(const OwnedHandles&) = delete;
  OwnedHandles& operator=(const OwnedHandles&) = delete;
  // A StableList holds its items as plain words: deleting one would not delete them, so the
  // handles stay this object's until the list is made, and are deleted here on any failure.
  ~OwnedHandles() {
    for (AtenTensorHandle t : handles_) aoti_torch_delete_tensor_object(t);
  }

  void reserve(size_t n) { handles_.reserve(n); }
  void add(AtenTensorHandle t) { handles_.push_back(t); }  // owned from now on
  size_t size() const { return handles_.size(); }
  AtenTensorHandle operator[](size_t i) const { return handles_[i]; }

  // The Tensor[] output, owning every handle (the caller's once it is on the stack).
  StableIValue release_as_list(const char* op) {
    StableListHandle list = nullptr;
    ZF_CHECK(torch_new_list_reserve_size(handles_.size(), &list) == AOTI_TORCH_SUCCESS, op,
             ": torch could not make a list");
    for (AtenTensorHandle t : handles_) torch_list_push_back(list, torch::stable::detail::from(t));  // reserved: no failure
    handles_.clear();
    return torch::stable::detail::from(list);
  }

 private:
  std::vector<AtenTensorHandle> handles_;
};

}  // namespace zerofast::cpu
