"""The native reader's time on one rank file, and ``prepare`` on one checkpoint: this checkout
against --baseline, in the same run.

Each round starts one fresh process per checkout (alternating); in it, after imports and one
warm-up, ``index_archive`` + ``reader.read_native`` of FILE runs --loops times with the cyclic
collector paused (as ``load_archive`` runs it), and ``prepare`` of CKPT --loops times;
the process reports the median of each, wall and CPU (``time.process_time``, all threads: what
a machine shared with other jobs moves least). The table gives the median over rounds and the
ratio baseline / this checkout, which the machine's load moves less than either figure.

    python benchmarks/native_read.py --baseline /work/wt/base --rounds 5 \\
        --file /work/bench-data/many_small-50M-w4/global_step1/zero_pp_rank_0_mp_rank_00_model_states.pt \\
        --ckpt /work/bench-data/ds_zero2_20k
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
KINDS = ("read", "prepare", "read_cpu", "prepare_cpu")  # wall seconds; CPU seconds of all threads

CHILD = """
import gc, json, statistics, sys, time
from pathlib import Path
import zerofast
from zerofast.load import reader
from zerofast.load.archive import index_archive
from zerofast.prepare import prepare
path, ckpt, loops = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
core = reader.native_core()
assert core is not None, "no native core"

def read():
    with reader.collector_paused():
        t, c = time.perf_counter(), time.process_time()
        ok, tree = reader.read_native(path, index_archive(path), core)
        took = time.perf_counter() - t, time.process_time() - c
    assert ok, tree
    del tree
    return took

def prep():
    t, c = time.perf_counter(), time.process_time()
    prepare(ckpt)
    return time.perf_counter() - t, time.process_time() - c

read(), prep()
reads = [read() for _ in range(loops)]
preps = [prep() for _ in range(loops)]
med = lambda xs, i: statistics.median(x[i] for x in xs)
print(json.dumps({"read": med(reads, 0), "prepare": med(preps, 0), "read_cpu": med(reads, 1),
                  "prepare_cpu": med(preps, 1), "zerofast": zerofast.__file__}))
"""


def measure(checkout: Path, path: Path, ckpt: Path, loops: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(checkout), ZEROFAST_NATIVE="1")
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), str(ckpt), str(loops)], env=env, cwd=str(checkout),
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--file", type=Path, required=True, help="one torch.save rank file")
    ap.add_argument("--ckpt", type=Path, required=True, help="a checkpoint folder for prepare")
    ap.add_argument("--baseline", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--loops", type=int, default=5)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    checkouts = {"this": HERE.parent, "baseline": args.baseline.resolve()}
    runs: dict[str, list[dict]] = {name: [] for name in checkouts}
    for _ in range(args.rounds):
        for name, checkout in checkouts.items():
            runs[name].append(measure(checkout, args.file, args.ckpt, args.loops))
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in KINDS} for name, rs in runs.items()}
    result = {"file": str(args.file), "ckpt": str(args.ckpt), "rounds": args.rounds, "loops": args.loops,
              "runs": runs, "medians": medians,
              "baseline_over_this": {k: medians["baseline"][k] / medians["this"][k] for k in KINDS}}
    args.out.mkdir(parents=True, exist_ok=True)
    target = args.out / f"native-read-{time.strftime('%Y%m%d-%H%M%S')}.json"
    target.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'':12} {'this s':>8} {'baseline s':>10} {'ratio':>6}")
    for k in KINDS:
        print(f"{k:12} {medians['this'][k]:8.4f} {medians['baseline'][k]:10.4f} {result['baseline_over_this'][k]:5.2f}x")
    print(f"results: {target}")


if __name__ == "__main__":
    main()
