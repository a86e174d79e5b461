"""Typed views of the checkpoint files, read without running code and without importing DeepSpeed.

Each file's zip directory is checked by :mod:`.archive`, then unpickled by
:mod:`.unpickle`: the C unpickler, resolving only allowlisted globals (DeepSpeed's
classes become the inert stand-ins of :mod:`.stand_ins`) and refusing every other one
while unpickling, before anything is built. Tensors are memory-mapped, so the large ones (fp32
masters, Adam moments) are not read here at all. The metadata planning relies on is
type-checked here, with the file in hand.
"""
from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..discover import CheckpointFiles, optim_file_name, zero3_model_file_name
from ..base import keys as K
from ..native import ops
from ..base.errors import (
    CorruptCheckpointError,
    IncompleteCheckpointError,
    InconsistentCheckpointError,
    UnsupportedCheckpointError,
    few,
    short_repr,
    some,
)
from .bulk_checks import all_instances, all_shapes
from .reader import load_file

# ---------------------------------------------------------------------------------------------
# Typed views of the two kinds of file. Only what planning needs is lifted out of the pickles;
# the rest stays reachable through ``raw`` for tools that want it (inspect, optimizer states).

@dataclass
class ModelStates:
    path: Path
    module: dict[str, torch.Tensor]
    buffer_names: list[str]
    param_shapes: list[dict[str, tuple[int, ...]]] | None
    frozen_param_shapes: dict[str, tuple[int, ...]] | None
    frozen_param_fragments: dict[str, torch.Tensor]
    shared_params: dict[str, str]
    dp_world_size: int | None
    raw: dict


@dataclass
class OptimStates:
    path: Path
    zero_stage: int | None
    partition_count: int | None
    flat_groups: list[torch.Tensor]
    param_alignment_paddings: list[list[int]] | None
    raw: dict


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value  # not ``or``: the truth of a tensor raises


def _keys(mapping: dict) -> str:
    shown = sorted(str(k)[:40] if isinstance(k, str) else short_repr(k, 40) for k in itertools.islice(mapping, 12))
    return str(shown) if len(mapping) <= 12 else f"{str(shown)[:-1]}, ... ({len(mapping)} in all)]"


def expect_dict(path: Path, obj: Any, what: str) -> dict:
    if not isinstance(obj, dict):
        raise CorruptCheckpointError(f"expected {what} to be a dict, found {type(obj).__name__}", path)
    return obj


# The pickle decides every type below. Each is checked here, where the file is known, so that
# planning never meets a string where it expects an int (and never fails with a bare TypeError).

def expect_list(path: Path, obj: Any, what: str) -> list:
    if not isinstance(obj, (list, tuple)):
        raise CorruptCheckpointError(f"expected {what} to be a list, found {type(obj).__name__}", path)
    return list(obj)


def expect_int(path: Path, obj: Any, what: str, minimum: int = 0) -> int:
    if type(obj) is not int or obj < minimum:  # bool is an int to Python, never to DeepSpeed
        raise CorruptCheckpointError(f"expected {what} to be an int >= {minimum}, found {short_repr(obj)}", path)
    return obj


def _expect_names(path: Path, obj: Any, what: str) -> list[str]:
    names = expect_list(path, obj, what)
    for n in names:
        if not isinstance(n, str):
            raise CorruptCheckpointError(f"expected {what} to hold names (str), found {type(n).__name__}", path)
    return names


def expect_mapping(path: Path, obj: Any, what: str, value_type: type, value_what: str) -> dict:
    mapping = expect_dict(path, obj, what)
    if all_instances(mapping, str) and (value_type is object or all_instances(mapping.values(), value_type)):
        return mapping
    for k, v in mapping.items():
        if not isinstance(k, str) or not isinstance(v, value_type):
            raise CorruptCheckpointError(
                f"expected {what} to map names (str) to {value_what}, found {type(k).__name__} -> "
                f"{type(v).__name__} for {short_repr(k)}", path)
    return mapping


INT64_MAX = 2 ** 63 - 1


