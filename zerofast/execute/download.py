"""Results made on a device, brought back into host memory: the upload ring's reverse, on the
same device protocol (:class:`~zerofast.devices.streams.Streams`: its host buffers, its copy
stream, its events).

The destinations are memory-mapped windows of the output files: pageable memory, which a GPU
cannot write directly, so every copy to it goes through a pinned host buffer anyway. Two such
buffers let the download of one chunk overlap the host copy of the previous chunk into the file,
and keep host memory at two chunks whatever the tensor size.
"""
from __future__ import annotations

import torch

from ..devices.streams import Streams

CHUNK_BYTES = 16 << 20  # one download; two are held (a 64 MiB output window is four)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.uint8)


class Download:
    """Copies 1-D contiguous device tensors into host tensors of the same dtype and size, in
    chunks through two host buffers of the device (made on first use, kept across calls)."""

    def __init__(self, streams: Streams, chunk_bytes: int = CHUNK_BYTES):
        self.streams = streams
        self.chunk_bytes = chunk_bytes
        self._slots: list[torch.Tensor] = []

    def __call__(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        src_b, dst_b = _bytes(src), _bytes(dst)
        pending = None
        try:
            for i, lo in enumerate(range(0, src_b.numel(), self.chunk_bytes)):
                hi = min(lo + self.chunk_bytes, src_b.numel())
                # Slot i % 2 last held chunk i - 2, which the previous round landed.
                slot = self._slot(i % 2)[: hi - lo]
                event = self.streams.download(src_b[lo:hi], slot)
                if pending is not None:
                    self._land(*pending)
                pending = (event, slot, dst_b[lo:hi])
            if pending is not None:
                self._land(*pending)
        except BaseException:
            # Nothing queued may still write a slot that the next call refills.
            self.streams.finish()
            raise

    def _land(self, event: object, slot: torch.Tensor, dst: torch.Tensor) -> None:
        self.streams.wait(event)
        dst.copy_(slot)

    def _slot(self, k: int) -> torch.Tensor:
        while len(self._slots) <= k:
            self._slots.append(self.streams.host_buffer(self.chunk_bytes))
        return self._slots[k]
