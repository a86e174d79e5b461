"""Train a tiny MoE, pipeline-parallel or AutoTP model with DeepSpeed on the CPU; save it and ground truth.

Run under torchrun like train.py:

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node W \
        tests/dsgen/train_families.py '<spec as JSON>' OUTDIR

Spec keys: family ("moe" | "pipe" | "autotp"), stage, world_size, dtype ("bf16" | "fp32"), steps, ep
(MoE: expert-parallel degree), pp (pipeline: stages), tp (AutoTP degree), ds_config (merged into the
generated config).

Rank 0 writes ``OUTDIR/ground_truth.pt`` (plain data, ``torch.load(weights_only=True)``) with the
keys of train.py's ground truth, under the names a consolidated checkpoint must have:

    trainable         name -> fp32 master, from safe_get_full_fp32_param (stages 1-3) or the
                      mixed-precision wrapper's fp32_groups (stage 0), gathered over all ranks;
                      AutoTP shards put together by the TP layer's own gather_params
    frozen, buffers   name -> value as the module holds it
    optimizer_states  key -> name -> full fp32 Adam state. Expert params: assembled from the base
                      optimizer's own state (DeepSpeed's safe_get_full_optimizer_state raises for
                      them); other params: safe_get_full_optimizer_state
    state_dict_keys   the consolidated names in order; tied: alias -> source
    layout            family, dp, ep, pp, experts per MoE layer, stage of each pipeline layer

MoE names are global: expert ``l`` of expert-parallel rank ``e`` is ``e * num_local + l``, the
names of ``family_models.build_moe(1)``. Pipeline names are PipelineModule's (``<layer>.<key>``,
``tied_modules.<key>.<param>``); ``sequential_keys`` lists ``build_sequential()``'s names. AutoTP
names and shapes are those of ``build_llama()`` (full tensors, not shards).
"""
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402
from deepspeed.utils import groups, safe_get_full_fp32_param  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import family_models as fm  # noqa: E402
import train as base  # noqa: E402
from gloo_job import process_group  # noqa: E402

_EXPERT = re.compile(r"^(.*\.deepspeed_experts\.)(\d+)(\..*)$")


def main():
    spec = base.read_spec(sys.argv[1])
    outdir = Path(sys.argv[2])
    stage = int(spec["stage"])
    steps = int(spec.get("steps", 2))
    tag = spec.get("tag", f"global_step{steps}")
    with process_group(lambda: deepspeed.init_distributed(dist_backend="gloo")):  # barrier, then torn down
        train_and_save(spec, outdir, stage, steps, tag)


def train_and_save(spec, outdir, stage, steps, tag):
    world = dist.get_world_size()
    assert world == spec["world_size"], (world, spec["world_size"])
    cfg = base.ds_config_for(spec)
    run = {"moe": run_moe, "pipe": run_pipe, "autotp": run_autotp}[spec["family"]]
    engine, truth = run(spec, cfg, stage, steps)
    engine.save_checkpoint(str(outdir), tag=tag)
    merged = merge_truth(truth)
    if dist.get_rank() == 0:
        merged.update(model_dtype="bfloat16" if spec["dtype"] == "bf16" else "float32", stage=stage,
                      world_size=world, tag=tag, spec=spec, ds_version=deepspeed.__version__)
        tmp = outdir / "ground_truth.pt.tmp"
        torch.save(merged, tmp)
        torch.load(tmp, weights_only=True)
        os.replace(tmp, outdir / "ground_truth.pt")


# -- mixture of experts ---------------------------------------------------------------------------

def run_moe(spec, cfg, stage, steps):
    from deepspeed.moe.layer import MoE
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    ep = int(spec["ep"])
    model = fm.build_moe(ep)
    groups_ = split_params_into_different_moe_groups_for_optimizer(
        [{"params": [p for p in model.parameters() if p.requires_grad], "name": "shared"}])
    optimizer = torch.optim.AdamW(groups_, lr=1e-2, betas=(0.9, 0.99))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    for _ in range(steps):
        ids = torch.randint(0, fm.VOCAB, (2, 6), generator=gen)
        loss = engine(ids, torch.randint(0, fm.VOCAB, (2, 6), generator=gen))
        engine.backward(loss)
        engine.step()

    module = engine.module
    moes = {prefix + ".": m for prefix, m in module.named_modules() if isinstance(m, MoE)}

    def global_name(name):
        m = _EXPERT.match(name)
        if not m:
            return name, False
        layer = next(m_ for prefix, m_ in moes.items() if name.startswith(prefix))
        e = groups._get_expert_parallel_rank(layer.expert_group_name)
        return f"{m.group(1)}{e * layer.num_local_experts + int(m.group(2))}{m.group(3)}", True

    masters = base.stage0_fp32_masters(engine, stage)
    base.relink_optimizer_state(engine)
    trainable, frozen, opt = {}, {}, {k: {} for k in base.OPTIMIZER_KEYS} if stage else {}
    for name, p in module.named_parameters():
        gname, expert = global_name(name)
        if not p.requires_grad:
            frozen[gname] = p.detach().clone()
            continue
        full = masters[id(p)] if stage == 0 else safe_get_full_fp32_param(p)
        trainable[gname] = full.detach().float().clone().reshape(p.shape)
        for key in opt:
            opt[key][gname] = (expert_optimizer_state(engine, p, key) if expert
                               else base.full_optimizer_state(p, key, name))
    persistent = set(module.state_dict())
    buffers = {n: b.detach().clone() for n, b in module.named_buffers() if n in persistent}
    single = fm.build_moe(1)
    layout = {"family": "moe", "dp": dist.get_world_size(), "ep": ep,
              "experts": {prefix[:-1]: m.num_experts for prefix, m in moes.items()}}
    return engine, {
        "trainable": trainable, "frozen": frozen, "buffers": buffers, "optimizer_states": opt,
        "state_dict_keys": list(single.state_dict().keys()),
        "tied": {"lm_head.weight": "embed.weight"},
        "optimizer_step": base.inner_optimizer_step(engine, stage),
        "layout": layout,
    }


