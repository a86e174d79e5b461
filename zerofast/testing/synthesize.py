"""Write DeepSpeed 0.19.8 ZeRO checkpoints without DeepSpeed, and return their ground truth.

The files match what ``DeepSpeedEngine.save_checkpoint`` writes in DeepSpeed 0.19.8 (checked
against checkpoints that the real engine wrote on a CPU): the same file names, the same pickled
dict keys in the same order, the same DeepSpeed globals in the pickles, the same partitioning,
padding and storage sharing. Values are random, so that a reader can be checked against the
returned :class:`GroundTruth`.

Used for fp16 checkpoints (DeepSpeed refuses fp16 on a CPU), for property-based tests
(:func:`zerofast.testing.strategies.layouts` draws random layouts), for demo checkpoints and for
large benchmark checkpoints. Every tensor is generated once with vectorized torch calls; the
per-rank pieces are built one rank at a time, so at stages 1-3 memory stays near the size of the
masters and module copy plus one rank's share (stage 0 is one file, built whole).

The pickles reference DeepSpeed classes by their real names (``deepspeed.runtime.zero.config.
ZeroStageEnum`` and friends). Small local stand-in classes are written under those names by a
pickler that emits the GLOBAL opcode itself, so DeepSpeed is never imported and nothing is put
into ``sys.modules``.

Layout facts mirrored here (DeepSpeed 0.19.8 source and real checkpoints):

* A trainable parameter with zero elements is not owned by the optimizer
  (``deepspeed.runtime.utils.is_optimized_parameter``): it is left out of the flat groups and
  ``param_shapes`` and, at stages 2 and 3, recorded with the frozen parameters. The ground truth
  therefore lists it under ``frozen`` (model dtype), which is also where DeepSpeed's own
  ``zero_to_fp32`` returns it from.
* Stages 1/2: each group's flat buffer is the group's parameters back to back (no per-parameter
  padding: ``zero_optimization.parameter_alignment`` defaults to false), then padded to a
  multiple of ``2 * world_size`` (``nccl_start_alignment_factor`` = 2). Rank r owns the r-th of
  ``world_size`` equal slices. The saved ``single_partition_of_fp32_groups[g]`` is that slice
  with this rank's share of the end padding cut off (a view; the storage keeps the padding).
  The base optimizer (Adam) state is not trimmed. The model-states ``module`` tensors are views
  into the group's model-dtype flat buffer (padding included in the storage).
* The stage-1 BF16_Optimizer (bf16 + fp32 gradient accumulation) saves the untrimmed slice, no
  ``zero_stage`` key, and ``group_paddings`` holding the whole end padding on the last rank only.
* Stage 3: every parameter (trainable or frozen) is split into ``ceil(numel / world_size)``
  element chunks, chunk r on rank r, zero padded at the end. A rank's flat group is its chunks
  of the group's parameters back to back; there is no other padding. Groups larger than
  ``sub_group_size`` (1e9 partition elements, the default) are split into sub-groups.
* Stage 0: one model-states file. Mixed precision (bf16/fp16) keeps fp32 masters in
  ``optimizer``: per-parameter ``fp32_groups`` (FP16_UnfusedOptimizer, what a torch optimizer
  gets), or one ``fp32_groups_flat`` tensor per group (FP16_Optimizer with a fused Adam; select
  it with ``LayoutSpec.stage0_flat_masters``). Plain fp32 has no masters: ``optimizer`` is the
  torch optimizer's own state dict.
* Stages 1-3 also get ``zero_to_fp32.py`` / ``zero_to_torch.py`` in the root, where DeepSpeed
  copies its recovery scripts; here they are short placeholders, not DeepSpeed's code.

Not modelled (values only, nothing a reader needs): ``ds_config`` is a small plausible config,
loss-scaler state assumes no overflow, and the Adam moments are random.
"""

from __future__ import annotations

import math
import os
import random
import re
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ..writers import ds_pickle
from ..writers.ds_pickle import ZeroStageEnum as _ZeroStageEnum, ds_global

__all__ = [
    "ParamSpec",
    "BufferSpec",
    "LayoutSpec",
    "GroundTruth",
    "synthesize",
    "DS_VERSION",
]

DS_VERSION = "0.19.8"

