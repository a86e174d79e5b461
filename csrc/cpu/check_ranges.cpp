// CPU kernel of zerofast::check_ranges: the checks of `zerofast verify` and `diff` in one pass
// over the checkpoint files, without materializing a tensor.
//
// Each tensor is cut into items of a few hundred KiB. A reader thread preads an item's source
// elements into its own bounce buffers, counts NaN, infinities and non-zero elements on them while
// they are in cache, casts them (ATen's copy kernel, as Tensor.to does) and compares them with the
// other side's item. Per-item results are reduced per chunk of each tensor at the end, with the
// semantics of the pure-torch reference (zerofast/reference.py) for every NaN, infinity, signed
// zero and subnormal: the Python checks fold these per-chunk figures exactly as they folded the
// ones torch computed over each chunk before.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <mutex>
#include <thread>
#include <tuple>
#include <utility>
#include <type_traits>
#include <vector>

#include "cast.h"
#include "file_read.h"

namespace zerofast {
namespace {

using cpu::cast_piece;
using cpu::IntList;
using cpu::Tensor;
using c10::ScalarType;
using cpu::pread_all;
using cpu::reader_threads;
using cpu::run_workers;
using cpu::Source;

// A row of `segments`: (tensor, side, source, source offset, tensor offset, length), in elements.
constexpr int kCols = 6;
// Elements per item: 256 KiB of fp32 per side, so both sides and the bounce buffer stay in L2.
constexpr int64_t kItemElems = 1 << 16;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
// The most chunks a call may ask for: 2^36 rows of counts are 2.75 TB, past any real checkpoint.
constexpr int64_t kMaxChunks = int64_t{1} << 36;

// Chunks of a tensor of `n` elements (one, empty, for an empty tensor), without overflow.
int64_t chunks_of(int64_t n, int64_t chunk) { return std::max<int64_t>(1, n / chunk + (n % chunk != 0)); }

bool supported(ScalarType t) {
  switch (t) {
    case ScalarType::Double: case ScalarType::Float: case ScalarType::Half: case ScalarType::BFloat16:
    case ScalarType::Long: case ScalarType::Int:
    case ScalarType::Short: case ScalarType::Char: case ScalarType::Byte: case ScalarType::Bool:
      return true;
    default:
      return false;
  }
}

struct Piece {
  int64_t src, src_off, dst_off, len;
};

struct CheckItem {
  int64_t tensor, lo, n;
};

// What one item found; reduced per chunk afterwards.
struct Part {
  int64_t nan = 0, inf = 0, nonzero = 0, changed = 0;
  bool differs = false, abs_nan = false, rel_nan = false;
  double max_abs = 0, max_rel = 0;
};

// NaN, infinity and non-zero counts of `n` floats given as bits, S the signed integer of their
// width: the magnitude bits (sign dropped, so a non-negative S) are above those of infinity
// exactly for a NaN. Blocks count specials and zeros in counters of the element's width, which
// the compiler vectorizes with plain SSE2; the rare block holding a special is counted again to
// tell NaN from infinity. (Measured 2x faster than three 64-bit counters per element.)
template <typename S>
void count_float(const char* p, int64_t n, S magnitude, S inf_bits, Part& r) {
  using U = std::make_unsigned_t<S>;
  constexpr int64_t kBlock = 8192;  // fits a 16-bit counter
  const S* v = reinterpret_cast<const S*>(p);
  for (int64_t lo = 0; lo < n; lo += kBlock) {
    const int64_t hi = std::min(n, lo + kBlock);
    U special = 0, zero = 0;
    for (int64_t i = lo; i < hi; ++i) {
      const S a = static_cast<S>(v[i] & magnitude);
      special += static_cast<U>(a >= inf_bits);
      zero += static_cast<U>(a == 0);
    }
    r.nonzero += (hi - lo) - static_cast<int64_t>(zero);
    if (special == 0) continue;
    for (int64_t i = lo; i < hi; ++i) {
      const S a = static_cast<S>(v[i] & magnitude);
      r.nan += a > inf_bits;
      r.inf += a == inf_bits;
    }
  }
}

template <typename U>
void count_nonzero(const char* p, int64_t n, Part& r) {
  const U* v = reinterpret_cast<const U*>(p);
  int64_t nz = 0;
  for (int64_t i = 0; i < n; ++i) nz += v[i] != 0;
  r.nonzero += nz;
}

void count(const char* p, ScalarType t, int64_t n, Part& r) {
  switch (t) {
    case ScalarType::Float: count_float<int32_t>(p, n, 0x7FFFFFFF, 0x7F800000, r); break;
    case ScalarType::Double: count_float<int64_t>(p, n, 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000, r); break;
    case ScalarType::BFloat16: count_float<int16_t>(p, n, 0x7FFF, 0x7F80, r); break;
    case ScalarType::Half: count_float<int16_t>(p, n, 0x7FFF, 0x7C00, r); break;
    case ScalarType::Long: count_nonzero<uint64_t>(p, n, r); break;
    case ScalarType::Int: count_nonzero<uint32_t>(p, n, r); break;
    case ScalarType::Short: count_nonzero<uint16_t>(p, n, r); break;
    default: count_nonzero<uint8_t>(p, n, r); break;  // int8, uint8, bool
  }
}

// Element i of a buffer of dtype t, as float64 (exact for every float and bool, round to
// nearest for large integers, as Tensor.to(torch.float64) gives).
double value(const char* p, ScalarType t, int64_t i) {
  switch (t) {
    case ScalarType::Float: return reinterpret_cast<const float*>(p)[i];
    case ScalarType::Double: return reinterpret_cast<const double*>(p)[i];
    case ScalarType::BFloat16: return static_cast<float>(reinterpret_cast<const c10::BFloat16*>(p)[i]);
    case ScalarType::Half: return static_cast<float>(reinterpret_cast<const c10::Half*>(p)[i]);
    case ScalarType::Long: return static_cast<double>(reinterpret_cast<const int64_t*>(p)[i]);
    case ScalarType::Int: return reinterpret_cast<const int32_t*>(p)[i];
    case ScalarType::Short: return reinterpret_cast<const int16_t*>(p)[i];
    case ScalarType::Char: return reinterpret_cast<const int8_t*>(p)[i];
    case ScalarType::Bool: return reinterpret_cast<const uint8_t*>(p)[i] != 0;
    default: return reinterpret_cast<const uint8_t*>(p)[i];
  }
}

// The value comparison of two items whose bytes differ: elements count as changed unless equal
// or both NaN; |x - y| and |x - y| / max(|x|, DBL_MIN) are maximized over the changed ones, a
// NaN anywhere making the maximum NaN. (An unchanged element adds 0, or NaN to the relative
// maximum where x is NaN: that is the chunk's NaN count, applied at the reduction.)
void compare(const char* a, const char* b, ScalarType t, int64_t n, Part& r) {
  r.differs = true;
  for (int64_t i = 0; i < n; ++i) {
    const double x = value(a, t, i), y = value(b, t, i);
    if (x == y || (std::isnan(x) && std::isnan(y))) continue;
    ++r.changed;
    const double gap = std::fabs(x - y);
    const double ax = std::fabs(x);
    const double rel = gap / (std::isnan(ax) ? ax : std::max(ax, DBL_MIN));
    if (std::isnan(gap)) r.abs_nan = true; else r.max_abs = std::max(r.max_abs, gap);
    if (std::isnan(rel)) r.rel_nan = true; else r.max_rel = std::max(r.max_rel, rel);
  }
}

Tensor zeros(int64_t rows, int64_t cols, ScalarType dtype) {
  const int64_t size[2] = {rows, cols};
  Tensor t = torch::stable::empty({size, 2}, dtype, std::nullopt, torch::stable::Device(c10::DeviceType::CPU));
  torch::stable::zero_(t);
  return t;
}

class Checks {
 public:
  Checks(std::vector<Source> sources, std::vector<int64_t> numels, std::vector<std::vector<Piece>> pieces[2],
         ScalarType dtype, bool compare, int64_t chunk, int64_t readers)
      : sources_(std::move(sources)), numels_(std::move(numels)), dtype_(dtype), compare_(compare),
        chunk_(chunk), readers_(readers) {
    pieces_[0] = std::move(pieces[0]);
    pieces_[1] = std::move(pieces[1]);
    out_size_ = static_cast<int64_t>(cpu::element_size(dtype));
    for (size_t t = 0; t < numels_.size(); ++t) {
      // Items cover what some row of either side covers: elsewhere both sides are zeros, which
      // add nothing, so the work follows the bytes read, not what `numels` claims. Items never
      // straddle a chunk, so each item's figures belong to one chunk.
      for (const auto& [lo, hi] : covered(pieces_[0][t], pieces_[1][t])) {
        for (int64_t x = lo; x < hi; x += items_.back().n) {
          items_.push_back({static_cast<int64_t>(t), x, std::min({kItemElems, chunk_ - x % chunk_, hi - x})});
        }
      }
    }
    parts_.resize(items_.size());
  }

