"""The loaded checkpoint: what a layout's ``load`` returns and its planner reads.

:class:`LoadedCheckpoint` holds a plain save's typed records (:mod:`.records`) and the
:class:`~zerofast.layouts.base.Layout` that read it (``ckpt.layout``, from its files), so that
every later step asks the layout instead of testing what kind of save it is.

:class:`PartitionedCheckpoint` is the record of the layouts that split their trainable
parameters into several flat buffers (MoE, pipeline, AutoTP). Each buffer is laid out exactly
like one param group of a plain ZeRO-1/2 save, only over a subset of the optimizer files (an
expert-data-parallel group, the data-parallel ranks of one pipeline stage); a
:class:`Partition` names that subset. Everything that is not a trainable master (frozen weights,
buffers) is a whole tensor in some file, listed in :attr:`PartitionedCheckpoint.stored` under its
output name.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..base import keys as K
from ..discover import CheckpointFiles
from ..base.errors import InconsistentCheckpointError
from .records import ModelStates, OptimStates, check_flat_groups


@dataclass
class LoadedCheckpoint:
    files: CheckpointFiles
    stage: int
    world_size: int
    model_states: list[ModelStates]
    optim_states: list[OptimStates]

    @property
    def layout(self) -> Any:
        """The layout that found and read these files (:mod:`zerofast.layouts`)."""
        return self.files.layout

    @property
    def meta(self) -> ModelStates:
        """Rank 0's model states: the metadata every rank repeats."""
        return self.model_states[0]

    @property
    def module_names(self) -> list[str]:
        """The model's own key order (its state dict's), which outputs follow."""
        return list(self.meta.module)

    @property
    def ds_version(self) -> str | None:
        return self.meta.raw.get(K.DS_VERSION)

    @property
    def last_ranks(self) -> frozenset[int]:
        """Optimizer files holding the end of a flat buffer (whose padding DeepSpeed strips)."""
        return frozenset({self.world_size - 1})

    @property
    def parallelism(self) -> dict:
        return {"family": "data-parallel", "dp": self.world_size}


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
class PartitionedCheckpoint(LoadedCheckpoint):
    degrees: dict = field(default_factory=dict)  # degrees and structure, for inspect
    partitions: list[Partition] = field(default_factory=list)
    stored: dict[str, Stored] = field(default_factory=dict)  # output name -> model-dtype tensor, model order
    aliases: dict[str, str] = field(default_factory=dict)  # tied name -> source name
    buffers: frozenset[str] = frozenset()
    partition_ends: frozenset[int] = frozenset()  # optimizer files that end a partition
    frozen_known: bool = True  # False where nothing tells frozen from trainable (fp32 without ZeRO)
    extra: dict = field(default_factory=dict)  # what the layout's own planner needs

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


def check_partitions(ckpt: PartitionedCheckpoint) -> None:
    """Each partition's ranks must hold equal parts of its flat buffer, as in a dense save."""
    for p in ckpt.partitions:
        check_flat_groups(ckpt.stage, [narrow_group(ckpt.optim_states[r], p.group) for r in p.ranks])


def narrow_group(o: OptimStates, group: int) -> OptimStates:
    """Optimizer file ``o`` seen as if it held flat group ``group`` alone."""
    if group >= len(o.flat_groups):
        raise InconsistentCheckpointError(f"expected at least {group + 1} flat fp32 groups, found {len(o.flat_groups)}",
                                          o.path)
    pads = o.param_alignment_paddings
    return dataclasses.replace(o, flat_groups=[o.flat_groups[group]],
                               param_alignment_paddings=None if pads is None or group >= len(pads) else [pads[group]])
