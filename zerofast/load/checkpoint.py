"""Typed views of the checkpoint files, read without running code and without importing DeepSpeed.

Each file's zip directory is checked by :mod:`.archive`, then unpickled by
:mod:`.unpickle`: the C unpickler, resolving only allowlisted globals (DeepSpeed's
classes become the inert stand-ins of :mod:`.stand_ins`) and refusing every other one
while unpickling, before anything is built. Tensors are memory-mapped, so the large ones (fp32
masters, Adam moments) are not read here at all. The metadata planning relies on is
type-checked here, with the file in hand.
"""
from __future__ import annotations

import itertools
import math
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..discover import CheckpointFiles
from ..plan import keys as K
from ..errors import (
    CorruptCheckpointError,
    IncompleteCheckpointError,
    InconsistentCheckpointError,
    UnsafeCheckpointError,
    UnsupportedCheckpointError,
    ZeroFastError,
    few,
    first_line,
    short_repr,
)
from .pickle_bounds import BoundsExceeded
from .stand_ins import RefusedState
from .unpickle import Refused, load_archive

def load_file(path: Path) -> Any:
    """Unpickle one ``torch.save`` file with memory-mapped tensors and only allowlisted globals."""
    try:
        return load_archive(path)
    except Refused as e:
        raise UnsafeCheckpointError(
            f"refused pickle global {e.global_name!r}: DeepSpeed checkpoints do not need it; nothing was executed",
            path) from None
    except RefusedState as e:
        raise UnsafeCheckpointError(
            f"refused pickle global {e.global_name!r}: {e.reason}; nothing was executed", path) from None
    except BoundsExceeded as e:
        raise UnsafeCheckpointError(f"refused data.pkl: {e}; nothing was executed", path) from None
    except RecursionError:
        raise UnsafeCheckpointError("refused data.pkl: its objects nest too deeply; nothing was executed",
                                    path) from None
    except ZeroFastError:
        raise
    # A malformed pickle fails inside the unpickler or a rebuild function with any of these (bad
    # opcodes, bad arguments, a storage too small for its tensor, ...).
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError, TypeError, IndexError, KeyError,
            AttributeError, AssertionError, struct.error, UnicodeDecodeError, OverflowError, MemoryError) as e:
        raise CorruptCheckpointError(f"expected a valid pickle in data.pkl, got: {first_line(e)}", path) from None


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


@dataclass
class LoadedCheckpoint:
    files: CheckpointFiles
    stage: int
    world_size: int
    model_states: list[ModelStates]
    optim_states: list[OptimStates]

    @property
    def meta(self) -> ModelStates:
        """Rank 0's model states: the metadata every rank repeats."""
        return self.model_states[0]

    @property
    def ds_version(self) -> str | None:
        return self.meta.raw.get(K.DS_VERSION)


def load_checkpoint(files: CheckpointFiles) -> LoadedCheckpoint:
    """Read every file of one save and settle its stage and world size."""
    model_states = [_model_states(p) for p in files.model_files]
    optim_states = [_optim_states(p) for p in files.optim_files]
    _check_parallelism(model_states[0])
    stage = _stage(files, model_states, optim_states)
    world_size = _world_size(files, stage, model_states, optim_states)
    _check_flat_groups(stage, optim_states)
    return LoadedCheckpoint(files, stage, world_size, model_states, optim_states)


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value  # not ``or``: the truth of a tensor raises


def _keys(mapping: dict) -> str:
    shown = sorted(str(k)[:40] if isinstance(k, str) else short_repr(k, 40) for k in itertools.islice(mapping, 12))
    return str(shown) if len(mapping) <= 12 else f"{str(shown)[:-1]}, ... ({len(mapping)} in all)]"


def _expect_dict(path: Path, obj: Any, what: str) -> dict:
    if not isinstance(obj, dict):
        raise CorruptCheckpointError(f"expected {what} to be a dict, found {type(obj).__name__}", path)
    return obj


