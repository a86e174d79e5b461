"""`make demo`: synthesize a small ZeRO-3 checkpoint, reconstruct it, and show what came out.

The checkpoint is written by zerofast's own synthesizer in DeepSpeed 0.19.8's on-disk format
(bf16 training, world size 4, a frozen LoRA-style base, a tied embedding, int and bool buffers),
so the demo needs neither DeepSpeed nor a GPU.
"""
from __future__ import annotations

import sys
import tempfile
import time

import torch

import zerofast
from zerofast.testing.synthesize import BufferSpec, LayoutSpec, ParamSpec, synthesize


def demo_layout() -> LayoutSpec:
    dim, vocab = 256, 1000
    blocks = [[ParamSpec(f"blocks.{i}.attn.weight", (dim, dim)), ParamSpec(f"blocks.{i}.mlp.weight", (4 * dim, dim)),
               ParamSpec(f"blocks.{i}.mlp.bias", (4 * dim,))] for i in range(4)]
    return LayoutSpec(
        stage=3, world_size=4, model_dtype=torch.bfloat16,
        groups=[[ParamSpec("embed.weight", (vocab, dim))] + [p for b in blocks for p in b if p.name.endswith("weight")],
                [p for b in blocks for p in b if p.name.endswith("bias")] + [ParamSpec("norm.weight", (dim,))]],
        frozen=[ParamSpec("base.weight", (dim, dim)), ParamSpec("base.bias", (dim,))],
        buffers=[BufferSpec("position_ids", (512,), torch.int64), BufferSpec("mask", (vocab,), torch.bool)],
        tied={"lm_head.weight": "embed.weight"},
        tag="global_step100", seed=0)


def _summary(sd, truth) -> str:
    kinds = {"trainable": truth.trainable, "frozen": truth.frozen, "buffer": truth.buffers}
    rows = []
    for kind, names in kinds.items():
        tensors = [sd[n] for n in names if n in sd]
        dtypes = sorted({str(t.dtype).replace("torch.", "") for t in tensors})
        rows.append(f"  {kind:<10} {len(tensors):>3} tensors  {sum(t.numel() for t in tensors):>9,} elements  "
                    f"{'/'.join(dtypes)}")
    return "\n".join(rows)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="zerofast-demo-") as tmp:
        spec = demo_layout()
        truth = synthesize(tmp, spec)
        print(f"synthesized a ZeRO-{spec.stage} checkpoint: world size {spec.world_size}, "
              f"{str(spec.model_dtype).replace('torch.', '')} training, in {tmp}")
        t0 = time.perf_counter()
        sd = zerofast.reconstruct(tmp)
        elapsed = time.perf_counter() - t0
        print(f"zerofast.reconstruct -> {len(sd)} tensors in {elapsed * 1000:.1f} ms (dtype=float32):")
        print(_summary(sd, truth))
        mismatched = [n for n, v in {**truth.trainable, **truth.frozen}.items() if not torch.equal(sd[n], v.float())]
        tied_ok = all(sd[a] is sd[s] for a, s in truth.tied.items())
        print(f"  tied: {truth.tied} share storage: {tied_ok}")
        print(f"  bit-identical to the synthesized ground truth: {not mismatched and tied_ok}")
        lazy = zerofast.reconstruct(tmp, dtype=None, lazy=True)
        meta = lazy.meta("base.weight")
        print(f"lazy, dtype=None: base.weight is {tuple(meta.shape)} {meta.dtype} (frozen, kept as stored)")
        return 0 if not mismatched and tied_ok else 1


if __name__ == "__main__":
    sys.exit(main())
