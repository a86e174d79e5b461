"""CPU seconds of the eager fp32 dict, zerofast (this checkout and --baseline) against DeepSpeed.

On a machine shared with other jobs, wall-clock medians swing by 2-5x between rounds; the CPU
time a process spends (``time.process_time``, all its threads) moves far less, so it is the
figure to compare there. Each measurement is a fresh process, cases alternating per round; the
table gives the median of the rounds, wall and CPU, and DeepSpeed's CPU over each zerofast's.

    python benchmarks/cpu_time.py --data /work/bench-data --workloads ds_zero2_20k,many_small-50M-w4 \
        --baseline /path/to/other/checkout --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHILD = """
import json, sys, time
ckpt, case = sys.argv[1], sys.argv[2]
if case == "ds":
    import os
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint as run
else:
    import zerofast
    from zerofast.native import ops
    ops.load_native() if ops.native_enabled() else None
    run = zerofast.reconstruct
t, c = time.perf_counter(), time.process_time()
sd = run(ckpt)
import zerofast
print(json.dumps({"wall": time.perf_counter() - t, "cpu": time.process_time() - c, "tensors": len(sd),
                  "zerofast": zerofast.__file__}))
"""


def measure(ckpt: Path, case: str, checkout: Path | None) -> dict:
    # Run from the measured checkout: ``python -c`` puts the working directory first on sys.path.
    where = str(checkout or HERE.parent)
    out = subprocess.run([sys.executable, "-c", CHILD, str(ckpt), case], env=dict(os.environ, PYTHONPATH=where),
                         cwd=where, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--workloads", default="ds_zero2_20k,many_small-50M-w4")
    ap.add_argument("--baseline", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    cases = {"zerofast": ("zf", None), "DeepSpeed": ("ds", None)}
    if args.baseline:
        cases["before"] = ("zf", args.baseline)
    report = {}
    for workload in args.workloads.split(","):
        samples: dict[str, list[dict]] = {name: [] for name in cases}
        for r in range(args.rounds):
            order = list(cases) if r % 2 == 0 else list(reversed(cases))
            for name in order:
                samples[name].append(measure(args.data / workload, *cases[name]))
                print(f"  {workload} round {r + 1} {name}: {samples[name][-1]}", flush=True)
        report[workload] = {name: {k: statistics.median(s[k] for s in got) for k in ("wall", "cpu")} | {"samples": got}
                            for name, got in samples.items()}
    print("| workload | tool | wall s | CPU s | DeepSpeed CPU / CPU |")
    print("|---|---|---|---|---|")
    for workload, tools in report.items():
        for name, m in tools.items():
            print(f"| {workload} | {name} | {m['wall']:.2f} | {m['cpu']:.2f} | {tools['DeepSpeed']['cpu'] / m['cpu']:.2f}x |")
    out = HERE / "results" / time.strftime("cpu-%Y%m%d-%H%M%S.json")
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
