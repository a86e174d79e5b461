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

import itertools
import math
import re

from ..discover import CheckpointFiles
from ..errors import CorruptCheckpointError, InconsistentCheckpointError, UnsupportedCheckpointError
from ..plan import FlatGroups, SourceTable, VirtualBuffer, _Entry, _rank_share, partitioned_entries
from ..safe_load import LoadedCheckpoint, _check_flat_groups, _model_states, _optim_states, _stage
from .common import FamilyCheckpoint, Stored


def load(files: CheckpointFiles) -> FamilyCheckpoint:
    T = files.mp_size
    models = [_model_states(p) for p in files.model_files]
    optims = [_optim_states(p) for p in files.optim_files]
    stage = _stage(files, models, optims)
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
    ckpt.trainable_builder = _Composer(metas, maps, T, dp).entries
    ckpt.partition_ends = frozenset((dp - 1) * T + t for t in range(T))
    _check_frozen(ckpt, metas, maps)
    if stage != 3:
        for t in range(T):
            _check_flat_groups(stage, [optims[d * T + t] for d in range(dp)])
    return ckpt


def _affine_maps(meta, T: int) -> list[tuple[re.Pattern, dict]]:
    info = meta.raw.get("universal_checkpoint_info")
    amap = info.get("affine_map") if isinstance(info, dict) else None
    params = amap.get("params") if isinstance(amap, dict) else None
    if not isinstance(params, dict):
        raise UnsupportedCheckpointError(
            "tensor-parallel checkpoints without universal_checkpoint_info.affine_map (not AutoTP) are not supported",
            meta.path)
    out = []
    for pattern, entry in params.items():
        ranks = entry.get("ranks") if isinstance(entry, dict) else None
        if not isinstance(pattern, str) or not isinstance(ranks, dict) or sorted(ranks) != list(range(T)):
            raise CorruptCheckpointError(f"expected affine_map entries with pieces for tp ranks 0..{T - 1}, found "
                                         f"{pattern!r:.80}", meta.path)
        out.append((re.compile(pattern), entry))
    return out


def _entry_for(maps, name: str):
    found = [e for p, e in maps if p.fullmatch(name)]
    return found[0] if len(found) == 1 else None


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


