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

import torch

from ..base.dtypes import out_dtype_for
from ..load.dcp import ChunkReader, DcpRecords, DcpTensor
from .columns import PlanTensors
from .model import BUFFER, TRAINABLE, Plan, Segments, SourceTable, TensorPlan

MODEL = "model"


def model_tensors(ckpt: DcpRecords) -> dict[str, DcpTensor]:
    """The model's tensors by their names in the model, in the order they were saved."""
    nested = [t for t in ckpt.tensors.values() if len(t.path) == 2 and t.path[0] == MODEL]
    if nested:
        return {t.path[1]: t for t in nested}
    return {t.path[0]: t for t in ckpt.tensors.values() if len(t.path) == 1}


def build_dcp_plan(ckpt: DcpRecords, table: SourceTable, dtype: torch.dtype | None) -> Plan:
    reader = ChunkReader(ckpt)
    tensors = {}
    for name, t in model_tensors(ckpt).items():
        segments: Segments = []
        for chunk in t.chunks:
            if chunk.numel:
                src = table.add(str(ckpt.folder / chunk.file), f"{t.key}@{chunk.offsets}", reader.read(t, chunk))
                segments.extend(box_runs(src, t.size, chunk.offsets, chunk.sizes))
        kind = TRAINABLE if t.dtype.is_floating_point else BUFFER
        tensors[name] = TensorPlan(name, t.size, kind, t.dtype, out_dtype_for(t.dtype, dtype), tuple(segments))
    return Plan(PlanTensors.of(list(tensors.values())), {}, tuple(tensors), 0, ckpt.ranks)


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