def expert_optimizer_state(engine, p, key):
    """The full optimizer state of an expert parameter, read from the base optimizer's state.

    Each rank of the expert-data-parallel group holds one fragment of the param's flat partition;
    the fragments are summed over that group (the zeros elsewhere add nothing).
    """
    mapping = p._hp_mapping
    full = torch.zeros(p.numel(), dtype=torch.float32)
    if mapping is not None:
        flat = engine.optimizer.single_partition_of_fp32_groups[mapping.param_group_index]
        state = engine.optimizer.optimizer.state[flat][key]
        hp, lp = mapping.hp_fragment_address, mapping.lp_fragment_address
        full.narrow(0, lp.start, lp.numel).copy_(state.narrow(0, hp.start, hp.numel))
    dist.all_reduce(full, group=groups._get_expert_data_parallel_group(p.group_name))
    return full.reshape(p.shape)


# -- pipeline parallel ----------------------------------------------------------------------------

def run_pipe(spec, cfg, stage, steps):
    from deepspeed.pipe import PipelineModule

    pp = int(spec["pp"])
    cfg = base.deep_merge(cfg, {"gradient_accumulation_steps": 2})
    torch.manual_seed(1234)
    model = PipelineModule(layers=fm.pipe_layers(), num_stages=pp, loss_fn=fm.pipe_loss,
                           partition_method="uniform")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.99))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    gen = torch.Generator().manual_seed(1000 + engine.grid.get_data_parallel_rank())

    def batches():
        while True:
            yield (torch.randint(0, fm.VOCAB, (2, 6), generator=gen),
                   torch.randint(0, fm.VOCAB, (2, 6), generator=gen))

    data = batches()
    for _ in range(steps):
        engine.train_batch(data_iter=data)

    module = engine.module
    base.relink_optimizer_state(engine)
    masters = base.stage0_fp32_masters(engine, stage)
    trainable, frozen, opt = {}, {}, {k: {} for k in base.OPTIMIZER_KEYS} if stage else {}
    for name, p in module.named_parameters():
        if not p.requires_grad:
            frozen[name] = p.detach().clone()
            continue
        full = masters[id(p)] if stage == 0 else safe_get_full_fp32_param(p)
        trainable[name] = full.detach().float().clone().reshape(p.shape)
        for key in opt:
            opt[key][name] = base.full_optimizer_state(p, key, name)
    persistent = set(module.state_dict())
    buffers = {n: b.detach().clone() for n, b in module.named_buffers() if n in persistent}
    layer_stage = {i: module._topo.get_coord(dist.get_rank()).pipe
                   for i in range(module._local_start, module._local_stop)}
    layout = {"family": "pipe", "dp": engine.grid.get_data_parallel_world_size(), "pp": pp,
              "layer_stage": layer_stage}
    return engine, {
        "trainable": trainable, "frozen": frozen, "buffers": buffers, "optimizer_states": opt,
        "state_dict_keys": list(module.state_dict().keys()),
        "sequential_keys": list(fm.build_sequential().state_dict().keys()),
        "tied": {},
        "optimizer_step": base.inner_optimizer_step(engine, stage),
        "layout": layout,
    }


# -- AutoTP --------------------------------------------------------------------------------------

# ``frozen`` (AutoTP, stages 1-2): frozen before training, so each tp rank's model states hold
# its shard; column-, row-parallel and replicated ones (AutoTP's affine_map covers them all)
AUTOTP_FROZEN = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight",
                 "model.layers.0.mlp.gate_proj.weight", "model.layers.0.input_layernorm.weight")