def _shape(path: Path, name: str, value: Any) -> tuple[int, ...]:
    # Dims and their product must fit int64, as in torch: a zero-element shape could otherwise
    # carry a dim of 2**64 into an output file's header.
    # A plain loop, no generators: this runs once per parameter of files with tens of thousands.
    if isinstance(value, (tuple, list)) and len(value) <= 64:
        product = 1
        for d in value:
            if type(d) is not int or not 0 <= d <= INT64_MAX:
                break
            product *= d or 1
        else:
            if product <= INT64_MAX:
                return tuple(value)
    raise InconsistentCheckpointError(
        f"expected a shape (at most 64 non-negative ints, product below 2**63) for {short_repr(name)}, found "
        f"{short_repr(value)}", path)


def _shapes(path: Path, mapping: Any, what: str) -> dict[str, tuple[int, ...]]:
    mapping = expect_mapping(path, mapping, what, object, "shapes")
    if type(mapping) in (dict, collections.OrderedDict) and (core := ops.native_module()) is not None:
        checked = core.plain_shapes(mapping)  # the same dict in one native pass, or None: decided below
        if checked is not None:
            return checked
    if all_shapes(mapping.values()):
        return dict(zip(mapping, map(tuple, mapping.values())))
    return {name: _shape(path, name, s) for name, s in mapping.items()}


def read_model_states(path: Path, module_optional: bool = False) -> ModelStates:
    """``module_optional``: a pipeline stage's file saves ``module`` as None (its layers have files)."""
    return model_states_from(path, load_file(path), module_optional)


MAX_MODULE_DEPTH = 8  # Megatron's nesting is 3-4 deep (language_model.embedding.word_embeddings)


def _flat_module(path: Path, module: dict) -> dict:
    """Megatron-DeepSpeed saves ``module`` as its ``state_dict_for_save_checkpoint``: dicts nested
    by submodule (``{"language_model": {"embedding": {"word_embeddings": {"weight": t}}}}``), whose
    keys joined with "." are the parameters' names. Flat modules come back as they are."""
    out: dict = {}

    def walk(prefix: str, d: dict, depth: int) -> None:
        if depth > MAX_MODULE_DEPTH:
            raise UnsupportedCheckpointError(f"expected 'module' nested at most {MAX_MODULE_DEPTH} deep, found "
                                             f"deeper under {short_repr(prefix)}", path)
        for key, value in d.items():
            if type(key) is not str:
                raise CorruptCheckpointError(f"expected names as 'module' keys, found {short_repr(key)}", path)
            name = f"{prefix}.{key}" if prefix else key
            if type(value) in (dict, collections.OrderedDict):
                walk(name, value, depth + 1)
            elif name in out:
                raise CorruptCheckpointError(f"'module' names {short_repr(name)} twice once its nesting is "
                                             "joined", path)
            else:
                out[name] = value

    walk("", module, 0)
    return out


def model_states_from(path: Path, raw: Any, module_optional: bool = False) -> ModelStates:
    """The typed view of a model-states file's tree ``raw``, checked."""
    raw = expect_dict(path, raw, "the model-states file")
    if K.MODULE not in raw:
        raise CorruptCheckpointError(f"expected a 'module' entry, found keys {_keys(raw)}", path)
    found = raw[K.MODULE]
    module = expect_mapping(path, {} if found is None and module_optional else found, "'module'", object, "tensors")
    if not all_instances(module.values(), torch.Tensor):
        module = _flat_module(path, module)
    for name, value in ({} if all_instances(module.values(), torch.Tensor) else module).items():
        if not isinstance(value, torch.Tensor):
            raise UnsupportedCheckpointError(
                f"expected every 'module' entry to be a tensor, found a {type(value).__name__} for {short_repr(name)} "
                "(non-tensor extra state is not supported yet)", path)
    shapes = raw.get(K.PARAM_SHAPES)
    if shapes is not None:
        if isinstance(shapes, dict):  # very old DeepSpeed saved a single group unwrapped
            shapes = [shapes]
        shapes = [_shapes(path, g, "a 'param_shapes' group") for g in expect_list(path, shapes, "'param_shapes'")]
    frozen = raw.get(K.FROZEN_PARAM_SHAPES)
    dp_world_size = raw.get(K.DP_WORLD_SIZE)
    return ModelStates(
        path=path,
        module=module,
        buffer_names=_expect_names(path, _default(raw.get(K.BUFFER_NAMES), []), "'buffer_names'"),
        param_shapes=shapes,
        frozen_param_shapes=None if frozen is None else _shapes(path, frozen, "'frozen_param_shapes'"),
        frozen_param_fragments=dict(expect_mapping(path, _default(raw.get(K.FROZEN_PARAM_FRAGMENTS), {}),
                                                    "'frozen_param_fragments'", torch.Tensor, "tensors")),
        shared_params=dict(expect_mapping(path, _default(raw.get(K.SHARED_PARAMS), {}), "'shared_params'", str,
                                           "names")),
        dp_world_size=None if dp_world_size is None else expect_int(path, dp_world_size, "'dp_world_size'", 1),
        raw=raw,
    )


