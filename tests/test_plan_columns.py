"""Columnar plans (zerofast.plan.columns) against the per-entry code they stand in for.

- ``plan_tensors`` over layers of tables (made by array arithmetic, or of entries made one by
  one: ``EntryTable.of_entries``) must give, tensor by tensor, the TensorPlan the per-entry
  assembly gives: the later layer winning a name, segments equal row for row.
- ``segment_rows`` of mixed tuples and views of several tables equals their rows in order.
- ``EntryTable`` is the dict a builder made before: same items, same order, a repeated name
  keeping the last entry as a dict does; ``join`` is the dict that updating one with each makes.
- The batched reader gives the same tensors, bit for bit, from the columns as from a list of
  TensorPlans, on real saves whose outputs mix dtypes; and the same read cut into many native
  calls (``read_batch.CALL_ROWS``) as in one, the calls' tables being the one table's, cut
  between tensors.
"""
from __future__ import annotations

from itertools import repeat

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import needs_deepspeed
from tests.dsgen.catalog import ensure_checkpoint
from zerofast.plan.columns import EntryTable, Layers, PlanTensors, plan_tensors, segment_rows
from zerofast.plan.model import SegmentTable, TableSegments, TensorPlan
from zerofast.prepare import prepare

DTYPES = (torch.float32, torch.bfloat16, torch.int64)
NAMES = [f"p{i}" for i in range(12)]


def _out(stored: torch.dtype) -> torch.dtype:
    return torch.float32 if stored.is_floating_point else stored


segment = st.tuples(st.integers(0, 3), st.integers(0, 50), st.integers(0, 50), st.integers(0, 9))
segments = st.lists(segment, max_size=3)
shape = st.lists(st.integers(0, 4), max_size=3).map(tuple)


@st.composite
def table_layer(draw) -> EntryTable:
    names = draw(st.lists(st.sampled_from(NAMES), unique=True, max_size=8))
    segs = [draw(segments) for _ in names]
    return EntryTable.of(names, [draw(shape) for _ in names], draw(st.sampled_from(DTYPES)), SegmentTable.of(segs))


@st.composite
def dict_layer(draw, tables: list[EntryTable]) -> dict:
    out = {}
    for name in draw(st.lists(st.sampled_from(NAMES), unique=True, max_size=8)):
        if tables and draw(st.booleans()):  # a view of some table's rows, as partition_entries passes on
            table = draw(st.sampled_from(tables))
            if len(table):
                out[name] = (draw(shape), table.dtype, TableSegments(table.table, draw(st.integers(0, len(table) - 1))))
                continue
        out[name] = (draw(shape), draw(st.sampled_from(DTYPES)), draw(segments))
    return out


kind = st.sampled_from(("trainable", "frozen", "buffer"))


@st.composite
def layers(draw) -> list:
    tables = [draw(table_layer()) for _ in range(draw(st.integers(0, 2)))]
    picked = [*tables, *(draw(dict_layer(tables)) for _ in range(draw(st.integers(0, 3))))]
    order = draw(st.permutations(range(len(picked))))
    return [(draw(kind), picked[i]) for i in order]


def _tables(pairs: list) -> list:
    """The layers as plain_plan hands them over: a dict of entries as its columns."""
    return [(k, e if isinstance(e, EntryTable) else EntryTable.of_entries(e)) for k, e in pairs]


@st.composite
def table_first(draw) -> list:
    """What plain_plan passes: the builder's table, then dicts (frozen weights, buffers)."""
    table = draw(table_layer())
    return [(draw(kind), table), *((draw(kind), draw(dict_layer([table]))) for _ in range(draw(st.integers(0, 3))))]


def _per_entry(named: list[str], pairs: list) -> dict[str, TensorPlan]:
    """What assemble built before the columns: one dict updated layer by layer, a TensorPlan each."""
    entries = {}
    for kind, named_entries in pairs:
        entries.update((n, (kind, e)) for n, e in named_entries.items())
    out = {}
    for name in named:
        kind, (shp, stored, segs) = entries[name]
        out[name] = TensorPlan(name, shp, kind, stored, _out(stored),
                               segs if type(segs) is TableSegments else tuple(segs))
    return out


