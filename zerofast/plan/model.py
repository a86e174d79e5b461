"""The plan: a plain-data description of every output tensor, and the vocabulary builders use.

For each output tensor the plan lists which ranges of which source tensors land where, the
dtype they are stored in and the dtype they come out as. Building a plan reads only metadata;
executing it (``zerofast.execute``) is the only step that moves bytes.
"""
from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import chain, repeat

import numpy as np
import torch

from ..load.unpickle import in_file_mapping

TRAINABLE, FROZEN, BUFFER = "trainable", "frozen", "buffer"

Segment = tuple[int, int, int, int]  # (source index, source offset, output offset, length)
Segments = list[Segment]
# What a layout builder says about one tensor: its shape, stored dtype, and where its elements are.
Entry = tuple[tuple[int, ...], torch.dtype, Segments]
# Per rank, per flat group: (where the tensor sits in its file's pickle, the 1-D tensor). The fp32
# masters and every per-element optimizer state (Adam's moments) are partitioned alike, so one set
# of builders lays out either; only the tensors they read differ.
FlatGroups = list[list[tuple[str, torch.Tensor]]]


class SegmentTable:
    """The segments of many tensors as one int64 array of rows (source index, source offset,
    output offset, length): tensor ``i`` has rows ``[starts[i], starts[i + 1])``.

    A plan of tens of thousands of tensors keeps its segments here, 32 bytes a row, instead of
    a tuple of four Python ints per row (about 160 bytes), and each tensor a
    :class:`TableSegments` view of its rows; the batched reader takes rows straight from here."""

    __slots__ = ("rows", "starts")

    def __init__(self, rows: np.ndarray, starts: np.ndarray):
        self.rows = rows
        self.starts = starts

    @classmethod
    def of(cls, segments: Sequence[Sequence[Segment]]) -> "SegmentTable":
        counts = np.fromiter(map(len, segments), dtype=np.int64, count=len(segments))
        starts = np.zeros(len(segments) + 1, dtype=np.int64)
        np.cumsum(counts, out=starts[1:])
        flat = np.fromiter(chain.from_iterable(chain.from_iterable(segments)), dtype=np.int64,
                           count=4 * int(starts[-1]))
        return cls(flat.reshape(-1, 4), starts)

    @classmethod
    def regular(cls, rows: np.ndarray, odd: np.ndarray, cut: Sequence[Sequence[Segment]]) -> "SegmentTable":
        """Tensor ``i``'s segments are ``rows[i]`` (an (N, R, 4) array), except where ``odd`` (a
        mask) is set: the tensors there take the segments of ``cut``, in order."""
        counts = np.full(len(rows), rows.shape[1], dtype=np.int64)
        where = np.flatnonzero(odd)
        counts[where] = np.fromiter(map(len, cut), dtype=np.int64, count=len(where))
        starts = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(counts, out=starts[1:])
        if not len(where):
            return cls(rows.reshape(-1, 4), starts)
        flat = np.empty((int(starts[-1]), 4), dtype=np.int64)
        in_odd = np.repeat(odd, counts)
        flat[~in_odd] = rows[~odd].reshape(-1, 4)
        flat[in_odd] = cls.of(cut).rows
        return cls(flat, starts)

    def views(self) -> list["TableSegments"]:
        return list(map(TableSegments, repeat(self), range(len(self.starts) - 1)))

    def gather(self, which: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows of tensors ``which`` in that order, and how many each has."""
        lo, counts = self.starts[which], self.starts[which + 1] - self.starts[which]
        first = np.cumsum(counts) - counts
        at = np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(lo - first, counts)
        return self.rows[at], counts


class TableSegments(Sequence):
    """One tensor's segments, read from its :class:`SegmentTable` as tuples when asked."""

    __slots__ = ("table", "number")

    def __init__(self, table: SegmentTable, number: int):
        self.table = table
        self.number = number

    def tuples(self) -> tuple[Segment, ...]:
        starts = self.table.starts
        return tuple(map(tuple, self.table.rows[starts[self.number]:starts[self.number + 1]].tolist()))

    def __len__(self) -> int:
        starts = self.table.starts
        return int(starts[self.number + 1]) - int(starts[self.number])

    def __getitem__(self, k):
        if not isinstance(k, int):
            return self.tuples()[k]
        n = len(self)  # one row without the others: Executor.may_view looks at the first of each tensor
        if not -n <= k < n:
            raise IndexError("segment index out of range")
        return tuple(self.table.rows[int(self.table.starts[self.number]) + k % n].tolist())

    def __iter__(self):
        return iter(self.tuples())

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and self.tuples() == tuple(map(tuple, other))

    def __hash__(self) -> int:
        return hash(self.tuples())

    def __repr__(self) -> str:
        return repr(self.tuples())


@dataclass(slots=True, unsafe_hash=True)
class TensorPlan:
    """One output tensor: ``segments`` rows are (source index, source offset, output offset,
    length), a tuple or a :class:`TableSegments` view of a plan's table.

    Plain data, never changed once built (a changed copy is ``dataclasses.replace``). It is not
    a frozen dataclass only because frozen fields cost five times as much to set: 0.1 s over a
    plan of 50k tensors."""

    name: str
    shape: tuple[int, ...]
    kind: str
    stored_dtype: torch.dtype
    out_dtype: torch.dtype
    segments: Sequence[Segment]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.out_dtype.itemsize

    def slice(self, lo: int, hi: int) -> "TensorPlan":
        """Elements ``[lo, hi)`` of this tensor (flattened) as a 1-D plan of their own."""
        segments = []
        for src, src_off, dst_off, length in self.segments:
            a, b = max(dst_off, lo), min(dst_off + length, hi)
            if a < b:
                segments.append((src, src_off + a - dst_off, a - lo, b - a))
        return dataclasses.replace(self, shape=(hi - lo,), segments=tuple(segments))


@dataclass(frozen=True)
class Plan:
    # output name -> plan; aliases are not repeated here. A read-only mapping: a dict, or for
    # plans of many tensors a plan.columns.PlanTensors (the same plans, kept column by column)
    tensors: Mapping[str, TensorPlan]
    aliases: dict[str, str]  # tied name -> name in ``tensors``
    order: tuple[str, ...]  # every output key, the model's own state_dict() order
    stage: int
    world_size: int
    # The save left its frozen parameters out (exclude_frozen_parameters=True); the names of
    # those it still mentions (the other half of a tied pair) are in absent_frozen.
    frozen_excluded: bool = False
    absent_frozen: tuple[str, ...] = ()


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
