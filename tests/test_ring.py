"""The upload ring (zerofast/execute/ring.py) on the CPU-backed fake device
(zerofast/testing/fake_device.py, registered by these tests themselves): its ordering, its slot
reuse and its error paths run here without a GPU. Results are held bit for bit to the CPU path's,
on real DeepSpeed checkpoints and on synthesized ones (for shapes DeepSpeed does not make on a
CPU: tensors split over many slots)."""
from __future__ import annotations

import pytest
import torch

import zerofast
from zerofast import devices
from zerofast.native import ops
from zerofast.execute import ring as ring_module
from zerofast.prepare import prepare
from zerofast.testing.fake_device import FakeDeviceError, FakeStreams, device_entry
from zerofast.testing.synthesize import LayoutSpec, ParamSpec, synthesize

from tests.conftest import HAVE_DEEPSPEED
from tests.helpers import assert_bitwise_equal, real_root

SMALL = "s3_bf16_w2_frozen_tied"
DTYPES = [torch.float32, torch.bfloat16, torch.float16, None]


@pytest.fixture(scope="module")
def big_save(tmp_path_factory):
    """ZeRO-3, world 3: tensors of odd sizes split unevenly over the ranks, one of 40k elements."""
    root = tmp_path_factory.mktemp("ring") / "ckpt"
    shapes = [(200, 200), (7,), (33, 5), (1,), (0,), (1000,), (3, 3, 3)]
    groups = [[ParamSpec(f"layer.{i}.weight", s) for i, s in enumerate(shapes)]]
    synthesize(root, LayoutSpec(stage=3, world_size=3, model_dtype=torch.bfloat16, groups=groups))
    return root


def _roots(big_save):
    yield big_save
    if HAVE_DEEPSPEED:
        yield real_root(SMALL)


def _executor(root, dtype, streams, slot_bytes, slots=3):
    prepared = prepare(root, dtype)
    ex = prepared.streaming_executor()
    ring = ring_module.Ring(streams, ex.reader, slots=slots, slot_bytes=slot_bytes)
    return prepared, ex, ring


def _tensor_plans(prepared):
    """The plan's tensors as the ring takes them: columns (a PlanTensors), no TensorPlan made."""
    return prepared.plan.tensors


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("slot_bytes", [1024, 1 << 16, 1 << 20])
def test_ring_equals_the_cpu_path(big_save, dtype, slot_bytes):
    streams = FakeStreams(jitter=0.002, seed=slot_bytes)
    for root in _roots(big_save):
        prepared, ex, ring = _executor(root, dtype, streams, slot_bytes)
        tps = _tensor_plans(prepared)
        got = ring.read(tps)
        want = ex.run_plan(tps)
        for tp, g, w in zip(tps.values(), got, want):
            assert_bitwise_equal(g, w, tp.name)
    streams.close()


def test_a_ring_that_skips_its_waits_is_caught(big_save):
    """The fake device's jitter makes a missing wait visible: a ring that refills a pinned slot
    before its upload ran hands out another chunk's bytes."""
    class NoWaits(FakeStreams):
        def wait(self, event):
            return None

        def upload(self, host, dev, after):
            # the copy is taken when the job runs, too late for a slot the host refilled meanwhile
            return super().upload(host, dev, None)

    streams = NoWaits(jitter=0.02, seed=1)
    prepared, ex, ring = _executor(big_save, torch.float32, streams, slot_bytes=256, slots=2)
    tps = _tensor_plans(prepared)
    got = ring.read(tps)
    want = ex.run_plan(tps)
    assert any(not torch.equal(g.view(-1).view(torch.uint8), w.view(-1).view(torch.uint8))
               for g, w in zip(got, want) if g.numel())
    streams.close()


def test_slots_are_allocated_once_and_reused(big_save):
    streams = FakeStreams()
    prepared, ex, ring = _executor(big_save, torch.float32, streams, slot_bytes=1024, slots=3)
    tps = _tensor_plans(prepared)
    for _ in range(3):
        ring.read(tps)
    assert streams.host_buffers == 3
    chunks = list(ring_module.chunks(tps, 1024))
    assert streams.counts["upload"] == 3 * len(chunks) > 3 * 3  # more chunks than slots: reuse
    streams.close()


