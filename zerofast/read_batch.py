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
from typing import Iterator, Sequence

import torch

from . import ops
from .plan import SourceRef, TensorPlan
from .unpickle import file_identity, file_location

Location = tuple[int, tuple[int, int, int, int]]  # (byte offset in the file, file identity)


def locate(refs: Sequence[SourceRef], sources: Sequence[torch.Tensor]) -> list[Location | None]:
    """Where each source's bytes sit in its file, for the sources that are views of one."""
    return [file_location(ref.file, t) for ref, t in zip(refs, sources)]


class BatchReader:
    """Runs batches of :class:`TensorPlan` over ``sources`` in one native call each."""

    def __init__(self, refs: Sequence[SourceRef], sources: Sequence[torch.Tensor],
                 locations: Sequence[Location | None]):
        self.refs = refs
        self.sources = list(sources)
        self.locations = locations

    def read(self, tps: Sequence[TensorPlan]) -> list[torch.Tensor]:
        """Each of ``tps`` in fresh memory, in its shape."""
        outs = [torch.empty(tp.numel, dtype=tp.out_dtype) for tp in tps]
        with self._files() as (fds, offsets):
            ops.read_cast(self.sources, fds, offsets, _rows(tps), outs)
        return [o.view(tp.shape) for o, tp in zip(outs, tps)]

    def write(self, fd: int, placed: Sequence[tuple[TensorPlan, int]]) -> None:
        """Each ``(tp, byte offset)`` into file ``fd``, one call per output dtype."""
        by_dtype: dict[torch.dtype, list[tuple[TensorPlan, int]]] = {}
        for tp, off in placed:
            by_dtype.setdefault(tp.out_dtype, []).append((tp, off))
        with self._files() as (fds, offsets):
            for dtype, group in by_dtype.items():
                tps = [tp for tp, _ in group]
                ops.read_cast_to_file(self.sources, fds, offsets, _rows(tps), fd,
                                      torch.tensor([off for _, off in group], dtype=torch.int64),
                                      torch.tensor([tp.numel for tp in tps], dtype=torch.int64), dtype)

    @contextmanager
    def _files(self) -> Iterator[tuple[list[int], torch.Tensor]]:
        """An fd per source (-1: read it from memory) and its byte offset, the files open meanwhile.

        A file whose identity changed since it was mapped (replaced, rewritten) is not read by
        name: its mapping still shows what was loaded and planned, so that is what is copied.
        """
        opened: dict[str, int] = {}
        fds, offsets = [], []
        try:
            for ref, loc in zip(self.refs, self.locations):
                fd = -1
                if loc is not None:
                    if ref.file not in opened:
                        opened[ref.file] = _open_same(ref.file, loc[1])
                    fd = opened[ref.file]
                fds.append(fd)
                offsets.append(loc[0] if fd >= 0 else 0)
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


def _rows(tps: Sequence[TensorPlan]) -> torch.Tensor:
    """The plan as the op's table: (output, source, source offset, output offset, length)."""
    flat: list[int] = []
    for i, tp in enumerate(tps):
        for seg in tp.segments:
            flat.append(i)
            flat.extend(seg)
    return torch.tensor(flat, dtype=torch.int64).view(-1, 5)
