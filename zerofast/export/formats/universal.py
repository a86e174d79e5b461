"""``zerofast.to_universal``: DeepSpeed's universal checkpoint layout, straight from a ZeRO save.

The layout is what ``python -m deepspeed.checkpoint.ds_to_universal`` writes and what
``{"checkpoint": {"load_universal": true}}`` loads at any world size:

    <out>/<model-states files of the source, copied>
    <out>/zero/optimizer_state.pt          the optimizer's global state and param groups
    <out>/zero/<param>/fp32.pt             the fp32 master  } trainable parameters
    <out>/zero/<param>/exp_avg.pt, ...     each optimizer state } ({'param': full tensor, 'cat_dim': 0};
    <out>/zero/<param>/step.pt             the step         }  flattened bare tensors from stage 3)
    <out>/zero/<name>/fp32.pt              frozen params and buffers, in their own dtype
    <out>/../latest_universal              the name of <out>

Unlike DeepSpeed's tool it needs no ``universal_checkpoint_info`` in the source, and it writes
the frozen params and buffers at every stage (DeepSpeed's tool drops them at stage 3, and its
engine never restores them: see :func:`universal_module_state`). Each tensor is planned by the
same builders as ``reshard`` and written through the native executor, streaming.
"""
from __future__ import annotations

import os
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ...errors import ExportError, UnsupportedCheckpointError
from ...layouts import discover, load_checkpoint
from ...load import ModelStates
from ...load.records import read_model_states
from ... import keys
from ...plan import BUFFER, FROZEN, TensorPlan, build_plan
from ...plan.optimizer import group_states
from .. import ds_pickle
from ..outdir import os_error, output_dir
from ..run import ALONE
from ..torch_stream import Skeleton
from .reshard import Source, commit_tree, concat, write_shared

if TYPE_CHECKING:
    from ..distributed import Team

LATEST = "latest_universal"
_SHARDED = (keys.ZERO12_INNER, keys.SLICE_MAPPINGS, keys.ZERO12_FLAT)


def to_universal(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, *, tag: str | None = None,
                 overwrite: bool = False, team: "Team | None" = None) -> Path:
    """Write the ZeRO stage 1-3 checkpoint at ``ckpt_dir`` as a universal checkpoint in ``out_dir``
    (a tag folder: ``latest_universal`` in its parent names it). Returns ``out_dir``. ``team``:
    the ranks sharing the files (``zerofast.export.distributed``); None writes them all."""
    team = team or ALONE
    out = Path(out_dir)
    with team.step("reading the checkpoint", out):
        files = discover(ckpt_dir, tag)
        ckpt = load_checkpoint(files)
        if ckpt.stage == 0:
            raise UnsupportedCheckpointError(
                "universal checkpoints are made from ZeRO stage 1-3 saves; this is stage 0, which every world "
                "size already loads", ckpt.meta.path)
        source = Source.read(ckpt)
    with team.output_dir(out, overwrite) as (tmp, previous):
        write_shared(team, out, tmp, files.tag, lambda: _files(source), source.executor)
        with team.step("committing", out):
            if team.leader:
                for path in files.model_files:
                    shutil.copyfile(path, tmp / path.name)
                names = [p.name for p in files.model_files] + ["zero"]
                commit_tree(out, tmp, names, previous)
                _write_latest(out)
    return out


def _files(source: Source):
    """(path under the output folder, object, skeleton) of every file under ``zero/``."""
    yield "zero/optimizer_state.pt", *_optimizer_state(source)
    for name, items in _param_files(source):
        for key, obj, skeleton in items:
            yield f"zero/{name}/{key}.pt", obj, skeleton


def _write_latest(out: Path) -> None:
    staged = out.parent / f".{LATEST}.tmp-{os.getpid()}"
    try:
        staged.write_text(out.name)
        os.replace(staged, out.parent / LATEST)
    except OSError as e:
        raise ExportError(f"cannot write {LATEST}: {os_error(e)}", out.parent / LATEST) from e


