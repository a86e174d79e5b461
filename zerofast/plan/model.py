"""The plan: a plain-data description of every output tensor, and the vocabulary builders use.

For each output tensor the plan lists which ranges of which source tensors land where, the
dtype they are stored in and the dtype they come out as. Building a plan reads only metadata;
executing it (``zerofast.execute``) is the only step that moves bytes. One tensor's plan
(:class:`TensorPlan`) and the segment tables are :mod:`.tensor`'s; a plan keeps its tensors
as columns (:class:`~.columns.PlanTensors`).
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..load.unpickle import in_file_mapping
from .columns import PlanTensors, columns_of
from .tensor import Entry, Segment, Segments, SegmentTable, TableSegments, TensorPlan

__all__ = ["TRAINABLE", "FROZEN", "BUFFER", "Segment", "Segments", "Entry", "FlatGroups", "SegmentTable",
           "TableSegments", "TensorPlan", "Plan", "SourceTable", "VirtualBuffer", "tensor_identity", "ceil_div",
           "rank_share"]

TRAINABLE, FROZEN, BUFFER = "trainable", "frozen", "buffer"

# Per rank, per flat group: (where the tensor sits in its file's pickle, the 1-D tensor). The fp32
# masters and every per-element optimizer state (Adam's moments) are partitioned alike, so one set
# of builders lays out either; only the tensors they read differ.
FlatGroups = list[list[tuple[str, torch.Tensor]]]


@dataclass(frozen=True)
class Plan:
    # output name -> plan, kept column by column; aliases are not repeated here. Given a mapping
    # of TensorPlans (a plan adapted by hand: an adapter's, a merge's), the plan holds its columns.
    tensors: PlanTensors
    aliases: dict[str, str]  # tied name -> name in ``tensors``
    order: tuple[str, ...]  # every output key, the model's own state_dict() order
    stage: int
    world_size: int
    # The save left its frozen parameters out (exclude_frozen_parameters=True); the names of
    # those it still mentions (the other half of a tied pair) are in absent_frozen.
    frozen_excluded: bool = False
    absent_frozen: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensors", columns_of(self.tensors))


class SourceTable:
    """Collects the source tensors a plan refers to, each registered once by its place in a file."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        # still a view of a file's live mapping (load.unpickle.in_file_mapping): not copied to
        # fit, not read whole into memory (a small file), which must never have its pages dropped
        self.mapped: list[bool] = []
        self.files: list[str] = []  # the file each came from
        self._index: dict[tuple[str, str], int] = {}

    def add(self, file: str, key: str, tensor: torch.Tensor) -> int:
        ident = (file, key)
        if ident not in self._index:
            flat = tensor.reshape(-1) if tensor.is_contiguous() else tensor.contiguous().reshape(-1)
            self._index[ident] = len(self.tensors)
            self.tensors.append(flat)
            self.mapped.append(in_file_mapping(file, flat))  # a copy made to fit lies in no mapping
            self.files.append(file)
        return self._index[ident]

    def whole(self, file: str, key: str, tensor: torch.Tensor) -> Entry:
        """The entry of a tensor stored whole under ``key`` of ``file``."""
        return tuple(tensor.shape), tensor.dtype, [(self.add(file, key, tensor), 0, 0, tensor.numel())]


class VirtualBuffer:
    """Several source tensors seen end to end as one flat buffer."""

    def __init__(self, sources: Sequence[int], lengths: Sequence[int]):
        self.sources = list(sources)
        self.starts = [0]
        for n in lengths:
            self.starts.append(self.starts[-1] + n)

    @property
    def numel(self) -> int:
        return self.starts[-1]

    def pieces(self, offset: int, length: int, dst: int) -> Segments:
        """Segments that copy ``[offset, offset+length)`` of the buffer to output offset ``dst``."""
        # Called once per parameter: start at the source holding ``offset``, not at the first.
        starts, end, out = self.starts, offset + length, []
        i = bisect.bisect_right(starts, offset) - 1
        while 0 <= i < len(self.sources) and starts[i] < end:
            lo = offset if offset > starts[i] else starts[i]
            hi = end if end < starts[i + 1] else starts[i + 1]
            if lo < hi:
                out.append((self.sources[i], lo - starts[i], dst + lo - offset, hi - lo))
            i += 1
        return out


    def single_pieces(self, offsets: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`pieces` of many ranges at once, for those that lie in one source: per range its
        source and the offset there, and a mask of the ranges this does not cover (empty, past
        the end, or crossing into the next source), to be cut with :meth:`pieces` one by one."""
        starts = np.array(self.starts, dtype=np.int64)
        last = len(self.sources) - 1
        at = np.searchsorted(starts, offsets, side="right") - 1
        odd = (lengths == 0) | (at > last) | (offsets + lengths > starts[np.minimum(at + 1, last + 1)])
        at = np.minimum(at, last)
        return np.array(self.sources, dtype=np.int64)[at], offsets - starts[at], odd


def tensor_identity(t) -> tuple:
    """Same value for two module entries exactly when they are one tensor saved under two names.

    Sharing a storage is not enough: fused fp16/bf16 optimizers keep every parameter as a view
    into one flat buffer, so distinct parameters share storages at different offsets.
    """
    if not isinstance(t, torch.Tensor):
        return ("object", id(t))
    return (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), tuple(t.stride()))


def ceil_div(n: int, k: int) -> int:
    """Integer ceil(n / k): float division loses exactness past 2**53 elements."""
    return -(-n // k)


def rank_share(n: int, k: int, rank: int) -> int:
    """Elements of an n-element tensor cut into k-element partitions that ``rank`` holds."""
    return max(0, min(k, n - rank * k))
