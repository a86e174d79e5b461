"""What a new user waits for: ``zerofast --help`` / ``--version``, and the pure-torch fallback.

- ``--help`` and ``--version``: wall time of fresh processes (``python -m zerofast ...``), median
  of --rounds, next to a bare ``python -c pass`` (the floor: the interpreter starting).
- The fallback's slowdown: ``zerofast.reconstruct`` and ``zerofast.export`` of a synthesized
  ZeRO-3 checkpoint (benchmarks/generate.py's ``zero3`` shape, --params parameters) timed inside
  fresh processes, on the native core and with ``ZEROFAST_NATIVE=0``, alternating, median of
  --rounds each. The ratios are what the fallback warning quotes (zerofast/native/loader.py's
  SLOWDOWN).

    python benchmarks/startup.py [--rounds 5] [--params 50e6] [--startup-only]

Results go to benchmarks/results/startup-<timestamp>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

# Timed inside the process, so that the interpreter and torch starting are left out.
CASES = {
    "reconstruct": "sd = zerofast.reconstruct(sys.argv[1])",
    "export": "zerofast.export(sys.argv[1], tempfile.mkdtemp(dir=sys.argv[2]) + '/out')",
}
TIMED = """
import sys, tempfile, time, zerofast
from zerofast.native import ops
ops.load_native() if sys.argv[3] == "1" else None  # loading the core is not what is timed
t0 = time.perf_counter()
{case}
print(time.perf_counter() - t0)
"""


def _env(**extra: str) -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
                **extra)


def wall(cmd: list[str], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=_env(), cwd=REPO)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fallback_times(ckpt: Path, scratch: Path, rounds: int) -> dict[str, dict[str, float]]:
    """Each case on the native core and on the reference, alternating, in fresh processes."""
    runs = {case: {"native": [], "reference": []} for case in CASES}
    for _ in range(rounds):
        for case, code in CASES.items():
            for label, mode in (("native", "1"), ("reference", "0")):
                out = subprocess.run([sys.executable, "-c", TIMED.format(case=code), str(ckpt), str(scratch), mode],
                                     check=True, capture_output=True, text=True, env=_env(ZEROFAST_NATIVE=mode),
                                     cwd=REPO)
                runs[case][label].append(float(out.stdout.split()[-1]))
    return {case: {k: statistics.median(v) for k, v in r.items()} for case, r in runs.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--params", type=float, default=50e6)
    ap.add_argument("--root", type=Path, default=HERE / "data")
    ap.add_argument("--startup-only", action="store_true", help="only --help and --version, not the fallback")
    args = ap.parse_args()
    from benchmarks.generate import ensure

    py = sys.executable
    result = {"rounds": args.rounds, "load": os.getloadavg(),
              "python_pass_s": wall([py, "-c", "pass"], args.rounds),
              "help_s": wall([py, "-m", "zerofast", "--help"], args.rounds),
              "version_s": wall([py, "-m", "zerofast", "--version"], args.rounds)}
    result["fallback_s"] = {}
    if not args.startup_only:
        ckpt = ensure(args.root, "zero3", int(args.params), 4)
        with tempfile.TemporaryDirectory(prefix="zerofast-bench-") as scratch:
            result["fallback_s"] = fallback_times(ckpt, Path(scratch), args.rounds)
    result["params"] = int(args.params)
    result["fallback_slowdown"] = {case: r["reference"] / r["native"] for case, r in result["fallback_s"].items()}
    out = HERE / "results" / f"startup-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"python -c pass        {result['python_pass_s']:.3f} s (median of {args.rounds} fresh processes)\n"
          f"zerofast --help       {result['help_s']:.3f} s\n"
          f"zerofast --version    {result['version_s']:.3f} s")
    for case, r in result["fallback_s"].items():
        print(f"{case} ({args.params / 1e6:.0f}M params): native {r['native']:.3f} s, reference "
              f"{r['reference']:.3f} s ({result['fallback_slowdown'][case]:.1f}x)")
    print(f"load average {result['load'][0]:.1f}; written to {out.relative_to(REPO)}")

if __name__ == "__main__":
    main()
