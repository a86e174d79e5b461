"""Find the native core for the running torch in the cache, build it there on first use, load it.

One process builds while the others wait on the lock (and then load what it built). A build that
cannot start (no compiler, no ninja, not Linux) or that fails makes the core unavailable: in the
default mode (``ZEROFAST_NATIVE`` unset or ``auto``) the ops then run on the pure-torch
reference, with one warning line; ``ZEROFAST_NATIVE=1`` makes it a :class:`NativeExtensionError`.
A failed build is remembered for its compiler, so later processes do not compile again to fail
again; ``zerofast build`` retries.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, NamedTuple

from ..errors import NativeExtensionError, first_line
from . import cache
from .cache import Unavailable
from ..settings import Settings, settings

# Measured with benchmarks/startup.py (fresh processes, median of 5; see the README): an export
# 3.4x slower on the reference, an eager reconstruct about as fast (0.7x) on 2 cores.
SLOWDOWN = "exports about 3x slower"
# The first build compiles three C++ files (plus two CUDA ones with the CUDA kernels): 141 to
# 306 s measured on 2 busy cores.
BUILD_TIME = "a few minutes"
# What CUDA torch builds for when neither TORCH_CUDA_ARCH_LIST nor a visible GPU says:
# CUDA 13 dropped the GPUs before Turing (sm_75).
DEFAULT_ARCHS = {13: "7.5;8.0;8.6;8.9;9.0;10.0;12.0+PTX", 12: "7.0;7.5;8.0;8.6;8.9;9.0+PTX",
                 11: "7.0;7.5;8.0;8.6+PTX"}


class Loaded(NamedTuple):
    module: object  # the extension module: torch_version(), built_devices()
    path: Path  # the shared library it was loaded from
    manifest: dict  # what build.py recorded: torch, devices, CUDA archs, build time


_state: Loaded | str | None = None  # the loaded core, or why it is unavailable; None: not tried yet
_warned = False
# Loading the library twice registers its ops twice, which aborts the process: threads that ask
# for the core at once (the rank-file reading pool) wait for the first to load it.
_LOCK = threading.RLock()


def load(required: bool = False, progress: bool | None = None) -> Loaded | None:
    """The native core, building it on first use; None where the ops should run on the reference.

    ``required`` (and ``ZEROFAST_NATIVE=1``) turns an unavailable core into a
    :class:`NativeExtensionError`; otherwise it is said once on stderr."""
    state = _state  # once loaded it stays: the ops of every file read need no lock to find it
    if isinstance(state, Loaded) and (required or settings().mode != "off"):
        return state
    with _LOCK:
        return _load(required, progress)


def _load(required: bool, progress: bool | None) -> Loaded | None:
    global _state
    s = settings()
    if s.mode == "off" and not required:
        return None
    if _state is None:
        try:
            _state = find_or_build(s, progress=_is_tty(sys.stderr) if progress is None else progress)
        except Unavailable as e:
            _state = str(e)
    if isinstance(_state, Loaded):
        return _state
    if required or s.mode == "required":
        raise NativeExtensionError(f"zerofast's native core is not available ({_state})"
                                   + ("; ZEROFAST_NATIVE=1 requires it" if s.mode == "required" else ""))
    _warn_once(_state)
    return None


def unavailable_reason() -> str | None:
    """Why the last attempt in this process found no core (None if it found one or none was made)."""
    return _state if isinstance(_state, str) else None


def build(force: bool = False) -> Loaded:
    """``zerofast build``: build the core for this torch now unless it is built, showing each step,
    and load it. An earlier failure is retried; ``force`` rebuilds a core that is there."""
    with _LOCK:
        return _build(force)


def _build(force: bool) -> Loaded:
    global _state
    if isinstance(_state, Loaded) and not force:
        return _state
    try:
        _state = find_or_build(settings(), progress=True, force=force, retry=True)
    except Unavailable as e:
        _state = str(e)
        raise NativeExtensionError(f"zerofast's native core could not be built ({e})") from None
    return _state


def find_or_build(s: Settings, progress: bool, force: bool = False, retry: bool = False) -> Loaded:
    tag_dir = cache.tag_dir(s, cache.core_tag(cache.sources_dir(), cache.torch_identity()))
    wanted = wanted_devices(s)
    candidates = [wanted] if wanted[0] == ("cpu",) else [wanted, (("cpu",), None)]
    for devices, archs in candidates:
        core = tag_dir / cache.device_tag(devices, archs)
        try:
            return _find_or_build_one(core, devices, archs, s, progress, force, retry)
        except Unavailable as e:
            if devices == ("cpu",):
                raise
            _note(f"zerofast: warning: the CUDA kernels did not build ({e}); building the native core for the "
                  "CPU only")
    raise AssertionError("unreachable: the CPU-only candidate comes last")


def _find_or_build_one(core: Path, devices: tuple[str, ...], archs: str | None, s: Settings,
                       progress: bool, force: bool, retry: bool) -> Loaded:
    if not force and cache.read_manifest(core):
        return import_core(core)
    cache.preflight(s)
    reason = None if force or retry else cache.failure(core, s)
    if reason:
        raise Unavailable(f"{reason}; that was an earlier build with the same compiler: `zerofast build` retries")
    with _locked(core):
        if force or not cache.read_manifest(core):  # else another process built it while we waited
            _run_build(core, devices, archs, s, progress)
    return import_core(core)


def wanted_devices(s: Settings) -> tuple[tuple[str, ...], str | None]:
    """The device kernels to compile, and the CUDA archs: CUDA only where torch has it and nvcc is
    found (or FORCE_CUDA=1), so a CPU-only torch never starts a CUDA build, nvcc or not."""
    import torch

    if not s.force_cuda:
        if torch.version.cuda is None:
            return ("cpu",), None
        from torch.utils.cpp_extension import CUDA_HOME

        if CUDA_HOME is None:
            return ("cpu",), None
    return ("cpu", "cuda"), cuda_archs(s)


def cuda_archs(s: Settings) -> str:
    """TORCH_CUDA_ARCH_LIST, else the visible GPUs' compute capabilities, else a default list (torch's
    builder alone raises an IndexError on a machine with nvcc and no GPU)."""
    if s.cuda_arch_list:
        return s.cuda_arch_list
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count():
        caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
        return ";".join(f"{major}.{minor}" for major, minor in caps)
    major = int((torch.version.cuda or "12").split(".")[0])
    return DEFAULT_ARCHS.get(major, DEFAULT_ARCHS[13 if major > 13 else 11])


def import_core(core: Path) -> Loaded:
    path = cache.library(core)
    spec = importlib.util.spec_from_file_location(cache.EXTENSION_NAME, path)
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as e:
        raise Unavailable(f"{path} does not load ({first_line(e)})") from e
    verify(module)
    sys.modules[cache.EXTENSION_NAME] = module
    return Loaded(module, path, cache.read_manifest(core) or {})


def verify(module) -> None:
    """The core's own record of the torch it was compiled against must be the running one."""
    import torch

    built_for = module.torch_version()
    if built_for != torch.__version__:
        raise Unavailable(f"the native core was built for torch {built_for} but torch {torch.__version__} is running")


