"""Run one of the suite's torchrun jobs many times and count how its runs ended (issue 46).

A torchrun job of the suite sometimes dies at exit with "terminate called without an active
exception" (a rank killed by SIGABRT). This runs one job the way the tests run it, N times, and
counts the outcomes: ``ok``, ``signal:<NAME>`` (the first failing rank was killed by a signal, as
torchrun's "Root Cause" summary says), ``port`` (the port was taken, not the job's fault), or
``error`` (a rank's own exception). ``terminate`` counts the runs whose output holds the abort's
message, whatever their exit.

    python -m tools.torchrun_loop --runs 50 --job train                 # DeepSpeed's generator
    python -m tools.torchrun_loop --runs 50 --job fsdp2 --world 4       # the FSDP2 DCP generator
    python -m tools.torchrun_loop --runs 50 --job train --root /tmp/old # another tree's scripts

Jobs: ``train`` is tests/dsgen/train.py with a catalog layout (``--layout``, default
``s1_bf16_w2_frozen``, its world size); ``fsdp2`` is tests/dsgen/dcp.py at ``--world``. Each run
writes into a fresh temporary folder, removed after. ``--root`` runs the scripts of another
checkout (a ``git archive`` of an older commit, for a before/after count). ``--log`` appends one
JSON line per run, ``--keep`` the output of each run that did not end ok (with every thread's
Python stack of an aborted rank: the ranks run with ``PYTHONFAULTHANDLER=1``). Start two loops at
once to add load, as a CI machine has.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_EXITCODE = re.compile(r"exitcode\s*:\s*(-?\d+)")
_SIGNAL = re.compile(r"Signal (\d+) \((SIG\w+)\) received by PID")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(args, root: Path, out: Path) -> list[str]:
    if args.job == "train":
        sys.path.insert(0, str(REPO))
        from tests.dsgen.catalog import ALL_LAYOUTS

        spec = ALL_LAYOUTS[args.layout]
        script, world, rest = root / "tests" / "dsgen" / "train.py", spec["world_size"], [json.dumps(spec), str(out)]
    else:
        script, world, rest = root / "tests" / "dsgen" / "dcp.py", args.world, [str(out)]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_addr",
            "127.0.0.1", "--master_port", str(_free_port()), str(script), *rest]


def outcome(returncode: int, output: str) -> str:
    """How one run ended: ok, port, signal:<NAME>, or error."""
    if returncode == 0:
        return "ok"
    if "address already in use" in output.lower():
        return "port"
    root = output.rfind("Root Cause")
    first = _EXITCODE.search(output, root) if root >= 0 else None
    if first is not None and int(first.group(1)) < 0:
        import signal

        code = -int(first.group(1))
        try:
            return f"signal:{signal.Signals(code).name}"
        except ValueError:
            return f"signal:{code}"
    return "error"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--job", choices=("train", "fsdp2"), default="train")
    ap.add_argument("--layout", default="s1_bf16_w2_frozen")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--root", type=Path, default=REPO, help="the checkout whose scripts run (default: this one)")
    ap.add_argument("--log", type=Path, help="append one JSON line per run here")
    ap.add_argument("--keep", type=Path, help="save the output of each run that did not end ok into this folder")
    args = ap.parse_args(argv)

    root = args.root.resolve()
    # faulthandler: an aborted rank prints every thread's Python stack (in the job, or at exit?)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "ZEROFAST_NATIVE": "0",
           "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    counts: collections.Counter = collections.Counter()
    t_start = time.monotonic()
    for i in range(args.runs):
        tmp = Path(tempfile.mkdtemp(prefix="torchrun-loop-"))
        try:
            cmd = _command(args, root, tmp / "out")
            t0 = time.monotonic()
            try:
                proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
                rc, output = proc.returncode, proc.stdout + proc.stderr
            except subprocess.TimeoutExpired as e:
                rc, output = None, str(e.stderr or "")
            seconds = time.monotonic() - t0
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        end = "timeout" if rc is None else outcome(rc, output)
        counts[end] += 1
        terminate = "terminate called without an active exception" in output
        counts["terminate"] += terminate
        if end != "ok" and args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            (args.keep / f"run{i:03d}-{end.replace(':', '_')}.txt").write_text(output)
        record = {"run": i, "job": args.job, "end": end, "rc": rc, "terminate": terminate, "s": round(seconds, 1),
                  "signals": sorted(set(m.group(2) for m in _SIGNAL.finditer(output)))}
        if args.log:
            with args.log.open("a") as f:
                f.write(json.dumps(record) + "\n")
        print(json.dumps(record), flush=True)
    summary = {"job": args.job, "layout": args.layout if args.job == "train" else None,
               "world": args.world if args.job == "fsdp2" else None, "root": str(root), "runs": args.runs,
               "minutes": round((time.monotonic() - t_start) / 60, 1), "cores": os.cpu_count(), **counts}
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
