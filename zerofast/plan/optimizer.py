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

from .. import keys as K
from ..dtypes import out_dtype_for
from ..errors import InconsistentCheckpointError, MissingOptimizerStateError, UnsupportedCheckpointError, short_repr
from ..load import LoadedCheckpoint, OptimStates
from .builders import master_flat_groups
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
    for name in model_order(ckpt, by_key[keys[0]]):
        for key in keys:
            shape, stored, segs = by_key[key][name]
            out = f"{name}.{key}" if qualified else name
            tensors[out] = TensorPlan(out, shape, KIND, stored, out_dtype_for(stored, dtype), tuple(segs))
    return Plan(tensors, {}, tuple(tensors), ckpt.stage, ckpt.world_size)


def flat_state_entries(ckpt: LoadedCheckpoint, table: SourceTable, keys: Sequence[str]) -> dict[str, dict]:
    """``{key: {param: entry}}`` of a save whose optimizer files partition each state like the
    masters; the layout places them as it places its masters."""
    states = checked_states(ckpt)
    return {key: ckpt.layout.trainable_from(ckpt, table, state_flat_groups(ckpt, states, key), f"'{key}' groups")
            for key in keys}


def model_order(ckpt: LoadedCheckpoint, entries: dict) -> list[str]:
    """The module's own key order, like the model state dict; names it does not list go last."""
    listed = [n for n in ckpt.meta.module if n in entries]
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
    """The per-element states the optimizer keeps for every parameter, e.g. ``["exp_avg", "exp_avg_sq"]``."""
    return ckpt.layout.optimizer_keys(ckpt)


def flat_keys(ckpt: LoadedCheckpoint) -> list[str]:
    """The per-element states every rank keeps for every flat group."""
    per_rank = [per_element_keys(groups) for groups in checked_states(ckpt)]
    return [k for k in per_rank[0] if all(k in keys for keys in per_rank)] if per_rank else []


def per_element_keys(states: list[_GroupState]) -> list[str]:
    """Keys that hold a tensor with elements (not a scalar like ``step``) in every group."""
    found = None
    for _, state in states:
        keys = [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0]
        present = set(keys)
        found = keys if found is None else [k for k in found if k in present]
    return found or []


def state_flat_groups(ckpt: LoadedCheckpoint, states: list[list[_GroupState]], key: str) -> FlatGroups:
    masters = master_flat_groups(ckpt)
    last = ckpt.last_ranks
    out: FlatGroups = []
    for r, (o, groups) in enumerate(zip(ckpt.optim_states, states)):
        rank = []
        for g, (where, state) in enumerate(groups):
            value = state.get(key)
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                raise _missing_key(o, where, state, key, groups)
            _check_length(o, f"{where}.{key}", value, masters[r][g][1], may_be_longer=ckpt.stage != 3 and r in last)
            rank.append((f"{where}.{key}", value))
        out.append(rank)
    return out


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
    owner = {name: group_of[entries[name][2][0][0]] for name in model_order(ckpt, entries) if entries[name][2]}
    found = {name: scalars(states[r][g][1]) for name, (r, g) in owner.items()}
    return {"state": found, "param_groups": _param_groups(ckpt, owner)}


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