@contextmanager
def _locked(core: Path) -> Iterator[None]:
    import fcntl  # here: Windows has none, and never gets this far (cache.preflight)

    core.parent.mkdir(parents=True, exist_ok=True)
    with open(core.with_name(core.name + ".lock"), "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _note(f"zerofast: waiting for another process that is building the native core in {core}")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _run_build(core: Path, devices: tuple[str, ...], archs: str | None, s: Settings, progress: bool) -> None:
    import torch

    for stale in core.parent.glob(f".{core.name}.*-*"):  # left by a killed build; we hold the lock
        shutil.rmtree(stale, ignore_errors=True)
    _note(f"zerofast: building the native core for torch {torch.__version__} ({'+'.join(devices)}"
          f"{', CUDA archs ' + archs if archs else ''}) in {core}: once per torch version, {BUILD_TIME}")
    start = time.monotonic()
    env = dict(os.environ, PATH=cache.tool_path(),
               PYTHONPATH=os.pathsep.join(p for p in (str(cache.PACKAGE.parent), os.environ.get("PYTHONPATH")) if p))
    if archs:
        env["TORCH_CUDA_ARCH_LIST"] = archs
    log = core.with_name(core.name + ".build.log")
    cmd = [sys.executable, "-m", "zerofast.native.build", str(core), ",".join(devices)]
    with open(log, "w") as out, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                                 env=env, errors="replace") as child:
        for line in child.stdout:
            out.write(line)
            step = progress_line(line) if progress else None
            if step:
                _note(step)
    if child.returncode != 0:
        reason = f"the build failed: {_failure_line(log)} (compiler {cache.compiler(s)}; log: {log})"
        cache.record_failure(core, s, reason)
        raise Unavailable(reason)
    cache.clear_failure(core)
    _note(f"zerofast: built the native core in {time.monotonic() - start:.0f} s")


_STEP = re.compile(r"^\[(\d+)/(\d+)\] (.*)")


def progress_line(line: str) -> str | None:
    """``[2/4] c++ ... -c .../csrc/cpu/read_cast.cpp -o ...`` -> ``zerofast: [2/4] compiled cpu/read_cast.cpp``
    (ninja prints a step when it is done, its output not being a terminal)."""
    m = _STEP.match(line)
    if not m:
        return None
    src = re.search(r" -c (\S+)", m.group(3)) or re.search(r" (\S+\.cu) ", m.group(3))
    what = f"compiled {_short_source(src.group(1))}" if src else "linked"
    return f"zerofast: [{m.group(1)}/{m.group(2)}] {what}"


def _short_source(path: str) -> str:
    parts = Path(path).parts
    return "/".join(parts[parts.index("csrc") + 1:]) if "csrc" in parts else Path(path).name


def _failure_line(log: Path) -> str:
    """The line of the build log that says what went wrong: the compiler's first error, else
    ninja's FAILED line, else the last line (torch's builder raising before ninja ran)."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    for pattern in (r"\berror\b:", r"^FAILED:"):
        hit = next((ln for ln in lines if re.search(pattern, ln)), None)
        if hit:
            return hit[:300]
    return lines[-1][:300] if lines else "no output"


def _warn_once(reason: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        _note(f"zerofast: warning: native core not available ({reason}); using the pure-torch reference: same "
              f"results, {SLOWDOWN} (ZEROFAST_NATIVE=1 makes this an error; `zerofast doctor` says more)")


def _note(line: str) -> None:
    print(" ".join(line.split()), file=sys.stderr, flush=True)


def _is_tty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
