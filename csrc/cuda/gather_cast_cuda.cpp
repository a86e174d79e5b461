// CUDA kernel of zerofast::gather_cast: the torch side of gather_cast_kernels.cu.
//
// Sources already on the GPU are read in place. Sources in host memory (memory-mapped checkpoint
// files) cross through a few pinned slots: the host packs ranges into a slot, a side stream
// copies the slot to its device twin, and the kernel on the caller's stream reads the twin. So
// packing one slot, uploading the next and casting a third overlap, and GPU memory holds the
// output plus the slots, whatever the size of the sources.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../gather_cast_checks.h"
#include "../page_advice.h"
#include "gather_cast_kernels.h"

namespace zerofast {
namespace {

using cuda::Batch;
using cuda::Piece;
using cuda::Span;
using cuda::Table;

// What one launch does; every piece of a launch has the same source dtype.
struct Launch {
  at::ScalarType from;
  at::ScalarType to;
  cuda::Kind kind;
};

Launch make_launch(const at::Tensor& source, const at::Tensor& out) {
  const auto from_size = static_cast<int64_t>(source.element_size());
  const auto to_size = static_cast<int64_t>(out.element_size());
  return {source.scalar_type(), out.scalar_type(), {from_size, to_size, source.scalar_type() != out.scalar_type()}};
}

cuda::Dtype kernel_dtype(at::ScalarType t) {
  switch (t) {
    case at::kDouble:
      return cuda::Dtype::kFloat64;
    case at::kFloat:
      return cuda::Dtype::kFloat32;
    case at::kHalf:
      return cuda::Dtype::kFloat16;
    case at::kBFloat16:
      return cuda::Dtype::kBFloat16;
    default:
      break;
  }
  // check_gather_cast_tensors lets only these four through to a cast.
  TORCH_INTERNAL_ASSERT(false, "gather_cast: no CUDA cast for ", t);
  return cuda::Dtype::kFloat32;
}

void launch(const Span* device_spans, const Table& t, const Launch& l, cudaStream_t stream) {
  const auto count = static_cast<int64_t>(t.spans.size());
  if (l.kind.casts) {
    C10_CUDA_CHECK(cuda::launch_cast(device_spans, count, kernel_dtype(l.from), kernel_dtype(l.to), stream));
  } else {
    C10_CUDA_CHECK(cuda::launch_copy(device_spans, count, t.word_bytes, stream));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::TensorOptions bytes_on(at::Device device) { return at::TensorOptions().dtype(at::kByte).device(device); }
at::TensorOptions pinned_bytes() { return at::TensorOptions().dtype(at::kByte).pinned_memory(true); }

// Sources already on the GPU: only the span table crosses. copy_ with non_blocking tells torch's
// host allocator that the stream still reads the pinned buffer, so it is not handed out again
// before the copy has been made.
void gather_resident(const std::vector<Piece>& pieces, const Launch& l, at::Device device, cudaStream_t stream) {
  const Table t = make_table(pieces, l.kind);
  const auto bytes = static_cast<int64_t>(t.spans.size() * sizeof(Span));
  at::Tensor host = at::empty({bytes}, pinned_bytes());
  std::memcpy(host.mutable_data_ptr(), t.spans.data(), static_cast<size_t>(bytes));
  at::Tensor table = at::empty({bytes}, bytes_on(device));
  table.copy_(host, /*non_blocking=*/true);
  launch(static_cast<const Span*>(table.const_data_ptr()), t, l, stream);
}

class Event {
 public:
  Event() { C10_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming)); }
  ~Event() { C10_CUDA_CHECK_WARN(cudaEventDestroy(event_)); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  void record(cudaStream_t stream) {
    C10_CUDA_CHECK(cudaEventRecord(event_, stream));
    recorded_ = true;
  }
  // An event never recorded stands for work that never existed: nothing to wait for.
  void block(cudaStream_t stream) const {
    if (recorded_) C10_CUDA_CHECK(cudaStreamWaitEvent(stream, event_, 0));
  }
  void wait() const {
    if (recorded_) C10_CUDA_CHECK(cudaEventSynchronize(event_));
  }

 private:
  cudaEvent_t event_{};
  bool recorded_ = false;
};

// Page faults on the mapped sources, not bandwidth, bound this copy, so it is spread over the
// threads like the CPU kernel is.
constexpr int64_t kGrainBytes = 1 << 20;

void copy_host(const std::vector<cuda::StagedCopy>& copies, char* data, bool drop_pages) {
  std::vector<int64_t> ends(copies.size());
  int64_t total = 0;
  for (size_t i = 0; i < copies.size(); ++i) ends[i] = total += copies[i].bytes;
  at::parallel_for(0, total, kGrainBytes, [&](int64_t begin, int64_t end) {
    size_t k = std::upper_bound(ends.begin(), ends.end(), begin) - ends.begin();
    for (; begin < end; ++k) {
      const cuda::StagedCopy& c = copies[k];
      const int64_t skip = begin - (ends[k] - c.bytes);
      const int64_t n = std::min(end, ends[k]) - begin;
      std::memcpy(data + c.offset + skip, c.src + skip, static_cast<size_t>(n));
      if (drop_pages) advise(c.src + skip, n, MADV_DONTNEED, true);
      begin += n;
    }
  });
}

struct Slot {
  Span* host_table = nullptr;  // pinned
  char* host_data = nullptr;  // pinned
  Span* device_table = nullptr;
  char* device_data = nullptr;
  Event uploaded;  // the side stream has read host_* (and written device_*)
  Event consumed;  // the kernel has read device_*
};

// Owns the slots and the side stream; sends the batches the Packer makes.
class Staging {
 public:
  Staging(const Launch& l, at::Device device, const cuda::Sizing& sizing, cudaStream_t compute, bool drop_pages)
      : launch_(l),
        table_bytes_(cuda::round_up(
            cuda::table_capacity(sizing.slot_bytes, cuda::kStagePieces) * static_cast<int64_t>(sizeof(Span)),
            cuda::kStageAlign)),
        stride_(table_bytes_ + sizing.slot_bytes),
        drop_pages_(drop_pages),
        compute_(compute),
        side_(c10::cuda::getStreamFromPool(false, device.index())),
        host_(at::empty({sizing.slots * stride_}, pinned_bytes())),
        device_(at::empty({sizing.slots * stride_}, bytes_on(device))) {
    carve(sizing.slots);
    // The device buffer may be memory the caller's stream was still using: uploads wait for it.
    Event ready;
    ready.record(compute_);
    ready.block(side_.stream());
  }

  // Host memory must outlive every upload that reads it; also on the way out of an error.
  ~Staging() { C10_CUDA_CHECK_WARN(cudaStreamSynchronize(side_.stream())); }

  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;

  void send(const Batch& b) {
    Slot& s = slot_[b.slot];
    s.uploaded.wait();  // the previous upload from this slot has read the host memory
    copy_host(b.copies, s.host_data, drop_pages_);
    const Table t = make_table(cuda::placed(b, s.device_data), launch_.kind);
    const auto table_bytes = static_cast<int64_t>(t.spans.size() * sizeof(Span));
    TORCH_INTERNAL_ASSERT(table_bytes <= table_bytes_, "gather_cast: span table overflows its slot");
    std::memcpy(s.host_table, t.spans.data(), static_cast<size_t>(table_bytes));
    upload(s, table_bytes, b.used);
    launch(s.device_table, t, launch_, compute_);
    s.consumed.record(compute_);
  }

  void finish() { C10_CUDA_CHECK(cudaStreamSynchronize(side_.stream())); }

 private:
  void carve(int slots) {
    char* host = static_cast<char*>(host_.mutable_data_ptr());
    char* device = static_cast<char*>(device_.mutable_data_ptr());
    for (int i = 0; i < slots; ++i) {
      slot_[i].host_table = reinterpret_cast<Span*>(host + i * stride_);
      slot_[i].host_data = host + i * stride_ + table_bytes_;
      slot_[i].device_table = reinterpret_cast<Span*>(device + i * stride_);
      slot_[i].device_data = device + i * stride_ + table_bytes_;
    }
  }

  void upload(Slot& s, int64_t table_bytes, int64_t data_bytes) {
    const cudaStream_t side = side_.stream();
    s.consumed.block(side);  // the previous kernel on this slot has read the device half
    C10_CUDA_CHECK(cudaMemcpyAsync(s.device_table, s.host_table, static_cast<size_t>(table_bytes),
                                   cudaMemcpyHostToDevice, side));
    C10_CUDA_CHECK(cudaMemcpyAsync(s.device_data, s.host_data, static_cast<size_t>(data_bytes),
                                   cudaMemcpyHostToDevice, side));
    s.uploaded.record(side);
    s.uploaded.block(compute_);
  }

  const Launch launch_;
  const int64_t table_bytes_;
  const int64_t stride_;
  const bool drop_pages_;
  const cudaStream_t compute_;
  const c10::cuda::CUDAStream side_;
  const at::Tensor host_;
  const at::Tensor device_;
  std::array<Slot, cuda::kStageSlots> slot_;
};

void gather_staged(const std::vector<Piece>& pieces, const Launch& l, at::Device device, cudaStream_t stream,
                   bool stream_sources) {
  if (stream_sources) {
    for (const Piece& p : pieces) advise(p.src, p.n * l.kind.from_size, MADV_WILLNEED, false);
  }
  const cuda::Sizing sizing = cuda::size_slots(pieces, l.kind);
  Staging staging(l, device, sizing, stream, stream_sources);
  cuda::Packer packer(sizing, l.kind, cuda::kStagePieces);
  const auto send = [&](const Batch& b) { staging.send(b); };
  for (const Piece& p : pieces) packer.add(p, send);
  packer.finish(send);
  staging.finish();
}

struct Group {
  Launch launch;
  bool resident;  // sources on the GPU
  std::vector<Piece> pieces;
};

std::vector<Group> group_pieces(const std::vector<at::Tensor>& sources, const at::Tensor& segments,
                                const at::Tensor& out) {
  std::vector<Group> groups;
  const int64_t* seg = segments.const_data_ptr<int64_t>();
  char* out_base = static_cast<char*>(out.mutable_data_ptr());
  const int64_t out_size = static_cast<int64_t>(out.element_size());
  for (int64_t i = 0; i < segments.size(0); ++i) {
    const int64_t len = seg[4 * i + 3];
    if (len == 0) continue;
    const at::Tensor& s = sources[seg[4 * i]];
    const Launch l = make_launch(s, out);
    const bool resident = s.is_cuda();
    auto g = std::find_if(groups.begin(), groups.end(),
                          [&](const Group& x) { return x.launch.from == l.from && x.resident == resident; });
    if (g == groups.end()) g = groups.insert(groups.end(), Group{l, resident, {}});
    const char* src = static_cast<const char*>(s.const_data_ptr()) + seg[4 * i + 1] * l.kind.from_size;
    g->pieces.push_back({src, out_base + seg[4 * i + 2] * out_size, len});
  }
  return groups;
}

void gather_cast_cuda(const std::vector<at::Tensor>& sources, const at::Tensor& segments, const at::Tensor& out,
                      bool stream_sources) {
  check_gather_cast_args(sources, segments, out);
  TORCH_CHECK(out.is_cuda(), "gather_cast: `out` is on ", out.device(), "; the CUDA kernel writes to the GPU only");
  const c10::cuda::CUDAGuard guard(out.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(out.device().index()).stream();
  for (const Group& g : group_pieces(sources, segments, out)) {
    if (g.resident) {
      gather_resident(g.pieces, g.launch, out.device(), stream);
    } else {
      gather_staged(g.pieces, g.launch, out.device(), stream, stream_sources);
    }
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(zerofast, CUDA, m) {
  m.impl("gather_cast", &gather_cast_cuda);
}

}  // namespace zerofast
