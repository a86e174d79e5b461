"""``zerofast.reshard``: rewrite a ZeRO checkpoint for another data-parallel world size.

DeepSpeed refuses to load a ZeRO checkpoint at another data-parallel size. The plan builders
already know where every element of the fp32 masters and of the Adam moments sits; here the
other direction is laid out: for each target rank, the flat partitions DeepSpeed 0.19.8 builds
at world size N, each described as a :class:`TensorPlan` over the source files, written through
the native executor straight into the new files (see :mod:`..torch_stream`).

How DeepSpeed lays the partitions out at world size N:

- stages 1/2 (and the stage-1 BF16_Optimizer): per param group, the parameters back to back in
  ``param_shapes`` order, each followed by its ``param_alignment_paddings`` entry (which depends
  on the dtype, not on N); the whole padded with zeros to a multiple of ``2 * N``; rank r owns
  the r-th of N equal slices. The saved fp32 slice drops the rank's share of the end padding
  (``group_paddings``); the Adam state keeps it. The BF16_Optimizer keeps the padding in its
  slice too and records it on the last rank only.
- stage 3: every parameter, trainable or frozen, is cut into ``ceil(numel / N)`` elements per
  rank, zero padded; a rank's flat group is its pieces back to back, per sub-group (groups are
  split into sub-groups of ``sub_group_size`` partition elements).

Everything else (module state, buffers, frozen weights, scalar optimizer state such as ``step``,
the loss scaler, the lr scheduler, ``global_steps``, client state) is copied; ``dp_world_size``
and ``ds_config``'s ``train_batch_size`` follow the new size.
"""
from __future__ import annotations

import math
import os
import shutil
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...errors import ExportError, InconsistentCheckpointError, ReshardError, UnsupportedCheckpointError
from ...execute import Executor
from ...layouts import discover, load_checkpoint
from ...load import LoadedCheckpoint
from ...load.stand_ins import DeepSpeedRecord
from ... import keys
from ...plan import FROZEN, SourceTable, TensorPlan, build_plan
from ...plan.builders import master_flat_groups
from ...plan.model import tensor_identity
from ...plan.optimizer import checked_states, state_flat_groups, available_keys, group_states
from .. import ds_pickle
from ..outdir import write_marker, os_error, output_dir, write_text
from ..run import ALONE
from ..torch_stream import Skeleton, write_torch_file

if TYPE_CHECKING:
    from ..distributed import Team

NCCL_START_ALIGNMENT_FACTOR = 2  # DeepSpeed's stage_1_and_2.py / bf16_optimizer.py
DEFAULT_SUB_GROUP_SIZE = 1_000_000_000  # zero_optimization.sub_group_size default
_FRAGMENT = "deepspeed.utils.tensor_fragment.fragment_address"
_RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


def reshard(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, world_size: int, *, tag: str | None = None,
            overwrite: bool = False, team: Team | None = None) -> Path:
    """Write the checkpoint at ``ckpt_dir`` as DeepSpeed would have saved it at ``world_size``
    data-parallel ranks, so that a plain ``engine.load_checkpoint(out_dir)`` at that size resumes.

    Args:
        ckpt_dir: the checkpoint root (holding ``latest``) or a tag folder, ZeRO stage 0-3.
        out_dir: the new checkpoint root; it gets ``latest``, the tag folder and DeepSpeed's
            recovery script when the source has one. Written into a temporary folder and moved
            into place once complete.
        world_size: the new data-parallel world size.
        tag: which save to read when the root holds several (the output keeps its tag).
        overwrite: write into a folder that holds files zerofast did not write.
        team: the ranks sharing the files (``zerofast.export.distributed``); None writes them all.

    Returns:
        The tag folder written.
    """
    if type(world_size) is not int or world_size < 1:
        raise ReshardError(f"expected a world size (an int >= 1), got {world_size!r}")
    team = team or ALONE
    out = Path(out_dir)
    with team.step("reading the checkpoint", out):
        files = discover(ckpt_dir, tag)
        ckpt = load_checkpoint(files)
        source = Source.read(ckpt)
        writer = _LAYOUTS[ckpt.stage](source, world_size)
    with team.output_dir(out, overwrite) as (tmp, previous):
        def produce():
            return ((f"{files.tag}/{name}", obj, sk) for name, obj, sk in writer.files())

        write_shared(team, out, tmp, files.tag, produce, source.executor)
        with team.step("committing", out):
            if team.leader:
                write_text(tmp / "latest", files.tag)
                names = [files.tag, "latest"]
                for script in _RECOVERY_SCRIPTS:
                    if (files.root / script).is_file():
                        shutil.copyfile(files.root / script, tmp / script)
                        names.append(script)
                commit_tree(out, tmp, names, previous)
    return out / files.tag


