// The operator schema: ops are declared once here; each device registers its kernels under
// csrc/<device>/. The library registers them when it loads (csrc/load/module.cpp is the Python
// module whose import loads it).
//
// Compiled with the CPU kernels against torch's stable ABI only (the unit begins with
// TORCH_TARGET_VERSION, zerofast/native/cache.py), so one binary serves every torch from that
// version on.
#include <torch/csrc/stable/library.h>

STABLE_TORCH_LIBRARY(zerofast, m) {
  // Copies `segments` rows (source index, source offset, output offset, length), counted in
  // elements, from 1-D contiguous `sources` into the 1-D contiguous `out`, casting each element
  // from the source dtype to out's dtype exactly as Tensor.to would.
  //
  // `stream_sources` promises that every source is a clean, private, read-only file mapping
  // that nobody else holds: the kernel then asks the OS to read the ranges ahead, and drops
  // the pages it has read from this process, so a pass over a large checkpoint does not keep
  // the input resident next to the output.
  m.def("gather_cast(Tensor[] sources, Tensor segments, Tensor(a!) out, bool stream_sources=False) -> ()");

  // A whole batch of outputs in one call, read from the checkpoint files rather than through
  // their mappings. `segments` rows are (output index, source index, source offset, output
  // offset, length), counted in elements. Source i is read with pread from file descriptor
  // `source_fds[i]` at byte `source_offsets[i]` onwards, where its bytes are the same as the
  // tensor's; with a negative fd it is copied from the tensor. Casts are those of Tensor.to.
  // Outputs not covered by a row keep what they held. `readers` reader threads do the reads
  // (<= 0: torch's intra-op thread count); `hugepages` asks for transparent huge pages on the
  // outputs. Neither changes a byte of the result.
  m.def("read_cast(Tensor[] sources, int[] source_fds, Tensor source_offsets, Tensor segments, "
        "Tensor(a!)[] outs, int readers=0, bool hugepages=True) -> ()");

  // The same into fresh outputs of one dtype, made here: output i has the shape
  // `dims[sum(ranks[:i]) : sum(ranks[:i + 1])]`. Elements no row writes are uninitialized.
  m.def("read_cast_new(Tensor[] sources, int[] source_fds, Tensor source_offsets, Tensor segments, int[] dims, "
        "int[] ranks, ScalarType dtype, int readers=0, bool hugepages=True) -> Tensor[]");

  // The same, into a file: output i is `out_numels[i]` elements of `out_dtype` at byte
  // `out_offsets[i]` of `out_fd`, written with pwrite, or with copy_file_range where no cast is
  // needed, the file systems allow it and `copy_file_range` is true.
  m.def("read_cast_to_file(Tensor[] sources, int[] source_fds, Tensor source_offsets, Tensor segments, "
        "int out_fd, Tensor out_offsets, Tensor out_numels, ScalarType out_dtype, int readers=0, "
        "bool copy_file_range=True) -> ()");

  // Tensors over the storages of `bases`, none copied: `layout` (1-D int64) holds one record per
  // output, (base index, storage offset, ndim, sizes..., strides...) in elements of that base's
  // dtype. Each output shares its base's storage as Tensor.set_ would make it: not an autograd
  // view of the base. The reader of torch.save files (csrc/load/unpickle.cpp) makes the tensors
  // that share a storage with it in one call. Checked: every output lies inside its base's
  // storage. Its outputs' shapes are the layout's values, so it has no fake (not traceable).
  m.def("restrided(Tensor(a)[] bases, Tensor layout) -> Tensor(a)[]");

  // The checks of `zerofast verify` in one pass, nothing materialized (csrc/cpu/check_ranges.cpp).
  // `segments` rows are (tensor, side, source, source offset, tensor offset, length) in elements;
  // sources as for read_cast, except that a source read from its file (fd >= 0) gives only its
  // dtype and length. Tensor t has `numels[t]` elements, cut into chunks of `chunk` (one empty
  // chunk for an empty tensor); elements no row covers are zeros. Per chunk, in tensor order:
  // `counts` [C, 5] = NaN, infinity and non-zero elements among side 0's source elements (as
  // stored, before any cast), whether any byte differs and how many elements changed; `maxima`
  // [C, 2] = max |x - y| and max |x - y| / max(|x|, DBL_MIN), torch's NaN-propagating maxima over
  // the chunk, 0 where no byte differs. x is side 0, y side 1, both cast to `dtype` (Tensor.to);
  // without `compare` there is no side 1, only the counts.
  m.def("check_ranges(Tensor[] sources, int[] source_fds, Tensor source_offsets, Tensor segments, Tensor numels, "
        "ScalarType dtype, bool compare, int chunk, int readers=0) -> (Tensor counts, Tensor maxima)");
}
