"""Mixture-of-experts saves (``deepspeed.moe.layer.MoE``), ZeRO 0, 1 and 2.

On disk (DeepSpeed 0.19.8):
- ``mp_rank_00_model_states.pt``: ``module`` without the experts, ``num_experts`` per MoE layer;
- ``layer_{L}_expert_{E}_mp_rank_00_model_states.pt``: expert E of MoE layer L (module order), its
  tensors in the model dtype under their full names with the **global** expert id;
- ZeRO 1/2: one optimizer file per rank. Besides the dense groups, each expert param group
  (``'moe': True``, named ``ep_size_<ep>``) holds the local experts of the rank's expert-parallel
  rank ``r % ep``, partitioned over its expert-data-parallel ranks ``r % ep, r % ep + ep, ...``.
  ``param_shapes`` names only expert-parallel rank 0's experts, by local id;
- ZeRO off: ``expp_rank_{e}_mp_rank_00_optim_states.pt`` holds ep rank e's wrapper state, whose
  ``fp32_groups`` have one unnamed fp32 master per parameter (expert groups: ep rank e's experts).

Output names are those of the same model built on one process: expert ``l`` of expert-parallel
rank ``e`` becomes ``e * num_local + l``.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..base import keys as K
from ..discover import MODEL_FILE_STAGE012, OPTIM, CheckpointFiles, Found, ranked
from ..base.errors import CorruptCheckpointError, IncompleteCheckpointError, InconsistentCheckpointError, UnsupportedCheckpointError
from ..load import LoadedCheckpoint, PartitionedCheckpoint, Partition, Stored, load_file, load_files
from ..load.checkpoint import check_partitions, merged_meta
from ..load.records import (expect_dict, expect_int, expect_list, expect_mapping, read_model_states, read_optim_states,
                            settle_stage, settle_world_size)
from ..plan.builders import stage0
from ..plan.model import Entry, SourceTable, tensor_identity
from .base import PartitionedLayout

# DeepSpeed's names: "layer_<L>_expert_<E>_mp_rank_00_model_states.pt" and (ZeRO off)
# "expp_rank_<R>_mp_rank_00_optim_states.pt". Experts saved before DeepSpeed 0.6 had no layer id.
MOE_EXPERT = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_00_model_states\.pt$")
MOE_OPTIM = re.compile(r"^expp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
_BEFORE_0_6 = re.compile(r"^expert_\d+_.*\.pt$")


@dataclass(frozen=True)
class MoEFiles(CheckpointFiles):
    expert_files: tuple[Path, ...] = ()  # one per (layer, global expert id), in that order

    def paths(self) -> tuple[Path, ...]:
        return super().paths() + self.expert_files


class MoELayout(PartitionedLayout):
    name = "moe"
    title = "mixture-of-experts"

    def claims(self, found: Found) -> str | None:
        return next((n for n in found.names if MOE_EXPERT.match(n) or MOE_OPTIM.match(n) or _BEFORE_0_6.match(n)),
                    None)

    def list_files(self, found: Found) -> MoEFiles:
        old = next((n for n in found.names if _BEFORE_0_6.match(n)), None)
        if old is not None:
            raise UnsupportedCheckpointError(
                f"mixture-of-experts checkpoints without layer ids (DeepSpeed < 0.6) are not supported (found {old})",
                found.tag_dir)
        return _files(self, found)

    def load(self, files: MoEFiles) -> PartitionedCheckpoint:
        return load(files)

    def stage0_masters(self, ckpt: PartitionedCheckpoint, table: SourceTable) -> dict[str, Entry]:
        return stage0_masters(ckpt, table)


def _files(layout: "MoELayout", found: Found) -> "MoEFiles":
    """ZeRO 1/2: the usual files plus the experts'. ZeRO off: the model file, one ``expp_rank``
    optimizer file per expert-parallel rank, and the experts'."""
    root, tag, tag_dir, names = found.root, found.tag, found.tag_dir, found.names
    experts = sorted((int(m.group(1)), int(m.group(2)), n) for n in names if (m := MOE_EXPERT.match(n)))
    expp = ranked(tag_dir, names, MOE_OPTIM, group=1)
    optim = ranked(tag_dir, names, OPTIM, group=2)
    if expp and optim:
        raise IncompleteCheckpointError(
            "expected either expp_rank_* (MoE without ZeRO) or zero_pp_rank_* optimizer files, found both: the "
            "folder mixes two saves", tag_dir)
    if MODEL_FILE_STAGE012 not in names:
        raise IncompleteCheckpointError(f"expected {MODEL_FILE_STAGE012} next to the expert files, found none",
                                        tag_dir)
    return MoEFiles(root, tag, tag_dir, (tag_dir / MODEL_FILE_STAGE012,), tuple(expp or optim), layout=layout,
                    expert_files=tuple(tag_dir / n for _, _, n in experts))


