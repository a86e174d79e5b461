"""DeepSpeed AutoEP saves (``expert_parallel.enabled``, DeepSpeed 0.19.2+), ZeRO 0-2 here, ZeRO-3 in
:mod:`.autoep_zero3`, whose subclass of this layout (reading both) is the one registered.

AutoEP replaces each Hugging Face MoE block (``model.layers.N.mlp``) with an ``AutoEPMoELayer``:
``router.gate.weight``, the expert-parallel rank's local experts fused as ``experts.w1`` (gate),
``experts.w2`` (down) and ``experts.w3`` (up) of shape ``[num_local_experts, ...]``, and often the
router under the HF name too (``mlp.gate`` is ``mlp.router``: ``state_dict()`` lists
``mlp.gate.gate.weight`` beside ``mlp.router.gate.weight``). On disk (DeepSpeed 0.19.8,
``engine._save_moe_checkpoint``):

- ``mp_rank_00_model_states.pt``: ``module`` without the experts; ``ds_autoep_layers``, one record
  per AutoEP layer (``moe_layer_id``, ``module_path``, ``num_experts``, ``num_local_experts``,
  ``ep_size``, ``expert_key_prefix``, ``expert_placement``, ``affine_maps``: per expert tensor how
  each ep rank's ``[num_local, ...]`` shard sits in the ``[num_experts, ...]`` tensor, and
  ``checkpoint_format``: ``per_expert_files`` at ZeRO 0-2, ``zero3_partitioned`` at ZeRO-3), also
  copied into ``universal_checkpoint_info``; ``param_shapes`` [0] the dense parameters, [1] the
  expert group with ep rank 0's local shapes;
- ``layer_{L}_expert_{E}_mp_rank_00_model_states.pt``: ``{expert_key_prefix}.w1.{E}`` (and w2,
  w3), expert E's slice in the model dtype;
- ZeRO off: ``expp_rank_{e}_mp_rank_00_optim_states.pt`` per ep rank, its wrapper's unnamed fp32
  masters (the dense group, then ep rank e's local experts), matched by value as for native MoE;
- ZeRO 1/2: one optimizer file per rank. The expert group (``'moe': True``, ``ep_size_<ep>``) of
  rank r holds ep rank ``r % ep``'s local experts, partitioned over its expert-data-parallel ranks
  ``r % ep, r % ep + ep, ...`` (partition count ``world / ep``), as for native MoE.

Output names are the AutoEP module's at ep 1: ``experts.w1`` holds every expert
(``[num_experts, ...]``), placed by the save's ``affine_maps``; ``mlp.gate.*`` is a tied name of
``mlp.router.*`` where the save holds both. Refused, naming the file and what is missing:
AutoEP+AutoTP folding (``folding`` metadata, ``mp_rank_01``), ``use_data_before_expert_parallel_``,
and a ``checkpoint_format`` other than the files' (``zero3_partitioned`` beside expert files).
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import torch

from ..base.errors import CorruptCheckpointError, InconsistentCheckpointError, UnsupportedCheckpointError, ZeroFastError
from ..discover import MODEL_FILE_STAGE012, Found
from ..load import LoadedCheckpoint, PartitionedCheckpoint, Partition, Stored, load_file, load_files
from ..load.archive import index_archive
from ..load.checkpoint import check_partitions, merged_meta
from ..load.legacy import is_legacy
from ..load.records import (expect_dict, expect_mapping, read_model_states, read_optim_states, settle_stage,
                            settle_world_size)
from ..plan.columns import EntryTable
from ..plan.builders import stage0
from ..plan.model import Entry, FlatGroups, SourceTable
from ..plan.partitioned import partition_entries
from . import moe
from .base import PartitionedLayout
from .tp_join import piece_segments

AUTOEP_LAYERS = "ds_autoep_layers"
AUTOEP_LAYERS_LEGACY = "autoep_layers"
FOLDING = "folding"
# A key only AutoEP's layer records hold; its bytes in a model-states pickle mark a save to look at.
_MARK = b"expert_key_prefix"
_PROBE_LIMIT = 64 << 20  # pickle bytes read to look for it
_LEGACY_PROBE = 8 << 20  # head of a legacy (non-zip) file read to look for it: its pickle, then storages
_REQUIRED = ("moe_layer_id", "module_path", "num_experts", "num_local_experts", "ep_size", "expert_key_prefix",
             "affine_maps")
WEIGHTS = ("w1", "w2", "w3")


def autoep_records(raw: dict, path: Path) -> list[dict] | None:
    """A model-states file's AutoEP layer records, or None where it has none (a native MoE save
    records ``ds_autoep_layers: None``)."""
    layers = raw.get(AUTOEP_LAYERS, raw.get(AUTOEP_LAYERS_LEGACY))
    if layers is None or layers == []:
        return None
    if not isinstance(layers, (list, tuple)) or not all(isinstance(x, dict) for x in layers):
        raise CorruptCheckpointError(f"expected '{AUTOEP_LAYERS}' to be a list of layer records, found "
                                     f"{type(layers).__name__}", path)
    return list(layers)


def _probe(path: Path) -> bool:
    """Whether ``path``'s pickle holds AutoEP's layer records (a byte search, nothing unpickled).
    The pickle is found through the archive index (the native zip directory where the core is
    there): zipfile's Python parse of a 50k-entry ZeRO-3 model-states file took 340 ms, half of
    reconstructing that checkpoint, against 11 ms."""
    try:
        if not is_legacy(path):
            data = index_archive(path).pickle_bytes
            return len(data) <= _PROBE_LIMIT and _MARK in data
    except (ZeroFastError, OSError):
        return False
    try:  # torch.save's legacy format: the object's pickle comes before the storages
        with open(path, "rb") as f:
            return _MARK in f.read(_LEGACY_PROBE)
    except OSError:
        return False


class AutoEPLayout(PartitionedLayout):
    name = "autoep"
    title = "AutoEP mixture-of-experts"
    subsumes = ("moe", "autotp", "moe_tp")  # MoE's expert file names; AutoEP+AutoTP writes mp_rank_01

    def claims(self, found: Found) -> str | None:
        names = set(found.names)
        if MODEL_FILE_STAGE012 in names:
            if not any(moe.MOE_EXPERT.match(n) or moe.MOE_OPTIM.match(n) for n in names):
                return None  # AutoEP at ZeRO 0-2 always writes expert files or expp_rank files
            probe = MODEL_FILE_STAGE012
        else:
            probe = "zero_pp_rank_0_mp_rank_00_model_states.pt"
            if probe not in names:
                return None
        return f"{probe} ({AUTOEP_LAYERS})" if _probe(found.tag_dir / probe) else None

    def list_files(self, found: Found):
        return moe._files(self, found)  # ZeRO-3 saves: autoep_zero3.AutoEPAllStagesLayout

    def load(self, files) -> PartitionedCheckpoint:
        return load(files)

    def trainable_from(self, ckpt: PartitionedCheckpoint, table: SourceTable, flats: FlatGroups,
                       what: str) -> EntryTable:
        return trainable(ckpt, table, flats, what)

    def stored_entries(self, ckpt: PartitionedCheckpoint, table: SourceTable) -> dict[str, Entry]:
        return frozen_experts(ckpt, table)

    def stage0_masters(self, ckpt: PartitionedCheckpoint, table: SourceTable) -> dict[str, Entry]:
        return stage0_masters(ckpt, table)


def _layer_records(first, fmt: str = "per_expert_files") -> list[dict]:
    """``first``'s AutoEP records, checked; each must have ``checkpoint_format`` ``fmt``."""
    path = first.path
    records = autoep_records(first.raw, path)
    if records is None:
        raise InconsistentCheckpointError(f"expected '{AUTOEP_LAYERS}' records in an AutoEP save, found none", path)
    if first.raw.get(FOLDING) is not None:
        raise UnsupportedCheckpointError(
            f"AutoEP+AutoTP folding ('{FOLDING}' metadata) is not supported: the expert and dense shards of each "
            "tp rank are not read", path)
    cfg = first.raw.get("ds_config")
    if isinstance(cfg, dict) and cfg.get("use_data_before_expert_parallel_"):
        raise UnsupportedCheckpointError(
            "AutoEP with use_data_before_expert_parallel_ is not supported: its expert-data-parallel groups are "
            "not the strided ones zerofast places", path)
    out = []
    for i, rec in enumerate(records):
        missing = [k for k in _REQUIRED if k not in rec]
        if missing:
            raise CorruptCheckpointError(f"{AUTOEP_LAYERS}[{i}] lacks {', '.join(missing)}", path)
        got = rec.get("checkpoint_format", "per_expert_files")
        if got != fmt:
            raise UnsupportedCheckpointError(
                f"{AUTOEP_LAYERS}[{i}] ({rec['module_path']!r}) has checkpoint_format {got!r}; only {fmt!r} is read "
                f"beside these files", path)
        n, local, ep = (rec["num_experts"], rec["num_local_experts"], rec["ep_size"])
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (n, local, ep)) or n != local * ep:
            raise InconsistentCheckpointError(
                f"{AUTOEP_LAYERS}[{i}]: num_experts {n!r} is not num_local_experts {local!r} x ep_size {ep!r}", path)
        if rec["moe_layer_id"] != i:
            raise InconsistentCheckpointError(f"{AUTOEP_LAYERS}[{i}] has moe_layer_id {rec['moe_layer_id']!r}", path)
        maps = rec["affine_maps"].get("params") if isinstance(rec["affine_maps"], dict) else None
        if not isinstance(maps, dict):
            raise CorruptCheckpointError(f"{AUTOEP_LAYERS}[{i}]: expected affine_maps.params", path)
        out.append(rec)
    if len({r["ep_size"] for r in out}) != 1:
        raise InconsistentCheckpointError(f"expected one ep_size over the AutoEP layers, found "
                                          f"{sorted({r['ep_size'] for r in out})}", path)
    return out


