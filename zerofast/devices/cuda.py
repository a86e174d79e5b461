"""The CUDA device's Python side: whether one is there, and GPU results back into host memory
through pinned buffers (``export(..., device="cuda")``). Its kernels are in ``csrc/cuda/``.

The export's destinations are memory-mapped windows of the output files: pageable memory, which
the GPU cannot write directly, so every copy to it goes through a pinned bounce buffer anyway.
Owning two such buffers lets the device-to-host copy of one chunk overlap the host copy of the
previous chunk into the file, and keeps host memory at two chunks whatever the tensor size.
"""
from __future__ import annotations

import torch

CHUNK_BYTES = 16 << 20


def available() -> bool:
    return torch.cuda.is_available()


def count() -> int:
    return torch.cuda.device_count()


def scope(device: torch.device):
    return torch.cuda.device(device)


def select(device: torch.device) -> None:
    torch.cuda.set_device(device)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.uint8)


class PinnedCopy:
    """Copies 1-D contiguous GPU tensors into host tensors of the same dtype and size."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES):
        self.chunk_bytes = chunk_bytes
        self._buffers: list[torch.Tensor] = []

    def __call__(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        src_b, dst_b = _bytes(src), _bytes(dst)
        stream = torch.cuda.current_stream(src.device)
        pending = None
        for i, lo in enumerate(range(0, src_b.numel(), self.chunk_bytes)):
            hi = min(lo + self.chunk_bytes, src_b.numel())
            # Buffer i % 2 was last filled by chunk i - 2, which the previous round has landed.
            staged = self._buffer(i % 2)[: hi - lo]
            staged.copy_(src_b[lo:hi], non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
            if pending is not None:
                _land(*pending)
            pending = (copied, staged, dst_b[lo:hi])
        if pending is not None:
            _land(*pending)

    def _buffer(self, k: int) -> torch.Tensor:
        while len(self._buffers) <= k:
            self._buffers.append(torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=True))
        return self._buffers[k]


def _land(copied: torch.cuda.Event, staged: torch.Tensor, dst: torch.Tensor) -> None:
    copied.synchronize()
    dst.copy_(staged)


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
