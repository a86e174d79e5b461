// CPU kernel of zerofast::gather_cast: the executor's only data-moving op.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../gather_cast_checks.h"
#include "cast.h"
#include "../page_advice.h"

namespace zerofast {
namespace {

using cpu::cast_piece;
using torch::stable::Tensor;

// One entry per source, so the per-range loop does no dtype lookups.
struct SourceView {
  const char* base;
  int64_t itemsize;
  c10::ScalarType dtype;
};

std::vector<SourceView> source_views(const std::vector<Tensor>& sources) {
  std::vector<SourceView> views;
  views.reserve(sources.size());
  for (const auto& s : sources) {
    views.push_back({static_cast<const char*>(s.const_data_ptr()), static_cast<int64_t>(s.element_size()),
                     s.scalar_type()});
  }
  return views;
}

struct OutView {
  char* base;
  int64_t itemsize;
  c10::ScalarType dtype;
};

void copy_piece(const SourceView& v, int64_t src_off, const OutView& out, int64_t dst_off, int64_t n) {
  const char* src = v.base + src_off * v.itemsize;
  char* dst = out.base + dst_off * out.itemsize;
  if (v.dtype == out.dtype) {
    std::memcpy(dst, src, static_cast<size_t>(n * out.itemsize));
  } else {
    cast_piece(src, v.dtype, dst, out.dtype, n);
  }
}

void read_ahead(const std::vector<SourceView>& views, const int64_t* seg, int64_t nseg) {
  for (int64_t i = 0; i < nseg; ++i) {
    const SourceView& v = views[seg[4 * i]];
    advise(v.base + seg[4 * i + 1] * v.itemsize, seg[4 * i + 3] * v.itemsize, MADV_WILLNEED, false);
  }
}

// Work is split by element count, not by segment, so one huge tensor and many tiny ones
// both spread evenly over the threads.
constexpr int64_t kGrainElements = 1 << 18;

void gather_cast_cpu(const std::vector<Tensor>& sources, const Tensor& segments, const Tensor& out,
                     bool stream_sources) {
  // The dispatcher sends CPU tensors here, but a caller can pick the kernel itself (redispatch):
  // a tensor of another device has no host bytes to read or write.
  ZF_CHECK(is_cpu(out.device()), "gather_cast: `out` is on ", device_text(out.device()),
           "; the CPU kernel writes to host memory only");
  check_gather_cast_args(sources, segments, out);
  const int64_t nseg = segments.size(0);
  if (nseg == 0) return;
  const int64_t* seg = segments.const_data_ptr<int64_t>();
  std::vector<int64_t> ends(nseg);
  int64_t total = 0;
  for (int64_t i = 0; i < nseg; ++i) {
    total += seg[4 * i + 3];
    ends[i] = total;
  }
  const auto views = source_views(sources);
  const OutView out_view{static_cast<char*>(out.mutable_data_ptr()), static_cast<int64_t>(out.element_size()),
                         out.scalar_type()};
  if (stream_sources) read_ahead(views, seg, nseg);

  torch::stable::parallel_for(0, total, kGrainElements, [&](int64_t begin, int64_t end) {
    int64_t k = std::upper_bound(ends.begin(), ends.end(), begin) - ends.begin();
    while (begin < end) {
      const int64_t* s = seg + 4 * k;
      const int64_t seg_start = ends[k] - s[3];
      const int64_t skip = begin - seg_start;
      const int64_t n = std::min(end, ends[k]) - begin;
      if (n > 0) {
        const SourceView& v = views[s[0]];
        copy_piece(v, s[1] + skip, out_view, s[2] + skip, n);
        if (stream_sources) advise(v.base + (s[1] + skip) * v.itemsize, n * v.itemsize, MADV_DONTNEED, true);
      }
      begin += n;
      ++k;
    }
  });
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(zerofast, CPU, m) {
  m.impl("gather_cast", TORCH_BOX(&gather_cast_cpu));
}

}  // namespace zerofast