@dataclass(frozen=True)
class FileWrite:
    """One output file as the ranks share them out (``Team.share`` reads ``file.name``,
    ``file.keys`` and ``nbytes``)."""

    name: str  # the path under the output folder
    nbytes: int
    keys: tuple = ()

    @property
    def file(self) -> "FileWrite":
        return self


def write_shared(team, out: Path, tmp: Path, tag: str, produce, executor: Executor) -> None:
    """Write this rank's share of the files ``produce()`` yields as (path, object, skeleton).
    Every rank plans every file (metadata only, one file at a time) and writes its own."""
    planned = [FileWrite(path, sum(tp.nbytes for tp in sk.plans.values())) for path, _, sk in produce()]
    mine = {w.name for w in team.share(planned, tag, out)}
    with team.step("writing the files", out):
        for path, obj, skeleton in produce():
            if path in mine:
                (tmp / path).parent.mkdir(parents=True, exist_ok=True)
                write_torch_file(tmp / path, obj, skeleton, executor)


def commit_tree(out_dir: Path, tmp: Path, names: list[str], previous: list[str]) -> None:
    """Move files and folders from ``tmp`` into ``out_dir`` in the order of ``names`` (``latest``
    after the tag folder it names), after removing what they replace and what the previous run
    wrote (``latest`` first, so it never names a folder that is gone). The export's marker claims
    every name first, so a rerun after an interruption recognizes them as zerofast's."""
    write_marker(out_dir, tmp, sorted(set(previous) | set(names)))
    try:
        for name in sorted(set(previous) | set(names), key=lambda n: n != "latest"):
            path = out_dir / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()
        for name in names:
            os.replace(tmp / name, out_dir / name)
    except OSError as e:
        raise ExportError(f"stopped while moving the new files into place: {os_error(e)}; run it again",
                          out_dir) from e
    write_marker(out_dir, tmp, names)


# ---------------------------------------------------------------------------------------------
# The source: every tensor the output needs, as plans over one source table.

@dataclass
class Source:
    ckpt: LoadedCheckpoint
    table: SourceTable
    executor: Executor
    masters: dict[str, TensorPlan]  # trainable name -> full fp32 master
    moments: dict[str, dict[str, TensorPlan]]  # per-element optimizer key -> name -> full state
    frozen: dict[str, TensorPlan]  # frozen name -> full value in the model dtype
    copies: dict[tuple, torch.Tensor]

    @classmethod
    def read(cls, ckpt: LoadedCheckpoint) -> "Source":
        if not ckpt.layout.writable:
            raise UnsupportedCheckpointError(
                f"checkpoints with {ckpt.layout.title} ({ckpt.layout.name}) cannot be written back at another world "
                "size yet; plain data-parallel ZeRO 0-3 saves can", ckpt.files.tag_dir)
        table = SourceTable()
        masters, moments, frozen = {}, {}, {}
        if ckpt.stage:
            _check_optimizer(ckpt)
            masters = _plans(ckpt.layout.trainable_from(ckpt, table, master_flat_groups(ckpt), "flat fp32 groups"))
            states = checked_states(ckpt)
            moments = {key: _plans(ckpt.layout.trainable_from(ckpt, table, state_flat_groups(ckpt, states, key),
                                                       f"'{key}' groups"))
                       for key in available_keys(ckpt)}
            plan = build_plan(ckpt, table, None)
            frozen = {n: tp for n, tp in plan.tensors.items() if tp.kind == FROZEN}
        return cls(ckpt, table, Executor(table.tensors, streamable=table.mapped), masters, moments, frozen, {})

    def copy(self, value: Any, file: Path, where: str, skeleton: Skeleton) -> Any:
        """``value`` from a loaded pickle, made writable: tensors become placeholders filled from
        the source file (one output tensor per source tensor, so ties stay ties), DeepSpeed
        stand-ins become objects pickled under their DeepSpeed names."""
        if isinstance(value, torch.Tensor):
            ident = (str(file), tensor_identity(value))
            if ident not in self.copies:
                src = self.table.add(str(file), where, value)
                tp = TensorPlan(where, tuple(value.shape), "copy", value.dtype, value.dtype,
                                ((src, 0, 0, value.numel()),) if value.numel() else ())
                self.copies[ident] = skeleton.tensor(tp)
            return self.copies[ident]
        if isinstance(value, DeepSpeedRecord):
            fields = {k: self.copy(v, file, f"{where}.{k}", skeleton) for k, v in vars(value).items() if k != "args"}
            return ds_pickle.record_class(value.ds_name)(**fields)
        if isinstance(value, torch.Size):
            return value
        if isinstance(value, dict):
            items = [(k, self.copy(v, file, f"{where}[{k!r}]", skeleton)) for k, v in value.items()]
            return type(value)(items) if type(value) in (dict, OrderedDict) else dict(items)
        if isinstance(value, (list, tuple)):
            items = [self.copy(v, file, f"{where}[{i}]", skeleton) for i, v in enumerate(value)]
            return type(value)(items) if type(value) in (list, tuple) else list(items)
        return value

    def new_file(self) -> Skeleton:
        self.copies = {}  # ties are per file, as torch.save keeps them
        return Skeleton()


