// The Python module that carries the core: importing it (zerofast/native/loader.py) loads this
// library, registering the ops of csrc/zerofast.cpp, and gives the rank-file readers of
// zerofast/load/ their native halves. Which devices have kernels is asked of torch's dispatcher
// from Python (zerofast/native/loader.py: kernel_devices), not here.
#include <pybind11/pybind11.h>

#include <string>

#include "shapes.h"
#include "twin.h"
#include "unpickle.h"
#include "zip_directory.h"

#ifndef ZEROFAST_TORCH_VERSION
#define ZEROFAST_TORCH_VERSION "unknown"
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("torch_version", [] { return std::string(ZEROFAST_TORCH_VERSION); },
        "torch version this extension was compiled against");
  zerofast::load::register_zip_directory(m);
  zerofast::load::register_unpickle(m);
  zerofast::load::register_twin(m);
  zerofast::load::register_shapes(m);
}
