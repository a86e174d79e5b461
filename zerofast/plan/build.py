"""Step 3: build the plan of a checkpoint's state dict.

The layout builders (:mod:`zerofast.plan.layouts`) place the trainable and declared frozen
parameters; everything else the module holds is classified here, the same way for every
layout: tied aliases, frozen weights only the module keeps, and buffers. The dtype policy and
the output order are applied here too, once.
"""
from __future__ import annotations

import torch

from ..errors import InconsistentCheckpointError
from ..load import LoadedCheckpoint
from . import keys
from .layouts import frozen_entries, trainable_entries
from .model import BUFFER, FROZEN, TRAINABLE, Entry, Plan, SourceTable, TensorPlan, tensor_identity


def out_dtype_for(stored: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype policy: floating tensors take ``dtype``; ``None`` and non-floating keep their own."""
    if dtype is None or not stored.is_floating_point:
        return stored
    return dtype


def build_plan(ckpt: LoadedCheckpoint, table: SourceTable, dtype: torch.dtype | None,
               exclude_frozen: bool = False) -> Plan:
    if ckpt.family != "zero":  # MoE, pipeline, AutoTP: their loaders list every tensor by output name
        from .layouts.family import build_plan as build_family_plan

        return build_family_plan(ckpt, table, dtype, exclude_frozen)
    trainable = trainable_entries(ckpt, table, exclude_frozen)
    frozen = frozen_entries(ckpt, table)
    kinds, aliases, undeclared_frozen, buffers, absent = _classify_module(ckpt, trainable, frozen)
    for name in undeclared_frozen:
        frozen[name] = _module_entry(ckpt, table, name)
    for name in buffers:
        buffers[name] = _module_entry(ckpt, table, name)
    entries = {**{n: (TRAINABLE, e) for n, e in trainable.items()}, **{n: (FROZEN, e) for n, e in frozen.items()},
               **{n: (BUFFER, e) for n, e in buffers.items()}}
    order = [n for n in kinds if (n in entries or n in aliases) and n not in absent]
    order += [n for n in entries if n not in kinds]  # parameters the module dict did not list
    if exclude_frozen:
        order = [n for n in order if entries.get(aliases.get(n, n), (None,))[0] != FROZEN]
    tensors = {}
    for name in order:
        if name in aliases:
            continue
        kind, (shape, stored, segs) = entries[name]
        tensors[name] = TensorPlan(name, shape, kind, stored, out_dtype_for(stored, dtype), tuple(segs))
    kept_aliases = {a: s for a, s in aliases.items() if a in order}
    return Plan(tensors, kept_aliases, tuple(order), ckpt.stage, ckpt.world_size,
                frozen_excluded=frozen_excluded(ckpt) or bool(absent), absent_frozen=tuple(sorted(absent)))


def frozen_excluded(ckpt: LoadedCheckpoint) -> bool:
    """Whether the save left its frozen parameters out (``exclude_frozen_parameters=True``, as the
    HF Trainer does for PEFT models). Stages 2-3 then record ``frozen_param_shapes`` as None
    instead of a (possibly empty) dict; stage 1 records None either way."""
    return ckpt.stage >= 2 and ckpt.meta.frozen_param_shapes is None


def _module_entry(ckpt: LoadedCheckpoint, table: SourceTable, name: str) -> Entry:
    return table.whole(str(ckpt.meta.path), f"{keys.MODULE}[{name!r}]", ckpt.meta.module[name])


def _classify_module(ckpt: LoadedCheckpoint, trainable: dict, frozen: dict):
    """Sort the module's keys into parameters, tied aliases, undeclared frozen params, buffers and
    frozen weights the save left out.

    Stage 3 records no ``shared_params`` even for tied weights; a tie then shows only as two
    module entries that share one storage, which torch.save preserves.

    A save with ``exclude_frozen_parameters=True`` deletes each frozen parameter from ``module``
    under the one name ``named_parameters()`` yields, so the other name of a tied frozen weight
    (``lm_head.weight`` of a PEFT model on a tied base) stays, pointing at a name that is gone.
    Both names are then absent, not inconsistent.
    """
    meta = ckpt.meta
    buffer_names = set(meta.buffer_names)
    aliases: dict[str, str] = {}
    undeclared_frozen: list[str] = []
    buffers: dict[str, None] = {}
    absent: set[str] = set()
    by_identity: dict[tuple, str] = {}
    kinds: dict[str, None] = {}
    for name, value in meta.module.items():
        kinds[name] = None
        identity = tensor_identity(value)
        if name in trainable or name in frozen:
            by_identity.setdefault(identity, name)
        elif name in meta.shared_params:
            aliases[name] = meta.shared_params[name]
        elif name in buffer_names:
            buffers[name] = None
        elif identity in by_identity:
            aliases[name] = by_identity[identity]
        elif ckpt.stage != 3 and isinstance(value, torch.Tensor):
            # Stage 1 saves no frozen_param_shapes; its frozen weights exist only here.
            undeclared_frozen.append(name)
            by_identity.setdefault(identity, name)
        elif frozen_excluded(ckpt) and isinstance(value, torch.Tensor) and value.numel() == 0:
            absent.add(name)  # a stage-3 placeholder of a frozen weight whose data was left out
        else:
            raise InconsistentCheckpointError(
                f"module entry {name!r} has no data: it is not in 'param_shapes', 'frozen_param_shapes', "
                "'shared_params' or 'buffer_names'", meta.path)
    for alias, source in list(aliases.items()):
        if source in trainable or source in frozen or source in undeclared_frozen:
            continue
        if source in meta.module or (ckpt.stage >= 2 and not frozen_excluded(ckpt)):
            raise InconsistentCheckpointError(f"tied parameter {alias!r} points to unknown parameter {source!r}",
                                              meta.path)
        absent.update((alias, source))
        del aliases[alias]
    return kinds, aliases, undeclared_frozen, buffers, absent
