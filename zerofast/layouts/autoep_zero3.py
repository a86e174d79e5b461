"""DeepSpeed AutoEP saves at ZeRO-3 (``checkpoint_format: zero3_partitioned``, DeepSpeed 0.19.8).

:data:`LAYOUT`, the registered AutoEP layout, is :mod:`.autoep`'s (its claim: ``ds_autoep_layers``
in the rank-0 model states) that reads these saves too. On disk, as for plain ZeRO-3, and no
expert files:

- ``zero_pp_rank_R_mp_rank_00_model_states.pt`` per rank: ``module`` with empty placeholders for
  the parameters (the experts not listed), ``param_shapes`` [0] the dense parameters, [1] the
  expert group with this rank's local shapes (``experts.w1`` ``[num_local_experts, ...]``), and
  ``ds_autoep_layers`` with this rank's own records: ``checkpoint_format: zero3_partitioned``,
  ``ep_rank``, ``expert_data_parallel_rank``, ``expert_data_parallel_world_size``,
  ``global_expert_start``/``end``, with the ZeRO 0-2 records' ``expert_placement`` and
  ``affine_maps`` (the same on every rank);
- ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` per rank: ``fp32_flat_groups`` per sub
  group, and ``ds_zero_partition_groups``, per sub group ``partition_count``, ``partition_rank``,
  ``partition_ranks`` (global ranks) and ``families`` (``replicated``, ``autoep_expert``). The
  dense group is cut over every rank; the expert group of rank R holds its ep rank's local
  experts, each tensor cut ZeRO-3 style (``ceil(n / count)`` elements per rank, in
  ``param_shapes`` order) over its expert-data-parallel group, in ``partition_rank`` order.

Each expert tensor is put together from its ep ranks' local tensors by ``affine_maps``, as at
ZeRO 1-2 (:func:`.autoep.trainable`). Refused: frozen parameters (their ZeRO-3 fragments are
not placed), and what :mod:`.autoep` refuses (AutoEP+AutoTP folding,
``use_data_before_expert_parallel_``).
"""
from __future__ import annotations

from typing import Any

import torch

from ..base.errors import CorruptCheckpointError, InconsistentCheckpointError, UnsupportedCheckpointError
from ..discover import MODEL_FILE_STAGE012, ZERO3_MODEL, CheckpointFiles, Found, plain_files
from ..load import PartitionedCheckpoint, Partition
from ..load.checkpoint import check_partitions, merged_meta
from ..load.rank_states import read_rank_model_states
from ..load.records import check_flat_groups, read_optim_states, settle_stage, settle_world_size
from . import autoep

FORMAT = "zero3_partitioned"
PARTITION_GROUPS = "ds_zero_partition_groups"
EXPERT_FAMILY = "autoep_expert"
_SAME = ("module_path", "num_experts", "num_local_experts", "ep_size", "expert_key_prefix", "expert_placement",
         "affine_maps", "expert_data_parallel_world_size")


class AutoEPAllStagesLayout(autoep.AutoEPLayout):
    """AutoEP at ZeRO 0-2 (:mod:`.autoep`) and ZeRO-3 (per-rank model states, no expert files)."""

    def list_files(self, found: Found) -> CheckpointFiles:
        names = found.names
        if MODEL_FILE_STAGE012 in names or not any(ZERO3_MODEL.match(n) for n in names):
            return super().list_files(found)
        model_files, optim_files = plain_files(found)
        return CheckpointFiles(found.root, found.tag, found.tag_dir, model_files, optim_files, layout=self)

    def load(self, files: CheckpointFiles) -> PartitionedCheckpoint:
        return load(files) if files.partitioned_model_states else super().load(files)