def _expert_file(path: Path, tree: Any) -> tuple[int, int, Path, dict]:
    m = moe.MOE_EXPERT.match(path.name)
    tensors = expect_mapping(path, expect_dict(path, tree, "an expert file"), "an expert file", torch.Tensor,
                             "tensors")
    return int(m.group(1)), int(m.group(2)), path, tensors


def load(files) -> PartitionedCheckpoint:
    first = read_model_states(files.model_files[0])
    records = _layer_records(first)
    ep = records[0]["ep_size"]
    zero_off = bool(files.optim_files) and files.optim_files[0].name.startswith("expp_rank_")
    optims = [] if zero_off else [read_optim_states(p, group_counts=True) for p in files.optim_files]
    stage = settle_stage(files, [first], optims)
    world = settle_world_size(files, stage, [first], optims)
    if stage == 0 and len(files.optim_files) != ep:
        raise InconsistentCheckpointError(
            f"expected one expp_rank optimizer file per expert-parallel rank (ep_size {ep}), found "
            f"{len(files.optim_files)}", files.tag_dir)
    if world % ep:
        raise InconsistentCheckpointError(f"AutoEP ep_size {ep} does not divide the world size {world}", first.path)
    experts = _experts(files, records)
    stored, frozen = _module_with_experts(first, records, experts)
    aliases = dict(first.shared_params or {})
    aliases.update(_router_aliases(first, records, stored))
    ckpt = PartitionedCheckpoint(files, stage, world, [first], optims, stored=stored, aliases=aliases,
                                 buffers=frozenset(first.buffer_names))
    ckpt.degrees = {"family": "mixture-of-experts (AutoEP)", "dp": world, "ep": ep,
                    "experts_per_layer": {r["module_path"]: r["num_experts"] for r in records}}
    ckpt.extra = {"records": records, "experts": experts, "frozen_experts": frozen}
    if stage != 0:
        ckpt.partitions = _partitions(ckpt, records, ep)
        ckpt.partition_ends = frozenset(p.ranks[-1] for p in ckpt.partitions)
        check_partitions(ckpt)
    ckpt.model_states = [merged_meta(first, stored, first.buffer_names, ckpt.aliases, first.param_shapes)]
    return ckpt


