// CPU kernels of zerofast::read_cast and zerofast::read_cast_to_file: a whole batch of output
// tensors gathered from checkpoint files with pread on a pool of reader threads.
//
// Why not the mapped sources: copying out of a file mapping takes a page fault per few pages of
// input, and dropping those pages again (madvise) costs TLB shootdowns across the threads. pread
// copies from the page cache with neither, straight into the output when the dtypes match, and a
// cold read keeps one request in flight per reader thread. Casts go through a small per-thread
// bounce buffer and ATen's own copy kernel (see cast_piece), so they stay Tensor.to bit for bit.
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/macros.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../gather_cast_checks.h"
#include "cast.h"
#include "handles.h"
#include "file_read.h"

namespace zerofast {
namespace {

using cpu::cast_piece;
using cpu::IntList;
using cpu::Tensor;
using cpu::io_error;
using cpu::pread_all;
using cpu::reader_threads;
using cpu::run_workers;
using cpu::Source;

// One row of `segments`: (out index, source index, source offset, output offset, length), in
// elements of the source and of the output.
constexpr int kRow = 5;

struct Dest {
  char* mem;        // null when writing to a file
  int64_t file_off;
  int64_t itemsize;
  c10::ScalarType dtype;
};

// A piece of one segment small enough for one bounce buffer. Items are sorted by where they
// read, so each file is read front to back whichever thread takes the next item.
// 32 bytes: a ZeRO-3 batch of 200k small tensors over 4 ranks has 800k of them at once.
struct ReadItem {
  int64_t seg;
  int64_t skip;  // elements into the segment
  int64_t at;    // where it reads: a byte offset in its file, or its address in memory
  int32_t n;     // elements, at most kItemBytes (one byte each, at the least)
  int fd;        // its source's file, -1 for memory
};
static_assert(sizeof(ReadItem) == 32, "ReadItem is packed to 32 bytes");

// Source elements per item: 1 MiB of fp32. Below ATen's grain size (32768) per cast call, a
// copy_ never starts its own threads inside a reader thread.
constexpr int64_t kItemBytes = 1 << 20;
static_assert(kItemBytes <= INT32_MAX, "an item's element count must fit ReadItem::n");
constexpr int64_t kCastElems = 32768;
// An item joins a run of reads only when it is this small: larger ones are read straight into
// their output, which saves the copy out of the bounce buffer.
constexpr int64_t kRunItemBytes = 64 << 10;

void pwrite_all(int fd, const char* src, int64_t nbytes, int64_t offset) {
  while (nbytes > 0) {
    const ssize_t put = ::pwrite(fd, src, static_cast<size_t>(nbytes), offset);
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) io_error("write", put < 0 ? errno : EIO, offset, nbytes);
    src += put;
    offset += put;
    nbytes -= put;
  }
}

// In-kernel copy between the two files, no user-space buffer. False when the kernel or the
// file systems cannot do it (nothing was written then), so the caller falls back to pread/pwrite.
bool copy_range(int in_fd, int64_t in_off, int out_fd, int64_t out_off, int64_t nbytes) {
  bool first = true;
  while (nbytes > 0) {
    loff_t in = in_off, out = out_off;
    const ssize_t done = ::copy_file_range(in_fd, &in, out_fd, &out, static_cast<size_t>(nbytes), 0);
    if (done < 0 && errno == EINTR) continue;
    if (done < 0 && first && (errno == EXDEV || errno == EINVAL || errno == ENOSYS || errno == EOPNOTSUPP ||
                              errno == EBADF)) {
      return false;
    }
    if (done < 0) io_error("copy_file_range", errno, out_off, nbytes);
    ZF_CHECK(done > 0, "zerofast: a checkpoint file ended at offset ", in_off,
             " while reading it: it was truncated after it was opened [errno ", EIO, "]");
    first = false;
    in_off += done;
    out_off += done;
    nbytes -= done;
  }
  return true;
}

class Batch {
 public:
  Batch(std::vector<Source> sources, std::vector<Dest> dests, const int64_t* seg, int64_t nseg, int out_fd,
        int64_t readers, bool copy_file_range)
      : sources_(std::move(sources)), dests_(std::move(dests)), seg_(seg), out_fd_(out_fd), readers_(readers) {
    copy_file_range_ = out_fd >= 0 && copy_file_range;
    split(nseg);
  }

