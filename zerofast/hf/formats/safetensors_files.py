"""safetensors, streamed: the header is laid out first and the data region sized up front, then
the executor's batch reader writes each tensor at its offset straight from the checkpoint files
(``copy_file_range``, or ``pwrite`` with the cast fused; see ``zerofast.execute.read_batch``).
Executors without one (a GPU computing) fill a memory-mapped window of the file instead, one
window (``windows.WINDOW_BYTES``) at a time. The data is written once, and memory stays flat whatever
the model size. Each native call is sized to take about :data:`_CALL_SECONDS`, so that a signal
(Ctrl-C, SIGTERM) is handled within a fraction of a second whatever the disk's speed.

:func:`read_header` is the one safetensors header parser of the package, with two policies: raise
(:func:`read`: ``load_exported``, and a base model's weights for ``--merge-adapters``, the tensors
memory-mapped without the safetensors package) or report and go on (``zerofast verify``).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from itertools import chain
from json.encoder import encode_basestring_ascii
import mmap
import os
import struct
import time
from pathlib import Path
from typing import BinaryIO, Iterator, Protocol, Sequence

import numpy as np
import torch

from ...base.dtypes import SAFETENSORS_CODES
from ...base.errors import ExportError, short_repr
from ...execute import Executor
from ...output.transaction import writing
from ...output.windows import reserve, write_windows
from ...plan.columns import Placed, PlanTensors
from ...plan.model import TensorPlan
from ..shards import ShardFile
from .base import TIED_KEY, Advance, WeightFormat

_BATCH_BYTES = 256 << 20  # the most one native call writes
_FIRST_BATCH = 16 << 20  # until the speed is known
_CALL_SECONDS = 0.1  # a signal waits at most about this long for the native call to return
_DTYPES = {code: dtype for dtype, code in SAFETENSORS_CODES.items()}


def header(tensors: PlanTensors, metadata: dict[str, str]) -> tuple[bytes, Placed]:
    """The file's first bytes (length prefix and JSON header) and each tensor's data offset.

    safetensors wants the data packed without gaps, so tensors go in by falling itemsize: every
    offset is then a multiple of its tensor's itemsize, and the typed views of the mapping are
    aligned (the header is padded so the data region starts at a multiple of 8). The JSON is
    ``json.dumps`` of the header dict (compact), written entry by entry from the columns.
    """
    sizes = tensors.itemsizes()
    if len(sizes) and bool((np.diff(sizes) > 0).any()):
        tensors = tensors.select(np.argsort(-sizes, kind="stable"))
    if "__metadata__" in tensors.names or not SAFETENSORS_CODES.keys() >= set(tensors.out):
        _refuse(tensors)
    nbytes = tensors.nbytes()
    ends = np.cumsum(nbytes)
    starts = ends - nbytes
    shapes = {s: ",".join(map(str, map(int, s))) for s in set(map(tuple, tensors.shapes))}  # a few distinct
    entries = [_ENTRY % e for e in zip(map(encode_basestring_ascii, tensors.names),
                                       map(SAFETENSORS_CODES.__getitem__, tensors.out),
                                       map(shapes.__getitem__, map(tuple, tensors.shapes)), starts.tolist(), ends.tolist())]
    raw = "".join(chain(('{"__metadata__":', json.dumps(metadata, separators=(",", ":"))), entries, "}")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, Placed(tensors, starts)


def _refuse(tensors: PlanTensors) -> None:
    """The error of the first tensor, in file order, that safetensors cannot store."""
    for name, dtype in zip(tensors.names, tensors.out):
        if name == "__metadata__":
            # The name of the header's metadata entry: the file would lose one or the other.
            raise ExportError("a tensor named '__metadata__' cannot be stored in safetensors, whose header uses that "
                              "name for its metadata; use --format torch")
        if dtype not in SAFETENSORS_CODES:
            raise ExportError(f"{name!r} has dtype {dtype}, which safetensors cannot store; use --format torch")


_ENTRY = ',%s:{"dtype":"%s","shape":[%s],"data_offsets":[%d,%d]}'


def write(path: Path, file: ShardFile, metadata: dict[str, str] | None, executor: Executor,
          advance: Advance) -> None:
    head, placed = header(file.tensors, metadata or {})
    with writing(path), open(path, "w+b") as f:
        f.write(head)
        f.flush()
        reserve(f.fileno(), 0, len(head) + file.nbytes)
        if executor.batch is not None:  # read and written by the native op, no mapping on either side
            pace = _Pace()
            for batch, nbytes in _batches(placed, len(head), pace):
                started = time.monotonic()
                executor.batch.write(f.fileno(), batch)
                pace.record(nbytes, time.monotonic() - started)
                advance(nbytes)
            return
        write_windows(f.fileno(), placed, len(head), executor, advance)


class _Pace:
    """How many bytes one native call may take: what the last call wrote in ``_CALL_SECONDS``,
    between ``_FIRST_BATCH / 4`` and ``_BATCH_BYTES``."""

    def __init__(self) -> None:
        self.limit = min(_FIRST_BATCH, _BATCH_BYTES)

    def record(self, nbytes: int, seconds: float) -> None:
        rate = nbytes / max(seconds, 1e-6)
        floor = min(_FIRST_BATCH // 4, _BATCH_BYTES)
        self.limit = int(min(_BATCH_BYTES, max(floor, rate * _CALL_SECONDS)))


def _batches(placed: Placed, base: int, pace: _Pace) -> Iterator[tuple[Sequence[tuple[TensorPlan, int]], int]]:
    """(tensor, file offset) in groups of about ``pace.limit`` bytes, each with its bytes: one
    native call each, and a progress report in between. Whole tensors go as a :class:`Placed`
    part of ``placed``; a tensor larger than the limit is cut into slices, a group each."""
    numels = placed.tensors.numels()
    sizes = numels * placed.tensors.itemsizes()
    ends = np.cumsum(sizes)
    lo = 0
    while lo < len(sizes):
        if sizes[lo] > pace.limit and numels[lo] > 1:
            yield from _slices(placed[lo], base, pace)
            lo += 1
            continue
        done = int(ends[lo - 1]) if lo else 0
        # whole tensors up to the first that fills the limit, none larger than it
        hi = min(int(np.searchsorted(ends, done + pace.limit, side="left")) + 1, len(sizes))
        big = np.flatnonzero((sizes[lo:hi] > pace.limit) & (numels[lo:hi] > 1))
        hi = lo + int(big[0]) if len(big) and big[0] > 0 else hi
        yield placed.part(lo, hi, base), int(ends[hi - 1]) - done
        lo = hi


def _slices(placed: tuple[TensorPlan, int], base: int, pace: _Pace) -> Iterator[tuple[list, int]]:
    """One tensor larger than the limit, a slice of about ``pace.limit`` bytes a call."""
    tp, off = placed
    lo, itemsize = 0, tp.out_dtype.itemsize
    while lo < tp.numel:
        hi = min(tp.numel, lo + max(1, pace.limit // itemsize))
        yield [(tp.slice(lo, hi), base + off + lo * itemsize)], (hi - lo) * itemsize
        lo = hi


HEADER_LIMIT = 100_000_000  # the safetensors project's bound on the header (MAX_HEADER_SIZE)


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors header: its bytes are ``[begin, end)`` of the data region."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass
class Header:
    """A safetensors file's header as :func:`read_header` found it."""

    size: int  # of the file
    start: int  # where the data region begins: 8 + the header's length
    entries: dict[str, Entry]  # the well-formed entries whose bytes are in the file, in header order
    metadata: dict[str, str]
    cut: list[str] = field(default_factory=list)  # well-formed entries whose bytes run past the end


