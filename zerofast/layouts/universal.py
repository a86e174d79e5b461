"""Universal checkpoints (``python -m deepspeed.checkpoint.ds_to_universal``).

Claimed by its ``zero`` folder next to the model states. A universal folder keeps copies of the model-states files and, in place of the partitioned
optimizer files, ``zero/<param>/<state>.pt``: each trainable parameter's fp32 master (``fp32``)
and per-element optimizer states (``exp_avg``, ...) whole, plus ``step``. From a ZeRO-1/2 save
each file is ``{'param': tensor of the parameter's shape, 'cat_dim': 0}``; from a ZeRO-3 save
it is the bare tensor, flattened (a tensor-parallel save's: the dict, at every stage). Only
trainable parameters are planned from these files.
Frozen parameters and buffers are read from the copied model states exactly as for the save
they were converted from: ds_to_universal writes ``fp32.pt`` for them too at stages 1-2, but
cast to float32, which rounds int64 buffers above 2**24 and loses every dtype, while the model
states hold the original values.

The universal folder of a tensor- or pipeline-parallel save keeps every model-parallel rank's
model states: :mod:`.universal_parallel` reads them as the family's layout reads the training
save, and joins the frozen shards by the same rules.

Each file is unpickled by the same restricted loader (:func:`zerofast.load.load_file`) with its
tensor memory-mapped, and every tensor becomes one source of one plan, so the native executor
reads each once.
"""
from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..base import keys as K
from ..discover import Found, other_model_parallel_rank, plain_files, zero3_model_file_name
from ..base.errors import (CorruptCheckpointError, IncompleteCheckpointError, InconsistentCheckpointError,
                      MissingOptimizerStateError, some)
from ..load import LoadedCheckpoint, OptimStates, PartitionedCheckpoint, load_file
from ..load.records import (agree_with_config, check_parallelism, expect_dict, expect_int, no_stray_model_files,
                            read_model_states, some_of)
from ..plan import optimizer
from ..plan.build import plain_plan
from ..plan.columns import EntryTable
from ..plan.model import Entry, Plan, SourceTable
from ..plan.partitioned import partitioned_plan
from . import universal_parallel
from .base import Layout
from .pipeline import PIPE_LAYER, PipelineFiles

UNIVERSAL_DIR = "zero"  # ds_to_universal's per-parameter folders, next to the model states
UNIVERSAL_COMMON = "optimizer_state.pt"  # in UNIVERSAL_DIR: the optimizer state all ranks share

MASTER = "fp32"
SCALARS = ("step",)  # per-parameter files that hold no per-element state
RULE_FIELDS = ("cat_dim", "param_n_sub_params", "vocab_tensor")  # what ds_to_universal records of a tp rule


@dataclass(frozen=True)
class UniversalFiles(PipelineFiles):
    """``model_files`` in global-rank order, every model-parallel rank's; ``layer_files`` and
    ``mp_size`` as for a pipeline (a pipeline's layer files where they were copied in)."""

    zero_dir: Path | None = None  # the ``zero`` folder of per-parameter files
    parallel: bool = False  # files of model-parallel ranks > 0, or layer files: read by universal_parallel
    incomplete: str | None = None  # a rank grid found incomplete, raised once the folder is known parallel

    def paths(self) -> tuple[Path, ...]:
        return super().paths() + (self.zero_dir,)


@dataclass
class UniversalState:
    """The ``zero`` folder: one folder of files per parameter, and the optimizer's common state."""

    zero_dir: Path
    optimizer_state: dict  # zero/optimizer_state.pt: zero_stage, param_groups, ...
    shapes: dict = None  # each trainable parameter's shape in its files (the full one), param_shapes order
    groups: list = None  # the names of each optimizer param group
    fields: dict | None = None  # a tensor-parallel save's: the rule fields each parameter's files must hold

    @property
    def common_path(self) -> Path:
        return self.zero_dir / UNIVERSAL_COMMON