def _optimizer_state(source: Source) -> tuple[dict, Skeleton]:
    """What DeepSpeed's universal loader reads besides the parameters: loss scaling, clipping, the
    version, the step (stage 3) and the param groups; none of the partitioned tensors."""
    first = source.ckpt.optim_states[0]
    osd = first.raw[keys.OPTIMIZER_STATE_DICT]
    sk = source.new_file()
    if source.ckpt.stage == 3:
        inner = osd[keys.ZERO3_INNER]
        states = group_states(first, 3)
        reduced = {keys.STATE: {i: {k: source.copy(v, first.path, f"state.{k}", sk) for k, v in s.items()
                                 if not (isinstance(v, torch.Tensor) and v.dim() > 0)}
                             for i, (_, s) in enumerate(states)},
                   keys.PARAM_GROUPS: source.copy(inner[keys.PARAM_GROUPS], first.path, keys.PARAM_GROUPS, sk)}
        out = {k: _global(source, first, k, v, sk) for k, v in osd.items() if k != keys.ZERO3_FLAT}
        out[keys.ZERO3_INNER] = reduced
        out[keys.PARAM_GROUPS] = reduced[keys.PARAM_GROUPS]
    else:
        out = {k: _global(source, first, k, v, sk) for k, v in osd.items() if k not in _SHARDED}
        out[keys.PARAM_GROUPS] = source.copy(osd[keys.ZERO12_INNER][keys.PARAM_GROUPS], first.path,
                                          keys.PARAM_GROUPS, sk)
    return out, sk


def _global(source: Source, first, key, value, sk: Skeleton):
    if key == keys.ZERO_STAGE:
        return ds_pickle.ZeroStageEnum(int(value))
    return source.copy(value, first.path, str(key), sk)


def _param_files(source: Source):
    """(folder name, [(file stem, object, skeleton)]) per parameter, frozen param and buffer."""
    ckpt = source.ckpt
    stage3 = ckpt.stage == 3
    steps = _steps(source)
    for name, master in source.masters.items():
        items = []
        for key, tp in [("fp32", master)] + [(k, plans[name]) for k, plans in source.moments.items()]:
            sk = source.new_file()
            items.append((key, _param_obj(tp, sk, flat=stage3), sk))
        if name in steps:
            sk = source.new_file()
            where, value = steps[name]
            items.append(("step", source.copy(value, where, "step", sk), sk))
        yield name, items
    for name, tp in _module_entries(source).items():
        sk = source.new_file()
        yield name, [("fp32", _param_obj(tp, sk, flat=False), sk)]


def _param_obj(tp: TensorPlan, sk: Skeleton, flat: bool):
    if flat:  # DeepSpeed's tool writes stage-3 states as bare flattened tensors
        return sk.tensor(concat(tp.name, tp.numel, tp.out_dtype, [(tp, 0, tp.numel, 0)]))
    return {"param": sk.tensor(tp), "cat_dim": 0}


def _module_entries(source: Source) -> dict[str, TensorPlan]:
    """Frozen params and buffers, each whole, in the dtype the checkpoint holds them."""
    plan = build_plan(source.ckpt, source.table, None)
    return {n: tp for n, tp in plan.tensors.items() if tp.kind in (FROZEN, BUFFER)}


def _steps(source: Source) -> dict[str, tuple[Path, torch.Tensor]]:
    """Each trainable parameter's scalar ``step``, from the flat group that holds it on rank 0."""
    ckpt = source.ckpt
    first = ckpt.optim_states[0]
    states = group_states(first, ckpt.stage)
    out = {}
    for g, shapes in enumerate(ckpt.meta.param_shapes):
        if g >= len(states):
            break
        step = states[g][1].get("step")
        if step is None:
            continue
        for name in shapes:
            out[name] = (first.path, step)
    return out


def universal_module_state(universal_dir: str | os.PathLike) -> "OrderedDict[str, torch.Tensor]":
    """The frozen params and buffers of a universal checkpoint written by :func:`to_universal`.

    DeepSpeed's engine skips the module state when it loads a universal checkpoint, so these stay
    as the model was built. Put them back after ``engine.load_checkpoint``::

        state = zerofast.universal_module_state(folder)
        frozen = [p for n, p in engine.module.named_parameters() if n in state]
        with deepspeed.zero.GatheredParameters(frozen, modifier_rank=0):  # ZeRO-3; a no-op otherwise
            engine.module.load_state_dict(state, strict=False)
    """
    folder = Path(universal_dir)
    meta = _meta(folder)
    names = list(meta.buffer_names)
    trainable = {n for g in meta.param_shapes or [] for n in g}
    frozen = list(meta.frozen_param_shapes or {})
    if not frozen:  # stage 1 records no frozen shapes; its frozen weights are module entries
        frozen = [n for n in meta.module if n not in trainable and n not in meta.shared_params and n not in names]
    out = OrderedDict()
    for name in frozen + names:
        path = folder / "zero" / name / "fp32.pt"
        if path.is_file():
            out[name] = torch.load(path, weights_only=True)["param"]
    return out


def _meta(folder: Path) -> ModelStates:
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if (folder / name).is_file():
            return read_model_states(folder / name)
    raise UnsupportedCheckpointError("expected the model-states file of a universal checkpoint", folder)
