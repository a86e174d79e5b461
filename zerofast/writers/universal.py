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

A pipeline save's parameters keep their ``PipelineModule`` names, its tied module written once
(from the first stage), each ``step`` taken from the stage that holds the parameter; a
tensor-parallel save's are the full tensors after the fields of their rules
(``Layout.universal_fields``; an AutoTP save's rebuilt by its ``affine_map`` have none but
``vocab_tensor``). Unlike DeepSpeed's tool it needs no ``universal_checkpoint_info``
in a data-parallel source, and it writes the frozen params and buffers at every stage and for
every layout (DeepSpeed's tool drops them at stage 3 and for pipelines, and its engine never
restores them: see :func:`universal_module_state`). Each tensor is planned by the
same builders as ``reshard`` and written through the native executor, streaming.
"""
from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..base import keys
from ..base.settings import overriding
from ..base.errors import ExportError, UnplacedOptimizerStateError, UnsupportedCheckpointError
from ..layouts import discover, load_checkpoint
from ..layouts.tp_rules import SUB_PARAM_SHAPE
from ..load import ModelStates
from ..load.records import read_model_states
from ..output.team import opening
from ..output.transaction import Folder, copy_file, os_error, writing
from ..plan import BUFFER, FROZEN, TensorPlan, build_plan
from ..plan.builders import master_flat_groups
from ..plan.optimizer import group_states, rank0_places
from . import ds_pickle
from .source import Source, Written, concat, write_checkpoint
from .torch_stream import Skeleton

if TYPE_CHECKING:
    from ..output.team import Team
    from ..output.windows import Progress

COMMAND = "to-universal"
LATEST = "latest_universal"
_SHARDED = (keys.ZERO12_INNER, keys.SLICE_MAPPINGS, keys.ZERO12_FLAT)


def to_universal(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, *, tag: str | None = None,
                 overwrite: bool = False, progress: "Progress | None" = None, team: "Team | None" = None,
                 follow_symlinks: bool | None = None, tp_rules: str | os.PathLike | dict | None = None,
                 tp_replicated: str | None = None) -> Path:
    """Write the ZeRO stage 1-3 checkpoint at ``ckpt_dir`` as a universal checkpoint in ``out_dir``
    (a tag folder: ``latest_universal`` in its parent names it). Returns ``out_dir``.

    ``overwrite``: write into a folder holding files this command did not write, replacing only
    the names it writes. ``progress(bytes_done, bytes_total)``: as for :func:`zerofast.export`.
    ``team``: the ranks sharing the files (:mod:`zerofast.output.team`); None writes them all.
    ``follow_symlinks``, ``tp_rules``, ``tp_replicated``: as for :func:`zerofast.reconstruct`."""
    with overriding(tp_rules=tp_rules, tp_replicated=tp_replicated):
        return write_universal(ckpt_dir, out_dir, tag=tag, overwrite=overwrite, progress=progress, team=team,
                               follow_symlinks=follow_symlinks).path


def write_universal(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, *, tag: str | None = None,
                    overwrite: bool = False, progress: "Progress | None" = None,
                    team: "Team | None" = None, follow_symlinks: bool | None = None) -> Written:
    """:func:`to_universal`, returning what it wrote and replaced."""
    with opening(ckpt_dir, out_dir, tag, follow_symlinks, team) as run:
        files = discover(run.ckpt_dir, run.tag, follow_symlinks=run.follow_symlinks)
        ckpt = load_checkpoint(files)
        if ckpt.stage == 0:
            raise UnsupportedCheckpointError(
                "universal checkpoints are made from ZeRO stage 1-3 saves; this is stage 0, which every world "
                "size already loads", ckpt.meta.path)
        source = Source.read(ckpt, "to-universal")
        refuse_per_group_state(source)

    def finish(folder: Folder) -> None:
        for path in files.model_files:
            copy_file(path, folder.tmp / path.name)
        with _latest(run.out):
            folder.commit([p.name for p in files.model_files] + ["zero"])

    return write_checkpoint(run.out, files, lambda: _files(source), source.executor, command=COMMAND,
                            overwrite=overwrite, finish=finish, team=run.team, progress=progress, started=run.started)


def refuse_per_group_state(source: Source) -> None:
    """DeepSpeed 0.19.8's universal loader restores the same states for every parameter, each
    sliced like its fp32 partition (stage 3: ``exp_avg`` and ``exp_avg_sq`` only, with the step
    of sub-group 0 and the hyperparameters of group 0 for all). A state kept by some param groups
    only (Muon's ``momentum_buffer`` beside Adam's moments), or laid out over whole parameters,
    would come back wrong or not at all; such saves are refused, like any value a writer cannot
    place. ``reshard`` writes them at the new world size instead."""
    first = source.ckpt.optim_states[0]
    for key, plans in source.moments.items():
        whole = source.whole.get(key)
        if whole or set(plans) != set(source.masters):
            what = (f"laid out over whole parameters in flat groups {sorted(whole)}" if whole else
                    f"kept for {len(plans)} of the {len(source.masters)} trainable parameters (its param groups only)")
            raise UnplacedOptimizerStateError(
                f"to-universal cannot place the optimizer state {key!r}: it is {what}, and DeepSpeed's universal "
                "loader restores every state for every parameter, sliced like the fp32 partition; use reshard "
                "to change the world size", first.path)


def _files(source: Source):
    """(path under the output folder, object, skeleton) of every file under ``zero/``."""
    yield "zero/optimizer_state.pt", *_optimizer_state(source)
    for name, items in _param_files(source):
        for key, obj, skeleton in items:
            yield f"zero/{name}/{key}.pt", obj, skeleton


@contextlib.contextmanager
def _latest(out: Path):
    """Stage ``latest_universal`` in the parent folder before the commit (where a full disk fails
    with nothing moved yet), and move it into place after the body (the commit). The staged file
    goes on any failure."""
    final = out.parent / LATEST
    staged = out.parent / f".{LATEST}.tmp-{os.getpid()}"
    try:
        with writing(final):
            staged.write_text(out.name)
        yield
        try:
            os.replace(staged, final)
        except OSError as e:
            raise ExportError(f"could not write this file: {os_error(e)}; the universal checkpoint is complete in "
                              f"{out.name}, only {LATEST} is missing: write it or run the command again",
                              final) from e
    finally:
        with contextlib.suppress(OSError):
            staged.unlink()


def _optimizer_state(source: Source) -> tuple[dict, Skeleton]:
    """What DeepSpeed's universal loader reads besides the parameters: loss scaling, clipping, the
    version, the step (stage 3) and the param groups; none of the partitioned tensors."""
    first = source.ckpt.optim_states[0]
    osd = first.raw[keys.OPTIMIZER_STATE_DICT]
    sk = source.new_file()
    if source.ckpt.stage == 3 and source.ckpt.layout.universal_fields(source.ckpt) is not None:
        # ds_to_universal copies a tensor-parallel save's rank-0 state whole (its flat partition and
        # moments too, though no loader reads them): the same file is written for the same save
        out = {k: _global(source, first, k, v, sk) for k, v in osd.items()}
        out[keys.PARAM_GROUPS] = source.copy(osd[keys.ZERO3_INNER][keys.PARAM_GROUPS], first.path, keys.PARAM_GROUPS, sk)
    elif source.ckpt.stage == 3:
        inner = osd[keys.ZERO3_INNER]
        states = group_states(first, 3)
        reduced = {keys.STATE: {i: {k: source.copy(v, first.path, f"state.{k}", sk) for k, v in s.items()
                                 if not (isinstance(v, torch.Tensor) and v.dim() > 0)}
                             for i, (_, s) in enumerate(states)},
                   keys.PARAM_GROUPS: source.copy(inner[keys.PARAM_GROUPS], first.path, keys.PARAM_GROUPS, sk)}
        # The inner state is replaced by its reduced copy, so it is not copied (its moments would
        # be planned into the file's skeleton for nothing, and counted in the progress total).
        out = {k: None if k == keys.ZERO3_INNER else _global(source, first, k, v, sk) for k, v in osd.items()
               if k != keys.ZERO3_FLAT}
        out[keys.ZERO3_INNER] = reduced
        out[keys.PARAM_GROUPS] = reduced[keys.PARAM_GROUPS]
    else:
        out = {k: _global(source, first, k, v, sk) for k, v in osd.items() if k not in _SHARDED}
        out[keys.PARAM_GROUPS] = _param_groups(source, first, osd[keys.ZERO12_INNER], sk)
    return out, sk


def _param_groups(source: Source, first, inner, sk: Skeleton) -> list:
    """The wrapped optimizer's param groups (stages 1-2). An elastic_checkpoint save keeps none:
    its per-group states stand in for the optimizer's state_dict, and DeepSpeed resumes it with
    the hyperparameters of the engine that loads it. The universal loader pairs the engine's
    groups with these and copies every key but ``params``, so groups holding ``params`` alone do
    the same: every state is restored, the new engine's hyperparameters are kept."""
    if isinstance(inner, (list, tuple)):
        return [{"params": [g]} for g in range(len(inner))]
    return source.copy(inner[keys.PARAM_GROUPS], first.path, keys.PARAM_GROUPS, sk)


