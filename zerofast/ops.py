"""The only door to the native ops: ``torch.ops.zerofast.*``, or the reference when asked for.

The extension is loaded on first use, so ``import zerofast`` never fails for lack of it; the
first reconstruct does, with a :class:`NativeExtensionError` that says how to build it.
``ZEROFAST_NATIVE=0`` selects the pure-torch reference instead (slow; for debugging).
"""
from __future__ import annotations

import os
from typing import Sequence

import torch

from . import reference
from .errors import DeviceError, NativeExtensionError

_BUILD_HINT = "build it with `pip install --no-build-isolation -e .` (or `make build`) in the zerofast checkout"
# Device types the executor knows how to feed; the extension says which it was built with.
DEVICE_TYPES = ("cpu", "cuda")
_loaded = False


def native_enabled() -> bool:
    return os.environ.get("ZEROFAST_NATIVE", "1") != "0"


def load_native() -> None:
    """Import the compiled extension, registering ``torch.ops.zerofast``; check it fits this torch."""
    global _loaded
    if _loaded:
        return
    try:
        from . import _C
    except ImportError as e:
        raise NativeExtensionError(f"zerofast's native extension could not be loaded ({e}); {_BUILD_HINT}") from e
    built_for = _C.torch_version()
    if built_for != torch.__version__:
        raise NativeExtensionError(
            f"zerofast's native extension was built for torch {built_for} but torch {torch.__version__} is "
            f"running; rebuild it: {_BUILD_HINT}")
    if not _fake_registered():
        _register_fake()
    _loaded = True


def built_devices() -> list[str]:
    """Device types the loaded extension has kernels for (``["cpu"]``, ``["cpu", "cuda"]``)."""
    load_native()
    from . import _C

    return list(_C.built_devices())


def _fake_registered() -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key("zerofast::gather_cast", "Meta")


def _register_fake() -> None:
    # The op only writes into `out`, so its fake kernel has nothing to compute; having one lets
    # FakeTensor tracing (torch.compile, torch.library.opcheck) pass through the op.
    torch.library.register_fake("zerofast::gather_cast")(lambda sources, segments, out, stream_sources=False: None)


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
            f"{device.type.upper()}, or no compiler for it at build time); rebuild it with "
            "`FORCE_CUDA=1 pip install --no-build-isolation -e .`")
    return device


def gather_cast(sources: Sequence[torch.Tensor], segments: torch.Tensor, out: torch.Tensor,
                stream_sources: bool = False) -> None:
    """See the schema in csrc/zerofast.cpp. ``stream_sources`` only changes memory behaviour."""
    if not native_enabled():
        reference.gather_cast(sources, segments, out)
        return
    load_native()
    torch.ops.zerofast.gather_cast(list(sources), segments, out, stream_sources)
