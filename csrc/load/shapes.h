// The shape check of zerofast/load/records.py (_shapes), for a whole mapping in one native pass.
//
// A model-states file lists a shape per parameter (`param_shapes`): tens of thousands of
// torch.Size objects. Checking and converting them one Python call at a time cost a fifth of
// reading a 20k-parameter file. This pass gives the same result where every key is an exact str
// and every value an exact tuple, list or torch.Size of at most 64 exact ints, each in [0, 2**63),
// whose product (zeros counted as one) stays below 2**63; anywhere else it answers None and the
// Python check decides and words the error.
#pragma once

#include <pybind11/pybind11.h>

namespace zerofast::load {

// Adds `plain_shapes(mapping) -> dict[str, tuple[int, ...]] | None` to the _C module.
void register_shapes(pybind11::module_& m);

}  // namespace zerofast::load