  void run() {
    run_workers(reader_threads(runs_.size() - 1, readers_), [this] { worker(); });
    if (error_) std::rethrow_exception(error_);
  }

 private:
  const int64_t* row(int64_t seg) const { return seg_ + kRow * seg; }

  void split(int64_t nseg) {
    // At least one item per non-empty segment: reserving that many up front spares the vector's
    // doubling, which held the old and the new copy at once (the op's peak memory at 200k tensors).
    items_.reserve(static_cast<size_t>(nseg));
    for (int64_t i = 0; i < nseg; ++i) {
      const int64_t* r = row(i);
      const int64_t width = std::max(sources_[r[1]].itemsize, dests_[r[0]].itemsize);
      const int64_t step = std::max<int64_t>(1, kItemBytes / width);
      const Source& s = sources_[r[1]];
      const int64_t base = s.fd >= 0 ? s.file_off : reinterpret_cast<int64_t>(s.mem);
      for (int64_t skip = 0; skip < r[4]; skip += step)
        items_.push_back({i, skip, base + (r[2] + skip) * s.itemsize, static_cast<int32_t>(std::min(step, r[4] - skip)),
                          s.fd});
    }
    // The keys sit in the items, not behind two lookups per comparison: a batch of 20k small
    // tensors spent a tenth of its native time sorting. Plans in file order need no sort at all.
    const auto before = [](const ReadItem& a, const ReadItem& b) { return a.fd != b.fd ? a.fd < b.fd : a.at < b.at; };
    if (!std::is_sorted(items_.begin(), items_.end(), before)) std::sort(items_.begin(), items_.end(), before);
    group();
  }

  // Bytes an item moves when it can join a run, else -1: a plain copy (no cast) from a file into
  // memory, or from a file or memory into the output file.
  int64_t run_bytes(const ReadItem& it) const {
    const int64_t* r = row(it.seg);
    const Source& s = sources_[r[1]];
    const Dest& d = dests_[r[0]];
    if (s.dtype != d.dtype) return -1;
    return d.mem == nullptr || s.fd >= 0 ? it.n * s.itemsize : -1;
  }

  // Where an item lands in the output file.
  int64_t file_at(const ReadItem& it) const {
    const int64_t* r = row(it.seg);
    const Dest& d = dests_[r[0]];
    return d.file_off + (r[3] + it.skip) * d.itemsize;
  }

  // Runs of items that read one stretch of one file end to end (a ZeRO-3 rank's share of many
  // small parameters lies that way) are read with one pread into the bounce buffer and copied
  // out from there: 200k tiny preads cost more than the bytes they move. Written to a file, a run
  // must also land end to end (consecutive parameters of a ZeRO 1-2 partition in an export, in
  // model order): it is then one copy_file_range, not one per tensor.
  void group() {
    const bool to_file = out_fd_ >= 0;
    int64_t end = -1, file_end = -1, size = 0;
    int fd = -1;
    bool open = false;  // the last item can be joined
    for (size_t i = 0; i < items_.size(); ++i) {
      const ReadItem& it = items_[i];
      const int64_t n = run_bytes(it);
      const int64_t at_file = to_file ? file_at(it) : 0;
      const bool can = n >= 0 && (to_file || n <= kRunItemBytes);
      const bool joins = open && can && it.fd == fd && it.at == end && (!to_file || at_file == file_end) &&
                         size + n <= kItemBytes;
      if (!joins) {
        runs_.push_back(i);
        size = 0;
      }
      open = can;
      fd = it.fd;
      end = it.at + std::max<int64_t>(n, 0);
      file_end = at_file + std::max<int64_t>(n, 0);
      size += std::max<int64_t>(n, 0);
    }
    runs_.push_back(items_.size());
  }

