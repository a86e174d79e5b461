"""The plan of a save split into partitions (:class:`~zerofast.load.PartitionedCheckpoint`: MoE,
pipeline-parallel, AutoTP).

Every partition is planned by the plain stage 1-2 builder on a view of the checkpoint restricted
to its ranks. Every other tensor is a whole tensor the layout's loader listed by output name,
classified here as frozen or buffer; :func:`~zerofast.plan.build.assemble` applies the order and
the dtype policy as for plain saves. The layouts supply what is theirs (AutoTP's shard
composition, the masters of a save without ZeRO) as the ``trainable`` entries.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from ..errors import InconsistentCheckpointError, UnsupportedCheckpointError
from ..load import LoadedCheckpoint, PartitionedCheckpoint
from ..load.checkpoint import narrow_group
from .build import assemble
from .builders import flat_entries
from .columns import EntryTable, Layers
from .model import BUFFER, FROZEN, TRAINABLE, Entry, FlatGroups, Plan, SourceTable


def partition_entries(ckpt: PartitionedCheckpoint, table: SourceTable, flats: FlatGroups,
                      what: str) -> Mapping[str, Entry]:
    """Every trainable parameter of ``ckpt.partitions``, read from ``flats`` (the masters or one
    optimizer state, one entry per optimizer file): the partitions' tables joined into one where
    they can be (one dtype, no name twice; the plan then reads its columns), else the dict that
    updating one with each in turn makes."""
    parts = []
    for p in ckpt.partitions:
        optims = [narrow_group(ckpt.optim_states[r], p.group) for r in p.ranks]
        meta = dataclasses.replace(ckpt.meta, param_shapes=[p.shapes])
        view = LoadedCheckpoint(ckpt.files, ckpt.stage, len(p.ranks), [meta], optims)
        entries = flat_entries(view, table, [[flats[r][p.group]] for r in p.ranks], what)
        parts.append(entries if not p.skip else {n: e for n, e in entries.items() if n not in p.skip})
    if len(parts) == 1:
        return parts[0]
    joined = EntryTable.join(parts) if parts and all(type(e) is EntryTable for e in parts) else None
    if joined is not None:
        return joined
    out: dict[str, Entry] = {}
    for entries in parts:
        out.update(entries.items())
    return out


def partitioned_plan(ckpt: PartitionedCheckpoint, table: SourceTable, dtype: torch.dtype | None,
                     exclude_frozen: bool, trainable: Mapping[str, Entry]) -> Plan:
    """The state dict's plan: ``trainable`` (the layout's masters) and every stored tensor."""
    if exclude_frozen and not ckpt.frozen_known:
        raise UnsupportedCheckpointError(
            "exclude_frozen: this checkpoint does not record which parameters are frozen (no optimizer names them)",
            ckpt.meta.path)
    frozen: dict[str, Entry] = {}
    buffers: dict[str, Entry] = {}
    masters = trainable.keys()  # a dict's view: its lookups run in C
    for name, s in ckpt.stored.items():
        if name not in ckpt.aliases and name not in masters:
            (buffers if name in ckpt.buffers else frozen)[name] = table.whole(str(s.path), s.key, s.tensor)
    layers = Layers(((TRAINABLE, trainable), (FROZEN, frozen), (BUFFER, buffers)))
    for alias, source in ckpt.aliases.items():
        if source not in layers.names:
            raise InconsistentCheckpointError(f"tied parameter {alias!r} points to unknown parameter {source!r}",
                                              ckpt.meta.path)
    order = [n for n in ckpt.stored if n in layers.names or n in ckpt.aliases]
    order += [n for n in masters if n not in ckpt.stored]
    return assemble(ckpt, layers, order, ckpt.aliases, dtype, exclude_frozen)
