"""Helpers of tools/gpu_check.sh that run in fresh processes: the saves, the comparison with
DeepSpeed, the reader sweep, the no-CUDA-kernels check and the load time of the native core.

    python benchmarks/gpu_fresh.py synth    --root DIR --gb 4          # prints the save's folder
    python benchmarks/gpu_fresh.py fresh    --root DIR --gb 4 --json F --md F [--ds-path P] [--rounds 3]
    python benchmarks/gpu_fresh.py sweep    --root DIR --gb 4 --json F --md F [--rounds 3]
    python benchmarks/gpu_fresh.py compare  --root DIR --device cuda --json F [--expect-no-kernels]

The save is benchmarks/generate.py's ``zero3`` workload at world size 4, bf16 training, without
Adam's moments (reconstruct never reads them; they would only cost synthesis time and /dev/shm),
about ``--gb`` GB of fp32 masters.

``fresh`` and ``sweep`` time each figure in its own process, after its imports, with
benchmarks/case.py's cases (floor, zf_eager, ds_eager, zf_export, ds_export), alternating the
order from round to round, and report medians. Their JSON is rewritten after every measurement,
so a run cut short by its ``timeout`` still leaves what it measured. DeepSpeed's cases get
``--ds-path`` (where its wheels were installed) on their PYTHONPATH, and only they do.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
from benchmarks.case import model_like  # noqa: E402  (gpu_bench.py takes it from here too)

DS_CASES = ("ds_eager", "ds_export")


# ---------------------------------------------------------------------------------------------
# The saves


def save_dir(root: Path, gb: float) -> Path:
    return Path(root) / f"zero3-{gb:g}GB-w4"


def ensure_save(root: Path, gb: float) -> Path:
    """The ``zero3`` save of about ``gb`` GB of fp32 masters under ``root``, synthesized unless
    an identical one is there. Its workload.json records the bytes of its masters."""
    import dataclasses

    from benchmarks.generate import workload
    from zerofast.testing.synthesize import synthesize

    target = save_dir(root, gb)
    want = {"name": "zero3", "gb": gb, "world_size": 4, "moments": False}
    stamp = target / "workload.json"
    if stamp.is_file():
        have = json.loads(stamp.read_text())
        if {k: have.get(k) for k in want} == want:
            return target
    tmp = target.with_name(f".tmp-{target.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(target, ignore_errors=True)
    t0 = time.perf_counter()
    spec = dataclasses.replace(workload("zero3", int(gb * 1e9 / 4), 4), with_optimizer_states=False)
    truth = synthesize(tmp, spec)
    masters = sum(t.numel() * 4 for t in truth.trainable.values())
    del truth
    seconds = time.perf_counter() - t0
    (tmp / "workload.json").write_text(json.dumps({**want, "master_bytes": masters, "synth_s": seconds}))
    tmp.rename(target)
    print(f"synthesized {target} ({masters / 1e9:.2f} GB of fp32 masters) in {seconds:.1f} s", file=sys.stderr,
          flush=True)
    return target


def save_info(ckpt: Path) -> dict:
    info = json.loads((Path(ckpt) / "workload.json").read_text())
    info["file_bytes"] = sum(p.stat().st_size for p in Path(ckpt).rglob("*") if p.is_file())
    return info


def ensure_save_child(root: Path, gb: float) -> Path:
    """:func:`ensure_save` in a child process, so that the caller's heap and peak RSS never hold
    the synthesizer's tensors."""
    proc = subprocess.run([sys.executable, __file__, "synth", "--root", str(root), "--gb", repr(gb)],
                          stdout=subprocess.PIPE, text=True, env=child_env())
    if proc.returncode != 0:
        raise RuntimeError(f"synthesizing {gb} GB under {root} failed (rc {proc.returncode})")
    return Path(proc.stdout.strip().splitlines()[-1])


def warm(ckpt: Path) -> None:
    """Every file read once, as right after the training run that wrote them."""
    for p in sorted(Path(ckpt).rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                while f.read(1 << 24):
                    pass


# ---------------------------------------------------------------------------------------------
# Fresh processes


def child_env(ds_path: str | None = None, **extra: str) -> dict:
    """The environment of a measured child: this checkout first, DeepSpeed's folder only when asked."""
    paths = [str(REPO), *([ds_path] if ds_path else []), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p), **extra)