def _experts(files, records) -> dict[str, list[tuple[Path, torch.Tensor]]]:
    """``{prefix.wN: [(file, expert E's slice) for E in 0..num_experts-1]}``, every file checked."""
    by_layer: dict[int, dict[int, tuple[Path, dict]]] = {}
    for layer, expert, path, tensors in load_files(files.expert_files, _expert_file):
        by_layer.setdefault(layer, {})[expert] = (path, tensors)
    if sorted(by_layer) != list(range(len(records))):
        raise InconsistentCheckpointError(
            f"expected expert files for AutoEP layers 0..{len(records) - 1}, found layers {sorted(by_layer)}",
            files.tag_dir)
    out = {}
    for layer, rec in enumerate(records):
        got = by_layer[layer]
        if sorted(got) != list(range(rec["num_experts"])):
            raise InconsistentCheckpointError(
                f"expected experts 0..{rec['num_experts'] - 1} of AutoEP layer {layer} ({rec['module_path']!r}), "
                f"found files for {sorted(got)}", files.tag_dir)
        prefix = rec["expert_key_prefix"]
        for e, (path, tensors) in sorted(got.items()):
            want = {f"{prefix}.{w}.{e}" for w in WEIGHTS}
            if set(tensors) != want:
                raise InconsistentCheckpointError(
                    f"expected {sorted(want)} in the file of expert {e}, found {sorted(tensors)[:6]}", path)
        for w in WEIGHTS:
            slices = [(got[e][0], got[e][1][f"{prefix}.{w}.{e}"]) for e in range(rec["num_experts"])]
            if len({(tuple(t.shape), t.dtype) for _, t in slices}) != 1:
                raise InconsistentCheckpointError(f"the experts of {prefix}.{w} differ in shape or dtype",
                                                  slices[0][0])
            out[f"{prefix}.{w}"] = slices
    return out