# DeepSpeed constants mirrored from its source.
NCCL_START_ALIGNMENT_FACTOR = 2  # stage_1_and_2.py / bf16_optimizer.py
ZERO3_SUB_GROUP_SIZE = 1_000_000_000  # zero_optimization.sub_group_size default
MICRO_BATCH = 4  # only feeds the recorded ds_config / global_samples

_MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------------------------
# Public specs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class BufferSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class LayoutSpec:
    stage: int  # 0, 1, 2, 3
    world_size: int  # data-parallel world size (stage 0 records it; masters are full)
    model_dtype: torch.dtype  # torch.float32, torch.bfloat16, torch.float16
    groups: list[list[ParamSpec]]  # trainable params per optimizer group, in flat-buffer order
    frozen: list[ParamSpec] = ()  # requires_grad=False params
    buffers: list[BufferSpec] = ()
    # alias -> source; the source is a trainable or frozen param name. The alias is a key of the
    # module state dict but not of param_shapes. In `order` the source must come first (the
    # first name under which a module reaches a shared parameter is the one DeepSpeed keeps).
    tied: dict[str, str] = field(default_factory=dict)
    order: list[str] | None = None  # module.state_dict() key order; None: a sensible interleaving
    tag: str = "global_step1"
    write_latest: bool = True
    seed: int = 0
    # stage 1 + bf16 with fp32 gradient accumulation (DeepSpeed's BF16_Optimizer): the optimizer
    # files have no zero_stage key.
    bf16_optimizer_wrapper: bool = False
    with_optimizer_states: bool = True  # Adam exp_avg/exp_avg_sq, partitioned like the masters
    # Extra (not in DeepSpeed's config): stage 0 bf16/fp16 with a fused optimizer
    # (FP16_Optimizer) keeps one flat fp32 master per group (`fp32_groups_flat`) and the module
    # params are views into one flat model-dtype buffer per group.
    stage0_flat_masters: bool = False


@dataclass
class GroundTruth:
    trainable: dict[str, torch.Tensor]  # fp32 masters, full shape
    frozen: dict[str, torch.Tensor]  # model dtype, full shape (incl. zero-element trainables)
    buffers: dict[str, torch.Tensor]
    state_dict_keys: list[str]
    tied: dict[str, str]
    model_dtype: torch.dtype


# --------------------------------------------------------------------------------------------
# Pickling under DeepSpeed's global names
# --------------------------------------------------------------------------------------------


@ds_global("deepspeed.utils.tensor_fragment", "fragment_address")
class _FragmentAddress:
    """Stands in for the dataclass deepspeed.utils.tensor_fragment.fragment_address."""

    def __init__(self, numel: int, start: int):
        self.numel = numel
        self.start = start


@ds_global("deepspeed.runtime.fp16.loss_scaler", "LossScaler")
class _LossScaler:
    """Stands in for deepspeed.runtime.fp16.loss_scaler.LossScaler (static scale)."""

    def __init__(self, scale=1.0):
        self.cur_scale = scale
        self.dynamic = False


@ds_global("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler")
class _DynamicLossScaler:
    """Stands in for deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler, fp16 defaults."""

    def __init__(self, steps: int):
        # Attribute order as DynamicLossScaler.__init__ creates them; state after `steps`
        # overflow-free steps with the default config (2**16 start, window 1000, hysteresis 2).
        self.cur_scale = _fp16_loss_scale(steps)
        self.dynamic = True
        self.cur_iter = steps
        self.last_overflow_iter = -1
        self.scale_factor = 2.0
        self.scale_window = 1000
        self.min_scale = 1
        self.delayed_shift = 2
        self.cur_hysteresis = 2
        self.consecutive_hysteresis = False
        self.raise_error_at_min_scale = True
        self.dtype = torch.float16


