"""Whether a core gets CUDA kernels, for which GPUs, and whether the nvcc found can build them,
decided without initializing CUDA or importing ``torch.utils.cpp_extension``.

Loading a core runs :func:`wanted_devices` in every process, so it reads only files: nvcc is
found as torch's builder finds it (CUDA_HOME or CUDA_PATH, the PATH, /usr/local/cuda), and the
archs come from TORCH_CUDA_ARCH_LIST, else from a record of what the visible GPUs were found to be
(keyed by their models, read from /proc), else from the default list where no NVIDIA GPU is there.
Only the first load on a new kind of GPU asks torch.cuda (which initializes CUDA: 0.57 s on an
H200, issue 37). nvcc itself runs (:func:`nvcc_problem`) only before a CUDA build.
"""
from __future__ import annotations

import os
import re
import shutil
from functools import lru_cache
from pathlib import Path

from ..base.jsonfile import read_dict, write_json
from ..base.settings import Settings

# What CUDA torch builds for when neither TORCH_CUDA_ARCH_LIST nor a visible GPU says:
# CUDA 13 dropped the GPUs before Turing (sm_75).
DEFAULT_ARCHS = {13: "7.5;8.0;8.6;8.9;9.0;10.0;12.0+PTX", 12: "7.0;7.5;8.0;8.6;8.9;9.0+PTX",
                 11: "7.0;7.5;8.0;8.6+PTX"}
GPU_INFO = Path("/proc/driver/nvidia/gpus")  # one folder per GPU the driver (and container) exposes
ARCHS_MEMO = "gpu-archs.json"  # in <cache>/native: GPU models -> the archs torch.cuda reported


def wanted_devices(s: Settings) -> tuple[tuple[str, ...], str | None]:
    """The device kernels to compile, and the CUDA archs: CUDA only where torch has it and nvcc is
    found (or FORCE_CUDA=1), and never with ZEROFAST_CUDA_KERNELS=0, so a CPU-only torch never
    starts a CUDA build, nvcc or not."""
    import torch  # torch.version is a plain module: importing torch initializes no CUDA

    if not s.cuda_kernels:
        return ("cpu",), None
    if not s.force_cuda and (torch.version.cuda is None or not gpus_visible() or find_nvcc(s) is None):
        return ("cpu",), None
    return ("cpu", "cuda"), folder_archs(s)


def gpus_visible() -> bool:
    """Whether this process can see an NVIDIA GPU, read from /proc and CUDA_VISIBLE_DEVICES (no
    CUDA). Where none is visible no CUDA kernels are built (FORCE_CUDA=1 builds them anyway, for a
    build node): device="cuda" could not run here, and a CUDA build for every architecture took
    minutes before the CPU core on a machine with a CUDA torch, a toolkit and no GPU (issue 45)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return bool(gpu_models())


def toolkit_home(s: Settings) -> str | None:
    """The CUDA toolkit the nvcc found belongs to, for torch's builder, which takes the folder above
    nvcc's for it and so misses the headers when nvcc is a wrapper (``exec /usr/local/cuda-13.0/bin/nvcc
    "$@"`` in /usr/local/bin). CUDA_HOME (or CUDA_PATH) where set; else the folder above the real
    nvcc's where its include/ has cuda_runtime.h; else nvcc's own answer (``--dryrun`` names the
    folder it runs from, through any wrapper)."""
    if s.cuda_home:
        return s.cuda_home
    nvcc = find_nvcc(s)
    if nvcc is None:
        return None
    home = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    if _has_headers(home):
        return home
    here = _nvcc_here(nvcc)
    return os.path.dirname(here) if here and _has_headers(os.path.dirname(here)) else None


def _has_headers(home: str) -> bool:
    return os.path.isfile(os.path.join(home, "include", "cuda_runtime.h"))


@lru_cache(maxsize=None)
def _nvcc_here(nvcc: str) -> str | None:
    import subprocess

    try:
        done = subprocess.run([nvcc, "--dryrun", "-E", "-x", "cu", os.devnull], capture_output=True, text=True,
                              timeout=60, errors="replace")
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"^#\$ _HERE_=(.+)$", done.stdout + done.stderr, re.M)
    return m.group(1).strip() if m else None


def find_nvcc(s: Settings) -> str | None:
    """nvcc where torch's builder would take it: CUDA_HOME (or CUDA_PATH)/bin, the PATH, then
    /usr/local/cuda/bin."""
    if s.cuda_home:
        path = os.path.join(s.cuda_home, "bin", "nvcc")
        return path if os.access(path, os.X_OK) else None
    found = shutil.which("nvcc")
    if found:
        return found
    return "/usr/local/cuda/bin/nvcc" if os.access("/usr/local/cuda/bin/nvcc", os.X_OK) else None


def nvcc_key(s: Settings) -> str:
    """What names nvcc in a CUDA core's folder: its real path, size and time (no subprocess)."""
    nvcc = find_nvcc(s)
    if nvcc is None:
        return "no nvcc"
    st = os.stat(os.path.realpath(nvcc))
    return f"{os.path.realpath(nvcc)}:{st.st_size}:{st.st_mtime_ns}"


