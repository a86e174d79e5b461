"""Planning for universal checkpoints (``python -m deepspeed.checkpoint.ds_to_universal``).

A universal folder keeps copies of the model-states files and, in place of the partitioned
optimizer files, ``zero/<param>/<state>.pt``: each trainable parameter's fp32 master (``fp32``)
and per-element optimizer states (``exp_avg``, ...) whole, plus ``step``. From a ZeRO-1/2 save
each file is ``{'param': tensor of the parameter's shape, 'cat_dim': 0}``; from a ZeRO-3 save
it is the bare tensor, flattened. Only trainable parameters are planned from these files.
Frozen parameters and buffers are read from the copied model states exactly as for the save
they were converted from: ds_to_universal writes ``fp32.pt`` for them too at stages 1-2, but
cast to float32, which rounds int64 buffers above 2**24 and loses every dtype, while the model
states hold the original values.

Each file is unpickled by the same restricted loader (:func:`zerofast.load.load_file`) with its
tensor memory-mapped, and every tensor becomes one source of one plan, so the native executor
reads each once.
"""
from __future__ import annotations

import itertools
import math
import os
from pathlib import Path

import torch

from ...errors import CorruptCheckpointError, IncompleteCheckpointError, InconsistentCheckpointError, some
from ...load import LoadedCheckpoint, OptimStates, UniversalState, load_file
from .. import keys as K
from ..model import Entry, SourceTable

MASTER = "fp32"
SCALARS = ("step",)  # per-parameter files that hold no per-element state


def trainable(ckpt: LoadedCheckpoint, table: SourceTable, key: str = MASTER) -> dict[str, Entry]:
    """Every trainable parameter, read from its ``<key>.pt`` (the fp32 master, or an optimizer
    state such as ``exp_avg``): one whole source per parameter."""
    u = _state(ckpt)
    params = trainable_shapes(ckpt)
    paths = {name: param_dir(u, name) / f"{key}.pt" for name in params}
    missing = [str(p.relative_to(u.zero_dir.parent)) for p in paths.values() if not p.is_file()]
    if missing:
        raise IncompleteCheckpointError(
            f"expected {key}.pt for each of the {len(params)} trainable parameters, found {len(params) - len(missing)}; "
            f"missing: {some(missing)}", u.zero_dir)
    out = {}
    for name, shape in params.items():
        where, tensor = _read(ckpt, paths[name], shape)
        src = table.add(str(paths[name]), where, tensor)
        out[name] = (shape, tensor.dtype, [(src, 0, 0, tensor.numel())])
    return out


def trainable_shapes(ckpt: LoadedCheckpoint) -> dict[str, tuple[int, ...]]:
    return {name: shape for group in ckpt.meta.param_shapes for name, shape in group.items()}


def param_dir(u: UniversalState, name: str) -> Path:
    """The folder of parameter ``name``; a name from the pickle must not lead out of ``zero``."""
    if not name or name in (".", "..") or "/" in name or "\0" in name or os.sep in name:
        raise CorruptCheckpointError(f"expected parameter names usable as folder names, found {name!r:.80}",
                                     u.zero_dir)
    return u.zero_dir / name


def _read(ckpt: LoadedCheckpoint, path: Path, shape: tuple[int, ...]) -> tuple[str, torch.Tensor]:
    """The tensor of one per-parameter file, checked against the parameter's recorded shape."""
    obj = load_file(path)
    if ckpt.stage == 3:
        where, tensor, layout = "", obj, f"a bare 1-D tensor of {math.prod(shape)} elements (ZeRO-3 source)"
        ok = isinstance(tensor, torch.Tensor) and tensor.dim() == 1 and tensor.numel() == math.prod(shape)
    else:
        where, tensor, layout = "['param']", obj.get("param") if isinstance(obj, dict) else obj, \
            f"{{'param': tensor of shape {shape}}} (ZeRO-1/2 source)"
        ok = isinstance(obj, dict) and isinstance(tensor, torch.Tensor) and tuple(tensor.shape) == tuple(shape)
    if not ok:
        found = (f"{'a dict holding a' if isinstance(obj, dict) else 'a bare'} {tensor.dtype} tensor of shape "
                 f"{tuple(tensor.shape)}" if isinstance(tensor, torch.Tensor) else type(obj).__name__)
        raise InconsistentCheckpointError(f"expected {layout}, as 'param_shapes' records, found {found}", path)
    if not tensor.is_floating_point():
        raise CorruptCheckpointError(f"expected a floating-point tensor, found {tensor.dtype}", path)
    return where, tensor


