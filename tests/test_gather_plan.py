"""The CUDA path's slot packing and span tables, run on the CPU (tests/native/gather_plan_test.cpp).

csrc/cuda/gather_plan.h is plain C++, so a host compiler runs it against a model of the kernels
here, with the address and undefined-behaviour sanitizers when the toolchain has them.
"""
import shutil
import subprocess

import pytest

from tests.conftest import GATHER_CASES
from tools.cuda_build import CUDA_DIR, REPO

SOURCE = REPO / "tests" / "native" / "gather_plan_test.cpp"
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"]


def _build(cxx: str, exe) -> None:
    base = [cxx, "-std=c++17", "-O1", "-g", "-Wall", "-Wextra", "-Werror", f"-I{CUDA_DIR}", str(SOURCE), "-o", str(exe)]
    done = subprocess.run(base[:1] + SANITIZE + base[1:], capture_output=True, text=True)
    if done.returncode != 0 and "sanitize" in done.stderr + done.stdout:
        done = subprocess.run(base, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_packing_and_span_tables_match_a_model_of_the_kernels(tmp_path):
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler on the PATH")
    exe = tmp_path / "gather_plan_test"
    _build(cxx, exe)
    done = subprocess.run([str(exe), str(GATHER_CASES)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr
