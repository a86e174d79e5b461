// CPU kernel of zerofast::restrided: the tensors of a torch.save file that share a storage, made
// in one call (csrc/load/unpickle.cpp batches them). The readers include no torch header, so
// without this op each tensor would cost a Tensor.new and a Tensor.set_ through Python; here each
// is one TensorImpl over its base's storage, as set_ makes it (no autograd view, no copy).
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <cstdint>
#include <vector>

#include "../check.h"
#include "handles.h"

namespace zerofast {
namespace {

using torch::stable::Tensor;

constexpr int64_t kMaxDims = 64;  // as the readers' own limit (csrc/load/unpickle.cpp)

// The element one past the furthest a tensor of these sizes and strides reaches from `offset`
// (0 when it is empty), saturating past int64: the check below only compares it.
__int128 extent(int64_t offset, const int64_t* size, const int64_t* stride, int64_t ndim) {
  __int128 end = __int128(offset) + 1;
  for (int64_t d = 0; d < ndim; ++d) {
    if (size[d] == 0) return 0;
    end += __int128(size[d] - 1) * stride[d];
    if (end > (__int128(1) << 100)) return end;
  }
  return end;
}

// What each record needs of its base, asked of torch once per base rather than per record.
struct Base {
  AtenTensorHandle handle;
  int64_t capacity;  // its storage, in its elements
  int64_t offset;    // its own storage offset: the shim's offset counts from it
};

// The tensor of one record of `layout`, (base, storage offset, ndim, sizes..., strides...) in
// elements: a new owning handle.
AtenTensorHandle one(const std::vector<Base>& bases, const int64_t* r, int64_t left, int64_t at) {
  ZF_CHECK(left >= 3, "restrided: `layout` ends inside the record at ", at);
  const int64_t base = r[0], offset = r[1], ndim = r[2];
  ZF_CHECK(base >= 0 && base < int64_t(bases.size()), "restrided: the record at ", at, " names base ", base,
           " of ", bases.size());
  ZF_CHECK(ndim >= 0 && ndim <= kMaxDims && left >= 3 + 2 * ndim, "restrided: the record at ", at,
           " has ", ndim, " dimensions, past `layout`'s end or more than ", kMaxDims);
  const int64_t* size = r + 3;
  const int64_t* stride = size + ndim;
  bool plain = offset >= 0;
  for (int64_t d = 0; d < ndim; ++d) plain = plain && size[d] >= 0 && stride[d] >= 0;
  ZF_CHECK(plain, "restrided: the record at ", at, " has a negative offset, size or stride");
  const Base& b = bases[size_t(base)];
  ZF_CHECK(extent(offset, size, stride, ndim) <= b.capacity, "restrided: the record at ", at, " reaches past base ",
           base, "'s storage");
  AtenTensorHandle made = nullptr;
  ZF_CHECK(aoti_torch__reinterpret_tensor(b.handle, ndim, size, stride, offset - b.offset, &made) == AOTI_TORCH_SUCCESS,
           "restrided: torch could not make the tensor of the record at ", at);
  return made;
}

// Boxed by hand (handles.h).
void restrided_boxed(StableIValue* stack, uint64_t num_args, uint64_t num_outputs) {
  ZF_CHECK(num_args == 2 && num_outputs == 1, "restrided: expected the schema's 2 arguments and 1 output");
  const auto bases = torch::stable::detail::to<std::vector<Tensor>>(stack[0]);
  const auto layout = torch::stable::detail::to<Tensor>(stack[1]);
  ZF_CHECK(layout.scalar_type() == c10::ScalarType::Long && layout.dim() == 1 && layout.is_contiguous(),
           "restrided: `layout` must be a contiguous 1-D int64 tensor");
  std::vector<Base> described;
  for (size_t i = 0; i < bases.size(); ++i) {
    int64_t bytes = 0, offset = 0;
    ZF_CHECK(aoti_torch_get_storage_size(bases[i].get(), &bytes) == AOTI_TORCH_SUCCESS &&
                 aoti_torch_get_storage_offset(bases[i].get(), &offset) == AOTI_TORCH_SUCCESS,
             "restrided: `bases[", i, "]` has no storage");
    described.push_back({bases[i].get(), bytes / int64_t(bases[i].element_size()), offset});
  }
  const int64_t* r = layout.const_data_ptr<int64_t>();
  const int64_t n = layout.numel();
  cpu::OwnedHandles made;
  for (int64_t at = 0; at < n; at += 3 + 2 * r[at + 2]) made.add(one(described, r + at, n - at, at));
  stack[0] = made.release_as_list("restrided");
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(zerofast, CPU, m) {
  m.impl("restrided", &restrided_boxed);
}

}  // namespace zerofast
