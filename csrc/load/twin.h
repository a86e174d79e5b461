// Reading a rank file that repeats another one byte for byte outside its storages.
//
// ZeRO-3 writes one model-states file per rank, and each holds the same pickle: the placeholders
// of the partitioned parameters, the same param_shapes, the same config. Only the bytes of the
// storages differ (each rank's own frozen-parameter fragments and buffers). Unpickling each of
// W such files builds W identical trees of tens of thousands of objects. Here a file is first
// proven to be the template's twin: its zip directory (read and checked as any other) holds the
// template's entries in order, the same but for the archive's folder name, and its data.pkl is
// the template's but for the storages' device strings, which no reader uses. Then the reference reader, given this file, would build the template's tree
// with every storage cut from this file's entry of the same key, and that is what a `Twin` copies:
// copies of the template's containers and tensors, sharing its immutable leaves. Anything the
// copy does not know declines, and the file is read in full.
#pragma once

#include <pybind11/pybind11.h>

namespace zerofast::load {

// Adds `same_archive(...)`, `same_pickle(...)`, `twin(...)` and the `Twin` class to the _C module.
void register_twin(pybind11::module_& m);

}  // namespace zerofast::load
