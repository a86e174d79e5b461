"""Real DCP folders with thousands of chunks per tensor, written by torch's own ``dcp.save`` and
cached (issue 48).

    from tests.dsgen.dcp_chunks import ensure_many_chunks
    folder = ensure_many_chunks(1024)   # <cache>/dcp_chunks_1024-<key>/ckpt

The job (this file, run under torchrun at world 2 on gloo) builds ShardedTensors out of
one-row shards with ``init_from_local_shards`` (a ``ShardMetadata`` per shard) and saves
``{"model": ...}`` with ``dcp.save``. For ``chunks`` = n, every tensor under ``model`` but
``bias`` has n chunks:

    rows.weight   fp32 (n, 3)         one row per chunk, the ranks taking turns (even rows on rank 0)
    grid.weight   bf16 (n/2, 6)       one row and half the columns per chunk (an FSDP x TP 2 grid),
                                      rank (row + half) % 2
    ids           int64 (n,)          one element per chunk, rank 0 the first half
    bias          fp32 (7,)           a plain tensor on both ranks: one chunk (deduplicated)

The values are drawn from a seeded generator, the same on both ranks.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve()
CHUNKS = (1024, 4096)


def full_tensors(chunks: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(chunks)
    return {"rows.weight": torch.randn(chunks, 3, generator=g),
            "grid.weight": torch.randn(chunks // 2, 6, generator=g).bfloat16(),
            "ids": torch.randint(-2**40, 2**40, (chunks,), generator=g),
            "bias": torch.randn(7, generator=g)}


def _job(out: Path, chunks: int) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        place = f"rank:{rank}/cpu"
        full = full_tensors(chunks)

        def sharded(t: torch.Tensor, boxes: list[tuple[list[int], list[int]]]):
            shards = [Shard(t[tuple(slice(o, o + s) for o, s in zip(offs, sizes))].clone(),
                            ShardMetadata(offs, sizes, place)) for offs, sizes in boxes]
            return init_from_local_shards(shards, *t.shape)

        rows, half = chunks, chunks // 2
        model = {
            "rows.weight": sharded(full["rows.weight"], [([i, 0], [1, 3]) for i in range(rank, rows, 2)]),
            "grid.weight": sharded(full["grid.weight"], [([i, 3 * c], [1, 3]) for i in range(half) for c in (0, 1)
                                                         if (i + c) % 2 == rank]),
            "ids": sharded(full["ids"], [([i], [1]) for i in range(rank * half, (rank + 1) * half)]),
            "bias": full["bias"],
        }
        dcp.save({"model": model}, checkpoint_id=out / "ckpt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _complete(path: Path) -> bool:
    return (path / "ckpt" / ".metadata").is_file()


def ensure_many_chunks(chunks: int) -> Path:
    """The cached DCP folder whose sharded tensors have ``chunks`` chunks each (made on first use)."""
    import hashlib
    import json
    import os
    import shutil
    import subprocess

    from tests.dsgen.catalog import REPO_ROOT, TIMEOUT_S, _free_port, build_cached, cache_dir, worth_retrying

    key = hashlib.sha256(HERE.read_bytes() + json.dumps([chunks, torch.__version__]).encode()).hexdigest()[:12]

    def build(tmp: Path) -> None:
        for _attempt in range(3):  # retried only where worth_retrying says so
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                   "127.0.0.1", "--master_port", str(_free_port()), str(HERE), str(tmp), str(chunks)]
            proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
            output = proc.stdout + proc.stderr
            if proc.returncode == 0:
                return
            if not worth_retrying(output):
                break
        raise RuntimeError(f"the {chunks}-chunk DCP job failed (rc={proc.returncode}):\n{output[-6000:]}")

    return build_cached(cache_dir() / f"dcp_chunks_{chunks}-{key}", _complete, build,
                        f"the DCP save of {chunks} chunks per tensor") / "ckpt"


if __name__ == "__main__":
    _job(Path(sys.argv[1]), int(sys.argv[2]))
