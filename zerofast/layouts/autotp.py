"""Tensor-parallel training saves, ZeRO 1, 2 and 3: AutoTP (``"tensor_parallel": {"autotp_size": T}``)
and Megatron-DeepSpeed without pipeline parallelism (an ``mpu`` given to ``deepspeed.initialize``).

On disk (DeepSpeed 0.19.8), global rank = dp * T + tp:
- ZeRO 1/2: ``mp_rank_{tp:02d}_model_states.pt`` per tensor-parallel rank and
  ``[bf16_]zero_pp_rank_{dp}_mp_rank_{tp:02d}_optim_states.pt``: each tp rank is an ordinary ZeRO
  save of its **shards** (``module`` and ``param_shapes`` hold shard shapes) over its dp ranks;
- ZeRO 3 (AutoTP): per-rank ``zero_pp_rank_{dp}_mp_rank_{tp:02d}_model_states.pt``. The flat groups
  hold two param groups with one running offset per rank: [0] the replicated parameters,
  partitioned over **all** W ranks in global order (``ceil(n / W)`` each), [1] the shards,
  partitioned over the dp ranks of one tp rank (``ceil(n / dp)`` each). ``partition_count`` says
  dp in every file;
- how the shards go together, in ``universal_checkpoint_info`` in the model states:
  - AutoTP: ``affine_map``: for each parameter pattern and tp rank, pieces ``{shape, source:
    [offset, strides], dest: [offset, strides], locations}``: ``full.as_strided(shape, *source) =
    shard.as_strided(shape, *dest)``. A replicated piece is listed on every rank in
    ``locations``; it is read from the first;
  - Megatron-DeepSpeed: pattern lists (replicated, averaged, row-parallel, sub-parameters,
    vocabulary), which :mod:`.tp_rules` turns into the same pieces; replicated copies are
    compared bit for bit, averaged ones averaged as ``ds_to_universal`` does.

Planning: a tp rank's shards are planned like a plain save of that rank alone (ZeRO 1/2: over
its dp ranks; ZeRO-3: the replicated group over all ranks, the shards over the rank's dp ranks,
on one running offset per rank); each piece of the map then copies one contiguous run of its
innermost dimension at a time from the shard's segments into the full tensor, so the native
executor gathers it in the one pass.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path


from ..base import keys as K
from ..discover import CheckpointFiles, Found, other_model_parallel_rank, ranked
from ..base.errors import (CheckpointNotFoundError, CorruptCheckpointError, IncompleteCheckpointError,
                      InconsistentCheckpointError, UnsupportedCheckpointError, short_repr, some)
from ..load import LoadedCheckpoint, PartitionedCheckpoint, Stored, load_file
from ..load.records import check_flat_groups, read_model_states, read_optim_states, settle_stage
from ..plan.builders import flat_entries
from ..plan.columns import EntryTable
from ..plan.model import Entry, FlatGroups, SourceTable, VirtualBuffer, rank_share
from . import tp_join, tp_rules
from .base import Layout, PartitionedLayout

_TP_MODEL = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_TP_MODEL_Z3 = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_TP_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


@dataclass(frozen=True)
class TensorParallelFiles(CheckpointFiles):
    mp_size: int = 1  # tensor-parallel degree; rank files are in global-rank order dp * mp_size + tp
    # A rank grid found incomplete. Raised by the loader once rank 00's model states have ruled
    # out a pipeline save whose layer files are missing (the names cannot tell).
    incomplete: str | None = None


class AutoTPLayout(PartitionedLayout):
    name = "autotp"
    title = "tensor parallelism"

    def claims(self, found: Found) -> str | None:
        return other_model_parallel_rank(found.names)

    def list_files(self, found: Found) -> TensorParallelFiles:
        return tp_files(self, found)

    def load(self, files: TensorParallelFiles) -> PartitionedCheckpoint:
        return load(files)

    def trainable_from(self, ckpt: PartitionedCheckpoint, table: SourceTable, flats: FlatGroups,
                       what: str) -> EntryTable:
        return trainable(ckpt, table, flats, what)

    def stored_entries(self, ckpt: PartitionedCheckpoint, table: SourceTable) -> dict[str, Entry]:
        return frozen_entries(ckpt, table)

    def universal_fields(self, ckpt: PartitionedCheckpoint) -> dict[str, dict] | None:
        """The fields ds_to_universal writes beside each trainable parameter: by its rule
        (Megatron-DeepSpeed saves), or by AutoTP's affine_map (:func:`_affine_fields`)."""
        rules = ckpt.extra.get("rules")
        if rules is None:
            return _affine_fields(ckpt)
        T = ckpt.files.mp_size
        shapes = [{n: tuple(v) for g in m.param_shapes or [] for n, v in g.items()} for m in ckpt.model_states[:T]]
        return {name: tp_rules.universal_fields(rules.merge(name, [s[name] for s in shapes]), ckpt.meta.path)
                for name in shapes[0]}