# The pickle decides every type below. Each is checked here, where the file is known, so that
# planning never meets a string where it expects an int (and never fails with a bare TypeError).

def _expect_list(path: Path, obj: Any, what: str) -> list:
    if not isinstance(obj, (list, tuple)):
        raise CorruptCheckpointError(f"expected {what} to be a list, found {type(obj).__name__}", path)
    return list(obj)


def _expect_int(path: Path, obj: Any, what: str, minimum: int = 0) -> int:
    if type(obj) is not int or obj < minimum:  # bool is an int to Python, never to DeepSpeed
        raise CorruptCheckpointError(f"expected {what} to be an int >= {minimum}, found {short_repr(obj)}", path)
    return obj


def _expect_names(path: Path, obj: Any, what: str) -> list[str]:
    names = _expect_list(path, obj, what)
    for n in names:
        if not isinstance(n, str):
            raise CorruptCheckpointError(f"expected {what} to hold names (str), found {type(n).__name__}", path)
    return names


def _expect_mapping(path: Path, obj: Any, what: str, value_type: type, value_what: str) -> dict:
    mapping = _expect_dict(path, obj, what)
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
    if not isinstance(value, (tuple, list)) or len(value) > 64 \
            or not all(type(d) is int and 0 <= d <= INT64_MAX for d in value) \
            or math.prod(d or 1 for d in value) > INT64_MAX:
        raise InconsistentCheckpointError(
            f"expected a shape (at most 64 non-negative ints, product below 2**63) for {short_repr(name)}, found "
            f"{short_repr(value)}", path)
    return tuple(value)


def _shapes(path: Path, mapping: Any, what: str) -> dict[str, tuple[int, ...]]:
    return {name: _shape(path, name, s) for name, s in _expect_mapping(path, mapping, what, object, "shapes").items()}


def _model_states(path: Path) -> ModelStates:
    raw = _expect_dict(path, load_file(path), "the model-states file")
    if K.MODULE not in raw:
        raise CorruptCheckpointError(f"expected a 'module' entry, found keys {_keys(raw)}", path)
    module = _expect_mapping(path, raw[K.MODULE], "'module'", object, "tensors")
    for name, value in module.items():
        if not isinstance(value, torch.Tensor):
            raise UnsupportedCheckpointError(
                f"expected every 'module' entry to be a tensor, found a {type(value).__name__} for {short_repr(name)} "
                "(non-tensor extra state is not supported yet)", path)
    shapes = raw.get(K.PARAM_SHAPES)
    if shapes is not None:
        if isinstance(shapes, dict):  # very old DeepSpeed saved a single group unwrapped
            shapes = [shapes]
        shapes = [_shapes(path, g, "a 'param_shapes' group") for g in _expect_list(path, shapes, "'param_shapes'")]
    frozen = raw.get(K.FROZEN_PARAM_SHAPES)
    dp_world_size = raw.get(K.DP_WORLD_SIZE)
    return ModelStates(
        path=path,
        module=module,
        buffer_names=_expect_names(path, _default(raw.get(K.BUFFER_NAMES), []), "'buffer_names'"),
        param_shapes=shapes,
        frozen_param_shapes=None if frozen is None else _shapes(path, frozen, "'frozen_param_shapes'"),
        frozen_param_fragments=dict(_expect_mapping(path, _default(raw.get(K.FROZEN_PARAM_FRAGMENTS), {}),
                                                    "'frozen_param_fragments'", torch.Tensor, "tensors")),
        shared_params=dict(_expect_mapping(path, _default(raw.get(K.SHARED_PARAMS), {}), "'shared_params'", str,
                                           "names")),
        dp_world_size=None if dp_world_size is None else _expect_int(path, dp_world_size, "'dp_world_size'", 1),
        raw=raw,
    )


