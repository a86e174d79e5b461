"""Real PyTorch Distributed Checkpoints (DCP), made on the CPU by an FSDP2 job, and cached.

    from tests.dsgen.dcp import ensure_dcp
    folder = ensure_dcp(4)    # <cache>/dcp_fsdp2_w4-<key>/ckpt (.metadata, __r_0.distcp) and truth.pt

The job (this file, run under torchrun) shards a small model with ``fully_shard`` on a CPU mesh
(gloo), trains it two AdamW steps and saves ``{"model": msd, "optim": osd}`` from
``get_state_dict`` with ``dcp.save``, as the DCP tutorial and FSDP2 jobs do. The model has rows
that do not divide by 2 or 4 (uneven shards), an embedding tied to the output layer, an fp32 and
a bf16 parameter group (each its own FSDP2 unit), and fp32, int64 and bool buffers.

``truth.pt`` holds ``{"model": ..., "optim": ...}`` as the live job saw them, gathered with
``full_state_dict=True``: the ground truth, independent of any checkpoint reader.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve()
WORLDS = (2, 4)


class DcpModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.embed = nn.Embedding(37, 10)            # 37 rows: uneven at world 2 and 4
        self.fc = nn.Linear(10, 7)                    # 7 rows, a 7-element bias
        self.low = nn.Linear(10, 5).to(torch.bfloat16)  # a bf16 parameter, its own FSDP2 unit
        self.lm_head = nn.Linear(10, 37, bias=False)
        self.lm_head.weight = self.embed.weight      # tied
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 10))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("mask", torch.arange(37) % 4 != 0)

    def forward(self, ids):
        x = self.embed(ids) * self.scale
        x = x + self.fc(x).sum(-1, keepdim=True) + self.low(x.to(torch.bfloat16)).float().mean(-1, keepdim=True)
        self.steps += 1
        return self.lm_head(x).masked_fill(~self.mask, 0.0).logsumexp(-1).mean()


def _job(out: Path) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gloo_job import process_group  # this folder is first on sys.path: the script runs as a file

    with process_group():  # gloo; a barrier, then torn down
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        model = DcpModel()
        fully_shard(model.low, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(100 + dist.get_rank())
        for _ in range(2):
            model(torch.randint(0, 37, (3, 4), generator=gen)).backward()
            optim.step()
            optim.zero_grad()
        msd, osd = get_state_dict(model, optim)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=out / "ckpt")
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full_msd, full_osd = get_state_dict(model, optim, options=full)
        if dist.get_rank() == 0:
            torch.save({"model": full_msd, "optim": full_osd}, out / "truth.pt")


def _complete(path: Path) -> bool:
    return (path / "truth.pt").is_file() and (path / "ckpt" / ".metadata").is_file()


def ensure_dcp(world: int) -> Path:
    """The cached FSDP2 DCP folder saved at ``world`` ranks (made on first use); its parent holds
    ``truth.pt``."""
    import hashlib
    import json
    import os
    import socket
    import subprocess

    import shutil

    from tests.dsgen.catalog import REPO_ROOT, TIMEOUT_S, build_cached, cache_dir, not_ours

    key = hashlib.sha256(HERE.read_bytes() + json.dumps([world, torch.__version__]).encode()).hexdigest()[:12]

    def build(tmp: Path) -> None:
        for _attempt in range(3):  # again only where not_ours: the port taken, the rendezvous failed
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_addr",
                   "127.0.0.1", "--master_port", str(port), str(HERE), str(tmp)]
            proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
            output = proc.stdout + proc.stderr
            if proc.returncode == 0:
                return
            if not not_ours(output):
                break
        raise RuntimeError(f"the FSDP2 DCP job failed (rc={proc.returncode}):\n{output[-6000:]}")

    return build_cached(cache_dir() / f"dcp_fsdp2_w{world}-{key}", _complete, build, f"the FSDP2 DCP at {world}") / "ckpt"


if __name__ == "__main__":
    from gloo_job import exit_now

    _job(Path(sys.argv[1]))
    exit_now()  # torn down and written: no finalization (tests/dsgen/gloo_job.py)
