"""Plans of tens of thousands of tensors, kept column by column: the one form of a plan.

A ZeRO save of 20k small parameters used to cost a Python object per tensor at every step: an
entry and a segment view from the builder, a :class:`~.tensor.TensorPlan` from the plan, and a
trip through each again when the executor packed its table. Here the builders' output
(:class:`EntryTable`) and the plan's tensors (:class:`PlanTensors`) are lists and one
:class:`~.tensor.SegmentTable`; both are ordinary read-only mappings, whose values are made
only when someone asks for them (a view of the columns), and the batched reader takes the
columns as they are. Entries or plans made one by one become columns where they are handed
over: :meth:`EntryTable.of_entries`, :meth:`PlanTensors.of`.
"""
from __future__ import annotations

import math
import operator
from collections.abc import ItemsView, Mapping, ValuesView
from itertools import chain, repeat
from typing import Iterator, Sequence

import numpy as np
import torch

from .tensor import Entry, SegmentTable, TableSegments, TensorPlan


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
    """A builder's entries (name -> :data:`~.tensor.Entry`), column by column: entry ``i`` is
    ``names[i]`` of ``shapes[i]``, stored as ``dtypes[i]``, its segments rows ``i`` of
    ``table``; ``dtype`` is the one stored dtype of them all (None where they differ).

    A name given twice keeps the place of its first and the entry of its last, as the dict a
    builder would make by assigning each in turn."""

    __slots__ = ("names", "shapes", "dtypes", "dtype", "table", "index")

    def __init__(self, names: list[str], shapes: list, dtypes: list[torch.dtype], dtype: torch.dtype | None,
                 table: SegmentTable):
        index = dict(zip(names, range(len(names))))
        if len(index) != len(names):  # a repeated name: the later entry, at the earlier place
            keep = np.fromiter(index.values(), dtype=np.int64, count=len(index))
            at = keep.tolist()
            names, shapes, dtypes = list(index), list(map(shapes.__getitem__, at)), list(map(dtypes.__getitem__, at))
            table = _table(*table.gather(keep))
            index = dict(zip(names, range(len(names))))
        self.names = names
        self.shapes = shapes
        self.dtypes = dtypes
        self.dtype = dtype
        self.table = table
        self.index = index  # name -> its number

    @classmethod
    def of(cls, names: list[str], shapes: list, dtype: torch.dtype, table: SegmentTable) -> "EntryTable":
        """Entries of one stored dtype (a builder's group, laid out by array arithmetic)."""
        return cls(names, shapes, [dtype] * len(names), dtype, table)

    @classmethod
    def of_entries(cls, entries: Mapping[str, Entry]) -> "EntryTable":
        """The columns of entries made one by one (a dict: a builder's loop, a module's buffers);
        segments that are views of tables (:class:`~.tensor.TableSegments`) are read a table at
        a time."""
        names = list(entries)
        if not names:
            return cls([], [], [], None, SegmentTable(np.zeros((0, 4), dtype=np.int64), np.zeros(1, dtype=np.int64)))
        shapes, dtypes, segments = map(list, zip(*map(entries.__getitem__, names)))
        one = dict.fromkeys(dtypes)
        return cls(names, shapes, dtypes, next(iter(one)) if len(one) == 1 else None, _table(*segment_rows(segments)))

    def __getitem__(self, name: str) -> Entry:
        i = self.index[name]
        return self.shapes[i], self.dtypes[i], TableSegments(self.table, i)

    def without(self, names: set[str] | frozenset[str]) -> "EntryTable":
        """These entries less those of ``names``."""
        if not names or not any(map(names.__contains__, self.names)):
            return self
        keep = np.flatnonzero(np.fromiter(map(names.__contains__, self.names), dtype=bool, count=len(self.names)) == 0)
        at = keep.tolist()
        return EntryTable(list(map(self.names.__getitem__, at)), list(map(self.shapes.__getitem__, at)),
                          list(map(self.dtypes.__getitem__, at)), self.dtype, _table(*self.table.gather(keep)))

    @staticmethod
    def join(parts: Sequence["EntryTable"]) -> "EntryTable":
        """Several tables as one (stages 1-2 build one per param group), a name in two keeping
        the place of its first and the entry of its last (as updating one dict with each)."""
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return EntryTable.of_entries({})
        rows = np.concatenate([p.table.rows for p in parts])
        counts = np.concatenate([np.diff(p.table.starts) for p in parts])
        first = parts[0].dtype
        dtype = first if first is not None and all(p.dtype == first for p in parts) else None
        return EntryTable(list(chain.from_iterable(p.names for p in parts)),
                          list(chain.from_iterable(p.shapes for p in parts)),
                          list(chain.from_iterable(p.dtypes for p in parts)), dtype, _table(rows, counts))