def measure(case: str, ckpt: Path, scratch: Path, ds_path: str | None = None, **env: str) -> dict:
    """One benchmarks/case.py case in a fresh process: its JSON line, plus the process's wall time."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(HERE / "case.py"), case, str(ckpt), str(scratch / case)],
                          capture_output=True, text=True,
                          env=child_env(ds_path if case.startswith("ds_") else None, **env))
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{case} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_seconds"] = wall
    return result


LOAD_NATIVE = r"""
import json, sys, time
import torch
import zerofast
from zerofast.native import ops
t0 = time.perf_counter()
ops.load_native()
load_s = time.perf_counter() - t0
after_load = torch.cuda.is_initialized()
t0 = time.perf_counter()
sd = zerofast.reconstruct(sys.argv[1])
cpu_s = time.perf_counter() - t0
print(json.dumps({"load_native_s": load_s, "cuda_initialized_by_load": after_load,
                  "cuda_initialized_by_cpu_reconstruct": torch.cuda.is_initialized(), "cpu_reconstruct_s": cpu_s,
                  "built_devices": list(ops.built_devices())}))
"""


def load_native_once(ckpt: Path) -> dict:
    """``ops.load_native()`` timed in a fresh process after ``import torch, zerofast``; then a CPU
    reconstruct, and whether either initialized CUDA (neither should)."""
    proc = subprocess.run([sys.executable, "-c", LOAD_NATIVE, str(ckpt)], capture_output=True, text=True,
                          env=child_env())
    if proc.returncode != 0:
        raise RuntimeError(f"load_native child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ds_imports(ds_path: str | None) -> str | None:
    """DeepSpeed's version where its converter imports (with ``ds_path`` on the PYTHONPATH), else None."""
    code = "import deepspeed; from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint; " \
           "print(deepspeed.__version__)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(ds_path))
    return proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 and proc.stdout.strip() else None


def _write(path: Path | None, value: dict) -> None:
    if path:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(value, indent=1) + "\n")
        tmp.replace(path)


def _medians(samples: list[dict]) -> dict:
    return {"seconds": statistics.median(s["seconds"] for s in samples),
            "process_seconds": statistics.median(s["process_seconds"] for s in samples),
            "peak_rss": statistics.median(s["peak_rss"] for s in samples), "bytes": samples[0]["bytes"],
            "all_seconds": [s["seconds"] for s in samples], "n": len(samples)}