def load(files: CheckpointFiles) -> PartitionedCheckpoint:
    models = read_rank_model_states(files.model_files)
    optims = [read_optim_states(p, group_counts=True) for p in files.optim_files]
    stage = settle_stage(files, models, optims)
    world = settle_world_size(files, stage, models, optims)
    check_flat_groups(stage, optims)
    first = models[0]
    records = autoep._layer_records(first, FORMAT)
    ep_ranks = [_ep_rank(m, records, autoep._layer_records(m, FORMAT)) for m in models]
    ep = records[0]["ep_size"]
    if sorted(set(ep_ranks)) != list(range(ep)) or world % ep:
        raise InconsistentCheckpointError(f"the ranks' ds_autoep_layers name ep ranks {sorted(set(ep_ranks))}, not "
                                          f"0..{ep - 1} over world {world}", first.path)
    if first.frozen_param_shapes:
        raise UnsupportedCheckpointError(
            f"frozen parameters of an AutoEP ZeRO-3 save (among them {next(iter(first.frozen_param_shapes))!r}) are "
            "not supported: their ZeRO-3 fragments are not placed", first.path)
    experts = _expert_shapes(models, records, ep_ranks)
    stored, frozen = autoep._module_with_experts(first, records, experts)
    if frozen:
        raise UnsupportedCheckpointError(f"frozen AutoEP expert tensors at ZeRO-3 ({sorted(frozen)[0]!r}) are not "
                                         "supported", first.path)
    aliases = dict(first.shared_params or {})
    aliases.update(autoep._router_aliases(first, records, stored))
    ckpt = PartitionedCheckpoint(files, stage, world, models, optims, stored=stored, aliases=aliases,
                                 buffers=frozenset(first.buffer_names))
    ckpt.degrees = {"family": "mixture-of-experts (AutoEP)", "dp": world, "ep": ep,
                    "experts_per_layer": {r["module_path"]: r["num_experts"] for r in records}}
    ckpt.extra = {"records": records, "experts": experts, "frozen_experts": set()}
    ckpt.partitions = _partitions(models, optims, records, ep_ranks)
    ckpt.partition_ends = frozenset(p.ranks[-1] for p in ckpt.partitions)
    check_partitions(ckpt)
    ckpt.model_states = [merged_meta(first, stored, first.buffer_names, ckpt.aliases, first.param_shapes)]
    return ckpt


def _ep_rank(meta, first_records: list[dict], records: list[dict]) -> int:
    """The one ep rank a rank's records name; its records must match rank 0's but for that."""
    if len(records) != len(first_records):
        raise InconsistentCheckpointError(f"expected {len(first_records)} ds_autoep_layers records, found "
                                          f"{len(records)}", meta.path)
    ranks = set()
    for i, (rec, ref) in enumerate(zip(records, first_records)):
        for key in _SAME:
            if rec.get(key) != ref.get(key):
                raise InconsistentCheckpointError(f"ds_autoep_layers[{i}].{key} differs from rank 0's", meta.path)
        e = rec.get("ep_rank")
        if not isinstance(e, int) or isinstance(e, bool):
            raise CorruptCheckpointError(f"ds_autoep_layers[{i}] lacks an int ep_rank", meta.path)
        ranks.add(e)
    if len(ranks) != 1:
        raise InconsistentCheckpointError(f"ds_autoep_layers name several ep ranks {sorted(ranks)}", meta.path)
    return ranks.pop()


def _expert_shapes(models, records, ep_ranks) -> dict[str, list[tuple[Any, torch.Tensor]]]:
    """``{prefix.wN: [(rank 0's file, expert E's shape as a meta tensor) for E]}``: what
    :func:`.autoep.trainable` checks ``affine_maps`` against, in place of ZeRO 1-2's expert files.
    One expert's shape is the local tensor's without its first dimension, on every ep rank."""
    first = models[0]
    dtype = next((t.dtype for t in first.module.values()), torch.float32)
    out = {}
    for rec in records:
        for w in autoep.WEIGHTS:
            name = f"{rec['expert_key_prefix']}.{w}"
            shapes = set()
            for m in models:
                local = next((g[name] for g in m.param_shapes or [] if name in g), None)
                if local is None:
                    raise InconsistentCheckpointError(f"expected AutoEP expert tensor {name!r} in 'param_shapes'",
                                                      m.path)
                local = tuple(local)
                if not local or local[0] != rec["num_local_experts"]:
                    raise InconsistentCheckpointError(
                        f"{name!r} has the local shape {list(local)}, not {rec['num_local_experts']} experts", m.path)
                shapes.add(local[1:])
            if len(shapes) != 1:
                raise InconsistentCheckpointError(f"the ep ranks' experts of {name!r} differ in shape", first.path)
            one = torch.empty(shapes.pop(), dtype=dtype, device="meta")
            out[name] = [(first.path, one)] * rec["num_experts"]
    return out


