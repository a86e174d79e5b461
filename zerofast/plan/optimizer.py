"""The wrapped optimizer's per-element state (Adam's moments), planned per parameter.

ZeRO partitions every per-element state of the wrapped optimizer (Adam's ``exp_avg`` and
``exp_avg_sq``) exactly like the fp32 masters: one flat tensor per rank and flat group. So the
plan is built by the same stage 1-3 layout builders as the masters, pointed at these tensors
instead, and runs through the same native executor.

Where the state sits in each rank's optimizer file:
- stages 1-2: ``base_optimizer_state``, the torch optimizer's ``state_dict()`` whose groups hold
  one flat parameter each (or, with ``elastic_checkpoint``, a list of one state per group);
- stage 3: the inner ``optimizer_state_dict``, one flat parameter per sub-group.
Stages 1-2 strip the last rank's group padding from the masters but not from the state, so the
last rank's state may be longer than its masters; the offsets agree either way.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from ..base import keys as K
from ..base.dtypes import out_dtype_for
from ..base.errors import (InconsistentCheckpointError, MissingOptimizerStateError, UnplacedOptimizerStateError,
                      UnsupportedCheckpointError, short_repr)
from ..load import LoadedCheckpoint, OptimStates
from . import whole_params
from .builders import master_flat_groups
from .columns import PlanTensors
from .model import FlatGroups, Plan, SourceTable, TensorPlan

KIND = "optimizer_state"
_GroupState = tuple[str, dict]  # (where the state sits in the file's pickle, the state)


def build_optimizer_plan(ckpt: LoadedCheckpoint, table: SourceTable, keys: Sequence[str],
                         dtype: torch.dtype | None, *, qualified: bool) -> Plan:
    """Plan ``keys`` of every trainable parameter. Outputs are named ``<param>.<key>`` when
    ``qualified`` (several keys in one plan), else by the parameter name alone (one key)."""
    if not keys or (not qualified and len(keys) != 1):
        raise ValueError(f"expected {'one key' if not qualified else 'at least one key'}, got {list(keys)}")
    tensors: dict[str, TensorPlan] = {}
    by_key = ckpt.layout.optimizer_entries(ckpt, table, keys)
    every = {name: None for key in keys for name in by_key[key]}
    for name in model_order(ckpt, every):
        for key in (k for k in keys if name in by_key[k]):
            shape, stored, segs = by_key[key][name]
            out = f"{name}.{key}" if qualified else name
            tensors[out] = TensorPlan(out, shape, KIND, stored, out_dtype_for(stored, dtype), tuple(segs))
    return Plan(PlanTensors.of(list(tensors.values())), {}, tuple(tensors), ckpt.stage, ckpt.world_size)


def flat_state_entries(ckpt: LoadedCheckpoint, table: SourceTable, keys: Sequence[str]) -> dict[str, dict]:
    """``{key: {param: entry}}`` of a save whose optimizer files partition each state like the
    masters; the layout places them as it places its masters."""
    states = checked_states(ckpt)
    return {key: state_entries(ckpt, table, states, key) for key in keys}


def model_order(ckpt: LoadedCheckpoint, entries: dict) -> list[str]:
    """The module's own key order, like the model state dict; names it does not list go last."""
    listed = [n for n in ckpt.module_names if n in entries]
    seen = set(listed)
    return listed + [n for n in entries if n not in seen]


# ---------------------------------------------------------------------------------------------
# Reading the state out of the files.

def checked_states(ckpt: LoadedCheckpoint) -> list[list[_GroupState]]:
    if ckpt.stage == 0:
        raise UnsupportedCheckpointError(
            "optimizer states are read from ZeRO stage 1-3 checkpoints; this is stage 0, whose optimizer state "
            "is stored unpartitioned and unnamed in the model-states file", ckpt.meta.path)
    states = [group_states(o, ckpt.stage) for o in ckpt.optim_states]
    for o, groups in zip(ckpt.optim_states, states):
        if len(groups) != len(o.flat_groups):
            raise InconsistentCheckpointError(
                f"expected optimizer state for {len(o.flat_groups)} flat groups (one per fp32 group), found "
                f"{len(groups)}", o.path)
    return states


