// The pickle opcodes the native reader knows: those torch.save writes at protocol 2, and the
// protocol-4 forms of the same objects. Shared by the bounds pass and the builder, so that the
// two cannot disagree on a byte. FRAME is read by the bounds pass alone (DCP's .metadata is
// framed; torch.save never frames, and the builder declines it).
#pragma once

#include <cstdint>

namespace zerofast::load {

enum Op : uint8_t {
  MARK = 0x28, EMPTY_TUPLE = 0x29, STOP = 0x2E, POP = 0x30, POP_MARK = 0x31, DUP = 0x32,
  BINBYTES = 0x42, SHORT_BINBYTES = 0x43, BINFLOAT = 0x47, BININT = 0x4A, BININT1 = 0x4B,
  BININT2 = 0x4D, NONE = 0x4E, BINPERSID = 0x51, REDUCE = 0x52, BINUNICODE = 0x58,
  EMPTY_LIST = 0x5D, APPEND = 0x61, BUILD = 0x62, GLOBAL = 0x63, DICT = 0x64, APPENDS = 0x65,
  BINGET = 0x68, LONG_BINGET = 0x6A, LIST = 0x6C, BINPUT = 0x71, LONG_BINPUT = 0x72,
  SETITEM = 0x73, TUPLE = 0x74, SETITEMS = 0x75, EMPTY_DICT = 0x7D, PROTO = 0x80,
  NEWOBJ = 0x81, TUPLE1 = 0x85, TUPLE2 = 0x86, TUPLE3 = 0x87, NEWTRUE = 0x88, NEWFALSE = 0x89,
  LONG1 = 0x8A, SHORT_BINUNICODE = 0x8C, BINUNICODE8 = 0x8D, BINBYTES8 = 0x8E, EMPTY_SET = 0x8F,
  ADDITEMS = 0x90, FROZENSET = 0x91, STACK_GLOBAL = 0x93, MEMOIZE = 0x94, FRAME = 0x95,
};

}  // namespace zerofast::load