def _module_with_experts(first, records, experts) -> tuple[dict[str, Stored], set[str]]:
    """The dense module with each layer's fused expert tensors after the rest of its layer (where
    ``state_dict()`` lists them), and the frozen ones' names. An expert tensor is in no one file:
    its place holds an empty tensor of the model dtype (so ``verify`` counts its master among those
    without a saved copy, as for sharded ones); the trainable ones are read from the optimizer's
    partitions, the frozen ones from the expert files (:func:`frozen_experts`)."""
    stored = {n: Stored(first.path, f"module[{n!r}]", t) for n, t in first.module.items()}
    trainable = {n for group in (first.param_shapes or []) for n in group}
    frozen = set()
    for rec in records:
        head = rec["module_path"] + "."
        names = list(stored)
        at = max((i + 1 for i, n in enumerate(names) if n.startswith(head)), default=len(names))
        added = {}
        for w in WEIGHTS:
            name = f"{rec['expert_key_prefix']}.{w}"
            path, t = experts[name][0]
            added[name] = Stored(path, f"experts of {name!r}", torch.empty(0, dtype=t.dtype))
            if first.param_shapes is not None and name not in trainable:
                frozen.add(name)  # ZeRO off records no param_shapes: stage0_masters tells
        stored = dict([*list(stored.items())[:at], *added.items(), *list(stored.items())[at:]])
    return stored, frozen


def _router_aliases(first, records, stored) -> dict[str, str]:
    """``mlp.<alias>.<rest>`` -> ``mlp.router.<rest>``: AutoEP registers the router a second time
    under the HF block's gate name, and the save holds both copies but no ``shared_params`` for
    them. A module entry that no list names (not a parameter, frozen parameter or buffer) with a
    ``router.`` twin is that alias when the two are equal bit for bit."""
    named = {n for group in (first.param_shapes or []) for n in group}
    named |= set(first.frozen_param_shapes or {}) | set(first.buffer_names)
    out = {}
    for rec in records:
        head = rec["module_path"] + "."
        for name, s in stored.items():
            if not name.startswith(head) or name in named or name.startswith(head + "router."):
                continue
            parts = name[len(head):].split(".", 1)
            twin = f"{head}router.{parts[1]}" if len(parts) == 2 else None
            if twin is None or twin not in stored:
                continue
            a, b = s.tensor, stored[twin].tensor
            if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a.reshape(-1).view(torch.uint8),
                                                                          b.reshape(-1).view(torch.uint8)):
                raise InconsistentCheckpointError(
                    f"{name!r} has no data of its own and differs from its router twin {twin!r}", first.path)
            out[name] = twin
    return out


