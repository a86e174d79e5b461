"""Plans of tens of thousands of tensors, kept column by column.

A ZeRO save of 20k small parameters used to cost a Python object per tensor at every step: an
entry and a segment view from the builder, a :class:`~.model.TensorPlan` from the plan, and a
trip through each again when the executor packed its table. Here the builders' output
(:class:`EntryTable`) and the plan's tensors (:class:`PlanTensors`) are lists and one
:class:`~.model.SegmentTable`; both are ordinary read-only mappings, whose values are made
only when someone asks for them, and the batched reader takes the columns as they are.
"""
from __future__ import annotations

import math
import operator
from collections.abc import ItemsView, Mapping, ValuesView
from itertools import chain, repeat
from typing import Iterator, Sequence

import numpy as np
import torch

from .model import Entry, SegmentTable, TableSegments, TensorPlan


class _Named(Mapping):
    """A mapping over ``names`` (a list) and ``index`` (name -> number in it)."""

    __slots__ = ()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, name: object) -> bool:
        return name in self.index

    def keys(self):
        return self.index.keys()  # a dict's view: set operations on it run in C


class EntryTable(_Named):
    """A builder's entries (name -> :data:`~.model.Entry`) of one stored dtype whose segments
    are the rows of one table, tensor ``i`` named ``names[i]``. Made with :meth:`of`, which
    declines names that repeat (the dict a builder would make keeps the last of those)."""

    __slots__ = ("names", "shapes", "dtype", "table", "index")

    def __init__(self, names: list[str], shapes: list, dtype: torch.dtype, table: SegmentTable,
                 index: dict[str, int]):
        self.names = names
        self.shapes = shapes
        self.dtype = dtype
        self.table = table
        self.index = index  # name -> its number

    @classmethod
    def of(cls, names: list[str], shapes: list, dtype: torch.dtype,
           table: SegmentTable) -> "EntryTable | dict[str, Entry]":
        index = dict(zip(names, range(len(names))))
        if len(index) == len(names):
            return cls(names, shapes, dtype, table, index)
        return dict(zip(names, zip(shapes, repeat(dtype), table.views())))

    def __getitem__(self, name: str) -> Entry:
        i = self.index[name]
        return self.shapes[i], self.dtype, TableSegments(self.table, i)

    @staticmethod
    def join(parts: Sequence["EntryTable"]) -> "EntryTable | None":
        """Several tables as one (stages 1-2 build one per param group), or None where they
        differ in dtype or share a name."""
        if len({p.dtype for p in parts}) != 1:
            return None
        names = list(chain.from_iterable(p.names for p in parts))
        index = dict(zip(names, range(len(names))))
        if len(index) != len(names):
            return None
        rows = np.concatenate([p.table.rows for p in parts])
        starts = np.zeros(len(names) + 1, dtype=np.int64)
        np.cumsum(np.concatenate([np.diff(p.table.starts) for p in parts]), out=starts[1:])
        shapes = list(chain.from_iterable(p.shapes for p in parts))
        return EntryTable(names, shapes, parts[0].dtype, SegmentTable(rows, starts), index)


