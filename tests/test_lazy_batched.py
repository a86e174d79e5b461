"""The lazy mapping reads through the batched native reader (issue 22): every layout the suite
makes, bit for bit against the eager dict; ``materialize``; read-ahead in iteration order within
its byte budget; and no use of the per-tensor mapped path (``ops.gather_cast``) on the CPU."""
from __future__ import annotations

import dataclasses
import importlib.util
from collections import Counter

import pytest
import torch

import zerofast
from zerofast.native import ops
import zerofast.execute.executor as executor_module
from zerofast.prepare import prepare
from zerofast.plan.columns import PlanTensors

from tests.conftest import HAVE_DEEPSPEED
from tests.dsgen.families import FAMILY_LAYOUTS
from tests.helpers import assert_bitwise_equal, real_root

SMALL = "s3_bf16_w2_frozen_tied"  # frozen bf16 weights, fp32 masters, ties, int and bool buffers
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
FAMILIES = [n for n in sorted(FAMILY_LAYOUTS) if HAVE_TRANSFORMERS or not n.startswith("autotp_")]

pytestmark = pytest.mark.skipif(not HAVE_DEEPSPEED, reason="DeepSpeed 0.19.8 makes the real checkpoints")


@pytest.fixture
def no_mapped_path(monkeypatch):
    """Fail any use of the per-tensor mapped path: every read must go through the batched reader."""
    def refuse(*args, **kwargs):
        raise AssertionError("the per-tensor mapped path (gather_cast) was used")

    monkeypatch.setattr(ops, "gather_cast", refuse)


def _calls(monkeypatch, sd) -> list[list]:
    """The batches the mapping's executor reads (each a list of plans), as its path is asked for
    them (every read of the executor, a pass or one tensor, is one such call)."""
    batches: list[list] = []
    path = sd._executor.path
    read = path.read

    def spy(cols):
        batches.append(list(cols.values()))
        return read(cols)

    monkeypatch.setattr(path, "read", spy)
    return batches


def _pass_equals_eager(root, dtype, budget) -> None:
    eager = zerofast.reconstruct(root, dtype=dtype)
    lazy = zerofast.reconstruct(root, dtype=dtype, lazy=True)
    lazy.read_ahead_bytes = budget
    assert list(lazy) == list(eager)
    for name, value in lazy.items():
        assert_bitwise_equal(value, eager[name], name)


