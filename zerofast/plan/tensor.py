"""One tensor's plan and the segment tables plans keep their rows in: the vocabulary below the
plan (:mod:`.model`) and its columns (:mod:`.columns`).

A segment is a row (source index, source offset, output offset, length): that range of that
source tensor lands at that offset of the output, flattened.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain, repeat

import numpy as np
import torch


Segment = tuple[int, int, int, int]  # (source index, source offset, output offset, length)
Segments = list[Segment]
# What a layout builder says about one tensor: its shape, stored dtype, and where its elements are.
Entry = tuple[tuple[int, ...], torch.dtype, Segments]


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
        n = len(self)  # one row without the others
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
