"""The only door to the native ops: ``torch.ops.zerofast.*``, or the reference when asked for.

The native core is found, or built for the running torch, on first use (:mod:`.native.loader`),
so ``import zerofast`` never fails for lack of it. Where it cannot be built, the ops run on the
pure-torch reference, with one warning; ``ZEROFAST_NATIVE=1`` makes that an error instead, and
``ZEROFAST_NATIVE=0`` selects the reference.
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Sequence

import torch

from . import reference
from .errors import DeviceError, NativeExtensionError
from .native import loader

# Device types the executor knows how to feed; the extension says which it was built with.
DEVICE_TYPES = ("cpu", "cuda")
_loaded = False


def native_enabled() -> bool:
    """Whether the ops run natively: the core loads (or builds), and ZEROFAST_NATIVE is not 0."""
    if loader.load() is None:
        return False
    load_native()
    return True


def load_native():
    """The native core's module (built on first use), with ``torch.ops.zerofast`` registered; a
    :class:`NativeExtensionError` that says why if it cannot be had."""
    global _loaded
    module = loader.load(required=True).module
    if not _loaded:
        if not _fake_registered():
            _register_fake()
        _loaded = True
    return module


def built_devices() -> list[str]:
    """Device types the loaded extension has kernels for (``["cpu"]``, ``["cpu", "cuda"]``)."""
    return list(load_native().built_devices())


def _fake_registered() -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key("zerofast::gather_cast", "Meta")


def _register_fake() -> None:
    # These ops only write into their outputs (or a file), so their fake kernels have nothing to
    # compute; having them lets FakeTensor tracing (torch.compile, opcheck) pass through them.
    torch.library.register_fake("zerofast::gather_cast")(lambda sources, segments, out, stream_sources=False: None)
    torch.library.register_fake("zerofast::read_cast")(lambda sources, fds, offsets, segments, outs: None)
    torch.library.register_fake("zerofast::read_cast_to_file")(
        lambda sources, fds, offsets, segments, out_fd, out_offsets, out_numels, out_dtype: None)
    # read_cast_new has none: its output shapes are the values of its `dims` tensor, data that a
    # fake tensor does not carry.


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` as a place the executor can run, or a :class:`DeviceError` that says what is missing."""
    device = torch.device(device)
    if device.type == "cpu":
        return device
    if device.type not in DEVICE_TYPES:
        raise DeviceError(f"device={str(device)!r}: zerofast runs on {' or '.join(map(repr, DEVICE_TYPES))}")
    if not getattr(torch, device.type).is_available():
        raise DeviceError(f"device={str(device)!r}: this torch ({torch.__version__}) sees no {device.type.upper()} GPU")
    if native_enabled() and device.type not in built_devices():
        raise NativeExtensionError(
            f"zerofast's native extension was built without its {device.type.upper()} kernels (torch without "
            f"{device.type.upper()}, or no nvcc when it was built); rebuild it with nvcc on the PATH: "
            "`zerofast build` (FORCE_CUDA=1 to insist)")
    return device


def gather_cast(sources: Sequence[torch.Tensor], segments: torch.Tensor, out: torch.Tensor,
                stream_sources: bool = False) -> None:
    """See the schema in csrc/zerofast.cpp. ``stream_sources`` only changes memory behaviour."""
    if not native_enabled():
        reference.gather_cast(sources, segments, out)
        return
    load_native()
    torch.ops.zerofast.gather_cast(list(sources), segments, out, stream_sources)


def read_cast(sources: Sequence[torch.Tensor], source_fds: Sequence[int], source_offsets: torch.Tensor,
              segments: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
    """See the schema in csrc/zerofast.cpp."""
    if not native_enabled():
        reference.read_cast(sources, source_fds, source_offsets, segments, outs)
        return
    load_native()
    with _os_errors():
        torch.ops.zerofast.read_cast(list(sources), list(source_fds), source_offsets, segments, list(outs))


def read_cast_new(sources: Sequence[torch.Tensor], source_fds: Sequence[int], source_offsets: torch.Tensor,
                  segments: torch.Tensor, dims: torch.Tensor, ranks: torch.Tensor,
                  dtype: torch.dtype) -> list[torch.Tensor]:
    """See the schema in csrc/zerofast.cpp."""
    if not native_enabled():
        return reference.read_cast_new(sources, source_fds, source_offsets, segments, dims, ranks, dtype)
    load_native()
    with _os_errors():
        return torch.ops.zerofast.read_cast_new(list(sources), list(source_fds), source_offsets, segments, dims,
                                                ranks, dtype)


def read_cast_to_file(sources: Sequence[torch.Tensor], source_fds: Sequence[int], source_offsets: torch.Tensor,
                      segments: torch.Tensor, out_fd: int, out_offsets: torch.Tensor, out_numels: torch.Tensor,
                      out_dtype: torch.dtype) -> None:
    """See the schema in csrc/zerofast.cpp. A failed read or write raises OSError, as Python's would."""
    if not native_enabled():
        reference.read_cast_to_file(sources, source_fds, source_offsets, segments, out_fd, out_offsets, out_numels,
                                    out_dtype)
        return
    load_native()
    with _os_errors():
        torch.ops.zerofast.read_cast_to_file(list(sources), list(source_fds), source_offsets, segments, out_fd,
                                             out_offsets, out_numels, out_dtype)


_ERRNO = re.compile(r"^zerofast: (.*) \[errno (\d+)\]$", re.M)


@contextmanager
def _os_errors():
    # The kernels tag I/O failures with their errno, so callers can handle a full disk or a
    # file-size limit as they would from os.write.
    try:
        yield
    except RuntimeError as e:
        m = _ERRNO.search(str(e))
        if m is None:
            raise
        raise OSError(int(m.group(2)), m.group(1)) from None