def _partitions(ckpt: PartitionedCheckpoint, records, ep: int) -> list[Partition]:
    """Dense groups over every rank; each expert group once per ep rank e over ranks e, e+ep, ...,
    under internal names ``<name>@ep<e>`` that :func:`trainable` joins."""
    shapes = ckpt.meta.param_shapes
    o = ckpt.optim_states[0]
    if shapes is None or len(shapes) != len(o.flat_groups):
        raise InconsistentCheckpointError(
            f"expected one 'param_shapes' group per flat fp32 group ({len(o.flat_groups)}), found "
            f"{None if shapes is None else len(shapes)}", ckpt.meta.path)
    expert_groups = set(moe._expert_groups(o))
    counts = moe._partition_counts(o)
    W = ckpt.world_size
    fused = {f"{r['expert_key_prefix']}.{w}" for r in records for w in WEIGHTS}
    out = []
    for g, group in enumerate(shapes):
        if g not in expert_groups:
            if set(group) & fused:
                raise InconsistentCheckpointError(f"dense param group {g} holds AutoEP experts", ckpt.meta.path)
            out.append(Partition(tuple(range(W)), g, dict(group)))
            continue
        if counts[g] * ep != W:
            raise InconsistentCheckpointError(
                f"the expert group's partition count {counts[g]} is not world {W} / ep {ep}", o.path)
        stray = set(group) - fused
        if stray:
            raise InconsistentCheckpointError(f"expert group entries {sorted(stray)[:4]} name no AutoEP expert tensor",
                                              ckpt.meta.path)
        for e in range(ep):
            out.append(Partition(tuple(range(e, W, ep)), g, {f"{n}@ep{e}": s for n, s in group.items()}))
    return out


def trainable(ckpt: PartitionedCheckpoint, table: SourceTable, flats: FlatGroups, what: str) -> EntryTable:
    """Every trainable parameter in full: the dense ones as planned, each expert tensor joined from
    its ep ranks' shards by the save's ``affine_maps``."""
    found = partition_entries(ckpt, table, flats, what)
    shards: dict[str, dict[int, Entry]] = {}
    out: dict[str, Entry] = {}
    for name, entry in found.items():
        base, sep, rank = name.rpartition("@ep")
        if sep and rank.isdigit():
            shards.setdefault(base, {})[int(rank)] = entry
        else:
            out[name] = entry
    maps = {n: m for r in ckpt.extra["records"] for n, m in r["affine_maps"]["params"].items()}
    for name, per_rank in shards.items():
        out[name] = _join(ckpt, name, maps.get(name), per_rank)
    order = [n for n in ckpt.stored if n in out] + [n for n in out if n not in ckpt.stored]
    return EntryTable.of_entries({n: out[n] for n in order})


def _join(ckpt, name: str, amap: dict | None, per_rank: dict[int, Entry]) -> Entry:
    path = ckpt.meta.path
    if not isinstance(amap, dict) or not isinstance(amap.get("ranks"), dict):
        raise InconsistentCheckpointError(f"expected an affine_maps entry for AutoEP expert tensor {name!r}", path)
    shape = tuple(amap.get("logical_shape") or ())
    slices = ckpt.extra["experts"].get(name)
    full = (len(slices), *slices[0][1].shape) if slices else None
    if shape != full:
        raise InconsistentCheckpointError(
            f"{name!r}: affine_maps' logical_shape {list(shape)} is not its expert files' {full}", path)
    segs, covered = [], 0
    for e, shard in sorted(per_rank.items()):
        rank = amap["ranks"].get(e)
        if rank is None or tuple(rank.get("shard_shape") or ()) != tuple(shard[0]):
            raise InconsistentCheckpointError(f"{name!r}: affine_maps has no ep rank {e} of shape {list(shard[0])}",
                                              path)
        for piece in rank.get("pieces", []):
            segs += piece_segments(name, piece, shard, path)
            covered += math.prod(piece["shape"])
    if covered != math.prod(shape) or len(per_rank) != len(amap["ranks"]):
        raise InconsistentCheckpointError(
            f"the affine_maps pieces of {name!r} cover {covered} of its {math.prod(shape)} elements", path)
    return shape, per_rank[0][1], segs