def _affine_fields(ckpt: PartitionedCheckpoint) -> dict[str, dict]:
    """AutoTP at ZeRO 1-2, as ``merge_tp_slices`` of DeepSpeed 0.19.8 writes it: a parameter its
    ``affine_map`` names is rebuilt from the pieces with no field of a rule (not ``cat_dim``); one
    named tp-replicated without a map entry is rank 0's copy, also bare; either gets
    ``vocab_tensor`` when a vocabulary pattern names it. Refused: ZeRO-3 (the converter fails
    there), what the save marks unconvertible (as the converter refuses it), a parameter neither
    mapped nor named replicated (the converter would join the copies, which zerofast reads as one
    whole tensor), and a vocabulary with rows past ``original_vocab_size`` (the converter cuts them)."""
    first = ckpt.model_states[0]
    if ckpt.stage == 3:
        raise UnsupportedCheckpointError(
            "to-universal of an AutoTP save at ZeRO-3 is not supported: DeepSpeed 0.19.8's ds_to_universal fails on "
            "such saves, so there is no universal layout of them to write", first.path)
    info = first.raw.get(K.UNIVERSAL_INFO)
    info = info if isinstance(info, dict) else {}
    unsupported = info.get("autotp_unsupported_parameter_patterns")
    if unsupported:
        raise UnsupportedCheckpointError(f"to-universal: the save marks parameters AutoTP cannot convert "
                                         f"(autotp_unsupported_parameter_patterns: {short_repr(unsupported)})",
                                         first.path)
    vocab = info.get("vocabulary_parameter_patterns") or []
    vocab = {_literal(first.path, p) for p in (vocab if isinstance(vocab, (list, tuple)) else [vocab])}
    rows = info.get("original_vocab_size")
    maps, replicated = ckpt.extra["maps"], ckpt.extra["replicated"]
    out = {}
    for name, shape in ((n, tuple(v)) for g in first.param_shapes or [] for n, v in g.items()):
        if name not in maps and name not in replicated:
            raise UnsupportedCheckpointError(
                f"to-universal of {name!r}: the affine_map has no entry for it and the save does not name it "
                "tp-replicated, so ds_to_universal would concatenate the tp ranks' copies; not written", first.path)
        out[name] = {}
        if name in vocab:
            full = tuple(maps[name].get("logical_shape") or shape) if name in maps else shape
            if type(rows) is not int or len(full) != 2 or full[0] > rows:
                raise UnsupportedCheckpointError(
                    f"to-universal of {name!r}: a vocabulary parameter of shape {list(full)} with original_vocab_size "
                    f"{short_repr(rows)} (ds_to_universal cuts the rows past it, zerofast keeps them)", first.path)
            out[name] = {"vocab_tensor": True}
    return out


