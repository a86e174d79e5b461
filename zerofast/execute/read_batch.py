"""Step 4 for whole passes: many tensors per native call, read from the checkpoint files.

The eager dict and the export move every tensor once, so they hand the native op
(``torch.ops.zerofast.read_cast``, csrc/cpu/read_cast.cpp) the whole batch with its plan packed
into int64 tables of about :data:`CALL_ROWS` rows each. The op reads each source with ``pread`` from the file it was mapped from,
on a pool of reader threads, straight into the output when no cast is needed; the export writes
with ``pwrite`` or ``copy_file_range``. Neither touches the source mappings, so there are no page
faults on the input and no pages to drop afterwards. A source that is not a live view of its file
(a copy made to fit, a file changed since it was read) is copied from memory in the same call.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from itertools import chain
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

from ..base.settings import reader_count, settings
from ..native import ops
from ..load.residency import resident_share
from ..load.archive import file_identity
from ..load.unpickle import file_location
from ..plan.columns import Placed, PlanTensors
from ..plan.model import TensorPlan

Location = tuple[int, tuple[int, int, int, int]]  # (byte offset in the file, file identity)


def locate(files: Sequence[str], sources: Sequence[torch.Tensor]) -> list[Location | None]:
    """Where each source's bytes sit in its file, for the sources that are views of one."""
    return [file_location(file, t) for file, t in zip(files, sources)]


class BatchReader:
    """Runs batches of a plan's tensors (:class:`~zerofast.plan.columns.PlanTensors`: a plan's,
    a selection of them, or :meth:`~zerofast.plan.columns.PlanTensors.of` plans made one by
    one) over ``sources``, in one native call each."""

    def __init__(self, files: Sequence[str], sources: Sequence[torch.Tensor],
                 locations: Sequence[Location | None]):
        self.files = files
        self.sources = list(sources)
        self.locations = locations
        self._resident: dict[frozenset[int], float | None] = {}  # see readers

    def read(self, tps: PlanTensors) -> list[torch.Tensor]:
        """Each of ``tps``, in their order, in fresh memory, in its shape: a call per output
        dtype and :data:`CALL_ROWS` segment rows, which makes the tensors too."""
        groups = _groups(tps)
        made: list[torch.Tensor | None] = [None] * len(tps)
        used = sources_used(rows[:, 0] for *_, rows, _ in groups)
        readers = self.readers(used)
        with self.opened(used) as (fds, offsets):
            for dtype, where, shapes, rows, counts in groups:
                outs = []
                for lo, hi, table in _calls(rows, counts):
                    part = shapes[lo:hi]
                    outs += ops.read_cast_new(self.sources, fds, offsets, table, list(chain.from_iterable(part)),
                                              list(map(len, part)), dtype, readers)
                if len(where) == len(tps):
                    return outs
                for i, out in zip(where.tolist(), outs):
                    made[i] = out
        return made

    def read_into(self, tps: PlanTensors, outs: Sequence[torch.Tensor]) -> None:
        """Each of ``tps`` into the contiguous CPU tensor of ``outs`` beside it (of its size, in
        its ``out_dtype``), a call per :data:`CALL_ROWS` segment rows; elements no segment
        writes keep what they held."""
        if len(tps):
            rows, counts = tps.table.rows, np.diff(tps.table.starts)
            used = sources_used([rows[:, 0]])
            readers = self.readers(used)
            with self.opened(used) as (fds, offsets):
                for lo, hi, table in _calls(rows, counts):
                    # contiguous: written by element index
                    ops.read_cast(self.sources, fds, offsets, table, outs[lo:hi], readers)

    def file_ranges(self, tps: PlanTensors) -> dict[str, list[tuple[int, int]]]:
        """The bytes of the files that ``tps`` read, by file: (byte offset, length) per segment
        row whose source is a view of its file (sources read from memory are left out)."""
        rows = tps.table.rows
        out: dict[str, list[tuple[int, int]]] = {}
        for src in sorted(sources_used([rows[:, 0]])):
            where = self.locations[src]
            if where is None:
                continue
            size = self.sources[src].element_size()
            mine = rows[rows[:, 0] == src]
            starts = (where[0] + mine[:, 1] * size).tolist()
            out.setdefault(self.files[src], []).extend(zip(starts, (mine[:, 3] * size).tolist()))
        return out

    def write(self, fd: int, placed: Placed | Sequence[tuple[TensorPlan, int]]) -> None:
        """Each tensor of ``placed`` at its byte offset (a :class:`~zerofast.plan.columns.Placed`;
        ``(plan, offset)`` pairs, a sliced tensor's, become one here) into file ``fd``, a call
        per output dtype and :data:`CALL_ROWS` segment rows."""
        placed = Placed.of(placed)
        groups, where_at, counts_of = _groups(placed.tensors), placed.offsets, placed.tensors.numels()
        used = sources_used(rows[:, 0] for *_, rows, _ in groups)
        readers = self.readers(used)
        with self.opened(used) as (fds, offsets):
            for dtype, where, _, rows, counts in groups:
                # copies: counts_of may be the plan's cached column, which the op must not share
                at, numels = torch.from_numpy(where_at[where]), torch.from_numpy(counts_of[where])
                for lo, hi, table in _calls(rows, counts):
                    ops.read_cast_to_file(self.sources, fds, offsets, table, fd, at[lo:hi], numels[lo:hi], dtype,
                                          readers)

    def readers(self, used: Iterable[int]) -> int:
        """The reader threads for a batch over the sources ``used``: one a core where the page
        cache holds them, more where the reads will wait on the disk (settings.reader_count).
        Sampled once per set of sources: the lookups of a lazy mapping ask again and again."""
        key = frozenset(used)
        if key not in self._resident:
            self._resident[key] = resident_share([self.sources[i] for i in sorted(key)])
        return reader_count(settings(), self._resident[key])

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