def group_states(o: OptimStates, stage: int) -> list[_GroupState]:
    """This rank's optimizer state per flat group, in the order of its fp32 flat groups."""
    osd = o.raw[K.OPTIMIZER_STATE_DICT]
    field = K.inner_key(stage)
    inner = osd.get(field)
    where = f"optimizer_state_dict.{field}"
    if isinstance(inner, (list, tuple)):  # elastic_checkpoint: one lean state per group
        return [(f"{where}[{g}]", _as_dict(o, s, f"{where}[{g}]")) for g, s in enumerate(inner)]
    if isinstance(inner, dict) and isinstance(inner.get(K.STATE), dict):
        state = inner[K.STATE]
        return [(f"{where}.state[{i}]", _as_dict(o, state.get(i, {}), f"{where}.state[{i}]"))
                for i in _flat_param_indices(o, inner, where)]
    raise InconsistentCheckpointError(
        f"expected '{field}' in 'optimizer_state_dict' to be a torch optimizer state dict or a list of group "
        f"states, found {type(inner).__name__}", o.path)


def _flat_param_indices(o: OptimStates, inner: dict, where: str) -> list:
    """torch numbers the parameters through its param_groups in order; each one is a flat group
    here, so this order is the order of the fp32 flat groups."""
    return [i for _, params in param_groups(o, inner, where) for i in params]


def param_groups(o: OptimStates, inner: dict, where: str) -> list[tuple[dict, list[int]]]:
    """Each of torch's param groups with its ``params`` (parameter indices), checked."""
    groups = inner.get(K.PARAM_GROUPS)
    groups = [] if groups is None else groups
    if not isinstance(groups, (list, tuple)):
        raise InconsistentCheckpointError(f"expected {where}.param_groups to be a list, found {type(groups).__name__}",
                                          o.path)
    out = []
    for g, group in enumerate(groups):
        params = _as_dict(o, group, f"{where}.param_groups[{g}]").get(K.PARAMS, [])
        if not isinstance(params, (list, tuple)) or not all(type(i) is int for i in params):
            raise InconsistentCheckpointError(
                f"expected {where}.param_groups[{g}]['params'] to be a list of parameter indices (ints), found "
                f"{short_repr(params)}", o.path)
        out.append((group, list(params)))
    return out


def _as_dict(o: OptimStates, value: Any, where: str) -> dict:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):  # keys: "exp_avg", "step"...
        found = "a dict keyed by other than names" if isinstance(value, dict) else type(value).__name__
        raise InconsistentCheckpointError(f"expected {where} to be a dict of named states, found {found}", o.path)
    return value


def available_keys(ckpt: LoadedCheckpoint) -> list[str]:
    """The per-element states the optimizer keeps, each for the parameters of the groups that
    keep it (Muon: ``momentum_buffer`` in one group, ``exp_avg``/``exp_avg_sq`` in the other)."""
    return ckpt.layout.optimizer_keys(ckpt)


def flat_keys(ckpt: LoadedCheckpoint) -> list[str]:
    """The per-element states kept for some flat group by every rank, in first-seen order."""
    out: list[str] = []
    for held in group_keys(checked_states(ckpt)):
        out += [k for k in held if k not in out]
    return out


def group_keys(states: list[list[_GroupState]]) -> list[list[str]]:
    """Per flat group, the per-element states every rank keeps for it."""
    if not states:
        return []
    per_rank = [[_tensor_keys(state) for _, state in groups] for groups in states]
    return [[k for k in keys if all(k in rank[g] for rank in per_rank)] for g, keys in enumerate(per_rank[0])]


