"""device="cuda" against the CPU on a synthesized checkpoint; run by tools/gpu_check.sh.

The checkpoint is ZeRO-3, world size 4, bf16 training, without optimizer moments (they only
cost synthesis time here: reconstruct never reads them), about ``--gb`` GB of fp32 masters.
Every case runs once untimed, which also pulls the files into the page cache, and then
``--repeat`` times; the table shows the best. So it compares the executors, not the disk.

Cases: the raw op on one large tensor (host source to GPU out, GPU source to GPU out, and the CPU
op for reference), eager ``reconstruct`` and safetensors ``export`` in fp32 and bf16.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import zerofast  # noqa: E402
from benchmarks.generate import workload  # noqa: E402
from zerofast import ops  # noqa: E402
from zerofast.testing.synthesize import synthesize  # noqa: E402


# The device under test; `--device cpu` runs every case on the CPU twice, a dry run of this script
# on a machine without a GPU.
DEVICE = "cuda"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def best_of(fn: Callable[[], object], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times)


def op_cases(n: int, repeat: int) -> list[dict]:
    """One tensor of ``n`` fp32 elements cast to bf16: what the op itself sustains."""
    host = torch.randn(n)
    seg = torch.tensor([[0, 0, 0, n]])
    out_gpu = torch.empty(n, dtype=torch.bfloat16, device=DEVICE)
    out_cpu = torch.empty(n, dtype=torch.bfloat16)
    resident = host.to(DEVICE)
    ops.load_native()
    op = torch.ops.zerofast.gather_cast
    cpu = best_of(lambda: op([host], seg, out_cpu), repeat)
    rows = {"op fp32->bf16, host source": [host], "op fp32->bf16, GPU source": [resident]}
    return [{"case": name, "bytes": n * 6, "cpu_s": cpu, "cuda_s": best_of(lambda: op(src, seg, out_gpu), repeat)}
            for name, src in rows.items()]


def reconstruct_case(ckpt: Path, dtype: torch.dtype, repeat: int, nbytes: int) -> dict:
    def run(device: str) -> float:
        return best_of(lambda: zerofast.reconstruct(ckpt, dtype=dtype, device=device), repeat)

    return {"case": f"reconstruct {_name(dtype)}", "bytes": nbytes, "cpu_s": run("cpu"), "cuda_s": run(DEVICE)}


def export_case(ckpt: Path, dtype: torch.dtype, repeat: int, nbytes: int, scratch: Path) -> dict:
    def run(device: str) -> float:
        out = scratch / f"out-{device}"

        def once():
            zerofast.export(ckpt, out, dtype=dtype, device=device, overwrite=True)

        try:
            return best_of(once, repeat)
        finally:
            shutil.rmtree(out, ignore_errors=True)

    return {"case": f"export {_name(dtype)}", "bytes": nbytes, "cpu_s": run("cpu"), "cuda_s": run(DEVICE)}


def _name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]


def scratch_dir(need: int) -> Path:
    """tmpfs when it has room, so that export times are not disk write-back times."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 3 * need:
        return Path(tempfile.mkdtemp(dir=shm, prefix="zerofast-bench-"))
    return Path(tempfile.mkdtemp(prefix="zerofast-bench-"))


def table(rows: list[dict]) -> str:
    lines = [f"{'case':32} {'GB':>6} {'cpu s':>8} {'cuda s':>8} {'cpu/cuda':>9}"]
    for r in rows:
        lines.append(f"{r['case']:32} {r['bytes'] / 1e9:6.2f} {r['cpu_s']:8.3f} {r['cuda_s']:8.3f} "
                     f"{r['cpu_s'] / r['cuda_s']:8.2f}x")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gb", type=float, default=3.0, help="fp32 master bytes of the checkpoint, in GB")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a dry run without a GPU")
    ap.add_argument("--op-elements", type=int, default=256 << 20)
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU: nothing to benchmark", file=sys.stderr)
        return 1
    params = int(args.gb * 1e9 / 4)
    scratch = scratch_dir(int(args.gb * 1e9))
    try:
        t0 = time.perf_counter()
        ckpt = scratch / "ckpt"
        synthesize(ckpt, dataclasses.replace(workload("zero3", params, 4), with_optimizer_states=False))
        print(f"synthesized {params / 1e6:.0f}M parameters in {time.perf_counter() - t0:.1f} s under {scratch}",
              flush=True)
        rows = op_cases(args.op_elements, args.repeat)
        for dtype in (torch.float32, torch.bfloat16):
            out_bytes = params * dtype.itemsize
            rows.append(reconstruct_case(ckpt, dtype, args.repeat, params * 4 + out_bytes))
            print(table(rows[-1:]), flush=True)
            rows.append(export_case(ckpt, dtype, args.repeat, params * 4 + out_bytes, scratch))
            print(table(rows[-1:]), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "dry run on the CPU"
    info = {"gpu": gpu, "torch": torch.__version__, "cpu_threads": torch.get_num_threads(),
            "cpus": os.cpu_count(), "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(info, indent=2) + "\n")
    print(f"\n{info['gpu']}, torch {info['torch']}, {info['cpu_threads']} CPU threads; GB = bytes read + written; "
          f"best of {args.repeat} warm runs")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
