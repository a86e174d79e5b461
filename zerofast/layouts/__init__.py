"""Layout builders for the checkpoint families beyond plain data parallelism.

Each family has one module here that reads its files into a :class:`~.common.FamilyCheckpoint`
(the partitions its trainable masters are split into, and every other tensor by output name);
:func:`~.common.build_plan` turns that into the same plain-data :class:`~zerofast.plan.Plan` the
plain ZeRO layouts produce, so reconstruct, lazy, export, optimizer_state and load_into run on it
unchanged.
"""
from __future__ import annotations

from ..discover import CheckpointFiles
from .common import FamilyCheckpoint, build_plan, partition_entries

__all__ = ["FamilyCheckpoint", "build_plan", "load_family", "partition_entries"]


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
