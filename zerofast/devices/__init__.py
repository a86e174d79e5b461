"""The devices zerofast runs on, in one registry.

A device is one kernel directory under ``csrc/`` (its kernels register themselves with the
dispatcher) plus one :class:`Device` entry here, which says everything the Python side needs:
whether one is there, how a computation is pinned to one, which ``torch.distributed`` backend
ranks on it use, and its side of the byte moves between host memory and its own
(:class:`~.streams.Streams`: the upload ring, and the download of results made there).

The executor (``execute/``) picks its one path from these entries (``host``, ``streams``) and names no device type (``tests/test_structure.py`` checks that). Elsewhere a
type is still named in three kinds of places: the native core's build (``native/loader.py``,
``cudaplan.py``, ``proof.py``), which chooses the kernel directories of ``csrc/`` to compile by
their names, ``"cpu"`` and ``"cuda"``, before any device is used; the public entry points'
default ``device="cpu"``; and ``load/residency.py``, below this package, which asks whether a
source tensor (a file mapping) is in host memory. Above the executor, an entry's ``host`` (or
``Executor.host``) answers that question.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch

from ..base.errors import DeviceError
from . import cuda
from .streams import Streams


@dataclass(frozen=True)
class Device:
    type: str  # torch's device type, and the name of the kernel directory under csrc/
    available: Callable[[], bool]  # this torch sees at least one
    count: Callable[[], int]  # how many this process sees (ranks are placed on LOCAL_RANK's)
    scope: Callable[[torch.device], ContextManager]  # make it the current device while work runs
    select: Callable[[torch.device], None]  # make it this process's device for good (a rank's GPU)
    backend: str  # the torch.distributed backend of a team exporting on it
    # Its side of the upload ring and of downloads (streams.Streams) for one device; None: the
    # host's own memory, where results are made by the host's readers
    streams: Callable[[torch.device], Streams] | None = None

    @property
    def host(self) -> bool:
        """The host's own memory: results need no copy back, and ranks need no device each."""
        return self.streams is None


def _nothing(device: torch.device) -> ContextManager:
    return contextlib.nullcontext()


def _stay(device: torch.device) -> None:
    return None


DEVICES: dict[str, Device] = {
    "cpu": Device("cpu", lambda: True, lambda: 1, _nothing, _stay, "gloo"),
    "cuda": Device("cuda", cuda.available, cuda.count, cuda.scope, cuda.select, "nccl", cuda.CudaStreams),
}


# The host's own memory: the device of the one entry whose results need no copy back.
HOST = torch.device(next(d.type for d in DEVICES.values() if d.host))


def device_of(device: str | torch.device) -> Device:
    """The registry entry of ``device``'s type, or a :class:`DeviceError` that lists the types."""
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError, ValueError):
        raise DeviceError(f"device={device!r}: not a device torch knows; zerofast runs on "
                          f"{' or '.join(map(repr, DEVICES))}") from None
    if kind not in DEVICES:
        raise DeviceError(f"device={str(device)!r}: zerofast runs on {' or '.join(map(repr, DEVICES))}")
    return DEVICES[kind]
