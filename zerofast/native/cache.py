"""Where a built native core lives, and what it is built from, found without importing torch.

The CPU core is built on torch's stable C ABI (its op kernels) and CPython alone (its readers,
csrc/load/), so one build serves every torch from :data:`STABLE_TARGET` on. A core is kept in
``<cache>/native/<tag>/<devices>@<compiler>/``: the tag names that floor, the Python ABI, the
machine, the link flags and a hash of every source under ``csrc/``, so a core is never loaded by a
Python or sources it was not built for, and a new torch finds the core an older one built.
``<devices>`` is ``cpu`` or, with the CUDA kernels, ``cpu+cuda-<archs>``; ``<compiler>`` names the
C++ compiler (:func:`.toolchain.compiler_key`) and, with the CUDA kernels, nvcc and the torch build:
the CUDA kernels use torch's full C++ API, so such a core serves the torch build it was built by
only. Next to it: ``<core>.lock`` (held while building), ``<core>.build.log`` and, after a failed
build or a core found unsound, ``<core>.failed.json``.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import platform
import sys
import sysconfig
from pathlib import Path

from ..base.settings import Settings

EXTENSION_NAME = "zerofast_C"  # the module name the core is compiled and imported as
MANIFEST = "manifest.json"  # written last, so its presence means the core is complete
PACKAGE = Path(__file__).resolve().parent.parent
LDFLAGS = ["-fopenmp"]
NVCC_FLAGS = ["-O3"]
# The oldest torch the CPU core serves: the version its stable-ABI units are compiled for. 2.10 is
# the first to box Tensor[] and int[] arguments and to give parallel_for, get_num_threads, empty
# with options and typed data pointers. Written as a unit's first line (TORCH_TARGET_VERSION),
# before any include, it makes torch's non-stable headers refuse to compile there, and the stable
# headers offer only what 2.10 already has. An older torch runs the pure-torch reference
# (:func:`torch_floor_problem`).
STABLE_TARGET = (2, 10)
STABLE_UNITS = ("zerofast_cpu",)  # the units built against the stable ABI alone


class Unavailable(Exception):
    """Why the native core cannot be built or loaded here; the message is the reason users see."""


def sources_dir() -> Path:
    """``csrc/``: inside the package when installed from a wheel or sdist, next to it in a checkout."""
    for candidate in (PACKAGE / "csrc", PACKAGE.parent / "csrc"):
        if (candidate / "zerofast.cpp").is_file():
            return candidate
    raise Unavailable(f"the C++ sources are not installed (no csrc/zerofast.cpp in {PACKAGE} or next to it)")


def source_files(src: Path, devices: tuple[str, ...]) -> list[Path]:
    """What gets compiled: the op schema (csrc/*.cpp), the host code of csrc/load/ (the native
    pickle reader) and each device directory's kernels."""
    return [path for group in source_groups(src, devices).values() for path in group]


def source_groups(src: Path, devices: tuple[str, ...]) -> dict[str, list[Path]]:
    """The sources by the translation unit they are compiled in (:func:`write_units`): the Python
    half (csrc/load/, the module and the rank-file readers) in one, the op schema with the CPU
    kernels in one, each other device's C++ kernels in one, CUDA files alone."""
    groups = {"zerofast_python": sorted((src / "load").glob("*.cpp"))}
    for device in devices:
        schema = sorted(src.glob("*.cpp")) if device == "cpu" else []
        groups[f"zerofast_{device}"] = schema + sorted((src / device).glob("*.cpp"))
        groups.update({path.stem: [path] for path in sorted((src / device).glob("*.cu"))})
    return groups


def write_units(src: Path, devices: tuple[str, ...], folder: Path) -> list[Path]:
    """One file per group of :func:`source_groups` that includes its sources, written into
    ``folder``: the build's long pole is parsing torch's headers, about 10 s a translation unit on
    one core, so the core is compiled as one unit per group (two for the CPU core, one per core of
    the 2-core machines it is first built on) rather than one per source file: 39 s of CPU time
    against 149 s, measured on 2 cores. So the sources of one group keep no file-local name in
    common (a clash fails the build)."""
    folder.mkdir(parents=True, exist_ok=True)
    units = []
    for name, paths in source_groups(src, devices).items():
        if len(paths) == 1 and paths[0].suffix == ".cu":
            units.append(paths[0])  # nvcc's own unit: torch's builder names its object by the file
            continue
        unit = folder / f"{name}.cpp"
        prologue = f"#define TORCH_TARGET_VERSION {target_version()}\n" if name in STABLE_UNITS else ""
        unit.write_text(prologue + "".join(f'#include "{path.resolve()}"\n' for path in paths))
        units.append(unit)
    return units


def target_version() -> str:
    """:data:`STABLE_TARGET` as torch's stable headers spell a version: major and minor in the top
    two bytes of a 64-bit number (torch/csrc/stable/version.h)."""
    major, minor = STABLE_TARGET
    return f"0x{major:02x}{minor:02x}000000000000"


def torch_identity() -> dict:
    """The installed torch's version, CUDA version and git commit, from its ``version.py`` text."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise Unavailable("torch is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "version.py"
    values = {}
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError) as e:
        raise Unavailable(f"{path}: cannot read torch's version ({e})") from e
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and isinstance(getattr(node, "value", None), ast.Constant):
            values[target.id] = node.value.value
    return {k: values.get(k) for k in ("__version__", "cuda", "hip", "git_version")}


def cxx_flags(torch_version: str) -> list[str]:
    # torch 2.14's headers need C++20; older ones are built and tested here as C++17.
    return ["-O3", f"-std={'c++20' if release(torch_version) >= (2, 14) else 'c++17'}", "-fopenmp"]


def release(version: str) -> tuple[int, int]:
    """``"2.14.1+cu130"`` -> ``(2, 14)``."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def floor_text() -> str:
    return ".".join(map(str, STABLE_TARGET))


def torch_floor_problem(identity: dict) -> str | None:
    """Why this torch gets no native core (older than :data:`STABLE_TARGET`), or None."""
    if release(identity["__version__"]) >= STABLE_TARGET:
        return None
    return (f"the native core is built on torch's stable ABI and serves torch >= {floor_text()}; "
            f"torch {identity['__version__']} is older, so the pure-torch reference runs (same bytes, slower)")


def unfit_for(manifest: dict, torch_version: str) -> str | None:
    """Why the core of ``manifest`` does not serve ``torch_version``, or None: a core with CUDA kernels
    (torch's full C++ API) serves the torch build it was compiled against only, the CPU core (the
    stable ABI) any torch from its floor on."""
    if "cuda" in manifest.get("devices", ()):
        if manifest.get("torch") == torch_version:
            return None
        return f"the native core with CUDA kernels was built for torch {manifest.get('torch')} but torch {torch_version} " \
               "is running"
    floor = manifest.get("stable_torch")
    if floor is not None and release(torch_version) >= release(floor):
        return None
    return f"the native core serves torch >= {floor or '?'} but torch {torch_version} is running"


def core_tag(src: Path, identity: dict) -> str:
    """The folder name for cores of these sources on this Python (every device set): the same for
    every torch from :data:`STABLE_TARGET` on (``identity`` only names the floor it clears)."""
    digest = hashlib.sha256()
    # The extension suffix carries the ABI tag (".cpython-311-x86_64-linux-gnu.so") without the
    # millisecond sysconfig takes to build its table: this runs in every process that loads a core.
    inputs = {"stable": [target_version(), *STABLE_UNITS],
              "python": [sys.implementation.cache_tag, importlib.machinery.EXTENSION_SUFFIXES[0]],
              "machine": platform.machine(), "ld": LDFLAGS, "nvcc": NVCC_FLAGS}
    digest.update(json.dumps(inputs, sort_keys=True).encode())
    for relative, path in _sources_under(src):
        with open(path, "rb") as f:
            digest.update(relative.encode() + b"\0" + f.read() + b"\0")
    return f"torch{floor_text()}+-{sys.implementation.cache_tag}-{digest.hexdigest()[:12]}"


def _sources_under(src: Path) -> list[tuple[str, str]]:
    """(posix path relative to ``src``, path) of every C++/CUDA source and header below ``src``,
    sorted; ``os.walk`` rather than ``Path.rglob``, a third of its cost."""
    found = []
    for folder, dirs, files in os.walk(src):
        dirs.sort()
        rel = os.path.relpath(folder, src).replace(os.sep, "/")
        found += [((name if rel == "." else f"{rel}/{name}"), os.path.join(folder, name))
                  for name in files if name.endswith((".cpp", ".cu", ".h"))
                  and os.path.isfile(os.path.join(folder, name))]
    return sorted(found)


def device_tag(devices: tuple[str, ...], arch_list: str | None) -> str:
    tag = "+".join(devices)
    if "cuda" in devices and arch_list:
        tag += "-" + "_".join(arch_list.replace(",", ";").replace(" ", ";").split(";")).strip("_")
    return tag


def core_name(devices: tuple[str, ...], arch_list: str | None, compiler_key: str, nvcc_key: str | None) -> str:
    """``cpu@g++-12-0123456789`` or ``cpu+cuda-9.0@g++-12-0123456789@nvcc-01234567``, whose last
    part names nvcc and the torch build (see the module's docstring)."""
    name = f"{device_tag(devices, arch_list)}@{compiler_key}"
    if "cuda" in devices:
        key = json.dumps([nvcc_key or "", torch_identity()], sort_keys=True)
        name += "@nvcc-" + hashlib.sha256(key.encode()).hexdigest()[:8]
    return name


def compiler_key_of(core: Path) -> str:
    """The compiler part of a core folder's name (see :func:`core_name`)."""
    parts = core.name.split("@")
    return parts[1] if len(parts) > 1 else ""


PREBUILT = PACKAGE / "_prebuilt"  # a platform wheel's core (`make wheel`, zerofast/native/prebuild.py)


def prebuilt(tag: str) -> tuple[Path | None, str | None]:
    """(the wheel's prebuilt core, None) where its tag is ``tag``: built for the same Python, machine,
    flags and sources, so it loads as a core built here would (by any torch from the floor on); else
    (None, why not), why being None where the package carries no prebuilt core (a checkout, an
    sdist, a pure wheel)."""
    manifest = read_manifest(PREBUILT)
    if manifest is None:
        return None, None
    if manifest.get("tag") == tag:
        return PREBUILT, None
    return None, (f"the prebuilt core in this package is for Python {manifest.get('python')} on "
                  f"{manifest.get('machine', '?')}, and does not fit this Python or these sources")


def tag_dir(s: Settings, tag: str) -> Path:
    return s.cache_dir / "native" / tag


def read_manifest(core: Path) -> dict | None:
    try:
        return json.loads((core / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def library(core: Path) -> Path:
    return core / f"{EXTENSION_NAME}.so"  # the name torch's builder gives it on Linux


def tool_path() -> str:
    """PATH for the build: this environment's scripts (where pip puts ninja) first."""
    return os.pathsep.join([_scripts(), os.path.dirname(sys.executable), os.environ.get("PATH", "")])


@functools.lru_cache(maxsize=None)
def _scripts() -> str:
    return sysconfig.get_path("scripts")  # two milliseconds: only where a build or doctor looks for ninja


def compiler_path() -> str:
    """PATH for finding the C++ compiler, which every load does: this Python's folder first, as in
    :func:`tool_path`, without the scripts folder that pip puts ninja in (sysconfig's cost)."""
    return os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])


def compiler(s: Settings) -> str | None:
    import shutil  # shutil and subprocess are off the path of `zerofast --version` when a core is built

    return shutil.which(s.cxx.split()[0], path=compiler_path()) if s.cxx.split() else None


def preflight(s: Settings, cxx: str | None = None) -> None:
    """Raise :class:`Unavailable` for what can be known without compiling anything, with the
    compiler ``cxx`` (default: CXX)."""
    preflight_environment(s)
    preflight_compiler(cxx or (s.cxx.split()[0] if s.cxx.split() else "CXX"))


def preflight_environment(s: Settings) -> None:
    """What no other compiler would change: the platform, the sources, the build tools, Python.h."""
    import shutil

    if not sys.platform.startswith("linux"):
        raise Unavailable(f"the native core is built on Linux only ({sys.platform} has no copy_file_range, and "
                          "its default compiler no OpenMP)")
    sources_dir()
    if importlib.util.find_spec("setuptools") is None:  # torch's builder imports it
        raise Unavailable("setuptools is not installed (pip install setuptools)")
    if shutil.which("ninja", path=tool_path()) is None:
        raise Unavailable("ninja is not installed (pip install ninja)")
    if not Path(sysconfig.get_paths()["include"], "Python.h").is_file():
        raise Unavailable(f"Python's headers are not installed (no Python.h in {sysconfig.get_paths()['include']}; "
                          "install python3-dev)")


def preflight_compiler(name: str) -> str:
    """The compiler ``name`` as a path that runs, or :class:`Unavailable` saying why not."""
    import shutil
    import subprocess

    cxx = shutil.which(name, path=compiler_path())
    if cxx is None:
        raise Unavailable(f"no C++ compiler: {name} is not on the PATH (install g++, or set CXX)")
    try:
        runs = subprocess.run([cxx, "--version"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        runs = False
    if not runs:
        raise Unavailable(f"the C++ compiler {cxx} does not run (`{cxx} --version` fails)")
    return cxx


def failure(core: Path, s: Settings, cxx: str | None = None, retry: bool = False) -> str | None:
    """The reason a build of ``core`` failed before with this same compiler (default: CXX), if it
    did. ``retry`` (``zerofast build``) forgets failed builds but not unsound cores: the same
    compiler links the same way again."""
    try:
        record = json.loads(core.with_name(core.name + ".failed.json").read_text())
    except (OSError, ValueError):
        return None
    if retry and record.get("kind") != "unsound":
        return None
    return record.get("reason") if record.get("compiler") == (cxx or compiler(s)) else None


def record_failure(core: Path, s: Settings, reason: str, cxx: str | None = None, kind: str = "failed") -> None:
    marker = core.with_name(core.name + ".failed.json")
    marker.parent.mkdir(parents=True, exist_ok=True)
    tmp = marker.with_name(marker.name + f".{os.getpid()}")
    tmp.write_text(json.dumps({"reason": reason, "compiler": cxx or compiler(s), "kind": kind}))
    tmp.replace(marker)


def clear_failure(core: Path) -> None:
    core.with_name(core.name + ".failed.json").unlink(missing_ok=True)
