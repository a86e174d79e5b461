"""Compile checks for the CUDA sources, on machines without a GPU or a CUDA build of torch.

The kernels (``csrc/cuda/*.cu``) are torch-free and compile with nvcc alone. The glue
(``csrc/cuda/*.cpp``) needs torch's CUDA headers, which the CPU wheel lacks
(``c10/cuda/impl/cuda_cmake_macros.h``), so ``fetch`` takes them from the torch cu13.0 wheel and
the include folders of the CUDA libraries ATen's headers include, and keeps only the headers
(about 65 MB) under ``.cache/``. The wheels themselves (1.3 GB) are deleted once unpacked.

    python -m tools.cuda_build fetch            # what `make test` runs: a refused download skips
    python -m tools.cuda_build fetch --strict   # what `make cuda-check` runs: it fails instead
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CUDA_DIR = REPO / "csrc" / "cuda"
# torch 2.14.1's wheel on PyPI is its cu13.0 build; the three libraries are the versions it needs.
WHEELS = ("torch==2.14.1", "nvidia-cusparse==12.6.3.3", "nvidia-cublas==13.1.1.3", "nvidia-cusolver==12.0.4.66")
HEADERS = REPO / ".cache" / "cuda-headers" / "torch-2.14.1-cu130"
_STAMP = HEADERS / ".complete"
_TORCH_INCLUDES = (Path("torch/include"), Path("torch/include/torch/csrc/api/include"))
_MARKER = "torch/include/c10/cuda/impl/cuda_cmake_macros.h"  # the header a CPU wheel lacks
_TORCH_HEADER = re.compile(r"^\s*#\s*include\s*[<\"](torch|ATen|c10)/", re.M)
ARCH = "-arch=sm_90"


def nvcc() -> str | None:
    return shutil.which("nvcc")


def kernel_sources() -> list[Path]:
    return sorted(CUDA_DIR.glob("*.cu"))


def glue_sources() -> list[Path]:
    return sorted(CUDA_DIR.glob("*.cpp"))


def torch_includes(path: Path) -> list[str]:
    """The torch headers a file includes; kernels and their headers must have none."""
    return [m.group(0).strip() for m in _TORCH_HEADER.finditer(path.read_text())]


def headers_ready() -> bool:
    return _STAMP.is_file()


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)


# What torch's extension builder passes nvcc (torch.utils.cpp_extension.COMMON_NVCC_FLAGS): they
# remove the implicit half/bfloat16 conversions a kernel might otherwise lean on.
TORCH_NVCC_FLAGS = ["-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__", "--expt-relaxed-constexpr"]


def compile_kernel(src: Path, out_dir: Path) -> subprocess.CompletedProcess:
    # sm_75 too: below sm_80 the bf16 rounding takes its own branch, which must compile as well.
    return _run([nvcc(), "-std=c++17", *TORCH_NVCC_FLAGS, "-gencode", "arch=compute_90,code=sm_90", "-gencode",
                 "arch=compute_75,code=sm_75", "-Werror", "all-warnings", "-Xcompiler", "-Wall,-Wextra,-Werror",
                 "-c", str(src), "-o", str(out_dir / (src.stem + ".o"))])


def compile_glue(src: Path, out_dir: Path) -> subprocess.CompletedProcess:
    # -isystem keeps torch's own warnings out of -Werror, which then judges only our code.
    includes = [*(HEADERS / p for p in _TORCH_INCLUDES), *sorted(HEADERS.glob("nvidia/*/include"))]
    flags = [f for p in includes for f in ("-isystem", str(p))]
    return _run([nvcc(), "-std=c++20", ARCH, "-Xcompiler", "-Wall,-Wextra,-Werror", *flags, "-c", str(src),
                 "-o", str(out_dir / (src.stem + ".o"))])


class Refused(Exception):
    """pip could not get the wheels: no index, no network, or no such version there."""


def fetch_headers() -> None:
    """Unpack torch's CUDA headers into ``HEADERS`` unless they are there already."""
    if headers_ready():
        return
    HEADERS.parent.mkdir(parents=True, exist_ok=True)
    # Unpacked next to the destination, so that the final rename is atomic.
    with tempfile.TemporaryDirectory(dir=HEADERS.parent) as tmp:
        wheels, staged = Path(tmp) / "wheels", Path(tmp) / "headers"
        _download(wheels)
        for wheel in sorted(wheels.glob("*.whl")):
            _unpack_headers(wheel, staged)
        if not (staged / _MARKER).is_file():
            raise RuntimeError(f"the torch wheel pip found has no CUDA headers ({_MARKER} is missing): "
                               "it is not the cu13.0 build")
        (staged / _STAMP.name).write_text(" ".join(WHEELS) + "\n")
        shutil.rmtree(HEADERS, ignore_errors=True)
        staged.rename(HEADERS)


def _download(dest: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "-d", str(dest),
           *WHEELS]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise Refused(" / ".join(tail) or f"pip exited with {done.returncode}")


def _unpack_headers(wheel: Path, dest: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name.startswith("torch/include/") or (name.startswith("nvidia/") and "/include/" in name):
                z.extract(name, dest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.cuda_build")
    parser.add_argument("command", choices=["fetch"])
    parser.add_argument("--strict", action="store_true", help="fail, rather than skip, without nvcc or the wheels")
    args = parser.parse_args(argv)
    rc, verdict = (1, "FAILED") if args.strict else (0, "SKIPPED")
    if nvcc() is None:
        print(f"cuda compile check {verdict}: nvcc is not on the PATH", file=sys.stderr)
        return rc
    if headers_ready():
        return 0
    print(f"fetching CUDA torch headers ({', '.join(WHEELS)}) into {HEADERS.relative_to(REPO)}", file=sys.stderr)
    try:
        fetch_headers()
    except Refused as e:
        print(f"cuda compile check of the glue {verdict}: pip could not download the wheels ({e})", file=sys.stderr)
        return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
