"""Pipeline-parallel saves (``deepspeed.pipe.PipelineModule``), ZeRO 0 and 1, also with Megatron-
DeepSpeed's tensor parallelism (a ``PipeModelDataParallelTopology`` with a model axis).

On disk (DeepSpeed 0.19.8), for P stages, T tp ranks and D data-parallel ranks per (stage, tp):
- ``mp_rank_{s * T + t:02d}_model_states.pt`` per stage s and tp rank t: ``module`` is None;
  ``param_shapes`` lists the stage's trainable parameters under PipelineModule names
  (``1.up.weight``, ``tied_modules.embed.weight``), with tp rank t's shard shapes; ``buffer_names``
  likewise;
- ``[bf16_]zero_pp_rank_{d}_mp_rank_{s * T + t:02d}_optim_states.pt``: that (stage, tp rank)'s
  masters, an ordinary ZeRO partition over its D ranks (also with the BF16_Optimizer, which
  records no ``zero_stage``);
- ``layer_{NN:02d}-model_states.pt`` (T = 1) or ``layer_{NN:02d}-model_{t:02d}-model_states.pt``:
  layer NN's own ``state_dict()`` (layer-local keys, model dtype, tp rank t's shards), written once
  by data-parallel rank 0 of its stage. Frozen parameters and buffer values exist only here. A tied
  module (``TiedLayerSpec``) is saved once, in the file of its first layer; nothing says so but the
  names: its keys are ``tied_modules.<key>.*`` in the stages' ``param_shapes``/``buffer_names``.
  Every stage using it holds a master; the first stage's is kept (Megatron's position embedding
  gets no gradient on the last stage, so the copies there differ).

With T > 1 each tp rank's pipeline is planned as a pipeline of its own, and the tp ranks' shards
are joined by the rules in the model states' ``universal_checkpoint_info`` (or ``--tp-rules``),
as for tensor-parallel saves without a pipeline (:mod:`.tp_join`).

Output names are PipelineModule's, in layer order. :func:`zerofast.sequential_names` maps them to
the names of the same layers in one ``nn.Sequential``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..base import keys as K
from ..base.settings import settings
from ..discover import CheckpointFiles, Found, ranked
from ..base.errors import IncompleteCheckpointError, InconsistentCheckpointError, UnsupportedCheckpointError, some
from ..load import PartitionedCheckpoint, Partition, Stored, load_file
from ..load.checkpoint import check_partitions, merged_meta
from ..load.records import expect_dict, expect_mapping, read_model_states, read_optim_states, settle_stage
from ..plan.columns import EntryTable
from ..plan.model import Entry, FlatGroups, SourceTable
from ..plan.partitioned import partition_entries
from . import tp_join, tp_rules
from .base import Layout, PartitionedLayout

# "layer_<NN>[-model_<TT>]-model_states.pt" next to one "mp_rank_<SS>_model_states.pt" per (stage, tp).
PIPE_LAYER = re.compile(r"^layer_(\d+)-(?:model_(\d+)-)?model_states\.pt$")
PIPE_MODEL = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
PIPE_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


@dataclass(frozen=True)
class PipelineFiles(CheckpointFiles):
    layer_files: tuple[Path, ...] = ()  # one per saved layer and tp rank, tp rank by tp rank, in layer order
    mp_size: int = 1  # tensor-parallel degree

    def paths(self) -> tuple[Path, ...]:
        return super().paths() + self.layer_files

    def layers_of(self, tp: int) -> tuple[Path, ...]:
        per = len(self.layer_files) // self.mp_size
        return self.layer_files[tp * per:(tp + 1) * per]


class PipelineLayout(PartitionedLayout):
    name = "pipeline"
    title = "pipeline"
    subsumes = ("autotp",)  # a pipeline's later stages write mp_rank_01... files too

    def claims(self, found: Found) -> str | None:
        return next((n for n in found.names if PIPE_LAYER.match(n)), None)

    def list_files(self, found: Found) -> PipelineFiles:
        return pipeline_files(self, found)

    def load(self, files: PipelineFiles) -> PartitionedCheckpoint:
        return load(files)

    def stage0_masters(self, ckpt: PartitionedCheckpoint, table: SourceTable) -> dict[str, Entry]:
        if ckpt.files.mp_size == 1:
            return stage0_masters(ckpt, table)
        per_tp = [stage0_masters(ckpt, table, stored) for stored in ckpt.extra["tp_stored"]]
        return _joined(ckpt, table, per_tp, "layer files' values")

    def trainable_from(self, ckpt: PartitionedCheckpoint, table: SourceTable, flats: FlatGroups,
                       what: str) -> EntryTable:
        if ckpt.files.mp_size == 1:
            return partition_entries(ckpt, table, flats, what)
        per_tp = [partition_entries(ckpt, table, flats, what, parts) for parts in ckpt.extra["tp_partitions"]]
        return EntryTable.of_entries(_joined(ckpt, table, per_tp, what))

    def stored_entries(self, ckpt: PartitionedCheckpoint, table: SourceTable) -> dict[str, Entry]:
        """With several tp ranks (ZeRO 1: the optimizer names the trainable ones), each frozen
        parameter joined from every tp rank's layer files by the rules that join the trainable
        ones; a replicated one must be equal on every rank."""
        if ckpt.files.mp_size == 1 or ckpt.stage == 0:
            return {}
        trainable, per_tp = ckpt.extra["tp_shapes"][0], ckpt.extra["tp_stored"]
        frozen = [n for n in per_tp[0] if n not in trainable and n not in ckpt.buffers]
        rules, paths = ckpt.extra["rules"], ckpt.extra["tp_paths"]
        return {name: tp_join.join_entry(rules, table, name, [_whole(table, stored.get(name)) for stored in per_tp],
                                         "frozen weights", paths) for name in frozen}

    def universal_fields(self, ckpt: PartitionedCheckpoint) -> dict[str, dict] | None:
        """What ``ds_to_universal`` writes beside each trainable parameter's ``param``: the fields
        of its tensor-parallel rule (its tp rank shapes taken over every stage), or, in a save with a
        single tp rank and no rules, ``cat_dim`` 0 for every parameter (``--inject_missing_state``).
        The tied module's parameters are written once, from the first stage holding them."""
        if ckpt.stage == 0:
            return None
        if ckpt.files.mp_size > 1:
            rules, per_tp = ckpt.extra["rules"], ckpt.extra["tp_shapes"]
            return {name: tp_rules.universal_fields(rules.merge(name, [s[name] for s in per_tp]), ckpt.meta.path)
                    for name in per_tp[0]}
        return _single_tp_fields(ckpt)


