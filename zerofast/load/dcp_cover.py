"""Whether a DCP tensor's chunks cover it exactly once, for any number of chunks.

Each chunk is a box of the tensor (offsets and sizes per dimension). The chunks are accepted
when every box lies inside the tensor and every element is in exactly one box; otherwise
``InconsistentCheckpointError`` names the entry, the file, and what is wrong: the box past the
tensor, two boxes that overlap (and an element both hold), or an element that no box holds.

Up to :data:`FEW` boxes are compared pair by pair in Python. More go into int64 arrays
(numpy), dimensions that every box spans whole are left out, and the first of three ways that
applies decides:

grid
    Per split dimension, the distinct box edges (with 0 and the dimension's size) cut it into
    intervals. When every box is exactly one interval in every dimension (FSDP2's dim-0 shards,
    tensor-parallel column splits, an FSDP x TP grid, one-row shards), a box is a cell of that
    grid: the boxes cover the tensor exactly once when no two are the same cell and there are
    as many boxes as cells. Sorting the cells' numbers finds a repeated cell (an overlap) or the
    first missing one (a hole). O(n log n) for n boxes.
corners
    Any other layout. A box's indicator is an alternating sum of the orthant indicators at its
    2^d corners (+1 where an even number of coordinates is an upper edge, -1 otherwise), and
    orthant indicators at distinct points are linearly independent. So the boxes sum to the
    tensor's indicator (an exact cover) exactly when their signed corners, summed per point,
    equal the tensor's own signed corners. Where they do not, the first point in row-major
    order whose sum differs is an element held twice or more (the boxes holding it are named)
    or by none. O(n 2^d log n) for the d dimensions that some box splits, taken while d is at
    most :data:`CORNER_DIMS` and n 2^d at most :data:`CORNER_BUDGET`.
sweep
    What is left (many boxes splitting many dimensions without forming a grid): boxes sorted
    along one dimension, each compared with the boxes still open there; no overlap, every box
    inside, and the volumes summing to the element count is an exact cover. Past
    :data:`SWEEP_BUDGET` coordinate comparisons the entry is refused
    (``UnsupportedCheckpointError``), so the time stays bounded.

Only boxes with elements count: an empty box covers nothing (it must still lie inside).
Memory: a few int64 arrays of the boxes' coordinates (under 300 bytes a box for a 2-d tensor)
and, on the corner path, at most :data:`CORNER_BUDGET` corners of 8 bytes.
"""
from __future__ import annotations

import array
import heapq
import itertools
import math
from pathlib import Path
from typing import Sequence

import numpy as np

from ..base.errors import InconsistentCheckpointError, UnsupportedCheckpointError

INT_LIMIT = 1 << 62  # sizes, offsets and cell numbers stay below this (int64 with room for a sum)
CORNER_BUDGET = 1 << 22  # signed corners (n 2^d) the corner path may hold: ~80 MB at its peak
CORNER_DIMS = 12  # and at most this many split dimensions (2^d passes)
SWEEP_BUDGET = 1 << 23  # coordinates the sweep may compare (boxes times dimensions): a few seconds
FEW = 8  # up to this many boxes, each pair is compared in Python: quicker than setting up arrays

Box = Sequence[int]


