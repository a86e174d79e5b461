"""The array-built parts of the metadata path against the per-item code they stand in for.

- ``zero3._columns`` and ``zero12._columns`` (the stage-3 and stage 1-2 layouts by array
  arithmetic) must give exactly the per-parameter loop's entries; for stage 3: ``zero3._loop``'s
  entries, order included, on every stage-3 suite checkpoint (several flat groups and
  sub-groups, world sizes 1 to 4) and on hand-made rank buffers whose slices cross group boundaries
  and whose smallest parameters leave some ranks empty.
- ``bulk_checks.all_shapes`` may say yes only where records.py's per-shape check accepts every
  shape, and must say yes wherever it does and no dimension is zero.
"""
from __future__ import annotations

import math


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import needs_deepspeed
from tests.dsgen.catalog import ensure_checkpoint
from zerofast.base.errors import InconsistentCheckpointError
from zerofast.layouts import discover, load_checkpoint
from zerofast.load.bulk_checks import all_shapes
from zerofast.load import records
from zerofast.plan.builders import master_flat_groups, zero3, zero12
from zerofast.plan.model import SourceTable, VirtualBuffer
from zerofast.testing.synthesize import LayoutSpec, ParamSpec, synthesize

STAGE3 = ("s3_bf16_w2_frozen_tied", "s3_fp32_w3_3groups_subgroups", "s3_bf16_w4_offload", "s3_fp32_w1")


def _both(root) -> tuple[dict, dict]:
    ckpt = load_checkpoint(discover(root))
    table = SourceTable()
    flats = master_flat_groups(ckpt)
    bufs = [VirtualBuffer([table.add(str(o.path), where, t) for where, t in groups], [t.numel() for _, t in groups])
            for o, groups in zip(ckpt.optim_states, flats)]
    dtype = flats[0][0][1].dtype
    shapes = ckpt.meta.param_shapes
    names = [n for g in shapes for n in g]
    dims = [s for g in shapes for s in g.values()]
    return zero3._columns(names, dims, bufs, dtype), zero3._loop(ckpt, shapes, bufs, dtype)


def _assert_same(columns: dict | None, loop: dict) -> None:
    assert columns is not None
    assert list(columns) == list(loop)
    for name, (shape, dtype, segs) in loop.items():
        assert columns[name] == (shape, dtype, segs), name


@needs_deepspeed
@pytest.mark.parametrize("layout", STAGE3)
def test_columns_equal_the_loop_on_real_saves(layout):
    _assert_same(*_both(ensure_checkpoint(layout)))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=3), min_size=1, max_size=12),
       st.integers(1, 5), st.lists(st.integers(0, 30), max_size=4), st.integers(0, 5))
def test_columns_equal_the_loop_across_groups_and_empty_ranks(dims, world, cuts, spare):
    """Hand-made rank buffers whose group boundaries fall anywhere (a slice then crosses them),
    parameters smaller than the world size (some ranks hold none of them), spare elements at the end."""
    need = sum(math.ceil(math.prod(d) / world) for d in dims) + spare
    bounds = sorted({min(c, need) for c in cuts} | {0, need})
    lengths = [b - a for a, b in zip(bounds, bounds[1:])] or [0]
    bufs = [VirtualBuffer(range(r * len(lengths), (r + 1) * len(lengths)), lengths) for r in range(world)]
    names = [f"p{i}" for i in range(len(dims))]
    dims = [tuple(d) for d in dims]
    _assert_same(zero3._columns(names, dims, bufs, torch.bfloat16), zero3._loop(None, [dict(zip(names, dims))], bufs,
                                                                                 torch.bfloat16))


def test_columns_decline_what_the_loop_refuses(tmp_path):
    synthesize(tmp_path, LayoutSpec(stage=3, world_size=2, model_dtype=torch.bfloat16,
                                    groups=[[ParamSpec("a", (8,)), ParamSpec("b", (6,))]], with_optimizer_states=False))
    ckpt = load_checkpoint(discover(tmp_path))
    ckpt.meta.param_shapes[0]["c"] = (100,)  # more than the flat groups hold
    table = SourceTable()
    flats = master_flat_groups(ckpt)
    bufs = [VirtualBuffer([table.add(str(o.path), w, t) for w, t in g], [t.numel() for _, t in g])
            for o, g in zip(ckpt.optim_states, flats)]
    shapes = ckpt.meta.param_shapes
    assert zero3._columns(list(shapes[0]), list(shapes[0].values()), bufs, torch.float32) is None
    with pytest.raises(InconsistentCheckpointError, match="'param_shapes' needs .* to reach 'c'"):
        zero3.trainable(ckpt, table, shapes, flats)


_DIM = st.one_of(st.integers(0, 2 ** 64), st.booleans(), st.floats(0, 8), st.just(2 ** 62), st.integers(1, 9))
_SHAPE = st.one_of(st.lists(_DIM, max_size=3).map(tuple), st.lists(st.integers(1, 4), max_size=70),
                   st.lists(st.just(2 ** 21), min_size=3, max_size=3).map(tuple), st.just("12"),
                   st.just(torch.Size([3, 4])))


def _accepts(shape) -> bool:
    try:
        records._shape("f", "n", shape)  # the per-item reference check
        return True
    except InconsistentCheckpointError:
        return False


@settings(max_examples=300, deadline=None)
@given(st.lists(_SHAPE, max_size=6))
def test_all_shapes_agrees_with_the_per_shape_check(shapes):
    every = all(_accepts(s) for s in shapes)
    if all_shapes(shapes):
        assert every
    elif every:
        assert any(0 in s for s in shapes), "a zero dimension is the only case left to the per-shape check"


STAGE12 = ("s2_bf16_w2_frozen_tied", "s1_bf16_w2_frozen", "s2_fp32_w3_elastic", "s2_bf16_w4_resume",
           "s2_fp32_w4_odd_3groups")


def _zero12_both(ckpt, monkeypatch) -> tuple[dict, dict]:
    def trainable():
        return zero12.trainable(ckpt, SourceTable(), ckpt.meta.param_shapes, master_flat_groups(ckpt))

    columns = trainable()
    with monkeypatch.context() as patch:
        patch.setattr(zero12, "_columns", lambda *args: None)
        return columns, trainable()


@needs_deepspeed
@pytest.mark.parametrize("layout", STAGE12)
def test_zero12_columns_equal_the_loop_on_real_saves(layout, monkeypatch):
    ckpt = load_checkpoint(discover(ensure_checkpoint(layout)))
    _assert_same(*_zero12_both(ckpt, monkeypatch))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 3)), min_size=1, max_size=12), st.integers(1, 5),
       st.integers(0, 7))
def test_zero12_columns_equal_the_loop_across_partitions(params, world, spare):
    """Hand-made partitions of equal size: parameters cross from one rank's into the next, some
    hold no elements, paddings follow each."""
    sizes, pads = [n for n, _ in params], [p for _, p in params]
    total = sum(sizes) + sum(pads) + spare
    part = -(-total // world)
    lengths = [max(0, min(part, total - r * part)) for r in range(world)]
    buf = VirtualBuffer(range(world), lengths)
    group = {f"p{i}": (n,) for i, n in enumerate(sizes)}
    columns = zero12._columns(group, pads, buf, torch.bfloat16)
    offset, loop = 0, {}
    for (name, shape), n, pad in zip(group.items(), sizes, pads):
        loop[name] = (shape, torch.bfloat16, buf.pieces(offset, n, 0))
        offset += n + pad
    _assert_same(columns, loop)