def _fp16_loss_scale(steps: int):
    # Starts at 2**16 (an int, from the config); doubled (becoming a float) after each 1000
    # overflow-free steps.
    doublings = max(0, (steps - 1) // 1000)
    return 2**16 if doublings == 0 else 2.0**16 * 2.0**doublings


def _save(obj, path: str) -> None:
    ds_pickle.save(obj, path)


# --------------------------------------------------------------------------------------------
# Layout planning
# --------------------------------------------------------------------------------------------


@dataclass
class _Plan:
    spec: LayoutSpec
    stage: int
    world: int
    dtype: torch.dtype
    groups: list[list[ParamSpec]]  # optimizer-owned params (numel > 0) per group
    all_trainable: list[ParamSpec]  # incl. zero-element ones, group order
    frozen: dict[str, ParamSpec]  # frozen + zero-element trainables, by name
    buffers: dict[str, BufferSpec]
    tied: dict[str, str]
    order: list[str]
    param_order: list[str]  # module.parameters() order (aliases excluded)
    non_optimized: list[str]  # frozen_param_shapes order
    buffers_in_order: list[str]  # buffer_names
    steps: int


def _default_order(trainable, frozen, tied, buffers) -> list[str]:
    """Group names by module prefix (first appearance), params before buffers, like state_dict()."""
    items = [(p.name, 0) for p in trainable] + [(p.name, 0) for p in frozen]
    items += [(a, 0) for a in tied] + [(b.name, 1) for b in buffers]
    prefixes: dict[str, list[list[str]]] = {}
    for name, kind in items:
        prefix = name.rsplit(".", 1)[0] if "." in name else ""
        prefixes.setdefault(prefix, [[], []])[kind].append(name)
    keys = sorted(prefixes, key=lambda k: k != "")  # root module first, else first appearance
    order = [n for k in keys for part in prefixes[k] for n in part]
    # An alias must follow its source; move any that does not to right after it.
    for alias, source in tied.items():
        if order.index(alias) < order.index(source):
            order.remove(alias)
            order.insert(order.index(source) + 1, alias)
    return order


def _plan(spec: LayoutSpec) -> _Plan:
    if spec.stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0..3, got {spec.stage}")
    if spec.world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {spec.world_size}")
    if spec.model_dtype not in _MODEL_DTYPES:
        raise ValueError(f"model_dtype must be one of {_MODEL_DTYPES}, got {spec.model_dtype}")
    if spec.bf16_optimizer_wrapper and not (spec.stage == 1 and spec.model_dtype == torch.bfloat16):
        raise ValueError("bf16_optimizer_wrapper exists only at stage 1 with bf16")
    if spec.stage0_flat_masters and not (spec.stage == 0 and spec.model_dtype != torch.float32):
        raise ValueError("stage0_flat_masters exists only at stage 0 with bf16/fp16")
    if not spec.groups:
        raise ValueError("need at least one optimizer group")
    groups = []
    for i, g in enumerate(spec.groups):
        owned = [p for p in g if p.numel > 0]
        if not owned:
            # DeepSpeed's ZeRO wrappers index group[0] of the owned params and fail.
            raise ValueError(f"group {i} has no parameter with elements")
        groups.append(owned)
    all_trainable = [p for g in spec.groups for p in g]
    frozen = OrderedDict((p.name, p) for p in all_trainable if p.numel == 0)
    frozen.update((p.name, p) for p in spec.frozen)
    buffers = OrderedDict((b.name, b) for b in spec.buffers)
    tied = dict(spec.tied)
    params = [p.name for p in all_trainable] + [p.name for p in spec.frozen]
    names = params + list(tied) + list(buffers)
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"duplicate names: {dup}")
    for p in list(all_trainable) + list(spec.frozen):
        if any(d < 0 for d in p.shape):
            raise ValueError(f"negative dimension in {p}")
    param_set = set(params)
    for alias, source in tied.items():
        if source not in param_set:
            raise ValueError(f"tied alias {alias!r} -> {source!r}: source is not a parameter")
    if spec.order is None:
        order = _default_order(all_trainable, list(spec.frozen), tied, list(spec.buffers))
    else:
        order = list(spec.order)
        if sorted(order) != sorted(names):
            raise ValueError("order must list every param, alias and buffer name exactly once")
        pos = {n: i for i, n in enumerate(order)}
        for alias, source in tied.items():
            if pos[alias] < pos[source]:
                raise ValueError(f"tied alias {alias!r} comes before its source {source!r} in order")
    param_order = [n for n in order if n in param_set]
    optimized = {p.name for g in groups for p in g}
    match = re.fullmatch(r"global_step(\d+)", spec.tag)
    steps = int(match.group(1)) if match else 1
    return _Plan(
        spec=spec,
        stage=spec.stage,
        world=spec.world_size,
        dtype=spec.model_dtype,
        groups=groups,
        all_trainable=all_trainable,
        frozen=frozen,
        buffers=buffers,
        tied=tied,
        order=order,
        param_order=param_order,
        non_optimized=[n for n in param_order if n not in optimized],
        buffers_in_order=[n for n in order if n in buffers],
        steps=steps,
    )


