"""device="cuda" against the CPU and the floors, in one process; run by tools/gpu_check.sh.

The save is benchmarks/generate.py's ``zero3`` workload, world size 4, bf16 training, without
Adam's moments, about ``--gb`` GB of fp32 masters, on tmpfs (benchmarks/gpu_fresh.py synthesizes
it in a child process). Every case is timed ``--repeat`` times (best of, default 2) after the
files were read once, so it compares the executors, not the disk. GB/s are of fp32 masters.

Cases (``--cases``, comma-separated; default all):
- floors: ``read`` (every file of the save read once from the page cache, one thread per core,
  into reused buffers), ``copy`` (one plain copy of the fp32 masters into one fresh buffer),
  ``pinned`` and ``pageable`` (host-to-device copies of the same bytes into a GPU buffer);
- ``cpu_fp32``: ``reconstruct(device="cpu")``; ``cuda_fp32``, ``cuda_bf16``: ``device="cuda"``;
- ``lazy``: the lazy mapping on cuda, every tensor looked up once;
- ``load_into``: ``zerofast.load_into`` a module of fp32 tensors on the GPU;
- ``export_cpu``, ``export_cuda``: safetensors fp32, 1 GB shards, onto tmpfs;
- ``deepspeed``: DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint``, then ``.to("cuda")``
  of every tensor, in a child process with ``--ds-path`` on its PYTHONPATH (best of ``--repeat``).

``--device cpu`` is a dry run for a machine without a GPU: the cuda cases run on the CPU, the
host-to-device floors are left out. The JSON (``--json``) is rewritten after every case.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import zerofast  # noqa: E402
from benchmarks import gpu_fresh  # noqa: E402
from zerofast.native import ops  # noqa: E402

ALL = ["read", "copy", "pinned", "pageable", "cpu_fp32", "cuda_fp32", "cuda_bf16", "lazy", "load_into",
       "export_cpu", "export_cuda", "deepspeed"]
LABELS = {
    "read": "reading every file once from the page cache",
    "copy": "one plain copy of the fp32 masters into one buffer",
    "pinned": "pinned host-to-device copy of the same bytes",
    "pageable": "pageable host-to-device copy",
    "cpu_fp32": 'reconstruct(device="cpu") fp32',
    "cuda_fp32": 'reconstruct(device="cuda") fp32',
    "cuda_bf16": 'reconstruct(device="cuda") bf16',
    "lazy": "lazy on cuda, every tensor once",
    "load_into": "load_into a GPU model (fp32)",
    "export_cpu": "export safetensors fp32, cpu",
    "export_cuda": "export safetensors fp32, cuda",
    "deepspeed": 'DeepSpeed get_fp32_state_dict_from_zero_checkpoint, then .to("cuda")',
}

DEVICE = "cuda"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def best_of(fn: Callable[[], object], repeat: int) -> list[float]:
    """Each run's seconds; the result of a run is dropped before the next starts."""
    times = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        result = fn()
        sync()
        times.append(time.perf_counter() - t0)
        del result
    return times


# ---------------------------------------------------------------------------------------------
# The floors


