// Argument checks shared by every device's gather_cast kernel. Messages name the argument,
// because the caller is Python code that built a plan, and the plan is what is wrong.
//
// Written once for both tensor APIs: the CPU kernels hold torch::stable::Tensor (torch's stable
// ABI), the CUDA kernel at::Tensor. Everything used here (is_contiguous, scalar_type, numel,
// device().type()/index(), sizes, const_data_ptr<int64_t>) has the same name and meaning in both.
#pragma once

#include <torch/headeronly/core/DeviceType.h>
#include <torch/headeronly/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <vector>

#include "check.h"

namespace zerofast {

inline bool is_castable_float(c10::ScalarType t) {
  using c10::ScalarType;
  return t == ScalarType::Float || t == ScalarType::Double || t == ScalarType::Half || t == ScalarType::BFloat16;
}

template <typename Device>
bool is_cpu(const Device& device) {
  return device.type() == c10::DeviceType::CPU;
}

// A segment table: a contiguous CPU int64 tensor of `cols` columns.
template <typename Tensor>
bool is_row_table(const Tensor& t, int64_t cols) {
  return is_cpu(t.device()) && t.scalar_type() == c10::ScalarType::Long && t.dim() == 2 && t.size(1) == cols &&
         t.is_contiguous();
}

template <typename Tensor>
void check_gather_cast_tensors(const std::vector<Tensor>& sources, const Tensor& out) {
  ZF_CHECK(out.is_contiguous(), "gather_cast: `out` must be contiguous");
  for (size_t i = 0; i < sources.size(); ++i) {
    const auto& s = sources[i];
    ZF_CHECK(s.is_contiguous(), "gather_cast: `sources[", i, "]` must be contiguous");
    ZF_CHECK(s.device() == out.device() || is_cpu(s.device()), "gather_cast: `sources[", i, "]` is on ",
             device_text(s.device()), " but `out` is on ", device_text(out.device()));
    ZF_CHECK(s.scalar_type() == out.scalar_type() ||
                 (is_castable_float(s.scalar_type()) && is_castable_float(out.scalar_type())),
             "gather_cast: cannot cast `sources[", i, "]` of dtype ", s.scalar_type(), " to `out` dtype ",
             out.scalar_type(), "; only float64/float32/float16/bfloat16 are cast, other dtypes must match");
  }
}

// One row of a plan (source index, source offset, output offset, length): the source exists and
// both ranges fit. `source_numel[k]` is source k's element count, asked of torch once per call
// rather than per row (with the stable ABI each ask is a call into libtorch). `op` names the call
// in the message, and `out_index` the output (-1: `out`). ZF_CHECK builds its message only on
// failure, so the check costs no allocation per row.
inline void check_segment_row(const char* op, int64_t i, const std::vector<int64_t>& source_numel, int64_t src,
                              int64_t src_off, int64_t dst_off, int64_t len, int64_t out_numel,
                              int64_t out_index = -1) {
  const auto nsrc = static_cast<int64_t>(source_numel.size());
  ZF_CHECK(src >= 0 && src < nsrc, op, ": `segments[", i, "]` names source ", src, " but there are ", nsrc,
           " sources");
  ZF_CHECK(src_off >= 0 && dst_off >= 0 && len >= 0, op, ": `segments[", i, "]` has a negative offset or length");
  ZF_CHECK(len <= source_numel[src] - src_off, op, ": `segments[", i, "]` reads [", src_off, ", ", src_off, "+",
           len, ") past the end of `sources[", src, "]` (numel ", source_numel[src], ")");
  ZF_CHECK(len <= out_numel - dst_off, op, ": `segments[", i, "]` writes [", dst_off, ", ", dst_off, "+", len,
           ") past the end of ", out_index < 0 ? std::string("`out`") : "output " + std::to_string(out_index),
           " (numel ", out_numel, ")");
}

template <typename Tensor>
std::vector<int64_t> numels_of(const std::vector<Tensor>& tensors) {
  std::vector<int64_t> numel;
  numel.reserve(tensors.size());
  for (const auto& t : tensors) numel.push_back(t.numel());
  return numel;
}

// The message of a segment table that is not `is_row_table`.
template <typename Tensor>
void check_row_table(const char* op, const Tensor& segments, int64_t cols) {
  ZF_CHECK(is_row_table(segments, cols), op, ": `segments` must be a contiguous CPU int64 tensor of shape [N, ", cols,
           "], got ", segments.scalar_type(), " ", sizes_text(segments.sizes()), " on ",
           device_text(segments.device()));
}

// Every range is checked before any byte moves, so a bad plan fails without touching `out`.
template <typename Tensor>
void check_gather_cast_segments(const std::vector<Tensor>& sources, const Tensor& segments, const Tensor& out) {
  check_row_table("gather_cast", segments, 4);
  const int64_t* seg = segments.template const_data_ptr<int64_t>();
  const int64_t out_numel = out.numel();
  const auto source_numel = numels_of(sources);
  const int64_t nrows = segments.size(0);  // for a stable Tensor a call into libtorch: ask once
  for (int64_t i = 0; i < nrows; ++i) {
    const int64_t* r = seg + 4 * i;
    check_segment_row("gather_cast", i, source_numel, r[0], r[1], r[2], r[3], out_numel);
  }
}

template <typename Tensor>
void check_gather_cast_args(const std::vector<Tensor>& sources, const Tensor& segments, const Tensor& out) {
  check_gather_cast_tensors(sources, out);
  check_gather_cast_segments(sources, segments, out);
}

}  // namespace zerofast