def _positions(values: list) -> dict[object, np.ndarray]:
    """Each distinct value, in first-seen order, with the positions that hold it (int64)."""
    distinct = list(dict.fromkeys(values))
    if len(distinct) == 1:
        return {distinct[0]: np.arange(len(values), dtype=np.int64)}
    code = {d: k for k, d in enumerate(distinct)}
    codes = np.fromiter(map(code.__getitem__, values), dtype=np.int64, count=len(values))
    return {d: np.flatnonzero(codes == k) for k, d in enumerate(distinct)}


def sources_used(columns: Iterable[np.ndarray]) -> set[int]:
    """The sources that columns of source indices name (a count per source: np.unique would
    import numpy.ma, 14 ms, on the first lookup)."""
    return set(chain.from_iterable(np.flatnonzero(np.bincount(c)).tolist() for c in columns))


# Segment rows per native call of a whole-plan read. One call for a batch of 200k ZeRO-3 tensors
# over 4 ranks held its 800k-row table, the op's work list and its copy while growing, all at
# the peak (about 100 MiB, README: Limits); a call per 64k rows keeps a few MiB, for a few
# calls' overhead (tens of microseconds each).
CALL_ROWS = 1 << 16

# (dtype, positions in the batch, shapes, their segment rows in order, rows per tensor)
_Group = tuple[torch.dtype, Sequence[int], Sequence[Sequence[int]], np.ndarray, np.ndarray]


def _groups(cols: PlanTensors) -> list[_Group]:
    """``cols`` by output dtype, read off its columns: no object per tensor."""
    groups = []
    for dtype, where in _positions(cols.out).items():
        whole = len(where) == len(cols)  # one output dtype: the table and the shapes as they are
        rows, counts = (cols.table.rows, np.diff(cols.table.starts)) if whole else cols.table.gather(where)
        shapes = cols.shapes if whole else list(map(cols.shapes.__getitem__, where.tolist()))
        groups.append((dtype, where, shapes, rows, counts))
    return groups


def _calls(rows: np.ndarray, counts: np.ndarray) -> Iterator[tuple[int, int, torch.Tensor]]:
    """The op's tables for a group (one tensor at least), a call's worth at a time: (first
    tensor, past the last, the table), of about :data:`CALL_ROWS` rows, never splitting a tensor."""
    ends = np.cumsum(counts)
    lo = 0
    while lo < len(counts):
        first = int(ends[lo - 1]) if lo else 0
        hi = min(len(counts), max(lo + 1, int(np.searchsorted(ends, first + CALL_ROWS, side="right"))))
        table = _table(np.arange(hi - lo, dtype=np.int64), rows[first:int(ends[hi - 1])], counts[lo:hi])
        yield lo, hi, torch.from_numpy(table)
        lo = hi


def _table(outputs: np.ndarray, rows: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The op's table: (output, source, source offset, output offset, length), each of
    ``outputs`` on its ``counts`` rows. Built from flat columns, not a list per row: a batch
    can hold hundreds of thousands."""
    table = np.empty((len(rows), 5), dtype=np.int64)
    table[:, 0] = np.repeat(outputs, counts)
    table[:, 1:] = rows
    return table