  void move_run(size_t first, size_t last, std::vector<char>& in) {
    if (out_fd_ >= 0) {  // one stretch of the source onto one stretch of the file
      const ReadItem& a = items_[first];
      const ReadItem& z = items_[last - 1];
      copy_to_file(a.fd, a.at, file_at(a), z.at + run_bytes(z) - a.at, in);
      return;
    }
    const int64_t start = items_[first].at;
    const int64_t total = items_[last - 1].at + run_bytes(items_[last - 1]) - start;
    in.resize(static_cast<size_t>(std::max<int64_t>(total, kItemBytes)));
    const Source& s = sources_[row(items_[first].seg)[1]];
    pread_all(s.fd, in.data(), total, start);
    for (size_t i = first; i < last; ++i) {
      const int64_t* r = row(items_[i].seg);
      const Dest& d = dests_[r[0]];
      std::memcpy(d.mem + (r[3] + items_[i].skip) * d.itemsize, in.data() + (items_[i].at - start),
                  static_cast<size_t>(run_bytes(items_[i])));
    }
  }

  void worker() {
    std::vector<char> in, out;  // this thread's bounce buffers, grown on first need
    try {
      for (size_t g = next_.fetch_add(1); g + 1 < runs_.size() && !failed_.load(); g = next_.fetch_add(1)) {
        if (runs_[g + 1] - runs_[g] == 1) {
          move(items_[runs_[g]], in, out);
        } else {
          move_run(runs_[g], runs_[g + 1], in);
        }
      }
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error_) error_ = std::current_exception();
      failed_.store(true);
    }
  }

  void move(const ReadItem& it, std::vector<char>& in, std::vector<char>& out) {
    const int64_t* r = row(it.seg);
    const Source& s = sources_[r[1]];
    const Dest& d = dests_[r[0]];
    const int64_t src_byte = (r[2] + it.skip) * s.itemsize;
    const int64_t dst_byte = (r[3] + it.skip) * d.itemsize;
    if (s.dtype == d.dtype) {
      copy_same(s, src_byte, d, dst_byte, it.n * s.itemsize, in);
      return;
    }
    for (int64_t done = 0; done < it.n; done += kCastElems) {
      const int64_t n = std::min(kCastElems, it.n - done);
      const char* from = s.mem + src_byte + done * s.itemsize;
      if (s.fd >= 0) {
        in.resize(static_cast<size_t>(kCastElems * s.itemsize));
        pread_all(s.fd, in.data(), n * s.itemsize, s.file_off + src_byte + done * s.itemsize);
        from = in.data();
      }
      char* to = d.mem == nullptr ? nullptr : d.mem + dst_byte + done * d.itemsize;
      if (to == nullptr) {
        out.resize(static_cast<size_t>(kCastElems * d.itemsize));
        to = out.data();
      }
      cast_piece(from, s.dtype, to, d.dtype, n);
      if (d.mem == nullptr) pwrite_all(out_fd_, to, n * d.itemsize, d.file_off + dst_byte + done * d.itemsize);
    }
  }

  void copy_same(const Source& s, int64_t src_byte, const Dest& d, int64_t dst_byte, int64_t nbytes,
                 std::vector<char>& in) {
    if (d.mem != nullptr) {
      if (s.fd >= 0) {
        pread_all(s.fd, d.mem + dst_byte, nbytes, s.file_off + src_byte);
      } else {
        std::memcpy(d.mem + dst_byte, s.mem + src_byte, static_cast<size_t>(nbytes));
      }
      return;
    }
    const int64_t at = s.fd >= 0 ? s.file_off + src_byte : reinterpret_cast<int64_t>(s.mem + src_byte);
    copy_to_file(s.fd, at, d.file_off + dst_byte, nbytes, in);
  }

  // `nbytes` from `at` (a byte offset in file `fd`, or an address where `fd` is -1) to `out_off`
  // of the output file.
  void copy_to_file(int fd, int64_t at, int64_t out_off, int64_t nbytes, std::vector<char>& in) {
    if (fd < 0) {
      pwrite_all(out_fd_, reinterpret_cast<const char*>(at), nbytes, out_off);
      return;
    }
    if (copy_file_range_ && copy_range(fd, at, out_fd_, out_off, nbytes)) return;
    in.resize(static_cast<size_t>(kItemBytes));
    for (int64_t done = 0; done < nbytes; done += kItemBytes) {
      const int64_t n = std::min(kItemBytes, nbytes - done);
      pread_all(fd, in.data(), n, at + done);
      pwrite_all(out_fd_, in.data(), n, out_off + done);
    }
  }

