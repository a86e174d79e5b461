"""Universal folders of tensor- and pipeline-parallel saves (internal; for :mod:`.universal`):
Megatron-DeepSpeed's tensor parallelism, AutoTP, ``PipelineModule`` pipelines, and tensor x pipeline.

What DeepSpeed 0.19.8's ``ds_to_universal`` writes for such a save (read in its source, measured
on real saves):
- ``zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt`` per trainable parameter, whole: the tp ranks'
  slices joined by the save's ``universal_checkpoint_info`` (``merge_tp_slices``: its pattern
  lists, or AutoTP's ``affine_map``), a padded vocabulary cut to ``original_vocab_size``. Each is
  ``{<the rule's fields: cat_dim, param_n_sub_params, vocab_tensor>, 'param': tensor}``, from a
  ZeRO-3 save too (where a plain ZeRO-3 save gets a bare flat tensor); ``step.pt`` at ZeRO 1-2;
- copies of the model-states files: ``mp_rank_{t:02d}`` per tp rank (ZeRO-3:
  ``zero_pp_rank_{d}_mp_rank_{t:02d}``), ``mp_rank_{s * T + t:02d}`` per pipeline stage s and tp
  rank t. A tp rank's ``module`` holds its shards of the frozen parameters; a pipeline's is None;
- not a pipeline's ``layer_*-model_states.pt`` files, where alone its frozen parameters and
  buffers are;
- ``fp32.pt`` also for every ``module`` tensor without an optimizer fragment (frozen parameters,
  buffers), cast to float32, from the first model-states file holding it: of a frozen parameter
  split over the tp ranks, tp rank 0's shard.

So the trainable parameters come from their ``fp32.pt`` (checked against the full shape the rules
give their shards); the frozen parameters and buffers from the copied model states, joined by the
rules that join the training save's shards (:func:`.autotp.read_shards`, ``stored_entries``); a
pipeline's from its layer files where they were copied into the folder
(:func:`.pipeline.read_layers`). Without them a pipeline's buffers are refused by name, and its
frozen parameters, which nothing in the folder names, unless ``exclude_frozen`` asks for the
trainable parameters alone. An AutoTP save at ZeRO-3 is refused (ds_to_universal 0.19.8 fails on
those saves, so no such folder was ever checked).
"""
from __future__ import annotations

import dataclasses
import re

from ..base import keys as K
from ..base.errors import (CorruptCheckpointError, IncompleteCheckpointError, InconsistentCheckpointError,
                           UnsupportedCheckpointError, short_repr, some)
from ..base.settings import settings
from ..discover import Found
from ..load import PartitionedCheckpoint
from ..load.records import read_model_states
from ..plan.model import Entry, SourceTable
from . import autotp, pipeline, tp_join, tp_rules
from .pipeline import PIPE_LAYER

_EXPERT = re.compile(r"^layer_\d+_expert_\d+_mp_rank_\d+_model_states\.pt$")


def list_files(found: Found) -> tuple[tuple, tuple, int, str | None]:
    """The model-states files in global-rank order (tp ranks: ``dp * T + tp``; pipelines: ``stage *
    T + tp``), the layer files (tp rank by tp rank, in layer order), the tensor-parallel degree the
    names tell (for a pipeline without layer files: the stages times the tp ranks, settled once the
    model states are read) and a rank grid found incomplete."""
    experts = next((n for n in found.names if _EXPERT.match(n)), None)
    if experts is not None:
        raise UnsupportedCheckpointError(f"the universal folder of a mixture-of-experts save with model parallelism is "
                                         f"not supported (found {experts})", found.tag_dir)
    if any(PIPE_LAYER.match(n) for n in found.names):
        listed = pipeline.pipeline_files(pipeline.LAYOUT, found)
        return listed.model_files, listed.layer_files, listed.mp_size, None
    listed = autotp.tp_files(autotp.LAYOUT, found)
    return listed.model_files, (), listed.mp_size, listed.incomplete