def _joined(ckpt: PartitionedCheckpoint, table: SourceTable, per_tp, what: str) -> dict[str, Entry]:
    """Each tp rank's pipeline planned alone (``per_tp[t]``: name -> its shard), joined by the rules."""
    rules, paths = ckpt.extra["rules"], ckpt.extra["tp_paths"]
    return {name: tp_join.join_entry(rules, table, name, [shards.get(name) for shards in per_tp], what, paths)
            for name in per_tp[0]}


def _whole(table: SourceTable, s: Stored | None) -> Entry | None:
    return None if s is None else table.whole(str(s.path), s.key, s.tensor)


def pipeline_files(layout: Layout, found: Found) -> PipelineFiles:
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
    layers = sorted((int(m.group(2) or 0), int(m.group(1)), n) for n in names if (m := PIPE_LAYER.match(n)))
    T = 1 + max(t for t, _, _ in layers)
    per_tp = [[i for t, i, _ in layers if t == tp] for tp in range(T)]
    if any(p != per_tp[0] for p in per_tp) or len(stages) % T:
        raise IncompleteCheckpointError(
            f"expected the same layer files for each of {T} tensor-parallel ranks and a model-states file per (stage, "
            f"tp rank), found layers {[some(list(map(str, p))) for p in per_tp]} and {len(stages)} model-states "
            "files", tag_dir)
    return PipelineFiles(root, tag, tag_dir, tuple(stages), tuple(optim), layout=layout,
                         layer_files=tuple(tag_dir / n for _, _, n in layers), mp_size=T)


TIED = re.compile(r"^tied_modules\.([^.]+)\.(.+)$")


def load(files: PipelineFiles) -> PartitionedCheckpoint:
    T = files.mp_size
    everyone = [read_model_states(p, module_optional=True) for p in files.model_files]
    P = len(everyone) // T
    for ms in everyone:
        _check_degree(ms, P, T)
    optims = [read_optim_states(p) for p in files.optim_files]
    stage = settle_stage(files, everyone, optims)
    dp = len(optims) // (P * T) if optims else int(everyone[0].dp_world_size or 1)
    _check_partition_counts(optims, dp)
    ckpt = PartitionedCheckpoint(files, stage, dp * P * T, everyone, optims)
    if stage == 0:
        ckpt.frozen_known = False
    else:
        by_tp = [_partitions(everyone[t::T], dp, [(s * T + t) * dp for s in range(P)]) for t in range(T)]
        ckpt.partitions = [p for parts in by_tp for p in parts]
        ckpt.partition_ends = frozenset(p.ranks[-1] for p in ckpt.partitions)
        check_partitions(ckpt)
        ckpt.extra["tp_partitions"] = by_tp
    read_layers(ckpt, dp)
    return ckpt