def _plans(entries: dict) -> dict[str, TensorPlan]:
    return {name: TensorPlan(name, shape, "state", dtype, dtype, tuple(segs))
            for name, (shape, dtype, segs) in entries.items()}


def _check_optimizer(ckpt: LoadedCheckpoint) -> None:
    cfg = ckpt.meta.raw.get(keys.DS_CONFIG)
    zero = cfg.get("zero_optimization") if isinstance(cfg, dict) else None
    if isinstance(zero, dict) and zero.get("round_robin_gradients"):
        raise UnsupportedCheckpointError(
            "resharding with round_robin_gradients is not supported: the flat order of the parameters depends on "
            "the world size", ckpt.meta.path)
    if (ckpt.files.tag_dir / "offloaded_tensors").exists():
        raise UnsupportedCheckpointError("resharding NVMe-offloaded optimizer state is not supported",
                                         ckpt.files.tag_dir)
    inner_key = keys.inner_key(ckpt.stage)
    for o in ckpt.optim_states:
        inner = o.raw[keys.OPTIMIZER_STATE_DICT].get(inner_key)
        if not isinstance(inner, dict) or not isinstance(inner.get(keys.PARAM_GROUPS), list):
            raise UnsupportedCheckpointError(
                f"resharding needs the wrapped optimizer's state_dict() in {inner_key!r}; found "
                f"{type(inner).__name__} (an elastic_checkpoint save?)", o.path)


def concat(name: str, length: int, dtype: torch.dtype, pieces: list[tuple[TensorPlan, int, int, int]]) -> TensorPlan:
    """A 1-D plan of ``length`` elements: elements [lo, hi) of each piece's plan at ``dst``; the rest
    is left as the file holds it (zeros)."""
    segments = []
    for tp, lo, hi, dst in pieces:
        for src, src_off, dst_off, n in tp.slice(lo, hi).segments:
            segments.append((src, src_off, dst + dst_off, n))
    return TensorPlan(name, (length,), "partition", dtype, dtype, tuple(segments))


def _dtype(plans: dict[str, TensorPlan]) -> torch.dtype:
    return next(iter(plans.values())).out_dtype if plans else torch.float32


def _ds_config(cfg: Any, world: int) -> Any:
    """The config with the batch size DeepSpeed checks against the new world size."""
    if not isinstance(cfg, dict):
        return cfg
    out = dict(cfg)
    micro, gas = cfg.get("train_micro_batch_size_per_gpu"), cfg.get("gradient_accumulation_steps", 1)
    if "train_batch_size" in cfg and isinstance(micro, int) and isinstance(gas, int):
        out["train_batch_size"] = micro * gas * world
    return out


