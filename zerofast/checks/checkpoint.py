"""``zerofast verify CKPT``: check a DeepSpeed checkpoint without converting it.

The loader already refuses a checkpoint whose files are missing, truncated, unsafe or disagree
on stage, world size, partition counts, paddings or shapes; here each such refusal becomes a
finding. Then, streaming:
- each fp32 master, cast to the model dtype, must equal the model-dtype weight the same save
  holds (ZeRO-0/1/2, pipeline, MoE expert files): DeepSpeed writes that weight from the master
  after every step, so a difference means a stale or mixed-up file;
- the optimizer's ``step`` must agree across ranks and parameter groups (experts included);
- the masters and moments are counted for NaN/Inf (reported; fatal with ``strict``), and a
  parameter whose moments are all zero after a step has lost its optimizer state.
"""
from __future__ import annotations

import dataclasses
import os
from collections import Counter
from dataclasses import dataclass

import torch

from ..base import keys as K
from ..base.errors import ZeroFastError
from ..layouts import discover, load_checkpoint
from ..load import LoadedCheckpoint
from ..prepare import Prepared
from ..plan import TRAINABLE, Plan, SourceTable, TensorPlan, build_optimizer_plan, build_plan
from ..plan.optimizer import available_keys, checked_states, scalar_states
from .report import Report
from .ranges import NATIVE_DTYPES, figures
from .tensors import Difference, PlanSource, extremes, nonfinite, paired, same_bits

STORED = "stored"  # kind of a model-dtype weight planned for the cross-check


@dataclass
class Opened:
    """A checkpoint loaded and planned for checking: weights as stored, optimizer states by
    ``<param>.<key>``, all sources in one table (one executor reads them all)."""

    ckpt: LoadedCheckpoint
    plan: Plan
    optimizer: Plan | None
    keys: list[str]
    table: SourceTable

    def source(self, plan: Plan) -> PlanSource:
        prepared = Prepared(self.ckpt, plan, self.table.tensors, self.table.mapped, self.table.files)
        return PlanSource(plan.tensors, prepared.streaming_executor(), plan.aliases, [n for n in plan.order
                                                                                       if n in plan.tensors])


def open_checkpoint(path: str | os.PathLike, tag: str | None, report: Report, optimizer: bool = True,
                    follow_symlinks: bool | None = None) -> Opened | None:
    """Load and plan ``path``; a refusal is recorded as a ``files`` finding and gives None."""
    try:
        ckpt = load_checkpoint(discover(path, tag, follow_symlinks=follow_symlinks))
        table = SourceTable()
        plan = build_plan(ckpt, table, None)
        keys = available_keys(ckpt) if optimizer and ckpt.stage else []
        oplan = build_optimizer_plan(ckpt, table, keys, None, qualified=True) if keys else None
    except ZeroFastError as e:
        report.add("files", str(path), " ".join(str(e).split()))
        return None
    return Opened(ckpt, plan, oplan, keys, table)


def verify_checkpoint(path: str | os.PathLike, *, tag: str | None = None, strict: bool = False,
                      follow_symlinks: bool | None = None) -> Report:
    report = Report(str(path), None, "checkpoint")
    opened = open_checkpoint(path, tag, report, follow_symlinks=follow_symlinks)
    if opened is None:
        return report
    ckpt = opened.ckpt
    report.kind = f"{ckpt.layout.name} checkpoint"
    report.checks.append(f"files: ZeRO-{ckpt.stage}, world size {ckpt.world_size}, {len(ckpt.files.paths())} files "
                         "or folders read and consistent")
    _rank_metadata(ckpt, report)
    _masters(opened, report, strict)
    steps = _steps(ckpt, report)
    if opened.optimizer is not None:
        _moments(opened, report, strict, steps)
        _state_shapes(opened, report)
    return report


def _rank_metadata(ckpt: LoadedCheckpoint, report: Report) -> None:
    """Per-rank model-states files (ZeRO-3) repeat rank 0's metadata; a file from another save
    shows here first."""
    if not ckpt.model_states:  # a save that is not DeepSpeed's (a PyTorch DCP folder) has none
        return
    first = ckpt.model_states[0]
    # Only ZeRO-3's per-rank files repeat one param_shapes; pipeline stages and tp ranks hold their own.
    per_rank = all(m.path.name.startswith("zero_pp_rank_") and "_mp_rank_00_" in m.path.name for m in ckpt.model_states)
    for m in ckpt.model_states[1:]:
        for key in (K.GLOBAL_STEPS, K.DP_WORLD_SIZE, K.DS_VERSION):
            if m.raw.get(key) != first.raw.get(key):
                report.add("files", m.path.name, f"{key} is {m.raw.get(key)!r}, but {first.path.name} says "
                           f"{first.raw.get(key)!r}: a file from another save")
        if per_rank and m.param_shapes != first.param_shapes:
            report.add("files", m.path.name, f"param_shapes differ from {first.path.name}'s: a file from another save")