def fresh_main(args) -> int:
    ckpt = ensure_save_child(args.root, args.gb)
    info = save_info(ckpt)
    scratch = Path(args.scratch or args.root) / "fresh-out"
    scratch.mkdir(parents=True, exist_ok=True)
    ds_version = ds_imports(args.ds_path) if args.deepspeed else None
    cases = ["floor", "zf_eager", "ds_eager", "zf_export", "ds_export"]
    if not ds_version:
        cases = [c for c in cases if c not in DS_CASES]
    report = {"save": info, "rounds": args.rounds, "deepspeed": ds_version, "cases": {}, "load_native": [],
              "complete": False, "cpus": os.cpu_count()}
    samples: dict[str, list[dict]] = {c: [] for c in cases}
    print(f"fresh processes on {ckpt}: {', '.join(cases)}; DeepSpeed {ds_version or 'not importable: its cases skipped'}",
          flush=True)
    warm(ckpt)
    try:
        for r in range(args.rounds):
            for case in (cases if r % 2 == 0 else list(reversed(cases))):
                s = measure(case, ckpt, scratch, args.ds_path)
                samples[case].append(s)
                report["cases"] = {c: _medians(v) for c, v in samples.items() if v}
                _write(args.json, report)
                print(f"  round {r + 1} {case:10s} {s['seconds']:7.3f} s  process {s['process_seconds']:6.2f} s  "
                      f"rss {s['peak_rss'] / 2**20:7.0f} MiB", flush=True)
            got = load_native_once(ckpt)
            report["load_native"].append(got)
            _write(args.json, report)
            print(f"  round {r + 1} load_native {got['load_native_s'] * 1e3:7.1f} ms; CUDA initialized by the load: "
                  f"{got['cuda_initialized_by_load']}, by a CPU reconstruct: {got['cuda_initialized_by_cpu_reconstruct']}",
                  flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return _finish(args, report, fresh_table)


def _finish(args, report: dict, table) -> int:
    """Mark the report complete, write its JSON, and print (and with --md write) its table."""
    report["complete"] = True
    _write(args.json, report)
    text = table(report)
    if args.md:
        args.md.write_text(text + "\n")
    print(text)
    return 0


def fresh_table(report: dict) -> str:
    c = report["cases"]
    gb = report["save"]["master_bytes"] / 1e9
    sec = lambda k: c[k]["seconds"] if k in c else None  # noqa: E731
    fmt = lambda v: f"{v:.3f} s" if v is not None else "not measured"  # noqa: E731
    ratio = lambda a, b: f"{a / b:.2f}x" if a is not None and b else ""  # noqa: E731
    floor = sec("floor")
    lines = [f"Fresh processes, warm page cache, {gb:.2f} GB of fp32 masters, medians of "
             f"{min((v['n'] for v in c.values()), default=0)} (timed after imports); DeepSpeed "
             f"{report['deepspeed'] or 'absent'}; ratio = DeepSpeed / zerofast",
             "", "| case | DeepSpeed | zerofast | ratio | zerofast / floor | zerofast GB/s of masters |",
             "|---|---|---|---|---|---|"]
    for label, ds, zf in ((f"warm eager ZeRO-3, {gb:.1f} GB", "ds_eager", "zf_eager"),
                          ("export safetensors fp32, 1 GB shards", "ds_export", "zf_export")):
        z = sec(zf)
        gbps = f"{gb / z:.1f}" if z else ""
        lines.append(f"| {label} | {fmt(sec(ds))} | {fmt(z)} | {ratio(sec(ds), z)} | {ratio(z, floor)} | {gbps} |")
    lines.append(f"| one plain copy of the masters (the floor) | | {fmt(floor)} | | | "
                 f"{f'{gb / floor:.1f}' if floor else ''} |")
    loads = report.get("load_native") or []
    if loads:
        ms = statistics.median(x["load_native_s"] for x in loads) * 1e3
        init = any(x["cuda_initialized_by_load"] or x["cuda_initialized_by_cpu_reconstruct"] for x in loads)
        lines.append(f"| `ops.load_native()` in a fresh process | | {ms:.1f} ms | | | |")
        lines.append("")
        lines.append(f"CUDA initialized by loading the core or by a device=\"cpu\" reconstruct: {'YES' if init else 'no'} "
                     f"(built devices: {', '.join(loads[-1]['built_devices'])})")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The reader sweep


def sweep_main(args) -> int:
    ckpt = ensure_save_child(args.root, args.gb)
    info = save_info(ckpt)
    scratch = Path(args.scratch or args.root) / "sweep-out"
    scratch.mkdir(parents=True, exist_ok=True)
    readers = [r.strip() for r in args.readers.split(",") if r.strip()]
    # The default (ZEROFAST_READERS unset) is max(16, torch's threads): the row of 16 on a 16-core machine.
    configs = [(r, h) for r in readers for h in args.hugepages.split(",")]
    samples: dict[str, list[dict]] = {f"{r}/{h}": [] for r, h in configs}
    report = {"save": info, "rounds": args.rounds, "cpus": os.cpu_count(), "configs": {}, "complete": False}
    print(f"reader sweep on {ckpt}: zf_eager (device=cpu, fp32) in fresh processes, {len(configs)} settings x "
          f"{args.rounds} rounds", flush=True)
    warm(ckpt)
    try:
        for r in range(args.rounds):  # round-major: a sweep cut short still has every setting once
            for readers_, huge in (configs if r % 2 == 0 else list(reversed(configs))):
                env = {"ZEROFAST_HUGEPAGES": huge}
                if readers_ != "default":
                    env["ZEROFAST_READERS"] = readers_
                s = measure("zf_eager", ckpt, scratch, **env)
                key = f"{readers_}/{huge}"
                samples[key].append(s)
                report["configs"] = {k: {**_medians(v), "readers": k.split("/")[0], "hugepages": k.split("/")[1]}
                                     for k, v in samples.items() if v}
                _write(args.json, report)
                print(f"  round {r + 1} readers {readers_:>7s} hugepages {huge}: {s['seconds']:7.3f} s "
                      f"({info['master_bytes'] / s['seconds'] / 1e9:5.1f} GB/s)", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return _finish(args, report, sweep_table)


def sweep_table(report: dict) -> str:
    gb = report["save"]["master_bytes"] / 1e9
    configs = report["configs"]
    huges = sorted({v["hugepages"] for v in configs.values()})
    readers = sorted({v["readers"] for v in configs.values()}, key=lambda r: (r != "default", int(r) if r.isdigit() else 0))
    lines = [f"Reader sweep: warm eager ZeRO-3 on the CPU (fp32, {gb:.2f} GB of masters, {report['cpus']} CPUs), "
             f"fresh processes, medians (s, GB/s of masters)", "",
             "| ZEROFAST_READERS | " + " | ".join(f"ZEROFAST_HUGEPAGES={h}" for h in huges) + " |",
             "|---|" + "---|" * len(huges)]
    for r in readers:
        cells = []
        for h in huges:
            m = configs.get(f"{r}/{h}")
            cells.append(f"{m['seconds']:.3f} s ({gb / m['seconds']:.1f}, n={m['n']})" if m else "")
        lines.append(f"| {r} | " + " | ".join(cells) + " |")
    if configs:
        best = min(configs.values(), key=lambda v: v["seconds"])
        lines += ["", f"Fastest: ZEROFAST_READERS={best['readers']} ZEROFAST_HUGEPAGES={best['hugepages']} "
                      f"({best['seconds']:.3f} s, {gb / best['seconds']:.1f} GB/s)"]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# device="cuda" without zerofast's CUDA kernels, bit for bit against the CPU


def compare_save(root: Path) -> Path:
    """A small ZeRO-3 save (world 4) with one tensor larger than a ring slot (so it is uploaded in
    pieces), a few hundred small ones of odd sizes and an int64 buffer: about 100 MB of masters."""
    import torch

    from zerofast.testing.synthesize import BufferSpec, LayoutSpec, ParamSpec, synthesize

    target = Path(root) / "compare-w4"
    if (target / "workload.json").is_file():
        return target
    shutil.rmtree(target, ignore_errors=True)
    params = [ParamSpec("big.weight", (4099, 4100))]  # 67.2 MB of fp32: larger than a 64 MiB slot
    params += [ParamSpec(f"small.{i}.weight", (i % 7 + 1, 33 + i % 5)) for i in range(300)]
    params += [ParamSpec(f"mid.{i}.weight", (1000 + i, 777)) for i in range(8)]
    spec = LayoutSpec(stage=3, world_size=4, model_dtype=torch.bfloat16, groups=[params[:150], params[150:]],
                      buffers=[BufferSpec("position_ids", (4096,), torch.int64)], with_optimizer_states=False)
    synthesize(target, spec)
    (target / "workload.json").write_text(json.dumps({"name": "compare"}))
    return target


def _bits(t):
    import torch

    t = t.detach().cpu().contiguous()
    if t.is_floating_point():
        return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])
    return t


