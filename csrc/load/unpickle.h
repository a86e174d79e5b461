// zerofast's native reader of torch.save pickles (data.pkl): host code, not a device kernel.
//
// The Python reader (zerofast/load/unpickle.py) is the reference: CPython's C unpickler with an
// allowlist, a Python bounds pass before it and Python calls per storage and tensor. This one
// reads the same files in two native passes: pickle_scan.cpp bounds the pickle without the
// GIL, then unpickle.cpp builds the container tree, keeping storage references native and
// cutting each tensor out of the file mapping in C++. It accepts only what it can build exactly
// as the reference would; for anything else (an opcode outside torch.save's subset, a global
// off the allowlist, any bound or check that fails) it declines and the Python reader decides,
// so verdicts and messages are the reference's by construction.
#pragma once

#include <pybind11/pybind11.h>

namespace zerofast::load {

// Adds `unpickle(data, mapping, hooks, recipes=False) -> (True, result) | (False, reason)` to the _C
// module (with recipes=True, a third item: the Recipes of the result's tensors, recipes.h).
void register_unpickle(pybind11::module_& m);

}  // namespace zerofast::load
