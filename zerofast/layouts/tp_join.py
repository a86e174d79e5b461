"""Full tensors out of tensor-parallel slices, as plan entries (internal; for the tensor-parallel
and pipeline layouts).

A slice is the :data:`~zerofast.plan.model.Entry` a layout planned for one tp rank's shard. A join
(AutoTP's ``affine_map`` pieces, or a rule of :mod:`.tp_rules` turned into pieces) becomes
segments into the full tensor, so the executor gathers it in its one pass. Replicated copies are
read here, while planning (they are small: norms, biases, position embeddings), to be compared
bit for bit, or averaged where the rules or ``--tp-replicated mean`` say so.
"""
from __future__ import annotations

import itertools
import math
import warnings
from pathlib import Path
from typing import Sequence

import torch

from ..base.errors import CorruptCheckpointError, InconsistentCheckpointError, UnsupportedCheckpointError
from ..base.settings import TP_REPLICATED_ENV, settings
from ..plan.model import Entry, SourceTable
from . import tp_presets, tp_rules


def rules_of(info: dict, path: Path, names: Sequence[str]) -> "tp_rules.Rules | None":
    """The rules that join a save's slices: the user's (``--tp-rules``), else the pattern lists the
    save records; None where it records AutoTP's ``affine_map`` instead. A save with neither is
    refused, with the preset named when ``names`` look like Megatron-DeepSpeed's GPT."""
    given = settings().tp_rules  # the user's rules win over the save's
    if given:
        return tp_rules.read_rules(tp_presets.from_setting(given), path)
    if info.get("affine_map") is not None:  # AutoTP writes the pattern lists too, for older converters
        return None
    if tp_rules.has_rules(info):
        return tp_rules.read_rules(info, path)
    hint = ("; the names look like Megatron-DeepSpeed's GPT: --tp-rules megatron-gpt:mlp=swiglu|gelu,vocab=N "
            "applies its patterns" if tp_presets.looks_megatron(names) else "")
    raise UnsupportedCheckpointError(
        "expected universal_checkpoint_info in this tensor-parallel save's model states: AutoTP's affine_map, or "
        "Megatron-DeepSpeed's parameter patterns (tp_replicated_parameter_patterns, "
        "parameter_with_row_parallelism_patterns, ...), found neither, so how the tp ranks' slices go together is "
        f"not known. Give the rules with --tp-rules FILE (a JSON object in the same vocabulary) or a preset "
        f"(ZEROFAST_TP_RULES){hint}", path)


def rule_labels(rules: "tp_rules.Rules", shapes: list[dict[str, tuple]], path: Path) -> dict[str, str]:
    """Each parameter's rule (what ``inspect`` shows), from the tp ranks' shard shapes
    (``shapes[t]``: name -> shape), checked before any plan."""
    out = {}
    for name in shapes[0]:
        if any(name not in s for s in shapes):
            raise InconsistentCheckpointError(f"{name!r} is a trainable parameter of tp rank 0 but not of every tp "
                                              "rank", path)
        out[name] = rules.merge(name, [tuple(s[name]) for s in shapes]).label
    return out


def full_shapes(rules: "tp_rules.Rules", shapes: list[dict[str, tuple]]) -> dict[str, tuple]:
    """name -> the full tensor's shape, from the tp ranks' shard shapes."""
    out = {}
    for name in shapes[0]:
        per_rank = [tuple(s[name]) for s in shapes]
        out[name] = tp_rules.full_shape(rules.merge(name, per_rank), per_rank)
    return out


def join_entry(rules: "tp_rules.Rules", table: SourceTable, name: str, slices: list[Entry | None], what: str,
               paths: Sequence[Path]) -> Entry:
    """The full tensor ``name`` from its tp ranks' ``slices`` (``paths[t]``: rank t's file, for
    messages), by ``rules``."""
    missing = [t for t, s in enumerate(slices) if s is None]
    if missing:
        raise InconsistentCheckpointError(f"tp rank {missing[0]} has no {name!r}", paths[missing[0]])
    shapes = [tuple(s[0]) for s in slices]
    merge = rules.merge(name, shapes)
    if merge.kind == "join":
        entry = tp_rules.affine_entry(merge, shapes)
        return tuple(entry["logical_shape"]), slices[0][1], [
            seg for t, s in enumerate(slices) for piece in entry["ranks"][t]["pieces"]
            for seg in piece_segments(name, piece, s, paths[t])]
    if len(set(shapes)) != 1:
        raise InconsistentCheckpointError(f"{name!r} is named {merge.rule}, but its tp ranks hold shapes "
                                          f"{[list(x) for x in shapes]}", paths[0])
    values = [_values(table, s) for s in slices]
    if merge.kind == "replicated":
        differ = _first_difference(values)
        if differ is None:
            return slices[0]
        if settings().tp_replicated_mode() != "mean":
            t, diff = differ
            raise InconsistentCheckpointError(
                f"{name!r} is named tensor-parallel replicated, but the {what} of tp ranks 0 and {t} differ (largest "
                f"difference {diff:.6g}); to average the copies, as BLOOM's converters do, pass --tp-replicated mean "
                f"({TP_REPLICATED_ENV}=mean)", paths[t])
        warnings.warn(f"averaged the differing tp copies of the replicated {name!r} ({what}), as --tp-replicated "
                      "mean asks", stacklevel=2)
    mean = 0  # as ds_to_universal: sum(slices) / len(slices), from an int 0 (-0.0 + 0 is +0.0)
    for v in values:
        mean = mean + v
    mean = (mean / len(values)).reshape(shapes[0])
    return table.whole(str(paths[0]), f"mean over tp ranks of {name!r} ({what})", mean)


def piece_segments(name: str, piece: dict, shard: Entry, path) -> list[tuple[int, int, int, int]]:
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


def _values(table: SourceTable, entry: Entry) -> torch.Tensor:
    """The elements of ``entry`` (a small replicated tensor), read from the table's sources."""
    shape, _, segs = entry
    out = torch.empty(math.prod(shape), dtype=table.tensors[segs[0][0]].dtype if segs else torch.float32)
    for src, s_off, d_off, length in segs:
        out[d_off:d_off + length] = table.tensors[src][s_off:s_off + length]
    return out


def _first_difference(values: list[torch.Tensor]) -> tuple[int, float] | None:
    """Replicated copies are compared bit for bit, not assumed equal: the first tp rank whose copy
    differs from rank 0's, with the largest difference, or None."""
    first = values[0].view(torch.uint8)
    for t, v in enumerate(values[1:], 1):
        if not torch.equal(first, v.view(torch.uint8)):
            return t, (values[0].double() - v.double()).abs().max().item()
    return None
