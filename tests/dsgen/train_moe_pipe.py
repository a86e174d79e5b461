"""Train a tiny ``PipelineModule`` whose every stage holds a ``deepspeed.moe.layer.MoE`` layer, with
DeepSpeed on the CPU (gloo); save it and the job's ground truth (issue 47).

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node W \
        tests/dsgen/train_moe_pipe.py '<spec as JSON>' OUTDIR

Spec keys: family "moe_pipe", stage (0 or 1: a pipeline allows no more), world_size, dtype, pp
(stages, 2), ep (expert-parallel degree inside a stage's data-parallel group), steps.

Layers (``MOE_PIPE_LAYERS``), split uniformly over the two stages: an embedding, an MoE block of 4
experts, a plain block | an MoE block of 2 experts, train_families' frozen block with buffers, a
head. Every stage needs an MoE layer: DeepSpeed makes the expert groups in ``deepspeed.initialize``,
collectively, and a stage without one hangs there.

Rank 0 writes ``OUTDIR/ground_truth.pt`` with train_families.py's keys: ``trainable`` (fp32 masters
from ``safe_get_full_fp32_param``), ``frozen``, ``buffers`` under PipelineModule names, experts by
their global ids (expert ``l`` of expert-parallel rank ``e`` is ``e * num_local + l``), and
``layout`` with ``stage_moe`` (per stage, the PipelineModule name of each MoE layer in module order).
"""
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
from torch import nn  # noqa: E402
import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402
from deepspeed.utils import groups, safe_get_full_fp32_param  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import family_models as fm  # noqa: E402
import train as base  # noqa: E402
import train_families as tf  # noqa: E402
from gloo_job import process_group  # noqa: E402

_EXPERT = re.compile(r"^(.*\.deepspeed_experts\.)(\d+)(\..*)$")
EXPERTS_PER_STAGE = (4, 2)


class MoEBlock(nn.Module):
    """A residual MoE layer (the pipeline passes one tensor; the aux loss is left out)."""

    def __init__(self, num_experts: int, ep_size: int):
        super().__init__()
        from deepspeed.moe.layer import MoE

        self.norm = nn.LayerNorm(fm.DIM)
        self.moe = MoE(hidden_size=fm.DIM, expert=fm.Expert(), num_experts=num_experts, ep_size=ep_size, k=1,
                       min_capacity=4)

    def forward(self, x):
        return x + self.moe(self.norm(x))[0]


def moe_pipe_layers(ep_size: int):
    from deepspeed.pipe import LayerSpec

    return [LayerSpec(fm.Embed, fm.VOCAB, fm.DIM), LayerSpec(MoEBlock, EXPERTS_PER_STAGE[0], ep_size),
            LayerSpec(fm.PipeBlock),
            LayerSpec(MoEBlock, EXPERTS_PER_STAGE[1], ep_size), LayerSpec(fm.FrozenBlock),
            LayerSpec(nn.Linear, fm.DIM, fm.VOCAB, bias=False)]


def main():
    spec = base.read_spec(sys.argv[1])
    outdir = Path(sys.argv[2])
    with process_group(lambda: deepspeed.init_distributed(dist_backend="gloo")):
        train_and_save(spec, outdir)


