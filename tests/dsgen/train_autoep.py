"""Train a tiny transformers Qwen3-MoE under DeepSpeed AutoEP on the CPU; save it and ground truth.

Run under torchrun like train_families.py:

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node W \
        tests/dsgen/train_autoep.py '<spec as JSON>' OUTDIR

Spec keys: stage, world_size, dtype ("bf16" | "fp32"), steps, ep (``expert_parallel.autoep_size``),
frozen (freeze a dense norm and one layer's fused ``down_proj`` before ``deepspeed.initialize``),
ds_config (merged into the generated config).

AutoEP (DeepSpeed 0.19.2+, ``expert_parallel.enabled``) replaces each ``model.layers.N.mlp`` with an
``AutoEPMoELayer``: ``router.gate.weight`` (the HF ``mlp.gate.weight``), the ep rank's local experts
fused as ``experts.w1`` (gate), ``experts.w2`` (down), ``experts.w3`` (up), shape
``[num_local_experts, ...]``, and ``mlp.gate`` kept as a second name of the router module, so
``state_dict()`` lists ``mlp.gate.gate.weight`` too.

Rank 0 writes ``OUTDIR/ground_truth.pt`` (plain data) with train_families.py's keys, under the names
of the AutoEP module at ep 1 (``experts.w1`` with every expert, ``[num_experts, ...]``):

    trainable         name -> fp32 master. Dense: safe_get_full_fp32_param. Experts: each ep rank's
                      safe_get_full_fp32_param of its local ``w1`` (gathered over its expert-data-parallel
                      group by DeepSpeed), all-gathered over the expert-parallel group and placed by the
                      layer's own ``expert_placement_descriptor``
    frozen, buffers   name -> value as the module holds it (frozen experts gathered as above)
    optimizer_states  key -> name -> full fp32 Adam state (experts: train_families.expert_optimizer_state,
                      then placed like the masters)
    state_dict_keys   ``engine.module.state_dict()``'s names, experts in full; tied: ``mlp.gate.*`` ->
                      ``mlp.router.*`` (one module under two names)
    hf_state_dict_keys  the transformers model's own names before AutoEP replaced its MoE blocks
    layout            family, dp, ep, experts per AutoEP layer

At ZeRO-3 (``checkpoint_format: zero3_partitioned``, no expert files) the same keys under the same
names: every parameter's ``safe_get_full_fp32_param`` (gathered by DeepSpeed over the parameter's own
ZeRO-3 group: every rank for the dense ones, the expert-data-parallel group for ``experts.w*``), the
Adam states by ``safe_get_full_optimizer_state`` the same way, frozen values inside
``deepspeed.zero.GatheredParameters``; the experts then all-gathered over the expert-parallel group
and placed as at ZeRO 1-2.
"""
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

# DeepSpeed 0.19.8's AutoEP presets call ``_CAN_RECORD_REGISTRY.get(key, default)`` on transformers'
# output-capture registry, whose ``get`` takes one argument since transformers 5.x ("TypeError:
# _CanRecordRegistry.get() takes 2 positional arguments but 3 were given" in
# _install_instance_transformers_output_recorders). The registry is a dict keyed by class-name
# strings; a string key with a default is a plain dict lookup. This touches only the router-logits
# recorders, not what is trained or saved.
from transformers.utils import output_capturing as _oc  # noqa: E402

_registry_get = _oc._CanRecordRegistry.get


def _get(self, key, *default):
    if isinstance(key, str):
        return dict.get(self, key, *default)
    return _registry_get(self, key)


_oc._CanRecordRegistry.get = _get

import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402
from deepspeed.utils import groups, safe_get_full_fp32_param  # noqa: E402
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train as base  # noqa: E402
import train_families as fam  # noqa: E402
from gloo_job import exit_now, process_group  # noqa: E402

VOCAB = 64
EXPERTS = 4
FROZEN = ("model.layers.0.self_attn.q_norm.weight", "model.layers.1.mlp.experts.down_proj")


def build_model():
    torch.manual_seed(1234)
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         num_experts=EXPERTS, num_experts_per_tok=2, decoder_sparse_step=1,
                         max_position_embeddings=32, mlp_only_layers=[], tie_word_embeddings=False)
    return Qwen3MoeForCausalLM(cfg)


def main():
    spec = base.read_spec(sys.argv[1])
    outdir = Path(sys.argv[2])
    steps = int(spec.get("steps", 2))
    tag = spec.get("tag", f"global_step{steps}")
    with process_group(lambda: deepspeed.init_distributed(dist_backend="gloo")):
        train_and_save(spec, outdir, int(spec["stage"]), steps, tag)


def train_and_save(spec, outdir, stage, steps, tag):
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    world = dist.get_world_size()
    assert world == spec["world_size"], (world, spec["world_size"])
    ep = int(spec["ep"])
    cfg = base.deep_merge(base.ds_config_for(spec), {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.99]}},
        "expert_parallel": {"enabled": True, "autoep_size": ep, "preset_model": "qwen3_moe"}})
    model = build_model()
    hf_keys = list(model.state_dict().keys())
    if spec.get("frozen"):
        for name, p in model.named_parameters():
            if name in FROZEN:
                p.requires_grad_(False)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()],
                                           config=cfg)
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (2, 6), generator=gen)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(str(outdir), tag=tag)

    module = engine.module
    layers = {name: m for name, m in module.named_modules() if isinstance(m, AutoEPMoELayer)}
    layout = {"family": "autoep", "dp": world, "ep": ep,
              "experts": {name: m.num_experts for name, m in layers.items()}}
    merged = fam.merge_truth(collect_truth(engine, module, layers, stage, hf_keys, layout))
    if dist.get_rank() == 0:
        merged.update(model_dtype="bfloat16" if spec["dtype"] == "bf16" else "float32", stage=stage,
                      world_size=world, tag=tag, spec=spec, ds_version=deepspeed.__version__)
        tmp = outdir / "ground_truth.pt.tmp"
        torch.save(merged, tmp)
        torch.load(tmp, weights_only=True)
        os.replace(tmp, outdir / "ground_truth.pt")


def collect_truth(engine, module, layers, stage, hf_keys, layout):
    def layer_of(name):
        for prefix, m in layers.items():
            for w in ("w1", "w2", "w3"):
                if name == f"{prefix}.experts.{w}":
                    return m
        return None

    def full_experts(m, local):
        """Every ep rank's ``local`` (its experts, in its order) placed by the layer's descriptor."""
        group = groups._get_expert_parallel_group(m.ep_group_name)
        parts = [torch.empty_like(local) for _ in range(m.ep_size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        full = torch.empty((m.num_experts, *local.shape[1:]), dtype=local.dtype)
        placement = m.expert_placement_descriptor
        for rank_entry in placement["ranks"]:
            full[list(rank_entry["experts"])] = parts[rank_entry["rank"]]
        return full

    masters = base.stage0_fp32_masters(engine, stage)
    base.relink_optimizer_state(engine)
    trainable, frozen, opt = {}, {}, {k: {} for k in base.OPTIMIZER_KEYS} if stage else {}
    for name, p in module.named_parameters():
        m = layer_of(name)
        if not p.requires_grad:
            if stage == 3:  # gathered over the parameter's own ZeRO-3 group
                with deepspeed.zero.GatheredParameters([p]):
                    value = p.detach().clone().reshape(base.full_shape(p))
            else:
                value = p.detach().clone()
            frozen[name] = full_experts(m, value) if m is not None else value
            continue
        value = masters[id(p)] if stage == 0 else safe_get_full_fp32_param(p)
        value = value.detach().float().clone().reshape(base.full_shape(p))
        trainable[name] = full_experts(m, value) if m is not None else value
        for key in opt:
            if m is not None and stage == 3:  # the expert-data-parallel group's full state of the local experts
                opt[key][name] = full_experts(m, base.full_optimizer_state(p, key, name))
            elif m is not None:
                opt[key][name] = full_experts(m, fam.expert_optimizer_state(engine, p, key))
            else:
                opt[key][name] = base.full_optimizer_state(p, key, name)
    state = module.state_dict()
    persistent = set(state)
    buffers = {n: b.detach().clone() for n, b in module.named_buffers() if n in persistent}
    tied = {}
    for prefix, m in layers.items():
        for alias, sub in m._modules.items():  # named_children() lists a module once
            if sub is m.router and alias != "router":
                tied.update({f"{prefix}.{alias}.{k}": f"{prefix}.router.{k}" for k in m.router.state_dict()})
    return {
        "trainable": trainable, "frozen": frozen, "buffers": buffers, "optimizer_states": opt,
        "state_dict_keys": list(state.keys()), "tied": tied, "hf_state_dict_keys": hf_keys,
        "optimizer_step": base.inner_optimizer_step(engine, stage), "layout": layout,
    }


if __name__ == "__main__":
    main()
    exit_now()