EXPERTS = ".deepspeed_moe.experts.deepspeed_experts."
EXPERT_NAME = re.compile(r"^(.*" + re.escape(EXPERTS) + r")(\d+)(\..+)$")


def split_expert(name: str) -> tuple[str, int, str] | None:
    """EXPERT_NAME's groups of ``name`` (the prefix through the last fitting EXPERTS, the expert id,
    the rest from its dot), or None where it does not match. Asked of every tensor name of a
    thousand-file save, several times: the usual name (ASCII, its last EXPERTS followed by digits
    and a dot) is split by string search, which finds what the greedy pattern finds; any other
    goes to the pattern."""
    at = name.rfind(EXPERTS)
    if at >= 0 and name.isascii() and "\n" not in name:
        start = at + len(EXPERTS)
        dot = name.find(".", start)
        if dot > start and dot + 1 < len(name) and name[start:dot].isdigit():
            return name[:start], int(name[start:dot]), name[dot:]
    m = EXPERT_NAME.match(name)
    return (m.group(1), int(m.group(2)), m.group(3)) if m else None


def load(files: CheckpointFiles) -> PartitionedCheckpoint:
    first = read_model_states(files.model_files[0])
    if first.raw.get("ds_autoep_layers") or first.raw.get("autoep_layers"):  # the AutoEP layout's, unclaimed
        raise UnsupportedCheckpointError(
            "this mixture-of-experts save is DeepSpeed AutoEP's ('ds_autoep_layers'), which the native MoE layout "
            "does not read, and the AutoEP layout did not recognize it from its pickle", first.path)
    zero_off = bool(files.optim_files) and files.optim_files[0].name.startswith("expp_rank_")
    optims = [] if zero_off else [read_optim_states(p, group_counts=True) for p in files.optim_files]
    stage = settle_stage(files, [first], optims)
    world = settle_world_size(files, stage, [first], optims)
    num_experts = [expect_int(first.path, n, "each 'num_experts' entry", 1)
                   for n in expect_list(first.path, first.raw.get(K.NUM_EXPERTS), "'num_experts'")]
    layers = _expert_layers(files, num_experts)
    stored = _module_with_experts(first, layers)
    ckpt = PartitionedCheckpoint(files, stage, world, [first], optims, stored=stored,
                            aliases=_aliases(first, stored), buffers=frozenset(first.buffer_names))
    ep = _ep_degrees(ckpt, layers)
    ckpt.degrees = {"family": "mixture-of-experts", "dp": world, "ep": ep,
                        "experts_per_layer": {prefix[:-len(EXPERTS)]: n for prefix, (_, n) in layers.items()}}
    ckpt.extra = {"experts": layers}
    if stage != 0:
        ckpt.partitions = _partitions(ckpt, layers)
        ckpt.partition_ends = frozenset(p.ranks[-1] for p in ckpt.partitions)
        check_partitions(ckpt)
    ckpt.model_states = [merged_meta(first, stored, first.buffer_names, ckpt.aliases, first.param_shapes)]
    return ckpt


def _expert_file(path: Path, tree: Any) -> tuple[int, int, Path, dict]:
    m = MOE_EXPERT.match(path.name)
    tensors = expect_mapping(path, expect_dict(path, tree, "an expert file"), "an expert file", torch.Tensor,
                             "tensors")
    return int(m.group(1)), int(m.group(2)), path, tensors


def _expert_layers(files: CheckpointFiles, num_experts: list[int]) -> dict[str, tuple[list, int]]:
    """``{name prefix up to the expert id: ([(global id, file, {name: tensor})...], experts in layer)}``."""
    return expert_layers(load_files(files.expert_files, _expert_file), num_experts, files.tag_dir)


