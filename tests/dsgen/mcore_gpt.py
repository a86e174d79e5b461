"""Real Megatron-Core saves of a tiny ``GPTModel`` (``torch_dist`` backend), cached (issue 48 section 2).

    from tests.dsgen.mcore_gpt import ensure_mcore_gpt, VARIANTS
    folder = ensure_mcore_gpt("tp2_stacked")   # <cache>/mcore_gpt_tp2_stacked-<key>

The job (this file, run under torchrun on gloo, world 2) builds Megatron-Core's own ``GPTModel``
with the local (non-Transformer-Engine) layer spec, ``get_gpt_layer_local_spec()``: 2 layers,
hidden 16, ffn 32, vocabulary 32, sequence 16, ``use_cpu_initialization``, fp32 parameters. It
takes one Adam step on CPU on drawn gradients (so the optimizer has state), then saves the way Megatron-LM does,
``{"model": model.sharded_state_dict(metadata=...), "optimizer": ..., "iteration": 1, ...}`` with
``megatron.core.dist_checkpointing.save`` into ``root/iter_0000001`` and writes
``root/latest_checkpointed_iteration.txt``. The variants (``VARIANTS``):

    tp1_dp2        TP 1 x DP 2: 2 heads, GeLU MLP, learned absolute positions, untied output layer;
                   layers stacked (the default); every tensor whole on both ranks (DP replicas)
    tp2_stacked    TP 2: 4 heads, SwiGLU (gated_linear_unit), RoPE, tied embeddings; stacked
    tp2_singleton  the same model and data, saved with ``metadata={"singleton_local_shards": True}``
                   (NeMo's setting): per-layer keys, SwiGLU's linear_fc1 as ``weight_w`` / ``weight_v``

The optimizer state is Megatron-Core's own non-distributed form: ``FP32Optimizer.sharded_state_dict``
(``optimizer.state.{exp_avg,exp_avg_sq}.<weight key>``, sharded like the weight), run on a plain
``torch.optim.Adam``. ``FP32Optimizer.__init__`` itself puts a tensor on ``'cuda'``, so the job
builds it without calling it and only asks it for its sharded state. The distributed optimizer
does not run on the CPU (see ``DISTRIBUTED_OPTIMIZER``).

Next to ``root`` (rank 0 writes them):

    truth.pt            {key: the full tensor} for every model weight in the save: each
                        ShardedTensor's local data (factories applied, as the save applies them)
                        placed at its own global offset, gathered over the ranks, every element
                        covered exactly once by a main replica
    optimizer_truth.pt  the same for the ``optimizer.*`` tensors
    model_state_rank<r>.pt   rank r's own ``model.state_dict()`` (tensors only), after the step
    layout.json         the variant, versions, for each ``model.state_dict()`` key its save key(s),
                        layer index and piece, each save key's global shape, the replica check

Megatron-Core calls ``torch.cuda.synchronize()`` and ``torch.cuda.current_device()`` even on the
CPU; the job makes both no-ops before importing it. Its writer starts a process (a
multiprocessing manager) that imports this file again: the job runs only under ``__main__``, and
shuts that manager down before it ends (see there).
"""
from __future__ import annotations

import importlib.util
import json
import zlib
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve()
MCORE_VERSION = "0.16.1"
HAVE_MCORE = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
ITERATION = 1
VOCAB, SEQ, HIDDEN, FFN, LAYERS = 32, 16, 16, 32, 2

VARIANTS: dict[str, dict] = {
    "tp1_dp2": {"world": 2, "tp": 1, "heads": 2, "glu": False, "rope": False, "tied": False, "singleton": False},
    "tp2_stacked": {"world": 2, "tp": 2, "heads": 4, "glu": True, "rope": True, "tied": True, "singleton": False},
    "tp2_singleton": {"world": 2, "tp": 2, "heads": 4, "glu": True, "rope": True, "tied": True, "singleton": True},
}

# Why no variant uses the distributed optimizer: with the two patches above it still stops, in
# MixedPrecisionOptimizer.__init__ (DistributedOptimizer's base), at
# ``torch.tensor([0], dtype=torch.int, device='cuda')`` ("Torch not compiled with CUDA enabled");
# past it, DistributedOptimizer accepts only parameters of type 'torch.cuda.FloatTensor' /
# 'torch.cuda.HalfTensor' / 'torch.cuda.BFloat16Tensor', and the grad buffers and clip_grads make
# more tensors on 'cuda'.
DISTRIBUTED_OPTIMIZER = ("megatron/core/optimizer/optimizer.py: MixedPrecisionOptimizer.__init__ makes "
                         "torch.tensor([0], dtype=torch.int, device='cuda'); DistributedOptimizer "
                         "needs torch.cuda.*Tensor parameters")