def flat_group_keys(ckpt: LoadedCheckpoint) -> list[dict]:
    """Per param group of the wrapped optimizer: its name (when it has one), how many flat
    groups and parameters it spans, and the per-element states it keeps. Elastic saves keep
    no param groups; then each flat group is reported on its own."""
    states = checked_states(ckpt)
    held = group_keys(states)
    o = ckpt.optim_states[0]
    field = K.inner_key(ckpt.stage)
    inner = o.raw[K.OPTIMIZER_STATE_DICT].get(field)
    groups = param_groups(o, inner, f"optimizer_state_dict.{field}") if isinstance(inner, dict) else \
        [({}, [g]) for g in range(len(held))]
    shapes = ckpt.meta.param_shapes or []
    out, flat = [], 0
    for group, params in groups:
        span = range(flat, min(flat + len(params), len(held)))
        flat += len(params)
        keys = [k for g in span for k in held[g]]
        name = group.get("name")
        out.append({"name": name if isinstance(name, str) else None, "flat_groups": len(span),
                    "params": sum(len(shapes[g]) for g in span if g < len(shapes)),
                    "keys": list(dict.fromkeys(keys))})
    return out


def _tensor_keys(state: dict) -> list[str]:
    """Keys that hold a tensor with elements (not a scalar like ``step``)."""
    return [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0]


def per_element_keys(states: list[_GroupState]) -> list[str]:
    """Keys that hold a tensor with elements in some group of one rank."""
    out: list[str] = []
    for _, state in states:
        out += [k for k in _tensor_keys(state) if k not in out]
    return out


def state_entries(ckpt: LoadedCheckpoint, table: SourceTable, states: list[list[_GroupState]],
                  key: str) -> dict:
    """``{param: entry}`` of ``key`` for every parameter whose flat group keeps it. A group
    without it, or with it laid out over whole parameters (:mod:`.whole_params`), is stood in
    for by its fp32 masters so the layout places the rest as usual; the parameters read from a
    stand-in are dropped, and those of whole-parameter groups read on their own."""
    held = group_keys(states)
    if not any(key in keys for keys in held):
        merged = {k: v for _, state in states[0] for k, v in state.items()}
        raise _missing_key(ckpt.optim_states[0], "every flat group", merged, key, states[0])
    masters = master_flat_groups(ckpt)
    raw = raw_flats(states, key, held, masters)
    whole = whole_params.whole_groups(ckpt, raw, masters, [g for g, keys in enumerate(held) if key in keys])
    flats, stand_ins = state_flat_groups(ckpt, raw, key, held, masters, whole)
    found = ckpt.layout.trainable_from(ckpt, table, flats, f"'{key}' groups")
    dropped = {table.add(str(ckpt.optim_states[r].path), *masters[r][g]) for r, g in stand_ins}
    out = {name: e for name, e in found.items() if not any(seg[0] in dropped for seg in e[2])}
    for g in sorted(whole):
        out.update(whole_params.entries(ckpt, table, raw, masters, g))
    return out


def whole_state_groups(ckpt: LoadedCheckpoint, key: str) -> set[int]:
    """The flat groups whose ``key`` is laid out over whole parameters (Muon's momentum, ZeRO 1-2)."""
    states = checked_states(ckpt)
    held = group_keys(states)
    masters = master_flat_groups(ckpt)
    return whole_params.whole_groups(ckpt, raw_flats(states, key, held, masters), masters,
                                     [g for g, keys in enumerate(held) if key in keys])


def raw_flats(states: list[list[_GroupState]], key: str, held: list[list[str]], masters: FlatGroups) -> FlatGroups:
    """Per rank and flat group, ``key``'s tensor as stored, or the fp32 master where the group
    does not keep it."""
    return [[(f"{where}.{key}", state[key]) if key in held[g] else masters[r][g]
             for g, (where, state) in enumerate(groups)] for r, groups in enumerate(states)]


