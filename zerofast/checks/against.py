"""``zerofast verify OUT --against CKPT``: an export, a reshard or a universal conversion
checked against the checkpoint it came from.

Both sides are streamed in lockstep, chunk by chunk, and compared bit for bit: the expected side
is the checkpoint's plan under the dtype policy the export used (found from the export's own
dtypes; a tensor in another dtype is named), so "equal after the documented cast" is equality of
the very bytes ``export`` would write. Nothing is held whole on either side.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from ..base.errors import ZeroFastError
from ..hf import trainer as hf
from ..hf.run import OPTIMIZER_JSON
from ..prepare import Prepared, plan_checkpoint, prepare
from ..base import keys as K
from ..base.dtypes import out_dtype_for
from ..plan import FROZEN, Plan
from ..plan.optimizer import available_keys, scalar_states
from .checkpoint import open_checkpoint
from .export_folder import ExportFolder, is_export, weight_files
from .report import Report
from .tensors import PlanSource, TensorSource, compare, same_bits

POLICIES = (torch.float32, torch.bfloat16, torch.float16, None)  # the export's dtype choices, in this order
SAVED_STATE = (K.GLOBAL_STEPS, "lr_scheduler")  # model-states entries a resumed run reads back


def verify_against(out: str | os.PathLike, ckpt: str | os.PathLike, *, tag: str | None = None,
                   base_model: str | os.PathLike | None = None, follow_symlinks: bool | None = None,
                   base_dtype: str | None = None) -> Report:
    if is_export(out):
        return _export_against(out, ckpt, tag, base_model, follow_symlinks, base_dtype)
    return _checkpoint_against(out, ckpt, tag, follow_symlinks)


# ---------------------------------------------------------------------------------------------
# Export folders

def _export_against(out, ckpt, tag, base_model, follow_symlinks, base_dtype) -> Report:
    report = Report(str(out), str(ckpt), "export")
    folder = ExportFolder(out, report)
    folder.check_config()
    try:
        prepared = prepare(ckpt, None, tag=tag, warn_absent=False, follow_symlinks=follow_symlinks)
        expected = _expected(prepared, folder, base_model, base_dtype)
    except ZeroFastError as e:
        report.add("files", str(ckpt), " ".join(str(e).split()))
        return report
    report.kind = "adapter export" if folder.adapter else f"{folder.format} export"
    dtype = _policy(expected.plan, folder)
    plan = _with_dtype(expected.plan, dtype)
    if not folder.adapter:
        plan = _frozen_left_out(plan, folder, report)
    source = PlanSource(plan.tensors, expected.streaming_executor(), plan.aliases, plan.tensors)
    policy = "kept as stored" if dtype is None else f"dtype={dtypes_name(dtype)}"
    compare_sets(report, source, folder, f"weights ({policy})")
    _optimizer_against(report, out, prepared)
    return report


def dtypes_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _expected(prepared: Prepared, folder: ExportFolder, base_model, base_dtype: str | None) -> Prepared:
    """What ``export`` wrote from this checkpoint: the plan as it is, the adapter's, or the merge
    (onto the base ``base_dtype`` names, as the export's own keyword: as stored by default)."""
    source = hf.trainer_folder(prepared)
    if folder.adapter:
        return dataclasses.replace(prepared, plan=hf.adapter_plan(prepared.plan, source))
    names = set(folder.order) | set(folder.aliases)
    if hf.is_peft(prepared.plan, source) and not any(n.startswith(hf.PEFT_PREFIX) for n in names):
        return hf.merged_plan(prepared, None, base_model, source, base_dtype or hf.AS_STORED)[0]
    return prepared


def _policy(plan: Plan, folder: TensorSource) -> torch.dtype | None:
    """The dtype policy under which most of the export's elements have the dtype they have."""
    stored = set(folder.order)

    def score(dtype):
        return sum(tp.numel for n, tp in plan.tensors.items()
                   if n in stored and folder.meta(n).dtype == out_dtype_for(tp.stored_dtype, dtype))
    return max(POLICIES, key=score)  # max keeps the first of equals: fp32 before "keep"


def _with_dtype(plan: Plan, dtype: torch.dtype | None) -> Plan:
    tensors = {n: dataclasses.replace(tp, out_dtype=out_dtype_for(tp.stored_dtype, dtype))
               for n, tp in plan.tensors.items()}
    return dataclasses.replace(plan, tensors=tensors)


def _frozen_left_out(plan: Plan, folder: ExportFolder, report: Report) -> Plan:
    """An export with ``exclude_frozen`` holds none of the frozen parameters: expect none."""
    frozen = [n for n, tp in plan.tensors.items() if tp.kind == FROZEN]
    present = set(folder.order) | set(folder.aliases)
    if not frozen or any(n in present for n in frozen):
        return plan
    report.checks.append(f"weights: the {len(frozen)} frozen parameters are left out (exclude_frozen)")
    keep = {n: tp for n, tp in plan.tensors.items() if tp.kind != FROZEN}
    aliases = {a: s for a, s in plan.aliases.items() if s in keep}
    return dataclasses.replace(plan, tensors=keep, aliases=aliases,
                               order=tuple(n for n in plan.order if n in keep or n in aliases))


def _optimizer_against(report: Report, out, prepared: Prepared) -> None:
    if weight_files(Path(out), optimizer=True) is None:
        return
    folder = ExportFolder(out, report, optimizer=True)
    ckpt = prepared.checkpoint
    keys = [k for k in available_keys(ckpt) if any(n.endswith(f".{k}") for n in folder.order)]
    if not keys:
        report.add("missing", "optimizer", "the export holds optimizer states, the checkpoint none it keeps")
        return
    states = plan_checkpoint(ckpt, None, optimizer_keys=keys, qualified=True)
    plan = states.plan
    compare_sets(report, PlanSource(plan.tensors, states.streaming_executor()), folder, f"optimizer ({', '.join(keys)})")
    _scalars_json(report, Path(out) / OPTIMIZER_JSON, ckpt)


def _scalars_json(report: Report, path: Path, ckpt) -> None:
    """The per-parameter scalars (``step``) the export wrote next to the states."""
    try:
        written = json.loads(path.read_text()).get("state")
    except (OSError, ValueError, AttributeError) as e:
        report.add("steps", path.name, f"expected the optimizer's scalars as JSON, could not read them ({e})")
        return
    want = scalar_states(ckpt)["state"]
    odd = [n for n in want if not isinstance(written, dict) or written.get(n) != want[n]]
    for name in odd:
        found = written.get(name) if isinstance(written, dict) else None
        report.add("steps", name, f"{path.name} says {found}, the checkpoint {want[name]}")
    if not odd:
        report.checks.append(f"steps: {path.name} holds the scalars of the {len(want)} parameters")


# ---------------------------------------------------------------------------------------------
# Two sets of tensors, one expected

def compare_sets(report: Report, expected: TensorSource, got: TensorSource, what: str) -> None:
    """Every tensor and alias of ``expected`` present in ``got`` with its dtype, shape and bits."""
    want = set(expected.order) | set(expected.aliases)
    have = set(got.order) | set(got.aliases)
    for name in [*expected.order, *expected.aliases]:
        if name not in have:
            report.add("missing", name, f"the checkpoint has it; the output does not ({what})")
    for name in [*got.order, *got.aliases]:
        if name not in want:
            report.add("extra", name, f"the output holds it; the checkpoint has no such tensor ({what})")
    pairs = _alias_pairs(report, expected, got)
    stored = set(got.order)
    for name in expected.order:
        if name in stored:
            pair = _checked_pair(report, expected, got, name, name)
            pairs += [pair] if pair else []
    found = compare(expected, got, pairs)
    bad = 0
    for (ne, ng), d in found.items():
        if d.differs:
            bad += 1
            report.add("values", ng, f"differs from the checkpoint's {ne} in {d.changed:,} of "
                       f"{expected.meta(ne).numel:,} elements (max abs {d.max_abs:.3g}, max rel {d.max_rel:.3g})",
                       changed=d.changed, max_abs=d.max_abs, max_rel=d.max_rel)
    report.tensors += len(pairs)
    report.bytes_read += sum(expected.meta(ne).nbytes + got.meta(ng).nbytes for ne, ng in pairs)
    report.checks.append(f"{what}: {len(pairs) - bad} of {len(expected.order)} tensors equal bit for bit"
                         + (f", {len(expected.aliases)} aliases" if expected.aliases else ""))


def _alias_pairs(report: Report, expected: TensorSource, got: TensorSource) -> list[tuple[str, str]]:
    """A tie is either recorded as the same alias, or (``duplicate_tied``) stored as a copy, which
    must then equal its source."""
    pairs = []
    stored, tensors = set(got.order), set(expected.order)
    for alias, source in expected.aliases.items():
        if alias in got.aliases:
            if got.aliases[alias] != source:
                report.add("aliases", alias, f"tied to {got.aliases[alias]!r}, the checkpoint ties it to {source!r}")
        elif alias in stored:
            pair = _checked_pair(report, expected, got, source, alias)
            pairs += [pair] if pair else []
    for alias, source in got.aliases.items():
        if alias in tensors:
            report.add("aliases", alias, f"recorded as a tie to {source!r}; in the checkpoint it is a tensor of its own")
    return pairs


def _checked_pair(report: Report, expected: TensorSource, got: TensorSource, ne: str, ng: str):
    me, mg = expected.meta(ne), got.meta(ng)
    if me.dtype != mg.dtype:
        report.add("dtype", ng, f"is {dtypes_name(mg.dtype)}; the export's dtype policy gives {dtypes_name(me.dtype)}",
                   expected=dtypes_name(me.dtype), found=dtypes_name(mg.dtype))
    elif me.shape != mg.shape:
        report.add("shape", ng, f"has shape {list(mg.shape)}, the checkpoint's {list(me.shape)}")
    else:
        return ne, ng
    return None


# ---------------------------------------------------------------------------------------------
# Checkpoints written from a checkpoint: reshard, to-universal

def _checkpoint_against(out, ckpt, tag, follow_symlinks) -> Report:
    report = Report(str(out), str(ckpt), "checkpoint")
    mine = open_checkpoint(out, None, report, follow_symlinks=follow_symlinks)
    source = open_checkpoint(ckpt, tag, report, follow_symlinks=follow_symlinks)
    if mine is None or source is None:
        return report
    report.kind = f"{mine.ckpt.layout.name} checkpoint"
    compare_sets(report, source.source(source.plan), mine.source(mine.plan), "weights (masters, frozen, buffers)")
    if source.optimizer is not None:
        if mine.optimizer is None:
            report.add("missing", "optimizer", "the source keeps per-element optimizer states; the output none")
        else:
            compare_sets(report, source.source(source.optimizer), mine.source(mine.optimizer),
                         f"optimizer ({', '.join(source.keys)})")
        _scalars(report, source.ckpt, mine.ckpt)
    for key in SAVED_STATE:
        if not same_value(source.ckpt.meta.raw.get(key), mine.ckpt.meta.raw.get(key)):
            report.add("saved-state", key, f"is {_short(mine.ckpt.meta.raw.get(key))}, the source's "
                       f"{_short(source.ckpt.meta.raw.get(key))}")
    report.checks.append(f"saved state: {', '.join(SAVED_STATE)} compared")
    return report


def _scalars(report: Report, source, mine) -> None:
    try:
        want, have = scalar_states(source)["state"], scalar_states(mine)["state"]
    except ZeroFastError as e:
        report.add("steps", "optimizer", " ".join(str(e).split()))
        return
    odd = [n for n in want if want[n] != have.get(n)]
    for name in odd:
        report.add("steps", name, f"optimizer scalars {have.get(name)}, the source's {want[name]}")
    if not odd:
        report.checks.append(f"steps: the optimizer scalars of {len(want)} parameters equal the source's")


def same_value(a, b) -> bool:
    """Equality of pickled values, tensors bit for bit."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and same_bits(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:  # a stand-in object without equality
        return repr(a) == repr(b)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
