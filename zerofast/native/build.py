"""``python -m zerofast.native.build CORE DEVICES``: compile the native core into the folder CORE.

:mod:`.loader` runs this in a child process, so that the compiler's output goes to the build log
(and, condensed, to stderr) rather than to the caller's stdout, and a failed build leaves the
caller's process untouched. torch's own builder (``torch.utils.cpp_extension.load``, with ninja)
compiles against the torch this Python imports, into a temporary folder next to CORE that is
renamed into place once the module has loaded, proved sound (:mod:`.proof`) and its manifest is
written: a core folder is complete and sound, or absent. An unsound core exits with
``proof.UNSOUND`` and says why on its last line.
"""
from __future__ import annotations

import json
import os
import platform
import re
import shutil
import sys
import time
from pathlib import Path

from . import cache, proof, toolchain


class CoreNotSound(Exception):
    """The core built and loaded in this child, but is not sound: the message says why (the
    child exits with ``proof.UNSOUND``; the loader raises its ``UnsoundBuild``)."""


def build(core: Path, devices: tuple[str, ...]) -> None:
    start = time.monotonic()
    tmp = core.with_name(f".{core.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    module = _compile(tmp, devices)
    manifest = {**_proved(module, cache.library(tmp)), "seconds": round(time.monotonic() - start, 1),
                "cuda_arch_list": os.environ.get("TORCH_CUDA_ARCH_LIST") if "cuda" in devices else None}
    (tmp / cache.MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    if core.exists():  # `zerofast build --force`: the old core goes only once the new one is whole
        old = core.with_name(f".{core.name}.old-{os.getpid()}")
        core.rename(old)
        shutil.rmtree(old, ignore_errors=True)
    tmp.rename(core)


def _compile(tmp: Path, devices: tuple[str, ...]):
    import torch
    from torch.utils.cpp_extension import load

    # Escaped for the shell that ninja runs the compiler through.
    version = f'-DZEROFAST_TORCH_VERSION=\\"{torch.__version__}\\"'
    units = cache.write_units(cache.sources_dir(), devices, tmp / "units")
    print(f"zerofast: compiling {len(units)} units ({', '.join(u.name for u in units)})", flush=True)
    return load(cache.EXTENSION_NAME, [str(u) for u in units],
                extra_cflags=[*cache.cxx_flags(torch.__version__), version], extra_cuda_cflags=cache.NVCC_FLAGS,
                extra_ldflags=cache.LDFLAGS, build_directory=str(tmp), verbose=True, with_cuda="cuda" in devices)


def _proved(module, library: Path) -> dict:
    """The manifest's record of the loaded core and its compiler, once :mod:`.proof` finds it sound
    (else :class:`CoreNotSound`): the op check of each device visible here, the linkage of all."""
    import torch

    built = list(proof.kernel_devices())
    checked = proof.checkable(built)
    unsound = proof.problems(str(library), built, checked)
    if unsound:
        raise CoreNotSound("; ".join(unsound))
    cxx = os.environ.get("CXX", "c++")  # the loader sets it to the compiler it chose
    return {"torch": torch.__version__, "torch_git": torch.version.git_version, "cuda": torch.version.cuda,
            "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI), "python": sys.version.split()[0],
            "machine": platform.machine(), "stable_torch": cache.floor_text(),
            "devices": built, "checked": checked, "compiler": cxx,
            "compiler_version": toolchain.compiler_version(cxx).split("\n")[0],
            "links": toolchain.needed_libraries(str(library)), "built": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def main(argv: list[str]) -> int:
    core, devices = Path(argv[0]), tuple(argv[1].split(","))
    try:
        build(core, devices)
    except CoreNotSound as e:
        print(proof.MARK + str(e), flush=True)
        return proof.UNSOUND
    finally:  # what a failed build compiled is of no use; the log is kept by the caller
        for tmp in core.parent.glob(f".{core.name}.tmp-{os.getpid()}"):
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


_STEP = re.compile(r"^\[(\d+)/(\d+)\] (.*)")


def progress_line(line: str) -> str | None:
    """``[2/4] c++ ... -c .../csrc/cpu/read_cast.cpp -o ...`` -> ``zerofast: [2/4] compiled cpu/read_cast.cpp``
    (ninja prints a step when it is done, its output not being a terminal)."""
    if line.startswith("zerofast: "):  # the build child's own lines (what it compiles)
        return line.rstrip("\n")
    m = _STEP.match(line)
    if not m:
        return None
    src = re.search(r" -c (\S+)", m.group(3)) or re.search(r" (\S+\.cu) ", m.group(3))
    what = f"compiled {_short_source(src.group(1))}" if src else "linked"
    return f"zerofast: [{m.group(1)}/{m.group(2)}] {what}"


def _short_source(path: str) -> str:
    path = path.strip("'\"")  # torch's builder quotes the paths it writes into build.ninja
    parts = Path(path).parts
    return "/".join(parts[parts.index("csrc") + 1:]) if "csrc" in parts else Path(path).name


def failure_line(log: Path) -> str:
    """The line of the build log that says what went wrong: the compiler's first error, else
    ninja's FAILED line, else the last line (torch's builder raising before ninja ran)."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    for pattern in (r"\berror\b:", r"^FAILED:"):
        hit = next((ln for ln in lines if re.search(pattern, ln)), None)
        if hit:
            return hit[:300]
    return lines[-1][:300] if lines else "no output"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
