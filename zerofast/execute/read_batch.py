"""Step 4 for whole passes: many tensors per native call, read from the checkpoint files.

The eager dict and the export move every tensor once, so they hand the native op
(``torch.ops.zerofast.read_cast``, csrc/cpu/read_cast.cpp) the whole batch with its plan packed
into one int64 table. The op reads each source with ``pread`` from the file it was mapped from,
on a pool of reader threads, straight into the output when no cast is needed; the export writes
with ``pwrite`` or ``copy_file_range``. Neither touches the source mappings, so there are no page
faults on the input and no pages to drop afterwards. A source that is not a live view of its file
(a copy made to fit, a file changed since it was read) is copied from memory in the same call.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from itertools import chain, repeat
from operator import attrgetter
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

from .. import ops
from ..load.archive import file_identity
from ..load.unpickle import file_location
from ..plan.model import TensorPlan

Location = tuple[int, tuple[int, int, int, int]]  # (byte offset in the file, file identity)


def locate(files: Sequence[str], sources: Sequence[torch.Tensor]) -> list[Location | None]:
    """Where each source's bytes sit in its file, for the sources that are views of one."""
    return [file_location(file, t) for file, t in zip(files, sources)]


class BatchReader:
    """Runs batches of :class:`TensorPlan` over ``sources`` in one native call each."""

    def __init__(self, files: Sequence[str], sources: Sequence[torch.Tensor],
                 locations: Sequence[Location | None]):
        self.files = files
        self.sources = list(sources)
        self.locations = locations

    def read(self, tps: Sequence[TensorPlan]) -> list[torch.Tensor]:
        """Each of ``tps`` in fresh memory, in its shape: one call per output dtype, which makes
        the tensors too."""
        made: list[torch.Tensor | None] = [None] * len(tps)
        groups = [(dtype, where, group, _rows(group)) for dtype, (where, group) in _by_dtype(tps).items()]
        with self.opened(_used(rows for *_, rows in groups)) as (fds, offsets):
            for dtype, where, group, rows in groups:
                shapes = [tp.shape for tp in group]
                dims = list(chain.from_iterable(shapes))
                outs = ops.read_cast_new(self.sources, fds, offsets, rows, dims, list(map(len, shapes)), dtype)
                if len(where) == len(tps):
                    return outs
                for i, out in zip(where, outs):
                    made[i] = out
        return made

    def read_into(self, tps: Sequence[TensorPlan], outs: Sequence[torch.Tensor]) -> None:
        """Each of ``tps`` into the contiguous CPU tensor of ``outs`` beside it (of its size, in
        its ``out_dtype``), in one call; elements no segment writes keep what they held."""
        if tps:
            rows = _rows(tps)
            with self.opened(_used([rows])) as (fds, offsets):
                ops.read_cast(self.sources, fds, offsets, rows, outs)  # contiguous: written by element index

    def write(self, fd: int, placed: Sequence[tuple[TensorPlan, int]]) -> None:
        """Each ``(tp, byte offset)`` into file ``fd``, one call per output dtype."""
        groups = [(where, group, _rows(group)) for where, group in _by_dtype([tp for tp, _ in placed]).values()]
        with self.opened(_used(rows for *_, rows in groups)) as (fds, offsets):
            for where, group, rows in groups:
                dtype = group[0].out_dtype
                ops.read_cast_to_file(self.sources, fds, offsets, rows, fd,
                                      torch.tensor([placed[i][1] for i in where], dtype=torch.int64),
                                      torch.tensor([tp.numel for tp in group], dtype=torch.int64), dtype)

    @contextmanager
    def opened(self, used: Iterable[int] | None = None) -> Iterator[tuple[list[int], torch.Tensor]]:
        """An fd per source (-1: read it from memory, or not in ``used``) and its byte offset,
        the files open meanwhile. With ``used`` (source indices), only the files they are in are
        opened: a lazy lookup of one tensor of a save of thousands of expert files opens one or a few.

        A file whose identity changed since it was mapped (replaced, rewritten) is not read by
        name: its mapping still shows what was loaded and planned, so that is what is copied.
        """
        used = range(len(self.sources)) if used is None else set(used)
        opened: dict[str, int] = {}
        fds, offsets = [-1] * len(self.sources), [0] * len(self.sources)
        try:
            for i in sorted(used):
                file, loc = self.files[i], self.locations[i]
                if loc is None:
                    continue
                if file not in opened:
                    opened[file] = _open_same(file, loc[1])
                fds[i] = opened[file]
                offsets[i] = loc[0] if fds[i] >= 0 else 0
            yield fds, torch.tensor(offsets, dtype=torch.int64)
        finally:
            for fd in opened.values():
                if fd >= 0:
                    os.close(fd)


