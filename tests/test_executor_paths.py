"""The executor's one path (zerofast/execute/executor.py), chosen at construction from its
device's registry entry: the batched reader for host memory, the upload ring for a device that
has one (here the CPU-backed fake device, registered by these tests), the mapped gather where
there is no file reader or results are made on one device for another. Each gives the host
path's results bit for bit; the ring is fed the plan's columns as they are."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from zerofast import devices
from zerofast.execute import ring as ring_module
from zerofast.execute.executor import Executor, HostPath, MappedGather, RingPath
from zerofast.prepare import prepare
from zerofast.plan.columns import PlanTensors
from zerofast.testing.fake_device import FakeStreams, device_entry
from zerofast.testing.synthesize import LayoutSpec, ParamSpec, synthesize

from tests.helpers import assert_bitwise_equal


@pytest.fixture(scope="module")
def save(tmp_path_factory):
    """ZeRO-3, world 3, bf16: tensors of odd sizes split unevenly over the ranks."""
    root = tmp_path_factory.mktemp("paths") / "ckpt"
    shapes = [(120, 90), (7,), (33, 5), (1,), (0,), (1000,), (3, 3, 3)]
    groups = [[ParamSpec(f"layer.{i}.weight", s) for i, s in enumerate(shapes)]]
    synthesize(root, LayoutSpec(stage=3, world_size=3, model_dtype=torch.bfloat16, groups=groups))
    return root


@pytest.fixture
def fake(monkeypatch):
    """The fake device registered under a type zerofast has no entry for, and as "cuda": the
    path comes from the entry, whatever its type is called."""
    streams = FakeStreams(jitter=0.001)
    monkeypatch.setitem(devices.DEVICES, "xpu", device_entry(streams, "xpu"))
    monkeypatch.setitem(devices.DEVICES, "cuda", device_entry(streams, "cuda"))
    monkeypatch.setattr(ring_module, "SLOT_BYTES", 2048)
    monkeypatch.setattr(ring_module, "MIN_SLOT_BYTES", 2048)
    yield streams
    streams.close()


def _same(got, want, cols):
    assert len(got) == len(want) == len(cols)
    for name, g, w in zip(cols.names, got, want):
        assert g.shape == w.shape, name
        assert_bitwise_equal(g, w, name)


def test_each_executor_has_one_path_from_its_device_entry(save, fake):
    prepared = prepare(save, torch.float32)
    host = prepared.streaming_executor()
    assert isinstance(host.path, HostPath) and host.batch is host.reader is not None
    for kind in ("xpu", "cuda"):
        ring = prepared.streaming_executor(kind)
        assert isinstance(ring.path, RingPath) and ring.batch is None and ring.reader is not None
    elsewhere = prepared.streaming_executor(compute="cuda")  # results in host memory, made on the device
    assert isinstance(elsewhere.path, MappedGather) and elsewhere.batch is None
    alone = Executor(prepared.sources)  # no file reader: the mappings are all there is
    assert isinstance(alone.path, MappedGather) and alone.batch is None
    assert alone.file_ranges(prepared.plan.tensors) == {}
    assert alone.device == devices.HOST and alone.host


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, None], ids=str)
def test_every_path_gives_the_host_paths_results(save, fake, dtype):
    prepared = prepare(save, dtype)
    cols = prepared.plan.tensors
    want = prepared.streaming_executor().run_plan(cols)
    for executor in (prepared.streaming_executor("xpu"), prepared.streaming_executor(compute="cuda"),
                     Executor(prepared.sources, streamable=prepared.mapped)):
        _same(executor.run_plan(cols), want, cols)
        _same(executor.run_plan(PlanTensors.of(list(cols.values()))), want, cols)
        _same([executor.run(tp) for tp in cols.values()], want, cols)
    assert fake.counts["upload"] > 0
    assert fake.counts["download"] > 0  # results made on the device come back through its buffers


def test_the_ring_reads_selections_and_plans_of_tuples_off_their_columns(save, fake):
    """A selection (reordered, a tensor twice) and the columns of plans whose segments are
    tuples: the ring cuts its chunks from whatever columns it is given."""
    prepared = prepare(save, torch.bfloat16)
    cols = prepared.plan.tensors
    host, ring = prepared.streaming_executor(), prepared.streaming_executor("xpu")
    picked = cols.select(np.array([5, 0, 2, 0, 6], dtype=np.int64))
    _same(ring.run_plan(picked), host.run_plan(picked), picked)
    as_tuples = PlanTensors.of([dataclasses.replace(tp, segments=tuple(map(tuple, tp.segments)))
                                for tp in cols.values()])
    _same(ring.run_plan(as_tuples), host.run_plan(cols), cols)


def test_pieces_cut_from_the_columns_are_the_plans_slices(save):
    prepared = prepare(save, torch.float32)
    cols = prepared.plan.tensors
    table = cols.table
    for i, tp in enumerate(cols.values()):
        rows = table.rows[int(table.starts[i]):int(table.starts[i + 1])]
        for lo, hi in [(0, tp.numel), (0, 1), (tp.numel // 3, tp.numel // 2 + 1), (tp.numel - 1, tp.numel)]:
            if not 0 <= lo < hi <= tp.numel:
                continue
            got = ring_module.piece_rows(rows, lo, hi).tolist()
            assert got == [list(s) for s in tp.slice(lo, hi).segments], (tp.name, lo, hi)


def _spied(executor, monkeypatch):
    passes, gathered = [], []
    read_into, into = executor.path.read_into, executor.gather.into
    monkeypatch.setattr(executor.path, "read_into", lambda c, o: (passes.append(list(c.names)), read_into(c, o)))
    monkeypatch.setattr(executor.gather, "into", lambda tp, flat: (gathered.append(tp.name), into(tp, flat)))
    return passes, gathered


def test_run_into_host_memory_is_one_pass(save, monkeypatch):
    prepared = prepare(save, None)
    executor = prepared.streaming_executor()
    cols = prepared.plan.tensors
    want = executor.run_plan(cols)
    outs = [torch.full(tp.shape, 3, dtype=tp.out_dtype) for tp in cols.values()]
    passes, gathered = _spied(executor, monkeypatch)
    executor.run_into(cols, outs)
    assert passes == [list(cols.names)] and gathered == []
    _same(outs, want, cols)


def test_run_into_splits_what_the_path_takes_from_what_it_gathers(save, fake, monkeypatch):
    """Outputs the ring does not take (here: host memory, every other one; the fake device's own
    memory is host memory too) are built on the device one by one and downloaded through its
    buffers; the ones it takes go through it in one pass."""
    prepared = prepare(save, torch.bfloat16)
    executor = prepared.streaming_executor("xpu")
    cols = prepared.plan.tensors
    tps = list(cols.values())
    want = prepared.streaming_executor().run_plan(cols)
    outs = [torch.full(tp.shape, 3, dtype=tp.out_dtype) for tp in tps]
    taken = {id(o) for o in outs[::2]}
    monkeypatch.setattr(executor.path, "takes", lambda out: id(out) in taken)
    passes, gathered = _spied(executor, monkeypatch)
    executor.run_into(cols, outs)
    assert passes == [[tp.name for tp in tps[::2]]]
    assert gathered == [tp.name for tp in tps[1::2]]
    _same(outs, want, cols)
