// Argument checks shared by every device's gather_cast kernel. Messages name the argument,
// because the caller is Python code that built a plan, and the plan is what is wrong.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <c10/util/Exception.h>

#include <vector>

namespace zerofast {

inline bool is_castable_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

inline void check_gather_cast_tensors(const std::vector<at::Tensor>& sources, const at::Tensor& out) {
  TORCH_CHECK(out.is_contiguous(), "gather_cast: `out` must be contiguous");
  for (size_t i = 0; i < sources.size(); ++i) {
    const auto& s = sources[i];
    TORCH_CHECK(s.is_contiguous(), "gather_cast: `sources[", i, "]` must be contiguous");
    TORCH_CHECK(s.device() == out.device() || s.device().is_cpu(), "gather_cast: `sources[", i,
                "]` is on ", s.device(), " but `out` is on ", out.device());
    TORCH_CHECK(s.scalar_type() == out.scalar_type() ||
                    (is_castable_float(s.scalar_type()) && is_castable_float(out.scalar_type())),
                "gather_cast: cannot cast `sources[", i, "]` of dtype ", s.scalar_type(), " to `out` dtype ",
                out.scalar_type(), "; only float64/float32/float16/bfloat16 are cast, other dtypes must match");
  }
}

// One row of a plan (source index, source offset, output offset, length): the source exists and
// both ranges fit. `op` names the call in the message, and `out_index` the output (-1: `out`).
// TORCH_CHECK builds its message only on failure, so the check costs no allocation per row.
inline void check_segment_row(const char* op, int64_t i, const std::vector<at::Tensor>& sources, int64_t src,
                              int64_t src_off, int64_t dst_off, int64_t len, int64_t out_numel,
                              int64_t out_index = -1) {
  const auto nsrc = static_cast<int64_t>(sources.size());
  TORCH_CHECK(src >= 0 && src < nsrc, op, ": `segments[", i, "]` names source ", src, " but there are ", nsrc,
              " sources");
  TORCH_CHECK(src_off >= 0 && dst_off >= 0 && len >= 0, op, ": `segments[", i, "]` has a negative offset or length");
  TORCH_CHECK(len <= sources[src].numel() - src_off, op, ": `segments[", i, "]` reads [", src_off, ", ", src_off,
              "+", len, ") past the end of `sources[", src, "]` (numel ", sources[src].numel(), ")");
  TORCH_CHECK(len <= out_numel - dst_off, op, ": `segments[", i, "]` writes [", dst_off, ", ", dst_off, "+", len,
              ") past the end of ", out_index < 0 ? std::string("`out`") : "output " + std::to_string(out_index),
              " (numel ", out_numel, ")");
}

// Every range is checked before any byte moves, so a bad plan fails without touching `out`.
inline void check_gather_cast_segments(const std::vector<at::Tensor>& sources, const at::Tensor& segments,
                                       const at::Tensor& out) {
  TORCH_CHECK(segments.device().is_cpu() && segments.scalar_type() == at::kLong && segments.dim() == 2 &&
                  segments.size(1) == 4 && segments.is_contiguous(),
              "gather_cast: `segments` must be a contiguous CPU int64 tensor of shape [N, 4], got ",
              segments.scalar_type(), " ", segments.sizes(), " on ", segments.device());
  const int64_t* seg = segments.const_data_ptr<int64_t>();
  const int64_t out_numel = out.numel();
  for (int64_t i = 0; i < segments.size(0); ++i) {
    const int64_t* r = seg + 4 * i;
    check_segment_row("gather_cast", i, sources, r[0], r[1], r[2], r[3], out_numel);
  }
}

inline void check_gather_cast_args(const std::vector<at::Tensor>& sources, const at::Tensor& segments,
                                   const at::Tensor& out) {
  check_gather_cast_tensors(sources, out);
  check_gather_cast_segments(sources, segments, out);
}

}  // namespace zerofast