def degrees(files, first) -> tuple[int, int]:
    """``(pp, tp)`` from rank 0's model states (``checkpoint_parallel_dimensions``, DeepSpeed 0.19.5
    on); without them, a module means tensor parallelism over ``mp_world_size`` ranks."""
    dims = first.raw.get(K.PARALLEL_DIMENSIONS)
    dims = dims if isinstance(dims, dict) else {}
    pp, tp = dims.get(K.PP_DEGREE), dims.get(K.TP_DEGREE)
    if type(pp) is int and type(tp) is int and pp >= 1 and tp >= 1:
        return pp, tp
    mp = first.raw.get(K.MP_WORLD_SIZE)
    if first.raw.get(K.MODULE) is None or type(mp) is not int or mp < 1:
        raise UnsupportedCheckpointError(
            f"expected checkpoint_parallel_dimensions (or mp_world_size and a module) in the model states of a "
            f"universal folder with {len(files.model_files)} model-parallel ranks, found "
            f"{short_repr(first.raw.get(K.PARALLEL_DIMENSIONS))}: its pipeline stages cannot be told from its "
            "tensor-parallel ranks", first.path)
    return 1, mp


def read(ckpt: PartitionedCheckpoint, pp: int) -> tuple[dict[str, tuple], list[list[str]], dict | None]:
    """Fills ``ckpt`` (holding every tp rank's model states, or a pipeline's first, read with its
    module optional) from its model states and layer files as its family's layout reads the
    training save; returns each trainable parameter's full shape, as ds_to_universal writes it, the
    names of each optimizer param group, and (where tp ranks are joined by Megatron-DeepSpeed's
    rules) the fields ds_to_universal records beside each parameter's tensor by the same rules."""
    files = ckpt.files
    if pp > 1:
        return _pipeline(ckpt, pp)
    if files.layer_files:
        raise InconsistentCheckpointError(f"expected no layer files in the universal folder of a save without "
                                          f"pipeline stages (pp_degree 1), found {files.layer_files[0].name}",
                                          files.model_files[0])
    if files.incomplete:
        raise IncompleteCheckpointError(files.incomplete, files.tag_dir)
    T, first = files.mp_size, ckpt.model_states[0]
    if first.raw.get(K.MODULE) is None:
        raise CorruptCheckpointError("expected the module of tp rank 0 in a universal folder without pipeline stages "
                                     "(pp_degree 1), found None", first.path)
    dp = len(ckpt.model_states) // T if ckpt.stage == 3 else int(first.dp_world_size or 1)
    if ckpt.stage == 3 and first.dp_world_size is not None and first.dp_world_size != dp:
        raise IncompleteCheckpointError(f"dp_world_size is {first.dp_world_size}, but the folder holds the "
                                        f"model states of {dp} data-parallel ranks of each of {T} tp ranks",
                                        files.tag_dir)
    ckpt.world_size = dp * T
    autotp.read_shards(ckpt, dp)
    ckpt.extra["family"] = autotp.LAYOUT
    shards = [{n: tuple(v) for g in m.param_shapes or [] for n, v in g.items()} for m in ckpt.model_states[:T]]
    rules = ckpt.extra["rules"]
    if rules is None and ckpt.stage == 3:
        raise UnsupportedCheckpointError(
            "the universal folder of an AutoTP save at ZeRO-3 is not supported (DeepSpeed 0.19.8's ds_to_universal "
            "fails on such saves, so none was ever checked)", first.path)
    full = tp_join.full_shapes(rules, shards) if rules is not None else _mapped_shapes(ckpt, shards)
    # AutoTP's parameters are rebuilt from the map, which leaves no field of a rule to check
    fields = autotp.LAYOUT.universal_fields(ckpt) if rules is not None else None
    return full, [list(g) for g in first.param_shapes or []], fields


def _mapped_shapes(ckpt: PartitionedCheckpoint, shards: list[dict]) -> dict[str, tuple]:
    """AutoTP: the ``affine_map``'s logical shape of each mapped parameter; the rest are whole."""
    maps, replicated = ckpt.extra["maps"], ckpt.extra["replicated"]
    return {name: tuple(maps[name].get("logical_shape") or shape) if name in maps and name not in replicated
            else shape for name, shape in shards[0].items()}


