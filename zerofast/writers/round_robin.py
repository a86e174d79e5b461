"""``round_robin_gradients`` at stages 1-2: each param group's flat order depends on the world size.

DeepSpeed 0.19.8 (``stage_1_and_2._round_robin_reorder``) deals a group's parameters out to the
W ranks in turn, parameter i to rank i mod W, and lays the flat buffer out rank by rank: first
parameters 0, W, 2W, ..., then 1, W+1, ..., and so on. ``param_shapes`` records that order. The
alignment padding after each parameter (``parameter_alignment``) follows the new order. To write
the save at N ranks, the original order is recovered from the one at W and dealt out again for N.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from ..base import keys
from ..load import LoadedCheckpoint


def enabled(ckpt: LoadedCheckpoint) -> bool:
    return bool(_zero_config(ckpt).get("round_robin_gradients"))


def dealt(count: int, world: int) -> list[int]:
    """The original indices in the flat order at ``world`` ranks."""
    return [i for rank in range(world) for i in range(rank, count, world)]


def reorder(params: Sequence[Any], old_world: int, new_world: int) -> list[Any]:
    """``params`` in their flat order at ``old_world`` ranks, put in the order at ``new_world``."""
    original: list[Any] = [None] * len(params)
    for position, index in enumerate(dealt(len(params), old_world)):
        original[index] = params[position]
    return [original[i] for i in dealt(len(params), new_world)]


def paddings(numels: Sequence[int], ckpt: LoadedCheckpoint) -> list[int]:
    """The padding after each parameter in this order: up to the next multiple of the parameter
    alignment (16 bytes of the model dtype with ``parameter_alignment``, else none), none after
    the last."""
    align = 1
    if _zero_config(ckpt).get("parameter_alignment"):
        align = 16 // math.gcd(16, _model_itemsize(ckpt))
    out, offset = [], 0
    for i, n in enumerate(numels):
        offset += n
        pad = 0 if i == len(numels) - 1 else (-offset) % align
        out.append(pad)
        offset += pad
    return out


def _zero_config(ckpt: LoadedCheckpoint) -> dict:
    cfg = ckpt.meta.raw.get(keys.DS_CONFIG)
    zero = cfg.get("zero_optimization") if isinstance(cfg, dict) else None
    return zero if isinstance(zero, dict) else {}


def _model_itemsize(ckpt: LoadedCheckpoint) -> int:
    sizes = [v.element_size() for v in ckpt.meta.module.values() if getattr(v, "is_floating_point", lambda: False)()]
    return sizes[0] if sizes else 2
