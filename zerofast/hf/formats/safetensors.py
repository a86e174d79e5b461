"""safetensors, streamed: the header is laid out first and the data region sized up front, then
the executor's batch reader writes each tensor at its offset straight from the checkpoint files
(``copy_file_range``, or ``pwrite`` with the cast fused; see ``zerofast.execute.read_batch``).
Executors without one (a GPU computing) fill a memory-mapped window of the file instead, one
window (``windows.WINDOW_BYTES``) at a time. The data is written once, and memory stays flat whatever
the model size. Each native call is sized to take about :data:`_CALL_SECONDS`, so that a signal
(Ctrl-C, SIGTERM) is handled within a fraction of a second whatever the disk's speed.

:func:`read` is the one safetensors reader of the package (``load_exported``, and a base model's
weights for ``--merge-adapters``): the header checked against the file, the tensors memory-mapped,
without the safetensors package.
"""
from __future__ import annotations

import json
import math
from itertools import chain
from json.encoder import encode_basestring_ascii
import mmap
import os
import struct
import time
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from ...dtypes import SAFETENSORS_CODES
from ...errors import ExportError
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


def read(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors of a safetensors file, memory-mapped copy-on-write, and its string metadata."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        try:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError(f"a header of {n} bytes in a file of {size}")
            header = json.loads(f.read(n))
            if not isinstance(header, dict):
                raise ValueError(f"the header is a JSON {type(header).__name__}, not an object")
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else b""
        except (struct.error, ValueError, RecursionError) as e:
            raise ExportError(f"expected a safetensors file, could not read its header ({e})", path) from None
    metadata = header.pop("__metadata__", None)
    return {key: _tensor(data, info, 8 + n, size, key, path) for key, info in header.items()}, (
        metadata if isinstance(metadata, dict) else {})


def _tensor(data, info, start: int, size: int, key: str, path: Path) -> torch.Tensor:
    try:
        dtype, shape, (lo, hi) = _DTYPES[info["dtype"]], [int(s) for s in info["shape"]], info["data_offsets"]
        lo, hi = int(lo), int(hi)
    except (KeyError, TypeError, ValueError):
        raise ExportError(f"tensor {key!r} has a header entry safetensors does not define: {info!r}"[:300],
                          path) from None
    count = math.prod(shape)
    if min(shape, default=0) < 0 or not 0 <= lo <= hi <= size - start or hi - lo != count * dtype.itemsize:
        raise ExportError(f"tensor {key!r} claims bytes [{lo}, {hi}), which do not fit its shape {shape} "
                          "inside the file", path)
    if not count:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype, count=count, offset=start + lo).reshape(shape)


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
