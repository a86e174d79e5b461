"""Reading many rank files at once.

A MoE save is thousands of expert files, a ZeRO-3 save one model and one optimizer file per
rank. Each read opens the file, checks its zip directory, bounds its pickle without the GIL
(the native reader's first pass) and builds its tree; a small pool of threads overlaps the
parts that leave the GIL free (system calls, page faults on the mapping, the bounds pass).

The pool pays only where a file's read is long enough to hide its hand-offs: a tiny expert
file (4 KiB, four tensors: about 80 us of mostly Python) read on eight threads under the GIL
cost more than read in turn (ds_moe_1k: 0.5 s for the reading before the first byte with the
pool, 0.31 s without). Large files go to the pool at once; small ones are read in turn, and only
if the first few take long (large pickles in small files) do the rest go to the pool.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator, Sequence, TypeVar

T = TypeVar("T")
MAX_THREADS = 8
# A file at least this large goes to the pool without a probe (the ZeRO-3 rank files).
POOL_FILE_BYTES = 1 << 20
# Smaller files: this many are read in turn first, and the rest go to the pool only where they
# took this long each (a file's read then outweighs the pool's hand-offs by far).
PROBE_FILES = 8
POOL_FILE_SECONDS = 0.002


def read_all(read: Callable[[Path], T], paths: Sequence[Path]) -> list[T]:
    """``[read(p) for p in paths]``, several at a time where that pays. The first file in order
    that fails raises its own error, as the plain loop would."""
    threads = min(len(paths), os.cpu_count() or 1, MAX_THREADS)
    if threads < 2:
        return [read(p) for p in paths]
    done: list[T] = []
    if _size(paths[0]) < POOL_FILE_BYTES:
        started = time.perf_counter()
        done = [read(p) for p in paths[:PROBE_FILES]]
        if time.perf_counter() - started < POOL_FILE_SECONDS * len(done):
            return done + [read(p) for p in paths[len(done):]]
    rest = paths[len(done):]
    if len(rest) < 2:
        return done + [read(p) for p in rest]
    with ThreadPoolExecutor(max_workers=min(threads, len(rest)), thread_name_prefix="zerofast-read") as pool:
        return done + list(pool.map(read, rest))


@contextlib.contextmanager
def read_meanwhile(read: Callable[[Path], T], paths: Sequence[Path], overlap: bool = True
                   ) -> Iterator[Callable[[], list[T]]]:
    """``read_all(read, paths)`` begun on threads as the block starts, while the caller reads
    other files in it: the call it yields waits for the reads and returns the list, or raises the
    first error in order. Leaving the block (the caller's own read raised) waits for the reads
    under way and starts no more, so no thread outlives it.

    Large files only (at least POOL_FILE_BYTES each; with ``overlap`` off, or for small ones,
    nothing starts early and the call reads them then): the optimizer files of a save whose model
    file holds tens of thousands of tensors, whose GIL-free parts (the zip directory, the bounds
    pass) then run while the model file is unpickled. On ds_zero2_20k that was 1.14x (7 fresh
    processes each) until the native reader stopped keeping unread memo values; since, its
    optimizer files read 2.5x faster and the overlap measures 0.99-1.03x (paired rounds)."""
    threads = min(len(paths), os.cpu_count() or 1, MAX_THREADS)
    if not overlap or threads < 2 or any(_size(p) < POOL_FILE_BYTES for p in paths):
        yield functools.partial(read_all, read, paths)
        return
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="zerofast-read-meanwhile")
    try:
        futures = [pool.submit(read, p) for p in paths]
        yield lambda: [f.result() for f in futures]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0  # the read itself says what is wrong with the file


def read_ahead(read: Callable[[Path], T], paths: Sequence[Path], ahead: int = 4) -> Iterator[Callable[[], T]]:
    """Per path in order, a call returning ``read(path)`` (or raising what it raised), with up to
    ``ahead`` of the paths after it under way on threads meanwhile: for reads that leave the GIL
    free (a zip directory), done while the caller works on the files before. ``ahead`` bounds
    what is held at once (each index holds its file's pickle): ``ahead`` under way, plus the
    one handed out, plus the one before it where the caller still holds it while taking the
    next. Close the iterator when leaving it early: the reads under way are waited for, the
    rest not started."""
    workers = min(len(paths), os.cpu_count() or 1, MAX_THREADS, ahead)
    if workers < 2:
        for path in paths:
            yield functools.partial(read, path)
        return
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="zerofast-read-ahead")
    try:
        waiting = iter(paths)
        started = collections.deque(pool.submit(read, p) for p in itertools.islice(waiting, ahead))
        while started:
            first = started.popleft()
            for p in itertools.islice(waiting, 1):
                started.append(pool.submit(read, p))
            yield first.result
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
