"""Every environment variable the native core reads, read in one function (see the README's
"Install" section). Nothing here imports torch, so ``zerofast --version`` can use it."""
from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

from ..errors import NativeExtensionError

# ZEROFAST_NATIVE's values -> the mode they select.
MODES = {"auto": "auto", "": "auto", "1": "required", "0": "off"}


class NativeSettings(NamedTuple):
    mode: str  # "auto": native, else the reference with one warning; "required": an error instead; "off"
    cache_dir: Path  # built cores live in cache_dir / "native"
    cxx: str  # the compiler torch's builder calls (it reads CXX itself; this is for the checks)
    force_cuda: bool  # compile the CUDA kernels even where torch has no CUDA or nvcc is not found
    cuda_arch_list: str | None  # TORCH_CUDA_ARCH_LIST: which GPUs the CUDA kernels are built for


def settings() -> NativeSettings:
    env = os.environ
    raw = env.get("ZEROFAST_NATIVE", "auto").strip().lower()
    if raw not in MODES:
        raise NativeExtensionError(f"ZEROFAST_NATIVE={raw!r}: expected 1 (native core required), 0 (pure-torch "
                                   "reference) or auto (native, else the reference with a warning)")
    cache = env.get("ZEROFAST_CACHE_DIR") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "zerofast")
    return NativeSettings(mode=MODES[raw], cache_dir=Path(cache), cxx=env.get("CXX") or "c++",
                          force_cuda=env.get("FORCE_CUDA", "0") == "1",
                          cuda_arch_list=env.get("TORCH_CUDA_ARCH_LIST") or None)
