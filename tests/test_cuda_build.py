"""Every CUDA source compiles, checked without a GPU (see tools/cuda_build.py).

``ZEROFAST_REQUIRE_CUDA_CHECK=1`` (set by ``make cuda-check``) turns the skips for a missing nvcc
or missing headers into failures, so the explicit check cannot pass vacuously.
"""
import os

import pytest

from tools import cuda_build

REQUIRED = os.environ.get("ZEROFAST_REQUIRE_CUDA_CHECK") == "1"


def _unavailable(reason: str) -> None:
    if REQUIRED:
        pytest.fail(reason)
    pytest.skip(reason)


def _check(done) -> None:
    assert done.returncode == 0, f"{' '.join(done.args)}\n{done.stdout}{done.stderr}"


def test_there_are_cuda_sources():
    assert cuda_build.kernel_sources() and cuda_build.glue_sources()


@pytest.mark.parametrize("path", [*cuda_build.kernel_sources(), *cuda_build.CUDA_DIR.glob("*.h")],
                         ids=lambda p: p.name)
def test_kernels_include_no_torch(path):
    # What keeps them compilable in CI, where no CUDA build of torch exists.
    assert cuda_build.torch_includes(path) == []


@pytest.mark.parametrize("src", cuda_build.kernel_sources(), ids=lambda p: p.name)
def test_kernel_compiles_alone(src, tmp_path):
    if cuda_build.nvcc() is None:
        _unavailable("nvcc is not on the PATH")
    _check(cuda_build.compile_kernel(src, tmp_path))


@pytest.mark.parametrize("src", cuda_build.glue_sources(), ids=lambda p: p.name)
def test_glue_compiles_against_cuda_torch_headers(src, tmp_path):
    if cuda_build.nvcc() is None:
        _unavailable("nvcc is not on the PATH")
    if not cuda_build.headers_ready():
        _unavailable("torch's CUDA headers are not fetched: `make cuda-check` (or "
                     "`python -m tools.cuda_build fetch`) puts them under .cache/")
    _check(cuda_build.compile_glue(src, tmp_path))