def state_flat_groups(ckpt: LoadedCheckpoint, raw: FlatGroups, key: str, held: list[list[str]],
                      masters: FlatGroups, whole: set[int]) -> tuple[FlatGroups, list[tuple[int, int]]]:
    """``raw`` checked to be laid out like the fp32 partitions, with the groups that do not keep
    ``key`` or keep it over whole parameters stood in for by the masters; and the (rank, group)
    of those stand-ins."""
    last = ckpt.last_ranks
    out: FlatGroups = []
    stand_ins = []
    for r, (o, groups) in enumerate(zip(ckpt.optim_states, raw)):
        rank = []
        for g, (where, value) in enumerate(groups):
            if key not in held[g] or g in whole:
                rank.append(masters[r][g])
                stand_ins.append((r, g))
                continue
            _check_length(o, where, value, masters[r][g][1], may_be_longer=ckpt.stage != 3 and r in last)
            rank.append((where, value))
        out.append(rank)
    return out, stand_ins


def refuse_unplaced(ckpt: LoadedCheckpoint, placed: Sequence[str], writer: str) -> None:
    """Raise :class:`UnplacedOptimizerStateError` for the first partitioned (per-element) value
    ``writer`` would not place: a key outside ``placed``, one some rank keeps for a flat group
    that another rank does not, or one laid out neither like its group's fp32 partition nor over
    whole parameters. Copying such a value through would hand every new rank the old rank's
    partition: a wrong answer, not an error."""
    states = checked_states(ckpt)
    held = group_keys(states)
    masters = master_flat_groups(ckpt)
    whole = {key: whole_state_groups(ckpt, key) for key in flat_keys(ckpt)}
    for r, (o, groups) in enumerate(zip(ckpt.optim_states, states)):
        for g, (where, state) in enumerate(groups):
            for key in _tensor_keys(state):
                why = _unplaced(ckpt, r, state[key], masters[r][g][1], key in placed, held[g], key)
                if why and not (key in placed and g in whole.get(key, ())):
                    raise UnplacedOptimizerStateError(
                        f"{writer} cannot place the partitioned optimizer state {where}.{key} "
                        f"({state[key].numel()} elements): {why}; refusing rather than copying this rank's "
                        "partition into the new files", o.path)


def _unplaced(ckpt: LoadedCheckpoint, r: int, value: torch.Tensor, master: torch.Tensor, placed: bool,
              held: list[str], key: str) -> str | None:
    """Why ``value`` cannot be placed like the fp32 partition, or None when it can."""
    if key not in held:
        return f"not every rank keeps it for this group (kept by all: {held})"
    if not placed:
        return "the writer does not place this key"
    n, m = value.numel(), master.numel()
    if n == m or (ckpt.stage != 3 and r in ckpt.last_ranks and n > m):
        return None
    return f"no layout rule covers it (its fp32 partition holds {m} elements)"


def _missing_key(o: OptimStates, where: str, state: dict, key: str, groups: list[_GroupState]) -> Exception:
    available = per_element_keys(groups)
    what = "is a scalar, not a per-element state" if key in state else "is missing"
    return MissingOptimizerStateError(
        f"optimizer state {key!r} {what} in {where}; per-element states here: {available}", o.path)


def _check_length(o: OptimStates, where: str, value: torch.Tensor, master: torch.Tensor, may_be_longer: bool) -> None:
    n, m = value.numel(), master.numel()
    if n == m or (may_be_longer and n > m):
        return
    raise InconsistentCheckpointError(
        f"expected {where} to hold {'at least ' if may_be_longer else ''}{m} elements like its fp32 partition, "
        f"found {n}", o.path)


# ---------------------------------------------------------------------------------------------
# Scalar state (``step``) and hyperparameters, for the export's JSON.

def scalar_states(ckpt: LoadedCheckpoint) -> dict:
    """``{"state": {param: {scalar key: value}}, "param_groups": [...]}`` as plain JSON data.

    Each parameter gets the scalars of the flat group its elements sit in; each param group lists
    its hyperparameters and the names of the parameters it holds.
    """
    return ckpt.layout.scalar_states(ckpt)


