"""Structure-aware fuzzing: one value or dict key anywhere in a real rank file's object tree is
replaced by a value of another type or size, and zerofast must answer with a ZeroFastError (or
succeed): no raw exception, no crash, no hang, no unbounded memory.

The cases run in a child process (tests/fuzz_child.py) under an address-space limit and a
timeout. ZEROFAST_FUZZ_CASES sets the number of cases per layout (default 200),
ZEROFAST_FUZZ_SEED the seed (default 0).
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest

from tests.conftest import needs_deepspeed
from tests.dsgen.catalog import ensure_checkpoint
from tests.planting import REPO_ROOT

pytestmark = needs_deepspeed

CASES = int(os.environ.get("ZEROFAST_FUZZ_CASES", "200"))
SEED = int(os.environ.get("ZEROFAST_FUZZ_SEED", "0"))
ADDRESS_SPACE = 6 << 30  # torch alone maps about 2 GiB of address space
SECONDS_PER_CASE = 2.0


def run_limited(args: list[str], timeout: float, address_space: int = ADDRESS_SPACE) -> subprocess.CompletedProcess:
    """A child under RLIMIT_AS: a memory bomb fails there instead of swapping the machine."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))

    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run(args, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=limit)


@pytest.mark.parametrize("layout, seed", [("s2_bf16_w2_frozen_tied", SEED), ("s3_bf16_w2_frozen_tied", SEED + 1)])
def test_mutated_object_trees_give_typed_errors(tmp_path, layout, seed):
    pristine = ensure_checkpoint(layout)
    report = tmp_path / "report.json"
    try:
        proc = run_limited([sys.executable, "-m", "tests.fuzz_child", str(pristine), str(tmp_path), str(seed),
                            str(CASES), str(report)], timeout=60 + SECONDS_PER_CASE * CASES)
    except subprocess.TimeoutExpired as e:
        last = (e.stdout or b"").decode(errors="replace").strip().splitlines()[-1:]
        pytest.fail(f"the fuzzer hung at {last}")
    last = proc.stdout.strip().splitlines()[-1:]
    assert proc.returncode == 0, f"the child died ({proc.returncode}) at {last}: {proc.stderr[-3000:]}"
    failures = json.loads(report.read_text())
    assert failures == [], "\n\n".join(f"{f['case']}\n{f['traceback']}" for f in failures[:5]) + \
        f"\n\n{len(failures)} of {CASES} cases raised a raw exception"
