"""Generated arguments for every native op (tests/op_fuzz_child.py): a valid call gives the
reference's result bit for bit, a damaged one a RuntimeError naming the damaged argument, and no
argument takes the process down.

The cases run in batches, each in a child process with a time limit, so that a crash or a hang
fails its batch, naming the case it died in, and the other batches still run.
ZEROFAST_OP_FUZZ_CASES sets the number of cases per device (default 2400), ZEROFAST_OP_FUZZ_SEED
the seed (default 0). A failing case runs again alone:
``python -m tests.op_fuzz_child <device> <seed> <case> 1 <work dir> <report.json>``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.planting import REPO_ROOT
from zerofast.native import ops

CASES = int(os.environ.get("ZEROFAST_OP_FUZZ_CASES", "2400"))
SEED = int(os.environ.get("ZEROFAST_OP_FUZZ_SEED", "0"))
BATCH = 800
SECONDS_PER_BATCH = 120  # a batch takes a few seconds; past this it hangs


def _run_batches(device: str, tmp_path) -> list[str]:
    problems = []
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONDONTWRITEBYTECODE="1", ZEROFAST_NATIVE="1")
    for first in range(0, CASES, BATCH):
        count = min(BATCH, CASES - first)
        work, report = tmp_path / f"batch{first}", tmp_path / f"report{first}.json"
        args = [sys.executable, "-m", "tests.op_fuzz_child", device, str(SEED), str(first), str(count), str(work),
                str(report)]
        try:
            proc = subprocess.run(args, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                                  timeout=SECONDS_PER_BATCH)
        except subprocess.TimeoutExpired as e:
            last = (e.stdout or b"").decode(errors="replace").strip().splitlines()[-1:]
            problems.append(f"seed {SEED}: the batch from case {first} hung at {last}")
            continue
        last = proc.stdout.strip().splitlines()[-2:-1]  # the line before "done", or the case it died in
        if proc.returncode != 0 or not report.exists():
            died = proc.stdout.strip().splitlines()[-1:]
            problems.append(f"seed {SEED}: the batch from case {first} died ({proc.returncode}) at {died}: "
                            f"{proc.stderr[-1500:]}")
            continue
        assert proc.stdout.strip().splitlines()[-1] == "done", last
        problems += [f"seed {SEED} {json.dumps(f)}" for f in json.loads(report.read_text())]
    return problems


def test_no_op_argument_crashes_the_cpu_kernels(tmp_path):
    ops.load_native()
    problems = _run_batches("cpu", tmp_path)
    assert problems == [], "\n".join(problems[:20]) + f"\n{len(problems)} problems in {CASES} cases"


def test_no_op_argument_crashes_the_cuda_kernel(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no GPU visible: the CUDA kernel's arguments are fuzzed where one is")
    if "cuda" not in ops.built_devices():
        pytest.skip("the native core was built without its CUDA kernels (no nvcc when it was built)")
    problems = _run_batches("cuda", tmp_path)
    assert problems == [], "\n".join(problems[:20]) + f"\n{len(problems)} problems in {CASES} cases"
