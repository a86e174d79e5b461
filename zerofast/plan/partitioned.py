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
from typing import Sequence

import torch

from ..base.errors import InconsistentCheckpointError, UnsupportedCheckpointError
from ..load import LoadedCheckpoint, PartitionedCheckpoint
from ..load.checkpoint import Partition, narrow_group
from .build import assemble
from .builders import flat_entries
from .columns import EntryTable, Layers
from .model import BUFFER, FROZEN, TRAINABLE, Entry, FlatGroups, Plan, SourceTable


def partition_entries(ckpt: PartitionedCheckpoint, table: SourceTable, flats: FlatGroups,
                      what: str, partitions: Sequence[Partition] | None = None) -> EntryTable:
    """Every trainable parameter of ``partitions`` (default ``ckpt.partitions``), read from
    ``flats`` (the masters or one optimizer state, one entry per optimizer file): the partitions'
    tables joined into one, as updating one dict with each in turn would have them."""
    parts = []
    for p in ckpt.partitions if partitions is None else partitions:
        optims = [narrow_group(ckpt.optim_states[r], p.group) for r in p.ranks]
        meta = dataclasses.replace(ckpt.meta, param_shapes=[p.shapes])
        view = LoadedCheckpoint(ckpt.files, ckpt.stage, len(p.ranks), [meta], optims)
        entries = flat_entries(view, table, [[flats[r][p.group]] for r in p.ranks], what)
        parts.append(entries.without(p.skip))
    return EntryTable.join(parts)


def partitioned_plan(ckpt: PartitionedCheckpoint, table: SourceTable, dtype: torch.dtype | None,
                     exclude_frozen: bool, trainable: EntryTable, composed: dict[str, Entry] | None = None) -> Plan:
    """The state dict's plan: ``trainable`` (the layout's masters) and every stored tensor, those
    of ``composed`` (put together by the layout from several files) as given."""
    composed = composed or {}
    if exclude_frozen and not ckpt.frozen_known:
        raise UnsupportedCheckpointError(
            "exclude_frozen: this checkpoint does not record which parameters are frozen (no optimizer names them)",
            ckpt.meta.path)
    frozen: dict[str, Entry] = {}
    buffers: dict[str, Entry] = {}
    masters = trainable.keys()  # a dict's view: its lookups run in C
    for name, s in ckpt.stored.items():
        if name not in ckpt.aliases and name not in masters:
            whole = composed.get(name)
            if whole is None:
                whole = table.whole(str(s.path), s.key, s.tensor)
            (buffers if name in ckpt.buffers else frozen)[name] = whole
    layers = Layers(((TRAINABLE, trainable), (FROZEN, EntryTable.of_entries(frozen)),
                     (BUFFER, EntryTable.of_entries(buffers))))
    for alias, source in ckpt.aliases.items():
        if source not in layers.names:
            raise InconsistentCheckpointError(f"tied parameter {alias!r} points to unknown parameter {source!r}",
                                              ckpt.meta.path)
    order = [n for n in ckpt.stored if n in layers.names or n in ckpt.aliases]
    order += [n for n in masters if n not in ckpt.stored]
    return assemble(ckpt, layers, order, ckpt.aliases, dtype, exclude_frozen)