def expert_layers(items, num_experts: list[int], where: Path, what: str = "") -> dict[str, tuple[list, int]]:
    """:func:`_expert_layers` of expert files already read, ``(layer, global id, file, {name:
    tensor})`` each: every layer of ``num_experts`` and each of its experts exactly once (``what``
    says which of the save's expert files, in messages)."""
    by_layer: dict[int, list] = {}
    for layer, expert, path, tensors in items:
        by_layer.setdefault(layer, []).append((expert, path, tensors))
    if sorted(by_layer) != list(range(len(num_experts))):
        raise InconsistentCheckpointError(
            f"expected expert files{what} for MoE layers 0..{len(num_experts) - 1} ('num_experts' {num_experts}), "
            f"found layers {sorted(by_layer)}", where)
    out = {}
    for layer, experts in sorted(by_layer.items()):
        ids = sorted(e for e, _, _ in experts)
        if ids != list(range(num_experts[layer])):
            raise InconsistentCheckpointError(
                f"expected experts 0..{num_experts[layer] - 1} of MoE layer {layer}{what}, found files for {ids}",
                where)
        out[_layer_prefix(experts)] = (sorted(experts, key=lambda x: x[0]), num_experts[layer])
    return out


def _layer_prefix(experts) -> str:
    prefixes = set()
    for expert, path, tensors in experts:
        for name in tensors:
            parts = split_expert(name)
            if parts is None or parts[1] != expert:
                raise InconsistentCheckpointError(
                    f"expected names with '{EXPERTS}{expert}.' in the file of expert {expert}, found {name!r}", path)
            prefixes.add(parts[0])
    if len(prefixes) != 1:
        raise InconsistentCheckpointError(f"expected one MoE layer per expert file set, found {sorted(prefixes)}",
                                          experts[0][1])
    return prefixes.pop()


def _module_with_experts(first, layers) -> dict[str, Stored]:
    """The dense module with each layer's experts placed after the rest of its ``deepspeed_moe``
    (its gate), where a model built on one process registers them."""
    stored = {n: Stored(first.path, f"module[{n!r}]", t) for n, t in first.module.items()}
    for prefix, (experts, _) in layers.items():
        head = prefix[:-len("experts.deepspeed_experts.")]
        names = list(stored)
        at = max((i + 1 for i, n in enumerate(names) if n.startswith(head)), default=len(names))
        added = {n: Stored(path, f"[{n!r}]", t) for _, path, tensors in experts for n, t in tensors.items()}
        stored = dict([*list(stored.items())[:at], *added.items(), *list(stored.items())[at:]])
    return stored


def _aliases(first, stored: dict[str, Stored]) -> dict[str, str]:
    """``shared_params`` (ZeRO 1/2), else module entries that are one tensor (ZeRO off saves none)."""
    if first.shared_params:
        return dict(first.shared_params)
    seen, out = {}, {}
    for name, t in first.module.items():
        ident = tensor_identity(t)
        if ident in seen and name not in first.buffer_names:
            out[name] = seen[ident]
        seen.setdefault(ident, name)
    return out


