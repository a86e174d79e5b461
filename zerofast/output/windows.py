"""Tensors written into a file through bounded memory-mapped windows, filled by the executor.

The path for writers that cannot hand a whole batch to the native file writer (a GPU computing
the values, the streaming torch.save writer): each tensor, or slice of one, is gathered and cast
straight into its place in a mapping of at most ``WINDOW_BYTES``, so memory stays flat whatever
the tensor sizes. Each window's blocks are reserved (:func:`reserve`) before it is mapped, so a
full disk or a file-size limit is an OSError, not a SIGBUS on the first page with no room.
"""
from __future__ import annotations

import errno
import mmap
import os
from typing import Callable, Iterable, Iterator, Sequence

import torch

from ..execute import Executor
from ..plan.model import TensorPlan

WINDOW_BYTES = 64 << 20


def write_windows(fd: int, placed: Iterable[tuple[TensorPlan, int]], base: int, executor: Executor,
                  advance: Callable[[int], None] | None = None) -> None:
    """Write each ``(tensor, offset)`` at ``base + offset`` of ``fd``, one window at a time."""
    for start, end, batch in _windows(_pieces(placed, base)):
        _fill(fd, start, end, batch, executor)
        if advance is not None:
            advance(sum(tp.nbytes for tp, _ in batch))  # the tensors' bytes, not the gaps between them


def _pieces(placed: Iterable[tuple[TensorPlan, int]], base: int) -> Iterator[tuple[TensorPlan, int]]:
    """(tensor or slice of one, file offset), each at most one window long."""
    for tp, off in placed:
        size = tp.out_dtype.itemsize
        step = max(1, WINDOW_BYTES // size)
        for lo in range(0, tp.numel, step):
            hi = min(tp.numel, lo + step)
            yield (tp if hi - lo == tp.numel else tp.slice(lo, hi)), base + off + lo * size


def _windows(pieces: Iterable[tuple[TensorPlan, int]]) -> Iterator[tuple[int, int, list[tuple[TensorPlan, int]]]]:
    """Consecutive pieces grouped into byte ranges of at most one window."""
    batch: list[tuple[TensorPlan, int]] = []
    start = end = 0
    for tp, off in pieces:
        if batch and off + tp.nbytes - start > WINDOW_BYTES:
            yield start, end, batch
            batch = []
        if not batch:
            start = off
        batch.append((tp, off))
        end = off + tp.nbytes
    if batch:
        yield start, end, batch


def reserve(fd: int, offset: int, length: int) -> None:
    """Allocate the blocks of ``[offset, offset + length)`` of ``fd``: a full disk (ENOSPC) or a
    file-size limit (EFBIG) then fails here, as an OSError, rather than killing the process with
    SIGBUS when a mapped page finds no room."""
    if length <= 0:
        return
    try:
        os.posix_fallocate(fd, offset, length)
    except AttributeError:  # no posix_fallocate on this platform: at least size the file
        _grow(fd, offset + length)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        _grow(fd, offset + length)


def _grow(fd: int, size: int) -> None:
    if os.fstat(fd).st_size < size:
        os.ftruncate(fd, size)


def _fill(fd: int, start: int, end: int, batch: Sequence[tuple[TensorPlan, int]], executor: Executor) -> None:
    reserve(fd, start, end - start)
    base = start - start % mmap.ALLOCATIONGRANULARITY
    # The tensor holds the only reference to the mapping, so returning unmaps it: written pages
    # leave this process's memory and wait in the page cache for write-back.
    window = torch.frombuffer(mmap.mmap(fd, end - base, offset=base), dtype=torch.uint8)
    for tp, off in batch:
        executor.run(tp, out=window[off - base:off - base + tp.nbytes].view(tp.out_dtype))




Progress = Callable[[int, int], None]


def counter(progress: Progress | None, total: int) -> Callable[[int], None]:
    """An ``advance(nbytes)`` that reports ``progress(done, total)``: first with 0, then as data lands."""
    done = 0
    if progress is not None:
        progress(0, total)

    def advance(nbytes: int) -> None:
        nonlocal done
        done += nbytes
        if progress is not None:
            progress(done, total)

    return advance
