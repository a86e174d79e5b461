"""Frozen parameters named in ``frozen_param_shapes``: never fp32, always the model dtype.

Stages 1-2 keep each whole, in ``frozen_param_fragments`` (or only in ``module``); stage 3 cuts
each into ceil(n/W)-element fragments, one per rank's model-states file.
"""
from __future__ import annotations

import math

import torch

from ...base.errors import InconsistentCheckpointError
from ...load import LoadedCheckpoint
from ...base import keys
from ..model import Entry, Segments, SourceTable, ceil_div, rank_share


def declared(ckpt: LoadedCheckpoint, table: SourceTable) -> dict[str, Entry]:
    meta = ckpt.meta
    if not meta.frozen_param_shapes:
        return {}
    out: dict[str, Entry] = {}
    for name, shape in meta.frozen_param_shapes.items():
        if ckpt.stage == 3:
            out[name] = _zero3(ckpt, table, name, shape)
            continue
        frag = meta.frozen_param_fragments.get(name)
        if frag is None or frag.numel() != math.prod(shape):
            frag = meta.module.get(name)
        if frag is None or frag.numel() != math.prod(shape):
            raise InconsistentCheckpointError(
                f"frozen parameter {name!r} of shape {shape} has no full tensor in 'frozen_param_fragments' or "
                "'module'", meta.path)
        _, dtype, segs = table.whole(str(meta.path), f"{keys.FROZEN_PARAM_FRAGMENTS}[{name!r}]", frag)
        out[name] = (shape, dtype, segs)
    return out


def _zero3(ckpt: LoadedCheckpoint, table: SourceTable, name: str, shape: tuple[int, ...]) -> Entry:
    n = math.prod(shape)
    k = ceil_div(n, ckpt.world_size)
    segs: Segments = []
    dtype = None
    for r, ms in enumerate(ckpt.model_states):
        frag = ms.frozen_param_fragments.get(name)
        share = rank_share(n, k, r)
        if frag is None or frag.numel() < share:
            raise InconsistentCheckpointError(
                f"expected a fragment of at least {share} elements for frozen parameter {name!r}, "
                f"found {'none' if frag is None else frag.numel()}", ms.path)
        dtype = frag.dtype
        src = table.add(str(ms.path), f"{keys.FROZEN_PARAM_FRAGMENTS}[{name!r}]", frag)
        if share:
            segs.append((src, 0, r * k, share))
    return shape, dtype or torch.float32, segs
