"""Mixture-of-experts with pipeline parallelism: a ``deepspeed.pipe.PipelineModule`` whose every stage
holds ``deepspeed.moe.layer.MoE`` layers, ZeRO 1 (also with the BF16_Optimizer).

On disk (DeepSpeed 0.19.8), for P stages and D data-parallel ranks per stage (global rank
``s * D + d``, the pipeline's topology), written through DeepSpeed's MoE save, not the pipeline's:
- no ``layer_NN-model_states.pt`` files: ``mp_rank_{s:02d}_model_states.pt`` holds stage s's
  ``module`` under PipelineModule names (``1.moe.deepspeed_moe.gate.wg.weight``), the experts left
  out; ``param_shapes`` names the stage's dense group(s) and its expert group(s), these by the local
  ids of expert-parallel rank 0; ``num_experts`` lists the stage's MoE layers only;
  ``checkpoint_parallel_dimensions`` says ``pp_degree`` P (the file names alone look like tensor
  parallelism: :mod:`.moe_tp` hands such a save over here);
- ``[bf16_]zero_pp_rank_{d}_mp_rank_{s:02d}_optim_states.pt``: stage s's masters; its expert groups
  (``'moe': True``) hold expert-parallel rank ``d % ep``'s experts, partitioned over the stage's dp
  ranks ``d % ep, d % ep + ep, ...`` (``groups._get_expert_parallel_ranks`` per stage);
- ``layer_{L}_expert_{E}_mp_rank_{s:02d}_model_states.pt``: expert E (global id) of the stage's L-th
  MoE layer (L counted within the stage: every stage's first one is ``layer_0``), its tensors under
  the PipelineModule name of their layer.

Each stage's expert files are read as :mod:`.moe` reads a save's; the layer a file's L means is told
by its tensors' names, which must be the stage's L-th MoE layer (its gate in that stage's module, in
module order): a file whose names say otherwise is refused, not guessed. Output names are
PipelineModule's, in layer order, the experts by global id after their gate.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..base import keys as K
from ..base.errors import InconsistentCheckpointError, UnsupportedCheckpointError
from ..discover import CheckpointFiles
from ..load import PartitionedCheckpoint, Partition, load_files
from ..load.checkpoint import check_partitions, merged_meta
from ..load.records import (expect_dict, expect_int, expect_list, expect_mapping, read_model_states, read_optim_states,
                            settle_stage)
from . import moe, pipeline
from .base import PartitionedLayout

EXPERT_FILE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


@dataclass(frozen=True)
class MoEPipelineFiles(CheckpointFiles):
    expert_files: tuple[Path, ...] = ()  # by (stage, layer within the stage, global expert id)

    def paths(self) -> tuple[Path, ...]:
        return super().paths() + self.expert_files


class MoEPipelineLayout(PartitionedLayout):
    """Claims nothing by itself: its file names are those of :mod:`.moe_tp`, whose ``load`` finds
    ``pp_degree`` > 1 in the model states and hands the files to :func:`load`."""

    name = "moe_pipe"
    title = "mixture-of-experts with pipeline parallelism"

    def claims(self, found) -> str | None:
        return None

    def load(self, files: CheckpointFiles) -> PartitionedCheckpoint:
        return load(files)


def pipeline_degree(ms) -> int | None:
    """``checkpoint_parallel_dimensions``' ``pp_degree`` of model states ``ms``, where it is an int."""
    dims = ms.raw.get(K.PARALLEL_DIMENSIONS)
    pp = dims.get(K.PP_DEGREE) if isinstance(dims, dict) else None
    return pp if type(pp) is int else None


def relisted(files: CheckpointFiles) -> MoEPipelineFiles:
    """The files another layout listed (global-rank order ``dp * T + tp``), re-listed stage by stage,
    the optimizer files in the pipeline's rank order ``stage * D + dp``."""
    def optim_key(p: Path):
        m = OPTIM.match(p.name)
        if m is None:
            raise UnsupportedCheckpointError(f"{p.name} in a mixture-of-experts pipeline save is not supported", p)
        return int(m.group(3)), int(m.group(2))

    experts = sorted((int(m.group(3)), int(m.group(1)), int(m.group(2)), p)
                     for p in getattr(files, "expert_files", ()) if (m := EXPERT_FILE.match(p.name)))
    return MoEPipelineFiles(files.root, files.tag, files.tag_dir, tuple(files.model_files),
                            tuple(sorted(files.optim_files, key=optim_key)), layout=LAYOUT,
                            expert_files=tuple(p for *_, p in experts))