def run_autotp(spec, cfg, stage, steps):
    from deepspeed.module_inject.layers import TensorParallel_Layer

    tp = int(spec["tp"])
    cfg = base.deep_merge(cfg, {"tensor_parallel": {"autotp_size": tp}})
    if stage == 3:
        # Building the model imports torch._dynamo lazily, which fails under zero.Init's patched
        # tensor constructors: import it first.
        import transformers.generation.utils  # noqa: F401
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = fm.build_llama()
    else:
        model = fm.build_llama()
    frozen_names = set(AUTOTP_FROZEN) if spec.get("frozen") else set()
    assert not (frozen_names and stage == 3), "frozen: stages 1-2"
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen_names)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, betas=(0.9, 0.99))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    dp_rank = dist.get_rank() // tp
    gen = torch.Generator().manual_seed(1000 + dp_rank)
    for _ in range(steps):
        ids = torch.randint(0, fm.VOCAB, (2, 6), generator=gen)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()

    module = engine.module
    base.relink_optimizer_state(engine)
    owner = {id(p): m for m in module.modules() if isinstance(m, TensorParallel_Layer)
             for p in m.parameters(recurse=False)}
    trainable, frozen, opt = {}, {}, {k: {} for k in base.OPTIMIZER_KEYS}
    for name, p in module.named_parameters():
        if not p.requires_grad:  # as the model holds it (its dtype), the shards put together
            frozen[name] = tp_gathered(owner[id(p)], p, p.detach()) if id(p) in owner else p.detach().clone()
            continue
        values = [safe_get_full_fp32_param(p)] + [base.full_optimizer_state(p, k, name) for k in opt]
        values = [v.detach().float().clone().reshape(base.full_shape(p)) for v in values]
        if id(p) in owner:
            values = [tp_gathered(owner[id(p)], p, v) for v in values]
        trainable[name] = values[0]
        for k, v in zip(opt, values[1:]):
            opt[k][name] = v
    persistent = set(module.state_dict())
    buffers = {n: b.detach().clone() for n, b in module.named_buffers() if n in persistent}
    layout = {"family": "autotp", "dp": dist.get_world_size() // tp, "tp": tp}
    return engine, {
        "trainable": trainable, "frozen": frozen, "buffers": buffers, "optimizer_states": opt,
        "state_dict_keys": list(fm.build_llama().state_dict().keys()), "tied": {},
        "optimizer_step": base.inner_optimizer_step(engine, stage), "layout": layout,
    }


def tp_gathered(layer, p, shard):
    """The full tensor of a tensor-parallel shard, put together by the layer's own gather_params
    (DeepSpeed's all-gather along the layer's partition dim) on a stand-in holding ``shard``."""
    holders = [torch.nn.Parameter(shard.clone(), requires_grad=False) if q is p else None
               for q in (layer.weight, getattr(layer, "bias", None))]
    layer.gather_params(holders)
    return next(h for h in holders if h is not None).data.detach().clone()


# -- merging the ranks' views ---------------------------------------------------------------------

def merge_truth(local):
    """Collect every rank's entries on all ranks; a name two ranks hold must agree bit for bit."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    merged = dict(everyone[0])
    for part in ("trainable", "frozen", "buffers"):
        merged[part] = _merge_maps([r[part] for r in everyone], part)
    merged["optimizer_states"] = {k: _merge_maps([r["optimizer_states"][k] for r in everyone], k)
                                  for k in everyone[0]["optimizer_states"]}
    merged["state_dict_keys"] = _merge_keys([r["state_dict_keys"] for r in everyone])
    if everyone[0]["layout"]["family"] == "pipe":
        stages = {}
        for r in everyone:
            stages.update(r["layout"]["layer_stage"])
        merged["layout"] = dict(everyone[0]["layout"], layer_stage=[stages[i] for i in sorted(stages)])
        merged["state_dict_keys"] = _pipe_order(merged["state_dict_keys"])
    return merged


def _merge_maps(maps, what):
    out = {}
    for m in maps:
        for name, value in m.items():
            if name in out:
                same = out[name].dtype == value.dtype and torch.equal(out[name].view(-1).view(torch.uint8),
                                                                      value.view(-1).view(torch.uint8))
                if not same:
                    raise RuntimeError(f"ranks disagree on {what} {name}")
            else:
                out[name] = value
    return out


def _merge_keys(lists):
    seen = {}
    for keys in lists:
        for k in keys:
            seen.setdefault(k, None)
    return list(seen)


def _pipe_order(keys):
    """Layer order: ``<index>.*`` by index, each tied module at its first layer."""
    def rank(k):
        head = k.split(".", 1)[0]
        return (int(head), 0) if head.isdigit() else (-1, 0)
    return sorted(keys, key=rank)


if __name__ == "__main__":
    from gloo_job import exit_now

    main()
    exit_now()  # torn down and written: no finalization (tests/dsgen/gloo_job.py)
