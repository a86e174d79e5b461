// The native reader's bounds pass over data.pkl: a port of zerofast/load/pickle_bounds.py.
//
// It walks the opcodes once, keeping a few integers per simulated object, and declines a
// pickle whose containers nest deeper than 100 levels, whose memo indices run ahead of the
// values stored so far, or whose dict keys, set members and call arguments would take more
// than 8 steps per byte of the file to hash. It knows only the opcodes the native unpickler
// (unpickle.cpp) builds; any other opcode declines too. Declining is always safe: the Python
// reader then reads the file and words the verdict.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace zerofast::load {

// The native reader will not read this pickle; the Python reader decides. Never shown to users.
struct Declined : std::runtime_error {
  explicit Declined(const std::string& why) : std::runtime_error(why) {}
};

// The unsigned little-endian integer of `width` bytes at `p`: pickle arguments and zip fields
// alike (every reader of csrc/load/).
inline uint64_t little(const uint8_t* p, int width) {
  uint64_t v = 0;
  for (int i = width - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// What the bounds pass learned that lets the unpickler build less.
struct ScanFacts {
  // Per memo index the pickle ever puts, the slot the unpickler keeps its value in, or -1 where
  // no GET ever reads that index: torch.save memoizes every object it writes (240k puts in a
  // 20k-tensor model-states file) but reads back a few (19 there), and a value kept in the memo
  // costs a slot and a reference until the end of the read.
  std::vector<int32_t> memo_slot;
  int32_t memo_slots = 0;
  size_t tuples = 0, tuple_items = 0;  // what TUPLE* and FROZENSET make, to size the arenas once
  size_t calls = 0, dict_items = 0;    // REDUCE and NEWOBJ; SETITEM(S) pairs: bounds for the batches
};

// Throws Declined unless `data` is a pickle the native unpickler may build. Needs no Python.
ScanFacts scan_pickle(const uint8_t* data, size_t size);

}  // namespace zerofast::load
