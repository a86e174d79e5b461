"""What the family builders share: a checkpoint seen as a set of dense ZeRO partitions.

Each family (MoE, pipeline) splits its trainable parameters into flat buffers that are each laid
out exactly like one param group of a plain ZeRO-1/2 save, only over a subset of the optimizer
files (an expert-data-parallel group, the data-parallel ranks of one pipeline stage). A
:class:`Partition` names that subset; planning one runs the plain stage 1-2 builder on a view of
the checkpoint restricted to it. Everything that is not a trainable master (frozen weights,
buffers) is a whole tensor in some file, listed in :attr:`FamilyCheckpoint.stored` under its
output name.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import InconsistentCheckpointError, UnsupportedCheckpointError
from ..plan import (BUFFER, FROZEN, TRAINABLE, FlatGroups, Plan, SourceTable, TensorPlan, _Entry, master_flat_groups,
                    out_dtype_for, partitioned_entries)
from ..safe_load import LoadedCheckpoint, ModelStates, _check_flat_groups


@dataclass(frozen=True)
class Partition:
    """``ranks`` (indices into ``optim_states``) hold, in order, the partitions of flat group
    ``group``; ``shapes`` lists its parameters in flat order under their output names. ``skip``:
    names an earlier partition already provides (a pipeline's tied copies)."""

    ranks: tuple[int, ...]
    group: int
    shapes: dict[str, tuple[int, ...]]
    skip: frozenset[str] = frozenset()


@dataclass
class Stored:
    """A whole tensor in one file: ``key`` says where it sits in that file's pickle."""

    path: Path
    key: str
    tensor: torch.Tensor


@dataclass
class FamilyCheckpoint(LoadedCheckpoint):
    family: str = ""
    degrees: dict = field(default_factory=dict)  # degrees and structure, for inspect
    partitions: list[Partition] = field(default_factory=list)
    stored: dict[str, Stored] = field(default_factory=dict)  # output name -> model-dtype tensor, model order
    aliases: dict[str, str] = field(default_factory=dict)  # tied name -> source name
    buffers: frozenset[str] = frozenset()
    stage0_masters: object = None  # stage 0: callable(ckpt, table) -> {name: _Entry}
    partition_ends: frozenset[int] = frozenset()  # optimizer files that end a partition
    # Instead of ``partitions``: callable(ckpt, table, flats, what) -> {name: _Entry} (AutoTP)
    trainable_builder: object = None
    frozen_known: bool = True  # False where nothing tells frozen from trainable (fp32 without ZeRO)

    @property
    def last_ranks(self) -> frozenset[int]:
        return self.partition_ends

    @property
    def parallelism(self) -> dict:
        return self.degrees


def merged_meta(first: ModelStates, stored: dict[str, Stored], buffers, aliases, shapes) -> ModelStates:
    """Rank 0's model states, with ``module`` the consolidated model's tensors in its order."""
    return dataclasses.replace(first, module={n: s.tensor for n, s in stored.items()}, buffer_names=sorted(buffers),
                               shared_params=dict(aliases), param_shapes=shapes)


def check_partitions(ckpt: FamilyCheckpoint) -> None:
    """Each partition's ranks must hold equal parts of its flat buffer, as in a dense save."""
    for p in ckpt.partitions:
        _check_flat_groups(ckpt.stage, [_narrow(ckpt.optim_states[r], p.group) for r in p.ranks])


def _narrow(o, group: int):
    if group >= len(o.flat_groups):
        raise InconsistentCheckpointError(f"expected at least {group + 1} flat fp32 groups, found {len(o.flat_groups)}",
                                          o.path)
    pads = o.param_alignment_paddings
    return dataclasses.replace(o, flat_groups=[o.flat_groups[group]],
                               param_alignment_paddings=None if pads is None or group >= len(pads) else [pads[group]])


def partition_entries(ckpt: FamilyCheckpoint, table: SourceTable, flats: FlatGroups, what: str) -> dict[str, _Entry]:
    """Every trainable parameter, read from ``flats`` (the masters or one optimizer state)."""
    if ckpt.trainable_builder is not None:
        return ckpt.trainable_builder(ckpt, table, flats, what)
    out: dict[str, _Entry] = {}
    for p in ckpt.partitions:
        optims = [_narrow(ckpt.optim_states[r], p.group) for r in p.ranks]
        meta = dataclasses.replace(ckpt.meta, param_shapes=[p.shapes])
        view = LoadedCheckpoint(ckpt.files, ckpt.stage, len(p.ranks), [meta], optims)
        entries = partitioned_entries(view, table, [[flats[r][p.group]] for r in p.ranks], what)
        out.update((n, e) for n, e in entries.items() if n not in p.skip)
    return out


def build_plan(ckpt: FamilyCheckpoint, table: SourceTable, dtype: torch.dtype | None, exclude_frozen: bool) -> Plan:
    if exclude_frozen and not ckpt.frozen_known:
        raise UnsupportedCheckpointError(
            "exclude_frozen: this checkpoint does not record which parameters are frozen (no optimizer names them)",
            ckpt.meta.path)
    if ckpt.stage == 0:
        trainable = ckpt.stage0_masters(ckpt, table)
    else:
        trainable = partition_entries(ckpt, table, master_flat_groups(ckpt), "flat fp32 groups")
    entries: dict[str, tuple[str, _Entry]] = {}
    for name, s in ckpt.stored.items():
        if name in ckpt.aliases:
            continue
        if name in trainable:
            entries[name] = (TRAINABLE, trainable[name])
        else:
            src = table.add(str(s.path), s.key, s.tensor)
            kind = BUFFER if name in ckpt.buffers else FROZEN
            entries[name] = (kind, (tuple(s.tensor.shape), s.tensor.dtype, [(src, 0, 0, s.tensor.numel())]))
    entries.update((n, (TRAINABLE, e)) for n, e in trainable.items() if n not in entries)
    order = [n for n in ckpt.stored if n in entries or n in ckpt.aliases]
    order += [n for n in entries if n not in ckpt.stored]
    if exclude_frozen:
        order = [n for n in order if entries[ckpt.aliases.get(n, n)][0] != FROZEN]
    tensors = {}
    for name in order:
        if name not in ckpt.aliases:
            kind, (shape, stored, segs) = entries[name]
            tensors[name] = TensorPlan(name, shape, kind, stored, out_dtype_for(stored, dtype), tuple(segs))
    for alias, source in ckpt.aliases.items():
        if source not in entries:
            raise InconsistentCheckpointError(f"tied parameter {alias!r} points to unknown parameter {source!r}",
                                              ckpt.meta.path)
    aliases = {a: s for a, s in ckpt.aliases.items() if a in order}
    return Plan(tuple(table.refs), tensors, aliases, tuple(order), ckpt.stage, ckpt.world_size,
                {"tag": ckpt.files.tag, "ds_version": ckpt.ds_version, "parallelism": ckpt.parallelism})
