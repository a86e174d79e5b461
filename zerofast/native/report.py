"""What ``zerofast --version`` prints (without importing torch, so it answers at once) and what
``zerofast doctor`` adds (it imports torch and loads, or builds, the native core)."""
from __future__ import annotations

import os
import platform
import sys

from ..errors import NativeExtensionError
from . import cache
from .cache import Unavailable
from ..settings import settings


def version_lines(zerofast_version: str) -> list[str]:
    return [f"zerofast {zerofast_version}", f"torch {_torch_version()}", f"python {_python()}",
            f"native core: {_core_line()}", f"threads: {_threads()}"]


def _torch_version() -> str:
    try:
        identity = cache.torch_identity()
    except Unavailable:
        return "not installed"
    return f"{identity['__version__']} ({'CUDA ' + identity['cuda'] if identity['cuda'] else 'CPU only'})"


def _python() -> str:
    return f"{platform.python_version()} ({sys.implementation.name}, {sys.platform} {platform.machine()})"


def _core_line() -> str:
    """The core this process would load, read from the cache: nothing is loaded or compiled here."""
    try:
        s = settings()
        if s.mode == "off":
            return "off (ZEROFAST_NATIVE=0: the pure-torch reference runs)"
        built = cache.built_cores(s)
        if built:
            core, manifest = built[0]
            return (f"built for {', '.join(manifest.get('devices', ['?']))} (torch {manifest.get('torch')}), "
                    f"loaded on first use from {cache.library(core)}")
        cache.preflight(s)
        failed = _earlier_failure(s)
        if failed:
            return f"not available ({failed})"
    except (Unavailable, NativeExtensionError) as e:
        return f"not available ({e})"
    return "not built yet: it is built on first use, once per torch version (`zerofast build` does it now)"


def _earlier_failure(s) -> str | None:
    tag_dir = cache.tag_dir(s, cache.core_tag(cache.sources_dir(), cache.torch_identity()))
    for marker in sorted(tag_dir.glob("*.failed.json")):
        reason = cache.failure(marker.with_name(marker.name.removesuffix(".failed.json")), s)
        if reason:
            return reason
    return None


def _threads() -> str:
    omp = os.environ.get("OMP_NUM_THREADS")
    if omp:
        return f"{omp} (OMP_NUM_THREADS)"
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{n} (the CPUs this process may use: torch's default intra-op pool; OMP_NUM_THREADS sets it)"


def doctor_lines(zerofast_version: str) -> list[str]:
    """The version lines, then the core as loaded (built if needed), the toolchain and the devices."""
    import shutil

    import torch

    from .loader import load, unavailable_reason, wanted_devices

    lines = version_lines(zerofast_version)[:3]
    s = settings()
    try:
        loaded = load(required=True, progress=True)
        m = loaded.manifest
        lines.append(f"native core: loaded from {loaded.path}, kernels for {', '.join(loaded.module.built_devices())} "
                     f"(built for torch {m.get('torch')} in {m.get('seconds')} s on {m.get('built')})")
    except NativeExtensionError:
        lines.append(f"native core: not available ({unavailable_reason()}); the ops run on the pure-torch reference")
    devices, archs = wanted_devices(s)
    lines += [f"threads: {torch.get_num_threads()} intra-op, {torch.get_num_interop_threads()} inter-op",
              f"mode: ZEROFAST_NATIVE={s.native!r} -> {s.mode}",
              f"cache: {s.cache_dir / 'native'}",
              f"compiler: {_tool_version(cache.compiler(s))}",
              f"ninja: {_tool_version(shutil.which('ninja', path=cache.tool_path()))}",
              f"nvcc: {_tool_version(shutil.which('nvcc'))}",
              f"kernels wanted: {', '.join(devices)}" + (f" (CUDA archs {archs})" if archs else
                                                          " (CUDA needs a CUDA torch and nvcc, or FORCE_CUDA=1)"),
              f"GPUs: {_gpus(torch)}",
              f"package: {os.path.dirname(cache.PACKAGE)} (sources: {_sources()})"]
    return lines


def _tool_version(path: str | None) -> str:
    import subprocess

    if path is None:
        return "not found"
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{path} (does not run: {e})"
    first = next((ln for ln in (done.stdout or done.stderr).splitlines() if ln.strip()), "")
    return f"{path} ({first.strip()})" if done.returncode == 0 else f"{path} (exits with {done.returncode})"


def _gpus(torch) -> str:
    if not torch.cuda.is_available():
        return "none visible to torch"
    return ", ".join(f"{torch.cuda.get_device_name(i)} (sm_{''.join(map(str, torch.cuda.get_device_capability(i)))})"
                     for i in range(torch.cuda.device_count()))


def _sources() -> str:
    try:
        return str(cache.sources_dir())
    except Unavailable as e:
        return str(e)
