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

import torch

from ...discover import PIPE_LAYER, CheckpointFiles
from ...errors import InconsistentCheckpointError, UnsupportedCheckpointError
from ...plan import keys as K
from ..checkpoint import expect_dict, expect_mapping, read_model_states, read_optim_states, settle_stage, load_file
from . import FamilyCheckpoint, Partition, Stored, check_partitions, merged_meta

TIED = re.compile(r"^tied_modules\.([^.]+)\.(.+)$")


def load(files: CheckpointFiles) -> FamilyCheckpoint:
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
    ckpt = FamilyCheckpoint(files, stage, dp * P, stages, optims, family="pipeline", stored=stored,
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