def _ep_degrees(ckpt: PartitionedCheckpoint, layers) -> int:
    """The expert-parallel degree: from the expert groups' partition counts (ZeRO 1/2) or the
    number of ``expp_rank`` files (ZeRO off)."""
    if ckpt.stage == 0:
        ep = len(ckpt.files.optim_files)
    else:
        groups = _expert_groups(ckpt.optim_states[0])
        counts = _partition_counts(ckpt.optim_states[0])
        degrees = {ckpt.world_size // counts[g] for g in groups}
        if len(degrees) != 1:
            raise InconsistentCheckpointError(
                f"expected one expert-parallel degree, found partition counts {counts} (world {ckpt.world_size})",
                ckpt.optim_states[0].path)
        ep = degrees.pop()
    for prefix, (_, n) in layers.items():
        if ep < 1 or n % ep or ckpt.world_size % ep:
            raise InconsistentCheckpointError(
                f"{n} experts in {prefix.rstrip('.')!r} do not split over expert-parallel degree {ep} (world "
                f"{ckpt.world_size})", ckpt.files.tag_dir)
    return ep


def _expert_groups(o) -> list[int]:
    """Indices of the expert param groups (``'moe': True`` in the wrapped optimizer's groups)."""
    inner = o.raw[K.OPTIMIZER_STATE_DICT].get(K.ZERO12_INNER)
    groups = inner.get(K.PARAM_GROUPS) if isinstance(inner, dict) else None
    if not isinstance(groups, (list, tuple)):
        raise CorruptCheckpointError("expected base_optimizer_state.param_groups to say which groups hold experts",
                                     o.path)
    return [g for g, group in enumerate(groups) if isinstance(group, dict) and group.get("moe") is True]


def _partition_counts(o) -> list[int]:
    counts = o.raw[K.OPTIMIZER_STATE_DICT].get(K.PARTITION_COUNT)
    if not isinstance(counts, (list, tuple)) or len(counts) != len(o.flat_groups):
        raise CorruptCheckpointError(f"expected a partition_count per group ({len(o.flat_groups)}), found {counts!r:.80}",
                                     o.path)
    return list(counts)


def _partitions(ckpt: PartitionedCheckpoint, layers) -> list[Partition]:
    shapes = ckpt.meta.param_shapes
    if shapes is None or len(shapes) != len(ckpt.optim_states[0].flat_groups):
        raise InconsistentCheckpointError(
            f"expected one 'param_shapes' group per flat fp32 group ({len(ckpt.optim_states[0].flat_groups)}), found "
            f"{None if shapes is None else len(shapes)}", ckpt.meta.path)
    experts = set(_expert_groups(ckpt.optim_states[0]))
    ep = ckpt.degrees["ep"]
    W = ckpt.world_size
    out = []
    for g, group in enumerate(shapes):
        if g not in experts:
            out.append(Partition(tuple(range(W)), g, dict(group)))
            continue
        local = _local_experts(ckpt, group, layers, ep)
        for e in range(ep):
            out.append(Partition(tuple(range(e, W, ep)), g,
                                 {f"{prefix}{e * n + expert}{rest}": shape for prefix, expert, rest, n, shape in local}))
    return out


def _local_experts(ckpt, group: dict, layers, ep: int) -> list[tuple[str, int, str, int, Any]]:
    """Each entry of expert-parallel rank 0's expert group as (prefix, local expert id, rest,
    experts per rank, shape): renamed to ep rank ``e``'s global ids as ``prefix{e * n + id}rest``."""
    out = []
    for name, shape in group.items():
        parts = split_expert(name)
        if parts is None or parts[0] not in layers:
            raise InconsistentCheckpointError(f"expert group entry {name!r} names no expert of a known MoE layer",
                                              ckpt.meta.path)
        prefix, expert, rest = parts
        local = layers[prefix][1] // ep
        if expert >= local:
            raise InconsistentCheckpointError(
                f"expert group entry {name!r}: local expert id beyond the {local} experts per rank", ckpt.meta.path)
        out.append((prefix, expert, rest, local, shape))
    return out


# ZeRO off: the masters, matched by value per expert-parallel rank.

def stage0_masters(ckpt: PartitionedCheckpoint, table: SourceTable) -> dict[str, Entry]:
    """Each expert-parallel rank's masters sit unnamed in its ``expp_rank`` file. The dense
    masters are matched on ep rank 0, each rank's expert masters against its own experts, with
    the value matching of a plain stage-0 save."""
    out: dict[str, Entry] = {}
    dense = {n: s.tensor for n, s in ckpt.stored.items() if split_expert(n) is None}
    ep = ckpt.parallelism["ep"]
    for e, path in enumerate(ckpt.files.optim_files):
        raw = expect_dict(path, load_file(path), "an expp_rank optimizer file")
        mine = dict(dense)
        for experts, n in ckpt.extra["experts"].values():
            mine.update(t for expert, _, tensors in experts if expert // (n // ep) == e for t in tensors.items())
        meta = dataclasses.replace(ckpt.meta, path=Path(path), module=mine, param_shapes=None, raw=raw)
        view = LoadedCheckpoint(ckpt.files, 0, ckpt.world_size, [meta], [])
        found = stage0.trainable(view, table, exclude_frozen=False)
        out.update((n, v) for n, v in found.items() if e == 0 or split_expert(n) is not None)
    ckpt.aliases.update(_copied_ties(ckpt, out))
    return out


def _copied_ties(ckpt: PartitionedCheckpoint, masters: dict) -> dict[str, str]:
    """Tied weights of a ZeRO-off MoE save. It records no ``shared_params`` and saves the module
    as copies, so a tied alias is a second, bit-identical copy of a parameter that has a master,
    with no master of its own. (Two distinct parameters, one frozen, would have to be equal in
    every bit to be taken for a tie; the output values are the same either way in ``dtype=None``.)"""
    by_value: dict[tuple, str] = {}
    for name in masters:
        t = ckpt.stored[name].tensor if name in ckpt.stored else None
        if t is not None:
            by_value.setdefault((tuple(t.shape), t.dtype, _bits(t)), name)
    out = {}
    for name, s in ckpt.stored.items():
        if name in masters or name in ckpt.buffers or name in ckpt.aliases:
            continue
        source = by_value.get((tuple(s.tensor.shape), s.tensor.dtype, _bits(s.tensor)))
        if source is not None:
            out[name] = source
    return out


def _bits(t) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


LAYOUT = MoELayout()