# --------------------------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------------------------

# Finite in every model dtype; some round differently in bf16/fp16, some are subnormal there.
_EDGE_VALUES = [0.0, -0.0, 1.0, -1.0, 65504.0, -65504.0, 2.0**-24, -(2.0**-14), 1e-30, 1.0 + 2.0**-9, 3.0e-5]


class _Values:
    def __init__(self, seed: int):
        self.gen = torch.Generator().manual_seed(seed)
        self.rng = random.Random(seed)

    def fill(self, t: torch.Tensor) -> torch.Tensor:
        """Fill a contiguous floating tensor in place: standard normal, sometimes a few edge values."""
        n = t.numel()
        if n == 0:
            return t
        t.normal_(generator=self.gen)
        if self.rng.random() < 0.3:
            k = min(n, self.rng.randint(1, 4))
            idx = torch.tensor(self.rng.sample(range(n), k) if n <= 4096 else
                               [self.rng.randrange(n) for _ in range(k)])
            vals = torch.tensor([self.rng.choice(_EDGE_VALUES) for _ in range(k)], dtype=torch.float32)
            t.view(-1)[idx] = vals.to(t.dtype)
        return t

    def buffer(self, spec: BufferSpec) -> torch.Tensor:
        if spec.dtype.is_floating_point:
            return self.fill(torch.empty(spec.shape, dtype=spec.dtype))
        if spec.dtype == torch.bool:
            return torch.randint(0, 2, spec.shape, generator=self.gen).bool()
        if spec.dtype.is_complex:
            return torch.randn(spec.shape, dtype=spec.dtype, generator=self.gen)
        info = torch.iinfo(spec.dtype)
        lo, hi = max(info.min, -1000), min(info.max, 1000)
        return torch.randint(lo, hi + 1, spec.shape, generator=self.gen, dtype=spec.dtype)

    def moments(self, numel: int, valid: int | None = None):
        """Adam exp_avg / exp_avg_sq for a flat fp32 partition; zero past `valid` (padding)."""
        exp_avg = torch.empty(numel).normal_(0.0, 1e-3, generator=self.gen)
        exp_avg_sq = torch.empty(numel).uniform_(0.0, 1e-6, generator=self.gen)
        if valid is not None and valid < numel:
            exp_avg[valid:] = 0
            exp_avg_sq[valid:] = 0
        return exp_avg, exp_avg_sq


def _adam_group(lr: float, params: list[int]) -> dict:
    # torch.optim.AdamW param_group keys (torch 2.x), in state_dict order.
    return {
        "lr": lr,
        "betas": (0.9, 0.999),
        "eps": 1e-08,
        "weight_decay": 0.01,
        "amsgrad": False,
        "maximize": False,
        "foreach": None,
        "capturable": False,
        "differentiable": False,
        "fused": None,
        "decoupled_weight_decay": True,
        "params": params,
    }


def _adam_state(steps: int, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> dict:
    return {"step": torch.tensor(float(steps)), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def _ds_config(plan: _Plan) -> dict:
    cfg = {
        "train_batch_size": MICRO_BATCH * plan.world,
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "torch_adam": True}},
        "zero_optimization": {"stage": plan.stage},
    }
    if plan.dtype == torch.bfloat16:
        cfg["bf16"] = {"enabled": True}
    elif plan.dtype == torch.float16:
        cfg["fp16"] = {"enabled": True}
    if plan.spec.bf16_optimizer_wrapper:
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    return cfg


def _loss_scaler(plan: _Plan):
    return _DynamicLossScaler(plan.steps) if plan.dtype == torch.float16 else _LossScaler(1.0)


def _common_tail(plan: _Plan, cfg: dict) -> dict:
    return {
        "lr_scheduler": None,
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": 0,
        "global_steps": plan.steps,
        "global_samples": plan.steps * cfg["train_batch_size"],
        "dp_world_size": plan.world,
        "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": cfg,
        "ds_version": DS_VERSION,
    }


