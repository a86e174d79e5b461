"""Mixture-of-experts saves with Megatron-DeepSpeed tensor parallelism (a ``deepspeed.moe.layer.MoE``
in a model trained with an ``mpu``: Megatron-DeepSpeed's MoE GPT), ZeRO 1 and 2.

On disk (DeepSpeed 0.19.8), global rank = dp * T + tp as the mpu orders them:
- the files of :mod:`.autotp`: ``mp_rank_{tp:02d}_model_states.pt`` per tp rank, its ``module``
  (without the experts) and ``param_shapes`` holding that rank's shards, and
  ``[bf16_]zero_pp_rank_{dp}_mp_rank_{tp:02d}_optim_states.pt`` per rank;
- ``layer_{L}_expert_{E}_mp_rank_{tp:02d}_model_states.pt``: expert E (global id) of MoE layer L as
  the rank that wrote it holds it, in the model dtype;
- in each optimizer file the expert param groups (``'moe': True``) hold the local experts of the
  rank's expert-parallel rank; ``param_shapes`` names them by local id, as :mod:`.moe` reads.

Two arrangements, told apart by the expert files:
- whole experts (``enable_expert_tensor_parallelism=False``, Megatron-DeepSpeed's default): DeepSpeed
  makes the expert groups without the mpu, over the global ranks (``groups._create_expert_and_data_parallel``):
  rank r is expert-parallel rank ``r % ep``, its expert groups partitioned over the ranks
  ``r % ep, r % ep + ep, ...``. Only the first of those writes expert files, so each expert has
  one file, that of global rank ``E // num_local``'s tp rank;
- tensor-parallel experts (``enable_expert_tensor_parallelism=True``): the groups are made inside
  each tp rank's data-parallel group (``_create_expert_data_and_model_parallel``): dp rank d is
  expert-parallel rank ``d % ep``, partitioned over dp ranks ``d % ep, d % ep + ep, ...`` of the
  same tp rank. Every tp rank writes its shard of every expert, and the shards are joined by the
  rules that join the dense ones (:mod:`.tp_rules`, from ``universal_checkpoint_info``).

The dense part is planned by :mod:`.autotp` on a view of the save without the expert groups; the
experts by :mod:`.moe`'s partitions (per tp rank where they are tensor-parallel, then joined).
"""
from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..base import keys as K
from ..base.errors import IncompleteCheckpointError, InconsistentCheckpointError, UnsupportedCheckpointError
from ..discover import Found, other_model_parallel_rank
from ..load import PartitionedCheckpoint, Partition, Stored, load_files
from ..load.checkpoint import check_partitions, merged_meta
from ..load.records import (check_flat_groups, expect_dict, expect_int, expect_list, expect_mapping,
                            read_model_states, read_optim_states, settle_stage)
from ..plan.columns import EntryTable
from ..plan.model import Entry, FlatGroups, SourceTable
from ..plan.partitioned import partition_entries
from . import autotp, moe, moe_pipe, tp_join
from .autotp import TensorParallelFiles
from .base import PartitionedLayout
from .pipeline import PIPE_LAYER