  std::vector<Source> sources_;
  std::vector<Dest> dests_;
  const int64_t* seg_;
  int out_fd_;
  int64_t readers_ = 0;
  bool copy_file_range_ = false;
  std::vector<ReadItem> items_;
  std::vector<size_t> runs_;  // where each run of items_ starts, then items_.size()
  std::atomic<size_t> next_{0};
  std::atomic<bool> failed_{false};
  std::mutex mutex_;
  std::exception_ptr error_;
};

void check_castable(c10::ScalarType from, c10::ScalarType to, int64_t src, int64_t out) {
  ZF_CHECK(from == to || (is_castable_float(from) && is_castable_float(to)), "read_cast: cannot cast `sources[",
           src, "]` of dtype ", from, " to `outs[", out, "]` dtype ", to,
           "; only float64/float32/float16/bfloat16 are cast, other dtypes must match");
}

// Every row is checked before any byte moves, so a bad plan fails without touching an output.
const int64_t* check_rows(const Tensor& segments, const std::vector<Tensor>& sources,
                          const std::vector<int64_t>& out_numel, const std::vector<c10::ScalarType>& out_dtype) {
  check_row_table("read_cast", segments, kRow);
  const int64_t* seg = segments.const_data_ptr<int64_t>();
  const auto nout = static_cast<int64_t>(out_numel.size());
  const auto source_numel = numels_of(sources);
  std::vector<c10::ScalarType> source_dtype;
  source_dtype.reserve(sources.size());
  for (const auto& s : sources) source_dtype.push_back(s.scalar_type());
  const int64_t nrows = segments.size(0);  // a call into libtorch: asked once, not per row
  for (int64_t i = 0; i < nrows; ++i) {
    const int64_t* r = seg + kRow * i;
    const int64_t out = r[0], src = r[1], src_off = r[2], dst_off = r[3], len = r[4];
    ZF_CHECK(out >= 0 && out < nout, "read_cast: `segments[", i, "]` names output ", out, " but there are ",
             nout, " outputs");
    check_segment_row("read_cast", i, source_numel, src, src_off, dst_off, len, out_numel[out], out);
    check_castable(source_dtype[src], out_dtype[out], src, out);
  }
  return seg;
}

// Asks for transparent huge pages on the outputs' whole 2 MiB blocks: one page fault (and one
// zeroing pass) per 2 MiB instead of per 4 KiB when the readers first touch them. Measured about
// 2x faster on a 400 MB eager dict (README, performance); `hugepages=False` turns it off, for
// machines whose fragmented memory makes the kernel compact on each fault (defrag=madvise).
void advise_huge(const std::vector<Dest>& dests, const std::vector<int64_t>& numel, bool hugepages) {
  if (!hugepages) return;
  constexpr uintptr_t kHuge = 2u << 20;
  for (size_t i = 0; i < dests.size(); ++i) {
    const auto base = reinterpret_cast<uintptr_t>(dests[i].mem);
    const auto lo = (base + kHuge - 1) / kHuge * kHuge;
    const auto hi = (base + static_cast<uintptr_t>(numel[i] * dests[i].itemsize)) / kHuge * kHuge;
    if (hi > lo) (void)madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
  }
}

// In-memory outputs: where each starts, and how many elements of which dtype it holds.
struct Outs {
  std::vector<Dest> dests;
  std::vector<int64_t> numel;
  std::vector<c10::ScalarType> dtypes;
};

void read_into(const std::vector<Tensor>& sources, IntList source_fds, const Tensor& source_offsets,
               const Tensor& segments, Outs outs, int64_t readers, bool hugepages) {
  auto srcs = cpu::make_sources("read_cast", sources, source_fds, source_offsets, /*strided_files=*/false);
  const int64_t* seg = check_rows(segments, sources, outs.numel, outs.dtypes);
  advise_huge(outs.dests, outs.numel, hugepages);
  Batch(std::move(srcs), std::move(outs.dests), seg, segments.size(0), -1, readers, false).run();
}

