"""Reading many rank files at once.

A MoE save is thousands of expert files, a ZeRO-3 save one model and one optimizer file per
rank. Each read opens the file, checks its zip directory, bounds its pickle without the GIL
(the native reader's first pass) and builds its tree; a small pool of threads overlaps the
parts that leave the GIL free (system calls, page faults on the mapping, the bounds pass).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")
MAX_THREADS = 8


def read_all(read: Callable[[Path], T], paths: Sequence[Path]) -> list[T]:
    """``[read(p) for p in paths]``, several at a time. The first file in order that fails
    raises its own error, as the plain loop would."""
    threads = min(len(paths), os.cpu_count() or 1, MAX_THREADS)
    if threads < 2:
        return [read(p) for p in paths]
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="zerofast-read") as pool:
        return list(pool.map(read, paths))