def _module(plan: _Plan, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> OrderedDict:
    module = OrderedDict()
    for name in plan.order:
        if name in buffers:
            module[name] = buffers[name]
        elif name in params:
            module[name] = params[name]
        else:  # a tied alias: the very tensor of its source
            module[name] = params[plan.tied[name]]
    return module


def _param_shapes(groups: list[list[ParamSpec]]) -> list[OrderedDict]:
    return [OrderedDict((p.name, torch.Size(p.shape)) for p in g) for g in groups]


def _frozen_shapes(plan: _Plan) -> OrderedDict:
    return OrderedDict((n, torch.Size(plan.frozen[n].shape)) for n in plan.non_optimized)


# --------------------------------------------------------------------------------------------
# Writers per stage
# --------------------------------------------------------------------------------------------


def _flat_masters(plan: _Plan, vals: _Values, align: int, unambiguous: bool = False):
    """One fp32 flat buffer per group, padded to `align`; returns (flats, totals, views).
    ``unambiguous``: stage 0's flat masters, which readers cut by value (see _unambiguous_master)."""
    flats, totals, views = [], [], {}
    taken: set[bytes] = set()
    for g in plan.groups:
        total = sum(p.numel for p in g)
        padded = math.ceil(total / align) * align
        flat = torch.empty(padded, dtype=torch.float32)
        flat[total:] = 0
        off = 0
        for p in g:
            piece = flat[off:off + p.numel]
            if unambiguous:
                _unambiguous_master(vals, piece, plan.dtype, taken)
            else:
                vals.fill(piece)
            views[p.name] = piece.view(p.shape)
            off += p.numel
        flats.append(flat)
        totals.append(total)
    return flats, totals, views


def _frozen_values(plan: _Plan, vals: _Values) -> dict[str, torch.Tensor]:
    return {n: vals.fill(torch.empty(p.shape, dtype=plan.dtype)) for n, p in plan.frozen.items()}


def _per_param_adam(plan: _Plan, vals: _Values, groups: list[list[ParamSpec]]) -> dict:
    """A torch AdamW state dict over these params, numbered across groups in order."""
    state, param_groups, idx = {}, [], 0
    for g in groups:
        ids = []
        for p in g:
            if plan.spec.with_optimizer_states:
                exp_avg, exp_avg_sq = vals.moments(p.numel)
                state[idx] = _adam_state(plan.steps, exp_avg.view(p.shape), exp_avg_sq.view(p.shape))
            ids.append(idx)
            idx += 1
        param_groups.append(_adam_group(0.001, ids))
    return {"state": state, "param_groups": param_groups}


def _unambiguous_master(vals: _Values, out: torch.Tensor, dtype: torch.dtype, taken: set[bytes]) -> torch.Tensor:
    """Fill ``out`` (a fresh fp32 master) so that its first element in the model dtype starts no
    earlier master.

    Stage 0 names no parameter for its masters, so a reader can only match them by value, and a
    real save whose masters round alike is ambiguous (zerofast refuses it; see the stage-0 tests).
    Random layouts are meant to be readable: with distinct first elements, at most one parameter
    can match at any offset, so both the per-parameter matching and the cutting of flat masters
    have exactly one answer. Colliding draws are redrawn."""
    while True:
        vals.fill(out)
        if dtype == torch.float32 or out.numel() == 0:
            return out
        key = out.reshape(-1)[:1].to(dtype).view(torch.uint8).numpy().tobytes()
        if key not in taken:
            taken.add(key)
            return out


def _write_stage0(plan: _Plan, vals: _Values, tag_dir: str, cfg: dict):
    spec = plan.spec
    frozen_vals = _frozen_values(plan, vals)
    buffer_vals = {n: vals.buffer(b) for n, b in plan.buffers.items()}
    params: dict[str, torch.Tensor] = dict(frozen_vals)
    masters: dict[str, torch.Tensor] = {}
    if spec.stage0_flat_masters:
        flats, _, masters = _flat_masters(plan, vals, 1, unambiguous=True)
        lp_flats = [f.to(plan.dtype) for f in flats]
        for g, lp in zip(plan.groups, lp_flats):
            off = 0
            for p in g:
                params[p.name] = lp[off:off + p.numel].view(p.shape)
                off += p.numel
    else:
        taken: set[bytes] = set()
        for g in plan.groups:
            for p in g:
                masters[p.name] = _unambiguous_master(vals, torch.empty(p.shape), plan.dtype, taken)
                params[p.name] = masters[p.name] if plan.dtype == torch.float32 else masters[p.name].to(plan.dtype)
    module = _module(plan, params, buffer_vals)

    if plan.dtype == torch.float32:
        # No wrapper: the torch optimizer's own state dict; it holds every trainable param,
        # zero-element ones included.
        optimizer = _per_param_adam(plan, vals, spec.groups)
    else:
        fp16 = plan.dtype == torch.float16
        optimizer = {}
        if fp16 or not spec.stage0_flat_masters:
            # FP16_UnfusedOptimizer always writes these three; FP16_Optimizer only with fp16.
            optimizer["dynamic_loss_scale"] = fp16
            optimizer["cur_scale"] = _fp16_loss_scale(plan.steps) if fp16 else 1.0
            optimizer["cur_iter"] = plan.steps
            if fp16:
                optimizer["last_overflow_iter"] = -1
                optimizer["scale_factor"] = 2.0
                optimizer["scale_window"] = 1000
        if spec.stage0_flat_masters:
            state = {}
            if spec.with_optimizer_states:
                state = {i: _adam_state(plan.steps, *vals.moments(f.numel())) for i, f in enumerate(flats)}
            inner = {"state": state, "param_groups": [_adam_group(0.001, [i]) for i in range(len(flats))]}
        else:
            inner = _per_param_adam(plan, vals, plan.groups)
        optimizer["optimizer_state_dict"] = inner
        if spec.stage0_flat_masters:
            optimizer["fp32_groups_flat"] = [f.detach().requires_grad_(True) for f in flats]
            optimizer["clip_grad"] = 1.0
        else:
            optimizer["fp32_groups"] = [[masters[p.name].detach().requires_grad_(True) for p in g]
                                        for g in plan.groups]
    sd = {
        "module": module,
        "buffer_names": list(plan.buffers_in_order),
        "optimizer": optimizer,
        "param_shapes": None,
        "frozen_param_shapes": None,
        "shared_params": None,
        "frozen_param_fragments": None,
    }
    sd.update(_common_tail(plan, cfg))
    _save(sd, os.path.join(tag_dir, "mp_rank_00_model_states.pt"))
    return masters, frozen_vals, buffer_vals


def _slice_mappings(group: list[ParamSpec], start: int, size: int) -> OrderedDict:
    out, off, end = OrderedDict(), 0, start + size
    for p in group:
        lo, hi = max(off, start), min(off + p.numel, end)
        if lo < hi:
            out[p.name] = _FragmentAddress(numel=hi - lo, start=lo - start)
        off += p.numel
    return out


def _write_stage12(plan: _Plan, vals: _Values, tag_dir: str, cfg: dict, prefix: str):
    spec, world = plan.spec, plan.world
    align = NCCL_START_ALIGNMENT_FACTOR * world
    flats, totals, masters = _flat_masters(plan, vals, align)
    frozen_vals = _frozen_values(plan, vals)
    buffer_vals = {n: vals.buffer(b) for n, b in plan.buffers.items()}

    # Model-states file: module params are views into the group's model-dtype flat buffer.
    params: dict[str, torch.Tensor] = dict(frozen_vals)
    for g, flat in zip(plan.groups, flats):
        lp = flat.to(plan.dtype)  # same storage when fp32: identical bytes on disk
        off = 0
        for p in g:
            params[p.name] = lp[off:off + p.numel].view(p.shape)
            off += p.numel
    stage2 = plan.stage == 2
    sd = {
        "module": _module(plan, params, buffer_vals),
        "buffer_names": list(plan.buffers_in_order),
        "optimizer": None,
        "param_shapes": _param_shapes(plan.groups),
        "frozen_param_shapes": _frozen_shapes(plan) if stage2 else None,
        "shared_params": dict(plan.tied),
        "frozen_param_fragments": OrderedDict((n, params[n].detach()) for n in plan.non_optimized)
        if stage2 else None,
    }
    sd.update(_common_tail(plan, cfg))
    _save(sd, os.path.join(tag_dir, "mp_rank_00_model_states.pt"))
    del sd, params

    # Optimizer files, one rank at a time.
    n_groups = len(plan.groups)
    for rank in range(world):
        parts, paddings, mappings, state = [], [], [], {}
        for gi, (g, flat, total) in enumerate(zip(plan.groups, flats, totals)):
            size = flat.numel() // world
            left = rank * size
            part = flat[left:left + size].clone()
            if spec.bf16_optimizer_wrapper:
                pad = flat.numel() - total if rank == world - 1 else 0
            elif total <= left:
                pad = size
            elif total < left + size:
                pad = left + size - total
            else:
                pad = 0
            with torch.enable_grad():
                part.requires_grad_(True)
                # ZeRO 1/2 trims this rank's padding off (a view: the storage keeps it).
                parts.append(part if spec.bf16_optimizer_wrapper else part[:size - pad])
            paddings.append(pad)
            mappings.append(_slice_mappings(g, left, size))
            if spec.with_optimizer_states:
                state[gi] = _adam_state(plan.steps, *vals.moments(size, max(0, min(size, total - left))))
        base = {"state": state, "param_groups": [_adam_group(0.001, [gi]) for gi in range(n_groups)]}
        if spec.bf16_optimizer_wrapper:
            osd = {
                "clip_grad": 1.0,
                "base_optimizer_state": base,
                "single_partition_of_fp32_groups": parts,
                "group_paddings": paddings,
                "partition_count": [world] * n_groups,
                "ds_version": DS_VERSION,
                "param_slice_mappings": mappings,
            }
        else:
            scaler = _loss_scaler(plan)
            osd = {
                "loss_scaler": scaler,
                "dynamic_loss_scale": scaler.dynamic,
                "overflow": False,
                "clip_grad": 1.0,
                "base_optimizer_state": base,
                "single_partition_of_fp32_groups": parts,
                "zero_stage": _ZeroStageEnum(plan.stage),
                "group_paddings": paddings,
                "param_alignment_paddings": [[0] * len(g) for g in plan.groups],
                "partition_count": [world] * n_groups,
                "ds_version": DS_VERSION,
                "param_slice_mappings": mappings,
            }
        name = f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        _save({"optimizer_state_dict": osd, "ds_config": cfg, "ds_version": DS_VERSION},
              os.path.join(tag_dir, name))
        del osd, parts, state, base
    return masters, frozen_vals, buffer_vals


def _zero3_sub_groups(plan: _Plan) -> list[tuple[int, list[ParamSpec]]]:
    """(group index, params) per sub-group, as stage3._create_fp16_sub_groups splits them."""
    out = []
    for gi, g in enumerate(plan.groups):
        ks = [math.ceil(p.numel / plan.world) for p in g]
        if ZERO3_SUB_GROUP_SIZE >= sum(ks):
            out.append((gi, list(g)))
            continue
        cur, acc = [], 0
        for p, k in zip(g, ks):
            cur.append(p)
            acc += k
            if acc >= ZERO3_SUB_GROUP_SIZE or p is g[-1]:
                out.append((gi, cur))
                cur, acc = [], 0
    return out


def _zero3_chunk(flat: torch.Tensor, n: int, k: int, rank: int, out: torch.Tensor) -> None:
    lo = rank * k
    hi = min(lo + k, n)
    if hi > lo:
        out[:hi - lo].copy_(flat[lo:hi])


def _write_stage3(plan: _Plan, vals: _Values, tag_dir: str, cfg: dict, prefix: str):
    spec, world = plan.spec, plan.world
    masters = {p.name: vals.fill(torch.empty(p.shape, dtype=torch.float32)) for g in plan.groups for p in g}
    frozen_vals = _frozen_values(plan, vals)
    buffer_vals = {n: vals.buffer(b) for n, b in plan.buffers.items()}
    sub_groups = _zero3_sub_groups(plan)
    param_shapes = _param_shapes([sg for _, sg in sub_groups])
    frozen_shapes = _frozen_shapes(plan)
    for rank in range(world):
        # Numel-0 placeholders; a tied alias gets its own placeholder, as in real files.
        placeholders = {n: torch.empty(0, dtype=plan.dtype) for n in plan.param_order + list(plan.tied)}
        fragments = OrderedDict()
        for n in plan.non_optimized:
            numel = plan.frozen[n].numel
            k = math.ceil(numel / world)
            chunk = torch.zeros(k, dtype=plan.dtype)
            _zero3_chunk(frozen_vals[n].view(-1), numel, k, rank, chunk)
            fragments[n] = chunk
        sd = {
            "module": _module(plan, placeholders, buffer_vals),
            "buffer_names": list(plan.buffers_in_order),
            "optimizer": None,
            "param_shapes": param_shapes,
            "frozen_param_shapes": frozen_shapes,
            # Only global rank 0 collects the shared params.
            "shared_params": dict(plan.tied) if rank == 0 else {},
            "frozen_param_fragments": fragments,
        }
        sd.update(_common_tail(plan, cfg))
        _save(sd, os.path.join(tag_dir, f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"))
        del sd, fragments

        flats, state = [], {}
        for si, (_, sg) in enumerate(sub_groups):
            ks = [math.ceil(p.numel / world) for p in sg]
            flat = torch.zeros(sum(ks), dtype=torch.float32)
            off = 0
            for p, k in zip(sg, ks):
                _zero3_chunk(masters[p.name].view(-1), p.numel, k, rank, flat[off:off + k])
                off += k
            flat.requires_grad_(True)
            flats.append(flat)
            if spec.with_optimizer_states:
                state[si] = _adam_state(plan.steps, *vals.moments(flat.numel()))
        groups = [_adam_group(0.001, [si for si, (gi, _) in enumerate(sub_groups) if gi == g])
                  for g in range(len(plan.groups))]
        scaler = _loss_scaler(plan)
        osd = {
            "zero_stage": _ZeroStageEnum(3),
            "loss_scaler": scaler,
            "dynamic_loss_scale": scaler.dynamic,
            "overflow": False,
            "partition_count": world,
            "optimizer_state_dict": {"state": state, "param_groups": groups},
            "fp32_flat_groups": flats,
        }
        name = f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        _save({"optimizer_state_dict": osd, "ds_config": cfg, "ds_version": DS_VERSION},
              os.path.join(tag_dir, name))
        del osd, flats, state
    return masters, frozen_vals, buffer_vals


_RECOVERY_STUB = '''#!/usr/bin/env python
# Placeholder written by zerofast.synthesize where DeepSpeed copies its recovery script
# ({name}) next to a ZeRO checkpoint. It is not DeepSpeed's script and does nothing.
raise SystemExit("{name}: placeholder from zerofast.synthesize, not DeepSpeed's script")
'''


def synthesize(root: str | os.PathLike, spec: LayoutSpec) -> GroundTruth:
    """Write a checkpoint of layout `spec` under `root` (DeepSpeed 0.19.8 format); return its values."""
    plan = _plan(spec)
    root = os.fspath(root)
    tag_dir = os.path.join(root, str(spec.tag))
    os.makedirs(tag_dir, exist_ok=True)
    vals = _Values(spec.seed)
    cfg = _ds_config(plan)
    prefix = "bf16_" if plan.dtype == torch.bfloat16 else ""
    if plan.stage == 0:
        masters, frozen_vals, buffer_vals = _write_stage0(plan, vals, tag_dir, cfg)
    elif plan.stage in (1, 2):
        masters, frozen_vals, buffer_vals = _write_stage12(plan, vals, tag_dir, cfg, prefix)
    else:
        masters, frozen_vals, buffer_vals = _write_stage3(plan, vals, tag_dir, cfg, prefix)
    if plan.stage > 0:
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):
            with open(os.path.join(root, script), "w") as fh:
                fh.write(_RECOVERY_STUB.format(name=script))
    if spec.write_latest:
        with open(os.path.join(root, "latest"), "w") as fh:
            fh.write(str(spec.tag))
    trainable = {p.name: masters[p.name] for g in plan.groups for p in g}
    return GroundTruth(
        trainable=trainable,
        frozen=frozen_vals,
        buffers=buffer_vals,
        state_dict_keys=list(plan.order),
        tied=dict(plan.tied),
        model_dtype=plan.dtype,
    )