class PlanTensors(_Named):
    """A plan's tensors (name -> :class:`~.tensor.TensorPlan`), column by column: tensor ``i``
    is ``names[i]`` with rows ``i`` of ``table``. A TensorPlan is made the first time one is
    looked up (:meth:`plan_of`: a view of the columns, its segments a
    :class:`~.tensor.TableSegments` of the table), and kept (the lazy mapping looks each up
    more than once)."""

    __slots__ = ("names", "shapes", "kinds", "stored", "out", "table", "_index", "_made", "_numels")

    def __init__(self, names: list[str], shapes: list, kinds: list[str], stored: list[torch.dtype],
                 out: list[torch.dtype], table: SegmentTable):
        self.names, self.shapes, self.kinds, self.stored, self.out = names, shapes, kinds, stored, out
        self.table = table
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
            tp = made[i] = TensorPlan(self.names[i], self.shapes[i], self.kinds[i], self.stored[i], self.out[i],
                                      TableSegments(self.table, i))
        return tp

    def __getitem__(self, name: str) -> TensorPlan:
        return self.plan_of(self.index[name])

    @classmethod
    def of(cls, tps: Sequence[TensorPlan]) -> "PlanTensors":
        """The columns of plans made one by one (a small plan's dict, an adapter's). Its own
        lookups return those plans; :meth:`select` and :meth:`span` make theirs from the table."""
        rows, counts = segment_rows([tp.segments for tp in tps])
        cols = cls([tp.name for tp in tps], [tp.shape for tp in tps], [tp.kind for tp in tps],
                   [tp.stored_dtype for tp in tps], [tp.out_dtype for tp in tps], _table(rows, counts))
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
        part = PlanTensors(pick[0] if names is None else names, *pick[1:], _table(*self.table.gather(numbers)))
        part._numels = None if self._numels is None else self._numels[numbers]
        return part

    def span(self, lo: int, hi: int) -> "PlanTensors":
        """Tensors ``[lo, hi)``: :meth:`select` of a range, cut from the columns as slices."""
        if lo == 0 and hi == len(self.names):
            return self
        starts = self.table.starts
        table = SegmentTable(self.table.rows[int(starts[lo]):int(starts[hi])], starts[lo:hi + 1] - starts[lo])
        part = PlanTensors(self.names[lo:hi], self.shapes[lo:hi], self.kinds[lo:hi], self.stored[lo:hi],
                           self.out[lo:hi], table)
        part._numels = None if self._numels is None else self._numels[lo:hi]
        return part

    def retyped(self, out: list[torch.dtype]) -> "PlanTensors":
        """The same tensors made in the output dtypes ``out`` (one per tensor): a model's own
        dtypes, where ``load_into`` writes into its tensors."""
        part = PlanTensors(self.names, self.shapes, self.kinds, self.stored, list(out), self.table)
        part._numels = self._numels
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
    """A plan's tensors as columns: a :class:`PlanTensors` as it is, a mapping's plans gathered.
    The one door into the plan's form, which :class:`~.model.Plan` passes what it is given
    through (a plan adapted outside :mod:`zerofast.plan` is a dict of TensorPlans)."""
    return tensors if isinstance(tensors, PlanTensors) else PlanTensors.of(list(tensors.values()))


class Placed(Sequence):
    """``(plan, byte offset)`` of each tensor of ``tensors``, kept as columns: the tensors of
    an export's file (or a batch of them) where they go in it."""

    __slots__ = ("tensors", "offsets")

    def __init__(self, tensors: PlanTensors, offsets: np.ndarray):
        self.tensors = tensors
        self.offsets = offsets  # int64, one per tensor

    @classmethod
    def of(cls, placed: "Placed | Sequence[tuple[TensorPlan, int]]") -> "Placed":
        """``placed`` as it is, or ``(plan, offset)`` pairs (a tensor's slices, cut by a writer
        one by one) as columns: where those pairs come into the columnar writer."""
        if isinstance(placed, Placed):
            return placed
        return cls(PlanTensors.of([tp for tp, _ in placed]), np.array([off for _, off in placed], dtype=np.int64))

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i):
        i = range(len(self))[operator.index(i)]  # one index (a slice is part()'s), negative from the end
        return self.tensors.plan_of(i), int(self.offsets[i])

    def part(self, lo: int, hi: int, base: int = 0) -> "Placed":
        """Tensors ``[lo, hi)``, their offsets moved by ``base``."""
        return Placed(self.tensors.span(lo, hi), self.offsets[lo:hi] + base)


