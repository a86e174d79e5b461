"""Steps 1-3 composed: discover, load safely and plan (internal).

``prepare`` returns a :class:`Prepared`: the checkpoint read, its plan built, and the source
tensors the plan indexes. Only the executor (step 4) moves bytes after that. This module sits on
both :mod:`zerofast.layouts` (steps 1-3 per kind of save) and :mod:`zerofast.execute` (step 4,
which depends on :mod:`zerofast.plan` and below only); ``zerofast.prepare`` is this module, and
the package exports no function of that name.

The entry points that read a state dict (or one optimizer state) start here: ``reconstruct``,
``load_into``, ``optimizer_state``, ``sequential_names``, ``export``, ``to_dcp``, ``diff`` and
``verify`` of an export against its checkpoint; :func:`plan_checkpoint` then plans the
optimizer's states of the checkpoint that ``prepare`` loaded, where those are asked for. Three
do not: ``reshard`` and ``to_universal`` (``writers/reshard.py``, ``writers/universal.py``) call
:func:`zerofast.layouts.discover` and :func:`zerofast.layouts.load_checkpoint` themselves and
plan the masters, the optimizer's moments and the frozen weights over one source table
(:mod:`zerofast.writers.source`), and ``verify`` of a checkpoint (``checks/checkpoint.py``) does
the same for the plans it checks against each other, wrapping each in a :class:`Prepared` only
to run it.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Sequence

import torch

from .base import dtypes
from .base.errors import FrozenWeightsAbsentWarning
from .devices import device_of
from .execute import Executor, view_ranges
from .execute.read_batch import BatchReader, locate
from .layouts import discover, load_checkpoint
from .load import LoadedCheckpoint
from .load.reader import collector_paused
from .plan import Plan, SourceTable, build_optimizer_plan, build_plan
from .base.settings import read_once


@dataclass
class Prepared:
    """A checkpoint read and planned: everything but the data movement."""

    checkpoint: LoadedCheckpoint
    plan: Plan
    sources: list[torch.Tensor]
    mapped: list[bool]  # per source: a view of a file mapping, not a copy
    files: list[str] | None = None  # per source: the file it was read from (None: read from memory)

    def lazy_executor(self, device: str | torch.device = "cpu") -> Executor:
        """An executor for the lazy mapping: it may hand sources out as views (a tensor stored
        whole in the requested dtype), so it never drops their pages; everything else is read
        from the files in batches, as the eager dict is, so reading every tensor once keeps no
        more than what is read at once resident."""
        views = {}
        if device_of(device).host:  # views of the file mappings: host memory only
            with collector_paused():  # tens of thousands of small objects made, none of them garbage
                tensors = self.plan.tensors
                ranges = view_ranges(tensors)
                views = {name: where for name, where in zip(tensors, ranges) if where is not None and self._inside(where)}
        viewed = {where[0] for where in views.values()}
        streamable = [m and i not in viewed for i, m in enumerate(self.mapped)]
        return Executor(self.sources, device, streamable=streamable, batch=self._batch_reader(), views=views)

    def _inside(self, where: tuple[int, int, int]) -> bool:
        """Whether a view's range lies inside its source, as slicing it would check (a view is
        made with ``as_strided``, which checks only against the whole storage); one outside is
        read instead, where the native reader's own row checks word the error."""
        src, offset, length = where
        return 0 <= offset and offset + length <= self.sources[src].numel()

    def streaming_executor(self, device: str | torch.device = "cpu",
                           compute: str | torch.device | None = None) -> Executor:
        """An executor for one pass that hands no source views out (eager dict, export)."""
        return Executor(self.sources, device, streamable=self.mapped, compute=compute, batch=self._batch_reader())

    def _batch_reader(self) -> BatchReader:
        files = self.files or [""] * len(self.sources)
        return BatchReader(files, self.sources, locate(files, self.sources) if self.files else [None] * len(files))


def prepare(ckpt_dir: str | os.PathLike, dtype: torch.dtype | None = torch.float32, *, tag: str | None = None,
            exclude_frozen: bool = False, optimizer_keys: Sequence[str] | None = None,
            warn_absent: bool = True, follow_symlinks: bool | None = None) -> Prepared:
    """Read and plan the state dict, or with ``optimizer_keys`` (exactly one) that per-element
    state of the wrapped optimizer, named like the parameters. A full state dict of a save that
    left its frozen weights out warns (``FrozenWeightsAbsentWarning``) unless ``warn_absent`` is off.
    ``follow_symlinks``: follow links that leave the checkpoint folder (None: the setting)."""
    dtype = dtypes.output_dtype(dtype)  # one vocabulary: torch.bfloat16, "bf16", "BFloat16", ...
    with read_once():  # not a dozen environment lookups per rank file of a thousand-file save
        files = discover(ckpt_dir, tag, follow_symlinks=follow_symlinks)
        with collector_paused():
            prepared = plan_checkpoint(load_checkpoint(files), dtype, exclude_frozen=exclude_frozen,
                                       optimizer_keys=optimizer_keys)
    plan = prepared.plan
    if plan.frozen_excluded and optimizer_keys is None and not exclude_frozen and warn_absent:
        _warn_frozen_absent(plan, prepared.checkpoint.files.tag_dir)
    return prepared


def _warn_frozen_absent(plan: Plan, where: os.PathLike) -> None:
    named = f" (among them {', '.join(plan.absent_frozen)})" if plan.absent_frozen else ""
    warnings.warn(FrozenWeightsAbsentWarning(
        f"{where}: saved without its frozen parameters (exclude_frozen_parameters=True, as the HF Trainer saves "
        f"PEFT models){named}: returning only the {len(plan.tensors)} trainable parameters and buffers it holds"),
        stacklevel=4)


def plan_checkpoint(ckpt: LoadedCheckpoint, dtype: torch.dtype | None, *, exclude_frozen: bool = False,
                    optimizer_keys: Sequence[str] | None = None, qualified: bool = False) -> Prepared:
    """The planning half of :func:`prepare`, for a checkpoint already loaded. With ``qualified``
    the optimizer states are named ``<param>.<key>``, so that several keys fit in one plan."""
    table = SourceTable()
    if optimizer_keys is None:
        plan = build_plan(ckpt, table, dtype, exclude_frozen=exclude_frozen)
    else:
        plan = build_optimizer_plan(ckpt, table, optimizer_keys, dtype, qualified=qualified)
    return Prepared(ckpt, plan, table.tensors, table.mapped, table.files)