def test_chunks_cover_each_tensor_once(big_save):
    prepared = prepare(big_save, torch.float32)
    tps = _tensor_plans(prepared)
    for slot in (8, 100, 4096, 1 << 30):
        covered = [0] * len(tps)
        for chunk, nbytes in ring_module.chunks(tps, slot):
            assert 0 <= nbytes <= slot
            if chunk.lo is not None:
                covered[int(chunk.which[0])] += chunk.hi - chunk.lo
                continue
            assert len({tps.stored[i] for i in chunk.which.tolist()}) == 1
            for i in chunk.which.tolist():
                covered[i] += int(tps.numels()[i])
        assert covered == [tp.numel for tp in tps.values()]


@pytest.mark.parametrize("fail", [("upload", 0), ("upload", 5), ("compute", 3)])
def test_a_failed_device_job_is_raised_after_everything_queued_ran(big_save, fail):
    streams = FakeStreams(jitter=0.002, fail=fail)
    prepared, ex, ring = _executor(big_save, torch.float32, streams, slot_bytes=512)
    tps = _tensor_plans(prepared)
    with pytest.raises(FakeDeviceError, match=f"fake device {fail[0]} {fail[1]} failed"):
        ring.read(tps)
    assert streams.jobs and all(job.done() for job in streams.jobs)
    streams.fail = None  # the ring stays usable
    for tp, g, w in zip(tps.values(), ring.read(tps), ex.run_plan(tps)):
        assert_bitwise_equal(g, w, tp.name)
    streams.close()


def test_a_read_error_drains_the_queue_first(big_save, monkeypatch):
    streams = FakeStreams(jitter=0.01)
    prepared, ex, ring = _executor(big_save, torch.float32, streams, slot_bytes=512)
    tps = _tensor_plans(prepared)
    calls = {"n": 0}
    real = ops.read_cast

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise OSError(5, "injected read failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "read_cast", failing)
    with pytest.raises(OSError, match="injected read failure"):
        ring.read(tps)
    assert streams._queued == []  # finish() ran: nothing left in flight
    streams.close()


def test_read_into_casts_into_existing_outputs(big_save):
    streams = FakeStreams(jitter=0.002)
    prepared, ex, ring = _executor(big_save, None, streams, slot_bytes=2048)
    tps = _tensor_plans(prepared)
    outs = [torch.full(tp.shape, 7, dtype=torch.float64) for tp in tps.values()]
    ring.read_into(tps, outs)
    for tp, out, want in zip(tps.values(), outs, ex.run_plan(tps)):
        assert_bitwise_equal(out, want.to(torch.float64), tp.name)
    streams.close()


@pytest.fixture
def fake_cuda(monkeypatch):
    """The fake device registered as "cuda", in place of the registry's entry: the public API
    runs the ring end to end on the CPU (outputs are host tensors)."""
    streams = FakeStreams(jitter=0.001)
    monkeypatch.setitem(devices.DEVICES, "cuda", device_entry(streams, "cuda"))
    monkeypatch.setattr(ring_module, "SLOT_BYTES", 4096)
    monkeypatch.setattr(ring_module, "MIN_SLOT_BYTES", 4096)
    yield streams
    streams.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, None], ids=str)
def test_reconstruct_on_the_fake_device(big_save, fake_cuda, dtype):
    for root in _roots(big_save):
        want = zerofast.reconstruct(root, dtype=dtype)
        got = zerofast.reconstruct(root, dtype=dtype, device="cuda")
        assert list(got) == list(want)
        for name, value in want.items():
            assert_bitwise_equal(got[name], value, name)
        lazy = zerofast.reconstruct(root, dtype=dtype, device="cuda", lazy=True)
        for name, value in lazy.items():
            assert_bitwise_equal(value, want[name], name)
    assert fake_cuda.counts["upload"] > 0


def test_export_on_the_fake_device(big_save, fake_cuda, tmp_path):
    """export(device="cuda") without zerofast's CUDA kernels builds each tensor through the ring
    and writes the same bytes as the CPU's export."""
    zerofast.export(big_save, tmp_path / "cpu", dtype=torch.bfloat16)
    zerofast.export(big_save, tmp_path / "cuda", dtype=torch.bfloat16, device="cuda")
    files = sorted(p.name for p in (tmp_path / "cpu").iterdir() if p.is_file())
    assert files == sorted(p.name for p in (tmp_path / "cuda").iterdir() if p.is_file())
    for name in files:
        assert (tmp_path / "cpu" / name).read_bytes() == (tmp_path / "cuda" / name).read_bytes(), name
    assert fake_cuda.counts["upload"] > 0