class _Values(ValuesView):
    def __iter__(self) -> Iterator[TensorPlan]:
        return map(self._mapping.plan_of, range(len(self._mapping)))


class _Items(ItemsView):
    def __iter__(self):
        return zip(self._mapping.names, map(self._mapping.plan_of, range(len(self._mapping))))


class Layers:
    """Entries by kind: name -> (kind, :data:`~.tensor.Entry`) over ``(kind, entries)`` pairs
    (each an :class:`EntryTable`), where two name one tensor the later winning, as
    ``dict.update`` in turn would have it. ``names``: every name once, in the order that dict
    would have."""

    def __init__(self, layers: Sequence[tuple[str, EntryTable]]):
        self.layers = [(kind, entries) for kind, entries in layers if len(entries)]
        self.names = dict.fromkeys(chain.from_iterable(entries.keys() for _, entries in self.layers))

    def kind(self, name: str) -> str | None:
        for kind, entries in reversed(self.layers):
            if name in entries:
                return kind
        return None


def plan_tensors(named: list[str], layers: Layers, out_dtype) -> PlanTensors:
    """The columns of ``named`` (every one in ``layers``), their output dtypes ``out_dtype(stored)``.

    Column by column per layer: a layer's positions in ``named`` at once, its rows gathered
    from its table, never an entry made of it."""
    n = len(named)
    winner, numbers = _winners(named, layers.layers)
    shapes, kinds, stored = (np.empty(n, dtype=object) for _ in range(3))
    parts = []
    for k, (kind, entries) in enumerate(layers.layers):
        at = np.flatnonzero(winner == k)
        if not len(at):
            continue
        kinds[at] = kind
        which = numbers[at] if k == 0 else np.fromiter(
            map(entries.index.__getitem__, map(named.__getitem__, at.tolist())), dtype=np.int64, count=len(at))
        picked = which.tolist()
        shapes[at] = np.fromiter(map(entries.shapes.__getitem__, picked), dtype=object, count=len(at))
        if entries.dtype is not None:
            stored[at] = entries.dtype
        else:
            stored[at] = np.fromiter(map(entries.dtypes.__getitem__, picked), dtype=object, count=len(at))
        parts.append((at, *entries.table.gather(which)))
    stored_dtypes = stored.tolist()
    outs = {s: out_dtype(s) for s in set(stored_dtypes)}
    return PlanTensors(list(named), shapes.tolist(), kinds.tolist(), stored_dtypes,
                       list(map(outs.__getitem__, stored_dtypes)), scattered(n, parts))


def _winners(named: list[str], layers: list[tuple[str, EntryTable]]) -> tuple[np.ndarray, np.ndarray]:
    """Per name of ``named``, the layer whose entry it takes (the last that holds it), and each
    name's number in the first layer (-1: not in it).

    The first layer is the large one (a builder's table; then come the few frozen weights and
    buffers of the module): each name is looked up once, in it alone; the later layers' names
    are placed by their numbers there, or among the few names it lacks."""
    n = len(named)
    if not layers:
        if n:
            raise KeyError(named[0])
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    first = layers[0][1]
    numbers = np.fromiter(map(first.index.get, named, repeat(-1)), dtype=np.int64, count=n)
    winner = np.where(numbers >= 0, 0, -1)
    if len(layers) > 1:
        inside = np.flatnonzero(numbers >= 0)
        place = np.full(len(first) + 1, -1, dtype=np.int64)  # table number -> position; [-1]: none
        place[numbers[inside]] = inside
        missing = np.flatnonzero(numbers < 0).tolist()
        outside = dict(zip(map(named.__getitem__, missing), missing))  # the few names the table lacks
        for k, (_, entries) in enumerate(layers[1:], 1):
            names = entries.names
            there = place[np.fromiter(map(first.index.get, names, repeat(-1)), dtype=np.int64, count=len(names))]
            elsewhere = np.fromiter(map(outside.get, names, repeat(-1)), dtype=np.int64, count=len(names))
            at = np.where(there >= 0, there, elsewhere)
            winner[at[at >= 0]] = k
    if bool((winner < 0).any()):
        raise KeyError(named[int(np.flatnonzero(winner < 0)[0])])
    return winner, numbers


def segment_rows(segments: Sequence[Sequence]) -> tuple[np.ndarray, np.ndarray]:
    """The rows of each of ``segments`` (tuples, or :class:`~.tensor.TableSegments` of any
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
