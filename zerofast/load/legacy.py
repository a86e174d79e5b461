"""``torch.save``'s legacy (non-zip) format, as DeepSpeed writes it with
``"checkpoint": {"checkpoint_serialization": false}`` (internal).

The file is five pickles and the storages' bytes, back to back:

1. the magic number ``0x1950a86a20f9469cfc6c``; 2. the format version, 1001; 3. ``sys_info``
   (``little_endian``, the C type sizes); 4. the object, whose storages are persistent ids
   ``("storage", torch.<Dtype>Storage, key, location, numel, view)``; 5. the sorted list of the
   storage keys;

then, per key in that order, an 8-byte little-endian element count and that many elements of the
storage's dtype.

This module finds those offsets; :mod:`.archive` makes of them the same index a zip archive gets
(entries ``archive/data/<key>``), so that the restricted unpickler reads the object with the same
allowlist, bounds and size checks. The small pickles around it (magic number, version,
``sys_info``, the keys) are evaluated from their opcodes as plain data, with no lookup at all. The object's pickle is not run to learn each storage's
dtype: its opcodes are walked (:mod:`pickletools`, which builds nothing) with the stack effect of
each, the storage references read off the stack, and only their strings and numbers kept.
"""
from __future__ import annotations

import io
import os
import pickle
import pickletools
import struct
from pathlib import Path

import torch

from ..base.errors import CorruptCheckpointError, UnsupportedCheckpointError, short_repr

MAGIC = 0x1950A86A20F9469CFC6C
VERSION = 1001
# How the file starts: pickle protocol 2, LONG1 of 10 bytes, the magic number.
HEAD = b"\x80\x02\x8a\x0a" + MAGIC.to_bytes(10, "little")
MAX_HEADER = 4096  # bytes of the three small pickles
MAX_KEYS = 1 << 22
PREFIX = "archive"


def is_legacy(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(HEAD)) == HEAD
    except OSError:
        return False


def read_layout(path: Path, size: int) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The object's pickle and ``{storage key: (byte offset, byte length)}`` of a legacy file,
    each storage checked to lie inside the file, one after the other, the last ending it."""
    with open(path, "rb") as f:
        head = f.read(min(size, MAX_HEADER))
        obj_start = _header(path, head)
        f.seek(obj_start)
        kinds, obj_end = _storage_kinds(path, f)
        f.seek(obj_start)
        data = f.read(obj_end - obj_start)
        keys, at = _keys(path, f, obj_end)
        storages = {}
        for key in keys:
            if key not in kinds:
                raise CorruptCheckpointError(f"the legacy file lists storage {short_repr(key)} that its pickle never "
                                             "references", path)
            raw = os.pread(f.fileno(), 8, at)
            if len(raw) != 8:
                raise CorruptCheckpointError(f"the legacy file ends before storage {short_repr(key)}", path)
            numel = struct.unpack("<q", raw)[0]
            nbytes = numel * kinds[key]
            if numel < 0 or at + 8 + nbytes > size:
                raise CorruptCheckpointError(f"storage {short_repr(key)} of the legacy file declares {numel} "
                                             f"elements, more than the file holds", path)
            storages[key] = (at + 8, nbytes)
            at += 8 + nbytes
    if at != size:
        raise CorruptCheckpointError(f"expected the legacy file to end after its {len(keys)} storages at byte {at}, "
                                     f"found {size} bytes", path)
    missing = set(kinds) - set(keys)
    if missing:
        raise CorruptCheckpointError(f"the legacy file's pickle references storages it does not hold: "
                                     f"{short_repr(sorted(missing))}", path)
    return data, storages


def _header(path: Path, head: bytes) -> int:
    """The offset after the three small pickles, each checked."""
    f = io.BytesIO(head)
    values = []
    for what in ("magic number", "format version", "sys_info"):
        try:
            values.append(_small_pickle(f))
        except (ValueError, EOFError, pickle.UnpicklingError, struct.error) as e:
            raise CorruptCheckpointError(f"expected the legacy torch.save {what} pickle, found: {e}", path) from None
    magic, version, info = values
    if magic != MAGIC or version != VERSION:
        raise UnsupportedCheckpointError(f"expected a legacy torch.save file of format {VERSION}, found "
                                         f"{short_repr(version)}", path)
    if not isinstance(info, dict) or info.get("little_endian") is not True:
        raise UnsupportedCheckpointError(f"expected a little-endian legacy torch.save file, found sys_info "
                                         f"{short_repr(info)}", path)
    return f.tell()


def _small_pickle(f) -> object:
    """A pickle of plain data (numbers, strings, bools, None, lists, tuples, dicts), evaluated
    from its opcodes: nothing is looked up or called, any other opcode is refused."""
    stack: list = []
    memo: dict = {}
    for op, arg, _ in pickletools.genops(f):
        name = op.name
        if name == "STOP":
            return stack.pop()
        if name in _STRINGS or name in _NUMBERS or name == "NONE":
            stack.append(arg)
        elif name in ("NEWTRUE", "NEWFALSE"):
            stack.append(name == "NEWTRUE")
        elif name in ("EMPTY_DICT", "EMPTY_LIST"):
            stack.append({} if name == "EMPTY_DICT" else [])
        elif name == "MARK":
            stack.append(_MARK)
        elif name in ("BINPUT", "LONG_BINPUT", "PUT"):
            memo[arg] = stack[-1]
        elif name in ("BINGET", "LONG_BINGET", "GET"):
            stack.append(memo[arg])
        elif name in ("SETITEMS", "APPENDS", "TUPLE"):
            cut = len(stack) - 1 - stack[::-1].index(_MARK)
            items = stack[cut + 1:]
            del stack[cut:]
            if name == "TUPLE":
                stack.append(tuple(items))
            elif name == "APPENDS":
                stack[-1].extend(items)
            else:
                stack[-1].update(zip(items[::2], items[1::2]))
        elif name == "SETITEM":
            value, key = stack.pop(), stack.pop()
            stack[-1][key] = value
        elif name == "APPEND":
            stack[-2].append(stack.pop())
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            n = int(name[-1])
            items = tuple(stack[-n:])
            del stack[-n:]
            stack.append(items)
        elif name not in ("PROTO", "FRAME", "MEMOIZE"):
            raise ValueError(f"opcode {name} in a pickle of plain data")
        elif name == "MEMOIZE":
            memo[len(memo)] = stack[-1]
    raise EOFError("no STOP")


_STRINGS = {"BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING", "SHORT_BINSTRING"}
_NUMBERS = {"BININT", "BININT1", "BININT2", "INT", "LONG", "LONG1", "LONG4"}
_MARK = object()


def _storage_kinds(path: Path, f) -> tuple[dict[str, int], int]:
    """``{storage key: element size}`` for the object's storage references, and where its
    pickle ends. Only the stack's shape is followed; no object is built."""
    sizes = {f"torch {name}": dtype.itemsize for dtype, name in torch.storage._dtype_to_storage_type_map().items()
             if not name.startswith("Q")}  # the storage types the restricted unpickler resolves
    stack: list = []
    memo: dict = {}
    kinds: dict[str, int] = {}
    try:
        for op, arg, _ in pickletools.genops(f):
            name = op.name
            if name == "STOP":
                return kinds, f.tell()
            if name in _STRINGS or name in _NUMBERS or name == "NONE":
                stack.append(arg)
            elif name == "GLOBAL":
                stack.append(("global", arg))
            elif name == "MARK":
                stack.append(_MARK)
            elif name in ("BINPUT", "LONG_BINPUT", "PUT"):
                memo[arg] = stack[-1]
            elif name == "MEMOIZE":
                memo[len(memo)] = stack[-1]
            elif name in ("BINGET", "LONG_BINGET", "GET"):
                stack.append(memo[arg])
            elif name == "TUPLE":
                cut = len(stack) - 1 - stack[::-1].index(_MARK)
                items = tuple(stack[cut + 1:])
                del stack[cut:]
                stack.append(items)
            elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
                n = int(name[-1])
                items = tuple(stack[-n:])
                del stack[-n:]
                stack.append(items)
            elif name == "BINPERSID":
                _note_storage(path, stack.pop(), sizes, kinds)
                stack.append(None)
            else:
                _generic(op, stack)
    except (ValueError, IndexError, KeyError) as e:
        raise CorruptCheckpointError(f"expected a valid pickle in the legacy file, found: {e}", path) from None
    raise CorruptCheckpointError("expected the legacy file's pickle to end with STOP, found its end first", path)


