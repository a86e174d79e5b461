"""Find the native core for the running torch in the cache, build it there on first use, load it.

One process builds while the others wait on the lock (and then load what it built). A build that
cannot start (no compiler, no ninja, not Linux) or that fails makes the core unavailable: in the
default mode (``ZEROFAST_NATIVE`` unset or ``auto``) the ops then run on the pure-torch
reference, with one warning line; ``ZEROFAST_NATIVE=1`` makes it a :class:`NativeExtensionError`.
A failed build is remembered for its compiler, so later processes do not compile again to fail
again; ``zerofast build`` retries.

A core is proven sound before it is cached (:mod:`.proof`); where the compiler asked for (CXX,
default ``c++``) gives none, or fails, the next C++ compiler is tried
(:func:`.toolchain.compiler_candidates`), and only where none gives a sound core do the ops run
on the reference. Finding a built core touches no CUDA (:mod:`.cudaplan`): a CPU-only call on a
GPU node initializes no CUDA context.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, NamedTuple

from ..base.errors import NativeExtensionError, first_line
from . import build as build_child, cache, cudaplan, proof, toolchain, torch_kit
from .cache import Unavailable
from .cudaplan import wanted_devices
from ..base.settings import Settings, settings

# Measured with benchmarks/startup.py (fresh processes, median of 5; see the README): an export
# 3.4x slower on the reference, an eager reconstruct about as fast (0.7x) on 2 cores.
SLOWDOWN = "exports about 3x slower"
# The first build of the CPU core compiles two translation units (cache.write_units): about 23 s
# of CPU time for the longer one on this project's 2-core machines, so about half a minute there.
BUILD_TIME = "about half a minute on 2 cores"


class Loaded(NamedTuple):
    module: object  # the extension module: torch_version() and the readers of csrc/load
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


NOT_SOUND = "its core is not sound: "  # how a recorded unsound core's reason starts


class Earlier(Unavailable):
    """A failure an earlier process recorded for this core and compiler: not said again."""


class BuildFailed(Unavailable):
    """The build ran in this process and gave no core."""


class UnsoundBuild(BuildFailed):
    """The build child's core is not sound (:mod:`.build` raised its ``CoreNotSound``, or crashed
    checking it): its compiler is passed over for every device set."""


class Environment(Unavailable):
    """Missing whatever compiler is used (the platform, ninja, Python.h): no other one is tried."""


class NoCompiler(Unavailable):
    """The compiler is not there or does not run. For the one asked for (CXX, default ``c++``)
    that is final: the next compilers stand in for one that builds an unsound core, not for none."""


class Job(NamedTuple):
    s: Settings
    progress: bool
    force: bool
    retry: bool
    failures: list  # "compiler: why" for each compiler that gave no core, for the fallback's notes
    prebuilt: str | None = None  # why the package's prebuilt core does not fit, said before a build


def find_or_build(s: Settings, progress: bool, force: bool = False, retry: bool = False) -> Loaded:
    """The wheel's prebuilt core where it fits, else the first core that loads from the compilers in
    turn (CXX first), building it where needed."""
    identity = cache.torch_identity()
    floor = cache.torch_floor_problem(identity)
    if floor:
        raise Unavailable(floor)
    tag = cache.core_tag(cache.sources_dir(), identity)
    wanted = wanted_devices(s)
    packaged, mismatch = cache.prebuilt(tag)
    if packaged is not None and not force and set(wanted[0]) <= set(cache.read_manifest(packaged)["devices"]):
        return import_core(packaged)
    tag_dir = cache.tag_dir(s, tag)
    job = Job(s, progress, force, retry, [], mismatch)
    for i, cxx in enumerate(toolchain.compiler_candidates(s, cache.compiler_path())):
        try:
            return _with_compiler(tag_dir, cxx, wanted, job)
        except Environment:
            raise
        except NoCompiler:
            if i == 0:
                raise
            continue  # a PATH entry that does not run: not worth a line
        except Unavailable as e:
            job.failures.append((cxx, str(e)))
            if isinstance(e, BuildFailed):  # said once, by the process that found it
                _note(f"zerofast: warning: {cxx} gave no sound core ({e}); trying the next C++ compiler")
    if len(job.failures) == 1:
        raise Unavailable(job.failures[0][1])
    raise Unavailable("no C++ compiler gave a sound core: " + "; ".join(f"{c}: {why}" for c, why in job.failures))


def _with_compiler(tag_dir: Path, cxx: str, wanted: tuple, job: Job) -> Loaded:
    """The core of ``cxx``: with the CUDA kernels where they are wanted, else (or where they fail)
    for the CPU alone."""
    devices, archs = wanted
    candidates = [wanted] if devices == ("cpu",) else [wanted, (("cpu",), None)]
    key = toolchain.compiler_key(cxx)
    for devices, archs in candidates:
        nvcc = cudaplan.nvcc_key(job.s) if "cuda" in devices else None
        core = tag_dir / cache.core_name(devices, archs, key, nvcc)
        try:
            return _find_or_build_one(core, devices, archs, cxx, job)
        except (UnsoundBuild, Environment, NoCompiler):
            raise
        except Unavailable as e:
            if devices == ("cpu",):
                raise
            if not isinstance(e, Earlier):
                _note(f"zerofast: the CUDA kernels are not built ({e}); building the native core for the CPU only: "
                      "device=\"cuda\" runs on torch's own GPU operations")
    raise AssertionError("unreachable: the CPU-only candidate comes last")


def _find_or_build_one(core: Path, devices: tuple[str, ...], archs: str | None, cxx: str, job: Job) -> Loaded:
    if not job.force and cache.read_manifest(core):
        return import_core(core)
    reason = None if job.force else cache.failure(core, job.s, cxx, job.retry)
    if reason:
        again = "`zerofast build --force` builds it again" if reason.startswith(NOT_SOUND) else \
            "`zerofast build` retries"
        raise Earlier(f"{reason}; that was an earlier build with the same compiler: {again}")
    try:
        cache.preflight_environment(job.s)
    except Unavailable as e:
        raise Environment(str(e)) from None
    try:
        cxx = cache.preflight_compiler(cxx)
    except Unavailable as e:
        raise NoCompiler(str(e)) from None
    if "cuda" in devices:
        _check_nvcc(core, cxx, job.s)
    with _locked(core):
        if job.force or not cache.read_manifest(core):  # else another process built it while we waited
            _run_build(core, devices, archs, cxx, job)
    return import_core(core)


def _check_nvcc(core: Path, cxx: str, s: Settings) -> None:
    """nvcc that cannot build for this torch (missing, not running, another CUDA major): recorded,
    so that later processes go to the CPU core without running it again."""
    import torch

    problem = cudaplan.nvcc_problem(s, torch.version.cuda)
    if problem:
        cache.record_failure(core, s, problem, cxx)
        raise Unavailable(problem)


def import_core(core: Path) -> Loaded:
    path = cache.library(core)
    spec = importlib.util.spec_from_file_location(cache.EXTENSION_NAME, path)
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as e:
        raise Unavailable(f"{path} does not load ({first_line(e)})") from e
    manifest = cache.read_manifest(core) or {}
    verify(manifest)
    kit = torch_kit.objects()
    if kit is not None:  # else the native readers decline every file and the Python reference reads it
        module.bind_torch(kit)
    sys.modules[cache.EXTENSION_NAME] = module
    return Loaded(module, path, manifest)


def verify(manifest: dict) -> None:
    """The core must serve the running torch (:func:`.cache.unfit_for`)."""
    import torch

    problem = cache.unfit_for(manifest, torch.__version__)
    if problem:
        raise Environment(problem)


def device_problem(device: str) -> str | None:
    """Why the loaded core's ``device`` kernels are not sound, or None. Where its build saw no such
    device (a GPU node's core built where no GPU was visible), the op check runs here, at the first
    call for it: once per core (the answer is kept in its folder), in a child process, so that a
    kernel that crashes takes only the child down. A core found wanting warns once (ZEROFAST_NATIVE=1:
    an error), and the device's kernels are not used (:func:`unsound_devices`)."""
    state = _state
    if not isinstance(state, Loaded) or device in state.manifest.get("checked", [device]):
        return None
    with _LOCK:
        if device not in _checked:
            _checked[device] = _recorded_check(state.path.parent, device)
            if _checked[device]:
                _unsound_kernels(device, _checked[device])
    return _checked[device]


def unsound_devices() -> set[str]:
    """The devices whose kernels in the loaded core failed their check in this process."""
    return {d for d, problem in _checked.items() if problem}


_checked: dict[str, str | None] = {}  # device -> why its kernels are not sound (None: they are)


def _recorded_check(core: Path, device: str) -> str | None:
    record = core / f"checked-{device}.json"
    try:
        return json.loads(record.read_text())["problem"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    verdict, problem = _check_in_child(core, device)
    if verdict:
        try:
            tmp = record.with_name(f"{record.name}.{os.getpid()}")
            tmp.write_text(json.dumps({"problem": problem}))
            tmp.replace(record)
        except OSError:  # a cache shared read-only: the verdict stands for this process alone
            pass
    return problem


def _check_in_child(core: Path, device: str) -> tuple[bool, str | None]:
    """(whether it is the core's verdict, why it is not sound or None) from :mod:`.proof` run in a
    child. A check that could not run (no memory, a busy GPU) is no verdict: it is not kept."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(cache.PACKAGE.parent), os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, "-m", "zerofast.native.proof", str(core), device], capture_output=True,
                          text=True, env=env, errors="replace", timeout=600)
    if done.returncode == 0:
        return True, None
    if done.returncode < 0:
        return True, f"its {device} op crashed its check ({_signal_name(-done.returncode)})"
    if done.returncode == proof.UNSOUND:
        return True, done.stdout.strip().splitlines()[-1][len(proof.MARK):]
    return False, f"its {device} op check did not run ({(done.stderr.strip().splitlines() or ['no output'])[-1]})"


def _unsound_kernels(device: str, problem: str) -> None:
    message = f"the native core's {device.upper()} kernels are not sound ({problem})"
    if settings().mode == "required":
        raise NativeExtensionError(message + "; ZEROFAST_NATIVE=1 requires them")
    _note(f"zerofast: warning: {message}; device={device!r} runs on torch's own operations instead")


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


def _run_build(core: Path, devices: tuple[str, ...], archs: str | None, cxx: str, job: Job) -> None:
    import torch

    for stale in core.parent.glob(f".{core.name}.*-*"):  # left by a killed build; we hold the lock
        shutil.rmtree(stale, ignore_errors=True)
    once = (f"once for torch {torch.__version__}" if "cuda" in devices else
            f"once for every torch >= {cache.floor_text()}")
    _note(f"zerofast: building the native core with torch {torch.__version__} ({'+'.join(devices)}"
          f"{', CUDA archs ' + archs if archs else ''}) with {cxx} in {core}: {once}, {BUILD_TIME}")
    if job.prebuilt:
        _note(f"zerofast: {job.prebuilt}")
    start = time.monotonic()
    log = core.with_name(core.name + ".build.log")
    returncode = run_build_child(core, devices, build_env(cxx, archs, "cuda" in devices, job), log, job.progress)
    if returncode != 0:
        _failed(core, cxx, job.s, returncode, log)
    cache.clear_failure(core)
    _note(f"zerofast: built the native core in {time.monotonic() - start:.0f} s")


def build_env(cxx: str, archs: str | None, cuda: bool, job: Job) -> dict:
    """The build child's environment: the compiler, ninja on the PATH, nvcc's host compiler and toolkit."""
    env = dict(os.environ, PATH=cache.tool_path(), CXX=cxx,
               PYTHONPATH=os.pathsep.join(p for p in (str(cache.PACKAGE.parent), os.environ.get("PYTHONPATH")) if p))
    if cuda and (job.failures or "CC" not in env):  # nvcc's host compiler (torch passes CC as -ccbin)
        env["CC"] = cxx
    if cuda and cudaplan.toolkit_home(job.s):  # an nvcc wrapper's toolkit, whose headers torch would miss
        env["CUDA_HOME"] = cudaplan.toolkit_home(job.s)
    if archs:
        env["TORCH_CUDA_ARCH_LIST"] = archs
    return env


def run_build_child(core: Path, devices: tuple[str, ...], env: dict, log: Path, progress: bool) -> int:
    """Run :mod:`.build` for ``core``, its output into ``log`` and, condensed, to stderr: its exit status."""
    cmd = [sys.executable, "-m", "zerofast.native.build", str(core), ",".join(devices)]
    with open(log, "w") as out, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                                 env=env, errors="replace") as child:
        for line in child.stdout:
            out.write(line)
            step = build_child.progress_line(line) if progress else None
            if step:
                _note(step)
    return child.returncode


def _failed(core: Path, cxx: str, s: Settings, returncode: int, log: Path) -> None:
    """Record and raise why the build child failed: an unsound core (it says why), a crash while
    loading or checking the new core (a signal), or a failed compile."""
    if returncode == proof.UNSOUND or returncode < 0:
        said = _unsound_line(log) if returncode > 0 else f"it crashed its check ({_signal_name(-returncode)})"
        reason = f"{NOT_SOUND}{said} (log: {log})"
        cache.record_failure(core, s, reason, cxx, kind="unsound")
        raise UnsoundBuild(reason)
    reason = f"the build failed: {build_child.failure_line(log)} (compiler {cxx}; log: {log})"
    cache.record_failure(core, s, reason, cxx)
    raise BuildFailed(reason)


def _unsound_line(log: Path) -> str:
    lines = log.read_text(errors="replace").splitlines()
    return next((ln[len(proof.MARK):] for ln in reversed(lines) if ln.startswith(proof.MARK)), "no reason given")


def _signal_name(number: int) -> str:
    import signal

    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


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
