"""A linear pre-pass over ``data.pkl`` that bounds what the C unpickler will build from it.

CPython's unpickler trusts its input in ways that a small file can turn into a crash or an
unbounded amount of work before any global is resolved:

- hashing a tuple recurses in C without a depth check, so a dict key nested 10^6 deep kills
  the interpreter (SIGSEGV), and a key built of shared tuples (each level ``(t, t, ..., t)``)
  hashes for ever;
- ``PUT n`` grows the memo array to ``n`` entries: a 12-byte pickle asks for gigabytes.

This pass walks the opcodes once, simulating the stack with a few integers per object, and
refuses (before the C unpickler runs) a pickle whose containers nest deeper than
:data:`MAX_DEPTH`, whose memo indices run ahead of the values stored so far, or whose dict
keys, set members and call arguments would take more than a budget proportional to the file
to hash. Everything else the unpickler builds is made by at least one opcode byte per
element, so its size is already linear in the file.
"""
from __future__ import annotations

import pickle
import struct

MAX_DEPTH = 100  # DeepSpeed's files nest fewer than 20 levels
_CAP = 1 << 40  # costs saturate here, so they stay small ints


class BoundsExceeded(pickle.UnpicklingError):
    """The pickle would make zerofast crash, or work or allocate without bound; it is refused."""


class PickleBoundsError(BoundsExceeded):
    """Found by the pre-pass: the C unpickler has not run."""


# A record per simulated object: [depth, cost to hash it, cost to hash each of its items, the
# items' records (tuples only)]. Scalars share one record, which is never updated.
_SCALAR = (0, 1, 0, None)


def _reach(r) -> int:
    """What hashing ``r``, its items, and its items' items can cost (a callee iterating them)."""
    total = r[1] + r[2]
    if r[3] is not None:
        for i in r[3]:
            total += i[1] + i[2]
    return min(total, _CAP)


_FIXED = {  # opcode -> argument bytes, for opcodes that push one scalar
    ord("J"): 4, ord("K"): 1, ord("G"): 8, ord("M"): 2, ord("N"): 0, 0x88: 0, 0x89: 0, 0x82: 1, 0x83: 2, 0x84: 4,
}
_SIZED = {  # opcode -> (length field bytes, struct format): a length-prefixed scalar
    ord("T"): (4, "<i"), ord("U"): (1, "<B"), ord("X"): (4, "<I"), 0x8C: (1, "<B"), 0x8D: (8, "<Q"),
    ord("B"): (4, "<I"), ord("C"): (1, "<B"), 0x8E: (8, "<Q"), 0x96: (8, "<Q"), 0x8A: (1, "<B"), 0x8B: (4, "<i"),
}
_LINE = {ord(c) for c in "FILSVP"}  # text argument up to a newline; pushes one scalar
_FIXED_WIDTH = [_FIXED.get(op, -1) for op in range(256)]
_EMPTY_TUPLE = (1, 1, 0, ())  # immutable, like the tuple: shared


