"""The protocol a device implements for moving bytes between host memory and its own: the upload
ring (:mod:`zerofast.execute.ring`) and the download of results made there
(:mod:`zerofast.execute.download`).

A device has a host side (pinned buffers the CPU fills or drains), a copy stream (uploads and
downloads) and a compute stream (copies out of the uploaded slot into the outputs, casting; or
whatever made a result). Work queued on one stream runs in order; an *event* marks a point in a
stream that other streams, or the host, can wait for.

Call order, per pass of the ring:

1. ``host_buffer`` and ``device_buffer`` once per slot (kept across passes), ``empty`` per output;
2. per chunk, in slot ``k``:

   a. ``wait(upload event of slot k's previous chunk)``: the host may refill pinned slot ``k``;
   b. ``upload(host, dev, after=compute event of slot k's previous chunk)`` -> upload event:
      the copy stream overwrites device slot ``k`` only once the compute stream is done with it;
   c. ``compute(fn, after=that upload event)`` -> compute event: ``fn`` queues the copies out;

3. ``finish()`` once, also after an error: everything queued has run (an error it raises is the
   first that a queued job raised), so the slots may be refilled or dropped.

Call order of a download, per chunk in host buffer ``k`` of two: ``download(dev, host k)`` ->
event (queued after everything the compute stream holds so far), then ``wait`` on the previous
chunk's event and its host copy out; ``finish()`` after an error.
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch


class Streams(Protocol):
    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An output tensor in device memory."""

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 host tensor the device can upload from without another copy (pinned)."""

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 device tensor."""

    def upload(self, host: torch.Tensor, dev: torch.Tensor, after: object | None) -> object:
        """Queue ``dev.copy_(host)`` on the copy stream after event ``after`` (None: at once);
        return the event of its completion."""

    def download(self, dev: torch.Tensor, host: torch.Tensor) -> object:
        """Queue ``host.copy_(dev)`` on the copy stream once everything queued on the compute
        stream so far has run (what made ``dev``); return the event of its completion."""

    def compute(self, fn: Callable[[], None], after: object) -> object:
        """Queue ``fn``'s device work on the compute stream after event ``after``; return the
        event of its completion."""

    def wait(self, event: object) -> None:
        """Block the host until ``event`` has happened."""

    def finish(self) -> None:
        """Block the host until all queued work has run."""