  // The union of two sides' rows (each sorted by tensor offset, without overlaps) as [lo, hi) spans.
  static std::vector<std::pair<int64_t, int64_t>> covered(const std::vector<Piece>& a, const std::vector<Piece>& b) {
    std::vector<std::pair<int64_t, int64_t>> spans;
    size_t i = 0, j = 0;
    while (i < a.size() || j < b.size()) {
      const Piece& p = j == b.size() || (i < a.size() && a[i].dst_off <= b[j].dst_off) ? a[i++] : b[j++];
      if (!spans.empty() && p.dst_off <= spans.back().second) {
        spans.back().second = std::max(spans.back().second, p.dst_off + p.len);
      } else {
        spans.emplace_back(p.dst_off, p.dst_off + p.len);
      }
    }
    return spans;
  }

  std::tuple<Tensor, Tensor> run() {
    run_workers(reader_threads(items_.size(), readers_), [this] { worker(); });
    if (error_) std::rethrow_exception(error_);
    return reduce();
  }

 private:
  void worker() {
    std::vector<char> in, out[2];
    try {
      for (size_t i = next_.fetch_add(1); i < items_.size() && !failed_.load(); i = next_.fetch_add(1)) {
        check(items_[i], parts_[i], in, out);
      }
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error_) error_ = std::current_exception();
      failed_.store(true);
    }
  }