@lru_cache(maxsize=None)
def nvcc_release(nvcc: str) -> str | None:
    """``nvcc --version``'s "release X.Y", or None where it does not run or say one."""
    import subprocess

    try:
        done = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60, errors="replace")
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"release (\d+)\.(\d+)", done.stdout)
    return f"{m.group(1)}.{m.group(2)}" if done.returncode == 0 and m else None


def nvcc_problem(s: Settings, torch_cuda: str | None) -> str | None:
    """Why the nvcc found cannot build CUDA kernels for a torch of CUDA ``torch_cuda``, or None: it is
    missing, does not run, or is of another CUDA major version (its kernels would need a runtime
    torch does not bring). A CPU torch under FORCE_CUDA=1 has no version to match."""
    nvcc = find_nvcc(s)
    if nvcc is None:
        return f"no nvcc (looked in {'$CUDA_HOME/bin' if s.cuda_home else 'the PATH'} and /usr/local/cuda/bin)"
    release = nvcc_release(nvcc)
    if release is None:
        return f"{nvcc} does not run (`{nvcc} --version` fails or names no release)"
    if torch_cuda and release.split(".")[0] != torch_cuda.split(".")[0]:
        return f"{nvcc} is CUDA {release} but torch is built with CUDA {torch_cuda} (the major versions differ)"
    return None


def gpu_models() -> list[str]:
    """The NVIDIA GPUs the driver exposes here, by model, read from /proc (no CUDA)."""
    try:
        folders = sorted(GPU_INFO.iterdir())
    except OSError:
        return []
    models = []
    for folder in folders:
        try:
            text = (folder / "information").read_text()
        except OSError:
            continue
        m = re.search(r"^Model:\s*(.+)$", text, re.M)
        models.append(m.group(1).strip() if m else "unknown")
    return models


def folder_archs(s: Settings) -> str:
    """The archs a CUDA core's folder is named by, found without CUDA where it can be: the list
    asked for, the default where no GPU is there, else the record for these GPU models; only a new
    kind of GPU is asked (torch.cuda), and its answer recorded for the next processes."""
    if s.cuda_arch_list:
        return s.cuda_arch_list
    models = gpu_models()
    if not models:
        return cuda_archs(s)  # no NVIDIA GPU: the default list, without asking torch.cuda
    memo_path = s.cache_dir / "native" / ARCHS_MEMO
    key = "|".join(models)
    memo = read_dict(memo_path)
    if key not in memo:
        archs = cuda_archs(s)
        if _all_visible(len(models)):  # archs of a CUDA_VISIBLE_DEVICES subset name only that subset
            write_json(memo_path, {**memo, key: archs})  # two writers may lose one's entry: asked again later
        return archs
    return memo[key]


def _all_visible(count: int) -> bool:
    import torch

    return torch.cuda.device_count() == count


def cuda_archs(s: Settings) -> str:
    """TORCH_CUDA_ARCH_LIST, else the visible GPUs' compute capabilities, else a default list (torch's
    builder alone raises an IndexError on a machine with nvcc and no GPU)."""
    if s.cuda_arch_list:
        return s.cuda_arch_list
    import torch

    if gpu_models() and torch.cuda.is_available() and torch.cuda.device_count():
        caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
        return ";".join(f"{major}.{minor}" for major, minor in caps)
    major = int((torch.version.cuda or "12").split(".")[0])
    return DEFAULT_ARCHS.get(major, DEFAULT_ARCHS[13 if major > 13 else 11])
