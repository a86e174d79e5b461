"""What proves a freshly built core sound before it is put in the cache (issue 38): it links the
C++ runtime the process uses, and on each device it has kernels for, an op given bad arguments
raises a ``RuntimeError`` carrying its whole message and one given good ones copies right.

These run in a child process (the build's, or :func:`main`'s for a device that was not visible at
build time), so a core that crashes on its first error takes only that child down.
"""
from __future__ import annotations

import sys

from ..base.errors import first_line
from . import cache, toolchain

# The op call and the message it must raise, whole. A core linking its own static libstdc++ cut
# this at the first integer ("gather_cast: `segments[") on the CPU machine and crashed on the GPU one.
BAD_SEGMENTS = [[1, 0, 0, 1]]  # names source 1 of a list of one
EXPECTED = "gather_cast: `segments[0]` names source 1 but there are 1 sources"
UNSOUND = 3  # the child's exit status for a core that built but is not sound
MARK = "zerofast-unsound: "  # how the child says why, on the last line of its output


def problems(library: str, devices: list[str], checked: list[str]) -> list[str]:
    """Why the loaded core at ``library`` is not sound (empty: it is). Each device of ``checked``
    has its op check run; the linkage is read from the file."""
    found = [p for p in [toolchain.linkage_problem(library)] if p]
    return found + [p for device in checked for p in (message_problem(device), run_problem(device)) if p]


def checkable(devices: list[str]) -> list[str]:
    """The devices whose op check can run here: the CPU, and CUDA only where a GPU is visible."""
    import torch

    return [d for d in devices if d == "cpu" or (d == "cuda" and torch.cuda.is_available())]


def message_problem(device: str) -> str | None:
    """Why ``gather_cast`` on ``device`` does not raise its bad-segment error whole, or None."""
    import torch

    sources, out = [torch.zeros(10, device=device)], torch.zeros(10, device=device)
    try:
        torch.ops.zerofast.gather_cast(sources, torch.tensor(BAD_SEGMENTS), out, False)
    except RuntimeError as e:
        said = first_line(e)
        if EXPECTED in str(e):
            return None
        return f"its {device} op's error message arrives cut short ({said!r} where {EXPECTED!r} was raised)"
    return f"its {device} op accepted a segment that names a missing source"


def run_problem(device: str) -> str | None:
    """Why ``gather_cast`` on ``device`` does not copy a good segment here, or None: kernels that the
    driver cannot run (an nvcc newer than the driver) fail only once something is launched."""
    import torch

    out = torch.zeros(4, device=device)
    try:
        torch.ops.zerofast.gather_cast([torch.arange(10.0, device=device)], torch.tensor([[0, 2, 0, 3]]), out, False)
    except RuntimeError as e:
        return f"its {device} op does not run here ({first_line(e)})"
    return None if out.tolist() == [2.0, 3.0, 4.0, 0.0] else f"its {device} op copied the wrong values"


KERNEL_DEVICES = (("CPU", "cpu"), ("CUDA", "cuda"))  # dispatch key, device type


def kernel_devices() -> list[str]:
    """The device types whose kernels the loaded core registered (``["cpu"]``, ``["cpu", "cuda"]``):
    a device directory compiled in registers under its dispatch key, so the dispatcher is asked
    rather than a list kept beside the build flags."""
    import torch

    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return [name for key, name in KERNEL_DEVICES if has("zerofast::gather_cast", key)]


def main(argv: list[str]) -> int:
    """``python -m zerofast.native.proof CORE DEVICE``: load the core in CORE and check DEVICE."""
    import importlib.util
    from pathlib import Path

    import torch  # noqa: F401 (first: the core's libraries, libc10 and the rest, come with torch)

    spec = importlib.util.spec_from_file_location(cache.EXTENSION_NAME, cache.library(Path(argv[0])))
    spec.loader.exec_module(importlib.util.module_from_spec(spec))  # registers torch.ops.zerofast
    problem = message_problem(argv[1]) or run_problem(argv[1])
    if problem:
        print(MARK + problem, flush=True)
        return UNSOUND
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
