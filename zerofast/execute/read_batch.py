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
from itertools import chain
from typing import Iterator, Sequence

import numpy as np
import torch

from .. import ops
from ..load.unpickle import file_identity, file_location
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
        with self.opened(tps) as (fds, offsets):
            for dtype, (where, group) in _by_dtype(tps).items():
                dims = [d for tp in group for d in tp.shape]
                ranks = [len(tp.shape) for tp in group]
                outs = ops.read_cast_new(self.sources, fds, offsets, _rows(group), dims, ranks, dtype)
                for i, out in zip(where, outs):
                    made[i] = out
        return made

    def read_into(self, tps: Sequence[TensorPlan], outs: Sequence[torch.Tensor]) -> None:
        """Each of ``tps`` into the contiguous CPU tensor of ``outs`` beside it (of its size, in
        its ``out_dtype``), in one call; elements no segment writes keep what they held."""
        if tps:
            with self.opened(tps) as (fds, offsets):
                ops.read_cast(self.sources, fds, offsets, _rows(tps), [o.view(-1) for o in outs])

    def write(self, fd: int, placed: Sequence[tuple[TensorPlan, int]]) -> None:
        """Each ``(tp, byte offset)`` into file ``fd``, one call per output dtype."""
        with self.opened([tp for tp, _ in placed]) as (fds, offsets):
            for dtype, (where, group) in _by_dtype([tp for tp, _ in placed]).items():
                ops.read_cast_to_file(self.sources, fds, offsets, _rows(group), fd,
                                      torch.tensor([placed[i][1] for i in where], dtype=torch.int64),
                                      torch.tensor([tp.numel for tp in group], dtype=torch.int64), dtype)

    @contextmanager
    def opened(self, tps: Sequence[TensorPlan] | None = None) -> Iterator[tuple[list[int], torch.Tensor]]:
        """An fd per source (-1: read it from memory, or not used by ``tps``) and its byte offset,
        the files open meanwhile. With ``tps``, only the files they read are opened: a lazy lookup
        of one tensor of a save of thousands of expert files opens one or a few.

        A file whose identity changed since it was mapped (replaced, rewritten) is not read by
        name: its mapping still shows what was loaded and planned, so that is what is copied.
        """
        used = range(len(self.sources)) if tps is None else {seg[0] for tp in tps for seg in tp.segments}
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
    dtypes = [tp.out_dtype for tp in tps]
    if len(set(dtypes)) == 1:  # the usual batch: one call, no regrouping
        return {dtypes[0]: (list(range(len(tps))), list(tps))}
    groups: dict[torch.dtype, tuple[list[int], list[TensorPlan]]] = {}
    for i, tp in enumerate(tps):
        where, group = groups.setdefault(tp.out_dtype, ([], []))
        where.append(i)
        group.append(tp)
    return groups


def _rows(tps: Sequence[TensorPlan]) -> torch.Tensor:
    """The plan as the op's table: (output, source, source offset, output offset, length).
    Built from flat columns, not a list per row: a batch can hold hundreds of thousands."""
    segments = [tp.segments for tp in tps]
    counts = np.fromiter(map(len, segments), dtype=np.int64, count=len(segments))
    table = np.empty((int(counts.sum()), 5), dtype=np.int64)
    table[:, 0] = np.repeat(np.arange(len(tps), dtype=np.int64), counts)
    table[:, 1:] = np.fromiter(chain.from_iterable(chain.from_iterable(segments)), dtype=np.int64,
                               count=4 * len(table)).reshape(-1, 4)
    return torch.from_numpy(table)