def _pieces(sharded: dict) -> list:
    """The ShardedTensors a save writes for ``sharded`` (factories applied, in place)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    apply_factories(sharded)
    return [v for v in nested_values(sharded) if isinstance(v, ShardedTensor)]


def _gather(sharded: dict) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Every key's full tensor, from the ranks' ShardedTensors placed at their global offsets;
    and, per key, how many elements of the other replicas differ from the main one."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    mine = []
    for sh in _pieces(sharded):
        assert sh.flattened_range is None, sh
        mine.append((sh.key, tuple(sh.global_shape), tuple(sh.global_offset), sh.prepend_axis_num,
                     is_main_replica(sh.replica_id), sh.data.detach().clone()))
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    full: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    others = []
    for key, shape, offset, prepend, main, data in (p for rank in every for p in rank):
        box = (1,) * prepend + tuple(data.shape)
        where = tuple(slice(o, o + n) for o, n in zip(offset, box))
        if not main:
            others.append((key, where, data.reshape(box)))
            continue
        if key not in full:
            full[key] = torch.zeros(shape, dtype=data.dtype)
            covered[key] = torch.zeros(shape, dtype=torch.bool)
        assert tuple(full[key].shape) == shape and full[key].dtype == data.dtype, key
        assert not covered[key][where].any(), f"{key}: main replicas overlap at {offset}"
        full[key][where] = data.reshape(box)
        covered[key][where] = True
    for key, done in covered.items():
        assert done.all(), f"{key}: {int((~done).sum())} elements held by no main replica"
    differ: dict[str, int] = {}
    for key, where, data in others:
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[data.element_size()]
        n = int((full[key][where].contiguous().view(ints) != data.contiguous().view(ints)).sum())
        differ[key] = differ.get(key, 0) + n
    return full, differ


def _layout(sharded: dict) -> dict[str, list]:
    """For each ``model.state_dict()`` key: its pieces in the save, as [save key, layer or None,
    piece index], in the order the save cuts them (SwiGLU's linear_fc1 gives two)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out: dict[str, list] = {}
    for name, sh in sharded.items():
        if isinstance(sh, ShardedTensorFactory):
            built = sh.build()
            built = built if isinstance(built, list) else [built]
        elif isinstance(sh, ShardedTensor):
            built = [sh]
        else:
            continue
        out[name] = [[b.key, b.global_offset[0] if b.prepend_axis_num else None, i] for i, b in enumerate(built)]
    return out


def _job(variant: str, out: Path) -> None:
    torch.cuda.synchronize = lambda *args, **kwargs: None  # Megatron-Core calls these even on the CPU
    torch.cuda.current_device = lambda: "cpu"
    import time

    import torch.distributed as dist
    from gloo_job import process_group  # this folder is first on sys.path: the script runs as a file

    spec = VARIANTS[variant]
    t0 = time.monotonic()
    with process_group():
        from importlib.metadata import version

        from megatron.core import dist_checkpointing, parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.optimizer.optimizer import FP32Optimizer
        from megatron.core.transformer.transformer_config import TransformerConfig

        class CpuFP32Optimizer(FP32Optimizer):
            """Megatron-Core's FP32Optimizer for its ``sharded_state_dict`` alone: its ``__init__``
            puts a loss scale on 'cuda'; ``state_dict`` and ``get_parameters`` need ``optimizer``."""

            def __init__(self, optimizer):  # noqa: D107 - no super().__init__: see the docstring
                self.optimizer = optimizer

        rank = dist.get_rank()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=spec["tp"])
        torch.manual_seed(1234)
        config = TransformerConfig(
            num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=spec["heads"],
            gated_linear_unit=spec["glu"], use_cpu_initialization=True, params_dtype=torch.float32,
            tensor_model_parallel_size=spec["tp"], hidden_dropout=0.0, attention_dropout=0.0)
        model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ,
                         position_embedding_type="rope" if spec["rope"] else "learned_absolute",
                         share_embeddings_and_output_weights=spec["tied"])

        # One Adam step. A forward pass does not run on the CPU (the attention's dropout forks
        # Megatron's CUDA RNG tracker, which holds torch.cuda RNG states): the gradients are
        # drawn from a generator seeded by the parameter's name, so replicas (DP, and the
        # layer norms and row-parallel biases every TP rank holds) get the same ones.
        adam = torch.optim.Adam(model.parameters(), lr=1e-2)
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
        adam.step()
        t_step = time.monotonic() - t0

        metadata = {"singleton_local_shards": True} if spec["singleton"] else None
        optimizer = CpuFP32Optimizer(adam)

        def state() -> dict:
            model_sd = model.sharded_state_dict(metadata=metadata)
            return {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, metadata=metadata),
                    "iteration": ITERATION, "checkpoint_version": 3.0,
                    "args": {"tensor_model_parallel_size": spec["tp"], "num_layers": LAYERS, **spec}}

        layout = _layout(model.sharded_state_dict(metadata=metadata))
        folder = out / "root" / f"iter_{ITERATION:07d}"
        folder.mkdir(parents=True, exist_ok=True)
        dist_checkpointing.save(state(), str(folder))
        t_save = time.monotonic() - t0 - t_step

        truth_state = state()  # a fresh one: the save applied the factories of its own in place
        weights, weights_differ = _gather(truth_state["model"])
        opt, opt_differ = _gather(truth_state["optimizer"])
        own = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
        torch.save(own, out / f"model_state_rank{rank}.pt")
        dist.barrier()
        if rank == 0:
            (out / "root" / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
            torch.save(weights, out / "truth.pt")
            torch.save(opt, out / "optimizer_truth.pt")
            report = {
                "variant": variant, "spec": spec,
                "versions": {"megatron-core": version("megatron-core"), "torch": torch.__version__},
                "layout": layout,
                "shapes": {k: list(v.shape) for k, v in {**weights, **opt}.items()},
                "replicas_differ": {k: n for k, n in {**weights_differ, **opt_differ}.items() if n},
                "seconds": {"build_and_step": round(t_step, 2), "save": round(t_save, 2),
                            "total": round(time.monotonic() - t0, 2)},
            }
            (out / "layout.json").write_text(json.dumps(report, indent=1))


def _complete(path: Path) -> bool:
    return ((path / "layout.json").is_file() and (path / "truth.pt").is_file()
            and (path / "root" / "latest_checkpointed_iteration.txt").is_file())


def ensure_mcore_gpt(variant: str) -> Path:
    """The cached folder of one variant (``root/``, ``truth.pt``, ...; made on first use; needs
    megatron-core)."""
    import hashlib
    import os
    import shutil
    import subprocess
    from importlib.metadata import version

    from tests.dsgen.catalog import REPO_ROOT, TIMEOUT_S, _free_port, build_cached, cache_dir, not_ours

    spec = VARIANTS[variant]
    key = hashlib.sha256(HERE.read_bytes() + (HERE.parent / "gloo_job.py").read_bytes()
                         + json.dumps([variant, spec, version("megatron-core"), torch.__version__]).encode())
    key = key.hexdigest()[:12]

    def build(tmp: Path) -> None:
        for _attempt in range(3):  # retried only where the launch failed before the job ran
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(spec["world"]),
                   "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), str(HERE), variant, str(tmp)]
            proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
            output = proc.stdout + proc.stderr
            if proc.returncode == 0:
                return
            if not not_ours(output):
                break
        raise RuntimeError(f"the Megatron-Core GPTModel save job ({variant}) failed (rc={proc.returncode}):\n"
                           f"{output[-6000:]}")

    return build_cached(cache_dir() / f"mcore_gpt_{variant}-{key}", _complete, build,
                        f"the Megatron-Core GPTModel save ({variant})")


if __name__ == "__main__":  # Megatron-Core's writer starts a process that imports this file again
    _job(sys.argv[1], Path(sys.argv[2]))
    import multiprocessing.util

    from gloo_job import exit_now

    # That process is a multiprocessing Manager (filesystem_async._get_write_results_queue, spawn
    # context), kept for the life of the rank and shut down only by multiprocessing's atexit hook,
    # which exit_now's os._exit skips: left running, it (and its resource tracker) holds the job's
    # stdout and stderr open, and the test's subprocess.run(capture_output=True) waits on them until
    # its timeout. So run that hook first: it shuts the Manager down and joins every child.
    multiprocessing.util._exit_function()
    exit_now()  # torn down and written: no finalization (tests/dsgen/gloo_job.py)
