"""What each tensor costs after the rank files are read: planning, and the eager dict over prepare.

``python benchmarks/plan_cost.py --data DIR --workloads ds_zero2_20k,many_small-50M-w4
--baseline OTHER_CHECKOUT``: every measurement in a fresh process (``--one``), this checkout and
the baseline alternating, ``--rounds`` rounds. Per process: ``build_plan`` over the loaded
checkpoint (median of 5, collector paused as prepare pauses it), ``prepare`` and the eager dict's
time over it (median of 3), and the first eager dict of the process on its own. The report is
the median over the rounds and the ratios to the baseline; results go to
benchmarks/results/plan-cost-<timestamp>.json.
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
KEYS = ("build_plan", "prepare", "eager_over_prepare", "first_eager_over_prepare")


def one(ckpt: str) -> dict:
    import gc

    import torch

    from zerofast.prepare import prepare
    from zerofast.plan import SourceTable, build_plan
    from zerofast.results import eager_state_dict

    def timed(f):
        t0 = time.perf_counter()
        out = f()
        return time.perf_counter() - t0, out

    first_prepare, p = timed(lambda: prepare(ckpt))
    first_eager, sd = timed(lambda: eager_state_dict(p.plan, p.streaming_executor()))
    del sd
    gc.disable()
    plans = [timed(lambda: build_plan(p.checkpoint, SourceTable(), torch.float32))[0] for _ in range(5)]
    gc.enable()
    pairs = []
    for _ in range(3):
        t_prepare, q = timed(lambda: prepare(ckpt))
        t_eager, sd = timed(lambda q=q: eager_state_dict(q.plan, q.streaming_executor()))
        pairs.append((t_prepare, t_eager))
        del sd, q
    return {"build_plan": statistics.median(plans), "prepare": statistics.median(a for a, _ in pairs),
            "eager_over_prepare": statistics.median(b for _, b in pairs), "first_eager_over_prepare": first_eager,
            "tensors": len(p.plan.tensors)}


def measure(tree: Path, ckpt: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "ZEROFAST_NATIVE": "1"}
    proc = subprocess.run([sys.executable, str(HERE / "plan_cost.py"), "--one", str(ckpt)], cwd=tree, env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--data", type=Path)
    ap.add_argument("--workloads", default="ds_zero2_20k,many_small-50M-w4")
    ap.add_argument("--baseline", type=Path, required=False)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one)))
        return
    trees = {"this": HERE.parent, **({"baseline": args.baseline} if args.baseline else {})}
    report = {}
    for workload in args.workloads.split(","):
        samples = {name: [] for name in trees}
        for r in range(args.rounds):
            for name, tree in (trees.items() if r % 2 == 0 else reversed(trees.items())):
                samples[name].append(measure(tree, args.data / workload))
                print(workload, r + 1, name, json.dumps(samples[name][-1]), flush=True)
        medians = {name: {k: statistics.median(s[k] for s in runs) for k in KEYS} for name, runs in samples.items()}
        ratios = {k: medians["this"][k] / medians["baseline"][k] for k in KEYS} if args.baseline else {}
        report[workload] = {"samples": samples, "medians": medians, "this_over_baseline": ratios}
        print(workload, json.dumps({"medians": medians, "this_over_baseline": ratios}, indent=1), flush=True)
    out = HERE / "results" / time.strftime("plan-cost-%Y%m%d-%H%M%S.json")
    out.write_text(json.dumps({"baseline": str(args.baseline), "rounds": args.rounds, "results": report}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