def _groups_of(o) -> list[dict]:
    info = o.raw.get("optimizer_state_dict", {}).get(PARTITION_GROUPS)
    if not isinstance(info, (list, tuple)) or len(info) != len(o.flat_groups) or \
            not all(isinstance(x, dict) for x in info):
        raise CorruptCheckpointError(f"expected '{PARTITION_GROUPS}' with a record per flat group "
                                     f"({len(o.flat_groups)}) in an AutoEP ZeRO-3 save", o.path)
    return list(info)


def _partitions(models, optims, records, ep_ranks) -> list[Partition]:
    """Dense groups over every rank; each expert group once per ep rank, over that ep rank's
    expert-data-parallel ranks in ``partition_rank`` order, under ``<name>@ep<e>``."""
    W = len(optims)
    shapes = models[0].param_shapes
    if shapes is None or any(len(m.param_shapes or []) != len(shapes) for m in models) or \
            any(len(o.flat_groups) != len(shapes) for o in optims):
        raise InconsistentCheckpointError("expected one 'param_shapes' group per flat fp32 group on every rank",
                                          models[0].path)
    infos = [_groups_of(o) for o in optims]
    fused = {f"{r['expert_key_prefix']}.{w}" for r in records for w in autoep.WEIGHTS}
    out = []
    for g, group in enumerate(shapes):
        experts = set(group) & fused
        is_expert = [EXPERT_FAMILY in (info[g].get("families") or []) for info in infos]
        if not experts and not any(is_expert):
            for r, info in enumerate(infos):
                if info[g].get("partition_rank") != r or list(info[g].get("partition_ranks") or []) != list(range(W)):
                    raise InconsistentCheckpointError(f"dense group {g} is not cut over every rank in rank order",
                                                      optims[r].path)
            for m in models[1:]:
                if m.param_shapes[g] != group:
                    raise InconsistentCheckpointError(f"'param_shapes' group {g} differs from rank 0's", m.path)
            out.append(Partition(tuple(range(W)), g, dict(group)))
            continue
        if not all(is_expert) or set(group) != experts:
            raise InconsistentCheckpointError(f"group {g} mixes AutoEP experts and other parameters",
                                              models[0].path)
        members: dict[int, list[int]] = {}
        for r, e in enumerate(ep_ranks):
            members.setdefault(e, []).append(r)
        edp = records[0]["expert_data_parallel_world_size"]
        for e, ranks in sorted(members.items()):
            for r in ranks:  # each rank's partition record against its own ds_autoep_layers records
                info = infos[r][g]
                own = {rec.get("expert_data_parallel_rank") for rec in autoep.autoep_records(models[r].raw,
                                                                                            models[r].path) or []}
                if type(info.get("partition_rank")) is not int or own != {info.get("partition_rank")} or \
                        info.get("partition_count") != len(ranks) or \
                        sorted(info.get("partition_ranks") or []) != sorted(ranks) or len(ranks) != edp:
                    raise InconsistentCheckpointError(
                        f"ep rank {e}'s expert group {g} is not cut over its {edp} expert-data-parallel ranks "
                        f"{sorted(ranks)}: this rank records partition_rank {info.get('partition_rank')!r} of "
                        f"{info.get('partition_count')!r} over {info.get('partition_ranks')!r}, expert-data-parallel "
                        f"rank {sorted(own, key=str)}", optims[r].path)
            ranks.sort(key=lambda r: infos[r][g]["partition_rank"])
            if [infos[r][g]["partition_rank"] for r in ranks] != list(range(len(ranks))):
                raise InconsistentCheckpointError(f"ep rank {e}'s expert group {g} repeats a partition_rank over "
                                                  f"ranks {ranks}", optims[ranks[0]].path)
            for r in ranks:
                if models[r].param_shapes[g] != models[ranks[0]].param_shapes[g]:
                    raise InconsistentCheckpointError(f"'param_shapes' group {g} differs within ep rank {e}",
                                                      models[r].path)
            local = models[ranks[0]].param_shapes[g]
            out.append(Partition(tuple(ranks), g, {f"{n}@ep{e}": tuple(s) for n, s in local.items()}))
    return out


LAYOUT = AutoEPAllStagesLayout()
