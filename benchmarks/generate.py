"""Benchmark workloads: large checkpoints in DeepSpeed 0.19.8's exact on-disk format.

Two shapes, sized by --params (default about 500M) at world size 4, bf16 training:
- ``zero3``: ZeRO-3, every parameter trainable;
- ``zero2_frozen``: ZeRO-2 with a frozen bf16 base holding half the weights (the LoRA shape).
A third, ``many_small`` (ZeRO-3, 50k tensors, 50M parameters), measures per-tensor overhead.
They are written by zerofast's synthesizer, which writes what the engine writes (Adam moments
included), so both tools read the same bytes they would read after real training.

``ds_zero2_20k`` is a real DeepSpeed 0.19.8 save instead (one training step on the CPU, through
tests/dsgen/train.py under torchrun): ZeRO-2, world size 2, 3250 tiny blocks, about 19.5k
tensors in one model-states file, the metadata-bound shape of a many-expert model.

Two scale workloads (issue 22):
- ``many_small_200k``: ``many_small`` four times over (ZeRO-3, 200k tensors of about 1k elements,
  200M parameters, world 4), for the per-tensor cost at scale;
- ``ds_moe_1k``: a real DeepSpeed 0.19.8 MoE save (benchmarks/moe_job.py: train_families.py's MoE
  run with 4 MoE layers of 256 tiny experts, ZeRO-2, world 2, ep 2): 1024
  ``layer_*_expert_*_mp_rank_00_model_states.pt`` files, with DeepSpeed's ground truth.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from zerofast.testing.synthesize import BufferSpec, LayoutSpec, ParamSpec, synthesize

DIM = 2048


def _layers(prefix: str, n_params: int) -> list[ParamSpec]:
    """Transformer-like blocks of (4*DIM x DIM) weights plus biases, totalling about n_params."""
    per_block = 2 * 4 * DIM * DIM + 4 * DIM + DIM
    blocks = max(1, round(n_params / per_block))
    specs = []
    for i in range(blocks):
        specs += [ParamSpec(f"{prefix}.{i}.up.weight", (4 * DIM, DIM)), ParamSpec(f"{prefix}.{i}.up.bias", (4 * DIM,)),
                  ParamSpec(f"{prefix}.{i}.down.weight", (DIM, 4 * DIM)), ParamSpec(f"{prefix}.{i}.down.bias", (DIM,))]
    return specs


# The many-small-tensor shapes (about 1k elements each) by tensor count: ``many_small`` and the
# scaling series of docs/performance.md (1k, 10k, 50k, 200k tensors).
SMALL_COUNTS = {"many_small_1k": 1_000, "many_small_10k": 10_000, "many_small": 50_000, "many_small_200k": 200_000}
SMALL_PARAMS = {name: count * 1_000 for name, count in SMALL_COUNTS.items()}


def workload(name: str, n_params: int, world_size: int) -> LayoutSpec:
    buffers = [BufferSpec("position_ids", (4096,), torch.int64)]
    if name == "zero3":
        params = _layers("layers", n_params)
        groups = [[p for p in params if p.name.endswith("weight")], [p for p in params if p.name.endswith("bias")]]
        return LayoutSpec(stage=3, world_size=world_size, model_dtype=torch.bfloat16, groups=groups, buffers=buffers)
    if name == "zero2_frozen":
        trainable = _layers("adapters", n_params // 2)
        frozen = _layers("base", n_params // 2)
        return LayoutSpec(stage=2, world_size=world_size, model_dtype=torch.bfloat16, groups=[trainable],
                          frozen=frozen, buffers=buffers)
    if name in SMALL_COUNTS:
        # Per-tensor overhead dominates here: 50k (200k) tensors of about 1k elements each.
        count = SMALL_COUNTS[name]
        side = max(1, int((n_params / count) ** 0.5))
        params = [ParamSpec(f"t.{i}.weight", (side, side + i % 3)) for i in range(count)]
        return LayoutSpec(stage=3, world_size=world_size, model_dtype=torch.bfloat16, groups=[params],
                          with_optimizer_states=False)
    raise ValueError(f"unknown workload {name!r}")


# Real DeepSpeed saves: name -> the tests/dsgen/train.py spec that makes it.
REAL = {
    "ds_zero2_20k": {"stage": 2, "world_size": 2, "dtype": "bf16", "n_groups": 1, "steps": 1, "tag": "global_step1",
                     "model": {"n_blocks": 3250, "dim": 4, "hidden": 4, "vocab": 11, "lora_rank": 1}},
    "ds_moe_1k": {"family": "moe", "stage": 2, "world_size": 2, "dtype": "bf16", "ep": 2, "steps": 1,
                  "tag": "global_step1", "moe_layers": [256, 256, 256, 256]},
}
# The torchrun script of each real save (default: tests/dsgen/train.py).
SCRIPTS = {"ds_moe_1k": Path(__file__).resolve().parent / "moe_job.py"}


def ensure_real(root: Path, name: str) -> Path:
    """Train and save workload ``name`` of :data:`REAL` with DeepSpeed unless it is already there."""
    target, spec = root / name, REAL[name]
    stamp = target / "workload.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == spec:
        return target
    tmp = root / f".tmp-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.perf_counter()
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    script = SCRIPTS.get(name, Path(__file__).resolve().parent.parent / "tests" / "dsgen" / "train.py")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(spec["world_size"]),
                    "--master_addr", "127.0.0.1", "--master_port", str(29613 + list(REAL).index(name)), str(script), json.dumps(spec), str(tmp)],
                   env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"training {name} failed:\n{proc.stderr[-4000:]}")
    (tmp / "workload.json").write_text(json.dumps(spec))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    print(f"trained and saved {target} with DeepSpeed in {time.perf_counter() - t0:.1f}s", flush=True)
    return target


def ensure(root: Path, name: str, n_params: int, world_size: int) -> Path:
    """Write workload ``name`` under ``root`` unless an identical one is already there."""
    if name in REAL:
        return ensure_real(root, name)
    target = root / f"{name}-{n_params // 10**6}M-w{world_size}"
    stamp = target / "workload.json"
    want = {"name": name, "params": n_params, "world_size": world_size}
    if stamp.is_file() and json.loads(stamp.read_text()) == want:
        return target
    t0 = time.perf_counter()
    truth = synthesize(target, workload(name, n_params, world_size))
    total = sum(t.numel() for d in (truth.trainable, truth.frozen) for t in d.values())
    stamp.write_text(json.dumps(want))
    print(f"wrote {target} ({total / 1e6:.0f}M parameters) in {time.perf_counter() - t0:.1f}s", flush=True)
    return target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--root", type=Path, default=Path(__file__).parent / "data")
    ap.add_argument("--params", type=float, default=500e6)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--scale", action="store_true", help="also the scale workloads: many_small_200k, ds_moe_1k")
    args = ap.parse_args()
    for name in ("zero3", "zero2_frozen"):
        ensure(args.root, name, int(args.params), args.world_size)
    for name in ("many_small", *(("many_small_200k", "ds_moe_1k") if args.scale else ())):
        ensure(args.root, name, SMALL_PARAMS.get(name, 0), args.world_size)


if __name__ == "__main__":
    main()
