// The one cast the CPU kernels use, shared by gather_cast, read_cast and check_ranges.
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/macros.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <cstdint>

namespace zerofast::cpu {

// Casts go through ATen's own copy kernel on borrowed memory: Tensor.to is defined by that
// kernel, including how each CPU's vector units round and which NaN they emit, so anything
// hand-written here could only drift from it. The stable ABI reaches it as from_blob + copy_.
inline void cast_piece(const char* src, c10::ScalarType src_dtype, char* dst, c10::ScalarType dst_dtype, int64_t n) {
  const torch::stable::Device cpu(c10::DeviceType::CPU);
  const int64_t size[1] = {n}, stride[1] = {1};
  const torch::stable::Tensor s =
      torch::stable::from_blob(const_cast<char*>(src), {size, 1}, {stride, 1}, cpu, src_dtype);
  const torch::stable::Tensor d = torch::stable::from_blob(dst, {size, 1}, {stride, 1}, cpu, dst_dtype);
  // The shim's copy_ calls the op directly; torch::stable::copy_ finds it by name and boxes its
  // arguments on every call: 0.4 us more per tiny gather_cast with a cast (4.7 us against 4.3).
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_copy_(d.get(), s.get(), /*non_blocking=*/0));
}

// Bytes per element of `dtype`. The stable ABI has no table of element sizes but gives a tensor's,
// so it is asked of an empty tensor: one call per batch, and torch stays the only table.
inline int64_t element_size(c10::ScalarType dtype) {
  const int64_t none[1] = {0};
  return static_cast<int64_t>(
      torch::stable::empty({none, 1}, dtype, std::nullopt, torch::stable::Device(c10::DeviceType::CPU)).element_size());
}

}  // namespace zerofast::cpu