def _pipeline(ckpt: PartitionedCheckpoint, pp: int) -> tuple[dict[str, tuple], list[list[str]], dict | None]:
    files = ckpt.files
    if not files.layer_files:  # the tp degree is the model states' own: nothing else tells it here
        tp = degrees(files, ckpt.model_states[0])[1]
        if len(files.model_files) != pp * tp:
            raise IncompleteCheckpointError(
                f"expected a model-states file per pipeline stage and tp rank ({pp} x {tp}), found "
                f"{len(files.model_files)}", files.tag_dir)
        ckpt.files = dataclasses.replace(files, mp_size=tp)
    everyone = ckpt.model_states[:1] + [read_model_states(p, module_optional=True) for p in ckpt.files.model_files[1:]]
    T = ckpt.files.mp_size
    dp = int(everyone[0].dp_world_size or 1)
    ckpt.model_states, ckpt.world_size = everyone, dp * pp * T
    stages = everyone[0::T]
    pipeline.read_layers(ckpt, dp)
    ckpt.extra["family"] = pipeline.LAYOUT
    shapes = {n: tuple(v) for g in ckpt.meta.param_shapes or [] for n, v in g.items()}
    info = everyone[0].raw.get(K.UNIVERSAL_INFO)
    if T == 1 and (settings().tp_rules or tp_rules.has_rules(info)):  # ds_to_universal applies them to one slice
        rules = tp_join.rules_of(info if isinstance(info, dict) else {}, everyone[0].path, list(shapes))
        shapes = tp_join.full_shapes(rules, [shapes]) if rules is not None else shapes
    count = max(len(ms.param_shapes or []) for ms in stages)
    groups = [list(dict.fromkeys(n for ms in stages if g < len(ms.param_shapes or []) for n in ms.param_shapes[g]))
              for g in range(count)]
    return shapes, groups, pipeline.LAYOUT.universal_fields(ckpt) if T > 1 else None


def stored_entries(ckpt: PartitionedCheckpoint, table: SourceTable, exclude_frozen: bool) -> dict[str, Entry]:
    """The frozen parameters the family's layout puts together from several tp ranks' files; a
    pipeline folder without its layer files is refused, unless only its trainable parameters are
    asked for and it has no buffers."""
    files = ckpt.files
    if ckpt.degrees.get("pp", 1) > 1 and not files.layer_files:
        where = (f"ds_to_universal copies no layer_*-model_states.pt files, where alone a pipeline save keeps them; "
                 f"copy the source tag folder's layer files into {files.tag_dir}")
        if ckpt.buffers:
            raise IncompleteCheckpointError(f"expected the values of this pipeline save's buffers "
                                            f"({some(sorted(ckpt.buffers))}), found none: {where}", files.tag_dir)
        if not exclude_frozen:
            raise IncompleteCheckpointError(
                f"expected the values of this pipeline save's frozen parameters, found none and nothing that names "
                f"them: {where}, or pass exclude_frozen=True (--exclude-frozen) to read the trainable parameters "
                "alone", files.tag_dir)
    elif ckpt.degrees.get("pp", 1) > 1:
        _check_layers(ckpt)
    return ckpt.extra["family"].stored_entries(ckpt, table)


def _check_layers(ckpt: PartitionedCheckpoint) -> None:
    """Layer files copied in by hand: every layer the stages name (by a trainable parameter or a
    buffer) must have its file, every buffer its value."""
    files = ckpt.files
    held = {int(PIPE_LAYER.match(p.name).group(1)) for p in files.layer_files}
    named = {n for g in ckpt.meta.param_shapes or [] for n in g} | set(ckpt.buffers)
    layers = sorted({int(head) for n in named if (head := n.split(".", 1)[0]).isdigit()} - held)
    missing = layers or sorted(ckpt.buffers - set(ckpt.stored))
    if missing:
        raise IncompleteCheckpointError(
            f"expected the layer files of every layer of this pipeline save, found none for "
            f"{'layers' if layers else 'the buffers'} {some(missing)} (copy every layer_*-model_states.pt file "
            "of the source tag folder)", files.tag_dir)