  void check(const CheckItem& it, Part& r, std::vector<char>& in, std::vector<char>* out) {
    for (int side = 0; side < (compare_ ? 2 : 1); ++side) {
      out[side].resize(static_cast<size_t>(kItemElems * out_size_));
      gather(it, side, r, in, out[side].data());
    }
    if (compare_ && std::memcmp(out[0].data(), out[1].data(), static_cast<size_t>(it.n * out_size_)) != 0) {
      compare(out[0].data(), out[1].data(), dtype_, it.n, r);
    }
  }

  // The item's elements of one side into `to` (zeros where no row covers them), cast to the
  // checked dtype when comparing; side 0's source elements counted on the way.
  void gather(const CheckItem& it, int side, Part& r, std::vector<char>& in, char* to) {
    const auto& rows = pieces_[side][it.tensor];
    const int64_t hi = it.lo + it.n;
    // Rows are sorted by tensor offset and do not overlap: the first that ends past `lo`.
    auto p = std::upper_bound(rows.begin(), rows.end(), it.lo,
                              [](int64_t lo, const Piece& q) { return lo < q.dst_off + q.len; });
    int64_t covered = 0;
    for (auto q = p; q != rows.end() && q->dst_off < hi; ++q) {
      covered += std::min(hi, q->dst_off + q->len) - std::max(it.lo, q->dst_off);
    }
    if (compare_ && covered < it.n) std::memset(to, 0, static_cast<size_t>(it.n * out_size_));
    for (; p != rows.end() && p->dst_off < hi; ++p) {
      const int64_t a = std::max(it.lo, p->dst_off), n = std::min(hi, p->dst_off + p->len) - a;
      const Source& s = sources_[p->src];
      const int64_t byte = (p->src_off + a - p->dst_off) * s.itemsize;
      const bool direct = compare_ && s.dtype == dtype_;  // read straight into the compared buffer
      const char* from = s.mem + byte;
      if (s.fd >= 0 || direct) {
        char* buf = to + (a - it.lo) * out_size_;
        if (!direct) {
          in.resize(static_cast<size_t>(kItemElems * 8));
          buf = in.data();
        }
        if (s.fd >= 0) pread_all(s.fd, buf, n * s.itemsize, s.file_off + byte);
        else std::memcpy(buf, from, static_cast<size_t>(n * s.itemsize));
        from = buf;
      }
      if (side == 0) count(from, s.dtype, n, r);
      if (compare_ && !direct) cast_piece(from, s.dtype, to + (a - it.lo) * out_size_, dtype_, n);
    }
  }

