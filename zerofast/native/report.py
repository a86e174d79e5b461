"""What ``zerofast --version`` prints (without importing torch, so it answers at once) and what
``zerofast doctor`` adds (it imports torch and loads, or builds, the native core)."""
from __future__ import annotations

import json
import os
import platform
import sys

from ..base.errors import NativeExtensionError
from . import cache, proof, toolchain
from .cache import Unavailable
from ..base.settings import settings


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
    """The core this process would load, read from the cache: nothing is loaded or compiled here.
    As the loader does, the compilers are taken in turn (CXX first): the first one's built core,
    else its earlier failure or why it cannot run, then the next."""
    try:
        s = settings()
        if s.mode == "off":
            return "off (ZEROFAST_NATIVE=0: the pure-torch reference runs)"
        identity = cache.torch_identity()
        floor = cache.torch_floor_problem(identity)
        if floor:
            return f"not available ({floor})"
        tag = cache.core_tag(cache.sources_dir(), identity)
        packaged, mismatch = cache.prebuilt(tag)
        if packaged is not None:
            return f"prebuilt, shipped in this package for torch >= {cache.floor_text()} (built with torch " \
                   f"{cache.read_manifest(packaged).get('torch')}; nothing to compile), loaded on first use from " \
                   f"{cache.library(packaged)}"
        tag_dir = cache.tag_dir(s, tag)
        reasons = []
        for i, cxx in enumerate(toolchain.compiler_candidates(s, cache.compiler_path())):
            built = _built_by(tag_dir, toolchain.compiler_key(cxx))
            if built:
                core, manifest = built
                return (f"built here for {', '.join(manifest.get('devices', ['?']))} (with torch {manifest.get('torch')}, "
                        f"for torch >= {manifest.get('stable_torch')}), "
                        f"loaded on first use from {cache.library(core)}" + (f" ({mismatch})" if mismatch else ""))
            reasons.append((cxx, _why_not(tag_dir, cxx, s, asked=i == 0)))
            if reasons[-1][1] is None:
                return ("not built yet: it is built on first use, once for every torch >= "
                        f"{cache.floor_text()} (`zerofast build` does it now)"
                        + (f"; {mismatch}" if mismatch else ""))
    except (Unavailable, NativeExtensionError) as e:
        return f"not available ({e})"
    if len(reasons) == 1:
        return f"not available ({reasons[0][1]})"
    return "not available (no C++ compiler gave a sound core: " + "; ".join(f"{c}: {w}" for c, w in reasons) + ")"


def _built_by(tag_dir, key: str):
    """The complete core of the compiler named ``key``, most devices first, or None."""
    found = [(d, m) for d in sorted(tag_dir.glob(f"*@{key}*")) if d.is_dir() and cache.compiler_key_of(d) == key
             and (m := cache.read_manifest(d)) and not cache.unfit_for(m, cache.torch_identity()["__version__"])]
    return max(found, key=lambda dm: len(dm[1].get("devices", [])), default=None)


def _why_not(tag_dir, cxx: str, s, asked: bool) -> str | None:
    """Why ``cxx`` gives no CPU core (its recorded failure, or it does not run), or None: it would
    build. The compiler ``asked`` for (CXX) not running is final, as for the loader."""
    cache.preflight_environment(s)
    failed = cache.failure(tag_dir / f"cpu@{toolchain.compiler_key(cxx)}", s, cxx)
    if failed:
        return failed
    try:
        cache.preflight_compiler(cxx)
    except Unavailable as e:
        if asked:
            raise
        return str(e)
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

    from .cudaplan import find_nvcc, wanted_devices
    from .loader import load, unavailable_reason

    lines = version_lines(zerofast_version)[:3]
    s = settings()
    try:
        loaded = load(required=True, progress=True)
        m = loaded.manifest
        origin = "prebuilt, shipped in this package" if m.get("prebuilt") else "built here"
        lines.append(f"native core: {origin}, loaded from {loaded.path}, kernels for "
                     f"{', '.join(proof.kernel_devices())} (built with torch {m.get('torch')} for torch >= "
                     f"{m.get('stable_torch')}, in "
                     f"{m.get('seconds')} s on {m.get('built')})")
        lines += _proof_lines(loaded)
    except NativeExtensionError:
        lines.append(f"native core: not available ({unavailable_reason()}); the ops run on the pure-torch reference")
    devices, archs = wanted_devices(s)
    lines += [f"threads: {torch.get_num_threads()} intra-op, {torch.get_num_interop_threads()} inter-op",
              f"mode: ZEROFAST_NATIVE={s.native!r} -> {s.mode}",
              f"cache: {s.cache_dir / 'native'}",
              f"compiler: {_tool_version(cache.compiler(s))}",
              f"ninja: {_tool_version(shutil.which('ninja', path=cache.tool_path()))}",
              f"nvcc: {_tool_version(find_nvcc(s))}"
              + ("" if s.cuda_kernels else " (not used: ZEROFAST_CUDA_KERNELS=0)"),
              f"kernels wanted: {', '.join(devices)}" + (f" (CUDA archs {archs})" if archs else
                                                          " (CUDA needs a CUDA torch and nvcc, or FORCE_CUDA=1)"),
              *_rejected(s),
              f"GPUs: {_gpus(torch)}",
              f"package: {os.path.dirname(cache.PACKAGE)} (sources: {_sources()})"]
    return lines


def _proof_lines(loaded) -> list[str]:
    """What the core was built with, what it links and what its checks found (see :mod:`.proof`)."""
    m = loaded.manifest
    problem = toolchain.linkage_problem(str(loaded.path))
    checked = m.get("checked", [])
    pending = [d for d in proof.kernel_devices() if d not in checked]
    return [f"core compiler: {m.get('compiler')} ({m.get('compiler_version') or '?'})",
            f"core linkage: {problem or 'links ' + toolchain.LIBSTDCXX + ' (' + _process_libstdcxx() + ')'}",
            f"core check: an op's bad-argument error arrives whole ({proof.EXPECTED!r}) on "
            f"{', '.join(checked) or 'no device'}" + (f"; {', '.join(pending)} is checked at its first call (no GPU "
                                                      "was visible at build time)" if pending else "")]


def _process_libstdcxx() -> str:
    """Where this process's libstdc++ was loaded from (torch loaded it), from /proc/self/maps."""
    try:
        with open("/proc/self/maps") as f:
            hit = next((ln.split()[-1] for ln in f if ln.rstrip().endswith("/" + toolchain.LIBSTDCXX)
                        or "/libstdc++.so.6." in ln), None)
    except OSError:
        hit = None
    return f"the process's: {hit}" if hit else "the process's"


def _rejected(s) -> list[str]:
    """One line per compiler whose core failed to build or was found unsound, from the cache."""
    tag_dir = cache.tag_dir(s, cache.core_tag(cache.sources_dir(), cache.torch_identity()))
    lines = []
    for marker in sorted(tag_dir.glob("*.failed.json")):
        try:
            record = json.loads(marker.read_text())
        except (OSError, ValueError):
            continue
        lines.append(f"not used: {marker.name.removesuffix('.failed.json')} by {record.get('compiler')}: "
                     f"{record.get('reason')}")
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