def stored_weights(opened: Opened) -> tuple[dict[str, TensorPlan], int]:
    """The model-dtype weight the save holds next to each trainable master, planned as a whole
    source, and how many masters have none (ZeRO-3 placeholders, tensor-parallel shards)."""
    ckpt, table = opened.ckpt, opened.table
    family = getattr(ckpt, "stored", None)  # MoE / pipeline / AutoTP: whole tensors by output name
    out, without = {}, 0
    for name, tp in opened.plan.tensors.items():
        if tp.kind != TRAINABLE:
            continue
        if family is not None:
            s = family.get(name)
            file, key, t = (s.path, s.key, s.tensor) if s is not None else (None, None, None)
        else:
            file, key, t = ckpt.meta.path, f"{K.MODULE}[{name!r}]", ckpt.meta.module.get(name)
        if t is None or t.numel() == 0 or not t.is_floating_point() or tuple(t.shape) != tuple(tp.shape):
            without += tp.numel > 0
            continue
        shape, dtype, segs = table.whole(str(file), key, t)
        if tuple(segs) != tuple(tp.segments):  # an fp32 run without ZeRO: the weight is the master
            out[name] = TensorPlan(name, shape, STORED, dtype, dtype, tuple(segs))
    return out, without


def _masters(opened: Opened, report: Report, strict: bool) -> None:
    """Masters with a saved weight are read cast to its dtype (the reader threads cast them, as
    ``export`` does) and compared bit for bit; NaN/Inf are counted on the fp32 masters as read."""
    plan = opened.plan
    weights, without = stored_weights(opened)
    masters = [n for n in plan.tensors if plan.tensors[n].kind == TRAINABLE]
    if not masters:
        return
    crossed = [n for n in masters if n in weights]
    fp32 = opened.source(plan)
    cast = PlanSource({n: dataclasses.replace(plan.tensors[n], out_dtype=weights[n].out_dtype) for n in crossed},
                      fp32.executor)
    stored = PlanSource(weights, fp32.executor)
    natively = all(plan.tensors[n].stored_dtype in NATIVE_DTYPES and weights[n].out_dtype in NATIVE_DTYPES
                   for n in crossed)
    diffs, health = (_cross_checked if natively else _cross_checked_here)(cast, stored, fp32, crossed)
    health.update(counted(fp32, [n for n in masters if n not in weights]))
    _count(report, plan, masters, weights)
    _report_masters(report, plan, weights, diffs, len(masters), without)
    _report_nonfinite(report, health, strict, "master")


def _cross_checked(cast: PlanSource, stored: PlanSource, fp32: PlanSource, names: list[str]):
    """(differences, health) of each master against its saved weight, in one native pass per
    weight dtype; the health is that of the fp32 elements, counted as they are read."""
    diffs: dict[str, Difference] = {}
    health: dict[str, Health] = {}
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name in names:
        by_dtype.setdefault(stored.meta(name).dtype, []).append(name)
    found = {}
    for dtype, group in by_dtype.items():
        found.update(zip(group, figures(cast, group, [cast.meta(n).numel for n in group], stored, group, dtype)))
    for name in names:  # in the masters' order, whatever the dtypes
        d = Difference()
        d.add_figures(found[name].counts, found[name].maxima)
        if d.differs:
            diffs[name] = d
        health[name] = Health().add_counts(found[name].counts)
    return diffs, health


def _cross_checked_here(cast: PlanSource, stored: PlanSource, fp32: PlanSource, names: list[str]):
    """:func:`_cross_checked` in Python, for dtypes the native op does not know: the cast chunk
    also answers "any NaN/Inf" (a cast keeps both, and may turn a huge fp32 value into an fp16
    infinity), so only a tensor it flags is read again in fp32 to count them exactly."""
    diffs: dict[str, Difference] = {}
    health: dict[str, Health] = {}
    for name, _, _, master, weight in paired(cast, stored, [(n, n) for n in names]):
        health.setdefault(name, Health()).add(master)
        if not same_bits(master, weight):
            diffs.setdefault(name, Difference()).add(master, weight)
    flagged = [n for n in names if not health[n].finite]
    health.update({n: Health() for n in flagged})
    for name, _, master in fp32.chunks(flagged):
        health[name].add(master, count=True)
    return diffs, health


def counted(source: PlanSource, names: list[str]) -> dict[str, "Health"]:
    """Each tensor's NaN/Inf counts and whether it is all zero: natively where its dtype allows."""
    native = [n for n in names if source.plans[n].stored_dtype in NATIVE_DTYPES]
    health = dict(zip(native, (Health().add_counts(f.counts)
                               for f in figures(source, native, [source.meta(n).numel for n in native]))))
    here = [n for n in names if n not in health]
    for name, _, chunk in source.chunks(here):
        health.setdefault(name, Health()).add(chunk, count=True)
    return {n: health[n] for n in names if n in health}


