// The one cast the CPU kernels use, shared by gather_cast and read_cast.
#pragma once

#include <ATen/Functions.h>
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace zerofast::cpu {

// Casts go through ATen's own copy kernel on borrowed memory: Tensor.to is defined by that
// kernel, including how each CPU's vector units round and which NaN they emit, so anything
// hand-written here could only drift from it.
inline void cast_piece(const char* src, at::ScalarType src_dtype, char* dst, at::ScalarType dst_dtype, int64_t n) {
  const auto cpu = at::TensorOptions().device(at::kCPU);
  at::Tensor s = at::from_blob(const_cast<char*>(src), {n}, cpu.dtype(src_dtype));
  at::Tensor d = at::from_blob(dst, {n}, cpu.dtype(dst_dtype));
  d.copy_(s);
}

}  // namespace zerofast::cpu