def check_cover(key: str, size: Sequence[int], offsets: Sequence[Box], sizes: Sequence[Box], where: Path) -> None:
    """Raise ``InconsistentCheckpointError`` unless the boxes (``offsets[i]``, ``sizes[i]``) lie
    inside a tensor of ``size`` and hold each of its elements exactly once; it names the entry
    ``key`` of the file ``where`` and the boxes or the element at fault. A tensor of 2**62
    elements or more, and a layout past the sweep's budget, raise ``UnsupportedCheckpointError``."""
    size = tuple(size)
    d, n = len(size), len(offsets)
    if len(sizes) != n:
        raise ValueError("expected as many offsets as sizes")
    if any(k != d for k in itertools.chain(set(map(len, offsets)), set(map(len, sizes)))):
        i = next(i for i in range(n) if len(offsets[i]) != d or len(sizes[i]) != d)
        raise InconsistentCheckpointError(f"entry {key!r}: chunk at {tuple(offsets[i])} of size {tuple(sizes[i])} "
                                          f"does not have the tensor's {d} dimensions", where)
    numel = math.prod(size)
    if numel >= INT_LIMIT:
        raise UnsupportedCheckpointError(f"entry {key!r}: a tensor of size {size} has {numel} elements, more than "
                                         f"2**62: not read", where)
    if (n <= FEW or numel == 0 or d == 0) and _pairwise(key, size, offsets, sizes, where):
        return
    if numel == 0 or d == 0:  # no element, or a 0-d tensor with no chunk
        _hole(key, size, n, (0,) * d, where)
    try:  # array() refuses values past int64
        lo, extent = _matrix(offsets, n, d), _matrix(sizes, n, d)
    except OverflowError:
        lo = extent = None
    if lo is None or bool((lo >= INT_LIMIT).any()) or bool((extent >= INT_LIMIT).any()):
        _pairwise(key, size, offsets, sizes, where, past_only=True)  # names the box past the tensor
        raise AssertionError("unreachable: a number of 2**62 or more is past a tensor of fewer elements")
    hi = lo + extent  # below 2**63: no wrap
    past = np.flatnonzero((hi > np.array(size, dtype=np.int64)).any(1))
    if len(past):
        _past(key, size, offsets, sizes, int(past[0]), where)
    index = np.flatnonzero((hi > lo).all(1))  # live row -> the caller's box number
    if len(index) < n:
        lo, hi = lo[index], hi[index]
    _Cover(key, size, offsets, sizes, index, lo, hi, where).check()


def _matrix(rows: Sequence[Box], n: int, d: int) -> np.ndarray:
    flat = array.array("q", itertools.chain.from_iterable(rows))
    return np.frombuffer(flat, dtype=np.int64).reshape(n, d) if n else np.zeros((0, d), dtype=np.int64)


def _past(key: str, size: tuple, offsets: Sequence[Box], sizes: Sequence[Box], i: int, where: Path):
    raise InconsistentCheckpointError(f"entry {key!r}: chunk at {tuple(offsets[i])} of size {tuple(sizes[i])} is not "
                                      f"inside the tensor's size {size}", where)


def _pairwise(key: str, size: tuple, offsets: Sequence[Box], sizes: Sequence[Box], where: Path,
              past_only: bool = False) -> bool:
    """Plain Python, for a few boxes (each pair compared), a tensor with no elements or a 0-d
    one (where any two live boxes overlap at once), and to name a box whose numbers do not fit
    int64. True when the boxes cover the tensor exactly; False when some element is in none."""
    live = []
    for i, (o, s) in enumerate(zip(offsets, sizes)):
        if any(a + b > m for a, b, m in zip(o, s, size)):
            _past(key, size, offsets, sizes, i, where)
        if all(s):
            live.append(i)
    if past_only:
        return False
    for j, a in enumerate(live):
        a_lo, a_size = offsets[a], sizes[a]
        for b in live[:j]:
            b_lo, b_size = offsets[b], sizes[b]
            if all(x < y + t and y < x + s for x, s, y, t in zip(a_lo, a_size, b_lo, b_size)):
                _overlap(key, offsets, sizes, b, a, tuple(max(x, y) for x, y in zip(a_lo, b_lo)), where)
    return sum(math.prod(sizes[i]) for i in live) == math.prod(size)


def _overlap(key: str, offsets: Sequence[Box], sizes: Sequence[Box], a: int, b: int, point: tuple, where: Path):
    raise InconsistentCheckpointError(
        f"entry {key!r}: chunks at {tuple(offsets[a])} of size {tuple(sizes[a])} and at {tuple(offsets[b])} of size "
        f"{tuple(sizes[b])} overlap (both hold the element at {point})", where)


def _hole(key: str, size: tuple, n: int, point: tuple, where: Path):
    raise InconsistentCheckpointError(f"entry {key!r}: the element at {point} of the tensor of size {size} is in none "
                                      f"of its {n} chunks", where)


