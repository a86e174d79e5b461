"""``zerofast diff A B``: what changed between two things zerofast reads (checkpoints, exports).

Each side is a checkpoint (its weights as stored: fp32 masters, frozen weights and buffers in
their dtypes; with ``optimizer`` also ``<param>.<key>`` for every per-element optimizer state) or
an export folder (its tensors as written, ``optimizer.safetensors`` too with ``optimizer``).
Tensors present on both sides are streamed in lockstep and compared in float64 chunk by chunk.
"""
from __future__ import annotations

import dataclasses
import os
import time
from contextlib import ExitStack, contextmanager
from typing import Iterator, Sequence

from ..base.errors import ExportError
from ..prepare import plan_checkpoint, prepare
from ..plan.optimizer import available_keys
from .export_folder import ExportFolder, is_export
from .ranges import Located, merged
from .report import Diff, Report, TensorChange
from .tensors import Chunk, Meta, PlanSource, TensorSource, compare


class Union:
    """Several tensor sources with disjoint names seen as one."""

    def __init__(self, sources: Sequence[TensorSource]):
        self.sources = list(sources)
        self.owner = {n: s for s in self.sources for n in s.order}
        self.order = tuple(self.owner)
        self.aliases = {a: t for s in self.sources for a, t in s.aliases.items()}

    def meta(self, name: str) -> Meta:
        return self.owner[name].meta(name)

    @contextmanager
    def located(self, names: Sequence[str]) -> Iterator[Located]:
        by_owner: dict[int, tuple[TensorSource, list[str]]] = {}
        for name in names:
            by_owner.setdefault(id(self.owner[name]), (self.owner[name], []))[1].append(name)
        with ExitStack() as stack:
            yield merged([stack.enter_context(owner.located(mine)) for owner, mine in by_owner.values()])

    def chunks(self, names: Sequence[str]) -> Iterator[Chunk]:
        run: list[str] = []
        for name in names:  # consecutive names of one source go in one call, so it can batch them
            if run and self.owner[run[-1]] is not self.owner[name]:
                yield from self.owner[run[0]].chunks(run)
                run = []
            run.append(name)
        if run:
            yield from self.owner[run[0]].chunks(run)


def open_tensors(path: str | os.PathLike, optimizer: bool = False, tag: str | None = None,
                 follow_symlinks: bool | None = None) -> TensorSource:
    """A checkpoint or an export folder as one source of tensors (raises on unreadable input)."""
    if is_export(path):
        report = Report(str(path), None, "export")
        parts = [ExportFolder(path, report)] + ([ExportFolder(path, report, optimizer=True)] if optimizer else [])
        if not report.ok:
            raise ExportError(f"cannot be read as an export: {report.failures[0].line()}", path)
        return Union(parts)
    prepared = prepare(path, None, tag=tag, warn_absent=False, follow_symlinks=follow_symlinks)
    plan = prepared.plan
    parts = [PlanSource(plan.tensors, prepared.streaming_executor(), plan.aliases,
                        [n for n in plan.order if n in plan.tensors])]
    keys = available_keys(prepared.checkpoint) if optimizer and prepared.checkpoint.stage else []
    if keys:
        states = plan_checkpoint(prepared.checkpoint, None, optimizer_keys=keys, qualified=True)
        parts.append(PlanSource(states.plan.tensors, states.streaming_executor()))
    return Union(parts)


def diff_paths(a: str | os.PathLike, b: str | os.PathLike, *, optimizer: bool = False, tag_a: str | None = None,
               tag_b: str | None = None, follow_symlinks: bool | None = None) -> Diff:
    started = time.monotonic()
    sa, sb = open_tensors(a, optimizer, tag_a, follow_symlinks), open_tensors(b, optimizer, tag_b, follow_symlinks)
    result = diff_sources(sa, sb)
    result.a, result.b = str(a), str(b)
    result.seconds = time.monotonic() - started
    return result


def diff_sources(sa: TensorSource, sb: TensorSource) -> Diff:
    result = Diff("A", "B")
    stored_a, stored_b = set(sa.order), set(sb.order)
    names_a = [*sa.order, *(n for n in sa.aliases if n not in stored_a)]
    names_b = [*sb.order, *(n for n in sb.aliases if n not in stored_b)]
    in_b, in_a = set(names_b), set(names_a)
    result.only_a = [n for n in names_a if n not in in_b]
    result.only_b = [n for n in names_b if n not in in_a]
    common = [n for n in names_a if n in in_b]
    resolved = {n: (sa.aliases.get(n, n), sb.aliases.get(n, n)) for n in common}
    pairs = list(dict.fromkeys(p for p in resolved.values()
                               if sa.meta(p[0]).shape == sb.meta(p[1]).shape))
    found = compare(sa, sb, pairs)
    for name in common:
        pa, pb = resolved[name]
        ma, mb = sa.meta(pa), sb.meta(pb)
        d = found.get((pa, pb))
        if d is not None and not d.differs and ma.dtype == mb.dtype:
            result.equal.append(name)
            continue
        change = TensorChange(name, str(ma.dtype).removeprefix("torch."), str(mb.dtype).removeprefix("torch."),
                              ma.shape, mb.shape, ma.numel)
        if d is not None:  # same shape: the values were compared
            change = dataclasses.replace(change, changed=d.changed, max_abs=d.max_abs, max_rel=d.max_rel)
        result.changed.append(change)
    result.changed.sort(key=lambda c: (not c.retyped or c.shape_a == c.shape_b, -_num(c.max_rel), -_num(c.max_abs)))
    return result


def _num(x: float) -> float:
    return float("inf") if x != x else x  # NaN differences first
