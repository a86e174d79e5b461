"""The plan of a MoE, pipeline-parallel or AutoTP checkpoint (:mod:`zerofast.load.families`).

The trainable masters come from the family's partitions, each planned by the plain stage 1-2
builder on a view of the checkpoint restricted to its ranks (AutoTP: :mod:`.autotp` composes
the tp ranks' shards; stage 0: the family's own matching). Every other tensor is a whole tensor
the loader listed by output name, classified here as frozen or buffer, with the dtype policy
applied like :mod:`zerofast.plan.build` does for plain saves.
"""
from __future__ import annotations

import dataclasses

import torch

from ...errors import InconsistentCheckpointError, UnsupportedCheckpointError
from ...load import LoadedCheckpoint
from ...load.families import FamilyCheckpoint, narrow_group
from ..model import BUFFER, FROZEN, TRAINABLE, Entry, FlatGroups, Plan, SourceTable, TensorPlan


def partition_entries(ckpt: FamilyCheckpoint, table: SourceTable, flats: FlatGroups, what: str) -> dict[str, Entry]:
    """Every trainable parameter, read from ``flats`` (the masters or one optimizer state)."""
    from . import partitioned_entries

    if ckpt.family == "tensor":
        from .autotp import trainable

        return trainable(ckpt, table, flats, what)
    out: dict[str, Entry] = {}
    for p in ckpt.partitions:
        optims = [narrow_group(ckpt.optim_states[r], p.group) for r in p.ranks]
        meta = dataclasses.replace(ckpt.meta, param_shapes=[p.shapes])
        view = LoadedCheckpoint(ckpt.files, ckpt.stage, len(p.ranks), [meta], optims)
        entries = partitioned_entries(view, table, [[flats[r][p.group]] for r in p.ranks], what)
        out.update((n, e) for n, e in entries.items() if n not in p.skip)
    return out


def build_plan(ckpt: FamilyCheckpoint, table: SourceTable, dtype: torch.dtype | None, exclude_frozen: bool) -> Plan:
    from ..build import out_dtype_for
    from . import master_flat_groups

    if exclude_frozen and not ckpt.frozen_known:
        raise UnsupportedCheckpointError(
            "exclude_frozen: this checkpoint does not record which parameters are frozen (no optimizer names them)",
            ckpt.meta.path)
    if ckpt.stage == 0:
        trainable = _stage0_masters(ckpt, table)
    else:
        trainable = partition_entries(ckpt, table, master_flat_groups(ckpt), "flat fp32 groups")
    entries: dict[str, tuple[str, Entry]] = {}
    for name, s in ckpt.stored.items():
        if name in ckpt.aliases:
            continue
        if name in trainable:
            entries[name] = (TRAINABLE, trainable[name])
        else:
            entries[name] = (BUFFER if name in ckpt.buffers else FROZEN, table.whole(str(s.path), s.key, s.tensor))
    entries.update((n, (TRAINABLE, e)) for n, e in trainable.items() if n not in entries)
    for alias, source in ckpt.aliases.items():
        if source not in entries:
            raise InconsistentCheckpointError(f"tied parameter {alias!r} points to unknown parameter {source!r}",
                                              ckpt.meta.path)
    order = [n for n in ckpt.stored if n in entries or n in ckpt.aliases]
    order += [n for n in entries if n not in ckpt.stored]
    if exclude_frozen:
        order = [n for n in order if entries[ckpt.aliases.get(n, n)][0] != FROZEN]
    tensors = {}
    for name in order:
        if name not in ckpt.aliases:
            kind, (shape, stored, segs) = entries[name]
            tensors[name] = TensorPlan(name, shape, kind, stored, out_dtype_for(stored, dtype), tuple(segs))
    aliases = {a: s for a, s in ckpt.aliases.items() if a in order}
    return Plan(tensors, aliases, tuple(order), ckpt.stage, ckpt.world_size)


def _stage0_masters(ckpt: FamilyCheckpoint, table: SourceTable) -> dict[str, Entry]:
    if ckpt.family == "moe":
        from .moe import stage0_masters
    elif ckpt.family == "pipeline":
        from .pipeline import stage0_masters
    else:
        raise UnsupportedCheckpointError(f"{ckpt.family} checkpoints without ZeRO are not supported", ckpt.meta.path)
    return stage0_masters(ckpt, table)