void read_cast_cpu(const std::vector<Tensor>& sources, IntList source_fds,
                   const Tensor& source_offsets, const Tensor& segments, const std::vector<Tensor>& outs,
                   int64_t readers, bool hugepages) {
  Outs described;
  for (size_t i = 0; i < outs.size(); ++i) {
    const auto& o = outs[i];
    ZF_CHECK(is_cpu(o.device()) && o.is_contiguous(), "read_cast: `outs[", i,
             "]` must be a contiguous CPU tensor, got a ", o.is_contiguous() ? "contiguous" : "non-contiguous",
             " one on ", device_text(o.device()));
    described.dests.push_back(
        {static_cast<char*>(o.data_ptr()), 0, static_cast<int64_t>(o.element_size()), o.scalar_type()});
    described.numel.push_back(o.numel());
    described.dtypes.push_back(o.scalar_type());
  }
  read_into(sources, source_fds, source_offsets, segments, std::move(described), readers, hugepages);
}

// Contiguous CPU tensors of one dtype, made with the shim's empty_strided: torch::stable::empty
// finds aten::empty by name and boxes its arguments on every call, which cost 0.8 us more per
// output of a 50k-output batch. The shim wants torch's own dtype code, taken from a probe tensor.
class Allocator {
 public:
  explicit Allocator(c10::ScalarType dtype) {
    const int64_t none[1] = {0};
    const Tensor probe =
        torch::stable::empty({none, 1}, dtype, std::nullopt, torch::stable::Device(c10::DeviceType::CPU));
    itemsize_ = static_cast<int64_t>(probe.element_size());
    STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(probe.get(), &dtype_));
  }

  int64_t itemsize() const { return itemsize_; }

  AtenTensorHandle empty(IntList sizes) {  // a new owning handle
    const auto n = sizes.size();
    strides_.resize(n);
    int64_t stride = 1;  // torch's contiguous strides: a size of 0 counts as 1
    for (size_t k = n; k-- > 0;) {
      strides_[k] = stride;
      stride *= std::max<int64_t>(sizes[k], 1);
    }
    AtenTensorHandle made = nullptr;
    STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(static_cast<int64_t>(n), sizes.data(), strides_.data(),
                                                           dtype_, aoti_torch_device_type_cpu(), 0, &made));
    return made;
  }

 private:
  int32_t dtype_ = 0;
  int64_t itemsize_ = 0;
  std::vector<int64_t> strides_;
};

// Allocating here rather than in Python is most of what a batch of 50k small tensors costs
// besides the reads: an empty tensor per output instead of a torch.empty and a view. The shapes
// are int lists, not tensors, so that the op's fake knows them. Boxed by hand (handles.h), and
// the outputs described from what made them rather than asked of each.
void read_cast_new_boxed(StableIValue* stack, uint64_t num_args, uint64_t num_outputs) {
  ZF_CHECK(num_args == 9 && num_outputs == 1, "read_cast_new: expected the schema's 9 arguments and 1 output");
  using torch::stable::detail::to;
  const auto sources = to<std::vector<Tensor>>(stack[0]);
  const auto source_fds = to<std::vector<int64_t>>(stack[1]);
  const auto source_offsets = to<Tensor>(stack[2]);
  const auto segments = to<Tensor>(stack[3]);
  const auto dims = to<std::vector<int64_t>>(stack[4]);
  const auto ranks = to<std::vector<int64_t>>(stack[5]);
  const auto dtype = to<c10::ScalarType>(stack[6]);
  const auto readers = to<int64_t>(stack[7]);
  const auto hugepages = to<bool>(stack[8]);
  Allocator alloc(dtype);
  const int64_t itemsize = alloc.itemsize();
  const auto ndims = static_cast<int64_t>(dims.size());
  cpu::OwnedHandles made;
  made.reserve(ranks.size());
  Outs outs;
  int64_t pos = 0;
  for (size_t i = 0; i < ranks.size(); ++i) {
    ZF_CHECK(ranks[i] >= 0 && ranks[i] <= ndims - pos, "read_cast_new: `ranks[", i, "]` = ", ranks[i],
             " reaches past the end of `dims`");
    int64_t bytes = itemsize, numel = 1;
    for (int64_t k = pos; k < pos + ranks[i]; ++k) {
      ZF_CHECK(dims[k] >= 0, "read_cast_new: `dims[", k, "]` = ", dims[k], ": output ", i, " has a negative size");
      ZF_CHECK(dims[k] == 0 || bytes <= std::numeric_limits<int64_t>::max() / dims[k], "read_cast_new: `dims[",
               pos, ":", pos + ranks[i], "]`: output ", i, " has more bytes than int64 counts");
      bytes *= dims[k] == 0 ? 1 : dims[k];
      numel *= dims[k];
    }
    made.add(alloc.empty(IntList(dims.data() + pos, static_cast<size_t>(ranks[i]))));
    void* data = nullptr;
    STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(made[i], &data));
    outs.dests.push_back({static_cast<char*>(data), 0, itemsize, dtype});
    outs.numel.push_back(numel);
    outs.dtypes.push_back(dtype);
    pos += ranks[i];
  }
  ZF_CHECK(pos == ndims, "read_cast_new: `dims` holds ", ndims - pos, " sizes past the last output");
  read_into(sources, source_fds, source_offsets, segments, std::move(outs), readers, hugepages);
  stack[0] = made.release_as_list("read_cast_new");
}

