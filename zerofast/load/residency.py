"""How much of a batch's sources the page cache holds, told from a sample of their pages.

Internal to the batched reader (:mod:`zerofast.execute.read_batch`), which sizes its pool of
reader threads by it (:func:`zerofast.base.settings.reader_count`): a read from the page cache is
a copy, best done by one thread a core; a cold read waits in ``pread``, so more reads in flight pay.
``mincore`` asks the kernel without touching the pages, so the sample faults nothing in.
"""
from __future__ import annotations

import ctypes
import mmap
from typing import Sequence

import numpy as np
import torch

from ..base import libc

PAGE = mmap.PAGESIZE
SAMPLES = 256  # pages asked about per batch: about a millisecond, whatever the save's size

def resident_share(sources: Sequence[torch.Tensor]) -> float | None:
    """The share of ``sources``' sampled pages in memory (evenly spaced over their bytes), or
    None where it cannot be told (nothing to sample, no ``mincore``)."""
    mincore = libc.function("mincore", ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
    spans = [(t.data_ptr(), t.numel() * t.element_size()) for t in sources if t.device.type == "cpu" and t.numel()]
    if mincore is None or not spans:
        return None
    sizes = np.fromiter((n for _, n in spans), dtype=np.int64, count=len(spans))
    ends = np.cumsum(sizes)
    total = int(ends[-1])
    points = np.arange(SAMPLES, dtype=np.int64) * total // SAMPLES
    which = np.searchsorted(ends, points, side="right")
    flag = ctypes.c_ubyte()
    asked = held = 0
    seen: set[int] = set()
    for point, i in zip(points.tolist(), which.tolist()):
        address = spans[i][0] + point - int(ends[i] - sizes[i])
        page = address - address % PAGE
        if page in seen:  # a batch of fewer pages than samples
            continue
        seen.add(page)
        if mincore(page, PAGE, ctypes.byref(flag)) != 0:
            continue  # not a mapping (ENOMEM): nothing to tell
        asked += 1
        held += flag.value & 1
    return held / asked if asked else None