class _Composer:
    """Full trainable tensors out of the tp ranks' shards."""

    def __init__(self, metas, maps, T: int, dp: int):
        self.metas, self.maps, self.T, self.dp = metas, maps, T, dp
        info = metas[0].raw.get("universal_checkpoint_info") or {}
        patterns = info.get("tp_replicated_parameter_patterns") or []
        self.replicated = [re.compile(p) for p in patterns if isinstance(p, str)]

    def _replicated(self, name: str) -> bool:
        return any(p.fullmatch(name) for p in self.replicated)

    def entries(self, ckpt: FamilyCheckpoint, table: SourceTable, flats: FlatGroups, what: str) -> dict[str, _Entry]:
        shards = self._zero3_shards(ckpt, table, flats) if ckpt.stage == 3 else self._zero12_shards(ckpt, table, flats,
                                                                                                  what)
        out = {}
        for name in shards[0]:
            out[name] = self._compose(ckpt, name, [s.get(name) for s in shards])
        return out

    def _zero12_shards(self, ckpt, table, flats, what) -> list[dict[str, _Entry]]:
        shards = []
        for t, meta in enumerate(self.metas):
            ranks = [d * self.T + t for d in range(self.dp)]
            view = LoadedCheckpoint(ckpt.files, ckpt.stage, self.dp, [meta], [ckpt.optim_states[r] for r in ranks])
            shards.append(partitioned_entries(view, table, [flats[r] for r in ranks], what))
        return shards

    def _zero3_shards(self, ckpt, table, flats) -> list[dict[str, _Entry]]:
        """Group 0 over all ranks in global order, later groups over the dp ranks of each tp rank,
        on one running offset per rank."""
        W = self.dp * self.T
        bufs = [VirtualBuffer([table.add(str(o.path), where, t) for where, t in groups], [t.numel() for _, t in groups])
                for o, groups in zip(ckpt.optim_states, flats)]
        dtype = flats[0][0][1].dtype
        shards = []
        for t, meta in enumerate(self.metas):
            if not meta.param_shapes:
                raise InconsistentCheckpointError("expected 'param_shapes' for a ZeRO-3 AutoTP rank, found none",
                                                  meta.path)
            out, offset = {}, 0
            for g, group in enumerate(meta.param_shapes):
                ranks = list(range(W)) if g == 0 else [d * self.T + t for d in range(self.dp)]
                for name, shape in group.items():
                    n = math.prod(shape)
                    k = math.ceil(n / len(ranks))
                    segs = []
                    for i, r in enumerate(ranks):
                        if offset + k > bufs[r].numel:
                            raise InconsistentCheckpointError(
                                f"'param_shapes' needs {offset + k} elements per rank to reach {name!r}, but this "
                                f"rank's flat groups hold {bufs[r].numel}", ckpt.optim_states[r].path)
                        segs += bufs[r].pieces(offset, _rank_share(n, k, i), i * k)
                    out[name] = (tuple(shape), dtype, segs)
                    offset += k
            shards.append(out)
        return shards

    def _compose(self, ckpt, name: str, shards: list) -> _Entry:
        entry = _entry_for(self.maps, name)
        # ZeRO-3 saves replicated parameters' affine_map entries with the placeholders' shape [0];
        # tp_replicated_parameter_patterns still names them, and every rank holds them whole.
        if entry is None or self._replicated(name):
            shapes = {s[0] for s in shards if s is not None}
            if len(shapes) != 1 or any(s is None for s in shards):
                raise InconsistentCheckpointError(
                    f"{name!r} differs between tp ranks but has no affine_map entry (or is named replicated)",
                    self.metas[0].path)
            return shards[0]
        shape = tuple(entry.get("logical_shape") or ())
        segs = []
        covered = 0
        for t, shard in enumerate(shards):
            for piece in entry["ranks"][t].get("pieces", []):
                if min(piece.get("locations") or [t]) != t:
                    continue  # a replicated piece: read from the first rank holding it
                if shard is None:
                    raise InconsistentCheckpointError(f"tp rank {t} has no {name!r}", self.metas[t].path)
                segs += _piece_segments(name, piece, shard, self.metas[t].path)
                covered += math.prod(piece["shape"])
        if covered != math.prod(shape):
            raise InconsistentCheckpointError(
                f"the affine_map pieces of {name!r} cover {covered} of its {math.prod(shape)} elements",
                self.metas[0].path)
        return shape, shards[0][1], segs


def _piece_segments(name: str, piece: dict, shard: _Entry, path) -> list[tuple[int, int, int, int]]:
    """Segments copying ``shard.as_strided(shape, *dest)`` into ``full.as_strided(shape, *source)``."""
    try:
        shape = [int(d) for d in piece["shape"]]
        (src_off, src_strides), (dst_off, dst_strides) = piece["source"], piece["dest"]
    except (KeyError, TypeError, ValueError):
        raise CorruptCheckpointError(f"expected an affine_map piece with shape, source and dest for {name!r}",
                                     path) from None
    if not shape:
        shape, src_strides, dst_strides = [1], [1], [1]
    inner = shape[-1] if src_strides[-1] == 1 and dst_strides[-1] == 1 else 1
    outer = [range(d) for d in shape[:-1]] + ([range(shape[-1])] if inner == 1 else [])
    out = []
    shard_segs = shard[2]
    for index in itertools.product(*outer):
        full_at = src_off + sum(i * s for i, s in zip(index, src_strides))
        shard_at = dst_off + sum(i * s for i, s in zip(index, dst_strides))
        for src, s_off, d_off, length in shard_segs:
            a, b = max(d_off, shard_at), min(d_off + length, shard_at + inner)
            if a < b:
                out.append((src, s_off + a - d_off, full_at + a - shard_at, b - a))
    return out
