"""The plan of a PyTorch DCP folder: each model tensor put back together from its chunks.

A chunk is a box of the tensor (offsets and sizes per dimension), stored as its own contiguous
tensor. In the tensor's row-major layout a box is a set of equal runs: past the last dimension
where the box is narrower than the tensor, it covers whole rows. FSDP2 shards along dim 0, so
each of its chunks is one run; a tensor-parallel column split is one run per row. Each run is
one segment of the :class:`TensorPlan`, and the native executor does the rest.

Which entries are the model: with the DCP tutorial's ``{"model": ..., "optim": ...}`` (what
FSDP2 jobs save), the tensors under ``model``; otherwise (torchtitan saves the model's keys at
the top) every top-level tensor. DCP records no ties: each name is its own tensor, as
``dcp_to_torch_save`` returns them. Floating tensors follow the dtype policy; DCP does not say
which were trainable, so they are all planned as trainable, and the rest as buffers.
"""
from __future__ import annotations

import itertools
import math
import re

import torch

from ..base.dtypes import out_dtype_for
from ..load.dcp import ChunkReader, DcpRecords, DcpTensor
from .columns import PlanTensors
from .model import BUFFER, TRAINABLE, Plan, Segments, SourceTable, TensorPlan

MODEL = "model"
# Megatron-Core's optimizer state: optimizer.state.exp_avg.<key>, optimizer.distributed.<buffer>
MCORE_OPTIMIZER = "optimizer."
MCORE_STATE = "optimizer.state."
MCORE_DISTRIBUTED = "optimizer.distributed."


def model_tensors(ckpt: DcpRecords) -> dict[str, DcpTensor]:
    """The model's tensors by their names in the model, in the order they were saved."""
    nested = [t for t in ckpt.tensors.values() if len(t.path) == 2 and t.path[0] == MODEL]
    if nested:
        return {t.path[1]: t for t in nested}
    if ckpt.mcore is not None:  # Megatron-Core: the weights at the top, the optimizer's state beside them
        return {t.path[0]: t for t in ckpt.tensors.values()
                if len(t.path) == 1 and not t.path[0].startswith(MCORE_OPTIMIZER)}
    return {t.path[0]: t for t in ckpt.tensors.values() if len(t.path) == 1}


def optimizer_tensors(ckpt: DcpRecords) -> dict[str, DcpTensor]:
    """Megatron-Core's optimizer-state tensors by their flat keys (none for other DCP saves)."""
    if ckpt.mcore is None:
        return {}
    return {t.key: t for t in ckpt.tensors.values() if t.key.startswith(MCORE_OPTIMIZER)}


def mcore_states(ckpt: DcpRecords) -> dict[str, dict[str, DcpTensor]]:
    """Megatron-Core's ``fully_sharded_model_space`` optimizer state, ``optimizer.state.<key>.<param>``:
    ``{key: {param: tensor}}``, keys in first-seen order (``exp_avg``, ``exp_avg_sq``, ``param``)."""
    out: dict[str, dict[str, DcpTensor]] = {}
    for key, t in optimizer_tensors(ckpt).items():
        if key.startswith(MCORE_STATE):
            state, _, param = key[len(MCORE_STATE):].partition(".")
            if param:
                out.setdefault(state, {})[param] = t
    return out


def build_dcp_plan(ckpt: DcpRecords, table: SourceTable, dtype: torch.dtype | None, unstack: bool = False) -> Plan:
    """``unstack``: a Megatron-Core save's stacked layers (``decoder.layers.mlp.linear_fc1.weight``,
    ``(L, ...)``) come out per layer (``decoder.layers.3.mlp.linear_fc1.weight``), as its
    ``singleton_local_shards`` saves and the model's own ``state_dict`` name them."""
    reader = ChunkReader(ckpt)
    tensors = {}
    for name, t in model_tensors(ckpt).items():
        kind = TRAINABLE if t.dtype.is_floating_point else BUFFER
        segments = tensor_segments(ckpt, reader, table, t)
        out_dtype = out_dtype_for(t.dtype, dtype)
        if unstack and ckpt.mcore is not None and STACKED.search(name) and len(t.shape) >= 1:
            for i, (layer, part) in enumerate(layer_slices(name, t.shape, segments)):
                tensors[layer] = TensorPlan(layer, t.shape[1:], kind, t.dtype, out_dtype, part)
        else:
            tensors[name] = TensorPlan(name, t.shape, kind, t.dtype, out_dtype, tuple(segments))
    return Plan(PlanTensors.of(list(tensors.values())), {}, tuple(tensors), 0, ckpt.ranks)