def tp_files(layout: Layout, found: Found) -> TensorParallelFiles:
    """Model-states files per tensor-parallel rank (per rank at ZeRO-3), optimizer files per
    (data-parallel, tensor-parallel) rank; both listed in global-rank order ``dp * T + tp``."""
    root, tag, tag_dir, names = found.root, found.tag, found.tag_dir, found.names
    z3 = _grid(tag_dir, names, _TP_MODEL_Z3, dp_group=1, mp_group=2)
    optim = _grid(tag_dir, names, _TP_OPTIM, dp_group=2, mp_group=3)
    plain = ranked(tag_dir, names, _TP_MODEL, group=1)
    if z3 and plain:
        raise IncompleteCheckpointError("expected either mp_rank_XX_model_states.pt (stages 0-2) or "
                                        "zero_pp_rank_*_mp_rank_XX_model_states.pt (stage 3), found both", tag_dir)
    T = 1 + max([len(plain) - 1] + [t for _, t, _ in z3 + optim])
    if not plain and not z3:
        raise CheckpointNotFoundError("expected mp_rank_XX model-states files, found none", tag_dir)
    incomplete = None
    if plain and len(plain) != T:
        incomplete = (f"expected a model-states file for each of the {T} tensor-parallel ranks "
                      f"(mp_rank_00..{T - 1:02d}), found {some([p.name for p in plain])}")
    for what, grid in (("optimizer", optim), ("model-states", z3)):
        tps = {t for _, t, _ in grid}
        dps = {d for d, _, _ in grid}
        if grid and (tps != set(range(T)) or len(grid) != len(dps) * T or dps != set(range(len(dps)))):
            incomplete = incomplete or (
                f"expected {what} files for every (data-parallel, tensor-parallel) rank pair of {T} tensor-parallel "
                f"ranks, found {some([str(p) for p in sorted((d, t) for d, t, _ in grid)])}")
    model = tuple(tag_dir / n for _, _, n in z3) if z3 else tuple(plain)
    return TensorParallelFiles(root, tag, tag_dir, model, tuple(tag_dir / n for _, _, n in optim), layout=layout,
                               mp_size=T, incomplete=incomplete)


def _grid(tag_dir: Path, names: list[str], pattern: re.Pattern, dp_group: int, mp_group: int):
    found = {}
    for n in names:
        m = pattern.match(n)
        if m:
            key = (int(m.group(dp_group)), int(m.group(mp_group)))
            if key in found:
                raise IncompleteCheckpointError(
                    f"expected one file for rank pair {key}, found {found[key]} and {n}: the folder mixes saves of "
                    "two dtypes", tag_dir)
            found[key] = n
    return [(d, t, n) for (d, t), n in sorted(found.items())]



def load(files: CheckpointFiles) -> PartitionedCheckpoint:
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
    ckpt = PartitionedCheckpoint(files, stage, dp * T, models, optims)
    read_shards(ckpt, dp)
    ckpt.partition_ends = frozenset((dp - 1) * T + t for t in range(T))
    if stage != 3:
        for t in range(T):
            check_flat_groups(stage, [optims[d * T + t] for d in range(dp)])
    return ckpt