void read_cast_to_file_cpu(const std::vector<Tensor>& sources, IntList source_fds,
                           const Tensor& source_offsets, const Tensor& segments, int64_t out_fd,
                           const Tensor& out_offsets, const Tensor& out_numels, c10::ScalarType out_dtype,
                           int64_t readers, bool copy_file_range) {
  cpu::check_fd(out_fd, /*write=*/true, "read_cast_to_file", {"out_fd"});
  for (const auto* t : {&out_offsets, &out_numels}) {
    ZF_CHECK(is_cpu(t->device()) && t->scalar_type() == c10::ScalarType::Long && t->dim() == 1 && t->is_contiguous() &&
                 t->size(0) == out_offsets.size(0),
             "read_cast_to_file: `out_offsets` and `out_numels` must be contiguous CPU int64 tensors of one "
             "length, got ", out_offsets.scalar_type(), " ", sizes_text(out_offsets.sizes()), " on ",
             device_text(out_offsets.device()), " and ", out_numels.scalar_type(), " ", sizes_text(out_numels.sizes()),
             " on ", device_text(out_numels.device()));
  }
  const int64_t* off = out_offsets.const_data_ptr<int64_t>();
  const int64_t* cnt = out_numels.const_data_ptr<int64_t>();
  const int64_t itemsize = cpu::element_size(out_dtype);
  std::vector<Dest> dests;
  std::vector<int64_t> numel;
  const int64_t nrows = out_offsets.size(0);  // a call into libtorch: asked once, not per row
  for (int64_t i = 0; i < nrows; ++i) {
    ZF_CHECK(off[i] >= 0 && cnt[i] >= 0, "read_cast_to_file: `out_offsets[", i, "]` = ", off[i], " or `out_numels[",
             i, "]` = ", cnt[i], " is negative");
    ZF_CHECK(cnt[i] <= (std::numeric_limits<int64_t>::max() - off[i]) / itemsize, "read_cast_to_file: `out_offsets[",
             i, "]` = ", off[i], " and `out_numels[", i, "]` = ", cnt[i], " end past any file");
    dests.push_back({nullptr, off[i], itemsize, out_dtype});
    numel.push_back(cnt[i]);
  }
  auto srcs = cpu::make_sources("read_cast", sources, source_fds, source_offsets, /*strided_files=*/false);
  const int64_t* seg = check_rows(segments, sources, numel, std::vector<c10::ScalarType>(numel.size(), out_dtype));
  Batch(std::move(srcs), std::move(dests), seg, segments.size(0), static_cast<int>(out_fd), readers,
        copy_file_range).run();
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(zerofast, CPU, m) {
  m.impl("read_cast", TORCH_BOX(&read_cast_cpu));
  m.impl("read_cast_new", &read_cast_new_boxed);
  m.impl("read_cast_to_file", TORCH_BOX(&read_cast_to_file_cpu));
}

}  // namespace zerofast
