"""AutoTP training saves (``"tensor_parallel": {"autotp_size": T}``), ZeRO 1, 2 and 3.

On disk (DeepSpeed 0.19.8), global rank = dp * T + tp:
- ZeRO 1/2: ``mp_rank_{tp:02d}_model_states.pt`` per tensor-parallel rank and
  ``[bf16_]zero_pp_rank_{dp}_mp_rank_{tp:02d}_optim_states.pt``: each tp rank is an ordinary ZeRO
  save of its **shards** (``module`` and ``param_shapes`` hold shard shapes) over its dp ranks;
- ZeRO 3: per-rank ``zero_pp_rank_{dp}_mp_rank_{tp:02d}_model_states.pt``. The flat groups hold two
  param groups with one running offset per rank: [0] the replicated parameters, partitioned over
  **all** W ranks in global order (``ceil(n / W)`` each), [1] the shards, partitioned over the dp
  ranks of one tp rank (``ceil(n / dp)`` each). ``partition_count`` says dp in every file;
- ``universal_checkpoint_info.affine_map`` in the model states: for each parameter pattern and tp
  rank, pieces ``{shape, source: [offset, strides], dest: [offset, strides], locations}``:
  ``full.as_strided(shape, *source) = shard.as_strided(shape, *dest)``. A replicated piece is
  listed on every rank in ``locations``; it is read from the first.

The plan composes each full tensor from the shards' segments, one contiguous run of the pieces'
innermost dimension at a time, so the native executor gathers it in the one pass.
"""
from __future__ import annotations

import re

from ...discover import CheckpointFiles
from ...errors import CorruptCheckpointError, IncompleteCheckpointError, UnsupportedCheckpointError, short_repr
from ...plan import keys as K
from ..checkpoint import check_flat_groups, read_model_states, read_optim_states, settle_stage, load_file
from . import FamilyCheckpoint, Stored


def load(files: CheckpointFiles) -> FamilyCheckpoint:
    T = files.mp_size
    _refuse_pipeline_without_layers(files)
    if files.incomplete:
        raise IncompleteCheckpointError(files.incomplete, files.tag_dir)
    models = [read_model_states(p) for p in files.model_files]
    optims = [read_optim_states(p) for p in files.optim_files]
    stage = settle_stage(files, models, optims)
    if stage == 0:
        raise UnsupportedCheckpointError("tensor-parallel checkpoints without ZeRO are not supported", files.tag_dir)
    dp = len(optims) // T
    metas = models[:T]  # the model states of each tp rank (of its dp rank 0, at ZeRO-3)
    maps = _affine_maps(metas[0], T)
    first = metas[0]
    stored = {n: Stored(first.path, f"module[{n!r}]", t) for n, t in first.module.items()}
    ckpt = FamilyCheckpoint(files, stage, dp * T, models, optims, family="tensor",
                            stored=stored, aliases=dict(first.shared_params), buffers=frozenset(first.buffer_names))
    ckpt.degrees = {"family": "tensor-parallel (AutoTP)", "dp": dp, "tp": T}
    # Not ``or``: the truth of a tensor the file put here raises.
    info = first.raw.get(K.UNIVERSAL_INFO)
    info = info if isinstance(info, dict) else {}
    replicated = info.get("tp_replicated_parameter_patterns")
    replicated = [] if replicated is None else replicated if isinstance(replicated, (list, tuple)) else [replicated]
    ckpt.extra = {"maps": maps, "replicated": {_literal(first.path, p) for p in replicated}}
    ckpt.partition_ends = frozenset((dp - 1) * T + t for t in range(T))
    _check_frozen(ckpt, metas, maps)
    if stage != 3:
        for t in range(T):
            check_flat_groups(stage, [optims[d * T + t] for d in range(dp)])
    return ckpt


def _refuse_pipeline_without_layers(files: CheckpointFiles) -> None:
    """mp_rank_XX files without layer files look tensor-parallel by name alone; a pipeline save
    whose layer files are missing (or were not copied) says otherwise in its model states."""
    raw = load_file(files.model_files[0])
    dims = raw.get(K.PARALLEL_DIMENSIONS) if isinstance(raw, dict) else None
    pp = dims.get(K.PP_DEGREE) if isinstance(dims, dict) else None
    if type(pp) is int and pp > 1:
        raise IncompleteCheckpointError(
            f"expected layer_*-model_states.pt files next to the model states of a pipeline-parallel save "
            f"(pp_degree {pp}), found none: the layer files of this save are missing", files.model_files[0])


def _affine_maps(meta, T: int) -> dict[str, dict]:
    """``{parameter name: its affine_map entry}``."""
    info = meta.raw.get(K.UNIVERSAL_INFO)
    amap = info.get("affine_map") if isinstance(info, dict) else None
    params = amap.get("params") if isinstance(amap, dict) else None
    if not isinstance(params, dict):
        raise UnsupportedCheckpointError(
            "tensor-parallel checkpoints without universal_checkpoint_info.affine_map (not AutoTP) are not supported",
            meta.path)
    out = {}
    for pattern, entry in params.items():
        ranks = entry.get("ranks") if isinstance(entry, dict) else None
        if not isinstance(ranks, dict) or sorted(ranks) != list(range(T)):
            raise CorruptCheckpointError(f"expected affine_map entries with pieces for tp ranks 0..{T - 1}, found "
                                         f"{pattern!r:.80}", meta.path)
        out[_literal(meta.path, pattern)] = entry
    return out


_ESCAPED = re.compile(r"\\([^A-Za-z0-9])")  # re.escape never escapes letters or digits
_META = set(".^$*+?{}[]|()\\")


def _literal(path, pattern) -> str:
    """The one name a DeepSpeed pattern (``^model\\.norm\\.weight$``) matches. The patterns come with
    the checkpoint, so they are never run as regular expressions (no backtracking blow-ups); any
    pattern that is not an escaped literal name is refused."""
    body = pattern[1:-1] if isinstance(pattern, str) and pattern.startswith("^") and pattern.endswith("$") else None
    plain = _ESCAPED.sub("", body) if body is not None else None
    if plain is None or _META & set(plain):
        raise UnsupportedCheckpointError(
            f"expected AutoTP parameter patterns of the form ^escaped\\.name$, found {short_repr(pattern)}", path)
    return _ESCAPED.sub(lambda m: m.group(1), body)


def _check_frozen(ckpt, metas, maps) -> None:
    """Only trainable shards are composed; a frozen tensor must be whole on every tp rank."""
    trainable = {n for g in metas[0].param_shapes or [] for n in g}
    for name, s in ckpt.stored.items():
        if name in trainable or name in ckpt.aliases:
            continue
        shapes = {tuple(m.module[name].shape) for m in metas if name in m.module}
        if len(shapes) > 1:
            raise UnsupportedCheckpointError(f"frozen tensor-parallel shard {name!r} (shapes {sorted(shapes)}) is "
                                             "not supported", metas[0].path)