# "layers." followed by a module name, not a layer number: one key for every layer of a type.
STACKED = re.compile(r"(?:^|\.)layers\.(?!\d+\.)")


def layer_slices(name: str, shape: tuple[int, ...], segments: Segments):
    """(per-layer name, its segments) for each index of a stacked tensor's leading dimension."""
    at = STACKED.search(name).end()
    inner = math.prod(shape[1:])
    for i in range(shape[0]):
        lo, hi = i * inner, (i + 1) * inner
        part = tuple((src, s_off + max(d_off, lo) - d_off, max(d_off, lo) - lo, min(d_off + n, hi) - max(d_off, lo))
                     for src, s_off, d_off, n in segments if max(d_off, lo) < min(d_off + n, hi))
        yield f"{name[:at]}{i}.{name[at:]}", part


def tensor_segments(ckpt: DcpRecords, reader: ChunkReader, table: SourceTable, t: DcpTensor) -> Segments:
    """The segments that put ``t`` together from its chunks."""
    segments: Segments = []
    for chunk in t.chunks:
        if chunk.numel:
            src = table.add(str(ckpt.folder / chunk.file), f"{t.key}@{chunk.offsets}", reader.read(t, chunk))
            if t.real_size is None:
                segments.extend(box_runs(src, t.size, chunk.offsets, chunk.sizes))
            else:
                segments.extend(unflattened_runs(src, t.size, t.real_size, chunk.offsets, chunk.sizes))
    return segments


def box_runs(src: int, size: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Segments:
    """Segments copying a contiguous box (``sizes`` at ``offsets``) into a row-major tensor of
    ``size``: one run per index of the dimensions before the last partial one."""
    if not size:
        return [(src, 0, 0, 1)]
    last = max((d for d in range(len(size)) if sizes[d] != size[d]), default=0)
    run = math.prod(sizes[last:])
    strides = [math.prod(size[d + 1:]) for d in range(len(size))]
    base = sum(o * st for o, st in zip(offsets, strides))
    out = []
    for i, index in enumerate(itertools.product(*(range(n) for n in sizes[:last]))):
        dst = base + sum(k * st for k, st in zip(index, strides))
        out.append((src, i * run, dst, run))
    return out


def unflattened_runs(src: int, stored: tuple[int, ...], real: tuple[int, ...], offsets: tuple[int, ...],
                     sizes: tuple[int, ...]) -> Segments:
    """Segments for a chunk of a tensor Megatron-Core stored flattened: ``stored`` is
    (grid..., box numel), element [g..., k] being element k (row-major) of the box at grid index
    g of the ``real`` tensor, each box ``real[d] // grid[d]`` wide. A box's last-dimension rows
    are the runs; a chunk may start or end inside one."""
    grid = stored[:-1]
    box = tuple(n // g for n, g in zip(real, grid))
    row = box[-1] if box else 1
    box_strides = [math.prod(box[d + 1:]) for d in range(len(box))]
    strides = [math.prod(real[d + 1:]) for d in range(len(real))]
    k0, width = offsets[-1], sizes[-1]
    out = []
    for i, index in enumerate(itertools.product(*(range(o, o + n) for o, n in zip(offsets[:-1], sizes[:-1])))):
        k = k0
        while k < k0 + width:
            run = min(row - k % row, k0 + width - k)
            at = [(k // st) % b for st, b in zip(box_strides, box)]  # k's place inside the box
            dst = sum((g * b + a) * st for g, b, a, st in zip(index, box, at, strides))
            out.append((src, i * width + (k - k0), dst, run))
            k += run
    return out
