"""AutoTP saves: each full tensor composed from the tp ranks' shards through the ``affine_map``.

A tp rank's shards are planned like a plain save of that rank alone (ZeRO 1/2: over its dp ranks;
ZeRO-3: the replicated group over all ranks, the shards over the rank's dp ranks, on one running
offset per rank); each piece of the map then copies one contiguous run of its innermost
dimension at a time from the shard's segments into the full tensor. See
:mod:`zerofast.load.families.autotp` for the layout on disk.
"""
from __future__ import annotations

import itertools
import math

from ...errors import CorruptCheckpointError, InconsistentCheckpointError
from ...load import LoadedCheckpoint
from ...load.families import FamilyCheckpoint
from ..model import Entry, FlatGroups, SourceTable, VirtualBuffer, rank_share


def trainable(ckpt: FamilyCheckpoint, table: SourceTable, flats: FlatGroups, what: str) -> dict[str, Entry]:
    """Every trainable parameter in full, read from ``flats`` (the masters or one optimizer state)."""
    T = ckpt.files.mp_size
    return _Composer(ckpt.model_states[:T], ckpt.extra["maps"], ckpt.extra["replicated"], T,
                     len(ckpt.optim_states) // T).entries(ckpt, table, flats, what)


class _Composer:
    """Full trainable tensors out of the tp ranks' shards."""

    def __init__(self, metas, maps, replicated, T: int, dp: int):
        self.metas, self.maps, self.replicated, self.T, self.dp = metas, maps, replicated, T, dp

    def entries(self, ckpt: FamilyCheckpoint, table: SourceTable, flats: FlatGroups, what: str) -> dict[str, Entry]:
        shards = self._zero3_shards(ckpt, table, flats) if ckpt.stage == 3 else self._zero12_shards(ckpt, table, flats,
                                                                                                  what)
        out = {}
        for name in shards[0]:
            out[name] = self._compose(ckpt, name, [s.get(name) for s in shards])
        return out

    def _zero12_shards(self, ckpt, table, flats, what) -> list[dict[str, Entry]]:
        from . import partitioned_entries

        shards = []
        for t, meta in enumerate(self.metas):
            ranks = [d * self.T + t for d in range(self.dp)]
            view = LoadedCheckpoint(ckpt.files, ckpt.stage, self.dp, [meta], [ckpt.optim_states[r] for r in ranks])
            shards.append(partitioned_entries(view, table, [flats[r] for r in ranks], what))
        return shards

    def _zero3_shards(self, ckpt, table, flats) -> list[dict[str, Entry]]:
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
                        segs += bufs[r].pieces(offset, rank_share(n, k, i), i * k)
                    out[name] = (tuple(shape), dtype, segs)
                    offset += k
            shards.append(out)
        return shards

    def _compose(self, ckpt, name: str, shards: list) -> Entry:
        entry = self.maps.get(name)
        # ZeRO-3 saves replicated parameters' affine_map entries with the placeholders' shape [0];
        # tp_replicated_parameter_patterns still names them, and every rank holds them whole.
        if entry is None or name in self.replicated:
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


def _piece_segments(name: str, piece: dict, shard: Entry, path) -> list[tuple[int, int, int, int]]:
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