class Problem(Protocol):
    def __call__(self, check: str, name: str, message: str, **detail) -> None: ...


def read_header(path: Path, problem: Problem | None = None, file: BinaryIO | None = None) -> Header | None:
    """The header of the safetensors file at ``path``, checked as the safetensors project checks
    it: a length prefix within the file and at most :data:`HEADER_LIMIT`; UTF-8 JSON holding an
    object, no key twice; ``__metadata__`` an object of strings; each entry a known dtype, a shape
    of non-negative integers and ``data_offsets`` ``[begin, end]`` of exactly its bytes; the
    entries' bytes tiling the data region, without holes or overlaps, up to the end of the file
    and nothing past it.

    Two policies. Without ``problem`` (loading), the first problem raises an :class:`ExportError`
    naming the file. With it (``verify``), each problem is passed to ``problem(check, name,
    message, **detail)``, as ``Report.add`` takes it, and reading goes on: a malformed entry is
    left out, one whose bytes lie past the end of a truncated file is listed in ``cut``, and None
    is returned only where the header itself cannot be read. ``check`` is ``"files"``, or
    ``"truncated"`` for a file shorter than its header says."""
    if file is None:
        with open(path, "rb") as f:
            return read_header(path, problem, f)
    path = Path(path)

    def bad(message: str, check: str = "files", name: str | None = None, **detail) -> None:
        if problem is None:
            raise ExportError(message, path)
        problem(check, name or path.name, message, **detail)

    size = os.fstat(file.fileno()).st_size
    prefix = file.read(8)
    if len(prefix) < 8:
        return bad(f"expected a safetensors file, it has only {size} bytes")
    (n,) = struct.unpack("<Q", prefix)
    if n > min(size - 8, HEADER_LIMIT):
        limit = "" if n <= HEADER_LIMIT else f", more than the {HEADER_LIMIT:,} safetensors allows"
        return bad(f"expected a safetensors file, could not read its header (a header of {n:,} bytes in a file "
                   f"of {size:,}{limit})")
    try:
        head = json.loads(file.read(n).decode("utf-8"), object_pairs_hook=_unique)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return bad(f"expected a safetensors file, could not read its header ({type(e).__name__}: {str(e)[:200]})")
    if not isinstance(head, dict):
        return bad(f"expected a safetensors file, its header is a JSON {type(head).__name__}, not an object")
    start = 8 + n
    metadata = head.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    elif not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        bad(f"its header's __metadata__ is not an object of strings: {short_repr(metadata, 200)}")
        metadata = {}
    entries: dict[str, Entry] = {}
    for name, info in head.items():
        entry = _entry(name, info, bad)
        if entry is not None:
            entries[name] = entry
    found = Header(size, start, {}, metadata)
    end = _tile(entries, bad)
    data = size - start
    for name, entry in entries.items():
        if entry.end <= data:
            found.entries[name] = entry
        else:
            found.cut.append(name)
    if end > data:
        bad(f"the file has {size:,} bytes, its header needs {start + end:,}: {len(found.cut)} tensors are cut off",
            "truncated", size=size, expected=start + end)
    elif end < data:
        bad(f"the file has {data - end:,} bytes past its last tensor's, which no tensor holds")
    return found