class _Scan:
    def __init__(self, data: bytes):
        self.data = data
        self.stack: list = []
        self.marks: list[int] = []
        self.memo: list = []
        self.hash_budget = 8 * len(data) + (1 << 20)

    # -- stack --------------------------------------------------------------------------------
    def underflow(self) -> PickleBoundsError:
        return pickle.UnpicklingError("unexpected MARK found" if self.marks else "unpickling stack underflow")

    def pop(self):
        if len(self.stack) <= (self.marks[-1] if self.marks else 0):
            raise self.underflow()
        return self.stack.pop()

    def pop_mark(self) -> list:
        if not self.marks:
            raise pickle.UnpicklingError("could not find MARK")
        start = self.marks.pop()
        items = self.stack[start:]
        del self.stack[start:]
        return items

    def top(self):
        if len(self.stack) <= (self.marks[-1] if self.marks else 0):
            raise self.underflow()
        return self.stack[-1]

    # -- costs --------------------------------------------------------------------------------
    def charge(self, cost: int) -> None:
        self.hash_budget -= cost
        if self.hash_budget < 0:
            raise PickleBoundsError(
                f"its dict keys, set members and call arguments would take more than {8 * len(self.data)} steps to "
                "hash (shared or deeply nested tuples)")

    def depth(self, items) -> int:
        depth = 1 + max((r[0] for r in items), default=0)
        if depth > MAX_DEPTH:
            raise PickleBoundsError(f"its containers nest deeper than {MAX_DEPTH} levels")
        return depth

    def container(self, items) -> list:
        return [self.depth(items), 1, min(sum(r[1] for r in items), _CAP), None]

    def tuple_(self, items) -> list:
        # A tuple's hash recurses into its items; it is immutable, so its cost is exact. Its
        # items stay reachable: a callee given the tuple as its arguments iterates them.
        depth = cost = 0
        for r in items:
            cost += r[1]
            if r[0] > depth:
                depth = r[0]
        if depth >= MAX_DEPTH:
            raise PickleBoundsError(f"its containers nest deeper than {MAX_DEPTH} levels")
        cost = min(1 + cost, _CAP)
        return [depth + 1, cost, cost - 1, items]

    def add(self, target, items, keys) -> None:
        """``items`` go into the container ``target`` (APPEND, SETITEM, ...); ``keys`` get hashed."""
        self.charge(sum(k[1] for k in keys))
        if target is not _SCALAR and target[3] is None:
            target[0] = max(target[0], self.depth(items))
            target[2] = min(target[2] + sum(r[1] for r in items), _CAP)

    def call(self, parts) -> list:
        """An allowlisted global called with ``parts`` (REDUCE, NEWOBJ, BUILD, ...). ``set`` and
        ``OrderedDict`` hash what their argument holds, now: that is charged from the argument's
        current records. The result may hold the arguments."""
        reach = depth = 0
        cost = 1
        for r in parts:  # _reach, inlined: one call per tensor of the file
            reach += r[1] + r[2]
            if r[3]:
                for i in r[3]:
                    reach += i[1] + i[2]
            cost += r[1]
            if r[0] > depth:
                depth = r[0]
        if depth >= MAX_DEPTH:
            raise PickleBoundsError(f"its containers nest deeper than {MAX_DEPTH} levels")
        self.charge(reach)
        return [depth + 1, min(cost, _CAP), min(reach, _CAP), None]

    def put(self, index: int) -> None:
        # The C unpickler sizes its memo array by the largest index; pickles number their
        # values 0, 1, 2, ... as they store them.
        if index < 0 or index > len(self.memo):
            raise PickleBoundsError(f"memo index {index} runs ahead of the {len(self.memo)} values stored so far")
        value = self.top()
        if index == len(self.memo):
            self.memo.append(value)
        else:
            self.memo[index] = value

    def get(self, index: int) -> None:
        if index >= len(self.memo):
            raise pickle.UnpicklingError(f"Memo value not found at index {index}")
        self.stack.append(self.memo[index])

    # -- the walk -----------------------------------------------------------------------------
    def line(self, pos: int) -> tuple[bytes, int]:
        end = self.data.find(b"\n", pos)
        if end < 0:
            raise pickle.UnpicklingError("pickle data was truncated")
        return self.data[pos:end], end + 1

    def run(self) -> int:
        # The frequent opcodes of a torch.save pickle are handled inline, most frequent first:
        # this runs once per opcode of files with hundreds of thousands of tensors.
        data, stack, memo, marks, n = self.data, self.stack, self.memo, self.marks, len(self.data)
        fixed, sized = _FIXED_WIDTH, _SIZED
        fence = 0  # the stack below the last mark is out of reach, as in the C unpickler
        pos = 0
        while pos < n:
            op = data[pos]
            pos += 1
            width = fixed[op]
            if width >= 0:
                pos += width
                stack.append(_SCALAR)
            elif op == 0x72 or op == 0x71:  # LONG_BINPUT, BINPUT
                width = 4 if op == 0x72 else 1
                index = int.from_bytes(data[pos:pos + width], "little")
                pos += width
                if pos > n:
                    break
                if index == len(memo) and len(stack) > fence:
                    memo.append(stack[-1])
                else:
                    self.put(index)
            elif op == 0x68 or op == 0x6A:  # BINGET, LONG_BINGET
                width = 1 if op == 0x68 else 4
                index = int.from_bytes(data[pos:pos + width], "little")
                pos += width
                if index >= len(memo):
                    raise pickle.UnpicklingError(f"Memo value not found at index {index}")
                stack.append(memo[index])
            elif op == 0x28:  # MARK
                fence = len(stack)
                marks.append(fence)
            elif op in sized:
                width, fmt = sized[op]
                if pos + width > n:
                    break
                (length,) = struct.unpack_from(fmt, data, pos)
                if length < 0:
                    raise pickle.UnpicklingError("negative byte count")
                pos += width + length
                stack.append(_SCALAR)
            elif op == 0x85:  # TUPLE1
                if len(stack) <= fence:
                    raise self.underflow()
                r = stack[-1]
                if r[0] >= MAX_DEPTH:
                    raise PickleBoundsError(f"its containers nest deeper than {MAX_DEPTH} levels")
                cost = min(r[1] + 1, _CAP)
                stack[-1] = [r[0] + 1, cost, cost - 1, [r]]
            elif op == 0x74:  # TUPLE
                stack.append(self.tuple_(self.pop_mark()))
                fence = marks[-1] if marks else 0
            elif op == 0x52:  # REDUCE
                if len(stack) - 2 < fence:
                    raise self.underflow()
                args = stack.pop()
                stack[-1] = self.call([stack[-1], args])
            elif op == 0x51:  # BINPERSID
                if len(stack) <= fence:
                    raise self.underflow()
                stack[-1] = _SCALAR
            elif op == 0x29:  # EMPTY_TUPLE
                stack.append(_EMPTY_TUPLE)
            elif op in _LINE:
                _, pos = self.line(pos)
                stack.append(_SCALAR)
            elif op == 0x2E:  # STOP
                return pos
            else:
                pos = self.structural(op, pos)
                fence = marks[-1] if marks else 0
        raise pickle.UnpicklingError("pickle data was truncated")

    def structural(self, op: int, pos: int) -> int:
        # TUPLE, TUPLE1, EMPTY_TUPLE, REDUCE and BINPERSID are handled in ``run``.
        if op == 0x86 or op == 0x87:  # TUPLE2, TUPLE3
            items = [self.pop() for _ in range(op - 0x84)]
            items.reverse()
            self.stack.append(self.tuple_(items))
        elif op == 0x94:  # MEMOIZE
            self.put(len(self.memo))
        elif op == 0x70:  # PUT
            text, pos = self.line(pos)
            self.put(_decimal(text))
        elif op == 0x67:  # GET
            text, pos = self.line(pos)
            self.get(_decimal(text))
        elif op in (0x5D, 0x7D, 0x8F):  # EMPTY_LIST, EMPTY_DICT, EMPTY_SET
            self.stack.append([1, 1, 0, None])
        elif op == 0x61:  # APPEND
            item = self.pop()
            self.add(self.top(), [item], ())
        elif op == 0x65:  # APPENDS
            items = self.pop_mark()
            self.add(self.top(), items, ())
        elif op == 0x73:  # SETITEM
            value, key = self.pop(), self.pop()
            self.add(self.top(), [key, value], [key])
        elif op == 0x75:  # SETITEMS
            items = self.pop_mark()
            self.add(self.top(), items, items[0::2])
        elif op == 0x90:  # ADDITEMS
            items = self.pop_mark()
            self.add(self.top(), items, items)
        elif op == 0x6C:  # LIST
            items = self.pop_mark()
            self.stack.append(self.container(items))
        elif op == 0x64:  # DICT
            items = self.pop_mark()
            self.charge(sum(k[1] for k in items[0::2]))
            self.stack.append(self.container(items))
        elif op == 0x91:  # FROZENSET: its hash combines its members' stored hashes, no recursion
            items = self.pop_mark()
            self.charge(sum(k[1] for k in items))
            record = self.container(items)
            record[1] = 1 + len(items)
            self.stack.append(record)
        elif op == 0x81:  # NEWOBJ
            args = self.pop()
            cls = self.pop()
            self.stack.append(self.call([cls, args]))
        elif op == 0x92:  # NEWOBJ_EX
            kwargs, args = self.pop(), self.pop()
            cls = self.pop()
            self.stack.append(self.call([cls, args, kwargs]))
        elif op == 0x62:  # BUILD: the state goes into the instance on the stack
            state = self.pop()
            inst = self.top()
            self.charge(_reach(state))  # a plain instance hashes the state dict's keys into its own
            self.add(inst, [state], ())
        elif op == 0x6F:  # OBJ
            self.stack.append(self.call(self.pop_mark()))
        elif op == 0x69:  # INST: module and name on two lines, arguments since the mark
            _, pos = self.line(pos)
            _, pos = self.line(pos)
            self.stack.append(self.call(self.pop_mark()))
        elif op == 0x63:  # GLOBAL
            _, pos = self.line(pos)
            _, pos = self.line(pos)
            self.stack.append(_SCALAR)
        elif op == 0x93:  # STACK_GLOBAL
            self.pop()
            self.pop()
            self.stack.append(_SCALAR)
        elif op == 0x30:  # POP
            if self.stack and len(self.stack) > (self.marks[-1] if self.marks else 0):
                self.stack.pop()
            elif self.marks:
                self.pop_mark()
            else:
                raise self.underflow()
        elif op == 0x31:  # POP_MARK
            self.pop_mark()
        elif op == 0x32:  # DUP
            self.stack.append(self.top())
        elif op == 0x80:  # PROTO
            pos += 1
        elif op == 0x95:  # FRAME: a length; the opcodes inside follow as usual
            pos += 8
        elif op == 0x98:  # READONLY_BUFFER
            self.top()
        else:  # NEXT_BUFFER (no buffers are given) or not an opcode: the unpickler stops here
            raise pickle.UnpicklingError(f"invalid load key, '{chr(op)}'." if op < 0x80 else
                                         f"invalid load key, '\\x{op:02x}'.")
        return pos


def _decimal(text: bytes) -> int:
    try:
        return int(text)
    except ValueError:
        raise pickle.UnpicklingError("pickle data has an invalid memo index") from None


def check_pickle(data: bytes) -> None:
    """Raise :class:`PickleBoundsError` (or the ``UnpicklingError`` the C unpickler would raise)
    if unpickling ``data`` could crash or run without bound. Linear in ``len(data)``."""
    _Scan(data).run()