def load(files: CheckpointFiles) -> PartitionedCheckpoint:
    files = relisted(files)
    stages = [read_model_states(p) for p in files.model_files]
    P = len(stages)
    for ms in stages:
        pipeline._check_degree(ms, P, 1)
        config = ms.raw.get(K.DS_CONFIG)
        if isinstance(config, dict) and config.get("use_data_before_expert_parallelism"):
            raise UnsupportedCheckpointError("a mixture-of-experts pipeline save with "
                                             "use_data_before_expert_parallelism is not supported", ms.path)
        tied = next((n for n in ms.module if pipeline.TIED.match(n)), None)
        if tied is not None:
            raise UnsupportedCheckpointError(
                f"tied modules ({tied!r}) in a mixture-of-experts pipeline save are not supported", ms.path)
    optims = [read_optim_states(p, group_counts=True) for p in files.optim_files]
    stage = settle_stage(files, stages, optims)
    if stage != 1 or len(optims) % P:
        raise UnsupportedCheckpointError(
            f"mixture-of-experts pipeline saves are read at ZeRO 1, this one is stage {stage} with {len(optims)} "
            f"optimizer files for {P} stages", files.tag_dir)
    D = len(optims) // P
    items = load_files(files.expert_files, _expert_file)
    ckpt = PartitionedCheckpoint(files, stage, D * P, stages, optims, buffers=frozenset(
        n for ms in stages for n in ms.buffer_names))
    per_stage, ep_of, shapes = [], set(), []
    for s, ms in enumerate(stages):
        layers = _stage_layers(files, ms, s, [(la, e, p, ts) for st, la, e, p, ts in items if st == s])
        view = PartitionedCheckpoint(files, stage, D, [ms], optims[s * D:(s + 1) * D])
        ep, parts = _stage_partitions(view, ms, layers, s * D, D)
        ep_of.add(ep)
        per_stage.append((layers, parts))
        shapes += list(ms.param_shapes)
        for name, t in moe._module_with_experts(ms, layers).items():
            if name in ckpt.stored:
                raise InconsistentCheckpointError(f"{name!r} is in the module of two stages", ms.path)
            ckpt.stored[name] = t
    if len(ep_of) != 1:
        raise InconsistentCheckpointError(f"expected one expert-parallel degree over the stages, found {sorted(ep_of)}",
                                          files.tag_dir)
    ckpt.partitions = [p for _, parts in per_stage for p in parts]
    ckpt.partition_ends = frozenset(p.ranks[-1] for p in ckpt.partitions)
    check_partitions(ckpt)
    ckpt.degrees = {"family": "mixture-of-experts with pipeline parallelism", "dp": D, "ep": ep_of.pop(), "pp": P,
                    "stages": [_layer_indices(ms) for ms in stages],
                    "experts_per_layer": {prefix[:-len(moe.EXPERTS)]: n for layers, _ in per_stage
                                          for prefix, (_, n) in layers.items()}}
    ckpt.model_states = [merged_meta(stages[0], ckpt.stored, ckpt.buffers, {}, shapes), *stages[1:]]
    return ckpt


def _expert_file(path: Path, tree) -> tuple[int, int, int, Path, dict]:
    """(stage, layer within the stage, global expert id, path, {name: tensor}) of one expert file."""
    m = EXPERT_FILE.match(path.name)
    tensors = expect_mapping(path, expect_dict(path, tree, "an expert file"), "an expert file", torch.Tensor,
                             "tensors")
    return int(m.group(3)), int(m.group(1)), int(m.group(2)), path, tensors


def _stage_layers(files, ms, s: int, items) -> dict:
    """Stage s's MoE layers as :func:`.moe.expert_layers` lists them, each file's L checked to be the
    stage's L-th MoE layer: the gates of the stage's module, in module order, name them."""
    num = [expect_int(ms.path, n, "each 'num_experts' entry", 1)
           for n in expect_list(ms.path, ms.raw.get(K.NUM_EXPERTS), "'num_experts'")]
    layers = moe.expert_layers(items, num, files.tag_dir, f" of stage {s} (mp_rank_{s:02d})")
    gates = [n[:-len("gate.wg.weight")] for n in ms.module if n.endswith(".deepspeed_moe.gate.wg.weight")]
    heads = [prefix[:-len("experts.deepspeed_experts.")] for prefix in layers]
    if heads != gates:
        where = next(((la, p) for la, (experts, _) in enumerate(layers.values())
                      for _, p, _ in experts[:1] if la >= len(gates) or heads[la] != gates[la]), (0, files.tag_dir))
        raise UnsupportedCheckpointError(
            f"stage {s}'s expert files name the MoE layers {[h.rstrip('.') for h in heads]} in their tensors, but "
            f"its module's gates are {[g.rstrip('.') for g in gates]}: which layer layer_{where[0]} is cannot be "
            "told", where[1])
    return layers


def _stage_partitions(view: PartitionedCheckpoint, ms, layers: dict, first: int, D: int):
    """Stage s's partitions over optimizer files ``first .. first + D``: the dense groups over all D,
    each expert group's ep rank e over ``first + e, first + e + ep, ...``, renamed to global ids."""
    o = view.optim_states[0]
    experts, counts = moe._expert_groups(o), moe._partition_counts(o)
    if not experts or any(D % counts[g] for g in experts) or len({D // counts[g] for g in experts}) != 1:
        raise InconsistentCheckpointError(f"expected expert groups partitioned over a divisor of the stage's {D} "
                                          f"data-parallel ranks, found partition counts {counts}", o.path)
    ep = D // counts[experts[0]]
    if ms.param_shapes is None or len(ms.param_shapes) != len(counts):
        raise InconsistentCheckpointError(f"expected one 'param_shapes' group per flat fp32 group ({len(counts)})",
                                          ms.path)
    for prefix, (_, n) in layers.items():
        if n % ep:
            raise InconsistentCheckpointError(f"{n} experts in {prefix.rstrip('.')!r} do not split over "
                                              f"expert-parallel degree {ep}", ms.path)
    out = []
    for g, group in enumerate(ms.param_shapes):
        if g not in experts:
            if counts[g] != D:
                raise InconsistentCheckpointError(f"expected the dense group {g} partitioned over the stage's {D} "
                                                  f"data-parallel ranks, found partition counts {counts}", o.path)
            out.append(Partition(tuple(range(first, first + D)), g, dict(group)))
            continue
        local = moe._local_experts(view, group, layers, ep)
        for e in range(ep):
            out.append(Partition(tuple(first + d for d in range(e, D, ep)), g,
                                 {f"{prefix}{e * n + x}{rest}": shape for prefix, x, rest, n, shape in local}))
    return ep, out


def _layer_indices(ms) -> list[int]:
    return sorted({int(h) for n in ms.module for h in [n.split(".", 1)[0]] if h.isdigit()})


LAYOUT = MoEPipelineLayout()