def _same(a: dict, b: dict) -> str | None:
    import torch

    if list(a) != list(b):
        return f"names differ: {sorted(set(a) ^ set(b))[:5]}"
    for name in a:
        x, y = a[name], b[name]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(_bits(x), _bits(y)):
            return f"{name} differs ({x.dtype}{tuple(x.shape)} against {y.dtype}{tuple(y.shape)})"
    return None




def compare_main(args) -> int:
    import torch

    import zerofast
    from zerofast.native import ops

    ckpt = compare_save(args.root)
    built = list(ops.built_devices())
    checks: list[dict] = []

    def check(name: str, fn) -> None:
        t0 = time.perf_counter()
        try:
            problem = fn()
        except Exception as e:  # noqa: BLE001 -- reported as the check's failure
            problem = f"{type(e).__name__}: {e}"
        checks.append({"check": name, "ok": problem is None, "problem": problem, "seconds": time.perf_counter() - t0})
        print(f"  {'PASS' if problem is None else 'FAIL'} {name}" + (f": {problem}" if problem else ""), flush=True)

    print(f"device={args.device!r} on {ckpt}; the core's built devices: {built}; "
          f"{'expecting no CUDA kernels' if args.expect_no_kernels else ''}", flush=True)
    if args.expect_no_kernels:
        check("the core has no CUDA kernels", lambda: None if "cuda" not in built else
              f"built devices {built}: the setting that switches the kernels off was not honoured")
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    for dtype in (torch.float32, torch.bfloat16, None):
        def eager(dtype=dtype):
            cpu = zerofast.reconstruct(ckpt, dtype=dtype)
            dev = zerofast.reconstruct(ckpt, dtype=dtype, device=args.device)
            sync()
            wrong = [k for k, v in dev.items() if v.device.type != args.device]
            return f"{wrong[:3]} not on {args.device}" if wrong else _same(dev, cpu)
        check(f"reconstruct eager {dtype}", eager)

    def lazy():
        cpu = zerofast.reconstruct(ckpt, dtype=torch.bfloat16)
        sd = zerofast.reconstruct(ckpt, dtype=torch.bfloat16, lazy=True, device=args.device)
        return _same({k: sd[k] for k in sd}, cpu)
    check("reconstruct lazy bf16, every tensor once", lazy)

    def load_into():
        cpu = zerofast.reconstruct(ckpt)
        model = model_like(zerofast.reconstruct(ckpt, lazy=True), args.device, torch.float32)
        zerofast.load_into(model, ckpt)
        sync()
        return _same(dict(model.state_dict()), cpu)
    check("load_into a model on the device, fp32", load_into)

    def export():
        out = Path(args.root) / "compare-export"
        shutil.rmtree(out, ignore_errors=True)
        try:
            zerofast.export(ckpt, out / "cpu", dtype=torch.bfloat16, max_shard_size="20MB")
            zerofast.export(ckpt, out / "dev", dtype=torch.bfloat16, max_shard_size="20MB", device=args.device)
            a = {p.name: p.read_bytes() for p in sorted((out / "cpu").iterdir()) if p.is_file()}
            b = {p.name: p.read_bytes() for p in sorted((out / "dev").iterdir()) if p.is_file()}
            if list(a) != list(b):
                return f"files differ: {sorted(set(a) ^ set(b))}"
            bad = [n for n in a if a[n] != b[n]]
            return f"bytes differ in {bad}" if bad else None
        finally:
            shutil.rmtree(out, ignore_errors=True)
    check("export safetensors bf16, the same bytes", export)
    ok = all(c["ok"] for c in checks)
    _write(args.json, {"device": args.device, "built_devices": built, "expect_no_kernels": args.expect_no_kernels,
                       "env": {k: os.environ.get(k) for k in ("ZEROFAST_CUDA_KERNELS", "CUDA_HOME", "FORCE_CUDA")},
                       "checks": checks, "ok": ok})
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("synth", "fresh", "sweep", "compare"):
        p = sub.add_parser(name)
        p.add_argument("--root", type=Path, required=True, help="where the saves live (tmpfs: /dev/shm/...)")
        p.add_argument("--gb", type=float, default=4.0, help="GB of fp32 masters of the save")
        p.add_argument("--json", type=Path)
        p.add_argument("--md", type=Path)
        p.add_argument("--rounds", type=int, default=3)
        p.add_argument("--scratch", type=Path, help="where outputs are written (default: --root)")
        p.add_argument("--ds-path", default=None, help="DeepSpeed's install folder, on DeepSpeed's PYTHONPATH only")
        p.add_argument("--no-deepspeed", dest="deepspeed", action="store_false")
        p.add_argument("--readers", default="1,2,4,8,16,32")
        p.add_argument("--hugepages", default="0,1")
        p.add_argument("--device", default="cuda")
        p.add_argument("--expect-no-kernels", action="store_true")
    args = ap.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    if args.cmd == "synth":
        print(ensure_save(args.root, args.gb))
        return 0
    return {"fresh": fresh_main, "sweep": sweep_main, "compare": compare_main}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