def stage0_masters(ckpt: PartitionedCheckpoint, table: SourceTable) -> dict[str, Entry]:
    """ZeRO off: each expert-parallel rank's masters sit unnamed in its ``expp_rank`` file (the
    dense ones on every rank, its local experts after them). They are matched by value, as for a
    native MoE save: ep rank 0's against the dense module, each rank's against its local experts
    (``[num_local, ...]``, stacked from the expert files in its ``expert_placement`` order, held in
    memory), then the experts joined as at ZeRO 1-2. An expert tensor without a master is frozen."""
    records = ckpt.extra["records"]
    ep = ckpt.degrees["ep"]
    experts = ckpt.extra["experts"]
    fused = {f"{r['expert_key_prefix']}.{w}": r for r in records for w in WEIGHTS}
    dense = {n: s.tensor for n, s in ckpt.stored.items() if n not in fused and n not in ckpt.aliases}
    out: dict[str, Entry] = {}
    shards: dict[str, dict[int, Entry]] = {}
    for e, path in enumerate(ckpt.files.optim_files):
        raw = expect_dict(path, load_file(path), "an expp_rank optimizer file")
        mine = dict(dense)  # every rank's file holds the dense masters too; rank 0's are kept
        for name, rec in fused.items():
            mine[f"{name}@ep{e}"] = torch.stack([experts[name][i][1] for i in _placed(rec, e, path)])
        meta = dataclasses.replace(ckpt.meta, path=Path(path), module=mine, param_shapes=None, raw=raw,
                                   shared_params={}, buffer_names=[n for n in ckpt.meta.buffer_names if n in mine])
        view = LoadedCheckpoint(ckpt.files, 0, ckpt.world_size, [meta], [])
        for name, entry in stage0.trainable(view, table, exclude_frozen=False).items():
            base, sep, rank = name.rpartition("@ep")
            if sep and rank.isdigit():
                shards.setdefault(base, {})[int(rank)] = entry
            elif e == 0:
                out[name] = entry
    maps = {n: m for r in records for n, m in r["affine_maps"]["params"].items()}
    frozen = set()
    for name in fused:
        got = shards.get(name, {})
        if not got:
            frozen.add(name)
            continue
        if len(got) != ep:
            raise InconsistentCheckpointError(
                f"{name!r} has fp32 masters on expert-parallel ranks {sorted(got)} only, not all {ep}",
                ckpt.files.optim_files[0])
        out[name] = _join(ckpt, name, maps.get(name), got)
    ckpt.extra["frozen_experts"] = frozen
    return out


def _placed(rec: dict, e: int, path: Path) -> list[int]:
    """The global expert ids ep rank ``e`` holds, in its local order (``expert_placement``)."""
    placement = rec.get("expert_placement")
    ranks = placement.get("ranks") if isinstance(placement, dict) else None
    mine = [x.get("experts") for x in ranks or [] if isinstance(x, dict) and x.get("rank") == e]
    if len(mine) != 1 or not isinstance(mine[0], (list, tuple)) or len(mine[0]) != rec["num_local_experts"] or \
            not all(isinstance(i, int) and 0 <= i < rec["num_experts"] for i in mine[0]):
        raise CorruptCheckpointError(
            f"expected expert_placement of {rec['module_path']!r} to list ep rank {e}'s "
            f"{rec['num_local_experts']} experts", path)
    return list(mine[0])


def frozen_experts(ckpt: PartitionedCheckpoint, table: SourceTable) -> dict[str, Entry]:
    """Each frozen expert tensor from its experts' files: expert E's slice at row E."""
    out = {}
    for name in ckpt.extra["frozen_experts"]:
        slices = ckpt.extra["experts"][name]
        n = slices[0][1].numel()
        segs = []
        for e, (path, t) in enumerate(slices):
            _, _, whole = table.whole(str(path), f"[{f'{name}.{e}'!r}]", t)
            segs += [(src, s_off, e * n + d_off, length) for src, s_off, d_off, length in whole]
        out[name] = ((len(slices), *slices[0][1].shape), slices[0][1].dtype, segs)
    return out


LAYOUT = AutoEPLayout()