  // Per chunk of each tensor: counts (nan, inf, nonzero, differs, changed) and maxima (abs, rel).
  std::tuple<Tensor, Tensor> reduce() {
    int64_t nchunks = 0;
    std::vector<int64_t> first;
    for (int64_t n : numels_) {
      first.push_back(nchunks);
      nchunks += chunks_of(n, chunk_);
    }
    Tensor counts = zeros(nchunks, 5, ScalarType::Long);
    Tensor maxima = zeros(nchunks, 2, ScalarType::Double);
    std::vector<Part> chunk(static_cast<size_t>(nchunks));
    for (size_t i = 0; i < items_.size(); ++i) {
      Part& c = chunk[first[items_[i].tensor] + items_[i].lo / chunk_];
      const Part& p = parts_[i];
      c.nan += p.nan; c.inf += p.inf; c.nonzero += p.nonzero; c.changed += p.changed;
      c.differs |= p.differs; c.abs_nan |= p.abs_nan; c.rel_nan |= p.rel_nan;
      c.max_abs = std::max(c.max_abs, p.max_abs);
      c.max_rel = std::max(c.max_rel, p.max_rel);
    }
    int64_t* k = counts.mutable_data_ptr<int64_t>();
    double* m = maxima.mutable_data_ptr<double>();
    for (int64_t c = 0; c < nchunks; ++c) {
      const Part& p = chunk[c];
      k[5 * c] = p.nan; k[5 * c + 1] = p.inf; k[5 * c + 2] = p.nonzero;
      k[5 * c + 3] = p.differs; k[5 * c + 4] = p.changed;
      if (p.differs) {
        m[2 * c] = p.abs_nan ? kNaN : p.max_abs;
        m[2 * c + 1] = p.rel_nan || p.nan > 0 ? kNaN : p.max_rel;
      }
    }
    return {counts, maxima};
  }