@dataclass
class UniversalCheckpoint(LoadedCheckpoint):
    state: UniversalState | None = None


@dataclass
class ParallelUniversalCheckpoint(PartitionedCheckpoint):
    """A tensor- or pipeline-parallel save's universal folder, read as its family reads the save."""

    state: UniversalState | None = None


class UniversalLayout(Layout):
    name = "universal"
    title = "a universal conversion"
    subsumes = ("moe", "pipeline", "autotp")  # it keeps the source's names; its loader judges them

    def claims(self, found: Found) -> str | None:
        return UNIVERSAL_DIR if (found.tag_dir / UNIVERSAL_DIR).is_dir() else None

    def list_files(self, found: Found) -> UniversalFiles:
        model_files, optim_files = plain_files(found)
        if optim_files:
            raise IncompleteCheckpointError(
                f"expected either optimizer files (a DeepSpeed save) or a {UNIVERSAL_DIR!r} folder (a universal "
                f"checkpoint), found both ({optim_files[0].name}): the folder mixes two saves", found.tag_dir)
        zero_dir = found.tag_dir / UNIVERSAL_DIR
        if other_model_parallel_rank(found.names) is None and not any(PIPE_LAYER.match(n) for n in found.names):
            return UniversalFiles(found.root, found.tag, found.tag_dir, model_files, (), layout=self, zero_dir=zero_dir)
        models, layers, mp_size, incomplete = universal_parallel.list_files(found)
        return UniversalFiles(found.root, found.tag, found.tag_dir, models, (), layout=self, layer_files=layers,
                              mp_size=mp_size, zero_dir=zero_dir, parallel=True, incomplete=incomplete)

    def load(self, files: UniversalFiles) -> UniversalCheckpoint | ParallelUniversalCheckpoint:
        return _load(files)

    def plan(self, ckpt: UniversalCheckpoint | ParallelUniversalCheckpoint, table: SourceTable,
             dtype: torch.dtype | None, exclude_frozen: bool) -> Plan:
        if isinstance(ckpt, ParallelUniversalCheckpoint):
            composed = universal_parallel.stored_entries(ckpt, table, exclude_frozen)
            return partitioned_plan(ckpt, table, dtype, exclude_frozen, trainable(ckpt, table), composed)
        return plain_plan(ckpt, table, dtype, exclude_frozen, trainable(ckpt, table))

    def optimizer_keys(self, ckpt: UniversalCheckpoint) -> list[str]:
        return state_keys(ckpt)

    def optimizer_entries(self, ckpt: UniversalCheckpoint, table: SourceTable, keys) -> dict[str, dict[str, Entry]]:
        """Each state is kept whole in ``zero/<param>/<key>.pt``."""
        available = state_keys(ckpt)
        for key in keys:
            if key not in available:
                raise MissingOptimizerStateError(
                    f"optimizer state {key!r} has no file in the parameters' folders; per-element states here: "
                    f"{available}", ckpt.state.zero_dir)
        return {key: trainable(ckpt, table, key) for key in keys}

    def optimizer_groups(self, ckpt: UniversalCheckpoint) -> list[dict]:
        """One entry: a universal folder keeps each state per parameter, not per group."""
        return [{"name": None, "flat_groups": 0, "params": None, "keys": state_keys(ckpt)}]

    def refuse_unplaced(self, ckpt: UniversalCheckpoint, placed, writer: str) -> None:
        """Nothing here is partitioned: every state is a whole tensor in its own file."""

    def scalar_states(self, ckpt: UniversalCheckpoint) -> dict:
        states, groups = scalar_states(ckpt)
        order = optimizer.model_order(ckpt, states)
        return {"state": {name: optimizer.scalars(states[name]) for name in order},
                "param_groups": [{**optimizer.hyperparameters(group), K.PARAMS: [n for n in order if n in names]}
                                 for group, names in groups]}