EXPERT_FILE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_EXPP = re.compile(r"^expp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
WHOLE, SPLIT = "whole", "tensor-parallel"


@dataclass(frozen=True)
class MoETPFiles(TensorParallelFiles):
    expert_files: tuple[Path, ...] = ()  # by (tp rank, layer, global expert id)

    def paths(self) -> tuple[Path, ...]:
        return super().paths() + self.expert_files


class MoETPLayout(PartitionedLayout):
    name = "moe_tp"
    title = "mixture-of-experts with tensor parallelism"
    subsumes = ("moe", "autotp")  # its expert files are MoE's, its mp_rank_01 files tensor parallelism's

    def claims(self, found: Found) -> str | None:
        if any(PIPE_LAYER.match(n) for n in found.names):
            return None  # a pipeline's: the registry refuses experts together with pipeline stages
        mark = next((n for n in found.names if EXPERT_FILE.match(n) or _EXPP.match(n)), None)
        return mark if mark is not None and other_model_parallel_rank(found.names) else None

    def list_files(self, found: Found) -> MoETPFiles:
        expp = next((n for n in found.names if _EXPP.match(n)), None)
        if expp is not None:
            raise UnsupportedCheckpointError(
                f"mixture-of-experts saves with tensor parallelism without ZeRO (found {expp}) are not supported, "
                "as tensor-parallel saves without ZeRO are not", found.tag_dir)
        base = autotp.tp_files(self, found)
        experts = sorted((int(m.group(3)), int(m.group(1)), int(m.group(2)), n)
                         for n in found.names if (m := EXPERT_FILE.match(n)))
        return MoETPFiles(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
                          expert_files=tuple(found.tag_dir / n for *_, n in experts))

    def load(self, files: MoETPFiles) -> PartitionedCheckpoint:
        return load(files)

    def trainable_from(self, ckpt: PartitionedCheckpoint, table: SourceTable, flats: FlatGroups,
                       what: str) -> EntryTable:
        return trainable(ckpt, table, flats, what)

    def stored_entries(self, ckpt: PartitionedCheckpoint, table: SourceTable) -> dict[str, Entry]:
        return {**autotp.frozen_entries(ckpt.extra["dense"], table), **_frozen_experts(ckpt, table)}


# Why a tp rank's model states can be missing from a save DeepSpeed 0.19.8 completed without error.
_LOST_MODEL_STATES = (
    "; DeepSpeed 0.19.8's MoE save (engine._save_moe_checkpoint) writes a tp rank's model states only from "
    "a rank that is data-parallel rank 0 and expert-data-parallel rank 0, so whole experts (expert groups over "
    "the global ranks) at an expert-parallel degree below the tensor-parallel degree leave the tp ranks from ep "
    "on without theirs: their shards' names and shapes and their frozen shards are not in the save")


def load(files: MoETPFiles) -> PartitionedCheckpoint:
    if files.incomplete:
        lost = len([p for p in files.model_files if p.name.startswith("mp_rank_")]) < files.mp_size
        raise IncompleteCheckpointError(files.incomplete + (_LOST_MODEL_STATES if lost else ""), files.tag_dir)
    T = files.mp_size
    models = [read_model_states(p) for p in files.model_files]
    first = models[0]
    if first.raw.get("ds_autoep_layers") or first.raw.get("autoep_layers"):
        raise UnsupportedCheckpointError("this tensor-parallel mixture-of-experts save is DeepSpeed AutoEP's "
                                         "('ds_autoep_layers'), which this layout does not read", first.path)
    pp = moe_pipe.pipeline_degree(first)
    if pp is not None and pp > 1:  # mp_rank_XX are pipeline stages: the MoE pipeline layout reads it
        return moe_pipe.load(files)
    optims = [read_optim_states(p, group_counts=True) for p in files.optim_files]
    stage = settle_stage(files, models, optims)
    if stage not in (1, 2):
        raise UnsupportedCheckpointError(
            f"mixture-of-experts saves with tensor parallelism are read at ZeRO 1 and 2, this one is stage {stage}",
            files.tag_dir)
    W = len(optims)
    dp = W // T
    for ms in models:
        autotp._check_degrees(ms, T)
    experts = moe._expert_groups(optims[0])
    counts = moe._partition_counts(optims[0])
    dense = [g for g in range(len(counts)) if g not in experts]
    for g in dense:
        if counts[g] != dp:
            raise InconsistentCheckpointError(f"expected the dense group {g} partitioned over the {dp} data-parallel "
                                              f"ranks of a tp rank, found partition_count {counts}", optims[0].path)
    for m in models:
        if m.param_shapes is None or len(m.param_shapes) != len(counts):
            raise InconsistentCheckpointError(f"expected one 'param_shapes' group per flat fp32 group ({len(counts)})",
                                              m.path)
    num_experts = _num_experts(models)
    arrangement, layers, held = _experts(files, num_experts, T)
    ep = _ep_degree(optims[0], experts, counts, W if arrangement == WHOLE else dp, layers)
    info = first.raw.get(K.UNIVERSAL_INFO)
    info = info if isinstance(info, dict) else {}
    dense_metas = [dataclasses.replace(m, param_shapes=[m.param_shapes[g] for g in dense]) for m in models]
    dense_names = [n for g in dense_metas[0].param_shapes for n in g]
    rules = tp_join.rules_of(info, first.path, dense_names)
    if rules is None:
        raise UnsupportedCheckpointError("mixture-of-experts with AutoTP (an affine_map in universal_checkpoint_info) "
                                         "is not supported", first.path)
    dense_optims = [_narrowed(o, dense) for o in optims]
    for t in range(T):
        check_flat_groups(stage, [dense_optims[d * T + t] for d in range(dp)])
    dense_stored = {n: Stored(first.path, f"module[{n!r}]", t) for n, t in first.module.items()}
    view = PartitionedCheckpoint(files, stage, W, dense_metas, dense_optims, stored=dense_stored,
                                 aliases=dict(first.shared_params), buffers=frozenset(first.buffer_names),
                                 extra={"maps": {}, "replicated": set(), "rules": rules})
    autotp._check_frozen(view, dense_metas, {})
    stored = moe._module_with_experts(first, layers)
    ckpt = PartitionedCheckpoint(files, stage, W, models, optims, stored=stored, aliases=dict(first.shared_params),
                                 buffers=frozenset(first.buffer_names))
    by_tp = _partitions(ckpt, models, experts, layers, ep, arrangement, T, dp)
    ckpt.partitions = [p for parts in by_tp for p in parts]
    check_partitions(ckpt)
    ckpt.partition_ends = frozenset({(dp - 1) * T + t for t in range(T)} | {p.ranks[-1] for p in ckpt.partitions})
    ckpt.extra = {"dense": view, "dense_groups": dense, "arrangement": arrangement, "by_tp": by_tp, "held": held,
                  "rules": rules}
    labels = tp_join.rule_labels(rules, [{n: tuple(s) for g in m.param_shapes for n, s in g.items()}
                                         for m in dense_metas], first.path)
    labels.update(_expert_labels(rules, by_tp, arrangement, first.path))
    ckpt.degrees = {"family": "mixture-of-experts with tensor parallelism (Megatron-DeepSpeed)", "dp": dp, "ep": ep,
                    "tp": T, "experts": arrangement, "tp_rules": labels,
                    "experts_per_layer": {prefix[:-len(moe.EXPERTS)]: n for prefix, (_, n) in layers.items()}}
    ckpt.model_states = [merged_meta(first, stored, first.buffer_names, ckpt.aliases, first.param_shapes), *models[1:]]
    return ckpt


def _num_experts(models) -> list[int]:
    out = None
    for m in models:
        found = [expect_int(m.path, n, "each 'num_experts' entry", 1)
                 for n in expect_list(m.path, m.raw.get(K.NUM_EXPERTS), "'num_experts'")]
        if out is not None and found != out:
            raise InconsistentCheckpointError(f"expected 'num_experts' {out} on every tp rank, found {found}", m.path)
        out = found
    return out


def _expert_file(path: Path, tree: Any) -> tuple[int, int, int, Path, dict]:
    m = EXPERT_FILE.match(path.name)
    tensors = expect_mapping(path, expect_dict(path, tree, "an expert file"), "an expert file", torch.Tensor,
                             "tensors")
    return int(m.group(1)), int(m.group(2)), int(m.group(3)), path, tensors


def _experts(files: MoETPFiles, num_experts: list[int], T: int):
    """The arrangement (:data:`WHOLE` or :data:`SPLIT`), the layers as :mod:`.moe` lists them (the
    whole experts, or tp rank 0's shards), and per tp rank ``{name: (file, tensor)}`` of its expert files."""
    items = load_files(files.expert_files, _expert_file)
    holders = defaultdict(set)
    for layer, expert, t, _, _ in items:
        holders[layer, expert].add(t)
    held = [{} for _ in range(T)]
    for _, _, t, path, tensors in items:
        if t >= T:
            raise InconsistentCheckpointError(f"expected expert files of tp ranks 0..{T - 1}, found {path.name}", path)
        held[t].update((n, (path, v)) for n, v in tensors.items())
    if all(len(ts) == T for ts in holders.values()):
        per_tp = [moe.expert_layers([(la, e, p, ts) for la, e, t_, p, ts in items if t_ == t], num_experts,
                                    files.tag_dir, f" of tp rank {t}") for t in range(T)]
        return SPLIT, per_tp[0], held
    several = next(((k, ts) for k, ts in sorted(holders.items()) if len(ts) > 1), None)
    if several is not None:
        other = next(((k, ts) for k, ts in sorted(holders.items()) if len(ts) != len(several[1])), None)
        found = [f"expert {e} of MoE layer {la} on tp ranks {sorted(ts)}"
                 for (la, e), ts in filter(None, (several, other))]
        raise InconsistentCheckpointError(
            f"expected each expert's file on one tensor-parallel rank (whole experts) or on all {T} (tensor-parallel "
            f"experts), found {' but '.join(found)}", files.tag_dir)
    layers = moe.expert_layers([(la, e, p, ts) for la, e, _, p, ts in items], num_experts, files.tag_dir)
    return WHOLE, layers, held


def _ep_degree(o, experts: list[int], counts: list[int], over: int, layers) -> int:
    """The expert-parallel degree, from the expert groups' partition counts: their ranks are
    ``over / ep`` (whole experts: of the global ranks; tensor-parallel ones: of a tp rank's dp ranks)."""
    if not experts:
        raise InconsistentCheckpointError("expected expert param groups ('moe': True) next to the expert files, "
                                          "found none", o.path)
    degrees = {over // counts[g] for g in experts if over % counts[g] == 0}
    if len(degrees) != 1 or any(over % counts[g] for g in experts):
        raise InconsistentCheckpointError(f"expected one expert-parallel degree dividing {over} ranks, found "
                                          f"partition counts {counts}", o.path)
    ep = degrees.pop()
    for prefix, (_, n) in layers.items():
        if n % ep:
            raise InconsistentCheckpointError(f"{n} experts in {prefix.rstrip('.')!r} do not split over "
                                              f"expert-parallel degree {ep}", o.path)
    return ep


def _narrowed(o, groups: list[int]):
    """Optimizer file ``o`` seen as if it held the flat ``groups`` alone."""
    pads = o.param_alignment_paddings
    keep = None if pads is None or any(g >= len(pads) for g in groups) else [pads[g] for g in groups]
    return dataclasses.replace(o, flat_groups=[o.flat_groups[g] for g in groups], param_alignment_paddings=keep)


def _partitions(ckpt, models, experts, layers, ep: int, arrangement: str, T: int, dp: int) -> list[list[Partition]]:
    """The expert partitions: one list of all of them (whole experts), or one per tp rank."""
    out = []
    for t in range(1 if arrangement == WHOLE else T):
        parts = []
        for g in experts:
            local = moe._local_experts(ckpt, models[t].param_shapes[g], layers, ep)
            for e in range(ep):
                if arrangement == WHOLE:
                    ranks = tuple(range(e, T * dp, ep))
                    _check_writer(ckpt, layers, local, e, ranks[0] % T)
                else:
                    ranks = tuple(d * T + t for d in range(e, dp, ep))
                parts.append(Partition(ranks, g, {f"{prefix}{e * n + x}{rest}": shape
                                                  for prefix, x, rest, n, shape in local}))
        out.append(parts)
    return out


def _check_writer(ckpt, layers, local, e: int, tp: int) -> None:
    """Whole experts: ep rank e's experts were written by global rank e, so they sit in its tp
    rank's files; any other placement is a grouping this layout does not know, refused."""
    for prefix, x, _, n, _ in local:
        expert = e * n + x
        path = next(p for i, p, _ in layers[prefix][0] if i == expert)
        if int(EXPERT_FILE.match(path.name).group(3)) != tp:
            raise UnsupportedCheckpointError(
                f"expert {expert} of {prefix.rstrip('.')!r} is in {path.name}, but with DeepSpeed's expert groups "
                f"over the global ranks its writer is tp rank {tp}'s: an expert grouping this layout does not know",
                path)


def _expert_labels(rules, by_tp, arrangement: str, path) -> dict[str, str]:
    if arrangement == WHOLE:
        return {n: "whole (expert)" for p in by_tp[0] for n in p.shapes}
    shapes = [{n: tuple(s) for p in parts for n, s in p.shapes.items()} for parts in by_tp]
    return tp_join.rule_labels(rules, shapes, path)


def trainable(ckpt: PartitionedCheckpoint, table: SourceTable, flats: FlatGroups, what: str) -> EntryTable:
    """The dense parameters joined over the tp ranks by :mod:`.autotp`; the experts read from their
    partitions, and joined over the tp ranks by the rules where they are tensor-parallel."""
    dense = ckpt.extra["dense_groups"]
    view = ckpt.extra["dense"]
    parts = [autotp.trainable(view, table, [[groups[g] for g in dense] for groups in flats], what)]
    shards = [partition_entries(ckpt, table, flats, what, p) for p in ckpt.extra["by_tp"]]
    if ckpt.extra["arrangement"] == WHOLE:
        parts += shards
    else:
        paths = [m.path for m in view.model_states]
        parts.append(EntryTable.of_entries({
            name: tp_join.join_entry(ckpt.extra["rules"], table, name, [s[name] if name in s.keys() else None
                                                                       for s in shards], what, paths)
            for name in shards[0].names}))
    return EntryTable.join(parts)


def _frozen_experts(ckpt: PartitionedCheckpoint, table: SourceTable) -> dict[str, Entry]:
    """Tensor-parallel experts that no optimizer holds: each put together from every tp rank's
    expert file by the rules (whole experts are read from their one file as they are)."""
    if ckpt.extra["arrangement"] == WHOLE:
        return {}
    trainable = {n for p in ckpt.partitions for n in p.shapes}
    held = ckpt.extra["held"]
    out = {}
    for name in held[0]:
        if name in trainable:
            continue
        if any(name not in h for h in held):
            raise InconsistentCheckpointError(f"expected {name!r} in the expert files of every tp rank",
                                              held[0][name][0])
        slices = [table.whole(str(h[name][0]), f"[{name!r}]", h[name][1]) for h in held]
        out[name] = tp_join.join_entry(ckpt.extra["rules"], table, name, slices, "frozen weights",
                                       [h[name][0] for h in held])
    return out


LAYOUT = MoETPLayout()