def _optim_states(path: Path) -> OptimStates:
    raw = _expect_dict(path, load_file(path), "the optimizer-states file")
    osd = _expect_dict(path, raw.get(K.OPTIMIZER_STATE_DICT), "'optimizer_state_dict'")
    key = next((k for k in (K.ZERO3_FLAT, K.ZERO12_FLAT) if k in osd), None)
    if key is None:
        raise CorruptCheckpointError(
            "expected 'fp32_flat_groups' (stage 3) or 'single_partition_of_fp32_groups' (stages 1-2) in "
            f"'optimizer_state_dict', found keys {_keys(osd)}", path)
    groups = _expect_list(path, osd[key], f"{key!r}")
    for i, g in enumerate(groups):
        if not isinstance(g, torch.Tensor) or g.dim() != 1 or not g.is_floating_point():
            found = f"a {g.dim()}-D {g.dtype} tensor" if isinstance(g, torch.Tensor) else type(g).__name__
            raise CorruptCheckpointError(f"expected {key}[{i}] to be a 1-D floating-point tensor, found {found}",
                                         path)
    count = osd.get(K.PARTITION_COUNT)
    if isinstance(count, (list, tuple)):
        counts = {_expect_int(path, c, "each 'partition_count'", 1) for c in count}
        if len(counts) > 1:
            # Expert (MoE) groups are partitioned over their own, smaller data-parallel group; the
            # flat buffers of those groups do not follow the dense layout.
            raise UnsupportedCheckpointError(
                f"mixture-of-experts checkpoints are not supported yet (per-group partition_count {list(count)})",
                path)
        count = counts.pop() if counts else None
    stage = osd.get(K.ZERO_STAGE)
    pads = osd.get(K.ALIGNMENT_PADDINGS)
    if pads is not None:
        pads = [_expect_list(path, g, "a 'param_alignment_paddings' group")
                for g in _expect_list(path, pads, "'param_alignment_paddings'")]
        for g in pads:
            for p in g:
                _expect_int(path, p, "each 'param_alignment_paddings' entry")
    return OptimStates(
        path=path,
        zero_stage=None if stage is None else _expect_int(path, stage, "'zero_stage'"),
        partition_count=None if count is None else _expect_int(path, count, "'partition_count'", 1),
        flat_groups=groups,
        param_alignment_paddings=pads,
        raw=raw,
    )


_KNOWN_STAGES = (0, 1, 2, 3)


def _stage(files: CheckpointFiles, models: list[ModelStates], optims: list[OptimStates]) -> int:
    if not optims:
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


def _world_size(files: CheckpointFiles, stage: int, models: list[ModelStates], optims: list[OptimStates]) -> int:
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
        return found
    recorded = int(recorded)
    if recorded < found:
        strays = [p.name for p in files.optim_files[recorded:]]
        raise IncompleteCheckpointError(
            f"partition_count is {recorded} but {found} rank files are present; stray files from another save: "
            f"{few(strays)}", files.tag_dir)
    if recorded > found:
        raise IncompleteCheckpointError(
            f"partition_count is {recorded} but only {found} optimizer rank files are present (ranks "
            f"{found}..{recorded - 1} missing)", files.tag_dir)
    return recorded


def _check_parallelism(meta: ModelStates) -> None:
    """Only the model-parallel rank 00 files are read; a save with tensor or pipeline parallelism
    has more, and they may simply be missing from this folder (so discovery cannot see them)."""
    dims = meta.raw.get(K.PARALLEL_DIMENSIONS)
    dims = dims if isinstance(dims, dict) else {}
    for what, degree, kind in (("mp_world_size", meta.raw.get(K.MP_WORLD_SIZE), "tensor-parallel"),
                               ("tp_degree", dims.get("tp_degree"), "tensor-parallel"),
                               ("pp_degree", dims.get("pp_degree"), "pipeline-parallel")):
        if degree is not None and not (type(degree) is int and degree == 1):
            raise UnsupportedCheckpointError(
                f"{kind} checkpoints are not supported yet (expected {what} 1, found {short_repr(degree, 40)})", meta.path)


def _check_flat_groups(stage: int, optims: list[OptimStates]) -> None:
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
