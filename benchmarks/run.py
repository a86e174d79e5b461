"""zerofast against DeepSpeed 0.19.8 and against the copy floor, side by side in one run.

Each measurement runs in a fresh process (benchmarks/case.py); the cases of one round alternate
tools, and the table reports medians over the rounds. Warm runs read the files once first; cold
runs drop the page cache before each measurement (needs root; skipped with a note otherwise).
Results go to benchmarks/results/<timestamp>.json and a markdown table is printed.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from benchmarks.dcp_workload import ensure_dcp_workload  # noqa: E402
from benchmarks.generate import REAL, SMALL_PARAMS, ensure  # noqa: E402

# dict_floor is the memory floor of an eager dict (case.py): the zf_eager row's RSS is set against it.
EAGER = ["floor", "dict_floor", "zf_prepare", "zf_eager", "ds_eager", "zf_lazy", "zf_load_into"]
# A save of thousands of expert files, which DeepSpeed's converter cannot read: against cat.
MANY_FILES = ["cat_files", "dict_floor", "zf_prepare", "zf_eager", "zf_lazy", "zf_export"]
EXPORT = ["zf_export", "ds_export", "zf_export_bf16", "zf_export_2workers", "disk_write"]
RESUME = ["copy_files", "zf_reshard", "zf_to_universal", "ds_to_universal"]
# With --dcp: to-dcp against copying the save's files, and a DCP folder's export against torch's.
TO_DCP = ["copy_files", "zf_to_dcp"]
FROM_DCP = ["zf_export_dcp", "torch_dcp_to_torch_save"]
# With --baseline: the same zerofast cases run on another checkout, in the same rounds.
BASELINE = {"base_eager": "zf_eager", "base_lazy": "zf_lazy", "base_load_into": "zf_load_into",
            "base_export": "zf_export"}


def drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def warm(ckpt: Path) -> None:
    # Every file read once, as right after the training run that wrote them.
    for p in [*ckpt.rglob("*.pt"), *ckpt.rglob("*.distcp")]:
        with open(p, "rb") as f:
            while f.read(1 << 24):
                pass


def measure(case: str, ckpt: Path, scratch: Path, baseline: Path | None = None) -> dict:
    # The zerofast measured is the checkout this script is in (or --baseline's), not whatever
    # the environment has installed.
    env = dict(os.environ, PYTHONPATH=str(baseline if case in BASELINE else HERE.parent))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(HERE / "case.py"), BASELINE.get(case, case), str(ckpt),
                           str(scratch / case)], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{case} on {ckpt} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_seconds"] = wall
    return result


def run_rounds(cases, ckpt, scratch, rounds, cold, baseline=None) -> dict[str, list[dict]]:
    samples: dict[str, list[dict]] = {c: [] for c in cases}
    if not cold:
        warm(ckpt)  # once: 24 GB holds the checkpoint and the outputs, so it stays cached
    for r in range(rounds):
        order = cases if r % 2 == 0 else list(reversed(cases))  # alternate who goes first
        for case in order:
            if cold:
                drop_caches()
            samples[case].append(measure(case, ckpt, scratch, baseline))
            s = samples[case][-1]
            print(f"  round {r + 1} {'cold' if cold else 'warm'} {case:15s} {s['seconds']:7.2f}s "
                  f"rss {s['peak_rss'] / 2**20:7.0f} MiB", flush=True)
    return samples


def startup(rounds: int) -> str:
    """Process start: ``import zerofast`` against ``import torch``, fresh processes, alternating."""
    env = dict(os.environ, PYTHONPATH=str(HERE.parent))
    times: dict[str, list[float]] = {"torch": [], "zerofast": []}
    for _ in range(rounds):
        for module in times:
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-c", f"import {module}"], check=True, env=env)
            times[module].append(time.perf_counter() - t0)
    t, z = statistics.median(times["torch"]), statistics.median(times["zerofast"])
    return f"process start (median of {rounds}): import torch {t:.2f} s, import zerofast {z:.2f} s ({z / t:.2f}x)"


def median(samples, key) -> float:
    return statistics.median(s[key] for s in samples)


def summarize(samples: dict[str, list[dict]]) -> dict[str, dict]:
    return {c: {"seconds": median(s, "seconds"), "process_seconds": median(s, "process_seconds"),
                "peak_rss": median(s, "peak_rss"), "bytes": s[0]["bytes"],
                "gb_per_s": s[0]["bytes"] / median(s, "seconds") / 1e9} for c, s in samples.items() if s}


def table(results: dict) -> str:
    lines = ["| workload | cache | case | s (after imports) | s (process) | GB/s | peak RSS MiB | vs floor | rival / case |",
             "|---|---|---|---|---|---|---|---|---|"]
    # The last column is the rival's time over the case's: DeepSpeed against zerofast, and one
    # worker against two (the 1-vs-2 worker scaling of the export).
    rivals = {"zf_eager": "ds_eager", "zf_lazy": "ds_eager", "zf_export": "ds_export", "zf_export_bf16": "ds_export",
              "zf_export_2workers": "zf_export", "zf_to_universal": "ds_to_universal", "base_eager": "zf_eager",
              "base_export": "zf_export", "disk_write": "zf_export"}
    for (workload, cache), cases in results.items():
        for case, m in cases.items():
            floor = cases.get("copy_files" if case == "zf_reshard" else "floor", cases.get("cat_files", {})).get("seconds")
            vs_floor = f"{m['seconds'] / floor:.2f}x" if floor else ""
            rival = cases.get(rivals.get(case, ""), {}).get("seconds")
            speedup = f"{rival / m['seconds']:.2f}x" if rival else ""
            rss = f"{m['peak_rss'] / 2**20:.0f}"
            if case == "zf_eager" and "dict_floor" in cases:
                rss += f" ({m['peak_rss'] / cases['dict_floor']['peak_rss']:.2f}x dict_floor)"
            lines.append(f"| {workload} | {cache} | {case} | {m['seconds']:.2f} | {m['process_seconds']:.2f} | "
                         f"{m['gb_per_s']:.2f} | {rss} | {vs_floor} | {speedup} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", type=Path, default=HERE / "data")
    ap.add_argument("--params", type=float, default=500e6)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-cold", action="store_true")
    ap.add_argument("--no-export", action="store_true")
    ap.add_argument("--resume", action="store_true",
                    help="also measure reshard (against copying the files) and to-universal (against DeepSpeed's "
                         "ds_to_universal)")
    ap.add_argument("--dcp", action="store_true",
                    help="only the DCP cases: to-dcp of zero3 against copy_files, and the export of a 4-rank DCP "
                         "folder of --params against dcp_to_torch_save")
    ap.add_argument("--workloads", default="zero3,zero2_frozen,many_small,ds_zero2_20k",
                    help="comma-separated workloads to run (default: these; also many_small_1k, many_small_10k, "
                         "many_small_200k, ds_moe_1k)")
    ap.add_argument("--baseline", type=Path, help="another zerofast checkout (built) to time in the same rounds")
    ap.add_argument("--skip", default="", help="cases to leave out, comma-separated")
    args = ap.parse_args()
    has_ds = importlib.util.find_spec("deepspeed") is not None
    cases = EAGER + ([] if args.no_export else EXPORT) + (RESUME if args.resume else [])
    if args.baseline:
        cases += [b for b, c in BASELINE.items() if c in cases]
    cases = [c for c in cases if c not in args.skip.split(",")]
    if not has_ds:
        cases = [c for c in cases if not c.startswith("ds_")]
        print("DeepSpeed is not installed: its cases are skipped")
    modes = [False] + ([] if args.no_cold else [True])
    if not args.no_cold and not drop_caches():
        print("cannot drop the page cache (needs root): cold runs skipped")
        modes = [False]
    results, notes = {}, []
    if args.dcp:
        return _dcp_main(args, modes)
    with tempfile.TemporaryDirectory(dir=args.data.parent if args.data.parent.exists() else None) as scratch:
        for workload in args.workloads.split(","):
            ckpt = ensure(args.data, workload, SMALL_PARAMS.get(workload, int(args.params)), args.world_size)
            small = workload in SMALL_PARAMS or workload in REAL  # metadata-bound: eager cases, warm only
            for cold in modes if not small else [False]:
                print(f"{workload} ({'cold' if cold else 'warm'} cache)", flush=True)
                wanted = cases if not small else [c for c in cases if c in EAGER or BASELINE.get(c) in EAGER]
                if REAL.get(workload, {}).get("family") == "moe":
                    wanted = [c for c in MANY_FILES if c in cases or c == "cat_files"] + \
                             [c for c in ("base_eager", "base_export") if c in cases]
                samples = run_rounds(wanted, ckpt, Path(scratch), args.rounds, cold, args.baseline)
                results[(workload, "cold" if cold else "warm")] = summarize(samples)
    notes.append(startup(args.rounds + 2))
    print(notes[-1], flush=True)
    report = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
              "params": args.params, "world_size": args.world_size, "rounds": args.rounds, "notes": notes,
              "results": {f"{w}/{c}": v for (w, c), v in results.items()}}
    out = HERE / "results" / time.strftime("%Y%m%d-%H%M%S.json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(table(results))
    print(f"wrote {out}")


def _dcp_main(args, modes) -> None:
    results = {}
    with tempfile.TemporaryDirectory(dir=args.data.parent if args.data.parent.exists() else None) as scratch:
        runs = [("zero3", ensure(args.data, "zero3", int(args.params), args.world_size), TO_DCP),
                ("dcp_w4", ensure_dcp_workload(args.data, int(args.params)), FROM_DCP)]
        for workload, ckpt, cases in runs:
            for cold in modes:
                print(f"{workload} ({'cold' if cold else 'warm'} cache)", flush=True)
                results[(workload, "cold" if cold else "warm")] = summarize(
                    run_rounds(cases, ckpt, Path(scratch), args.rounds, cold))
    report = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
              "params": args.params, "world_size": args.world_size, "rounds": args.rounds,
              "results": {f"{w}/{c}": v for (w, c), v in results.items()}}
    out = HERE / "results" / time.strftime("dcp-%Y%m%d-%H%M%S.json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    lines = [table(results), "", "| workload | cache | case | s | peak RSS MiB | ratio |", "|---|---|---|---|---|---|"]
    for (workload, cache), m in results.items():
        for case, rival in (("zf_to_dcp", "copy_files"), ("zf_export_dcp", "torch_dcp_to_torch_save")):
            if case in m and rival in m:
                lines.append(f"| {workload} | {cache} | {case} vs {rival} | {m[case]['seconds']:.2f} vs "
                             f"{m[rival]['seconds']:.2f} | {m[case]['peak_rss'] / 2**20:.0f} vs "
                             f"{m[rival]['peak_rss'] / 2**20:.0f} | {m[case]['seconds'] / m[rival]['seconds']:.2f}x |")
    print("\n".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