def _global(source: Source, first, key, value, sk: Skeleton):
    if key == keys.ZERO_STAGE:
        return ds_pickle.ZeroStageEnum(int(value))
    return source.copy(value, first.path, str(key), sk)


def _param_files(source: Source):
    """(folder name, [(file stem, object, skeleton)]) per parameter, frozen param and buffer."""
    ckpt = source.ckpt
    stage3 = ckpt.stage == 3
    steps = _steps(source)
    fields = ckpt.layout.universal_fields(ckpt)  # a tensor-parallel save's: how to cut each tensor again
    if fields is not None:
        fields = {name: _as_deepspeed(f) for name, f in fields.items()}
    for name, master in source.masters.items():
        items = []
        moments = [(k, plans[name]) for k, plans in source.moments.items() if name in plans]  # its group's keys
        for key, tp in [("fp32", master)] + moments:
            sk = source.new_file()
            items.append((key, _param_obj(tp, sk, stage3, None if fields is None else fields[name]), sk))
        if name in steps and not (stage3 and fields is not None):  # ds_to_universal writes none there
            sk = source.new_file()
            where, value = steps[name]
            items.append(("step", source.copy(value, where, "step", sk), sk))
        yield name, items
    for name, tp in _module_entries(source).items():
        sk = source.new_file()
        yield name, [("fp32", _param_obj(tp, sk, False, None), sk)]