def train_and_save(spec, outdir):
    from deepspeed.moe.layer import MoE
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from deepspeed.pipe import PipelineModule

    stage, steps, ep, pp = int(spec["stage"]), int(spec.get("steps", 2)), int(spec["ep"]), int(spec["pp"])
    tag = spec.get("tag", f"global_step{steps}")
    world = dist.get_world_size()
    assert world == spec["world_size"], (world, spec["world_size"])
    cfg = base.deep_merge(base.ds_config_for(spec), {"gradient_accumulation_steps": 2})
    torch.manual_seed(1234)
    model = PipelineModule(layers=moe_pipe_layers(ep), num_stages=pp, loss_fn=fm.pipe_loss,
                           partition_method="uniform")
    groups_ = split_params_into_different_moe_groups_for_optimizer(
        [{"params": [p for p in model.parameters() if p.requires_grad], "name": "shared"}])
    optimizer = torch.optim.AdamW(groups_, lr=1e-2, betas=(0.9, 0.99))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    gen = torch.Generator().manual_seed(1000 + engine.grid.get_data_parallel_rank())

    def batches():
        while True:
            yield (torch.randint(0, fm.VOCAB, (2, 6), generator=gen),
                   torch.randint(0, fm.VOCAB, (2, 6), generator=gen))

    data = batches()
    for _ in range(steps):
        engine.train_batch(data_iter=data)
    engine.save_checkpoint(str(outdir), tag=tag)

    module = engine.module
    moes = {prefix + ".": m for prefix, m in module.named_modules() if isinstance(m, MoE)}

    def global_name(name):
        m = _EXPERT.match(name)
        if not m:
            return name
        layer = next(m_ for prefix, m_ in moes.items() if name.startswith(prefix))
        e = groups._get_expert_parallel_rank(layer.expert_group_name)
        return f"{m.group(1)}{e * layer.num_local_experts + int(m.group(2))}{m.group(3)}"

    masters = base.stage0_fp32_masters(engine, stage)
    trainable, frozen = {}, {}
    for name, p in module.named_parameters():
        if not p.requires_grad:
            frozen[global_name(name)] = p.detach().clone()
            continue
        full = masters[id(p)] if stage == 0 else safe_get_full_fp32_param(p)
        trainable[global_name(name)] = full.detach().float().clone().reshape(p.shape)
    persistent = set(module.state_dict())
    buffers = {n: b.detach().clone() for n, b in module.named_buffers() if n in persistent}
    pipe_stage = engine.grid.get_stage_id()
    keys = _expanded(module.state_dict(), moes)
    experts = {prefix[:-1]: m.num_experts for prefix, m in moes.items()}
    local = {"trainable": trainable, "frozen": frozen, "buffers": buffers, "optimizer_states": {},
             "state_dict_keys": keys, "tied": {}, "optimizer_step": None,
             "layout": {"family": "moe_pipe", "dp": engine.grid.get_data_parallel_world_size(), "ep": ep, "pp": pp,
                        "stage_moe": {pipe_stage: list(experts)}, "experts": experts}}
    everyone = [None] * world
    dist.all_gather_object(everyone, local)
    merged = {"trainable": tf._merge_maps([r["trainable"] for r in everyone], "trainable"),
              "frozen": tf._merge_maps([r["frozen"] for r in everyone], "frozen"),
              "buffers": tf._merge_maps([r["buffers"] for r in everyone], "buffers"),
              "optimizer_states": {}, "tied": {}}
    stage_moe, all_experts = {}, {}
    for r in everyone:
        stage_moe.update(r["layout"]["stage_moe"])
        all_experts.update(r["layout"]["experts"])
    merged["layout"] = dict(everyone[0]["layout"], stage_moe=[stage_moe[s] for s in sorted(stage_moe)],
                            experts=all_experts)
    merged["state_dict_keys"] = tf._pipe_order(tf._merge_keys([r["state_dict_keys"] for r in everyone]))
    if dist.get_rank() == 0:
        merged.update(model_dtype="bfloat16" if spec["dtype"] == "bf16" else "float32", stage=stage,
                      world_size=world, tag=tag, spec=spec, ds_version=deepspeed.__version__)
        tmp = outdir / "ground_truth.pt.tmp"
        torch.save(merged, tmp)
        torch.load(tmp, weights_only=True)
        os.replace(tmp, outdir / "ground_truth.pt")


def _expanded(state_dict, moes):
    """The stage's state-dict names with each MoE layer's local experts replaced, at the first of
    them, by every expert of the layer by global id (a model built at ep 1 registers them so)."""
    out, done = [], set()
    for n in state_dict:
        m = _EXPERT.match(n)
        if m is None:
            out.append(n)
            continue
        if m.group(1) in done:
            continue
        done.add(m.group(1))
        layer = next(m_ for prefix, m_ in moes.items() if n.startswith(prefix))
        rests = [r.group(3) for k in state_dict if (r := _EXPERT.match(k)) and r.group(1) == m.group(1)
                 and r.group(2) == m.group(2)]
        out += [f"{m.group(1)}{e}{rest}" for e in range(layer.num_experts) for rest in rests]
    return out


if __name__ == "__main__":
    from gloo_job import exit_now

    main()
    exit_now()
