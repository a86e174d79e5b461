"""A large PyTorch DCP folder for the benchmarks, saved by ``dcp.save`` from DTensor shards.

    python -m torch.distributed.run --nproc_per_node 4 benchmarks/dcp_workload.py OUT N_PARAMS

Each of the 4 gloo ranks holds its dim-0 shard of every tensor (the FSDP2 layout) and the job
saves ``{"model": {...}}`` as an FSDP2 job's ``dcp.save`` does: one ``__<rank>_0.distcp`` per
rank. The shapes are benchmarks/generate.py's transformer blocks, in fp32.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
WORLD = 4
DIM = 2048  # as benchmarks/generate.py


def ensure_dcp_workload(root: Path, n_params: int) -> Path:
    """The DCP folder for ``n_params`` under ``root``, made unless an identical one is there."""
    target = root / f"dcp-{n_params // 10**6}M-w{WORLD}"
    stamp = target / "workload.json"
    want = {"name": "dcp", "params": n_params, "world_size": WORLD}
    if stamp.is_file() and json.loads(stamp.read_text()) == want:
        return target / "ckpt"
    t0 = time.perf_counter()
    target.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD), "--master_addr",
                    "127.0.0.1", "--master_port", "29531", str(Path(__file__).resolve()), str(target / "ckpt"),
                    str(n_params)], check=True, env=env)
    stamp.write_text(json.dumps(want))
    print(f"wrote {target} in {time.perf_counter() - t0:.1f}s", flush=True)
    return target / "ckpt"


def _shapes(n_params: int) -> list[tuple[str, tuple[int, ...]]]:
    """generate.py's transformer blocks: (4*DIM x DIM) and (DIM x 4*DIM) weights plus biases."""
    per_block = 2 * 4 * DIM * DIM + 4 * DIM + DIM
    out = []
    for i in range(max(1, round(n_params / per_block))):
        out += [(f"layers.{i}.up.weight", (4 * DIM, DIM)), (f"layers.{i}.up.bias", (4 * DIM,)),
                (f"layers.{i}.down.weight", (DIM, 4 * DIM)), (f"layers.{i}.down.bias", (DIM,))]
    return out


def _job(out: Path, n_params: int) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    sys.path.insert(0, str(HERE.parent))  # the checkout, for the suite's torchrun helper
    from tests.dsgen.gloo_job import process_group

    with process_group():  # gloo; a barrier, then torn down
        rank, world = dist.get_rank(), dist.get_world_size()
        mesh = init_device_mesh("cpu", (world,))
        gen = torch.Generator().manual_seed(rank)
        state = {}
        for name, shape in _shapes(n_params):
            local = torch.randn((shape[0] // world, *shape[1:]), generator=gen)
            state[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                                             stride=torch.empty(shape, device="meta").stride())
        dcp.save({"model": state}, checkpoint_id=out)


if __name__ == "__main__":
    _job(Path(sys.argv[1]), int(sys.argv[2]))
    from tests.dsgen.gloo_job import exit_now

    exit_now()  # torn down and written: no finalization (tests/dsgen/gloo_job.py)
