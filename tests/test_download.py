"""Results made on a device, brought back into host memory (zerofast/execute/download.py), on the
CPU-backed fake device (zerofast/testing/fake_device.py): its order against the compute stream,
its two host buffers, and its error path run here without a GPU. Every result is held byte for
byte to the device tensor it copies."""
from __future__ import annotations

import time
import pytest
import torch

from zerofast.execute.download import Download
from zerofast.testing.fake_device import FakeDeviceError, FakeStreams

CHUNK = 64  # bytes: every tensor below crosses several chunks


def _random(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """``numel`` elements of ``dtype`` from random bytes: any bit pattern, NaNs included."""
    size = torch.empty((), dtype=dtype).element_size()
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=g).view(dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8], ids=str)
def test_a_download_equals_the_device_tensor_byte_for_byte(dtype):
    streams = FakeStreams(jitter=0.002, seed=3)
    download = Download(streams, chunk_bytes=CHUNK)
    for numel in (0, 1, 15, 16, 17, 100, 1001):
        src = _random(numel, dtype, seed=numel)
        dst = torch.empty_like(src)
        download(src, dst)
        assert torch.equal(_bytes(dst), _bytes(src)), numel
    streams.close()


def test_a_download_that_skips_its_waits_is_caught():
    """The fake device's jitter makes a missing wait visible: a host copy taken before its
    chunk's download ran hands out the buffer's old bytes."""
    class NoWaits(FakeStreams):
        def wait(self, event):
            return None

    streams = NoWaits(jitter=0.02, seed=1)
    src = _random(1000, torch.float32, seed=0)
    dst = torch.zeros_like(src)
    Download(streams, chunk_bytes=CHUNK)(src, dst)
    assert not torch.equal(_bytes(dst), _bytes(src))
    streams.finish()
    streams.close()


def test_a_download_waits_for_the_work_that_makes_its_source():
    streams = FakeStreams()
    src = torch.zeros(500, dtype=torch.float32)
    want = _random(500, torch.float32, seed=7)

    def make():  # what the compute stream queued before the download: slow, and it writes src
        time.sleep(0.05)
        src.copy_(want)

    streams.compute(make, after=None)
    dst = torch.empty_like(src)
    Download(streams, chunk_bytes=CHUNK)(src, dst)
    assert torch.equal(_bytes(dst), _bytes(want))
    streams.close()


def test_two_host_buffers_serve_every_chunk_and_call():
    streams = FakeStreams()
    download = Download(streams, chunk_bytes=CHUNK)
    src = _random(300, torch.float32, seed=2)  # 1200 bytes: 19 chunks
    for _ in range(3):
        download(src, torch.empty_like(src))
    assert streams.host_buffers == 2
    assert streams.counts["download"] == 3 * 19
    streams.close()


@pytest.mark.parametrize("fail", [0, 4, 18])
def test_a_failed_download_is_raised_after_everything_queued_ran(fail):
    streams = FakeStreams(jitter=0.002, fail=("download", fail))
    download = Download(streams, chunk_bytes=CHUNK)
    src = _random(300, torch.float32, seed=5)
    with pytest.raises(FakeDeviceError, match=f"fake device download {fail} failed"):
        download(src, torch.empty_like(src))
    assert streams.jobs and all(job.done() for job in streams.jobs)
    streams.fail = None  # the buffers stay usable
    dst = torch.empty_like(src)
    download(src, dst)
    assert torch.equal(_bytes(dst), _bytes(src))
    streams.close()