def read_floor(files: list[Path], repeat: int) -> list[float]:
    """Every file read once with pread, split in 64 MiB pieces over one thread per core."""
    pieces = [(f, off, min(64 << 20, f.stat().st_size - off)) for f in files for off in range(0, f.stat().st_size, 64 << 20)]
    threads = min(len(pieces), os.cpu_count() or 1) or 1

    def run():
        lock, nxt = threading.Lock(), [0]

        def worker():
            buf = bytearray(64 << 20)
            fds: dict[Path, int] = {}
            try:
                while True:
                    with lock:
                        i = nxt[0]
                        nxt[0] += 1
                    if i >= len(pieces):
                        return
                    f, off, n = pieces[i]
                    fd = fds.get(f) or fds.setdefault(f, os.open(f, os.O_RDONLY))
                    view, got = memoryview(buf)[:n], 0
                    while got < n:
                        got += os.preadv(fd, [view[got:]], off + got) or n
            finally:
                for fd in fds.values():
                    os.close(fd)

        ts = [threading.Thread(target=worker) for _ in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    return best_of(run, repeat)


def master_sources(ckpt: Path) -> list[torch.Tensor]:
    """The fp32 flat master partitions of the save, memory-mapped (what reconstruct reads)."""
    from zerofast.prepare import prepare

    return [s for s in prepare(ckpt).sources if s.dtype == torch.float32]


def copy_floor(sources: list[torch.Tensor], repeat: int, keep: list) -> list[float]:
    """One fresh buffer of every master byte, filled by torch's copy from the mapped files."""
    total = sum(s.numel() for s in sources)

    def run():
        keep.clear()
        out = torch.empty(total, dtype=torch.float32)
        at = 0
        for s in sources:
            out[at:at + s.numel()].copy_(s.reshape(-1))
            at += s.numel()
        keep.append(out)  # the last copy is the pageable floor's source

    return best_of(run, repeat)


def upload_floor(host: torch.Tensor, repeat: int) -> list[float]:
    dev = torch.empty_like(host, device="cuda")
    pinned = host.is_pinned()
    return best_of(lambda: dev.copy_(host, non_blocking=pinned), repeat)  # the caller empties the cache


# ---------------------------------------------------------------------------------------------
# zerofast and DeepSpeed


def lazy_once(ckpt: Path, device: str) -> int:
    sd = zerofast.reconstruct(ckpt, lazy=True, device=device)
    total = 0
    for name in sd:
        t = sd[name]  # built, then dropped
        total += t.numel()
    return total


def export_runs(ckpt: Path, out: Path, device: str, repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.perf_counter()
        zerofast.export(ckpt, out, dtype=torch.float32, device=device, max_shard_size="1GB", overwrite=True)
        times.append(time.perf_counter() - t0)
        shutil.rmtree(out, ignore_errors=True)  # the output leaves tmpfs before the next run
    return times


DS_CHILD = r"""
import json, sys, time
import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
device, repeat = sys.argv[2], int(sys.argv[3])
if device == "cuda":
    torch.zeros(1, device="cuda")
runs = []
for _ in range(repeat):
    t0 = time.perf_counter()
    sd = get_fp32_state_dict_from_zero_checkpoint(sys.argv[1])
    t1 = time.perf_counter()
    sd = {k: v.to(device) for k, v in sd.items()}
    if device == "cuda":
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    runs.append([t1 - t0, t2 - t1])
    del sd
print(json.dumps(runs))
"""


def deepspeed_runs(ckpt: Path, ds_path: str | None, repeat: int) -> list[list[float]] | None:
    proc = subprocess.run([sys.executable, "-c", DS_CHILD, str(ckpt), DEVICE, str(repeat)], capture_output=True,
                          text=True, env=gpu_fresh.child_env(ds_path))
    if proc.returncode != 0 and "No module named 'deepspeed'" in proc.stderr:
        return None
    if proc.returncode != 0:
        raise RuntimeError(f"DeepSpeed's child failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def sample_same(names: list[str], cpu: dict, dev: dict) -> str:
    for name in names:
        a, b = cpu[name], dev[name].cpu()
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(gpu_fresh._bits(a), gpu_fresh._bits(b)):
            return f"DIFFERS at {name}"
    return f"bit for bit on {len(names)} sampled tensors"


# ---------------------------------------------------------------------------------------------


def table(report: dict) -> str:
    gb = report["master_bytes"] / 1e9
    lines = ["| case | seconds | GB/s of masters | all runs |", "|---|---|---|---|"]
    for key, row in report["rows"].items():
        if row.get("skipped"):
            lines.append(f"| {row['label']} | {row['skipped']} | | |")
            continue
        s = row["seconds"]
        if key == "deepspeed":
            lines.append(f"| {row['label']} | {row['dict_s']:.3f} + {row['to_s']:.3f} | {gb / s:.1f} | "
                         f"{', '.join(f'{a:.3f}+{b:.3f}' for a, b in row['runs'])} |")
        else:
            lines.append(f"| {row['label']} | {s:.3f} | {gb / s:.1f} | {', '.join(f'{t:.3f}' for t in row['runs'])} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, required=True, help="tmpfs folder of the saves (e.g. /dev/shm/zf-gpucheck)")
    ap.add_argument("--gb", type=float, default=4.0, help="fp32 master bytes of the save, in GB")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--cases", default=",".join(ALL))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--md", type=Path)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a dry run without a GPU")
    ap.add_argument("--ds-path", default=None, help="DeepSpeed's install folder (on its child's PYTHONPATH only)")
    ap.add_argument("--no-deepspeed", dest="deepspeed", action="store_false")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU: nothing to benchmark (--device cpu is the dry run)", file=sys.stderr)
        return 1
    cases = [c for c in args.cases.split(",") if c]
    unknown = set(cases) - set(ALL)
    if unknown:
        ap.error(f"unknown cases {sorted(unknown)}")
    ckpt = gpu_fresh.ensure_save_child(args.root, args.gb)
    info = gpu_fresh.save_info(ckpt)
    out_dir = args.root / "bench-out"
    ops.load_native()
    if DEVICE == "cuda":
        torch.zeros(1, device="cuda")  # the context, before any clock starts
    report = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "dry run on the CPU",
              "torch": torch.__version__, "cpu_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
              "built_devices": list(ops.built_devices()), "gb": args.gb, "master_bytes": info["master_bytes"],
              "file_bytes": info["file_bytes"], "repeat": args.repeat, "rows": {}, "notes": [], "complete": False}
    gb = info["master_bytes"] / 1e9
    print(f"{report['device']}, torch {report['torch']}, {report['cpu_threads']} threads; {ckpt}: {gb:.2f} GB of fp32 "
          f"masters in {info['file_bytes'] / 1e9:.2f} GB of files; best of {args.repeat}", flush=True)

    def record(key: str, runs=None, skipped: str | None = None, **extra) -> None:
        row = {"label": LABELS[key], **extra}
        if skipped:
            row["skipped"] = skipped
            print(f"  {LABELS[key]:70s} skipped: {skipped}", flush=True)
        else:
            row["runs"] = runs
            row["seconds"] = extra.get("seconds", min(runs))
            print(f"  {LABELS[key]:70s} {row['seconds']:7.3f} s {gb / row['seconds']:7.1f} GB/s "
                  f"(runs {', '.join(f'{t:.3f}' for t in runs) if key != 'deepspeed' else runs})", flush=True)
        report["rows"][key] = row
        gpu_fresh._write(args.json, report)

    files = sorted(p for p in ckpt.rglob("*") if p.is_file())
    gpu_fresh.warm(ckpt)
    sources = master_sources(ckpt)
    kept: list = []
    for key in cases:
        try:
            if key == "read":
                record(key, read_floor(files, args.repeat), bytes=info["file_bytes"])
            elif key == "copy":
                record(key, copy_floor(sources, args.repeat, kept))
            elif key in ("pinned", "pageable"):
                if DEVICE != "cuda":
                    record(key, skipped="no GPU (dry run)")
                    continue
                if key == "pinned":
                    host = torch.empty(info["master_bytes"] // 4, dtype=torch.float32, pin_memory=True)
                else:
                    if not kept:
                        copy_floor(sources, 1, kept)
                    host = kept[0]
                record(key, upload_floor(host, args.repeat))
                del host
                getattr(torch._C, "_host_emptyCache", lambda: None)()  # the pinned cache gives its pages back
            elif key == "cpu_fp32":
                kept.clear()  # the pageable source goes before a dict of the same size comes
                record(key, best_of(lambda: zerofast.reconstruct(ckpt, dtype=torch.float32), args.repeat),
                       threads=torch.get_num_threads())
            elif key in ("cuda_fp32", "cuda_bf16"):
                kept.clear()
                dtype = torch.float32 if key == "cuda_fp32" else torch.bfloat16
                record(key, best_of(lambda: zerofast.reconstruct(ckpt, dtype=dtype, device=DEVICE), args.repeat))
                if key == "cuda_fp32":  # a sample held against the CPU path, bit for bit
                    lazy_cpu = zerofast.reconstruct(ckpt, lazy=True)
                    names = list(lazy_cpu)
                    names = sorted({names[0], names[len(names) // 2], names[-1]})
                    cpu = {n: lazy_cpu[n] for n in names}
                    dev = zerofast.reconstruct(ckpt, device=DEVICE)
                    report["rows"][key]["check"] = sample_same(names, cpu, dev)
                    print(f"    {report['rows'][key]['check']}", flush=True)
                    del dev, cpu, lazy_cpu
            elif key == "lazy":
                record(key, best_of(lambda: lazy_once(ckpt, DEVICE), args.repeat))
            elif key == "load_into":
                model = gpu_fresh.model_like(zerofast.reconstruct(ckpt, lazy=True), DEVICE, torch.float32)
                record(key, best_of(lambda: zerofast.load_into(model, ckpt), args.repeat))
                del model
            elif key in ("export_cpu", "export_cuda"):
                record(key, export_runs(ckpt, out_dir / key, "cpu" if key == "export_cpu" else DEVICE, args.repeat))
            elif key == "deepspeed":
                if not args.deepspeed:
                    record(key, skipped="DeepSpeed does not import")
                    continue
                runs = deepspeed_runs(ckpt, args.ds_path, args.repeat)
                if runs is None:
                    record(key, skipped="DeepSpeed does not import")
                    continue
                best = min(runs, key=sum)
                record(key, [sum(r) for r in runs], seconds=sum(best), dict_s=best[0], to_s=best[1])
                report["rows"][key]["runs"] = runs
                gpu_fresh._write(args.json, report)
        except Exception as e:  # noqa: BLE001 -- one failed case is reported; the others still run
            print(f"  {LABELS[key]}: FAILED {type(e).__name__}: {e}", flush=True)
            report["rows"][key] = {"label": LABELS[key], "skipped": f"failed: {type(e).__name__}: {str(e)[:200]}"}
            report["notes"].append(f"{key}: {type(e).__name__}: {e}")
        finally:
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    shutil.rmtree(out_dir, ignore_errors=True)
    report["complete"] = True
    gpu_fresh._write(args.json, report)
    text = (f"In one process, best of {args.repeat}, {gb:.2f} GB of fp32 masters ({report['device']}, "
            f"{report['cpu_threads']} CPU threads):\n\n" + table(report))
    if args.md:
        args.md.write_text(text + "\n")
    print(text)
    return 0 if not report["notes"] else 1


if __name__ == "__main__":
    sys.exit(main())