def _load(files: UniversalFiles) -> UniversalCheckpoint | ParallelUniversalCheckpoint:
    """Copies of the model states, and per-parameter files in place of the optimizer files. The
    stage comes from the files as well: per-rank model states mean a ZeRO-3 source, and the
    optimizer's common state records the stage it was saved at."""
    meta = read_model_states(files.model_files[0], module_optional=files.parallel)
    path = files.zero_dir / UNIVERSAL_COMMON
    if not path.is_file():
        raise IncompleteCheckpointError(
            f"expected {path.name} in the universal checkpoint's {files.zero_dir.name!r} folder, found none",
            path.parent)
    common = expect_dict(path, load_file(path), "the universal optimizer state")
    recorded = common.get(K.ZERO_STAGE)
    recorded = None if recorded is None else expect_int(path, recorded, "'zero_stage'")
    # As in the source's own files, DeepSpeed's BF16_Optimizer (stage 1) records no stage.
    stage = 3 if files.partitioned_model_states else (1 if recorded is None else recorded)
    if stage not in (1, 2, 3) or (recorded is not None and recorded != stage):
        raise InconsistentCheckpointError(
            f"expected zero_stage {'3' if files.partitioned_model_states else '1 or 2'} next to "
            f"{'per-rank model-states files' if files.partitioned_model_states else files.model_files[0].name}, "
            f"found {recorded}", path)
    if meta.param_shapes is None:
        raise InconsistentCheckpointError("expected 'param_shapes' in a universal checkpoint's model states, found None",
                                          meta.path)
    agree_with_config(files, meta, stage, "the universal checkpoint's files")
    state = UniversalState(files.zero_dir, common)
    if files.parallel:
        pp, _ = universal_parallel.degrees(files, meta)
        models = [meta] if pp > 1 else [meta] + [read_model_states(p) for p in files.model_files[1:]]
        ckpt = ParallelUniversalCheckpoint(files, stage, 0, models, [], state=state)
        state.shapes, state.groups, state.fields = universal_parallel.read(ckpt, pp)
        return ckpt
    check_parallelism(meta, universal=True)
    models = [meta] + [read_model_states(p) for p in files.model_files[1:]]
    state.shapes = {name: shape for group in meta.param_shapes for name, shape in group.items()}
    state.groups = [list(group) for group in meta.param_shapes]
    world = int(meta.dp_world_size or len(models))
    if stage == 3:
        no_stray_model_files(files, world)
        missing = [(r, zero3_model_file_name(r)) for r in range(len(models), min(world, len(models) + 4))]
        if missing:
            raise IncompleteCheckpointError(
                f"dp_world_size is {world} but only {len(models)} model-states files are present; missing: "
                f"{some_of(missing, world - len(models))}", files.tag_dir)
    return UniversalCheckpoint(files, stage, world, models, [], state)


def trainable(ckpt: LoadedCheckpoint, table: SourceTable, key: str = MASTER) -> EntryTable:
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
        where, tensor = _read(ckpt, paths[name], shape, None if u.fields is None else u.fields.get(name, {}))
        src = table.add(str(paths[name]), where, tensor)
        out[name] = (shape, tensor.dtype, [(src, 0, 0, tensor.numel())])
    return EntryTable.of_entries(out)


def trainable_shapes(ckpt: LoadedCheckpoint) -> dict[str, tuple[int, ...]]:
    """Each trainable parameter's shape in its files: the full one, where the save held shards."""
    return _state(ckpt).shapes


def param_dir(u: UniversalState, name: str) -> Path:
    """The folder of parameter ``name``; a name from the pickle must not lead out of ``zero``."""
    if not name or name in (".", "..") or "/" in name or "\0" in name or os.sep in name:
        raise CorruptCheckpointError(f"expected parameter names usable as folder names, found {name!r:.80}",
                                     u.zero_dir)
    return u.zero_dir / name