  std::vector<Source> sources_;
  std::vector<int64_t> numels_;
  std::vector<std::vector<Piece>> pieces_[2];
  ScalarType dtype_;
  bool compare_;
  int64_t chunk_, readers_, out_size_ = 0;
  std::vector<CheckItem> items_;
  std::vector<Part> parts_;
  std::atomic<size_t> next_{0};
  std::atomic<bool> failed_{false};
  std::mutex mutex_;
  std::exception_ptr error_;
};

std::vector<Source> make_sources(const std::vector<Tensor>& sources, IntList fds,
                                 const Tensor& offsets, ScalarType dtype, bool compare) {
  auto out = cpu::make_sources("check_ranges", sources, fds, offsets, /*strided_files=*/true);
  for (size_t i = 0; i < sources.size(); ++i) {
    ZF_CHECK(supported(sources[i].scalar_type()) && (!compare || supported(dtype)), "check_ranges: `sources[", i,
             "]` is ", sources[i].scalar_type(), " and the checked dtype ", dtype,
             "; only float64/32/16, bfloat16, integers and bool are checked");
  }
  return out;
}

// Every row checked, sorted and checked for overlaps before a byte is read.
void make_pieces(const Tensor& segments, const std::vector<Tensor>& sources,
                 const std::vector<int64_t>& numels, bool compare, std::vector<std::vector<Piece>>* pieces) {
  check_row_table("check_ranges", segments, kCols);
  const auto ntensors = static_cast<int64_t>(numels.size());
  for (int side = 0; side < 2; ++side) pieces[side].assign(numels.size(), {});
  const int64_t* seg = segments.const_data_ptr<int64_t>();
  const auto nsrc = static_cast<int64_t>(sources.size());
  const auto source_numel = numels_of(sources);
  const int64_t nrows = segments.size(0);  // a call into libtorch: asked once, not per row
  for (int64_t i = 0; i < nrows; ++i) {
    const int64_t* r = seg + kCols * i;
    const int64_t t = r[0], side = r[1], src = r[2], src_off = r[3], dst_off = r[4], len = r[5];
    ZF_CHECK(t >= 0 && t < ntensors, "check_ranges: `segments[", i, "]` names tensor ", t, " of ", ntensors);
    ZF_CHECK(side == 0 || (side == 1 && compare), "check_ranges: `segments[", i, "]` names side ", side,
             compare ? "; sides are 0 and 1" : "; without `compare` there is only side 0");
    ZF_CHECK(src >= 0 && src < nsrc, "check_ranges: `segments[", i, "]` names source ", src, " of ", nsrc);
    ZF_CHECK(src_off >= 0 && dst_off >= 0 && len >= 0 && len <= source_numel[src] - src_off &&
                 len <= numels[t] - dst_off,
             "check_ranges: `segments[", i, "]` reaches outside `sources[", src, "]` or tensor ", t);
    if (len > 0) pieces[side][t].push_back({src, src_off, dst_off, len});
  }
  for (int side = 0; side < 2; ++side) {
    for (int64_t t = 0; t < ntensors; ++t) {
      auto& rows = pieces[side][t];
      std::sort(rows.begin(), rows.end(), [](const Piece& a, const Piece& b) { return a.dst_off < b.dst_off; });
      for (size_t j = 1; j < rows.size(); ++j) {
        ZF_CHECK(rows[j].dst_off >= rows[j - 1].dst_off + rows[j - 1].len, "check_ranges: `segments`: rows of tensor ",
                 t, " side ", side, " overlap at element ", rows[j].dst_off);
      }
    }
  }
}

std::tuple<Tensor, Tensor> check_ranges_cpu(const std::vector<Tensor>& sources,
                                                    IntList source_fds, const Tensor& source_offsets,
                                                    const Tensor& segments, const Tensor& numels,
                                                    ScalarType dtype, bool compare, int64_t chunk,
                                                    int64_t readers) {
  ZF_CHECK(chunk > 0, "check_ranges: `chunk` must be positive, got ", chunk);
  ZF_CHECK(is_cpu(numels.device()) && numels.scalar_type() == ScalarType::Long && numels.dim() == 1 &&
               numels.is_contiguous(),
           "check_ranges: `numels` must be a contiguous CPU int64 tensor of shape [T], got ", numels.scalar_type(),
           " ", sizes_text(numels.sizes()), " on ", device_text(numels.device()));
  const int64_t* nptr = numels.const_data_ptr<int64_t>();
  std::vector<int64_t> sizes(nptr, nptr + numels.size(0));
  int64_t nchunks = 0;
  for (size_t t = 0; t < sizes.size(); ++t) {
    ZF_CHECK(sizes[t] >= 0, "check_ranges: `numels[", t, "]` is negative");
    const int64_t more = chunks_of(sizes[t], chunk);
    ZF_CHECK(more <= kMaxChunks - nchunks, "check_ranges: `numels` and `chunk` = ", chunk, " make more than ", kMaxChunks,
             " chunks (at `numels[", t, "]` = ", sizes[t], ")");
    nchunks += more;
  }
  auto srcs = make_sources(sources, source_fds, source_offsets, dtype, compare);
  std::vector<std::vector<Piece>> pieces[2];
  make_pieces(segments, sources, sizes, compare, pieces);
  return Checks(std::move(srcs), std::move(sizes), pieces, dtype, compare, chunk, readers).run();
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(zerofast, CPU, m) {
  m.impl("check_ranges", TORCH_BOX(&check_ranges_cpu));
}

}  // namespace zerofast
