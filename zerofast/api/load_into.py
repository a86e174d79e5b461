"""``zerofast.load_into``: fill a model's parameters and buffers straight from a ZeRO checkpoint.

Nothing like a state dict is built. The tensors of the plan are read from the checkpoint files
and cast by the batched native reader (the eager dict's) directly into the model's own memory,
all in one call, where the model's tensor is on the CPU, contiguous, and the cast is one the
reader does; on a GPU, contiguous tensors are filled through the device's upload ring
(:mod:`zerofast.execute.ring`: pinned slots, cast on the GPU); the others go through temporaries, read in batches of at most
:data:`~zerofast.execute.executor.STAGING_BYTES` (or one tensor, if larger) and copied in. So the
peak extra memory is one such batch, never a second copy of the model. Writing in place (rather than
swapping in new tensors) is also what keeps tied parameters tied and optimizers pointing at them.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

import torch

from ..base import dtypes
from ..devices import HOST, device_of
from ..base.errors import LoadIntoError
from ..execute.executor import STAGING_BYTES, in_runs
from ..prepare import prepare
from ..load.reader import collector_paused, release_freed_heap
from ..base.dtypes import out_dtype_for
from ..plan import Plan
from ..plan.columns import PlanTensors


class IncompatibleKeys(NamedTuple):
    """Names the model and the checkpoint do not share, as ``Module.load_state_dict`` reports them."""

    missing_keys: list[str]
    unexpected_keys: list[str]


# The cyclic collector paused for the whole call (see collector_paused): the collection it owes
# then walks the result alone; the records and the plan are gone before it is back.
@collector_paused()
def load_into(model: torch.nn.Module, ckpt_dir: str | os.PathLike, *, strict: bool = True, tag: str | None = None,
              dtype: torch.dtype | None = None, follow_symlinks: bool | None = None) -> IncompatibleKeys:
    """Load a DeepSpeed ZeRO checkpoint into ``model`` in place, tensor by tensor.

    Args:
        model: any module whose ``state_dict()`` names match the checkpoint; its tensors may live
            on the CPU or on a GPU and keep their device, dtype and identity.
        ckpt_dir: the checkpoint root (holding ``latest``) or a tag folder.
        strict: raise :class:`LoadIntoError` before writing anything if a name is missing on
            either side. Otherwise the names in common are loaded and the rest reported.
        tag: which save to read when the root holds several.
        dtype: ``None`` (default) casts each tensor once, to the dtype of the model's own tensor.
            A floating dtype first rounds the values to it, as loading
            ``zerofast.reconstruct(ckpt_dir, dtype)`` would.
        follow_symlinks: follow symbolic links that lead out of the checkpoint folder (refused by
            default: a checkpoint from elsewhere could point zerofast at any file). None takes
            ``ZEROFAST_FOLLOW_SYMLINKS``.

    Returns:
        ``IncompatibleKeys(missing_keys, unexpected_keys)``, by name, in model and checkpoint order.
    """
    prepared = prepare(ckpt_dir, None, tag=tag, follow_symlinks=follow_symlinks)
    plan = prepared.plan
    targets = model.state_dict(keep_vars=True)
    result = _compare_names(plan, targets)
    if strict and (result.missing_keys or result.unexpected_keys):
        raise LoadIntoError(_describe(result), prepared.checkpoint.files.tag_dir)
    missing = set(result.missing_keys)
    index = plan.tensors.index
    pairs = [(name, index[plan.aliases.get(name, name)]) for name in targets if name not in missing]
    _check_shapes(plan.tensors, pairs, targets, prepared.checkpoint.files.tag_dir)
    in_place, staged = _split(plan.tensors, pairs, targets, dtype)
    places = {target.device: None for target in in_place[1]} | {HOST: None}
    executors = {place: prepared.streaming_executor(place) for place in places}
    executor = executors[HOST]
    del prepared  # the records are not needed to move the bytes (see results.state_dict_of)
    release_freed_heap(len(plan.tensors))
    with torch.no_grad():
        cols, outs = in_place
        for place, mover in executors.items():
            here = [i for i, target in enumerate(outs) if target.device == place]
            if here:
                mover.run_into(cols.select(np.array(here, dtype=np.int64)), [outs[i].data for i in here])
        cols, outs = staged
        done = 0
        for run in in_runs(cols, STAGING_BYTES):
            for value, target in zip(executor.run_plan(run), outs[done:done + len(run)]):
                target.copy_(value)
            done += len(run)
    return result


def _split(tensors: PlanTensors, pairs, targets: dict, dtype: torch.dtype | None):
    """The tensors to run, as columns in the dtypes they are made in, each list beside its
    targets: those written in place, those staged. A tied tensor (the model lists it under each
    of its names) is written once."""
    parts: dict[bool, tuple[list[int], list[torch.dtype], list[torch.Tensor]]] = {True: ([], [], []),
                                                                                False: ([], [], [])}
    seen = set()
    for name, i in pairs:
        target = targets[name]
        if id(target) in seen:
            continue
        seen.add(id(target))
        made_in = _made_in(tensors.stored[i], target, dtype)
        numbers, made, outs = parts[_writable_in_place(target, made_in)]
        numbers.append(i)
        made.append(made_in)
        outs.append(target)
    return tuple((tensors.select(np.array(numbers, dtype=np.int64)).retyped(made), outs)
                 for numbers, made, outs in (parts[True], parts[False]))


def _compare_names(plan: Plan, targets: dict) -> IncompatibleKeys:
    have = set(plan.order)
    missing = [name for name in targets if name not in have]
    unexpected = [name for name in plan.order if name not in targets]
    return IncompatibleKeys(missing, unexpected)


def _describe(result: IncompatibleKeys) -> str:
    parts = []
    if result.missing_keys:
        parts.append(f"the checkpoint has no {_names(result.missing_keys)} of the model")
    if result.unexpected_keys:
        parts.append(f"the model has no {_names(result.unexpected_keys)} of the checkpoint")
    return "; ".join(parts) + " (pass strict=False to load the names they share)"


def _names(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:8])
    more = f" and {len(names) - 8} more" if len(names) > 8 else ""
    return f"{len(names)} name{'s' if len(names) != 1 else ''} ({shown}{more})"


def _check_shapes(tensors: PlanTensors, pairs, targets: dict, where) -> None:
    wrong = [f"{name}: checkpoint {tuple(tensors.shapes[i])}, model {tuple(targets[name].shape)}"
             for name, i in pairs if tuple(tensors.shapes[i]) != tuple(targets[name].shape)]
    if wrong:
        raise LoadIntoError(f"shapes differ for {len(wrong)} tensor(s): " + "; ".join(wrong[:8]), where)


def _made_in(stored: torch.dtype, target: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor is made in for ``target``: the target's own (or ``dtype``'s rule), unless
    the reader cannot cast to it (an int64 buffer into a float one: torch's copy_ casts then)."""
    value_dtype = target.dtype if dtype is None else out_dtype_for(stored, dtype)
    return value_dtype if dtypes.castable(stored, value_dtype) else stored


def _writable_in_place(target: torch.Tensor, dtype: torch.dtype) -> bool:
    """Host memory the batched reader writes, or device memory its upload ring fills."""
    entry = device_of(target.device)
    reachable = entry.host or entry.streams is not None
    return reachable and target.dtype == dtype and target.is_contiguous()