class _Cover:
    """The live boxes (lo inclusive, hi exclusive, one row each) of one tensor, checked."""

    def __init__(self, key, size, offsets, sizes, index, lo, hi, where):
        self.key, self.size, self.offsets, self.sizes, self.where = key, size, offsets, sizes, where
        self.index, self.lo, self.hi = index, lo, hi
        self.n = len(offsets)

    def check(self) -> None:
        d, m = len(self.size), len(self.index)
        if m == 0:
            _hole(self.key, self.size, self.n, (0,) * d, self.where)
        extent = np.array(self.size, dtype=np.int64)
        whole = ((self.lo == 0) & (self.hi == extent)).all(0)
        self.split = [k for k in range(d) if not whole[k]]
        if not self.split:  # every live box is the whole tensor
            if m > 1:
                self.overlap(0, 1, (0,) * d)
            return
        # Per split dimension, the sorted distinct edges (0 and the size among them), and each
        # box's edges as positions among them.
        self.cuts, self.lo_at, self.hi_at = [], [], []
        lo, hi = np.ascontiguousarray(self.lo.T), np.ascontiguousarray(self.hi.T)  # one row per dimension
        for k in self.split:
            cuts = _distinct(np.concatenate([lo[k], hi[k], [0, self.size[k]]]))
            self.cuts.append(cuts)
            self.lo_at.append(np.searchsorted(cuts, lo[k]))
            self.hi_at.append(np.searchsorted(cuts, hi[k]))
        if all(bool((h - l == 1).all()) for l, h in zip(self.lo_at, self.hi_at)):
            self.grid()
        elif len(self.split) <= CORNER_DIMS and m << len(self.split) <= CORNER_BUDGET \
                and math.prod(len(c) for c in self.cuts) < INT_LIMIT:
            self.corners()
        else:
            self.sweep()

    # -- naming what is wrong -------------------------------------------------------------------
    def box(self, row: int) -> int:
        return int(self.index[row])

    def point(self, at: Sequence[int]) -> tuple:
        """The element whose split coordinates are the edges numbered ``at`` (0 elsewhere)."""
        out = [0] * len(self.size)
        for k, cuts, i in zip(self.split, self.cuts, at):
            out[k] = int(cuts[i])
        return tuple(out)

    def overlap(self, a: int, b: int, point: tuple):
        _overlap(self.key, self.offsets, self.sizes, self.box(a), self.box(b), point, self.where)

    def hole(self, point: tuple):
        _hole(self.key, self.size, self.n, point, self.where)

    def overlap_at(self, point: tuple):
        p = np.array(point, dtype=np.int64)
        rows = np.flatnonzero(((self.lo <= p) & (p < self.hi)).all(1))
        if len(rows) < 2:
            raise AssertionError(f"the element at {point} should be in two chunks")
        self.overlap(int(rows[0]), int(rows[1]), point)

    # -- the three ways -------------------------------------------------------------------------
    def grid(self) -> None:
        m = len(self.index)
        radix = [len(c) - 1 for c in self.cuts]  # intervals per split dimension
        cells = math.prod(radix)  # at most the tensor's element count: each cell holds one at least
        number = _numbers(self.lo_at, radix)
        order = np.argsort(number, kind="stable")
        ordered = number[order]
        same = np.flatnonzero(ordered[1:] == ordered[:-1])
        if len(same):
            j = int(same[0])
            a, b = int(order[j]), int(order[j + 1])
            self.overlap(a, b, tuple(int(v) for v in self.lo[a]))
        if m == cells:
            return
        # The first cell number that no box has: where the sorted numbers leave 0, 1, 2, ...
        gap = np.flatnonzero(ordered != np.arange(m))
        first = int(gap[0]) if len(gap) else m
        self.hole(self.point(_digits(first, radix)))

    def corners(self) -> None:
        radix = [len(c) for c in self.cuts]  # edge positions per split dimension
        s, m = len(self.split), len(self.index)
        # Row ``mask``: each box's corner with an upper edge in the dimensions of the mask's
        # bits, then the tensor's own corner, subtracted: the sums are coverage - 1 per element.
        # Each corner is its row-major number times two, plus one where its sign is negative.
        corners = np.empty((1 << s, m + 1), dtype=np.int64)
        for mask in range(1 << s):
            at = [h if mask >> k & 1 else l for k, (l, h) in enumerate(zip(self.lo_at, self.hi_at))]
            negative = bin(mask).count("1") & 1
            corners[mask, :m] = _numbers(at, radix) * 2 + negative
            corners[mask, m] = _number([radix[k] - 1 if mask >> k & 1 else 0 for k in range(s)], radix) * 2 \
                + (1 - negative)
        corners = corners.reshape(-1)
        corners.sort()
        negative = (corners & 1).astype(np.int32)
        corners >>= 1
        starts = np.flatnonzero(np.concatenate([[True], corners[1:] != corners[:-1]]))
        total = np.add.reduceat(1 - 2 * negative, starts)  # +1 and -1 per point, summed
        del negative
        wrong = np.flatnonzero(total)
        if not len(wrong):
            return
        # The first point in row-major order whose sum is not 0: the corners at or below it in
        # every coordinate come before it in that order, so only its own sum counts there, and
        # that sum is the point's coverage less one.
        j = int(wrong[0])
        point = self.point(_digits(int(corners[starts[j]]), radix))
        if int(total[j]) > 0:
            self.overlap_at(point)
        self.hole(point)

    def sweep(self) -> None:
        axis = max(range(len(self.split)), key=lambda k: len(self.cuts[k]))
        k = self.split[axis]
        others = [j for j in self.split if j != k]
        lo, hi = self.lo[:, others].tolist(), self.hi[:, others].tolist()
        start, end = self.lo[:, k].tolist(), self.hi[:, k].tolist()
        budget = SWEEP_BUDGET
        open_: list[tuple[int, int]] = []  # (end along the axis, row) of boxes still open
        for row in sorted(range(len(start)), key=start.__getitem__):
            while open_ and open_[0][0] <= start[row]:
                heapq.heappop(open_)
            budget -= len(open_) * max(1, len(others))
            if budget < 0:
                raise UnsupportedCheckpointError(
                    f"entry {self.key!r}: its {self.n} chunks split {len(self.split)} dimensions without forming a grid; "
                    f"checking that no two overlap would take more than {SWEEP_BUDGET} comparisons: not read",
                    self.where)
            a_lo, a_hi = lo[row], hi[row]
            for _, other in open_:
                b_lo, b_hi = lo[other], hi[other]
                if all(x < y2 and y < x2 for x, x2, y, y2 in zip(a_lo, a_hi, b_lo, b_hi)):
                    point = [0] * len(self.size)
                    point[k] = start[row]
                    for j, x, y in zip(others, a_lo, b_lo):
                        point[j] = max(x, y)
                    self.overlap(other, row, tuple(point))
            heapq.heappush(open_, (end[row], row))
        held = sum((self.hi - self.lo).prod(1).tolist())  # each below 2**62
        numel = math.prod(self.size)
        if held != numel:  # no overlaps and every box inside: fewer elements than the tensor's
            raise InconsistentCheckpointError(f"entry {self.key!r}: its {self.n} chunks hold {held} of the "
                                              f"{numel} elements of the tensor of size {self.size}: the rest are "
                                              f"in none", self.where)


def _distinct(values: np.ndarray) -> np.ndarray:
    """The sorted distinct values (np.unique, by one in-place sort)."""
    values.sort()
    return values[np.concatenate([[True], values[1:] != values[:-1]])]


def _numbers(at: list[np.ndarray], radix: list[int]) -> np.ndarray:
    """Row-major numbers of positions (one array per dimension), the first dimension slowest."""
    out = np.zeros_like(at[0])
    for positions, r in zip(at, radix):
        out = out * r + positions
    return out


def _number(at: list[int], radix: list[int]) -> int:
    out = 0
    for p, r in zip(at, radix):
        out = out * r + p
    return out


def _digits(number: int, radix: list[int]) -> list[int]:
    out = []
    for r in reversed(radix):
        number, p = divmod(number, r)
        out.append(p)
    return out[::-1]
