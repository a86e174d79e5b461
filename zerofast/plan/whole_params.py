"""Optimizer state laid out over whole parameters, not over the fp32 partition (Muon, ZeRO 1-2).

DeepSpeed's Muon orthogonalizes each 2-D parameter as a whole, so at stages 1-2 its
``momentum_buffer`` holds, on every rank, the full momentum of each parameter that touches
that rank's partition, back to back in ``param_shapes`` order, without alignment padding and
in the gradient's dtype. A parameter that straddles two partitions is held by both ranks (the
same values: DeepSpeed all-reduces the gradients of split Muon matrices).

A flat group's state is read this way when every rank's tensor is exactly as long as the
parameters touching its partition and at least one is not as long as its fp32 partition (when
both lengths agree on every rank, the two layouts are the same elements).
"""
from __future__ import annotations

import math
from typing import Sequence

from ..base.errors import InconsistentCheckpointError
from ..load import LoadedCheckpoint
from .model import Entry, FlatGroups, SourceTable


def param_spans(ckpt: LoadedCheckpoint, g: int) -> list[tuple[str, tuple, int, int]]:
    """(name, shape, start, numel) of each parameter of flat group ``g`` in the group's flat
    order, alignment padding included in the offsets."""
    shapes = ckpt.meta.param_shapes
    if shapes is None or g >= len(shapes):
        found = "None" if shapes is None else f"{len(shapes)} groups"
        raise InconsistentCheckpointError(f"expected 'param_shapes' to hold flat group {g} (a ZeRO stage 1-3 "
                                          f"checkpoint records one per fp32 group), found {found}", ckpt.meta.path)
    pads = ckpt.optim_states[0].param_alignment_paddings
    out, offset = [], 0
    for i, (name, shape) in enumerate(shapes[g].items()):
        n = math.prod(shape)
        out.append((name, tuple(shape), offset, n))
        offset += n + (int(pads[g][i]) if pads and g < len(pads) and i < len(pads[g]) else 0)
    return out


def touching(spans: Sequence[tuple[str, tuple, int, int]], start: int, end: int) -> list[tuple[str, tuple, int, int]]:
    """The parameters with at least one element in [start, end): DeepSpeed's params_in_partition."""
    return [s for s in spans if s[3] and s[2] < end and s[2] + s[3] > start]


def whole_groups(ckpt: LoadedCheckpoint, flats: FlatGroups, masters: FlatGroups, groups: Sequence[int]) -> set[int]:
    """Those of ``groups`` whose state in ``flats`` (per rank and flat group) is laid out over
    whole parameters; see the module docstring."""
    if ckpt.stage not in (1, 2):
        return set()
    out = set()
    for g in groups:
        _check_held(ckpt, flats, masters, g)
        size = masters[0][g][1].numel()
        spans = param_spans(ckpt, g)
        whole = [sum(s[3] for s in touching(spans, r * size, (r + 1) * size)) for r in range(len(flats))]
        lengths = [rank[g][1].numel() for rank in flats]
        own = [rank[g][1].numel() for rank in masters]
        if lengths == whole and lengths != own:
            out.add(g)
    return out


def entries(ckpt: LoadedCheckpoint, table: SourceTable, flats: FlatGroups, masters: FlatGroups,
            g: int) -> dict[str, Entry]:
    """``{param: entry}`` of flat group ``g``, each read whole from the first rank that holds it."""
    _check_held(ckpt, flats, masters, g)
    size = masters[0][g][1].numel()
    spans = param_spans(ckpt, g)
    out: dict[str, Entry] = {}
    for r, (o, rank) in enumerate(zip(ckpt.optim_states, flats)):
        where, value = rank[g]
        offset = 0
        for name, shape, _, n in touching(spans, r * size, (r + 1) * size):
            if name not in out:
                out[name] = (shape, value.dtype, [(table.add(str(o.path), where, value), offset, 0, n)])
            offset += n
    return out


def _check_held(ckpt: LoadedCheckpoint, flats: FlatGroups, masters: FlatGroups, g: int) -> None:
    """Every rank holds flat group ``g``, in ``flats`` and in ``masters``: a damaged rank file
    can lose one, which is then named, with the file, instead of indexed."""
    for o, flat, master in zip(ckpt.optim_states, flats, masters):
        held = min(len(flat), len(master))
        if g >= held:
            raise InconsistentCheckpointError(f"expected flat group {g} in this rank's optimizer state, found "
                                              f"{held} groups", o.path)
    if len(flats) != len(ckpt.optim_states) or len(masters) != len(ckpt.optim_states):
        raise InconsistentCheckpointError(f"expected the state of {len(ckpt.optim_states)} ranks, found "
                                          f"{min(len(flats), len(masters))}", ckpt.meta.path)
