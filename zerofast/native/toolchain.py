"""The C++ compilers a native core may be built with, what names each in the cache, and what a
built core links, all found without importing torch.

Compiler wrappers that link their own static copy of libstdc++ are common on clusters (module
systems, vendor toolchains): a core they link formats its error messages with that private
copy, which cut every message at its first integer on a CPU machine and crashed the process on a
GPU one (issue 38). So a core must link the libstdc++ the process uses (:func:`linkage_problem`),
and where the compiler asked for gives no sound core the next one is tried
(:func:`compiler_candidates`).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import struct
from functools import lru_cache
from typing import Iterator

from ..base.jsonfile import read_dict, write_json
from ..base.settings import Settings, settings

# The names tried on the PATH after CXX, each through every PATH entry that has it (a module
# system's wrapper usually shadows the distribution's compiler of the same name).
PATH_COMPILERS = ("g++", "c++", "clang++")
# The distribution's own compilers, tried last: on the GPU machine of issue 38 the only sound one.
SYSTEM_COMPILERS = ("/usr/bin/g++", "/usr/bin/c++")
LIBSTDCXX = "libstdc++.so.6"


def compiler_candidates(s: Settings, path: str) -> Iterator[str]:
    """CXX (default ``c++``) first, as written where it is not found (so that the failure names it),
    then every other C++ compiler on ``path`` and the system's, one per real path. Lazy: a load that
    finds the first one's core looks no further."""
    first = s.cxx.split()[0] if s.cxx.split() else "c++"
    first = shutil.which(first, path=path) or first
    seen = {os.path.realpath(first)}
    yield first
    for hit in [*(h for name in PATH_COMPILERS for h in _which_all(name, path)), *SYSTEM_COMPILERS]:
        real = os.path.realpath(hit)
        if real not in seen and os.access(hit, os.X_OK):
            seen.add(real)
            yield hit


def _which_all(name: str, path: str) -> list[str]:
    """Every entry of ``path`` that has ``name``, in order (``which -a``)."""
    return [hit for folder in path.split(os.pathsep) if folder
            and (hit := shutil.which(name, path=folder)) is not None]


@lru_cache(maxsize=None)
def compiler_version(cxx: str) -> str:
    """``cxx --version``'s output (about 2 ms to run); "" where it does not run (the build's
    preflight says why). Kept in the cache folder by the compiler's real path, size and time, so
    that loading a built core starts no process (a fresh ``reconstruct`` runs nothing but its own
    reads: tests/test_hostile.py watches it). A wrapper script whose compiler changed under it keeps
    its old version there until the script itself changes."""
    real = os.path.realpath(cxx)
    stamp = _stamp(real)
    memo = settings().cache_dir / "native" / "compilers.json"
    known = read_dict(memo)
    key = f"{real}\0{stamp}"
    if isinstance(known.get(key), str):
        return known[key]
    version = _run_version(cxx)
    if version:
        write_json(memo, {**known, key: version})
    return version


def _run_version(cxx: str) -> str:
    import subprocess

    try:
        done = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60, errors="replace")
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def _stamp(real: str) -> str:
    try:
        st = os.stat(real)
    except OSError:
        return "missing"
    return f"{st.st_size}:{st.st_mtime_ns}"


def compiler_key(cxx: str, extra: str = "") -> str:
    """The part of a core's folder name that names its compiler: the real path's name and a hash of
    the real path, its size and time (a replaced binary), and its ``--version`` (a wrapper script
    whose compiler changed), plus ``extra`` (nvcc's own key, for the CUDA kernels)."""
    real = os.path.realpath(cxx)
    stamp = _stamp(real)
    version = compiler_version(cxx)
    name = os.path.basename(cxx)  # GCC starts with the name it was called by: g++ and c++ are one compiler
    version = version[len(name):] if version.startswith(name + " ") else version
    digest = hashlib.sha256("\0".join([real, stamp, version, extra]).encode()).hexdigest()
    return f"{os.path.basename(real)}-{digest[:10]}"


def needed_libraries(library: str) -> list[str]:
    """The shared libraries an ELF64 little-endian file names as DT_NEEDED (what ``ldd`` starts
    from), read from its dynamic section; [] for a file that is not one."""
    with open(library, "rb") as f:
        data = f.read()
    if data[:6] != b"\x7fELF\x02\x01":
        return []
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    headers = [struct.unpack_from("<IIQQQQ", data, phoff + i * phentsize) for i in range(phnum)]
    dynamic = next((h for h in headers if h[0] == 2), None)  # PT_DYNAMIC
    if dynamic is None:
        return []
    entries = [struct.unpack_from("<qQ", data, dynamic[2] + i) for i in range(0, dynamic[5], 16)]
    strtab = next(value for tag, value in entries if tag == 5)  # DT_STRTAB, an address
    base = next(off + strtab - vaddr for kind, _, off, vaddr, _, size in headers
                if kind == 1 and vaddr <= strtab < vaddr + size)  # PT_LOAD holding it
    return [data[base + value:data.index(b"\0", base + value)].decode() for tag, value in entries if tag == 1]


def linkage_problem(library: str) -> str | None:
    """Why ``library`` cannot share the process's C++ runtime, or None: it must name libstdc++.so.6,
    which the dynamic loader then resolves to the copy torch already loaded. A core that names none
    carries a static copy whose exceptions and streams are not the process's."""
    needed = needed_libraries(library)
    if LIBSTDCXX in needed:
        return None
    return (f"it does not link {LIBSTDCXX} (it links {', '.join(needed) or 'nothing'}): the compiler linked its "
            "own static copy of the C++ runtime, whose error messages are cut short or crash")