def read_shards(ckpt: PartitionedCheckpoint, dp: int) -> None:
    """What the tp ranks' model states say, into ``ckpt``: the stored tensors (tp rank 0's module),
    the rule or map joining each parameter's shards, the degrees; the frozen shards checked. The
    optimizer files play no part, so a universal conversion, which keeps only the model states,
    is read the same way (:mod:`.universal_parallel`)."""
    T = ckpt.files.mp_size
    for ms in ckpt.model_states:
        _check_degrees(ms, T)
    metas = ckpt.model_states[:T]  # the model states of each tp rank (of its dp rank 0, at ZeRO-3)
    first = metas[0]
    ckpt.stored = {n: Stored(first.path, f"module[{n!r}]", t) for n, t in first.module.items()}
    ckpt.aliases, ckpt.buffers = dict(first.shared_params), frozenset(first.buffer_names)
    # Not ``or``: the truth of a tensor the file put here raises.
    info = first.raw.get(K.UNIVERSAL_INFO)
    info = info if isinstance(info, dict) else {}
    shapes = [{n: tuple(v) for g in m.param_shapes or [] for n, v in g.items()} for m in metas]
    rules = tp_join.rules_of(info, first.path, list(shapes[0]))
    if rules is not None:
        ckpt.degrees = {"family": "tensor-parallel (Megatron-DeepSpeed)", "dp": dp, "tp": T,
                        "tp_rules": tp_join.rule_labels(rules, shapes, first.path)}
        ckpt.extra = {"maps": {}, "replicated": set(), "rules": rules}
    else:
        maps = _affine_maps(metas[0], T)
        ckpt.degrees = {"family": "tensor-parallel (AutoTP)", "dp": dp, "tp": T}
        replicated = info.get("tp_replicated_parameter_patterns")
        replicated = [] if replicated is None else replicated if isinstance(replicated, (list, tuple)) else [replicated]
        ckpt.extra = {"maps": maps, "replicated": {_literal(first.path, p) for p in replicated}, "rules": None}
    _check_frozen(ckpt, metas, ckpt.extra["maps"])


def _check_degrees(ms, T: int) -> None:
    """What the engine recorded (DeepSpeed 0.19.5 on) must be what the files show."""
    dims = ms.raw.get(K.PARALLEL_DIMENSIONS)
    tp = dims.get(K.TP_DEGREE) if isinstance(dims, dict) else None
    if tp is not None and tp != T:
        raise InconsistentCheckpointError(f"expected tp_degree {T} (the model-states files' tensor-parallel ranks), "
                                          f"found {short_repr(tp)}", ms.path)


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
        raise CorruptCheckpointError(f"expected universal_checkpoint_info.affine_map.params to be a dict, found "
                                     f"{short_repr(params)}", meta.path)
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
    """A frozen tensor the layout does not put together must be whole on every tp rank: AutoTP
    names the split ones in its affine_map, Megatron-DeepSpeed's rules cover every parameter. At
    ZeRO-3 the frozen shards are partitioned over the dp ranks too: refused, not guessed."""
    names = _frozen_names(ckpt, metas[0])
    if names and ckpt.stage == 3:
        raise UnsupportedCheckpointError(f"frozen parameters of a ZeRO-3 tensor-parallel save (among them "
                                         f"{names[0]!r}) are not supported", metas[0].path)
    for name in names:
        shapes = {tuple(m.module[name].shape) for m in metas if name in m.module}
        if name not in maps and ckpt.extra.get("rules") is None and len(shapes) > 1:
            raise InconsistentCheckpointError(f"frozen {name!r} has the shapes {sorted(shapes)} on the tp ranks, but "
                                              "no affine_map entry says how they go together", metas[0].path)


def _frozen_names(ckpt, first) -> list[str]:
    """The stored parameters no optimizer holds: not trainable, not a buffer, not a tied alias."""
    trainable = {n for g in first.param_shapes or [] for n in g}
    return [n for n in ckpt.stored if n not in trainable and n not in ckpt.aliases and n not in ckpt.buffers]


def frozen_entries(ckpt: PartitionedCheckpoint, table: SourceTable) -> dict[str, Entry]:
    """Each frozen parameter split over the tp ranks, put together from every tp rank's model
    states by the rule that joins the trainable ones (AutoTP's affine_map entry, or
    Megatron-DeepSpeed's patterns; a replicated one must be equal on every rank)."""
    T = ckpt.files.mp_size
    metas = ckpt.model_states[:T]
    composer = _Composer(metas, ckpt.extra["maps"], ckpt.extra["replicated"], T, 0, ckpt.extra.get("rules"))
    out = {}
    for name in _frozen_names(ckpt, metas[0]):
        if composer.rules is None and name not in composer.maps:
            continue  # whole on every rank (checked when loaded)
        slices = [table.whole(str(m.path), f"module[{name!r}]", m.module[name]) if name in m.module else None
                  for m in metas]
        out[name] = composer.join(ckpt, table, name, slices, "frozen weights")
    return out