def read_layers(ckpt: PartitionedCheckpoint, dp: int) -> None:
    """What the stages' model states and the layer files say, into ``ckpt``: the stored tensors under
    their PipelineModule names (tp rank 0's), the degrees and structure, the tp rules, and ``meta``
    merged over the stages (full shapes). The optimizer files play no part, so a universal
    conversion, which keeps the model states (and the layer files, where they were copied), is read
    the same way (:mod:`.universal_parallel`)."""
    files, T, everyone = ckpt.files, ckpt.files.mp_size, ckpt.model_states
    P = len(everyone) // T
    for ms in everyone:
        _check_degree(ms, P, T)
    known = [_known_names(everyone[t::T]) for t in range(T)]
    if ckpt.stage == 0:  # no names recorded: the tied module's are those the save calls pipeline-replicated
        for k in known:
            k.update(dict.fromkeys(_pipeline_replicated(everyone[0]), None))
    views = [_layer_tensors(files.layers_of(t), known[t]) for t in range(T)]
    stored, tied_layers = views[0]
    stages = everyone[0::T]  # tp rank 0's pipeline: its structure is every tp rank's
    ckpt.stored, ckpt.buffers = stored, frozenset(n for ms in everyone for n in ms.buffer_names)
    ckpt.degrees = {"family": "pipeline-parallel", "dp": dp, "pp": P,
                    "stages": [_stage_layers(ms, tied_layers) for ms in stages], "tied_layers": tied_layers}
    shapes = [g for ms in stages for g in (ms.param_shapes or [])]
    if T > 1:
        shapes = _tensor_parallel(ckpt, everyone, views, shapes)
    ckpt.model_states = [merged_meta(stages[0], stored, ckpt.buffers, {}, shapes), *everyone[1:]]


def _tensor_parallel(ckpt: PartitionedCheckpoint, everyone, views, shapes: list[dict]) -> list[dict]:
    """The tp ranks' rules, checked against their shard shapes; the full shapes for the meta."""
    T = ckpt.files.mp_size
    per_tp = [{n: tuple(v) for ms in everyone[t::T] for g in ms.param_shapes or [] for n, v in g.items()}
              for t in range(T)]
    if ckpt.stage == 0:  # no param_shapes: the layer files' floating tensors are the trainable ones
        per_tp = [{n: tuple(s.tensor.shape) for n, s in stored.items() if s.tensor.is_floating_point()
                   and n not in ckpt.buffers} for stored, _ in views]
    first = everyone[0]
    info = first.raw.get(K.UNIVERSAL_INFO)
    rules = tp_join.rules_of(info if isinstance(info, dict) else {}, first.path, list(per_tp[0]))
    if rules is None:
        raise UnsupportedCheckpointError("a pipeline save with AutoTP's affine_map is not supported", first.path)
    ckpt.degrees["tp"] = T
    ckpt.degrees["tp_rules"] = tp_join.rule_labels(rules, per_tp, first.path)
    if ckpt.stage == 0:
        _check_frozen(per_tp, views)
    full = tp_join.full_shapes(rules, per_tp)
    ckpt.extra.update(rules=rules, tp_stored=[stored for stored, _ in views], tp_shapes=per_tp,
                      tp_paths=[everyone[t].path for t in range(T)])
    return [{n: full.get(n, v) for n, v in g.items()} for g in shapes]


def _single_tp_fields(ckpt: PartitionedCheckpoint) -> dict[str, dict]:
    """``universal_fields`` of a pipeline save with one tp rank: ds_to_universal applies the save's
    rules (or the user's) to the single slice, a vocabulary parameter's padding rows included,
    which zerofast keeps at one tp rank; such a padded vocabulary is refused rather than written
    other than DeepSpeed writes it. Without rules every parameter is joined on dim 0."""
    shapes = {n: tuple(v) for g in ckpt.meta.param_shapes or [] for n, v in g.items()}
    info = ckpt.meta.raw.get(K.UNIVERSAL_INFO)
    if not (settings().tp_rules or tp_rules.has_rules(info)):
        return {name: {"cat_dim": 0} for name in shapes}
    rules = tp_join.rules_of(info if isinstance(info, dict) else {}, ckpt.meta.path, list(shapes))
    if rules is None:
        raise UnsupportedCheckpointError("to-universal of a pipeline save with AutoTP's affine_map is not supported",
                                         ckpt.meta.path)
    out = {}
    for name, shape in shapes.items():
        merge = rules.merge(name, [shape])
        if merge.vocab is not None and shape and shape[0] != merge.vocab:
            raise UnsupportedCheckpointError(
                f"to-universal of {name!r}: a vocabulary parameter with {shape[0]} rows (original_vocab_size "
                f"{merge.vocab}) in a pipeline save with one tp rank is not supported (ds_to_universal trims the "
                "padding rows, zerofast keeps them there)", ckpt.meta.path)
        out[name] = tp_rules.universal_fields(merge, ckpt.meta.path)
    return out