class PlanTensors(_Named):
    """A plan's tensors (name -> :class:`~.model.TensorPlan`), column by column: tensor ``i``
    is ``names[i]`` with rows ``i`` of ``table``. A TensorPlan is made the first time one is
    looked up, and kept (the lazy mapping looks each up more than once); tensors whose segments
    were given as tuples (``loose``: number -> tuple) get those back."""

    __slots__ = ("names", "shapes", "kinds", "stored", "out", "table", "loose", "_index", "_made", "_numels")

    def __init__(self, names: list[str], shapes: list, kinds: list[str], stored: list[torch.dtype],
                 out: list[torch.dtype], table: SegmentTable, loose: dict[int, tuple]):
        self.names, self.shapes, self.kinds, self.stored, self.out = names, shapes, kinds, stored, out
        self.table = table
        self.loose = loose
        self._index: dict[str, int] | None = None
        self._made: list[TensorPlan | None] | None = None
        self._numels: np.ndarray | None = None

    @property
    def index(self) -> dict[str, int]:
        """name -> number, made on the first lookup by name (the eager dict never makes one)."""
        if self._index is None:
            self._index = dict(zip(self.names, range(len(self.names))))
        return self._index

    def plan_of(self, i: int) -> TensorPlan:
        made = self._made
        if made is None:
            made = self._made = [None] * len(self.names)
        tp = made[i]
        if tp is None:
            segments = self.loose.get(i)
            tp = made[i] = TensorPlan(self.names[i], self.shapes[i], self.kinds[i], self.stored[i], self.out[i],
                                      TableSegments(self.table, i) if segments is None else segments)
        return tp

    def __getitem__(self, name: str) -> TensorPlan:
        return self.plan_of(self.index[name])

    @classmethod
    def of(cls, tps: Sequence[TensorPlan]) -> "PlanTensors":
        """The columns of plans made one by one (a small plan's dict, an adapter's). Its own
        lookups return those plans; :meth:`select` and :meth:`span` make theirs from the table."""
        rows, counts = segment_rows([tp.segments for tp in tps])
        cols = cls([tp.name for tp in tps], [tp.shape for tp in tps], [tp.kind for tp in tps],
                   [tp.stored_dtype for tp in tps], [tp.out_dtype for tp in tps], _table(rows, counts), {})
        cols._made = list(tps)
        return cols

    def select(self, numbers: np.ndarray, names: list[str] | None = None) -> "PlanTensors":
        """Tensors ``numbers`` (an int64 array; a number may repeat) in that order, named
        ``names`` where given (a tied weight written twice): an export's file, in its order."""
        n = len(self.names)
        if names is None and len(numbers) == n and bool((numbers == np.arange(n)).all()):
            return self
        at = numbers.tolist()
        pick = [list(map(column.__getitem__, at)) for column in (self.names, self.shapes, self.kinds, self.stored,
                                                               self.out)]
        loose = {new: self.loose[old] for new, old in enumerate(at) if old in self.loose} if self.loose else {}
        part = PlanTensors(pick[0] if names is None else names, *pick[1:], _table(*self.table.gather(numbers)), loose)
        part._numels = None if self._numels is None else self._numels[numbers]
        return part

    def span(self, lo: int, hi: int) -> "PlanTensors":
        """Tensors ``[lo, hi)``: :meth:`select` of a range, cut from the columns as slices."""
        if lo == 0 and hi == len(self.names):
            return self
        starts = self.table.starts
        table = SegmentTable(self.table.rows[int(starts[lo]):int(starts[hi])], starts[lo:hi + 1] - starts[lo])
        loose = {i - lo: t for i, t in self.loose.items() if lo <= i < hi} if self.loose else {}
        part = PlanTensors(self.names[lo:hi], self.shapes[lo:hi], self.kinds[lo:hi], self.stored[lo:hi],
                           self.out[lo:hi], table, loose)
        part._numels = None if self._numels is None else self._numels[lo:hi]
        return part

    def numels(self) -> np.ndarray:
        """Each tensor's element count, as an int64 array (made once: a file's batches ask it)."""
        if self._numels is None:
            self._numels = np.fromiter(map(math.prod, self.shapes), dtype=np.int64, count=len(self.shapes))
        return self._numels

    def itemsizes(self) -> np.ndarray:
        """Each tensor's output itemsize, as an int64 array."""
        size = {d: d.itemsize for d in dict.fromkeys(self.out)}
        if len(size) == 1:
            return np.full(len(self.out), next(iter(size.values())), dtype=np.int64)
        return np.fromiter(map(size.__getitem__, self.out), dtype=np.int64, count=len(self.out))

    def nbytes(self) -> np.ndarray:
        """Each tensor's output bytes, as an int64 array."""
        return self.numels() * self.itemsizes()

    def values(self) -> "_Values":
        return _Values(self)

    def __repr__(self) -> str:
        shown = ", ".join(map(repr, self.names[:3]))
        return f"PlanTensors({len(self)} tensors: {shown}{', ...' if len(self) > 3 else ''})"

    def items(self) -> "_Items":
        return _Items(self)


def columns_of(tensors: Mapping[str, TensorPlan]) -> PlanTensors:
    """A plan's tensors as columns: a :class:`PlanTensors` as it is, a dict's plans gathered."""
    return tensors if isinstance(tensors, PlanTensors) else PlanTensors.of(list(tensors.values()))