def _state(ckpt: LoadedCheckpoint) -> UniversalState:
    assert ckpt.universal is not None, "not a universal checkpoint"
    return ckpt.universal


# ---------------------------------------------------------------------------------------------
# Optimizer states

def state_keys(ckpt: LoadedCheckpoint) -> list[str]:
    """The per-element optimizer states the parameters' folders hold, in file-name order. Any
    parameter's file counts: one missing elsewhere is an incomplete folder, not a state the
    optimizer does not keep (``trainable`` names it)."""
    u = _state(ckpt)
    found: set[str] = set()
    for name in trainable_shapes(ckpt):
        folder = param_dir(u, name)
        if folder.is_dir():
            found.update(n[:-3] for n in os.listdir(folder) if n.endswith(".pt"))
    return sorted(found - {MASTER, *SCALARS})


def scalar_states(ckpt: LoadedCheckpoint) -> tuple[dict[str, dict], list[tuple[dict, list[str]]]]:
    """Each parameter's scalar state (``step.pt``; ZeRO-3 sources write none) and the wrapped
    optimizer's param groups from ``zero/optimizer_state.pt``, each with the names of its
    parameters (``param_shapes`` keeps one entry per param group)."""
    u = _state(ckpt)
    states = {}
    for name in trainable_shapes(ckpt):
        path = param_dir(u, name) / "step.pt"
        states[name] = {"step": load_file(path)} if path.is_file() else {}
    if ckpt.stage == 3 and not any(states.values()):
        states = _zero3_rank0_states(ckpt) or states
    groups = u.optimizer_state.get(K.PARAM_GROUPS)
    shapes = ckpt.meta.param_shapes
    if not isinstance(groups, (list, tuple)) or len(groups) != len(shapes) or \
            not all(isinstance(g, dict) for g in groups):
        return states, []
    return states, [(g, list(names)) for g, names in zip(groups, shapes)]


def _zero3_rank0_states(ckpt: LoadedCheckpoint) -> dict[str, dict] | None:
    """A ZeRO-3 source leaves no ``step.pt``; ``zero/optimizer_state.pt`` is rank 0's optimizer
    dict, whose state per sub-group holds it. Rank 0 holds the first ceil(n/W) elements of every
    parameter, so walking ``param_shapes`` over its flat groups finds each parameter's sub-group."""
    from ..optimizer import group_states  # that module plans its states through this one

    u = _state(ckpt)
    common = u.optimizer_state
    flats = common.get(K.ZERO3_FLAT)
    if not isinstance(flats, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in flats):
        return None
    path = u.common_path
    groups = group_states(OptimStates(path, 3, None, list(flats), None, {K.OPTIMIZER_STATE_DICT: common}), 3)
    ends = list(itertools.accumulate(t.numel() for t in flats))
    out, offset = {}, 0
    for name, shape in trainable_shapes(ckpt).items():
        g = next((g for g, end in enumerate(ends) if end > offset), None)
        if g is None or g >= len(groups):
            raise InconsistentCheckpointError(
                f"'param_shapes' places {name!r} at element {offset} of rank 0's flat groups, which hold "
                f"{ends[-1] if ends else 0}",
                path)
        out[name] = groups[g][1]
        offset += math.ceil(math.prod(shape) / ckpt.world_size)
    return out