def _generic(op, stack: list) -> None:
    """An opcode's effect on the stack's depth, with placeholders for what it makes."""
    before = op.stack_before
    if pickletools.markobject in before:
        cut = len(stack) - 1 - stack[::-1].index(_MARK)
        del stack[cut:]
        below = before.index(pickletools.markobject)
    else:
        below = len(before)
    if below:
        if below > len(stack):
            raise ValueError(f"{op.name} on a stack of {len(stack)}")
        del stack[-below:]
    stack.extend([None] * len(op.stack_after))


def _note_storage(path: Path, pid, sizes: dict[str, int], kinds: dict[str, int]) -> None:
    if not (isinstance(pid, tuple) and len(pid) == 6 and pid[0] == "storage" and isinstance(pid[1], tuple)
            and isinstance(pid[2], str)):
        raise CorruptCheckpointError(f"expected a legacy torch storage reference, found {short_repr(pid)}", path)
    if pid[5] is not None:
        raise UnsupportedCheckpointError("a legacy torch.save file with storage views (torch before 0.4) is not "
                                         "supported", path)
    size = sizes.get(pid[1][1])
    if size is None:
        raise CorruptCheckpointError(f"expected a torch storage type, found {short_repr(pid[1][1])}", path)
    if kinds.setdefault(pid[2], size) != size:
        raise CorruptCheckpointError(f"storage {short_repr(pid[2])} is referenced with two dtypes", path)


def _keys(path: Path, f, at: int) -> tuple[list[str], int]:
    f.seek(at)
    try:
        keys = _small_pickle(f)
    except (ValueError, EOFError, pickle.UnpicklingError, struct.error) as e:
        raise CorruptCheckpointError(f"expected the legacy file's list of storage keys, found: {e}", path) from None
    if not isinstance(keys, list) or len(keys) > MAX_KEYS or not all(type(k) is str for k in keys) \
            or len(set(keys)) != len(keys):
        raise CorruptCheckpointError(f"expected a list of distinct storage keys, found {short_repr(keys)}", path)
    return keys, f.tell()