class Placed(Sequence):
    """``(plan, byte offset)`` of each tensor of ``tensors``, kept as columns: the tensors of
    an export's file (or a batch of them) where they go in it."""

    __slots__ = ("tensors", "offsets")

    def __init__(self, tensors: PlanTensors, offsets: np.ndarray):
        self.tensors = tensors
        self.offsets = offsets  # int64, one per tensor

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i):
        i = range(len(self))[operator.index(i)]  # one index (a slice is part()'s), negative from the end
        return self.tensors.plan_of(i), int(self.offsets[i])

    def part(self, lo: int, hi: int, base: int = 0) -> "Placed":
        """Tensors ``[lo, hi)``, their offsets moved by ``base``."""
        return Placed(self.tensors.span(lo, hi), self.offsets[lo:hi] + base)


def as_dict(tensors: Mapping[str, TensorPlan]) -> dict[str, TensorPlan]:
    """A plan's tensors as a plain dict, for a caller that looks up every name (a
    :class:`PlanTensors` answers each lookup in Python; a dict, in C)."""
    return tensors if type(tensors) is dict else dict(tensors.items())


class _Values(ValuesView):
    def __iter__(self) -> Iterator[TensorPlan]:
        return map(self._mapping.plan_of, range(len(self._mapping)))


class _Items(ItemsView):
    def __iter__(self):
        return zip(self._mapping.names, map(self._mapping.plan_of, range(len(self._mapping))))


class Layers:
    """Entries by kind: name -> (kind, :data:`~.model.Entry`) over ``(kind, entries)`` pairs,
    where two name one tensor the later winning, as ``dict.update`` in turn would have it.
    ``names``: every name once, in the order that dict would have."""

    def __init__(self, layers: Sequence[tuple[str, Mapping[str, Entry]]]):
        self.layers = [(kind, entries) for kind, entries in layers if len(entries)]
        self.names = dict.fromkeys(chain.from_iterable(entries.keys() for _, entries in self.layers))

    def kind(self, name: str) -> str | None:
        for kind, entries in reversed(self.layers):
            if name in entries:
                return kind
        return None


def plan_tensors(named: list[str], layers: Layers, out_dtype) -> PlanTensors:
    """The columns of ``named`` (every one in ``layers``), their output dtypes ``out_dtype(stored)``.

    Column by column per layer: a layer's positions in ``named`` at once, an
    :class:`EntryTable`'s rows gathered from its table, never an entry made of it."""
    n = len(named)
    winner, numbers = _winners(named, layers.layers)
    shapes, kinds, stored = (np.empty(n, dtype=object) for _ in range(3))
    loose: dict[int, tuple] = {}
    parts = []
    for k, (kind, entries) in enumerate(layers.layers):
        at = np.flatnonzero(winner == k)
        if not len(at):
            continue
        kinds[at] = kind
        if type(entries) is EntryTable:
            which = numbers[at] if k == 0 and numbers is not None else np.fromiter(
                map(entries.index.__getitem__, map(named.__getitem__, at.tolist())), dtype=np.int64, count=len(at))
            shapes[at] = np.fromiter(map(entries.shapes.__getitem__, which.tolist()), dtype=object, count=len(at))
            stored[at] = entries.dtype
            parts.append((at, *entries.table.gather(which)))
            continue
        names = list(map(named.__getitem__, at.tolist()))
        shape, dtypes, segments = zip(*map(entries.__getitem__, names))
        shapes[at] = np.fromiter(shape, dtype=object, count=len(at))
        stored[at] = np.fromiter(dtypes, dtype=object, count=len(at))
        loose.update((i, tuple(s)) for i, s in zip(at.tolist(), segments) if type(s) is not TableSegments)
        parts.append((at, *segment_rows(segments)))
    stored_dtypes = stored.tolist()
    outs = {s: out_dtype(s) for s in set(stored_dtypes)}
    return PlanTensors(list(named), shapes.tolist(), kinds.tolist(), stored_dtypes,
                       list(map(outs.__getitem__, stored_dtypes)), scattered(n, parts), loose)


