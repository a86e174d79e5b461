"""Real Megatron-Core ``dist_checkpointing`` saves (``torch_dist`` backend), cached (issue 48).

    from tests.dsgen.mcore import ensure_mcore, HAVE_MCORE
    root = ensure_mcore()   # <cache>/mcore_sharded-<key>/root

The job (this file, run under torchrun at world 2 on gloo, tensor parallel 2) saves hand-made
``ShardedTensor.from_rank_offsets`` tensors with ``megatron.core.dist_checkpointing.save`` twice,
as Megatron-LM lays out its saves: ``root/iter_0000005`` and ``root/iter_0000010``, and
``root/latest_checkpointed_iteration.txt`` naming 10. Each save holds

    embedding.word_embeddings.weight          fp32 (12, 6)    split on dim 0 (vocabulary parallel)
    decoder.layers.self_attention.linear_proj.weight   fp32 (2, 6, 8)   stacked layers, split on dim 2 (row parallel)
    decoder.layers.mlp.linear_fc1.weight      bf16 (2, 10, 6)  stacked layers, split on dim 1 (column parallel)
    decoder.final_layernorm.weight            bf16 (6,)       replicated (both ranks hold it, replica_id 0 and 1)
    optimizer.state.exp_avg.<the first two>   fp32            Adam state beside the weights, sharded like them
    optimizer.distributed.dp_group_idx_0.gbuf_idx_0.bucket_idx_0.exp_avg   fp32 (20,)  a flat buffer, half per rank
    rng_state/shard_0_2, rng_state/shard_1_2  ShardedObject (byte entries)

and ``common.pt`` (``iteration``, ``args``). The truth (``truth.pt``, rank 0) is the full tensors
the job cut the shards from, for the iteration-10 save; the iteration-5 save holds them times 2.

Megatron-Core's save calls ``torch.cuda.synchronize()`` and ``torch.cuda.current_device()``
even on the CPU; the job makes both no-ops before importing it.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve()
MCORE_VERSION = "0.16.1"
HAVE_MCORE = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
ITERATION = 10


def full_tensors(scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(48)
    return {
        "embedding.word_embeddings.weight": torch.randn(12, 6, generator=g) * scale,
        "decoder.layers.self_attention.linear_proj.weight": torch.randn(2, 6, 8, generator=g) * scale,
        "decoder.layers.mlp.linear_fc1.weight": (torch.randn(2, 10, 6, generator=g) * scale).bfloat16(),
        "decoder.final_layernorm.weight": (torch.randn(6, generator=g) * scale).bfloat16(),
    }


def optimizer_tensors(scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(49)
    return {
        "optimizer.state.exp_avg.embedding.word_embeddings.weight": torch.randn(12, 6, generator=g) * scale,
        "optimizer.state.exp_avg.decoder.layers.self_attention.linear_proj.weight":
            torch.randn(2, 6, 8, generator=g) * scale,
        "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.bucket_idx_0.exp_avg": torch.randn(20, generator=g) * scale,
    }


# How each tensor is cut at TP 2: the dimension split between the ranks, or None (replicated).
SPLIT = {
    "embedding.word_embeddings.weight": 0,
    "decoder.layers.self_attention.linear_proj.weight": 2,
    "decoder.layers.mlp.linear_fc1.weight": 1,
    "decoder.final_layernorm.weight": None,
    "optimizer.state.exp_avg.embedding.word_embeddings.weight": 0,
    "optimizer.state.exp_avg.decoder.layers.self_attention.linear_proj.weight": 2,
    "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.bucket_idx_0.exp_avg": 0,
}


def _job(out: Path) -> None:
    torch.cuda.synchronize = lambda *args, **kwargs: None  # Megatron-Core calls these even on the CPU
    torch.cuda.current_device = lambda: "cpu"
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        for iteration, scale in ((5, 2.0), (ITERATION, 1.0)):
            state = {}
            for key, full in {**full_tensors(scale), **optimizer_tensors(scale)}.items():
                dim = SPLIT[key]
                if dim is None:
                    state[key] = ShardedTensor.from_rank_offsets(key, full.clone(), replica_id=rank)
                else:
                    state[key] = ShardedTensor.from_rank_offsets(key, full.chunk(2, dim)[rank].clone(), (dim, rank, 2))
            state["rng"] = ShardedObject("rng_state", torch.get_rng_state(), (2,), (rank,), replica_id=0)
            state["iteration"] = iteration
            state["args"] = {"tensor_model_parallel_size": 2, "num_layers": 2}
            folder = out / f"iter_{iteration:07d}"
            folder.mkdir(parents=True, exist_ok=True)
            dist_checkpointing.save(state, str(folder))
            dist.barrier()
        if rank == 0:
            (out / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
            torch.save({**full_tensors(), **optimizer_tensors()}, out.parent / "truth.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _complete(path: Path) -> bool:
    return (path / "truth.pt").is_file() and (path / "root" / "latest_checkpointed_iteration.txt").is_file()


def ensure_mcore() -> Path:
    """The cached root of the two Megatron-Core saves (made on first use; needs megatron-core)."""
    import hashlib
    import json
    import os
    import shutil
    import subprocess

    from tests.dsgen.catalog import REPO_ROOT, TIMEOUT_S, _free_port, build_cached, cache_dir, worth_retrying

    from importlib.metadata import version

    key = hashlib.sha256(HERE.read_bytes() + json.dumps([version("megatron-core"), torch.__version__]).encode())
    key = key.hexdigest()[:12]

    def build(tmp: Path) -> None:
        for _attempt in range(3):  # retried only where worth_retrying says so
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                   "127.0.0.1", "--master_port", str(_free_port()), str(HERE), str(tmp / "root")]
            proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
            output = proc.stdout + proc.stderr
            if proc.returncode == 0:
                return
            if not worth_retrying(output):
                break
        raise RuntimeError(f"the Megatron-Core save job failed (rc={proc.returncode}):\n{output[-6000:]}")

    return build_cached(cache_dir() / f"mcore_sharded-{key}", _complete, build,
                        "the Megatron-Core dist_checkpointing saves") / "root"


if __name__ == "__main__":  # Megatron-Core's writer starts processes that import this file again
    _job(Path(sys.argv[1]))
