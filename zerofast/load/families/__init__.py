"""Loading the checkpoint families beyond plain data parallelism: MoE, pipeline, AutoTP.

Each family's loader (one module here) reads its files into a :class:`FamilyCheckpoint`: plain
data that :mod:`zerofast.plan.layouts.family` and the family's own layout builder plan from.

MoE and pipeline saves split their trainable parameters into flat buffers that are each laid out
exactly like one param group of a plain ZeRO-1/2 save, only over a subset of the optimizer files
(an expert-data-parallel group, the data-parallel ranks of one pipeline stage). A
:class:`Partition` names that subset. Everything that is not a trainable master (frozen weights,
buffers) is a whole tensor in some file, listed in :attr:`FamilyCheckpoint.stored` under its
output name.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...discover import CheckpointFiles
from ...errors import InconsistentCheckpointError
from ..checkpoint import LoadedCheckpoint, ModelStates, check_flat_groups


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
    family: str = ""  # "moe", "pipeline" or "tensor": which layout builder plans it
    degrees: dict = field(default_factory=dict)  # degrees and structure, for inspect
    partitions: list[Partition] = field(default_factory=list)
    stored: dict[str, Stored] = field(default_factory=dict)  # output name -> model-dtype tensor, model order
    aliases: dict[str, str] = field(default_factory=dict)  # tied name -> source name
    buffers: frozenset[str] = frozenset()
    partition_ends: frozenset[int] = frozenset()  # optimizer files that end a partition
    frozen_known: bool = True  # False where nothing tells frozen from trainable (fp32 without ZeRO)
    extra: dict = field(default_factory=dict)  # what the family's own layout builder needs

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
        check_flat_groups(ckpt.stage, [narrow_group(ckpt.optim_states[r], p.group) for r in p.ranks])


def narrow_group(o, group: int):
    """Optimizer file ``o`` seen as if it held flat group ``group`` alone."""
    if group >= len(o.flat_groups):
        raise InconsistentCheckpointError(f"expected at least {group + 1} flat fp32 groups, found {len(o.flat_groups)}",
                                          o.path)
    pads = o.param_alignment_paddings
    return dataclasses.replace(o, flat_groups=[o.flat_groups[group]],
                               param_alignment_paddings=None if pads is None or group >= len(pads) else [pads[group]])


def load_family(files: CheckpointFiles) -> FamilyCheckpoint:
    if files.family == "moe":
        from .moe import load
    elif files.family == "pipeline":
        from .pipeline import load
    elif files.family == "tensor":
        from .autotp import load
    else:
        raise ValueError(f"unknown checkpoint family {files.family!r}")
    return load(files)
