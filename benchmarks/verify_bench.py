"""Costs of ``zerofast verify`` and ``verify --against`` next to an export of the same checkpoint.

    python -m benchmarks.verify_bench --params 100e6 --rounds 3

Every measurement is a fresh process (``python -c``) timed from after its imports; cases alternate
within a round; the table gives medians over the rounds, the ratio to a plain export of the same
checkpoint (safetensors, fp32, 1 GB shards) and to an export that also writes the optimizer states
(which reads every byte ``verify`` reads), and the peak RSS of each process. Results go to
``benchmarks/results/verify-<time>.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.generate import ensure

HERE = Path(__file__).resolve().parent
CHILD = """
import sys, time
import torch, zerofast
case, ckpt, out = sys.argv[1:4]
t0 = time.perf_counter()
if case == "export":
    zerofast.export(ckpt, out, max_shard_size="1GB", overwrite=True)
elif case == "export_opt":
    zerofast.export(ckpt, out, max_shard_size="1GB", optimizer_states=True, overwrite=True)
elif case == "verify":
    assert zerofast.verify(ckpt).ok
elif case == "verify_against":
    assert zerofast.verify(out, against=ckpt).ok
seconds = time.perf_counter() - t0
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent across fork and exec.
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(seconds, hwm / 1024)
"""
CASES = ("export", "export_opt", "verify", "verify_against")


def run(case: str, ckpt: Path, out: Path) -> tuple[float, float]:
    if case.startswith("export"):
        shutil.rmtree(out, ignore_errors=True)
    target = out if case != "verify_against" else out.with_name("ref")
    proc = subprocess.run([sys.executable, "-c", CHILD, case, str(ckpt), str(target)], capture_output=True, text=True,
                          check=True)
    seconds, rss = proc.stdout.split()[-2:]
    return float(seconds), float(rss)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--root", type=Path, default=HERE / "data")
    ap.add_argument("--params", type=float, default=500e6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workloads", default="zero2_frozen,zero3")
    args = ap.parse_args()
    results = {}
    for name in args.workloads.split(","):
        ckpt = ensure(args.root, name, int(args.params), 4)
        scratch = Path(tempfile.mkdtemp(prefix="zf-verify-bench-", dir=args.root))
        try:
            run("export", ckpt, scratch / "ref")  # what verify --against reads back
            runs = {c: [] for c in CASES}
            for _ in range(args.rounds):
                for case in CASES:
                    runs[case].append(run(case, ckpt, scratch / "out"))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        med = {c: (statistics.median(s for s, _ in r), max(m for _, m in r)) for c, r in runs.items()}
        results[name] = {"runs": runs, "median_s": {c: m[0] for c, m in med.items()},
                         "peak_rss_mib": {c: m[1] for c, m in med.items()}}
        for case in CASES:
            s, rss = med[case]
            print(f"{name:13s} {case:15s} {s:7.2f} s  {s / med['export'][0]:5.2f}x export  "
                  f"{s / med['export_opt'][0]:5.2f}x export+optimizer  {rss:6.0f} MiB", flush=True)
    out = HERE / "results" / f"verify-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"params": args.params, "rounds": args.rounds, "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))
    main()
