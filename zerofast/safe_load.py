"""Step 2: read checkpoint files without running code and without importing DeepSpeed.

Files are opened with torch's restricted (``weights_only``) unpickler. DeepSpeed's classes are
resolved to the inert stand-ins in :mod:`zerofast.stand_ins`; any other global is refused while
unpickling, before anything is built. Tensors are memory-mapped, so the large ones (fp32 masters,
Adam moments) are not read here at all.
"""
from __future__ import annotations

import pickle
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .discover import CheckpointFiles
from .errors import (
    CorruptCheckpointError,
    IncompleteCheckpointError,
    InconsistentCheckpointError,
    UnsafeCheckpointError,
    UnsupportedCheckpointError,
)
from .stand_ins import STAND_INS

# torch keeps user-allowed globals in one process-wide set; the lock stops one load's exit from
# removing the stand-ins while another thread is still unpickling.
_ALLOWLIST_LOCK = threading.Lock()
_ALLOWLIST = [(obj, name) for name, obj in STAND_INS.items()]


def load_file(path: Path) -> Any:
    """Unpickle one ``torch.save`` file with memory-mapped tensors and only allowlisted globals."""
    _check_archive(path)
    try:
        with _ALLOWLIST_LOCK, torch.serialization.safe_globals(_ALLOWLIST):
            return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as e:
        raise _classify_unpickling_error(path, e) from None
    except (RuntimeError, EOFError, ValueError, OSError) as e:
        raise CorruptCheckpointError(f"expected a readable torch.save archive, got: {_first_line(e)}", path) from e


def _check_archive(path: Path) -> None:
    if not zipfile.is_zipfile(path):
        raise CorruptCheckpointError("expected a torch.save zip archive; the file is truncated or not one", path)


def _classify_unpickling_error(path: Path, e: pickle.UnpicklingError) -> Exception:
    text = str(e)
    marker = "GLOBAL "
    if marker in text:
        refused = text.split(marker, 1)[1].split()[0]
        return UnsafeCheckpointError(
            f"refused pickle global {refused!r}: DeepSpeed checkpoints do not need it; nothing was executed", path)
    if "reduce" in text or "new object" in text or "build" in text.lower() or "blocked" in text:
        return UnsafeCheckpointError(f"refused pickle operation ({_first_line(e)}); nothing was executed", path)
    return CorruptCheckpointError(f"expected a valid pickle, got: {_first_line(e)}", path)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


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
        return self.meta.raw.get("ds_version")


def load_checkpoint(files: CheckpointFiles) -> LoadedCheckpoint:
    """Read every file of one save and settle its stage and world size."""
    model_states = [_model_states(p) for p in files.model_files]
    optim_states = [_optim_states(p) for p in files.optim_files]
    stage = _stage(files, model_states, optim_states)
    world_size = _world_size(files, stage, model_states, optim_states)
    return LoadedCheckpoint(files, stage, world_size, model_states, optim_states)


def _expect_dict(path: Path, obj: Any, what: str) -> dict:
    if not isinstance(obj, dict):
        raise CorruptCheckpointError(f"expected {what} to be a dict, found {type(obj).__name__}", path)
    return obj


def _shape(path: Path, name: str, value: Any) -> tuple[int, ...]:
    try:
        return tuple(int(d) for d in value)
    except TypeError:
        raise InconsistentCheckpointError(f"expected a shape for {name!r}, found {value!r}", path) from None


def _shapes(path: Path, mapping: Any, what: str) -> dict[str, tuple[int, ...]]:
    return {name: _shape(path, name, s) for name, s in _expect_dict(path, mapping, what).items()}


def _model_states(path: Path) -> ModelStates:
    raw = _expect_dict(path, load_file(path), "the model-states file")
    if "module" not in raw:
        raise CorruptCheckpointError(f"expected a 'module' entry, found keys {sorted(raw)[:12]}", path)
    module = _expect_dict(path, raw["module"], "'module'")
    shapes = raw.get("param_shapes")
    if shapes is not None:
        if isinstance(shapes, dict):  # very old DeepSpeed saved a single group unwrapped
            shapes = [shapes]
        shapes = [_shapes(path, g, "a 'param_shapes' group") for g in shapes]
    frozen = raw.get("frozen_param_shapes")
    return ModelStates(
        path=path,
        module=module,
        buffer_names=list(raw.get("buffer_names") or []),
        param_shapes=shapes,
        frozen_param_shapes=None if frozen is None else _shapes(path, frozen, "'frozen_param_shapes'"),
        frozen_param_fragments=dict(raw.get("frozen_param_fragments") or {}),
        shared_params=dict(raw.get("shared_params") or {}),
        dp_world_size=raw.get("dp_world_size"),
        raw=raw,
    )


def _optim_states(path: Path) -> OptimStates:
    raw = _expect_dict(path, load_file(path), "the optimizer-states file")
    osd = _expect_dict(path, raw.get("optimizer_state_dict"), "'optimizer_state_dict'")
    key = next((k for k in ("fp32_flat_groups", "single_partition_of_fp32_groups") if k in osd), None)
    if key is None:
        raise CorruptCheckpointError(
            "expected 'fp32_flat_groups' (stage 3) or 'single_partition_of_fp32_groups' (stages 1-2) in "
            f"'optimizer_state_dict', found keys {sorted(map(str, osd))[:12]}", path)
    groups = list(osd[key])
    for i, g in enumerate(groups):
        if not isinstance(g, torch.Tensor) or g.dim() != 1:
            raise CorruptCheckpointError(f"expected {key}[{i}] to be a 1-D tensor, found {type(g).__name__}", path)
    count = osd.get("partition_count")
    if isinstance(count, (list, tuple)):
        # Expert groups may use another data-parallel size; the dense world is the largest.
        count = max(int(c) for c in count) if count else None
    return OptimStates(
        path=path,
        zero_stage=osd.get("zero_stage"),
        partition_count=None if count is None else int(count),
        flat_groups=groups,
        param_alignment_paddings=osd.get("param_alignment_paddings"),
        raw=raw,
    )


def _stage(files: CheckpointFiles, models: list[ModelStates], optims: list[OptimStates]) -> int:
    if not optims:
        return 0
    recorded = optims[0].zero_stage
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
        raise UnsupportedCheckpointError(f"expected zero_stage 1 or 2, found {recorded!r}", optims[0].path)
    return recorded


def _world_size(files: CheckpointFiles, stage: int, models: list[ModelStates], optims: list[OptimStates]) -> int:
    meta = models[0]
    if stage == 0:
        return int(meta.dp_world_size or 1)
    recorded = optims[0].partition_count or meta.dp_world_size
    found = len(optims)
    if recorded is None:
        return found
    recorded = int(recorded)
    if recorded < found:
        strays = [p.name for p in files.optim_files[recorded:]]
        raise IncompleteCheckpointError(
            f"partition_count is {recorded} but {found} rank files are present; stray files from another save: "
            f"{strays}", files.tag_dir)
    if recorded > found:
        raise IncompleteCheckpointError(
            f"partition_count is {recorded} but only {found} optimizer rank files are present (ranks "
            f"{found}..{recorded - 1} missing)", files.tag_dir)
    return recorded