def read_optim_states(path: Path, group_counts: bool = False) -> OptimStates:
    """``group_counts``: accept a different ``partition_count`` per group (MoE expert groups are
    partitioned over fewer ranks); ``partition_count`` is then the first group's."""
    raw = expect_dict(path, load_file(path), "the optimizer-states file")
    osd = expect_dict(path, raw.get(K.OPTIMIZER_STATE_DICT), "'optimizer_state_dict'")
    key = next((k for k in (K.ZERO3_FLAT, K.ZERO12_FLAT) if k in osd), None)
    if key is None:
        raise CorruptCheckpointError(
            "expected 'fp32_flat_groups' (stage 3) or 'single_partition_of_fp32_groups' (stages 1-2) in "
            f"'optimizer_state_dict', found keys {_keys(osd)}", path)
    groups = expect_list(path, osd[key], f"{key!r}")
    for i, g in enumerate(groups):
        if not isinstance(g, torch.Tensor) or g.dim() != 1 or not g.is_floating_point():
            found = f"a {g.dim()}-D {g.dtype} tensor" if isinstance(g, torch.Tensor) else type(g).__name__
            raise CorruptCheckpointError(f"expected {key}[{i}] to be a 1-D floating-point tensor, found {found}",
                                         path)
    count = osd.get(K.PARTITION_COUNT)
    if isinstance(count, (list, tuple)):
        counts = {expect_int(path, c, "each 'partition_count'", 1) for c in count}
        if len(counts) > 1 and not group_counts:
            # Expert (MoE) groups are partitioned over their own, smaller data-parallel group; a
            # folder without expert files cannot be an MoE save, and no other layout does this.
            raise InconsistentCheckpointError(
                f"expected one partition_count for every group, found {list(count)}: a mixture-of-experts save, "
                "but the folder holds no layer_*_expert_* files", path)
        count = count[0] if count else None
    stage = osd.get(K.ZERO_STAGE)
    pads = osd.get(K.ALIGNMENT_PADDINGS)
    if pads is not None:
        pads = [expect_list(path, g, "a 'param_alignment_paddings' group")
                for g in expect_list(path, pads, "'param_alignment_paddings'")]
        for g in pads:
            for p in g:
                expect_int(path, p, "each 'param_alignment_paddings' entry")
    return OptimStates(
        path=path,
        zero_stage=None if stage is None else expect_int(path, stage, "'zero_stage'"),
        partition_count=None if count is None else expect_int(path, count, "'partition_count'", 1),
        flat_groups=groups,
        param_alignment_paddings=pads,
        raw=raw,
    )


_KNOWN_STAGES = (0, 1, 2, 3)


def configured_stage(meta: ModelStates) -> int | None:
    """The ZeRO stage the run's DeepSpeed config asked for; None when the file has no config.
    DeepSpeed's default, with no ``zero_optimization`` section, is stage 0."""
    config = meta.raw.get(K.DS_CONFIG)
    if not isinstance(config, dict):
        return None
    section = config.get("zero_optimization")
    if section is None:
        return 0
    stage = section.get("stage", 0) if isinstance(section, dict) else None
    return stage if type(stage) is int else None


