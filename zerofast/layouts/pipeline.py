"""Pipeline-parallel saves (``deepspeed.pipe.PipelineModule``), ZeRO 0 and 1.

On disk (DeepSpeed 0.19.8), for P stages and D data-parallel ranks per stage:
- ``mp_rank_{s:02d}_model_states.pt`` per stage s: ``module`` is None; ``param_shapes`` lists the
  stage's trainable parameters under PipelineModule names (``1.up.weight``,
  ``tied_modules.embed.weight``); ``buffer_names`` likewise;
- ``[bf16_]zero_pp_rank_{d}_mp_rank_{s:02d}_optim_states.pt``: stage s's masters, an ordinary ZeRO
  partition over its D ranks (also with the BF16_Optimizer, which records no ``zero_stage``);
- ``layer_{NN:02d}-model_states.pt``: layer NN's own ``state_dict()`` (layer-local keys, model
  dtype), written once by data-parallel rank 0 of its stage. Frozen parameters and buffer values
  exist only here. A tied module (``TiedLayerSpec``) is saved once, in the file of its first
  layer; nothing says so but the names: its keys are ``tied_modules.<key>.*`` in the stages'
  ``param_shapes``/``buffer_names``. Every stage using it holds an equal fp32 master.

Output names are PipelineModule's, in layer order. :func:`zerofast.sequential_names` maps them to
the names of the same layers in one ``nn.Sequential``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..base import keys as K
from ..discover import CheckpointFiles, Found, ranked
from ..base.errors import IncompleteCheckpointError, InconsistentCheckpointError, UnsupportedCheckpointError
from ..load import PartitionedCheckpoint, Partition, Stored, load_file
from ..load.checkpoint import check_partitions, merged_meta
from ..load.records import expect_dict, expect_mapping, read_model_states, read_optim_states, settle_stage
from ..plan.model import Entry, SourceTable
from .base import PartitionedLayout

# "layer_<NN>-model_states.pt" next to one "mp_rank_<SS>_model_states.pt" per stage.
PIPE_LAYER = re.compile(r"^layer_(\d+)-model_states\.pt$")
PIPE_MODEL = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
PIPE_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


@dataclass(frozen=True)
class PipelineFiles(CheckpointFiles):
    layer_files: tuple[Path, ...] = ()  # one per saved layer, in layer order

    def paths(self) -> tuple[Path, ...]:
        return super().paths() + self.layer_files


class PipelineLayout(PartitionedLayout):
    name = "pipeline"
    title = "pipeline"
    subsumes = ("autotp",)  # a pipeline's later stages write mp_rank_01... files too

    def claims(self, found: Found) -> str | None:
        return next((n for n in found.names if PIPE_LAYER.match(n)), None)

    def list_files(self, found: Found) -> PipelineFiles:
        return _files(self, found)

    def load(self, files: PipelineFiles) -> PartitionedCheckpoint:
        return load(files)

    def stage0_masters(self, ckpt: PartitionedCheckpoint, table: SourceTable) -> dict[str, Entry]:
        return stage0_masters(ckpt, table)


def _files(layout: "PipelineLayout", found: Found) -> "PipelineFiles":
    """One model-states file per stage, optimizer files per (stage, data-parallel rank), layer files."""
    root, tag, tag_dir, names = found.root, found.tag, found.tag_dir, found.names
    stages = ranked(tag_dir, names, PIPE_MODEL, group=1)
    if not stages:
        raise IncompleteCheckpointError("expected mp_rank_<stage>_model_states.pt next to the pipeline layer files, "
                                        "found none", tag_dir)
    by_stage: dict[int, list[str]] = {}
    for n in names:
        m = PIPE_OPTIM.match(n)
        if m:
            by_stage.setdefault(int(m.group(3)), []).append(n)
    optim: list[Path] = []
    counts = set()
    for s in range(len(stages)):
        pattern = re.compile(rf"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_{s:02d}_optim_states\.pt$")
        files = ranked(tag_dir, by_stage.get(s, []), pattern, group=2)
        counts.add(len(files))
        optim += files
    if len(counts) > 1 or set(by_stage) - set(range(len(stages))):
        raise IncompleteCheckpointError(
            f"expected the same number of optimizer files for each of the {len(stages)} stages, found "
            f"{ {s: len(v) for s, v in sorted(by_stage.items())} }", tag_dir)
    layers = sorted((int(m.group(1)), n) for n in names if (m := PIPE_LAYER.match(n)))
    return PipelineFiles(root, tag, tag_dir, tuple(stages), tuple(optim), layout=layout,
                         layer_files=tuple(tag_dir / n for _, n in layers))


TIED = re.compile(r"^tied_modules\.([^.]+)\.(.+)$")


def load(files: CheckpointFiles) -> PartitionedCheckpoint:
    stages = [read_model_states(p, module_optional=True) for p in files.model_files]
    P = len(stages)
    for ms in stages:
        _check_degree(ms, P)
    optims = [read_optim_states(p) for p in files.optim_files]
    stage = settle_stage(files, stages, optims)
    dp = len(optims) // P if optims else int(stages[0].dp_world_size or 1)
    _check_partition_counts(optims, dp)
    known = _known_names(stages)
    stored, tied_layers = _layer_tensors(files, known)
    ckpt = PartitionedCheckpoint(files, stage, dp * P, stages, optims, stored=stored,
                            buffers=frozenset(n for ms in stages for n in ms.buffer_names))
    ckpt.degrees = {"family": "pipeline-parallel", "dp": dp, "pp": P,
                    "stages": [_stage_layers(ms, tied_layers) for ms in stages], "tied_layers": tied_layers}
    if stage == 0:
        ckpt.frozen_known = False
    else:
        ckpt.partitions = _partitions(stages, dp)
        ckpt.partition_ends = frozenset(p.ranks[-1] for p in ckpt.partitions)
        check_partitions(ckpt)
    shapes = [g for ms in stages for g in (ms.param_shapes or [])]
    ckpt.model_states = [merged_meta(stages[0], stored, ckpt.buffers, {}, shapes), *stages[1:]]
    return ckpt


def _check_degree(ms, P: int) -> None:
    dims = ms.raw.get(K.PARALLEL_DIMENSIONS)
    dims = dims if isinstance(dims, dict) else {}
    pp, tp = dims.get(K.PP_DEGREE), dims.get(K.TP_DEGREE)
    if tp is not None and tp != 1:
        raise UnsupportedCheckpointError(f"pipelines with tensor parallelism (tp_degree {tp!r:.40}) are not supported",
                                         ms.path)
    if pp is not None and pp != P:
        raise InconsistentCheckpointError(f"expected pp_degree {P} (one model-states file per stage), found {pp!r:.40}",
                                          ms.path)


def _check_partition_counts(optims, dp: int) -> None:
    for o in optims:
        if o.partition_count is not None and o.partition_count != dp:
            raise InconsistentCheckpointError(
                f"expected partition_count {dp} (optimizer files per stage), found {o.partition_count}", o.path)


def _known_names(stages) -> dict[str, tuple[int, ...] | None]:
    """Every name the stages record: trainable parameters with their shapes, buffers with None."""
    known: dict[str, tuple[int, ...] | None] = {}
    for ms in stages:
        for group in ms.param_shapes or []:
            known.update(group)
        known.update((n, None) for n in ms.buffer_names if n not in known)
    return known


def _layer_tensors(files: CheckpointFiles, known) -> tuple[dict[str, Stored], dict[str, int]]:
    """Every layer file's tensors under their PipelineModule names, in layer order; and the layer
    each tied module was saved with."""
    stored: dict[str, Stored] = {}
    tied_at: dict[str, int] = {}
    for path in files.layer_files:
        index = int(PIPE_LAYER.match(path.name).group(1))
        tensors = expect_mapping(path, expect_dict(path, load_file(path), "a layer file"), "a layer file",
                                  torch.Tensor, "tensors")
        prefix = _layer_prefix(path, index, tensors, known)
        key = TIED.match(prefix + "x")
        if key:
            if key.group(1) in tied_at:
                continue  # a tied module saved again at a later layer: the first copy is the one
            tied_at[key.group(1)] = index
        for k, t in tensors.items():
            stored[prefix + k] = Stored(path, f"[{k!r}]", t)
    return stored, tied_at


def _layer_prefix(path, index: int, tensors: dict, known) -> str:
    """``"<index>."`` for an ordinary layer; ``"tied_modules.<key>."`` when every key of the file is
    a recorded name (of the same shape) of exactly one tied module and none is ``<index>.<key>``."""
    plain = f"{index}."
    if any(plain + k in known for k in tensors):
        return plain
    candidates = {m.group(1) for n in known if (m := TIED.match(n))}
    fits = [c for c in sorted(candidates) if tensors and all(_fits(known, f"tied_modules.{c}.{k}", t)
                                                              for k, t in tensors.items())]
    if len(fits) > 1:
        raise InconsistentCheckpointError(
            f"layer {index}'s tensors {sorted(tensors)[:4]} fit tied modules {fits}; cannot tell which it holds", path)
    return f"tied_modules.{fits[0]}." if fits else plain


def _fits(known, name: str, t) -> bool:
    if name not in known:
        return False
    shape = known[name]
    return shape is None or tuple(shape) == tuple(t.shape)


def _stage_layers(ms, tied_layers: dict[str, int]) -> list[int]:
    """The layer indices a stage's recorded names mention (its layers with parameters or buffers;
    a tied module counts at the layer it was saved with)."""
    names = [n for g in ms.param_shapes or [] for n in g] + list(ms.buffer_names)
    found = {int(n.split(".", 1)[0]) for n in names if n.split(".", 1)[0].isdigit()}
    found |= {tied_layers[m.group(1)] for n in names if (m := TIED.match(n)) and m.group(1) in tied_layers}
    return sorted(found)


def _partitions(stages, dp: int) -> list[Partition]:
    out: list[Partition] = []
    seen: set[str] = set()
    for s, ms in enumerate(stages):
        if ms.param_shapes is None:
            raise InconsistentCheckpointError("expected 'param_shapes' for a ZeRO-1 pipeline stage, found None",
                                              ms.path)
        for g, group in enumerate(ms.param_shapes):
            out.append(Partition(tuple(range(s * dp, (s + 1) * dp)), g, dict(group), frozenset(seen & set(group))))
            seen |= set(group)
    return out


def stage0_masters(ckpt: PartitionedCheckpoint, table: SourceTable) -> dict[str, Entry]:
    """ZeRO off: without mixed precision the layer files hold the trained values themselves."""
    for ms in ckpt.model_states:
        opt = ms.raw.get(K.STAGE0_OPTIMIZER)
        if isinstance(opt, dict) and ({K.STAGE0_FP32_GROUPS, K.STAGE0_FP32_FLAT} & set(opt)):
            raise UnsupportedCheckpointError(
                "pipeline stage 0 with mixed-precision masters is not supported: the masters are unnamed and the "
                "stage's layers are not recorded", ms.path)
    return {n: table.whole(str(s.path), s.key, s.tensor)
            for n, s in ckpt.stored.items() if n not in ckpt.buffers and s.tensor.is_floating_point()}


def sequential_names(names, tied_layers: dict[str, int]) -> dict[str, str]:
    """PipelineModule name -> the name of the same tensor in ``nn.Sequential(*layers)``:
    ``tied_modules.<key>.<p>`` becomes ``<first layer>.<p>``, every other name stays."""
    out = {}
    for n in names:
        m = TIED.match(n)
        out[n] = f"{tied_layers[m.group(1)]}.{m.group(2)}" if m and m.group(1) in tied_layers else n
    return out


LAYOUT = PipelineLayout()
