"""A fake device for tests: a CPU-backed :class:`~zerofast.devices.streams.Streams` (the upload
ring's side of a device), and :func:`device_entry`, the registry entry a test puts in
``zerofast.devices.DEVICES`` itself (``monkeypatch.setitem``) to run the public API's device paths
on the CPU. Not in the registry, and not imported by ``import zerofast``.

The copy stream and the compute stream are each one worker thread taking jobs in order, events
are the jobs' futures, and device memory is host memory. With ``jitter`` each job sleeps a random
moment before it runs, so a ring that forgot a wait reads or overwrites a slot too early and the
result shows it. ``fail`` names a job (``("upload", n)`` or ``("compute", n)``, counting from 0)
(or ``("download", n)``) that raises, to drive the error paths.
"""
from __future__ import annotations

import contextlib
import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from ..devices import Device


class FakeDeviceError(RuntimeError):
    """What a job named by ``fail`` raises."""


class FakeStreams:
    def __init__(self, jitter: float = 0.0, seed: int = 0, fail: tuple[str, int] | None = None):
        self.jitter = jitter
        self.fail = fail
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._copy = ThreadPoolExecutor(1, thread_name_prefix="fake-device-copy")
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="fake-device-compute")
        self._queued: list[Future] = []  # since the last finish()
        self.jobs: list[Future] = []  # every job ever queued: a test checks that all of them ran
        self.counts = {"upload": 0, "compute": 0, "download": 0}
        self._computed: Future | None = None  # the compute stream's last job
        self.host_buffers = 0  # how many were asked for: the ring reuses its slots

    def empty(self, shape, dtype):
        return torch.empty(shape, dtype=dtype)

    def host_buffer(self, nbytes):
        self.host_buffers += 1
        return torch.empty(nbytes, dtype=torch.uint8)

    def device_buffer(self, nbytes):
        return torch.empty(nbytes, dtype=torch.uint8)

    def upload(self, host, dev, after):
        return self._queue(self._copy, "upload", lambda: dev.copy_(host), after)

    def compute(self, fn: Callable[[], None], after):
        self._computed = self._queue(self._compute, "compute", fn, after)
        return self._computed

    def download(self, dev, host):
        return self._queue(self._copy, "download", lambda: host.copy_(dev), self._computed)

    def wait(self, event: Future) -> None:
        event.result()

    def finish(self) -> None:
        queued, self._queued = self._queued, []
        error = None
        for job in queued:
            try:
                job.result()
            except BaseException as e:  # every job is waited for; the first error is raised
                error = error or e
        if error is not None:
            raise error

    def close(self) -> None:
        self._copy.shutdown()
        self._compute.shutdown()

    def _queue(self, pool: ThreadPoolExecutor, kind: str, fn, after: Future | None) -> Future:
        number = self.counts[kind]
        self.counts[kind] += 1
        pause = self._random.uniform(0, self.jitter) if self.jitter else 0.0

        def job() -> None:
            if after is not None:
                after.result()  # a failed job fails the ones ordered after it, as on a stream
            time.sleep(pause)
            if self.fail == (kind, number):
                raise FakeDeviceError(f"fake device {kind} {number} failed")
            fn()

        future = pool.submit(job)
        self._queued.append(future)
        self.jobs.append(future)
        return future


def device_entry(streams: FakeStreams, kind: str = "cuda") -> Device:
    """A registry entry for the device type ``kind`` whose ring runs on ``streams``: always there, one of it, no
    device to select, results copied back as host tensors, gloo for a team."""
    return Device(kind, lambda: True, lambda: 1, lambda device: contextlib.nullcontext(), lambda device: None,
                  "gloo", lambda device: streams)