def _replaced(raw: dict, source: Source, file: Path, skeleton: Skeleton, world: int, new: dict | None = None) -> dict:
    """A copy of a file's top-level dict with ``new`` values (same key order), world size updated."""
    out, new = {}, new or {}
    for key, value in raw.items():
        if key in new:
            out[key] = new[key]
        elif key == keys.DP_WORLD_SIZE:
            out[key] = world
        elif key == keys.DS_CONFIG:
            out[key] = _ds_config(value, world)
        else:
            out[key] = source.copy(value, file, str(key), skeleton)
    return out


# ---------------------------------------------------------------------------------------------
# Layouts.

class _Stage0:
    """Every rank holds everything: one model-states file, only its world size changes."""

    def __init__(self, source: Source, world: int):
        self.source, self.world = source, world

    def files(self):
        meta = self.source.ckpt.meta
        sk = self.source.new_file()
        yield meta.path.name, _replaced(meta.raw, self.source, meta.path, sk, self.world), sk


class _Zero12:
    def __init__(self, source: Source, world: int):
        self.source, self.world = source, world
        ckpt = source.ckpt
        self.first = ckpt.optim_states[0]
        self.bf16_wrapper = self.first.zero_stage is None
        self.groups = [list(g.items()) for g in ckpt.meta.param_shapes]
        pads = self.first.param_alignment_paddings
        self.pads = [[int(p) for p in pads[g]] if pads else [0] * len(names) for g, names in enumerate(self.groups)]
        self.totals, self.sizes = [], []
        for g, params in enumerate(self.groups):
            total = sum(math.prod(s) + p for (_, s), p in zip(params, self.pads[g]))
            align = NCCL_START_ALIGNMENT_FACTOR * world
            size = math.ceil(total / align) * align // world
            if total <= (world - 1) * size:
                raise ReshardError(
                    f"world size {world} leaves rank {world - 1} without a single element of param group {g} "
                    f"({total} elements): ZeRO needs every rank to hold part of every group; choose a smaller one",
                    ckpt.meta.path)
            self.totals.append(total)
            self.sizes.append(size)

    def files(self):
        meta = self.source.ckpt.meta
        sk = self.source.new_file()
        yield meta.path.name, _replaced(meta.raw, self.source, meta.path, sk, self.world), sk
        prefix = self.first.path.name.split("zero_pp_rank_")[0]
        for r in range(self.world):
            sk = self.source.new_file()
            yield f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt", self._optim_file(r, sk), sk

    def _padding(self, g: int, r: int) -> int:
        size, total = self.sizes[g], self.totals[g]
        if self.bf16_wrapper:
            return size * self.world - total if r == self.world - 1 else 0
        return max(0, min(size, (r + 1) * size - total))

    def _part(self, plans: dict[str, TensorPlan], g: int, r: int, length: int, what: str) -> TensorPlan:
        start, pieces, offset = r * self.sizes[g], [], 0
        for (name, shape), pad in zip(self.groups[g], self.pads[g]):
            n = math.prod(shape)
            lo, hi = max(offset, start), min(offset + n, start + length)
            if lo < hi:
                pieces.append((plans[name], lo - offset, hi - offset, lo - start))
            offset += n + pad
        return concat(f"{what}[{g}] of rank {r}", length, _dtype(plans), pieces)

    def _mappings(self, g: int, r: int) -> OrderedDict:
        start, end, offset, out = r * self.sizes[g], (r + 1) * self.sizes[g], 0, OrderedDict()
        for (name, shape), pad in zip(self.groups[g], self.pads[g]):
            n = math.prod(shape)
            lo, hi = max(offset, start), min(offset + n, end)
            if lo < hi:
                out[name] = ds_pickle.record_class(_FRAGMENT)(numel=hi - lo, start=lo - start)
            offset += n + pad
        return out

    def _optim_file(self, r: int, sk: Skeleton) -> dict:
        src = self.first
        osd = src.raw[keys.OPTIMIZER_STATE_DICT]
        n_groups = len(self.groups)
        masters = []
        for g in range(n_groups):
            length = self.sizes[g] - (0 if self.bf16_wrapper else self._padding(g, r))
            masters.append(sk.tensor(self._part(self.source.masters, g, r, length, "fp32 partition")))
        new = {
            keys.ZERO12_INNER: self._base_state(r, sk),
            keys.ZERO12_FLAT: masters,
            keys.GROUP_PADDINGS: [self._padding(g, r) for g in range(n_groups)],
            keys.PARTITION_COUNT: [self.world] * n_groups if isinstance(osd.get(keys.PARTITION_COUNT), list)
            else self.world,
            keys.SLICE_MAPPINGS: [self._mappings(g, r) for g in range(n_groups)],
        }
        if keys.ZERO_STAGE in osd:
            new[keys.ZERO_STAGE] = ds_pickle.ZeroStageEnum(int(osd[keys.ZERO_STAGE]))
        inner = _replaced(osd, self.source, src.path, sk, self.world, new)
        return _replaced(src.raw, self.source, src.path, sk, self.world, {keys.OPTIMIZER_STATE_DICT: inner})

    def _base_state(self, r: int, sk: Skeleton) -> dict:
        src = self.first
        base = src.raw[keys.OPTIMIZER_STATE_DICT][keys.ZERO12_INNER]
        states = group_states(src, 1)
        state = {}
        for g, (where, group_state) in enumerate(states):
            entry = {}
            for key, value in group_state.items():
                if key in self.source.moments:
                    entry[key] = sk.tensor(self._part(self.source.moments[key], g, r, self.sizes[g], key))
                else:
                    entry[key] = self.source.copy(value, src.path, f"{where}.{key}", sk)
            state[g] = entry
        out = {}
        for key, value in base.items():
            if key == keys.STATE:
                out[key] = state
            else:
                out[key] = self.source.copy(value, src.path, f"base_optimizer_state.{key}", sk)
        return out