def _check_frozen(per_tp: list[dict], views) -> None:
    """Without ZeRO every floating tensor of the layer files is joined as a master; any other
    (an integer one) must be whole on every tp rank."""
    for name, s in views[0][0].items():
        if name in per_tp[0]:
            continue
        shapes = {tuple(stored[name].tensor.shape) for stored, _ in views if name in stored}
        if len(shapes) > 1:
            raise UnsupportedCheckpointError(f"frozen tensor-parallel shard {name!r} (shapes {sorted(shapes)}) is "
                                             "not supported", s.path)


def _pipeline_replicated(ms) -> list[str]:
    """The names Megatron-DeepSpeed's ``pipeline_replicated_parameter_patterns`` spell out (its tied
    embedding: ``tied_modules.embed.word_embeddings.weight``); patterns that are not plain names
    (dots read as themselves) are left out."""
    info = ms.raw.get(K.UNIVERSAL_INFO)
    patterns = info.get("pipeline_replicated_parameter_patterns") if isinstance(info, dict) else None
    if not isinstance(patterns, (list, tuple)):
        return []
    names = [p.replace("\\.", ".") for p in patterns if isinstance(p, str)]
    return [n for n in names if _PLAIN_NAME.fullmatch(n) and TIED.match(n)]


_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.]{1,512}")


def _check_degree(ms, P: int, T: int) -> None:
    dims = ms.raw.get(K.PARALLEL_DIMENSIONS)
    dims = dims if isinstance(dims, dict) else {}
    pp, tp = dims.get(K.PP_DEGREE), dims.get(K.TP_DEGREE)
    if tp is not None and tp != T:
        raise InconsistentCheckpointError(f"expected tp_degree {T} (layer files per layer), found {tp!r:.40}", ms.path)
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


def _layer_tensors(layer_files, known) -> tuple[dict[str, Stored], dict[str, int]]:
    """Every layer file's tensors under their PipelineModule names, in layer order; and the layer
    each tied module was saved with."""
    stored: dict[str, Stored] = {}
    tied_at: dict[str, int] = {}
    for path in layer_files:
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


def _partitions(stages, dp: int, first_ranks: list[int]) -> list[Partition]:
    """Stage s's groups over optimizer files ``first_ranks[s]`` .. ``+ dp``; a name an earlier stage
    holds (a tied module) is read from that stage."""
    out: list[Partition] = []
    seen: set[str] = set()
    for ms, first in zip(stages, first_ranks):
        if ms.param_shapes is None:
            raise InconsistentCheckpointError("expected 'param_shapes' for a ZeRO-1 pipeline stage, found None",
                                              ms.path)
        for g, group in enumerate(ms.param_shapes):
            out.append(Partition(tuple(range(first, first + dp)), g, dict(group), frozenset(seen & set(group))))
            seen |= set(group)
    return out


def stage0_masters(ckpt: PartitionedCheckpoint, table: SourceTable, stored=None) -> dict[str, Entry]:
    """ZeRO off: without mixed precision the layer files hold the trained values themselves
    (``stored``: one tp rank's layer tensors; default the checkpoint's)."""
    for ms in ckpt.model_states:
        opt = ms.raw.get(K.STAGE0_OPTIMIZER)
        if isinstance(opt, dict) and ({K.STAGE0_FP32_GROUPS, K.STAGE0_FP32_FLAT} & set(opt)):
            raise UnsupportedCheckpointError(
                "pipeline stage 0 with mixed-precision masters is not supported: the masters are unnamed and the "
                "stage's layers are not recorded", ms.path)
    return {n: table.whole(str(s.path), s.key, s.tensor) for n, s in (ckpt.stored if stored is None else stored).items()
            if n not in ckpt.buffers and s.tensor.is_floating_point()}


def sequential_names(names, tied_layers: dict[str, int]) -> dict[str, str]:
    """PipelineModule name -> the name of the same tensor in ``nn.Sequential(*layers)``:
    ``tied_modules.<key>.<p>`` becomes ``<first layer>.<p>``, every other name stays."""
    out = {}
    for n in names:
        m = TIED.match(n)
        out[n] = f"{tied_layers[m.group(1)]}.{m.group(2)}" if m and m.group(1) in tied_layers else n
    return out


LAYOUT = PipelineLayout()
