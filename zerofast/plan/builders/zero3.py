"""ZeRO stage 3: every rank holds ceil(n/W) elements of every parameter at one running offset.

Per rank, the concatenation of its flat groups is one buffer F_r; parameter p takes the same
k = ceil(n/W) elements of every F_r, and a slice may cross the boundary between two groups.

A save of tens of thousands of parameters is laid out with array arithmetic (:func:`_columns`);
the per-parameter loop (:func:`_loop`) remains for what that does not cover and words the errors.
"""
from __future__ import annotations

import math
from itertools import chain

import numpy as np
import torch

from ...base.errors import InconsistentCheckpointError
from ...load import LoadedCheckpoint
from ..columns import EntryTable
from ..model import Entry, FlatGroups, SegmentTable, SourceTable, VirtualBuffer, ceil_div, rank_share

INT64_MAX = 2 ** 63 - 1


def trainable(ckpt: LoadedCheckpoint, table: SourceTable, shapes, flats: FlatGroups) -> EntryTable:
    rank_bufs = [VirtualBuffer([table.add(str(o.path), where, t) for where, t in groups],
                               [t.numel() for _, t in groups])
                 for o, groups in zip(ckpt.optim_states, flats)]
    dtype = flats[0][0][1].dtype if flats and flats[0] else torch.float32
    names = list(chain.from_iterable(shapes))
    dims = list(chain.from_iterable(group.values() for group in shapes))
    out = _columns(names, dims, rank_bufs, dtype)
    return out if out is not None else EntryTable.of_entries(_loop(ckpt, shapes, rank_bufs, dtype))


def _loop(ckpt: LoadedCheckpoint, shapes, rank_bufs: list[VirtualBuffer], dtype: torch.dtype) -> dict[str, Entry]:
    W = len(rank_bufs)
    out: dict[str, Entry] = {}
    offset = 0
    for group in shapes:
        for name, shape in group.items():
            n = math.prod(shape)
            k = ceil_div(n, W)
            for r, buf in enumerate(rank_bufs):
                if offset + k > buf.numel:
                    raise InconsistentCheckpointError(
                        f"'param_shapes' needs {offset + k} elements per rank to reach {name!r}, but this rank's "
                        f"flat groups hold {buf.numel}", ckpt.optim_states[r].path)
            segs = [p for r, buf in enumerate(rank_bufs) for p in buf.pieces(offset, rank_share(n, k, r), r * k)]
            out[name] = (shape, dtype, segs)
            offset += k
    return out


def _columns(names: list[str], dims: list, rank_bufs: list[VirtualBuffer],
             dtype: torch.dtype) -> EntryTable | None:
    """What :func:`_loop` returns, or None where it would raise or the sums could leave int64.
    A parameter whose slice on some rank crosses from one flat group into the next, or that a rank
    holds none of, gets its segments from :meth:`VirtualBuffer.pieces` as in the loop."""
    W = len(rank_bufs)
    if not names or not W or not all(buf.sources for buf in rank_bufs):
        return None
    sizes = list(map(math.prod, dims))
    if max(sizes) > INT64_MAX or -(-max(sizes) // W) * len(sizes) > INT64_MAX:
        return None
    n = np.array(sizes, dtype=np.int64)
    k = -(-n // W)
    offsets = np.cumsum(k) - k
    if int(offsets[-1] + k[-1]) > min(buf.numel for buf in rank_bufs):
        return None  # the loop names the parameter and the rank
    rows, odd = np.empty((len(names), W, 4), dtype=np.int64), np.zeros(len(names), dtype=bool)
    for r, buf in enumerate(rank_bufs):
        share = np.clip(n - r * k, 0, k)
        rows[:, r, 0], rows[:, r, 1], crossing = buf.single_pieces(offsets, share)
        rows[:, r, 2], rows[:, r, 3] = r * k, share
        odd |= crossing
    cut = [[p for r, buf in enumerate(rank_bufs)
            for p in buf.pieces(int(offsets[i]), rank_share(sizes[i], int(k[i]), r), r * int(k[i]))]
           for i in np.flatnonzero(odd).tolist()]
    return EntryTable.of(names, dims, dtype, SegmentTable.regular(rows, odd, cut))
