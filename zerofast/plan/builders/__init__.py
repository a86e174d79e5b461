"""The partition arithmetic every layout builds on. Each builder turns records into entries
(``name -> (shape, stored dtype, segments)``) over a shared :class:`~zerofast.plan.model.SourceTable`;
:mod:`zerofast.plan.build` classifies the rest of the module and applies the dtype policy.

- :mod:`.stage0`: no ZeRO; masters matched to module parameters by value.
- :mod:`.zero12`: stages 1-2, per-group flat buffers cut into equal rank partitions.
- :mod:`.zero3`: stage 3, every parameter cut across all ranks.
- :mod:`.frozen`: frozen parameters named in ``frozen_param_shapes``.

Which of them a save needs, and over which files, is its layout's call (:mod:`zerofast.layouts`).
"""
from __future__ import annotations

from ...base import keys
from ...base.errors import InconsistentCheckpointError
from ...load import LoadedCheckpoint
from ..columns import EntryTable
from ..model import FlatGroups, SourceTable
from . import zero3, zero12


def master_flat_groups(ckpt: LoadedCheckpoint) -> FlatGroups:
    """Per rank and flat group, the fp32 master partition and where it sits in its file."""
    key = keys.flat_key(ckpt.stage)
    return [[(f"{keys.OPTIMIZER_STATE_DICT}.{key}[{g}]", t) for g, t in enumerate(o.flat_groups)]
            for o in ckpt.optim_states]


def flat_entries(ckpt: LoadedCheckpoint, table: SourceTable, flats: FlatGroups, what: str) -> EntryTable:
    """Each parameter ``param_shapes`` lists, read from ``flats`` (one entry per rank in
    ``ckpt.optim_states``, laid out like the fp32 masters; ``what`` names them in errors), with
    the stage 1-2 or stage 3 arithmetic."""
    shapes = ckpt.meta.param_shapes
    if shapes is None:
        raise InconsistentCheckpointError("expected 'param_shapes' for a ZeRO stage 1-3 checkpoint, found None",
                                          ckpt.meta.path)
    for o, groups in zip(ckpt.optim_states, flats):
        if len(groups) != len(shapes):
            raise InconsistentCheckpointError(
                f"expected {len(shapes)} {what} (one per 'param_shapes' group), found {len(groups)}", o.path)
    build = zero3.trainable if ckpt.stage == 3 else zero12.trainable
    return build(ckpt, table, shapes, flats)