def _read(ckpt: LoadedCheckpoint, path: Path, shape: tuple[int, ...], fields: dict | None) -> tuple[str, torch.Tensor]:
    """The tensor of one per-parameter file, checked against the parameter's recorded shape (and,
    from a tensor-parallel save, the fields of the rule that joins its shards)."""
    obj = load_file(path)
    if ckpt.stage == 3 and not ckpt.files.parallel:  # a tensor-parallel source's files are dicts at ZeRO-3 too
        where, tensor, layout = "", obj, f"a bare 1-D tensor of {math.prod(shape)} elements (ZeRO-3 source)"
        ok = isinstance(tensor, torch.Tensor) and tensor.dim() == 1 and tensor.numel() == math.prod(shape)
    else:
        where, tensor, layout = "['param']", obj.get("param") if isinstance(obj, dict) else obj, \
            f"{{'param': tensor of shape {shape}}} ({'model-parallel' if ckpt.files.parallel else 'ZeRO-1/2'} source)"
        ok = isinstance(obj, dict) and isinstance(tensor, torch.Tensor) and tuple(tensor.shape) == tuple(shape)
    if not ok:
        found = (f"{'a dict holding a' if isinstance(obj, dict) else 'a bare'} {tensor.dtype} tensor of shape "
                 f"{tuple(tensor.shape)}" if isinstance(tensor, torch.Tensor) else type(obj).__name__)
        raise InconsistentCheckpointError(f"expected {layout}, as 'param_shapes' records, found {found}", path)
    if not tensor.is_floating_point():
        raise CorruptCheckpointError(f"expected a floating-point tensor, found {tensor.dtype}", path)
    if fields is not None:  # the frozen shards are joined by these rules: the converter must have used them too
        want, found = ({k: d[k] for k in RULE_FIELDS if k in d} for d in (fields, obj))
        if want != found:
            raise InconsistentCheckpointError(
                f"expected the fields {want} of the tensor-parallel rule the model states (or the rules given) name "
                f"for this parameter, found {found}: ds_to_universal joined it by another rule", path)
    return where, tensor


def _state(ckpt: "UniversalCheckpoint") -> "UniversalState":
    return ckpt.state


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
    if not isinstance(groups, (list, tuple)) or len(groups) != len(u.groups) or \
            not all(isinstance(g, dict) for g in groups):
        return states, []
    return states, [(g, list(names)) for g, names in zip(groups, u.groups)]


def _zero3_rank0_states(ckpt: LoadedCheckpoint) -> dict[str, dict] | None:
    """A ZeRO-3 source leaves no ``step.pt``; ``zero/optimizer_state.pt`` is rank 0's optimizer
    dict, whose state per sub-group holds it. Rank 0 holds the first ceil(n/W) elements of every
    parameter, so walking ``param_shapes`` over its flat groups finds each parameter's sub-group (of
    a tensor-parallel save: tp rank 0's shards, over its W data-parallel ranks)."""
    u = _state(ckpt)
    common = u.optimizer_state
    flats = common.get(K.ZERO3_FLAT)
    if not isinstance(flats, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in flats):
        return None
    path = u.common_path
    groups = optimizer.group_states(OptimStates(path, 3, None, list(flats), None, {K.OPTIMIZER_STATE_DICT: common}), 3)
    ends = list(itertools.accumulate(t.numel() for t in flats))
    out, offset = {}, 0
    ranks = ckpt.world_size // ckpt.files.mp_size
    for name, shape in ((n, s) for g in ckpt.meta.param_shapes for n, s in g.items()):
        g = next((g for g, end in enumerate(ends) if end > offset), None)
        if g is None or g >= len(groups):
            raise InconsistentCheckpointError(
                f"'param_shapes' places {name!r} at element {offset} of rank 0's flat groups, which hold "
                f"{ends[-1] if ends else 0}",
                path)
        out[name] = groups[g][1]
        offset += math.ceil(math.prod(shape) / ranks)
    return out


LAYOUT = UniversalLayout()
