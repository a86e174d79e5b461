"""One builder per checkpoint layout. Each turns a loaded checkpoint into entries
(``name -> (shape, stored dtype, segments)``) over a shared :class:`~zerofast.plan.model.SourceTable`;
:mod:`zerofast.plan.build` classifies the rest of the module and applies the dtype policy.

- :mod:`.stage0`: no ZeRO; masters matched to module parameters by value.
- :mod:`.zero12`: stages 1-2, per-group flat buffers cut into equal rank partitions.
- :mod:`.zero3`: stage 3, every parameter cut across all ranks.
- :mod:`.frozen`: frozen parameters named in ``frozen_param_shapes``.
- :mod:`.universal`: ds_to_universal folders, one file per parameter and state.
- :mod:`.family`: MoE, pipeline and AutoTP saves (:mod:`zerofast.load.families`), with
  :mod:`.moe`, :mod:`.pipeline` and :mod:`.autotp` for what each needs of its own.
"""
from __future__ import annotations

from ...errors import InconsistentCheckpointError
from ...load import LoadedCheckpoint
from .. import keys
from ..model import Entry, FlatGroups, SourceTable
from . import frozen, stage0, universal, zero3, zero12


def trainable_entries(ckpt: LoadedCheckpoint, table: SourceTable, exclude_frozen: bool) -> dict[str, Entry]:
    if ckpt.stage == 0:
        return stage0.trainable(ckpt, table, exclude_frozen)
    if ckpt.universal is not None:
        return universal.trainable(ckpt, table)
    return partitioned_entries(ckpt, table, master_flat_groups(ckpt), "flat fp32 groups")


def frozen_entries(ckpt: LoadedCheckpoint, table: SourceTable) -> dict[str, Entry]:
    return frozen.declared(ckpt, table)


def master_flat_groups(ckpt: LoadedCheckpoint) -> FlatGroups:
    key = keys.flat_key(ckpt.stage)
    return [[(f"{keys.OPTIMIZER_STATE_DICT}.{key}[{g}]", t) for g, t in enumerate(o.flat_groups)]
            for o in ckpt.optim_states]


def partitioned_entries(ckpt: LoadedCheckpoint, table: SourceTable, flats: FlatGroups,
                        what: str) -> dict[str, Entry]:
    """Each trainable parameter of a stage 1-3 checkpoint, read from ``flats`` (laid out like the
    fp32 masters; ``what`` names them in errors)."""
    if ckpt.family != "zero":
        from .family import partition_entries

        return partition_entries(ckpt, table, flats, what)
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
