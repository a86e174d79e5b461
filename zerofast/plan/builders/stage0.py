"""Planning for ZeRO stage 0, where the checkpoint does not say which master is which parameter.

A stage-0 mixed-precision save keeps its fp32 masters in the model-states file under
``optimizer`` (``fp32_groups``: one tensor per parameter; ``fp32_groups_flat``: one flat tensor
per group) and records no ``param_shapes``. Each master is matched to the module parameter of
the same shape whose stored value equals ``master.to(model_dtype)``. Only an unambiguous answer
is accepted: equal-looking parameters may share a class only if their masters are identical too,
since then every assignment yields the same state dict.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from ...base.errors import CorruptCheckpointError, InconsistentCheckpointError, UnsupportedCheckpointError
from ...load import LoadedCheckpoint
from ...base import keys
from ..model import Entry, SourceTable, tensor_identity


@dataclass(frozen=True)
class _Slot:
    """A master: ``numel`` elements at ``offset`` of source ``src`` (a registered flat tensor)."""

    src: int
    offset: int
    shape: tuple[int, ...]
    where: str


def trainable(ckpt: LoadedCheckpoint, table: SourceTable, exclude_frozen: bool) -> dict[str, Entry]:
    meta = ckpt.meta
    params = _module_parameters(ckpt)
    opt = meta.raw.get(keys.STAGE0_OPTIMIZER)
    if not isinstance(opt, dict) or not ({keys.STAGE0_FP32_GROUPS, keys.STAGE0_FP32_FLAT} & set(opt)):
        # Plain fp32 training keeps no masters: the module holds the trained values.
        if exclude_frozen:
            _require_no_frozen(ckpt, opt, len(params))
        return {name: module_entry(ckpt, table, name) for name in params}
    model_dtype = next(iter(params.values())).dtype if params else torch.float32
    slots = _slots(ckpt, table, opt, params, model_dtype)
    return _assign(ckpt, table, slots, params, model_dtype)


def _require_no_frozen(ckpt: LoadedCheckpoint, opt, n_params: int) -> None:
    """Plain fp32 stage 0 names no parameter as frozen. Only the optimizer's per-parameter state,
    kept for parameters that were trained and keyed by index, shows whether any exist."""
    state = opt.get(keys.STATE) if isinstance(opt, dict) else None
    trained = len(state) if isinstance(state, dict) else None
    if trained != n_params:
        raise UnsupportedCheckpointError(
            f"exclude_frozen: this fp32 stage-0 checkpoint does not record which parameters are frozen "
            f"(the optimizer has state for {trained} of the module's {n_params} parameters, unnamed)",
            ckpt.meta.path)


def _module_parameters(ckpt: LoadedCheckpoint) -> dict[str, torch.Tensor]:
    """Module entries that are parameters, one name per tensor (tied names are aliases)."""
    meta = ckpt.meta
    buffers = set(meta.buffer_names)
    seen: set[tuple] = set()
    out = {}
    for name, t in meta.module.items():
        if name in buffers or not isinstance(t, torch.Tensor) or name in meta.shared_params:
            continue
        identity = tensor_identity(t)
        if identity not in seen:
            seen.add(identity)
            out[name] = t
    return out


def module_entry(ckpt: LoadedCheckpoint, table: SourceTable, name: str) -> Entry:
    """The module dict's tensor ``name``, whole, as it is stored: the one such helper, also for
    the frozen weights and buffers :mod:`zerofast.plan.build` classifies."""
    return table.whole(str(ckpt.meta.path), f"{keys.MODULE}[{name!r}]", ckpt.meta.module[name])


def _slots(ckpt, table, opt, params, model_dtype) -> list[_Slot]:
    path = str(ckpt.meta.path)
    slots: list[_Slot] = []
    if keys.STAGE0_FP32_GROUPS in opt:
        for g, group in enumerate(_masters(ckpt, opt[keys.STAGE0_FP32_GROUPS], "optimizer.fp32_groups")):
            for i, t in enumerate(_masters(ckpt, group, f"optimizer.fp32_groups[{g}]", tensors=True)):
                where = f"optimizer.fp32_groups[{g}][{i}]"
                slots.append(_Slot(table.add(path, where, t), 0, tuple(t.shape), where))
        return slots
    for g, flat in enumerate(_masters(ckpt, opt[keys.STAGE0_FP32_FLAT], "optimizer.fp32_groups_flat", tensors=True)):
        where = f"optimizer.fp32_groups_flat[{g}]"
        slots += _walk_flat(ckpt, table.add(path, where, flat), flat.reshape(-1), params, model_dtype, where)
    return slots


def _masters(ckpt, value, where: str, tensors: bool = False) -> list:
    """``value`` as a list (of floating-point tensors with ``tensors``); the pickle decides its type."""
    ok = isinstance(value, (list, tuple)) and (
        not tensors or all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in value))
    if not ok:
        raise CorruptCheckpointError(
            f"expected {where} to be a list{' of floating-point tensors' if tensors else ''}, found "
            f"{type(value).__name__}{'' if not isinstance(value, (list, tuple)) else ' with other items'}",
            ckpt.meta.path)
    return list(value)


def _walk_flat(ckpt, src, flat, params, model_dtype, where) -> list[_Slot]:
    """Cut a flat master buffer into parameters by matching values.

    At an offset several parameters may match a prefix (a 1-element weight equal to the first
    element of a longer one), so every way to tile the buffer with matching parameters is
    followed; exactly one complete tiling must exist.
    """
    # Candidates are found by a digest of their first few values, and only those are compared
    # whole: the work per offset stays small unless many parameters share their leading values.
    by_prefix: dict[tuple[int, bytes], dict[bytes, set[tuple[int, ...]]]] = {}
    for t in params.values():
        if t.numel() > 0:
            flat_t = t.reshape(-1)
            by_prefix.setdefault((t.numel(), _digest(flat_t[:_PREFIX])), {}).setdefault(
                _digest(flat_t), set()).add(tuple(t.shape))
    numels = sorted({n for n, _ in by_prefix})
    total = flat.numel()
    # Same-valued parameters of distinct sizes make the reachable offsets grow combinatorially;
    # the work is bounded by the buffer's size, past which the cut counts as ambiguous.
    budget = [8 * total + (1 << 22)]

    def spend(elements: int) -> None:
        budget[0] -= elements
        if budget[0] < 0:
            raise InconsistentCheckpointError(
                f"cannot cut {where} into module parameters: too many parameters share their values (matching "
                f"would compare more than {8 * total + (1 << 22)} elements)", ckpt.meta.path)

    def shapes_at(offset: int) -> set[tuple[int, ...]]:
        found: set[tuple[int, ...]] = set()
        prefixes: dict[int, bytes] = {}
        for n in numels:
            if offset + n > total:
                break
            m = min(n, _PREFIX)
            spend(m)
            if m not in prefixes:
                prefixes[m] = _digest(flat[offset:offset + m].to(model_dtype))
            candidates = by_prefix.get((n, prefixes[m]))
            if candidates:
                spend(n)
                found |= candidates.get(_digest(flat[offset:offset + n].to(model_dtype)), set())
        return found

    steps = _tilings(total, shapes_at)
    if steps is None:
        raise InconsistentCheckpointError(
            f"cannot cut {where} into module parameters: no sequence of parameters whose values equal "
            f"master.to({model_dtype}) covers it exactly, or more than one does", ckpt.meta.path)
    return [_Slot(src, offset, shape, f"{where}[{offset}:]") for offset, shape in steps]


_PREFIX = 16


def _tilings(total: int, shapes_at) -> list[tuple[int, tuple[int, ...]]] | None:
    """The unique path of (offset, shape) steps from 0 to ``total``, or None if none or several."""
    options: dict[int, list[tuple[int, ...]]] = {}
    frontier = [0]
    while frontier:  # every offset some sequence of matches can reach
        offset = frontier.pop()
        if offset in options or offset >= total:
            continue
        options[offset] = sorted(shapes_at(offset))
        frontier += [offset + torch.Size(s).numel() for s in options[offset]]
    ways = {total: 1}
    for offset in sorted(options, reverse=True):  # complete tilings from each offset, capped at 2
        ways[offset] = min(2, sum(ways.get(offset + torch.Size(s).numel(), 0) for s in options[offset]))
    if ways.get(0, 0) != 1:
        return None
    steps, offset = [], 0
    while offset < total:
        shape = next(s for s in options[offset] if ways.get(offset + torch.Size(s).numel(), 0) == 1)
        steps.append((offset, shape))
        offset += torch.Size(shape).numel()
    return steps


def _digest(t: torch.Tensor) -> bytes:
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.blake2b(data, digest_size=16).digest()


def _assign(ckpt, table, slots, params, model_dtype) -> dict[str, Entry]:
    sources = table.tensors
    names_by_key: dict[tuple, list[str]] = {}
    for name, t in params.items():
        names_by_key.setdefault((tuple(t.shape), _digest(t)), []).append(name)
    slots_by_key: dict[tuple, list[_Slot]] = {}
    for s in slots:
        master = _slot_tensor(sources, s)
        slots_by_key.setdefault((s.shape, _digest(master.to(model_dtype))), []).append(s)
    assigned: dict[str, _Slot] = {}
    for key, group in slots_by_key.items():
        names = names_by_key.get(key, [])
        if len(names) < len(group):
            raise InconsistentCheckpointError(
                f"{group[0].where}: no module parameter of shape {key[0]} equals master.to({model_dtype})",
                ckpt.meta.path)
        if len({_digest(_slot_tensor(sources, s)) for s in group}) > 1:
            raise InconsistentCheckpointError(
                f"masters {[s.where for s in group]} differ but all match parameters {names[:len(group)]}; "
                "the mapping is ambiguous", ckpt.meta.path)
        assigned.update(zip(names, group))
    ordered = sorted(assigned.items(), key=lambda kv: slots.index(kv[1]))  # keep the group order
    return {name: (s.shape, sources[s.src].dtype, [(s.src, s.offset, 0, torch.Size(s.shape).numel())])
            for name, s in ordered}


def _slot_tensor(sources, s: _Slot) -> torch.Tensor:
    n = torch.Size(s.shape).numel()
    return sources[s.src][s.offset:s.offset + n]
