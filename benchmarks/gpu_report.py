"""The summary of tools/gpu_check.sh: its tables, issue 37's "Done when" targets checked, and the
time each stage took against its limit.

    python benchmarks/gpu_report.py OUT [--dry-run]

Reads what the stages left in OUT (bench-4GB.json, bench-12GB.json, fresh.json, sweep.json,
nokernels.json, stages.tsv), whatever of it is there, and writes OUT/summary.md and
OUT/targets.json; prints the summary. A target whose figures are missing is NOT MEASURED, with why.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from benchmarks import gpu_bench, gpu_fresh  # noqa: E402


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _secs(report: dict | None, key: str) -> float | None:
    row = (report or {}).get("rows", {}).get(key)
    return row["seconds"] if row and "seconds" in row else None


def targets(out: Path, stages: dict[str, dict]) -> list[dict]:
    got: list[dict] = []

    def add(target: str, value: str | None, ok: bool | None, why: str = "") -> None:
        status = "NOT MEASURED" if ok is None else ("PASS" if ok else "FAIL")
        got.append({"target": target, "status": status, "value": value or why})

    for label in ("4GB", "12GB"):
        bench = _load(out / f"bench-{label}.json")
        why = f"bench-{label}.json absent (stage {'bench' if label == '4GB' else 'big'} did not run)"
        if bench is None:
            add(f"{label}: device=\"cuda\" targets", None, None, why)
            continue
        gb = bench["master_bytes"] / 1e9
        label = f"{gb:.3g} GB"
        cpu = _secs(bench, "cpu_fp32")
        ds = _secs(bench, "deepspeed")
        for key in ("cuda_fp32", "cuda_bf16"):
            s = _secs(bench, key)
            name = f"{label} {key.replace('_', ' ')}"
            if s is None:
                add(f"{name} >= 20 GB/s", None, None, "not measured")
                continue
            add(f"{name} >= 20 GB/s of masters", f"{gb / s:.1f} GB/s ({s:.3f} s)", gb / s >= 20)
            add(f"{name} never slower than cpu fp32", f"{s:.3f} s vs cpu {cpu:.3f} s" if cpu else None,
                None if cpu is None else s <= cpu, "cpu fp32 not measured")
            add(f"{name} >= 3x DeepSpeed dict + .to(cuda)", f"{ds / s:.2f}x ({ds:.3f} s)" if ds else None,
                None if ds is None else ds / s >= 3, "DeepSpeed not measured (does not import)")
        if "lazy" in bench["rows"] or "load_into" in bench["rows"]:
            eager = _secs(bench, "cuda_fp32")
            for key, limit in (("lazy", 1.3), ("load_into", 1.1)):
                s = _secs(bench, key)
                ok = None if s is None or eager is None else s <= limit * eager
                add(f"{key} <= {limit}x eager cuda fp32", f"{s / eager:.2f}x ({s:.3f} s)" if ok is not None else None,
                    ok, "not measured")
        check = bench.get("rows", {}).get("cuda_fp32", {}).get("check")
        if check:
            add(f"{label} cuda fp32 equals cpu", check, "DIFFERS" not in check)
    fresh = _load(out / "fresh.json")
    c = (fresh or {}).get("cases", {})
    for name, ds, zf, limit in (("warm eager ZeRO-3 cpu >= 1.5x DeepSpeed (fresh)", "ds_eager", "zf_eager", 1.5),
                                ("export >= 3x DeepSpeed (fresh)", "ds_export", "zf_export", 3.0)):
        if ds in c and zf in c:
            r = c[ds]["seconds"] / c[zf]["seconds"]
            add(name, f"{r:.2f}x ({c[zf]['seconds']:.3f} s vs {c[ds]['seconds']:.3f} s)", r >= limit)
        else:
            add(name, None, None, "fresh.json absent" if fresh is None else "DeepSpeed not measured")
    if "zf_eager" in c and "floor" in c:
        r = c["zf_eager"]["seconds"] / c["floor"]["seconds"]
        add("warm eager ZeRO-3 cpu about 0.8x the plain-copy floor (for reference)", f"{r:.2f}x the floor", r <= 0.8)
    loads = (fresh or {}).get("load_native") or []
    if loads:
        ms = statistics.median(x["load_native_s"] for x in loads) * 1e3
        add("ops.load_native() in a fresh process <= 50 ms", f"{ms:.1f} ms (median of {len(loads)})", ms <= 50)
        init = any(x["cuda_initialized_by_load"] or x["cuda_initialized_by_cpu_reconstruct"] for x in loads)
        add("no CUDA context from loading the core or a cpu call", "CUDA initialized" if init else "none", not init)
    else:
        add("ops.load_native() in a fresh process <= 50 ms", None, None, "not measured")
    for file, how in (("nokernels.json", "the kernels switched off"), ("nokernels-nonvcc.json", "no nvcc found")):
        nok = _load(out / file)
        name = f"device=\"cuda\" with {how} equals cpu"
        if nok is None:
            add(name, None, None, f"{file} absent")
            continue
        bad = [x["check"] for x in nok["checks"] if not x["ok"]]
        add(f"{name} (core: {','.join(nok['built_devices'])})",
            f"{len(nok['checks']) - len(bad)}/{len(nok['checks'])} checks" + (f"; failed: {bad}" if bad else ""),
            not bad)
    t = stages.get("tests")
    if t and t["status"] != "skipped":
        add("cuda tests (tests/test_cuda.py, tests/test_ring.py)", t["status"] + _pytest_line(out / "tests.log"),
            t["status"] == "ok")
    else:
        add("cuda tests (tests/test_cuda.py, tests/test_ring.py)", None, None, "stage not run")
    b = stages.get("build")
    if b and b["status"] != "skipped":
        devices = (_load(out / "bench-4GB.json") or {}).get("built_devices")
        add("build with CUDA kernels", f"{b['status']}, {b['used']} s" + (f"; core: {','.join(devices)}" if devices else ""),
            b["status"] == "ok")
    return got


def _pytest_line(log: Path) -> str:
    try:
        lines = [ln for ln in log.read_text().splitlines() if " passed" in ln or " failed" in ln or " error" in ln]
    except OSError:
        return ""
    return f": {lines[-1].strip('= ')}" if lines else ""


def read_stages(out: Path) -> dict[str, dict]:
    stages: dict[str, dict] = {}
    try:
        rows = (out / "stages.tsv").read_text().splitlines()
    except OSError:
        return stages
    for row in rows:
        name, status, used, limit, expected = (row.split("\t") + [""] * 5)[:5]
        stages[name] = {"status": status, "used": used, "limit": limit, "expected": expected}
    return stages


def main() -> int:
    out = Path(sys.argv[1])
    dry = "--dry-run" in sys.argv
    stages = read_stages(out)
    parts = []
    if dry:
        parts.append("DRY RUN on the CPU (device=\"cpu\", tiny saves): the figures and verdicts below only show that "
                     "every stage runs; they measure nothing about a GPU.\n")
    for label in ("4GB", "12GB"):
        bench = _load(out / f"bench-{label}.json")
        if bench:
            gb = bench["master_bytes"] / 1e9
            parts.append(f"### In one process, {gb:.2f} GB of fp32 masters ({bench['device']}, {bench['cpu_threads']} "
                         f"CPU threads, best of {bench['repeat']}){'' if bench.get('complete') else ' (cut short)'}\n\n"
                         + gpu_bench.table(bench) + "\n")
    fresh = _load(out / "fresh.json")
    if fresh and fresh.get("cases"):
        parts.append("### Fresh processes" + ("" if fresh.get("complete") else " (cut short)") + "\n\n"
                     + gpu_fresh.fresh_table(fresh) + "\n")
    sweep = _load(out / "sweep.json")
    if sweep and sweep.get("configs"):
        parts.append("### CPU reader sweep" + ("" if sweep.get("complete") else " (cut short)") + "\n\n"
                     + gpu_fresh.sweep_table(sweep) + "\n")
    got = targets(out, stages)
    lines = ["### Issue 37's targets" + (" (dry run: not meaningful)" if dry else ""), "",
             "| target | status | measured |", "|---|---|---|"]
    lines += [f"| {t['target']} | {t['status']} | {t['value']} |" for t in got]
    parts.append("\n".join(lines) + "\n")
    lines = ["### Stages (seconds)", "", "| stage | status | used | limit | expected on the H200 |", "|---|---|---|---|---|"]
    lines += [f"| {n} | {s['status']} | {s['used']} | {s['limit']} | {s['expected']} |" for n, s in stages.items()]
    try:
        lines.append(f"\ntotal {sum(int(s['used'] or 0) for s in stages.values())} s")
    except ValueError:
        pass
    parts.append("\n".join(lines) + "\n")
    text = "\n".join(parts)
    (out / "summary.md").write_text(text)
    (out / "targets.json").write_text(json.dumps({"dry_run": dry, "targets": got, "stages": stages}, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
