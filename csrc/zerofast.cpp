// Operator schema and the Python module that carries it.
//
// Ops are declared once here; each device registers its kernels under csrc/<device>/.
// The Python module exists so `import zerofast._C` loads this library (registering the ops)
// and so the loader can compare the torch it was compiled against with the running one.
#include <torch/extension.h>
#include <torch/library.h>

#ifndef ZEROFAST_TORCH_VERSION
#define ZEROFAST_TORCH_VERSION "unknown"
#endif

TORCH_LIBRARY(zerofast, m) {
  // Copies `segments` rows (source index, source offset, output offset, length), counted in
  // elements, from 1-D contiguous `sources` into the 1-D contiguous `out`, casting each element
  // from the source dtype to out's dtype exactly as Tensor.to would.
  //
  // `stream_sources` promises that every source is a clean, private, read-only file mapping
  // that nobody else holds: the kernel then asks the OS to read the ranges ahead, and drops
  // the pages it has read from this process, so a pass over a large checkpoint does not keep
  // the input resident next to the output.
  m.def("gather_cast(Tensor[] sources, Tensor segments, Tensor(a!) out, bool stream_sources=False) -> ()");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("torch_version", [] { return std::string(ZEROFAST_TORCH_VERSION); },
        "torch version this extension was compiled against");
  m.def("cuda_built", [] {
#ifdef ZEROFAST_WITH_CUDA
    return true;
#else
    return false;
#endif
  }, "whether CUDA kernels were compiled in");
}