def flat_scalar_states(ckpt: LoadedCheckpoint) -> dict:
    """:func:`scalar_states` of a save whose optimizer files hold one state per flat group."""
    states = checked_states(ckpt)
    table = SourceTable()
    masters = master_flat_groups(ckpt)
    entries = ckpt.layout.trainable_from(ckpt, table, masters, "flat fp32 groups")
    group_of = {table.add(str(o.path), where, t): (r, g)
                for r, (o, groups) in enumerate(zip(ckpt.optim_states, masters)) for g, (where, t) in enumerate(groups)}
    placed = rank0_places(ckpt, states)
    owner = {}
    for name in model_order(ckpt, entries):
        segs = entries[name][2]
        if segs:
            owner[name] = group_of.get(segs[0][0]) or _computed_owner(ckpt, name, placed)
    found = {name: scalars(states[r][g][1]) for name, (r, g) in owner.items()}
    return {"state": found, "param_groups": _param_groups(ckpt, owner)}


def rank0_places(ckpt: LoadedCheckpoint, states: list[list[_GroupState]]) -> dict[str, tuple[int, int]]:
    """Each parameter that rank 0's ``param_shapes`` lists, with rank 0's flat group at that place."""
    out: dict[str, tuple[int, int]] = {}
    for g, shapes in enumerate((ckpt.meta.param_shapes or [])[:len(states[0]) if states else 0]):
        for name in shapes:
            out.setdefault(name, (0, g))
    return out


def _computed_owner(ckpt: LoadedCheckpoint, name: str, placed: dict[str, tuple[int, int]]) -> tuple[int, int]:
    """The flat group whose scalars (``step``) a parameter takes when its master is no flat group's
    elements but a value made while planning: the mean of a tensor-parallel save's replicated copies
    (``parameter_to_average_patterns``, ``--tp-replicated mean``). Every tp rank's copy sits in a
    group stepped with the others; like ds_to_universal (tp rank 0's step) and to-universal, the
    parameter takes rank 0's group at its ``param_shapes`` place."""
    if name in placed:
        return placed[name]
    raise InconsistentCheckpointError(
        f"{name!r} is planned from a value computed over several ranks (their mean), and rank 0's 'param_shapes' do "
        "not list it, so which flat group's scalar state (step) it takes is not known", ckpt.meta.path)


def hyperparameters(group: dict) -> dict:
    """A param group's hyperparameters as JSON data."""
    settings = {str(k)[:200]: _plain(v) for k, v in group.items() if k != K.PARAMS}
    return {k: v for k, v in settings.items() if v is not _SKIP}


def scalars(state: dict) -> dict:
    out = {}
    for key, value in state.items():
        plain = _plain(value)
        if plain is not _SKIP:
            out[str(key)] = plain
    return out


_SKIP = object()


def _plain(value: Any, depth: int = 0) -> Any:
    """``value`` as JSON data (hyperparameters, ``step``), or _SKIP. Shallow and short lists only:
    the pickle may share one list under many others."""
    if isinstance(value, torch.Tensor):
        value = value.item() if value.dim() == 0 and not value.is_complex() else _SKIP
    if value is None or type(value) in (bool, str):
        return value
    if type(value) is int:
        return value if abs(value) < 2 ** 63 else _SKIP
    if type(value) is float:
        return value if math.isfinite(value) else _SKIP  # NaN is not JSON
    if type(value) in (list, tuple) and depth < 2 and len(value) <= 64:
        items = [_plain(v, depth + 1) for v in value]
        return _SKIP if any(v is _SKIP for v in items) else items
    return _SKIP


def _param_groups(ckpt: LoadedCheckpoint, owner: dict[str, tuple[int, int]]) -> list[dict]:
    """The wrapped optimizer's param groups of rank 0, ``params`` given as names. Elastic
    checkpoints keep no param groups; then this is empty."""
    o = ckpt.optim_states[0]
    field = K.inner_key(ckpt.stage)
    inner = o.raw[K.OPTIMIZER_STATE_DICT].get(field)
    if not isinstance(inner, dict):
        return []
    position = 0
    out = []
    for group, params in param_groups(o, inner, f"optimizer_state_dict.{field}"):
        count = len(params)
        flat = range(position, position + count)
        position += count
        settings = hyperparameters(group)
        settings["params"] = [name for name, (_, g) in owner.items() if g in flat]
        out.append(settings)
    return out