def trainable(ckpt: PartitionedCheckpoint, table: SourceTable, flats: FlatGroups, what: str) -> EntryTable:
    """Every trainable parameter in full, read from ``flats`` (the masters or one optimizer state)."""
    T = ckpt.files.mp_size
    composer = _Composer(ckpt.model_states[:T], ckpt.extra["maps"], ckpt.extra["replicated"], T,
                         len(ckpt.optim_states) // T, ckpt.extra.get("rules"))
    return EntryTable.of_entries(composer.entries(ckpt, table, flats, what))


class _Composer:
    """Full trainable tensors out of the tp ranks' shards."""

    def __init__(self, metas, maps, replicated, T: int, dp: int, rules=None):
        self.metas, self.maps, self.replicated, self.T, self.dp = metas, maps, replicated, T, dp
        self.rules = rules  # Megatron-DeepSpeed's patterns (tp_rules.Rules), or None for AutoTP

    def entries(self, ckpt: PartitionedCheckpoint, table: SourceTable, flats: FlatGroups, what: str) -> dict[str, Entry]:
        shards = self._zero3_shards(ckpt, table, flats) if ckpt.stage == 3 else self._zero12_shards(ckpt, table, flats,
                                                                                                  what)
        return {name: self.join(ckpt, table, name, [s.get(name) for s in shards], what) for name in shards[0]}

    def join(self, ckpt, table: SourceTable, name: str, slices: list, what: str) -> Entry:
        """The full ``name`` from its tp ranks' ``slices``: by AutoTP's map or by the rules."""
        if self.rules is None:
            return self._compose(ckpt, name, slices)
        return tp_join.join_entry(self.rules, table, name, slices, what, [m.path for m in self.metas])

    def _zero12_shards(self, ckpt, table, flats, what) -> list[dict[str, Entry]]:
        shards = []
        for t, meta in enumerate(self.metas):
            ranks = [d * self.T + t for d in range(self.dp)]
            view = LoadedCheckpoint(ckpt.files, ckpt.stage, self.dp, [meta], [ckpt.optim_states[r] for r in ranks])
            shards.append(flat_entries(view, table, [flats[r] for r in ranks], what))
        return shards

    def _zero3_shards(self, ckpt, table, flats) -> list[dict[str, Entry]]:
        """AutoTP: group 0 over all ranks in global order, later groups over the dp ranks of each tp
        rank; Megatron-DeepSpeed: every group over the dp ranks of each tp rank. One running
        offset per rank."""
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
                # AutoTP's group 0 (the replicated parameters) spans every rank; Megatron-DeepSpeed
                # partitions every group over the mpu's data-parallel group
                ranks = list(range(W)) if g == 0 and self.rules is None else [d * self.T + t for d in range(self.dp)]
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
                if piece.get("scale", 1.0) != 1.0:  # the shard holds the block times scale: never read as is
                    raise UnsupportedCheckpointError(f"{name!r} has affine_map pieces with a scale "
                                                     f"({short_repr(piece.get('scale'))}): not supported",
                                                     self.metas[t].path)
                if min(piece.get("locations") or [t]) != t:
                    continue  # a replicated piece: read from the first rank holding it
                if shard is None:
                    raise InconsistentCheckpointError(f"tp rank {t} has no {name!r}", self.metas[t].path)
                segs += tp_join.piece_segments(name, piece, shard, self.metas[t].path)
                covered += math.prod(piece["shape"])
        if covered != math.prod(shape):
            raise InconsistentCheckpointError(
                f"the affine_map pieces of {name!r} cover {covered} of its {math.prod(shape)} elements",
                self.metas[0].path)
        return shape, shards[0][1], segs


LAYOUT = AutoTPLayout()
