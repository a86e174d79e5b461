"""Step 3: build the plan of a checkpoint's state dict.

Each layout (:mod:`zerofast.layouts`) places the trainable parameters with the builders of
:mod:`.builders`. For saves whose module dict names every tensor, :func:`plain_plan` classifies
the rest the same way for each: declared frozen parameters, tied aliases, frozen weights only the
module keeps, and buffers. :func:`assemble` applies the output order and the dtype policy, once,
for every layout.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from ..base.dtypes import out_dtype_for
from ..base.errors import InconsistentCheckpointError
from ..load import LoadedCheckpoint
from .builders.frozen import declared as frozen_entries
from .builders.stage0 import module_entry
from .columns import EntryTable, Layers, plan_tensors
from .model import BUFFER, FROZEN, TRAINABLE, Plan, SourceTable, tensor_identity


def build_plan(ckpt: LoadedCheckpoint, table: SourceTable, dtype: torch.dtype | None,
               exclude_frozen: bool = False) -> Plan:
    """The state dict's plan, as the checkpoint's layout builds it."""
    return ckpt.layout.plan(ckpt, table, dtype, exclude_frozen)


def plain_plan(ckpt: LoadedCheckpoint, table: SourceTable, dtype: torch.dtype | None, exclude_frozen: bool,
               trainable: EntryTable) -> Plan:
    """The plan of a save whose module dict names every tensor (plain ZeRO 0-3 and its universal
    copy), given the layout's ``trainable`` entries: the rest of the module is classified here."""
    frozen = frozen_entries(ckpt, table)
    kinds, aliases, undeclared_frozen, buffers, absent = _classify_module(ckpt, trainable, frozen)
    for name in undeclared_frozen:
        frozen[name] = module_entry(ckpt, table, name)
    for name in buffers:
        buffers[name] = module_entry(ckpt, table, name)
    layers = Layers(((TRAINABLE, trainable), (FROZEN, EntryTable.of_entries(frozen)),
                     (BUFFER, EntryTable.of_entries(buffers))))
    return assemble(ckpt, layers, _order(kinds, layers.names, aliases, absent), aliases, dtype, exclude_frozen,
                    frozen_excluded=frozen_excluded(ckpt) or bool(absent), absent_frozen=tuple(sorted(absent)))


def _order(kinds: Mapping, entries: Mapping, aliases: dict, absent: set) -> list[str]:
    """The module dict's order (less what has no data), then parameters the module did not list.
    Subset tests first, which make no set: with tens of thousands of names, usually neither
    filter drops any."""
    listed = entries.keys() <= kinds.keys()
    overlap = sum(a in entries for a in aliases)
    if absent or not listed or not aliases.keys() <= kinds.keys() or \
            len(entries) + len(aliases) - overlap != len(kinds):
        order = [n for n in kinds if (n in entries or n in aliases) and n not in absent]
    else:
        order = list(kinds)  # every module key has data or is a tie
    if listed:
        return order
    unlisted = entries.keys() - kinds.keys()
    return order + [n for n in entries if n in unlisted]


def assemble(ckpt: LoadedCheckpoint, layers: Layers, order: list[str], aliases: dict[str, str],
             dtype: torch.dtype | None, exclude_frozen: bool, **flags) -> Plan:
    """The plan of the tensors ``layers`` holds, in ``order``, tied ``aliases`` kept as names,
    the dtype policy applied; ``exclude_frozen`` drops the frozen ones (and their aliases).
    Every name of ``order`` is in ``layers`` or ``aliases``."""
    if exclude_frozen:
        order = [n for n in order if layers.kind(aliases.get(n, n)) != FROZEN]
    named = order if not aliases else [n for n in order if n not in aliases]
    tensors = plan_tensors(named, layers, lambda stored: out_dtype_for(stored, dtype))
    listed = set(order) if aliases else ()
    kept_aliases = {a: s for a, s in aliases.items() if a in listed}
    return Plan(tensors, kept_aliases, tuple(order), ckpt.stage, ckpt.world_size, **flags)


def frozen_excluded(ckpt: LoadedCheckpoint) -> bool:
    """Whether the save left its frozen parameters out (``exclude_frozen_parameters=True``, as the
    HF Trainer does for PEFT models). Stages 2-3 then record ``frozen_param_shapes`` as None
    instead of a (possibly empty) dict; stage 1 records None either way."""
    return ckpt.stage >= 2 and ckpt.meta.frozen_param_shapes is None


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
    unplaced = meta.module.keys() - trainable.keys() - frozen.keys()
    # Identities only tell the entries none of the lists below name: when there are none (the
    # usual case), tens of thousands of them need not be made.
    if unplaced - meta.shared_params.keys() - buffer_names:
        sorted_ = _classify_by_identity(ckpt, trainable, frozen, buffer_names)
    else:
        sorted_ = _classify_named(meta, unplaced)
    return _resolve_aliases(ckpt, *sorted_, trainable, frozen)


def _classify_named(meta, unplaced: set[str]):
    """The module's keys when each is named by some list: only those the builders did not place
    (ties and buffers, a few) are looked at one by one."""
    kinds = meta.module  # only its keys are read: the output order
    aliases: dict[str, str] = {}
    buffers: dict[str, None] = {}
    for name in (unplaced and [n for n in kinds if n in unplaced]):
        if name in meta.shared_params:
            aliases[name] = meta.shared_params[name]
        else:
            buffers[name] = None
    return kinds, aliases, [], buffers, set()


def _classify_by_identity(ckpt: LoadedCheckpoint, trainable: dict, frozen: dict, buffer_names: set[str]):
    meta = ckpt.meta
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
    return kinds, aliases, undeclared_frozen, buffers, absent


def _resolve_aliases(ckpt: LoadedCheckpoint, kinds, aliases, undeclared_frozen, buffers, absent, trainable, frozen):
    """Check that every tie points at a tensor; drop the ties of frozen weights the save left out."""
    meta = ckpt.meta
    for alias, source in list(aliases.items()):
        if source in trainable or source in frozen or source in undeclared_frozen:
            continue
        if source in meta.module or (ckpt.stage >= 2 and not frozen_excluded(ckpt)):
            raise InconsistentCheckpointError(f"tied parameter {alias!r} points to unknown parameter {source!r}",
                                              meta.path)
        absent.update((alias, source))
        del aliases[alias]
    return kinds, aliases, undeclared_frozen, buffers, absent
