"""ZeRO stage 3: every rank holds ceil(n/W) elements of every parameter at one running offset.

Per rank, the concatenation of its flat groups is one buffer F_r; parameter p takes the same
k = ceil(n/W) elements of every F_r, and a slice may cross the boundary between two groups.
"""
from __future__ import annotations

import math

import torch

from ...errors import InconsistentCheckpointError
from ...load import LoadedCheckpoint
from ..model import Entry, FlatGroups, SourceTable, VirtualBuffer, ceil_div, rank_share


def trainable(ckpt: LoadedCheckpoint, table: SourceTable, shapes, flats: FlatGroups) -> dict[str, Entry]:
    W = ckpt.world_size
    rank_bufs = [VirtualBuffer([table.add(str(o.path), where, t) for where, t in groups],
                               [t.numel() for _, t in groups])
                 for o, groups in zip(ckpt.optim_states, flats)]
    dtype = flats[0][0][1].dtype if flats and flats[0] else torch.float32
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