def _winners(named: list[str], layers: list) -> tuple[np.ndarray, np.ndarray | None]:
    """Per name of ``named``, the layer whose entry it takes (the last that holds it), and where
    the first layer is the one :class:`EntryTable`, each name's number there (-1: not in it).

    That case (a builder's table, then the few frozen weights and buffers of the module) is
    looked up once per name, in the table alone; the later layers' names are placed by their
    numbers there, or among the few names the table lacks."""
    n = len(named)
    first = layers[0][1] if layers else None
    if type(first) is not EntryTable or any(type(e) is EntryTable for _, e in layers[1:]):
        which: dict[str, int] = {}
        for k, (_, entries) in enumerate(layers):
            which.update(zip(entries.keys(), repeat(k)))
        return np.fromiter(map(which.__getitem__, named), dtype=np.int64, count=n), None
    numbers = np.fromiter(map(first.index.get, named, repeat(-1)), dtype=np.int64, count=n)
    winner = np.where(numbers >= 0, 0, -1)
    if len(layers) > 1:
        inside = np.flatnonzero(numbers >= 0)
        place = np.full(len(first) + 1, -1, dtype=np.int64)  # table number -> position; [-1]: none
        place[numbers[inside]] = inside
        missing = np.flatnonzero(numbers < 0).tolist()
        outside = dict(zip(map(named.__getitem__, missing), missing))  # the few names the table lacks
        for k, (_, entries) in enumerate(layers[1:], 1):
            names = list(entries.keys())
            there = place[np.fromiter(map(first.index.get, names, repeat(-1)), dtype=np.int64, count=len(names))]
            elsewhere = np.fromiter(map(outside.get, names, repeat(-1)), dtype=np.int64, count=len(names))
            at = np.where(there >= 0, there, elsewhere)
            winner[at[at >= 0]] = k
    if bool((winner < 0).any()):
        raise KeyError(named[int(np.flatnonzero(winner < 0)[0])])
    return winner, numbers


def segment_rows(segments: Sequence[Sequence]) -> tuple[np.ndarray, np.ndarray]:
    """The rows of each of ``segments`` (tuples, or :class:`~.model.TableSegments` of any
    tables) in that order, and how many each has: a table at a time, no object per row."""
    tables = list(map(getattr, segments, repeat("table"), repeat(None)))
    distinct = list(dict.fromkeys(map(id, tables)))
    if len(distinct) == 1 and tables and tables[0] is not None:
        numbers = np.fromiter(map(getattr, segments, repeat("number")), dtype=np.int64, count=len(segments))
        return tables[0].gather(numbers)
    code = {t: k for k, t in enumerate(distinct)}
    codes = np.fromiter(map(code.__getitem__, map(id, tables)), dtype=np.int64, count=len(tables))
    parts = []
    for k in range(len(distinct)):
        at = np.flatnonzero(codes == k)
        picked = list(map(segments.__getitem__, at.tolist()))
        table = tables[int(at[0])]
        if table is None:
            tuples = SegmentTable.of(picked)
            rows, counts = tuples.rows, np.diff(tuples.starts)
        else:
            rows, counts = table.gather(np.fromiter(map(getattr, picked, repeat("number")), dtype=np.int64,
                                                    count=len(picked)))
        parts.append((at, rows, counts))
    table = scattered(len(segments), parts)
    return table.rows, np.diff(table.starts)


def _table(rows: np.ndarray, counts: np.ndarray) -> SegmentTable:
    starts = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    return SegmentTable(rows.reshape(-1, 4), starts)


def scattered(n: int, parts: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> SegmentTable:
    """One table of ``n`` tensors from ``(positions, rows, counts)`` parts: the tensors at
    ``positions`` have ``counts`` rows each, ``rows`` end to end in that order."""
    counts = np.zeros(n, dtype=np.int64)
    for at, _, c in parts:
        counts[at] = c
    starts = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    if len(parts) == 1 and len(parts[0][0]) == n and bool((np.diff(parts[0][0]) > 0).all()):
        return SegmentTable(parts[0][1].reshape(-1, 4), starts)  # one part, already in order
    rows = np.empty((int(starts[-1]), 4), dtype=np.int64)
    for at, r, c in parts:
        first = np.cumsum(c) - c
        rows[np.repeat(starts[at] - first, c) + np.arange(len(r), dtype=np.int64)] = r
    return SegmentTable(rows, starts)