_SUBPARAM_SHAPE = "deepspeed.checkpoint.universal_checkpoint.SubparamShape"


def _as_deepspeed(fields: dict) -> dict:
    """A parameter's fields with ``sub_param_shape`` (plain data from the layout) as the
    SubparamShape object ds_to_universal pickles, which DeepSpeed's loader reads by attribute."""
    sub = fields.get(SUB_PARAM_SHAPE)
    if sub is None:
        return fields
    return {**fields, SUB_PARAM_SHAPE: ds_pickle.record_class(_SUBPARAM_SHAPE)(**sub)}


def _param_obj(tp: TensorPlan, sk: Skeleton, stage3: bool, fields: dict | None):
    """One state of one parameter, as DeepSpeed's tool writes it: for a tensor-parallel save the
    full tensor after the fields that say how to cut it again (at every stage); otherwise a bare
    flattened tensor from stage 3, ``{'param', 'cat_dim': 0}`` from stages 1-2."""
    if fields is not None:
        return {**fields, "param": sk.tensor(tp)}
    if stage3:
        return sk.tensor(concat(tp.name, tp.numel, tp.out_dtype, [(tp, 0, tp.numel, 0)]))
    return {"param": sk.tensor(tp), "cat_dim": 0}


def _module_entries(source: Source) -> dict[str, TensorPlan]:
    """Frozen params and buffers, each whole, in the dtype the checkpoint holds them."""
    plan = build_plan(source.ckpt, source.table, None)
    return {n: tp for n, tp in plan.tensors.items() if tp.kind in (FROZEN, BUFFER)}


def _steps(source: Source) -> dict[str, tuple[Path, torch.Tensor]]:
    """Each trainable parameter's scalar ``step``, as ds_to_universal takes it: from the flat group
    that holds the parameter's first element (the first rank holding a fragment of it; on tp rank
    0, and for a pipeline's tied module on its first stage). A master that is no flat group's
    (an average over tp ranks) takes the step of rank 0's group at its ``param_shapes`` place."""
    ckpt = source.ckpt
    states = [group_states(o, ckpt.stage) for o in ckpt.optim_states]
    group_of = {(str(o.path), t.data_ptr()): (r, g)
                for r, (o, groups) in enumerate(zip(ckpt.optim_states, master_flat_groups(ckpt)))
                for g, (_, t) in enumerate(groups)}
    table = source.table
    out = {}
    for name, (r, g) in rank0_places(ckpt, states).items():
        step = states[r][g][1].get("step")
        if step is not None:
            out[name] = (ckpt.optim_states[r].path, step)
    for name, master in source.masters.items():
        if not len(master.segments):
            continue
        src = min(master.segments, key=lambda seg: seg[2])[0]  # the source of the first element
        owner = group_of.get((table.files[src], table.tensors[src].data_ptr()))
        if owner is None:
            continue
        r, g = owner
        step = states[r][g][1].get("step") if g < len(states[r]) else None
        if step is not None:
            out[name] = (ckpt.optim_states[r].path, step)
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