def _report_masters(report: Report, plan: Plan, weights: dict[str, TensorPlan], diffs: dict[str, Difference],
                    count: int, without: int) -> None:
    dtypes = sorted({str(w.out_dtype).removeprefix("torch.") for w in weights.values()})
    if weights:
        report.checks.append(f"masters: {len(weights)} fp32 masters cast to {'/'.join(dtypes)} against the "
                             f"weights saved with them" + (f" ({without} have none: partitioned or sharded)"
                                                           if without else ""))
    else:
        report.checks.append(f"masters: {count} read (the save holds no model-dtype copy to compare with)")
    for name, d in diffs.items():
        report.add("master-weight", name, f"the fp32 master cast to {weights[name].out_dtype} differs from the saved "
                   f"weight in {d.changed:,} of {plan.tensors[name].numel:,} elements (max abs {d.max_abs:.3g}): a "
                   "stale or mixed-up file", changed=d.changed, max_abs=d.max_abs, max_rel=d.max_rel)


def _count(report: Report, plan: Plan, names, weights) -> None:
    report.tensors += len(names)
    report.bytes_read += sum(plan.tensors[n].numel * plan.tensors[n].stored_dtype.itemsize for n in names)
    report.bytes_read += sum(w.nbytes for w in weights.values())


@dataclass
class Health:
    """One tensor's values so far: all finite, all zero, and (when counted) NaN and Inf counts."""

    finite: bool = True
    zero: bool = True
    nan: int = 0
    inf: int = 0

    def add_counts(self, counts) -> "Health":
        """The native op's per-chunk (nan, inf, nonzero, ...) rows (:mod:`.ranges`) folded in."""
        for nan, inf, nonzero, *_ in counts:
            self.finite &= nan == 0 and inf == 0
            self.zero &= nonzero == 0
            self.nan += nan
            self.inf += inf
        return self

    def add(self, chunk: torch.Tensor, count: bool = False) -> None:
        finite, zero = extremes(chunk)
        self.finite &= finite
        self.zero &= zero
        if count and not finite:
            nan, inf = nonfinite(chunk)
            self.nan += nan
            self.inf += inf


def _report_nonfinite(report: Report, health: dict[str, Health], strict: bool, what: str) -> None:
    for name, h in health.items():
        if h.nan or h.inf:
            report.add("nonfinite", name, f"the {what} holds {h.nan:,} NaN and {h.inf:,} infinite elements",
                       fatal=strict, nan=h.nan, inf=h.inf)


def _steps(ckpt: LoadedCheckpoint, report: Report) -> float | None:
    """The optimizer's ``step`` must agree across every rank and flat group of the optimizer files
    (expert groups included) and every parameter's scalars (a universal folder's ``step.pt``);
    returns it (None where the save keeps none, as at stage 0)."""
    if ckpt.stage == 0:
        return None
    try:
        per_rank = checked_states(ckpt)
        per_param = scalar_states(ckpt)["state"]
    except ZeroFastError as e:
        report.add("steps", "optimizer", " ".join(str(e).split()))
        return None
    found = {f"{o.path.name} group {g}": _number(state.get("step"))
             for o, groups in zip(ckpt.optim_states, per_rank) for g, (_, state) in enumerate(groups)}
    if not found:  # no optimizer files (a universal folder): the parameters' own scalars
        found = {name: _number(s.get("step")) for name, s in per_param.items()}
    values = Counter(v for v in found.values() if v is not None)
    if not values:
        return None
    step, _ = values.most_common(1)[0]
    odd = {k: v for k, v in found.items() if v != step and v is not None}
    for where, v in odd.items():
        report.add("steps", where, f"optimizer step {v:g}, but {len(found) - len(odd)} others are at step {step:g}",
                   step=v, expected=step)
    if not odd:
        report.checks.append(f"steps: {len(found)} optimizer states (ranks x groups, or parameters) agree on step "
                             f"{step:g}")
    return step


def _number(value) -> float | None:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def _moments(opened: Opened, report: Report, strict: bool, step: float | None) -> None:
    plan = opened.optimizer
    source = opened.source(plan)
    health = counted(source, list(source.order))
    _count(report, plan, source.order, {})
    zero = [n for n, h in health.items() if h.zero and plan.tensors[n].numel and step]
    for name in zero:
        report.add("moments-zero", name, f"every element is zero after {step:g} optimizer steps: the optimizer state "
                   "was lost or reset")
    _report_nonfinite(report, health, strict, "optimizer state")
    report.checks.append(f"moments: {', '.join(opened.keys)} of {len(source.order) // max(len(opened.keys), 1)} "
                         "parameters counted for NaN/Inf and all-zero")


def _state_shapes(opened: Opened, report: Report) -> None:
    """Each parameter's optimizer states have its master's shape (a universal folder keeps each
    in a file of its own, which nothing else ties to the master)."""
    plan, optim = opened.plan, opened.optimizer
    bad = 0
    for name, tp in plan.tensors.items():
        if tp.kind != TRAINABLE:
            continue
        for key in opened.keys:
            other = optim.tensors.get(f"{name}.{key}")
            if other is None or other.shape != tp.shape:
                bad += 1
                report.add("shapes", f"{name}.{key}", f"has shape {None if other is None else list(other.shape)}, "
                           f"the fp32 master {list(tp.shape)}")
    if not bad:
        report.checks.append(f"shapes: the masters' {', '.join(opened.keys)} have their shapes")