def _open_same(path: str, identity: tuple[int, int, int, int]) -> int:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return -1
    if file_identity(os.fstat(fd)) != identity:
        os.close(fd)
        return -1
    return fd


def _by_dtype(tps: Sequence[TensorPlan]) -> dict[torch.dtype, tuple[list[int], list[TensorPlan]]]:
    """``tps`` grouped by output dtype: (their positions in ``tps``, the plans)."""
    dtypes = list(map(attrgetter("out_dtype"), tps))
    distinct = list(dict.fromkeys(dtypes))
    if len(distinct) == 1:  # the usual batch: one call, no regrouping
        return {distinct[0]: (list(range(len(tps))), list(tps))}
    code = {d: k for k, d in enumerate(distinct)}
    codes = np.fromiter(map(code.__getitem__, dtypes), dtype=np.int64, count=len(dtypes))
    groups = {}
    for k, dtype in enumerate(distinct):
        where = np.flatnonzero(codes == k).tolist()
        groups[dtype] = (where, list(map(tps.__getitem__, where)))
    return groups


def _used(tables: Iterable[torch.Tensor]) -> set[int]:
    """The sources the op's tables read (a count per source: np.unique would import numpy.ma,
    14 ms, on the first lookup)."""
    return set(chain.from_iterable(np.flatnonzero(np.bincount(t[:, 1].numpy())).tolist() for t in tables))


def _rows(tps: Sequence[TensorPlan]) -> torch.Tensor:
    """The plan as the op's table: (output, source, source offset, output offset, length).
    Built from flat columns, not a list per row: a batch can hold hundreds of thousands. The
    segments that are views of a plan's :class:`SegmentTable` are taken from it a table at a
    time, without a Python object per row; the op reads rows in any order."""
    segments = [tp.segments for tp in tps]
    tables = list(map(getattr, segments, repeat("table"), repeat(None)))
    distinct = list(dict.fromkeys(tables))
    if distinct == [None]:
        return torch.from_numpy(_table(np.arange(len(segments), dtype=np.int64), *_tuple_rows(segments)))
    code = {id(t): k for k, t in enumerate(distinct)}
    codes = np.fromiter(map(code.__getitem__, map(id, tables)), dtype=np.int64, count=len(tables))
    index = np.fromiter(map(getattr, segments, repeat("number"), repeat(-1)), dtype=np.int64, count=len(tables))
    parts = []
    for k, table in enumerate(distinct):
        at = np.flatnonzero(codes == k) if len(distinct) > 1 else np.arange(len(tables), dtype=np.int64)
        if table is None:
            parts.append(_table(at, *_tuple_rows([segments[i] for i in at.tolist()])))
        else:
            rows, counts = table.gather(index[at])
            parts.append(_table(at, rows, counts))
    return torch.from_numpy(parts[0] if len(parts) == 1 else np.concatenate(parts))


def _tuple_rows(segments: Sequence) -> tuple[np.ndarray, np.ndarray]:
    counts = np.fromiter(map(len, segments), dtype=np.int64, count=len(segments))
    rows = np.fromiter(chain.from_iterable(chain.from_iterable(segments)), dtype=np.int64,
                       count=4 * int(counts.sum())).reshape(-1, 4)
    return rows, counts


def _table(outputs: np.ndarray, rows: np.ndarray, counts: np.ndarray) -> np.ndarray:
    table = np.empty((len(rows), 5), dtype=np.int64)
    table[:, 0] = np.repeat(outputs, counts)
    table[:, 1:] = rows
    return table
