"""In-memory results: the eager state dict and the lazy mapping (files are :mod:`zerofast.hf`'s
and :mod:`zerofast.writers`')."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Iterator

import torch

from .execute import Executor
from .load.reader import collector_paused
from .plan.model import Plan


def eager_state_dict(plan: Plan, executor: Executor) -> "OrderedDict[str, torch.Tensor]":
    """Every tensor materialized into fresh memory, in the model's key order; ties share storage."""
    with collector_paused():
        outs = executor.run_all(list(plan.tensors.values()))
        if not plan.aliases and plan.order == tuple(plan.tensors):
            return OrderedDict(zip(plan.order, outs))
        made = dict(zip(plan.tensors, outs))
        return OrderedDict((name, made[plan.aliases.get(name, name)]) for name in plan.order)


@dataclass(frozen=True)
class TensorMeta:
    """What a lazy entry will be, known without reading its data."""

    shape: torch.Size
    dtype: torch.dtype
    kind: str
    nbytes: int


class LazyStateDict(Mapping):
    """A read-only mapping whose values are built one at a time, when looked up.

    Each lookup runs that tensor's part of the plan over memory-mapped sources; a tensor already
    stored whole in the requested dtype is returned as a view without copying. Nothing is cached,
    so holding the mapping costs only the file mappings.
    """

    def __init__(self, plan: Plan, executor: Executor):
        self._plan = plan
        self._executor = executor

    def __getitem__(self, name: str) -> torch.Tensor:
        tp = self._plan.tensors[self._plan.aliases.get(name, name)]
        return self._executor.view_or_run(tp)

    def __iter__(self) -> Iterator[str]:
        return iter(self._plan.order)

    def __len__(self) -> int:
        return len(self._plan.order)

    def __contains__(self, name: object) -> bool:
        return name in self._plan.tensors or name in self._plan.aliases

    def meta(self, name: str) -> TensorMeta:
        tp = self._plan.tensors[self._plan.aliases.get(name, name)]
        return TensorMeta(torch.Size(tp.shape), tp.out_dtype, tp.kind, tp.nbytes)

    @property
    def plan(self) -> Plan:
        return self._plan

    @property
    def aliases(self) -> dict[str, str]:
        return dict(self._plan.aliases)

    def __repr__(self) -> str:
        return f"LazyStateDict({len(self)} tensors, stage {self._plan.stage}, world size {self._plan.world_size})"