def _bf16(meta: ModelStates) -> bool:
    config = meta.raw.get(K.DS_CONFIG)
    section = config.get("bf16", config.get("bfloat16")) if isinstance(config, dict) else None
    return isinstance(section, dict) and bool(section.get("enabled"))


def agree_with_config(files: CheckpointFiles, meta: ModelStates, stage: int, source: str) -> None:
    declared = configured_stage(meta)
    if declared is not None and declared != stage:
        raise InconsistentCheckpointError(
            f"the DeepSpeed config (ds_config) says ZeRO stage {declared}, but {source} hold a stage-{stage} save",
            meta.path)


def _missing_optimizer_files(files: CheckpointFiles, meta: ModelStates) -> None:
    """A ZeRO save whose optimizer files are all gone would read as stage 0: the bf16 module
    weights upcast in place of the fp32 masters. Refuse it, naming the files."""
    declared = configured_stage(meta)
    if not files.partitioned_model_states and meta.param_shapes is None and not declared:
        return
    world = meta.dp_world_size or len(files.model_files)
    bf16 = _bf16(meta)
    names = [(r, optim_file_name(r, bf16)) for r in range(min(world, 4))]  # dp_world_size is the file's
    why = f"ds_config says ZeRO stage {declared}" if declared else "'param_shapes' is recorded"
    if files.partitioned_model_states:
        why = "the model states are partitioned per rank (ZeRO-3)"
    raise IncompleteCheckpointError(
        f"expected the ZeRO optimizer files ({why}), found none; missing: {some_of(names, world)}", files.tag_dir)


def settle_stage(files: CheckpointFiles, models: list[ModelStates], optims: list[OptimStates]) -> int:
    if not optims:
        _missing_optimizer_files(files, models[0])
        return 0
    recorded = optims[0].zero_stage
    for o in optims[1:]:
        if o.zero_stage != recorded:
            raise InconsistentCheckpointError(
                f"expected zero_stage {recorded} (as in {optims[0].path.name}), found {o.zero_stage}", o.path)
    if recorded is not None and recorded not in _KNOWN_STAGES:
        raise UnsupportedCheckpointError(
            f"expected ZeRO stage 0, 1, 2 or 3, found zero_stage {recorded}: a stage zerofast does not know",
            optims[0].path)
    if files.partitioned_model_states:
        if recorded not in (None, 3):
            raise InconsistentCheckpointError(
                f"expected zero_stage 3 next to per-rank model-states files, found {recorded}", optims[0].path)
        return 3
    if recorded is None:
        # DeepSpeed's BF16_Optimizer (stage 1 with fp32 gradient accumulation) records no stage;
        # its flat fp32 partitions follow the stage-1 layout.
        return 1
    if recorded not in (1, 2):
        raise InconsistentCheckpointError(
            f"expected zero_stage 1 or 2 next to a single {files.model_files[0].name}, found {recorded}",
            optims[0].path)
    return recorded


def settle_world_size(files: CheckpointFiles, stage: int, models: list[ModelStates], optims: list[OptimStates]) -> int:
    meta = models[0]
    if stage == 0:
        return int(meta.dp_world_size or 1)
    for o in optims[1:]:
        if o.partition_count != optims[0].partition_count:
            raise InconsistentCheckpointError(
                f"expected partition_count {optims[0].partition_count} (as in {optims[0].path.name}), found "
                f"{o.partition_count}", o.path)
    recorded = optims[0].partition_count or meta.dp_world_size
    found = len(optims)
    if recorded is None:
        recorded = found
    recorded = int(recorded)
    if recorded < found:
        strays = [p.name for p in files.optim_files[recorded:]]
        raise IncompleteCheckpointError(
            f"partition_count is {recorded} but {found} rank files are present; stray files from another save: "
            f"{few(strays)}", files.tag_dir)
    bf16 = bool(files.bf16_optim_files)
    # partition_count comes from the file: list the first few missing ranks, never the range.
    missing = [(r, optim_file_name(r, bf16)) for r in range(found, min(recorded, found + 4))]
    count = recorded - found
    if stage == 3:
        no_stray_model_files(files, recorded)
        present = len(files.model_files)
        missing += [(r, zero3_model_file_name(r)) for r in range(present, min(recorded, present + 4))]
        count += recorded - present
    if missing:
        raise IncompleteCheckpointError(
            f"expected the files of {recorded} ranks (partition_count {recorded}); missing: "
            f"{some_of(sorted(missing)[:4], count)}", files.tag_dir)
    return recorded