class _Zero3:
    def __init__(self, source: Source, world: int):
        self.source, self.world = source, world
        ckpt = source.ckpt
        first = ckpt.optim_states[0]
        inner = first.raw[keys.OPTIMIZER_STATE_DICT][keys.ZERO3_INNER]
        shapes = ckpt.meta.param_shapes
        self.param_groups = inner[keys.PARAM_GROUPS]
        self.group_params: list[list[tuple[str, tuple]]] = []
        seen = set()
        for g, group in enumerate(self.param_groups):
            subs = [i for i in group.get(keys.PARAMS, [])]
            if any(type(i) is not int or not 0 <= i < len(shapes) or i in seen for i in subs):
                raise InconsistentCheckpointError(
                    f"expected param group {g} to list sub-groups of 'param_shapes' (0..{len(shapes) - 1}) once, "
                    f"found {subs}", first.path)
            seen.update(subs)
            self.group_params.append([item for i in subs for item in shapes[i].items()])
        if len(seen) != len(shapes):
            raise InconsistentCheckpointError(
                f"the optimizer's param groups list {len(seen)} of {len(shapes)} 'param_shapes' sub-groups", first.path)
        # Scalar state (``step``) per param group, from the group's first sub-group.
        states = group_states(first, 3)
        self.step_of = [states[group[keys.PARAMS][0]][1] if group[keys.PARAMS] else {} for group in self.param_groups]
        self.sub_group_size = _sub_group_size(ckpt)
        self.sub_groups = [(g, sub) for g, params in enumerate(self.group_params)
                           for sub in self._split(params)]

    def _split(self, params: list[tuple[str, tuple]]) -> list[list[tuple[str, tuple]]]:
        """stage3._create_fp16_sub_groups at the new world size."""
        ks = [math.ceil(math.prod(s) / self.world) for _, s in params]
        if self.sub_group_size >= sum(ks):
            return [params]
        out, cur, acc = [], [], 0
        for i, (item, k) in enumerate(zip(params, ks)):
            cur.append(item)
            acc += k
            if acc >= self.sub_group_size or i == len(params) - 1:
                out.append(cur)
                cur, acc = [], 0
        return out

    def _chunk(self, tp: TensorPlan, n: int, r: int) -> tuple[TensorPlan, int, int]:
        k = math.ceil(n / self.world)
        lo, hi = min(n, r * k), min(n, (r + 1) * k)
        return tp, lo, hi

    def _flat(self, plans: dict[str, TensorPlan], sub: list, r: int, what: str) -> TensorPlan:
        pieces, offset = [], 0
        for name, shape in sub:
            n = math.prod(shape)
            tp, lo, hi = self._chunk(plans[name], n, r)
            if lo < hi:
                pieces.append((tp, lo, hi, offset))
            offset += math.ceil(n / self.world)
        return concat(f"{what} of rank {r}", offset, _dtype(plans), pieces)

    def files(self):
        for r in range(self.world):
            sk = self.source.new_file()
            yield f"zero_pp_rank_{r}_mp_rank_00_model_states.pt", self._model_file(r, sk), sk
        first = self.source.ckpt.optim_states[0]
        prefix = first.path.name.split("zero_pp_rank_")[0]
        for r in range(self.world):
            sk = self.source.new_file()
            yield f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt", self._optim_file(r, sk), sk

    def _model_file(self, r: int, sk: Skeleton) -> dict:
        models = self.source.ckpt.model_states
        src = models[0] if r == 0 else models[min(1, len(models) - 1)]
        fragments = OrderedDict()
        for name, shape in (src.frozen_param_shapes or {}).items():
            n = math.prod(shape)
            tp = self.source.frozen[name]
            k = math.ceil(n / self.world)
            _, lo, hi = self._chunk(tp, n, r)
            fragments[name] = sk.tensor(concat(f"frozen {name} of rank {r}", k, tp.out_dtype,
                                               [(tp, lo, hi, 0)] if lo < hi else []))
        shapes = [OrderedDict((n, torch.Size(s)) for n, s in sub) for _, sub in self.sub_groups]
        # Only global rank 0 collects the shared params.
        shared = self.source.copy(models[0].raw.get(keys.SHARED_PARAMS), src.path, keys.SHARED_PARAMS, sk) if r == 0 else {}
        return _replaced(src.raw, self.source, src.path, sk, self.world,
                         {keys.PARAM_SHAPES: shapes, keys.FROZEN_PARAM_FRAGMENTS: fragments, keys.SHARED_PARAMS: shared})

    def _optim_file(self, r: int, sk: Skeleton) -> dict:
        src = self.source.ckpt.optim_states[0]
        osd = src.raw[keys.OPTIMIZER_STATE_DICT]
        flats, state = [], {}
        for si, (g, sub) in enumerate(self.sub_groups):
            flats.append(sk.tensor(self._flat(self.source.masters, sub, r, f"fp32_flat_groups[{si}]")))
            entry = {}
            for key, value in self.step_of[g].items():
                if key in self.source.moments:
                    entry[key] = sk.tensor(self._flat(self.source.moments[key], sub, r, f"{key}[{si}]"))
                else:
                    entry[key] = self.source.copy(value, src.path, f"state.{key}", sk)
            state[si] = entry
        groups = []
        for g, group in enumerate(self.param_groups):
            settings = {k: self.source.copy(v, src.path, f"param_groups[{g}].{k}", sk) for k, v in group.items()}
            settings[keys.PARAMS] = [si for si, (owner, _) in enumerate(self.sub_groups) if owner == g]
            groups.append(settings)
        new = {
            keys.ZERO_STAGE: ds_pickle.ZeroStageEnum(int(osd[keys.ZERO_STAGE])),
            keys.PARTITION_COUNT: self.world,
            keys.ZERO3_INNER: {keys.STATE: state, keys.PARAM_GROUPS: groups},
            keys.ZERO3_FLAT: flats,
        }
        inner = _replaced(osd, self.source, src.path, sk, self.world, new)
        return _replaced(src.raw, self.source, src.path, sk, self.world, {keys.OPTIMIZER_STATE_DICT: inner})


def _sub_group_size(ckpt: LoadedCheckpoint) -> int:
    cfg = ckpt.meta.raw.get(keys.DS_CONFIG)
    zero = cfg.get("zero_optimization") if isinstance(cfg, dict) else None
    value = zero.get("sub_group_size", DEFAULT_SUB_GROUP_SIZE) if isinstance(zero, dict) else DEFAULT_SUB_GROUP_SIZE
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if type(value) is not int or value < 1:
        raise UnsupportedCheckpointError(f"expected zero_optimization.sub_group_size to be an int, found {value!r}",
                                         ckpt.meta.path)
    return value


_LAYOUTS = {0: _Stage0, 1: _Zero12, 2: _Zero12, 3: _Zero3}
