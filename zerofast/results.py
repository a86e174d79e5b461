"""In-memory results: the eager state dict and the lazy mapping (files are :mod:`zerofast.hf`'s
and :mod:`zerofast.writers`')."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import numpy as np
import torch

from .execute import Executor
from .load.reader import collector_paused, release_freed_heap
from .plan.model import Plan

if TYPE_CHECKING:
    from .prepare import Prepared


def eager_state_dict(plan: Plan, executor: Executor) -> "OrderedDict[str, torch.Tensor]":
    """Every tensor materialized into fresh memory, in the model's key order; ties share storage."""
    with collector_paused():
        outs = executor.run_plan(plan.tensors)
        if not plan.aliases and plan.order == tuple(plan.tensors):
            return OrderedDict(zip(plan.order, outs))
        made = dict(zip(plan.tensors, outs))
        return OrderedDict(zip(plan.order, map(made.__getitem__, map(plan.aliases.get, plan.order, plan.order))))


@dataclass(frozen=True)
class TensorMeta:
    """What a lazy entry will be, known without reading its data."""

    shape: torch.Size
    dtype: torch.dtype
    kind: str
    nbytes: int


READ_AHEAD_BYTES = 64 << 20  # what iterating the lazy mapping reads ahead, at most
# On a device the window is the upload ring's four slots, so that a window's reads overlap its
# uploads (the ring drains at the end of each pass).
DEVICE_READ_AHEAD_BYTES = 256 << 20
READ_AHEAD_TENSORS = 16384


class LazyStateDict(Mapping):
    """A read-only mapping whose values are built when they are looked up.

    A lookup reads that tensor from the checkpoint files with the same batched native reader the
    eager dict uses; a tensor already stored whole in the requested dtype is returned as a view of
    its memory-mapped source without copying. Nothing is cached: each lookup gives fresh memory,
    so holding the mapping costs only the file mappings.

    Iterating reads ahead: looking up the name the loop is at, past the last window, reads the
    tensors of the next names (up to :attr:`read_ahead_bytes` together, none of them a view, each
    smaller than that) in one native call, and hands them out as they are looked up. Iterating
    names alone reads nothing. A new window drops what the last one still held, so a pass over
    the mapping holds at most one window besides what the caller keeps.
    :meth:`materialize` reads a chosen set of tensors in one call.
    """

    def __init__(self, plan: Plan, executor: Executor):
        self._plan = plan
        self._executor = executor
        self._window: dict[int, torch.Tensor] = {}  # tensor number -> read ahead, not looked up yet
        self._window_end = 0  # the names before it are (or were) in the window
        self._at: int | None = None  # where the latest loop over the mapping is
        self.read_ahead_bytes = READ_AHEAD_BYTES if executor.host else DEVICE_READ_AHEAD_BYTES
        self._views = executor.views or {}  # plan name -> where it is viewed from
        self._cols = plan.tensors
        self._index = plan.tensors.index  # name -> tensor number: a pass looks each name up twice
        self._nbytes: list[int] | None = None  # each tensor's output bytes, made on the first loop

    def __getitem__(self, name: str) -> torch.Tensor:
        key = self._plan.aliases.get(name, name)
        i = self._index[key]
        at = self._at
        if at is not None and at >= self._window_end and self._plan.order[at] == name:
            self._window_end = self._read_ahead(at)
        ahead = self._window.pop(i, None)
        if ahead is not None:
            return ahead
        where = self._views.get(key)
        tp = self._cols.plan_of(i)  # one tensor: a view of the columns' row
        return self._executor.run(tp) if where is None else self._executor.view(tp, where)

    def __iter__(self) -> Iterator[str]:
        self._window_end = 0
        try:
            for i, name in enumerate(self._plan.order):
                self._at = i
                yield name
        finally:
            self._at = None
            self._window.clear()

    def _read_ahead(self, start: int) -> int:
        """Replace the window with the tensors of ``order[start:end]`` and return ``end``."""
        self._window.clear()
        if self._nbytes is None:
            self._nbytes = self._cols.nbytes().tolist()
        order, budget = self._plan.order, self.read_ahead_bytes
        picked: dict[int, None] = {}
        size, end = 0, start
        viewed, aliases, index, sizes, count = self._views, self._plan.aliases, self._index, self._nbytes, len(order)
        while end < count and len(picked) < READ_AHEAD_TENSORS:  # once per tensor: no call it can spare
            key = aliases.get(order[end], order[end])
            i = index[key]
            nbytes = sizes[i]
            if nbytes > budget or key in viewed:
                end += 1  # read alone (or viewed) when looked up
                continue
            if size + nbytes > budget:
                break
            picked[i] = None
            size += nbytes
            end += 1
        if picked:
            self._window = dict(zip(picked, self._run(list(picked))))
        return max(end, start + 1)

    def _run(self, numbers: list[int]) -> list[torch.Tensor]:
        return self._executor.run_plan(self._cols.select(np.array(numbers, dtype=np.int64)))

    def materialize(self, names: Iterable[str]) -> "OrderedDict[str, torch.Tensor]":
        """The tensors of ``names`` in fresh memory, read in one batch, in the order given; tied
        names share storage as in the eager dict. An unknown name raises KeyError before any read."""
        names = list(names)
        keys = [self._plan.aliases.get(n, n) for n in names]
        for name, key in zip(names, keys):
            if key not in self._index:
                raise KeyError(name)
        unique = list(dict.fromkeys(self._index[k] for k in keys))
        made = dict(zip(unique, self._run(unique))) if unique else {}
        return OrderedDict((name, made[self._index[key]]) for name, key in zip(names, keys))

    def __len__(self) -> int:
        return len(self._plan.order)

    def __contains__(self, name: object) -> bool:
        return name in self._index or name in self._plan.aliases

    def meta(self, name: str) -> TensorMeta:
        tp = self._cols.plan_of(self._index[self._plan.aliases.get(name, name)])
        return TensorMeta(torch.Size(tp.shape), tp.out_dtype, tp.kind, tp.nbytes)

    @property
    def plan(self) -> Plan:
        return self._plan

    @property
    def aliases(self) -> dict[str, str]:
        return dict(self._plan.aliases)

    def __repr__(self) -> str:
        return f"LazyStateDict({len(self)} tensors, stage {self._plan.stage}, world size {self._plan.world_size})"


# The cyclic collector paused for the whole call (see collector_paused): the collection it owes
# then walks the result alone; the records and the plan are gone before it is back.
@collector_paused()
def state_dict_of(prepare: Callable[[], "Prepared"], lazy: bool,
                  device: str | torch.device = "cpu") -> "OrderedDict[str, torch.Tensor] | LazyStateDict":
    """The eager dict (or with ``lazy`` the lazy mapping) of what ``prepare()`` reads and plans.

    The records (every rank file's tree: tens of thousands of placeholders per rank at ZeRO-3)
    are not needed to move the bytes: they are dropped, and the heap they leave handed back,
    before the outputs are made, not after. ``prepare`` is called here so that nothing else
    holds them."""
    prepared = prepare()
    plan, executor = prepared.plan, (prepared.lazy_executor if lazy else prepared.streaming_executor)(device)
    del prepared
    release_freed_heap(len(plan.tensors))
    return LazyStateDict(plan, executor) if lazy else eager_state_dict(plan, executor)