@settings(max_examples=300, deadline=None)
@given(layers() | table_first(), st.randoms(use_true_random=False))
def test_plan_tensors_equal_the_per_entry_plans(pairs, rnd):
    known = list(Layers(_tables(pairs)).names)
    named = rnd.sample(known, rnd.randint(0, len(known)))
    cols = plan_tensors(named, Layers(_tables(pairs)), _out)
    want = _per_entry(named, pairs)
    assert list(cols) == named and len(cols) == len(named)
    for name, tp in want.items():
        got = cols[name]
        assert (got.name, got.shape, got.kind, got.stored_dtype, got.out_dtype) == \
               (tp.name, tp.shape, tp.kind, tp.stored_dtype, tp.out_dtype)
        assert tuple(map(tuple, got.segments)) == tuple(map(tuple, tp.segments)), name
        assert type(got.segments) is TableSegments and got.segments.table is cols.table  # a view of the columns
    assert dict(cols.items()) == want and list(cols.values()) == list(want.values())


def test_layers_let_the_later_win_and_keep_the_first_place():
    first = EntryTable.of(["a", "b"], [(1,), (2,)], torch.float32, SegmentTable.of([[(0, 0, 0, 1)], [(0, 1, 0, 2)]]))
    later = {"c": ((1,), torch.int64, [(1, 0, 0, 1)]), "a": ((1,), torch.bfloat16, [(2, 0, 0, 1)])}
    both = Layers(_tables([("trainable", first), ("empty", {}), ("buffer", later)]))
    assert list(both.names) == ["a", "b", "c"]
    assert [k for k, _ in both.layers] == ["trainable", "buffer"]
    assert (both.kind("a"), both.kind("b"), both.kind("zz")) == ("buffer", "trainable", None)
    tps = plan_tensors(["b", "a"], both, _out)
    assert tps["a"].segments == ((2, 0, 0, 1),) and tps["a"].stored_dtype == torch.bfloat16
    assert type(tps["b"].segments) is TableSegments and tps["b"].segments == [(0, 1, 0, 2)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(segments, max_size=5), min_size=1, max_size=3), st.data())
def test_segment_rows_are_each_tensors_rows_in_order(tables, data):
    made = [SegmentTable.of(t) for t in tables]
    picks = data.draw(st.lists(st.one_of(
        segments.map(lambda s: ("tuple", s)),
        st.tuples(st.integers(0, len(made) - 1), st.integers(0, 4)).map(lambda p: ("view", p))), max_size=10))
    given_, want = [], []
    for kind, what in picks:
        if kind == "tuple":
            given_.append(what)
            want.append(list(what))
        elif len(tables[what[0]]) > what[1]:
            given_.append(TableSegments(made[what[0]], what[1]))
            want.append(list(tables[what[0]][what[1]]))
    rows, counts = segment_rows(given_)
    assert counts.tolist() == [len(w) for w in want]
    assert rows.reshape(-1, 4).tolist() == [list(r) for w in want for r in w]


def test_entry_table_is_the_dict_it_replaces():
    segs = [[(0, 0, 0, 2)], [], [(1, 4, 0, 1), (0, 9, 1, 1)]]
    table = EntryTable.of(["x", "y", "z"], [(2,), (0,), (2,)], torch.float32, SegmentTable.of(segs))
    plain = dict(zip(["x", "y", "z"], zip([(2,), (0,), (2,)], repeat(torch.float32), SegmentTable.of(segs).views())))
    assert type(table) is EntryTable
    assert table == plain and list(table.items()) == list(plain.items()) and list(table) == list(plain)
    assert "y" in table and "w" not in table and table.keys() - {"x"} == {"y", "z"}
    with pytest.raises(KeyError):
        table["w"]
    # a repeated name: the builder's dict kept the last entry, in the first one's place
    twice = EntryTable.of(["x", "y", "x"], [(2,), (0,), (2,)], torch.float32, SegmentTable.of(segs))
    assert type(twice) is EntryTable and list(twice) == ["x", "y"] and twice["x"][2] == [(1, 4, 0, 1), (0, 9, 1, 1)]
    assert dict(twice.items()) == dict(zip(["x", "y", "x"], zip([(2,), (0,), (2,)], repeat(torch.float32),
                                                              SegmentTable.of(segs).views())))
    of_entries = EntryTable.of_entries({"b": ((1,), torch.int64, [(3, 0, 0, 1)]), "a": ((2,), torch.float32, [])})
    assert list(of_entries.items()) == [("b", ((1,), torch.int64, [(3, 0, 0, 1)])), ("a", ((2,), torch.float32, []))]
    assert of_entries.dtype is None and len(EntryTable.of_entries({})) == 0