def no_stray_model_files(files: CheckpointFiles, world: int) -> None:
    if len(files.model_files) > world:
        strays = [p.name for p in files.model_files[world:]]
        raise IncompleteCheckpointError(
            f"partition_count is {world} but {len(files.model_files)} model-states files are present; stray files "
            f"from another save: {some(strays)}", files.tag_dir)


def some_of(missing: list[tuple[int, str]], count: int) -> str:
    """The first few of ``count`` missing files, as ``some`` shows them, from a short list."""
    shown = ", ".join(name for _, name in missing)
    return shown if count <= len(missing) else f"{shown} and {count - len(missing)} more"


def check_parallelism(meta: ModelStates, universal: bool) -> None:
    """Only the model-parallel rank 00 files are read; a save with tensor or pipeline parallelism
    has more, and they may simply be missing from this folder (so discovery cannot see them)."""
    dims = meta.raw.get(K.PARALLEL_DIMENSIONS)
    dims = dims if isinstance(dims, dict) else {}
    # Pipeline first: a pipeline save's own mp_world_size may count its stages.
    for what, degree, kind in (("pp_degree", dims.get(K.PP_DEGREE), "pipeline-parallel"),
                               ("mp_world_size", meta.raw.get(K.MP_WORLD_SIZE), "tensor-parallel"),
                               ("tp_degree", dims.get(K.TP_DEGREE), "tensor-parallel")):
        if degree is None or (type(degree) is int and degree == 1):
            continue
        missing = ("the other model-parallel ranks' model-states files (mp_rank_01, ...) of this universal "
                   "conversion are missing" if universal else
                   "the layer_*-model_states.pt files of this pipeline-parallel save are missing" if kind[0] == "p"
                   else "the other tensor-parallel ranks' files of this save are missing")
        raise IncompleteCheckpointError(f"expected {what} 1 in a folder with only mp_rank_00 files, found "
                                        f"{short_repr(degree, 40)}: {missing}", meta.path)


def check_flat_groups(stage: int, optims: list[OptimStates]) -> None:
    """Every rank's flat groups share one dtype. At stages 1-2 a group's flat buffer is cut into
    equal partitions, and DeepSpeed saves them without the group's end padding: so the ranks
    hold [P, ..., P, p <= P, 0, ..., 0] elements. Any other shortfall would shift every later
    parameter, so it is refused instead."""
    if not optims or not optims[0].flat_groups:
        return
    first = optims[0]
    dtype = first.flat_groups[0].dtype
    for o in optims:
        for i, g in enumerate(o.flat_groups):
            if g.dtype != dtype:
                raise InconsistentCheckpointError(
                    f"expected every flat group in {dtype} (as {first.path.name}'s first), found {g.dtype} in group "
                    f"{i}", o.path)
        if stage in (1, 2) and len(o.flat_groups) != len(first.flat_groups):
            raise InconsistentCheckpointError(
                f"expected {len(first.flat_groups)} flat groups (as in {first.path.name}), found {len(o.flat_groups)}",
                o.path)
    if stage not in (1, 2):
        return
    for i, g0 in enumerate(first.flat_groups):
        sizes = [o.flat_groups[i].numel() for o in optims]
        for r, o in enumerate(optims):
            if sizes[r] > g0.numel() or (sizes[r] < g0.numel() and any(sizes[r + 1:])):
                raise InconsistentCheckpointError(
                    f"expected group {i}'s partition to hold {g0.numel()} elements (as in {first.path.name}), found "
                    f"{sizes[r]}; only the partitions at the end of a group may be shorter", o.path)