@pytest.mark.parametrize("budget", [64, 64 << 20], ids=["tiny-windows", "default"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=str)
def test_lazy_pass_equals_eager(real_ckpt, dtype, budget, no_mapped_path):
    _, root, _ = real_ckpt
    _pass_equals_eager(root, dtype, budget)


@pytest.mark.parametrize("layout", FAMILIES)
def test_lazy_pass_equals_eager_for_the_families(layout, no_mapped_path):
    _pass_equals_eager(real_root(layout), torch.float32, 256)


def test_materialize_a_subset_in_one_batch(real_ckpt, monkeypatch, no_mapped_path):
    _, root, truth = real_ckpt
    eager = zerofast.reconstruct(root, dtype=None)
    lazy = zerofast.reconstruct(root, dtype=None, lazy=True)
    batches = _calls(monkeypatch, lazy)
    names = list(dict.fromkeys(list(eager)[::-2] + list(truth["tied"])))  # out of order, with the tied names
    got = lazy.materialize(names)
    assert list(got) == names and len(batches) == 1
    for name in names:
        assert_bitwise_equal(got[name], eager[name], name)
    for alias, source in truth["tied"].items():
        if source in got:
            assert got[alias].data_ptr() == got[source].data_ptr()


def test_materialize_refuses_an_unknown_name_before_reading(monkeypatch):
    lazy = zerofast.reconstruct(real_root(SMALL), lazy=True)
    batches = _calls(monkeypatch, lazy)
    with pytest.raises(KeyError, match="no.such"):
        lazy.materialize([lazy.plan.order[0], "no.such"])
    assert batches == []


def test_iteration_reads_ahead_in_order_within_the_budget(monkeypatch, no_mapped_path):
    lazy = zerofast.reconstruct(real_root(SMALL), lazy=True)
    plan = lazy.plan
    budget = 2 * max(tp.nbytes for tp in plan.tensors.values()) // 3  # the largest is read alone
    lazy.read_ahead_bytes = budget
    batches = _calls(monkeypatch, lazy)
    looked_up = []
    for name in lazy:
        looked_up.append(name)
        lazy[name]
    assert looked_up == list(plan.order)
    keys = [plan.aliases.get(n, n) for n in plan.order]
    viewed = _viewed(plan.tensors)
    copied = [k for k in keys if k not in viewed]  # the rest are views
    read = [tp.name for batch in batches for tp in batch]
    assert Counter(read) == Counter(copied)  # once per lookup: a tied name is a lookup of its own
    ahead = [[keys.index(tp.name) for tp in b] for b in batches if len(b) > 1]
    assert all(b == sorted(b) for b in ahead)  # each window in iteration order,
    assert [b[0] for b in ahead] == sorted(b[0] for b in ahead)  # and the windows one after another
    assert ahead and len(batches) < len(copied)  # small tensors come several to a call
    assert all(sum(tp.nbytes for tp in b) <= budget for b in batches if len(b) > 1)


def test_iterating_names_alone_reads_nothing(monkeypatch):
    lazy = zerofast.reconstruct(real_root(SMALL), lazy=True)
    batches = _calls(monkeypatch, lazy)
    assert list(lazy) == list(lazy.plan.order) and sorted(lazy.keys()) == sorted(lazy.plan.order)
    assert batches == []


def test_the_window_stays_within_its_budget_and_goes_with_the_loop(monkeypatch):
    lazy = zerofast.reconstruct(real_root(SMALL), lazy=True)
    lazy.read_ahead_bytes = 1 << 10
    batches = _calls(monkeypatch, lazy)
    held = []
    for i, name in enumerate(lazy):
        lazy[name]
        held.append(sum(t.numel() * t.element_size() for t in lazy._window.values()))
        if i == 5:
            break
    assert batches and max(held) <= lazy.read_ahead_bytes
    assert lazy._window == {}  # leaving the loop dropped what was read ahead


def test_prefetched_values_are_fresh_memory_each_lookup():
    lazy = zerofast.reconstruct(real_root(SMALL), lazy=True)
    first = {name: lazy[name] for name in lazy}
    again = {name: lazy[name] for name in lazy}
    viewed = _viewed(lazy.plan.tensors)
    for name in first:
        if lazy.plan.aliases.get(name, name) not in viewed:
            assert first[name].data_ptr() != again[name].data_ptr(), name
        assert_bitwise_equal(first[name], again[name], name)


def _viewed(tensors) -> set[str]:
    """The names of ``tensors`` (a plan's columns) that ``view_ranges`` says may be views."""
    return {name for name, where in zip(tensors, executor_module.view_ranges(tensors)) if where is not None}


def _may_view(tp) -> bool:
    """The rule, one TensorPlan at a time (the test's oracle for view_ranges): one whole range of
    one source, already in the requested dtype."""
    if len(tp.segments) != 1 or tp.stored_dtype != tp.out_dtype:
        return False
    _, _, dst_off, length = tp.segments[0]
    return dst_off == 0 and length == tp.numel


def _reference_view(sources, tp) -> torch.Tensor:
    src, offset, _, length = tuple(tp.segments[0])
    return sources[src][offset:offset + length].view(tp.shape)


@pytest.mark.parametrize("dtype", [torch.float32, None, torch.bfloat16])
@pytest.mark.parametrize("root_name", [SMALL, "s2_bf16_w2_frozen_tied", "s1_bf16_w2_frozen", "s0_bf16_w2"])
def test_view_ranges_follow_the_rule_and_views_are_the_slices(root_name, dtype):
    """The whole-table answer (``view_ranges``, off the columns) is the per-tensor one, for a
    plan's columns and for the columns of plans of tuples alike; a lazy lookup's view is the
    slice-and-view of its source exactly."""
    prepared = prepare(real_root(root_name), dtype)
    ranges = executor_module.view_ranges(prepared.plan.tensors)  # off the columns, no TensorPlan made
    tps = list(prepared.plan.tensors.values())
    assert [r is not None for r in ranges] == [_may_view(tp) for tp in tps]
    if dtype == torch.float32 and root_name.startswith(("s2", "s3")):  # the fp32 masters are whole tensors
        assert any(r is not None for r in ranges) and not all(r is not None for r in ranges)
    as_tuples = [dataclasses.replace(tp, segments=tuple(map(tuple, tp.segments))) for tp in tps]
    assert executor_module.view_ranges(PlanTensors.of(as_tuples)) == ranges
    lazy = zerofast.reconstruct(real_root(root_name), dtype=dtype, lazy=True)
    executor = prepared.lazy_executor()
    for tp, where in zip(tps, ranges):
        if where is None:
            continue
        assert where == tuple(tp.segments[0])[:2] + (tuple(tp.segments[0])[3],)
        got, want = executor.view(tp, where), _reference_view(prepared.sources, tp)
        assert (got.shape, got.stride(), got.storage_offset(), got.untyped_storage().data_ptr()) == \
            (want.shape, want.stride(), want.storage_offset(), want.untyped_storage().data_ptr())
        assert got._base is not None  # a view, as the slice is
        assert_bitwise_equal(lazy[tp.name], want, tp.name)


def test_contiguous_strides_are_torch_s():
    for shape in [(), (3,), (2, 3), (0, 3), (3, 0, 2), (1, 1, 5), (4, 1, 3), (2, 3, 4, 5)]:
        assert executor_module.contiguous_strides(shape) == torch.empty(shape).stride(), shape


def test_a_view_past_its_source_is_not_handed_out():
    """A plan row past its source's end (no builder makes one) must fail as the read checks it,
    not come back as a view of whatever follows the source in its storage."""
    prepared = prepare(real_root(SMALL), torch.float32)
    viewed = _viewed(prepared.plan.tensors)
    name, tp = next((n, tp) for n, tp in prepared.plan.tensors.items() if n in viewed and tp.numel > 1)
    src, _, _, length = tuple(tp.segments[0])
    past = dataclasses.replace(tp, segments=((src, prepared.sources[src].numel() - length + 1, 0, length),))
    prepared = dataclasses.replace(prepared, plan=dataclasses.replace(
        prepared.plan, tensors={**prepared.plan.tensors, name: past}))
    executor = prepared.lazy_executor()
    assert name not in executor.views
    lazy = zerofast.LazyStateDict(prepared.plan, executor)
    with pytest.raises(Exception, match="segment|source|past|range|outside"):
        lazy[name]
