"""``zerofast.reshard``: rewrite a ZeRO checkpoint for another data-parallel world size.

DeepSpeed refuses to load a ZeRO checkpoint at another data-parallel size. The plan builders
already know where every element of the fp32 masters and of the Adam moments sits; here the
other direction is laid out: for each target rank, the flat partitions DeepSpeed 0.19.8 builds
at world size N, each described as a :class:`TensorPlan` over the source files, written through
the native executor straight into the new files (see :mod:`.torch_stream`).

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
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..base.errors import InconsistentCheckpointError, ReshardError, UnplacedOptimizerStateError, UnsupportedCheckpointError
from ..layouts import discover, load_checkpoint
from ..load import LoadedCheckpoint
from ..output.team import opening
from ..output.transaction import Folder, copy_file, write_text
from ..base import keys
from ..plan import TensorPlan
from ..plan.optimizer import group_states
from . import ds_pickle, round_robin
from .source import Source, Written, concat, write_checkpoint
from .torch_stream import Skeleton

if TYPE_CHECKING:
    from ..output.team import Team
    from ..output.windows import Progress

COMMAND = "reshard"
NCCL_START_ALIGNMENT_FACTOR = 2  # DeepSpeed's stage_1_and_2.py / bf16_optimizer.py
DEFAULT_SUB_GROUP_SIZE = 1_000_000_000  # zero_optimization.sub_group_size default
_FRAGMENT = "deepspeed.utils.tensor_fragment.fragment_address"
ELASTIC_STEP = "base_optimizer_state_step"  # stage_1_and_2.BASE_OPTIMIZER_STATE_STEP
_RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


def reshard(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, world_size: int, *, tag: str | None = None,
            overwrite: bool = False, progress: Progress | None = None, team: Team | None = None,
            keep_nvme: bool = False, follow_symlinks: bool | None = None) -> Path:
    """Write the checkpoint at ``ckpt_dir`` as DeepSpeed would have saved it at ``world_size``
    data-parallel ranks, so that a plain ``engine.load_checkpoint(out_dir)`` at that size resumes.

    Args:
        ckpt_dir: the checkpoint root (holding ``latest``) or a tag folder, ZeRO stage 0-3.
        out_dir: the new checkpoint root; it gets ``latest``, the tag folder and DeepSpeed's
            recovery script when the source has one. Written into a temporary folder and moved
            into place once complete. It may not be, lie inside or hold the checkpoint.
        world_size: the new data-parallel world size.
        tag: which save to read when the root holds several (the output keeps its tag).
        overwrite: write into a folder that holds files this command did not write (another
            command's output, a user's files); only the names the new checkpoint writes are replaced.
        progress: called as ``progress(bytes_done, bytes_total)``, first with 0, then as data lands.
        team: the ranks sharing the files (:mod:`zerofast.output.team`); None writes them all.
        keep_nvme: write a ZeRO-Infinity save's optimizer state back into ``offloaded_tensors/``
            swap files, for an engine that offloads it to NVMe. Not supported (refused): DeepSpeed
            names those files by ``ds_id``, which the save does not record. Without it, such a
            save is written plain (everything in the optimizer files), which an engine without
            NVMe optimizer offload loads.
        follow_symlinks: as for :func:`zerofast.reconstruct`: follow symbolic links that lead out
            of the checkpoint folder (None: ``ZEROFAST_FOLLOW_SYMLINKS``).

    Returns:
        The tag folder written.
    """
    return write_resharded(ckpt_dir, out_dir, world_size, tag=tag, overwrite=overwrite, progress=progress,
                           team=team, keep_nvme=keep_nvme, follow_symlinks=follow_symlinks).path


def write_resharded(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, world_size: int, *,
                    tag: str | None = None, overwrite: bool = False, progress: Progress | None = None,
                    team: Team | None = None, keep_nvme: bool = False,
                    follow_symlinks: bool | None = None) -> Written:
    """:func:`reshard`, returning what it wrote and replaced."""
    if type(world_size) is not int or world_size < 1:
        raise ReshardError(f"expected a world size (an int >= 1), got {world_size!r}")
    if keep_nvme:
        raise UnsupportedCheckpointError(
            "writing the optimizer state into offloaded_tensors/ swap files (--keep-nvme) is not supported: DeepSpeed "
            "names them by each parameter's ds_id, which the save does not record. Without it, reshard writes a "
            "plain ZeRO-3 save, which an engine without NVMe optimizer offload loads", ckpt_dir)
    with opening(ckpt_dir, out_dir, tag, follow_symlinks, team) as run:
        files = discover(run.ckpt_dir, run.tag, follow_symlinks=run.follow_symlinks)
        ckpt = load_checkpoint(files)
        source = Source.read(ckpt)
        writer = _LAYOUTS[ckpt.stage](source, world_size)

    def produce():
        return ((f"{files.tag}/{name}", obj, sk) for name, obj, sk in writer.files())

    def finish(folder: Folder) -> None:
        write_text(folder.tmp / "latest", files.tag)
        names = [files.tag, "latest"]
        for script in _RECOVERY_SCRIPTS:
            if (files.root / script).is_file():
                copy_file(files.root / script, folder.tmp / script)
                names.append(script)
        folder.commit(names, pointer=lambda n: n == "latest")

    written = write_checkpoint(run.out, files, produce, source.executor, command=COMMAND, overwrite=overwrite,
                               finish=finish, team=run.team, progress=progress, started=run.started)
    return Written(run.out / files.tag, written.files, written.nbytes, written.seconds, written.replaced)


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
        self.round_robin = round_robin.enabled(ckpt)
        if self.round_robin:  # the flat order, and so the paddings, depend on the world size
            self.groups = [round_robin.reorder(params, ckpt.world_size, world) for params in self.groups]
            self.pads = [round_robin.paddings([math.prod(s) for _, s in params], ckpt) for params in self.groups]
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
        shapes = ({keys.PARAM_SHAPES: [OrderedDict((n, torch.Size(s)) for n, s in params) for params in self.groups]}
                  if self.round_robin else {})
        yield meta.path.name, _replaced(meta.raw, self.source, meta.path, sk, self.world, shapes), sk
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
        if self.round_robin:
            new[keys.ALIGNMENT_PADDINGS] = [list(pads) for pads in self.pads]
        if keys.ZERO_STAGE in osd:
            new[keys.ZERO_STAGE] = ds_pickle.ZeroStageEnum(int(osd[keys.ZERO_STAGE]))
        inner = _replaced(osd, self.source, src.path, sk, self.world, new)
        if isinstance(new[keys.ZERO12_INNER], list) and ELASTIC_STEP not in inner:
            inner[ELASTIC_STEP] = self._elastic_step(sk)
        return _replaced(src.raw, self.source, src.path, sk, self.world, {keys.OPTIMIZER_STATE_DICT: inner})

    def _elastic_step(self, sk: Skeleton) -> Any:
        """DeepSpeed 0.19.8 saves ``base_optimizer_state_step`` only when the torch optimizer keeps
        ``step`` in its param groups (torch's Adam keeps it per state), yet its elastic loader
        asserts the key on every load, so its own elastic saves do not load. Written here from
        the states' own ``step`` (all groups agree), the resharded save loads."""
        steps = [state.get("step") for _, state in group_states(self.first, 1)]
        return self.source.copy(steps[0], self.first.path, f"{keys.ZERO12_INNER}[0].step", sk)

    def _base_state(self, r: int, sk: Skeleton) -> dict | list:
        """The torch optimizer's state_dict() of rank r; with elastic_checkpoint, DeepSpeed's list
        of one lean state per group instead, each state without the rank's share of the padding."""
        src = self.first
        base = src.raw[keys.OPTIMIZER_STATE_DICT][keys.ZERO12_INNER]
        elastic = isinstance(base, (list, tuple))
        state = {}
        for g, (where, group_state) in enumerate(group_states(src, 1)):
            length = self.sizes[g] - (self._padding(g, r) if elastic else 0)
            entry = {}
            for key, value in group_state.items():
                if key in self.source.moments:
                    plans = self.source.moments[key]
                    entry[key] = sk.tensor(self._whole(plans, g, r, key) if g in self.source.whole.get(key, ())
                                           else self._part(plans, g, r, length, key))
                else:
                    entry[key] = self.source.copy(value, src.path, f"{where}.{key}", sk)
            state[g] = entry
        if elastic:
            return [state[g] for g in range(len(state))]
        out = {}
        for key, value in base.items():
            if key == keys.STATE:
                out[key] = state
            else:
                out[key] = self.source.copy(value, src.path, f"base_optimizer_state.{key}", sk)
        return out

    def _whole(self, plans: dict[str, TensorPlan], g: int, r: int, what: str) -> TensorPlan:
        """A state laid out over the whole parameters touching rank r's partition (Muon's
        momentum, see plan/whole_params.py), back to back without padding."""
        start, end, offset, pieces, length = r * self.sizes[g], (r + 1) * self.sizes[g], 0, [], 0
        for (name, shape), pad in zip(self.groups[g], self.pads[g]):
            n = math.prod(shape)
            if n and offset < end and offset + n > start:
                pieces.append((plans[name], 0, n, length))
                length += n
            offset += n + pad
        return concat(f"{what}[{g}] of rank {r}", length, _dtype(plans), pieces)


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
        for g, group in enumerate(self.param_groups):  # the new sub-groups mix the old ones' params
            for i in group[keys.PARAMS]:
                if set(states[i][1]) != set(self.step_of[g]):
                    raise UnplacedOptimizerStateError(
                        f"{COMMAND} cannot place the optimizer state of sub-group {i}: it keeps "
                        f"{sorted(states[i][1])}, another sub-group of param group {g} {sorted(self.step_of[g])}",
                        first.path)
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
