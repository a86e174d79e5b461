"""The CUDA device's Python side: whether one is there, how work is placed on one, and its
side of the byte moves (:class:`CudaStreams`: pinned host buffers, a copy stream for uploads and
downloads). Its kernels are in ``csrc/cuda/``.
"""
from __future__ import annotations

import torch


def available() -> bool:
    return torch.cuda.is_available()


def count() -> int:
    return torch.cuda.device_count()


def scope(device: torch.device):
    return torch.cuda.device(device)


def select(device: torch.device) -> None:
    torch.cuda.set_device(device)


class CudaStreams:
    """:class:`~zerofast.devices.streams.Streams` on one GPU: a side stream uploads from pinned
    slots, the current stream casts (so the outputs, made on it, are ready for whatever the
    caller queues next on it)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.copy = torch.cuda.Stream(device)

    def empty(self, shape, dtype):
        return torch.empty(shape, dtype=dtype, device=self.device)

    def host_buffer(self, nbytes):
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def device_buffer(self, nbytes):
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        buffer.record_stream(self.copy)  # written on the copy stream: not reused before it is done
        return buffer

    def upload(self, host, dev, after):
        with torch.cuda.stream(self.copy):
            if after is not None:
                self.copy.wait_event(after)
            dev.copy_(host, non_blocking=True)
            return self.copy.record_event()

    def download(self, dev, host):
        with torch.cuda.stream(self.copy):
            self.copy.wait_stream(torch.cuda.current_stream(self.device))
            host.copy_(dev, non_blocking=True)
            return self.copy.record_event()

    def compute(self, fn, after):
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(after)
        fn()
        return stream.record_event()

    def wait(self, event) -> None:
        event.synchronize()

    def finish(self) -> None:
        self.copy.synchronize()
        torch.cuda.current_stream(self.device).synchronize()