def test_joined_tables_are_the_dict_updated_with_each():
    a = EntryTable.of(["x", "y"], [(1,), (2,)], torch.float32, SegmentTable.of([[(0, 0, 0, 1)], [(0, 1, 0, 2)]]))
    b = EntryTable.of(["z"], [(3,)], torch.float32, SegmentTable.of([[(1, 0, 0, 3)]]))
    joined = EntryTable.join([a, b])
    assert dict(joined.items()) == {**dict(a.items()), **dict(b.items())} and joined.dtype == torch.float32
    later = EntryTable.of(["y"], [(4,)], torch.float32, SegmentTable.of([[(2, 0, 0, 4)]]))
    twice = EntryTable.join([a, later])  # a name in both: the later entry, at the first place
    assert list(twice.items()) == list({**dict(a.items()), **dict(later.items())}.items())
    other = EntryTable.of(["z"], [(3,)], torch.bfloat16, SegmentTable.of([[(1, 0, 0, 3)]]))
    mixed = EntryTable.join([a, other])
    assert mixed.dtype is None and mixed.dtypes == [torch.float32, torch.float32, torch.bfloat16]
    assert dict(mixed.items()) == {**dict(a.items()), **dict(other.items())}
    assert EntryTable.join([a]) is a and len(EntryTable.join([])) == 0
    assert a.without(frozenset({"x"})).names == ["y"] and a.without(frozenset({"q"})) is a


@needs_deepspeed
@pytest.mark.parametrize("layout", ["s2_bf16_w2_frozen_tied", "s3_bf16_w2_frozen_tied", "s1_fp32_w3"])
def test_reading_the_columns_equals_reading_the_plans(layout):
    prepared = prepare(ensure_checkpoint(layout))
    tensors = prepared.plan.tensors
    assert type(tensors) is PlanTensors
    if len(set(tensors.out)) < 2:
        pytest.skip(f"{layout}: every output has one dtype (the mixed case is the point here)")
    from_columns = prepared.streaming_executor().run_plan(tensors)
    from_plans = prepared.streaming_executor().run_plan(PlanTensors.of(list(tensors.values())))
    assert len(from_columns) == len(from_plans) == len(tensors)
    for name, a, b in zip(tensors, from_columns, from_plans):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a.view(torch.uint8) if a.numel() else a, b.view(torch.uint8) if b.numel() else b), name


def test_reading_the_columns_splits_by_output_dtype(tmp_path):
    """Without DeepSpeed: a synthesized save whose buffer is int64 beside float outputs."""
    from zerofast.testing.synthesize import BufferSpec, LayoutSpec, ParamSpec, synthesize

    spec = LayoutSpec(stage=2, world_size=2, model_dtype=torch.bfloat16,
                      groups=[[ParamSpec("w", (3, 5)), ParamSpec("v", (7,))]],
                      buffers=[BufferSpec("steps", (4,), torch.int64)])
    truth = synthesize(tmp_path, spec)
    prepared = prepare(tmp_path)
    tensors = prepared.plan.tensors
    made = prepared.streaming_executor().run_plan(tensors)
    assert {t.dtype for t in made} == {torch.float32, torch.int64}
    for tp, t in zip(tensors.values(), made):
        alone = prepared.streaming_executor().run(tp)
        assert t.dtype == tp.out_dtype and tuple(t.shape) == tuple(tp.shape)
        assert torch.equal(t, alone)
    assert torch.equal(made[list(tensors).index("steps")], truth.buffers["steps"])