def _unique(pairs: list[tuple[str, object]]) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {short_repr(key, 100)} appears twice")
        out[key] = value
    return out


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _entry(name: str, info, bad) -> Entry | None:
    """The header entry ``name``, or None after ``bad`` was told what is wrong with it."""
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        keys = sorted(map(str, info)) if isinstance(info, dict) else type(info).__name__
        return bad(f"header entry {name!r} is not a safetensors tensor entry: expected the keys data_offsets, dtype "
                   f"and shape, found {short_repr(keys, 200)}")
    code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(code, str) or code not in _DTYPES:
        return bad(f"header entry {name!r} has dtype {short_repr(code, 60)}, which safetensors does not define")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        return bad(f"header entry {name!r} has shape {short_repr(shape, 100)}, not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_int, offsets))
            and 0 <= offsets[0] <= offsets[1]):
        return bad(f"header entry {name!r} has data_offsets {short_repr(offsets, 100)}, not [begin, end] with "
                   "0 <= begin <= end")
    dtype, (lo, hi) = _DTYPES[code], offsets
    nbytes = math.prod(shape) * dtype.itemsize
    if hi - lo != nbytes:
        return bad(f"tensor {name!r} claims bytes [{lo}, {hi}), which do not fit its shape {shape} of {code} "
                   f"({nbytes:,} bytes)", name=name)
    return Entry(dtype, tuple(shape), lo, hi)


def _tile(entries: dict[str, Entry], bad) -> int:
    """Where the entries' bytes end, after ``bad`` was told of each hole and overlap among them."""
    end, last = 0, None
    for name, e in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        if e.begin > end:
            bad(f"bytes [{end}, {e.begin}) of its data, before tensor {name!r}, belong to no tensor")
        elif e.begin < end:
            bad(f"tensor {name!r} claims bytes [{e.begin}, {e.end}), which overlap those of {last!r}")
        if e.end >= end:
            end, last = e.end, name
    return end


def read(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors of a safetensors file, memory-mapped copy-on-write, and its string metadata;
    an :class:`ExportError` naming the file for anything :func:`read_header` refuses."""
    with open(path, "rb") as f:
        head = read_header(path, file=f)
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    return {name: _tensor(data, head.start, e) for name, e in head.entries.items()}, head.metadata


def _tensor(data, start: int, e: Entry) -> torch.Tensor:
    count = math.prod(e.shape)
    if not count:
        return torch.empty(e.shape, dtype=e.dtype)
    return torch.frombuffer(data, dtype=e.dtype, count=count, offset=start + e.begin).reshape(e.shape)


def file_metadata(tied: dict[str, str], count: int) -> dict[str, str]:
    # transformers refuses a safetensors file whose metadata lacks format "pt"
    metadata = {"format": "pt"}
    if tied and count == 1:
        metadata[TIED_KEY] = json.dumps(tied, sort_keys=True)
    return metadata


def index_metadata(tied: dict[str, str]) -> dict:
    return {TIED_KEY: json.dumps(tied, sort_keys=True)} if tied else {}


FORMAT = WeightFormat("safetensors", "model.safetensors", "model-{:05d}-of-{:05d}.safetensors",
                      "model.safetensors.index.json", aliases_in_files=False, write=write, read=read,
                      file_metadata=file_metadata, index_metadata=index_metadata)
