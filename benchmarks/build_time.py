"""What a fresh machine waits for the native core: its build from an empty cache, against a
baseline checkout's build, alternating in the same run.

Each round builds the CPU core of this checkout and of ``--baseline`` (a worktree of an earlier
commit: ``git worktree add /tmp/base <commit>``) into an empty cache folder of its own, in a fresh
process (``python -c 'loader.build()'`` with the checkout on PYTHONPATH), and records the wall time
of the whole call (torch's builder, the compile, the proof) and the CPU time of the process and
its children. Medians of --rounds, their ratio, and the machine's core count and load go to
benchmarks/results/build-<timestamp>.json. The build is CPU-bound: on a busy machine the wall
times stretch, the CPU times much less, so both are kept.

    python benchmarks/build_time.py --baseline /tmp/base [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BUILD = "from zerofast.native import loader; loader.build(force=True)"


def build_once(checkout: Path) -> dict:
    """One build of ``checkout``'s CPU core into an empty cache: wall and CPU seconds."""
    with tempfile.TemporaryDirectory(prefix="zerofast-build-bench-") as cache:
        env = {**os.environ, "ZEROFAST_CACHE_DIR": cache, "PYTHONPATH": str(checkout), "ZEROFAST_CUDA_KERNELS": "0"}
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-c", BUILD], env=env, capture_output=True, text=True, cwd=cache)
        wall = time.monotonic() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    said = [ln for ln in done.stderr.splitlines() if ln.startswith("zerofast: built the native core in")]
    if done.returncode != 0 or not said:  # a run that compiled nothing must not count as a build
        raise SystemExit(f"the build of {checkout} failed or did not compile:\n{done.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "load": round(os.getloadavg()[0], 2), "said": said[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, required=True, help="a checkout of the commit to compare with")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {"this": [], "baseline": []}
    for i in range(args.rounds):
        for name, checkout in (("this", REPO), ("baseline", args.baseline)):
            runs[name].append(build_once(checkout))
            print(f"round {i + 1} {name}: {runs[name][-1]}", flush=True)
    summary = {name: {k: statistics.median(r[k] for r in rs) for k in ("wall_s", "cpu_s")} for name, rs in runs.items()}
    ratio = {k: round(summary["baseline"][k] / summary["this"][k], 2) for k in ("wall_s", "cpu_s")}
    record = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
              "baseline": str(args.baseline), "rounds": args.rounds, "runs": runs, "median": summary,
              "baseline_over_this": ratio, "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    out = HERE / "results" / f"build-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({"median": summary, "baseline_over_this": ratio}), f"\n-> {out}")


if __name__ == "__main__":
    main()