@given(counts=st.lists(st.integers(0, 9), min_size=1, max_size=40), limit=st.integers(1, 12))
@settings(max_examples=200, deadline=None)
def test_calls_cut_a_group_into_whole_tensors_of_about_call_rows(counts, limit):
    import numpy as np

    from zerofast.execute import read_batch

    counts = np.array(counts, dtype=np.int64)
    rows = np.arange(int(counts.sum()) * 4, dtype=np.int64).reshape(-1, 4)
    whole = read_batch._table(np.arange(len(counts), dtype=np.int64), rows, counts)
    saved, read_batch.CALL_ROWS = read_batch.CALL_ROWS, limit
    try:
        calls = list(read_batch._calls(rows, counts))
    finally:
        read_batch.CALL_ROWS = saved
    assert [lo for lo, _, _ in calls] == [0] + [hi for _, hi, _ in calls[:-1]] and calls[-1][1] == len(counts)
    for lo, hi, table in calls:
        assert hi > lo
        assert len(table) <= limit or hi == lo + 1  # over the limit only where one tensor is
        assert hi == len(counts) or len(table) + counts[hi] > limit  # as many as fit: the next does not
        # Each call's table is the one-call table's rows of its tensors, numbered from 0.
        expect = whole[(whole[:, 0] >= lo) & (whole[:, 0] < hi)].copy()
        expect[:, 0] -= lo
        assert np.array_equal(table.numpy(), expect)


@needs_deepspeed
@pytest.mark.parametrize("layout", ["s3_bf16_w2_frozen_tied", "s1_fp32_w3"])
def test_reading_in_many_calls_equals_reading_in_one(layout, monkeypatch):
    from zerofast.native import ops
    from zerofast.execute import read_batch

    prepared = prepare(ensure_checkpoint(layout))
    tensors = prepared.plan.tensors
    monkeypatch.setattr(read_batch, "CALL_ROWS", 1 << 62)
    one = prepared.streaming_executor().run_plan(tensors)
    calls = []
    real = ops.read_cast_new
    monkeypatch.setattr(read_batch, "CALL_ROWS", 3)
    monkeypatch.setattr(ops, "read_cast_new", lambda *a: calls.append(len(a[5])) or real(*a))
    many = prepared.streaming_executor().run_plan(tensors)
    assert len(calls) > len(set(tensors.out)) and sum(calls) == len(tensors)
    calls.clear()
    from_plans = prepared.streaming_executor().run_plan(PlanTensors.of(list(tensors.values())))  # the TensorPlan groups
    assert len(calls) > len(set(tensors.out)) and sum(calls) == len(tensors)
    for name, a, b, c in zip(tensors, many, one, from_plans):
        assert a.dtype == b.dtype == c.dtype and a.shape == b.shape == c.shape, name
        bits = [t.view(torch.uint8) if t.numel() else t for t in (a, b, c)]
        assert torch.equal(bits[0], bits[1]) and torch.equal(bits[2], bits[1]), name


@needs_deepspeed
@pytest.mark.parametrize("layout", ["s3_bf16_w2_frozen_tied", "s1_fp32_w3"])
def test_reading_into_and_writing_in_many_calls_equal_one(layout, monkeypatch, tmp_path):
    """load_into's read_into and the export's write, cut into 3-row calls, against one call."""
    from zerofast.native import ops
    from zerofast.execute import read_batch

    prepared = prepare(ensure_checkpoint(layout))
    tps = list(prepared.plan.tensors.values())

    def both(rows: int):
        monkeypatch.setattr(read_batch, "CALL_ROWS", rows)
        executor = prepared.streaming_executor()
        outs = [torch.full((tp.numel,), 7, dtype=tp.out_dtype) for tp in tps]
        executor.run_into(prepared.plan.tensors, outs)
        placed, at = [], 0
        for tp in tps:
            placed.append((tp, at))
            at += tp.nbytes
        path = tmp_path / f"out-{rows}.bin"
        with open(path, "wb") as f:
            executor.batch.write(f.fileno(), placed)
        return outs, path.read_bytes()

    one_outs, one_file = both(1 << 62)
    calls = []
    for name in ("read_cast", "read_cast_to_file"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, real=real: calls.append(a[3].shape[0]) or real(*a))
    many_outs, many_file = both(3)
    assert len(calls) > 2 and sum(calls) == 2 * sum(len(tp.segments) for tp in tps)
    assert many_file == one_file and len(one_file) == sum(tp.nbytes for tp in tps)
    for tp, a, b in zip(tps, many_outs, one_outs):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), tp.name
