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
from .errors import NativeExtensionError

_BUILD_HINT = "build it with `pip install --no-build-isolation -e .` (or `make build`) in the zerofast checkout"
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
    _loaded = True


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` as a place the executor can run, or an error that says what is missing."""
    device = torch.device(device)
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise NotImplementedError(f"device={str(device)!r}: zerofast runs on 'cpu' or 'cuda'")
    if not torch.cuda.is_available():
        raise RuntimeError(f"device={str(device)!r}: this torch ({torch.__version__}) sees no CUDA GPU")
    if native_enabled():
        load_native()
        from . import _C

        if not _C.cuda_built():
            raise NativeExtensionError(
                "zerofast's native extension was built without its CUDA kernels (torch without CUDA, or no nvcc "
                "at build time); rebuild it with `FORCE_CUDA=1 pip install --no-build-isolation -e .`")
    return device


def gather_cast(sources: Sequence[torch.Tensor], segments: torch.Tensor, out: torch.Tensor,
                stream_sources: bool = False) -> None:
    """See the schema in csrc/zerofast.cpp. ``stream_sources`` only changes memory behaviour."""
    if not native_enabled():
        reference.gather_cast(sources, segments, out)
        return
    load_native()
    torch.ops.zerofast.gather_cast(list(sources), segments, out, stream_sources)
