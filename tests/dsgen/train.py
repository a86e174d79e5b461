"""Train a tiny model with DeepSpeed on the CPU, save a ZeRO checkpoint and ground truth.

Run under torchrun (one process per data-parallel rank):

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node W \
        tests/dsgen/train.py '<layout spec as JSON, or a path to a .json file>' OUTDIR

OUTDIR becomes the checkpoint root (``latest``, the tag folder, ``zero_to_fp32.py``)
and rank 0 adds ``OUTDIR/ground_truth.pt``, taken from DeepSpeed's own view of the
trained parameters (never from the checkpoint files). It holds only plain tensors,
lists, dicts, ints and strings, so ``torch.load(path, weights_only=True)`` reads it:

    trainable        name -> fp32 master (full, shaped like the parameter)
    frozen           name -> full value in the model dtype (there is no fp32 master)
    buffers          name -> persistent buffer as the module holds it
    state_dict_keys  list(model.state_dict().keys()) of the plain module
    tied             alias -> source name (the alias is in neither trainable nor frozen)
    empty_trainable  names of trainable zero-element params (recorded under "frozen")
    param_groups     list per optimizer group of trainable names (DeepSpeed's group order)
    optimizer_states key -> name -> full fp32 optimizer state of each trainable parameter, from
                     safe_get_full_optimizer_state, for the keys in OPTIMIZER_KEYS (stages 1-3;
                     empty at stage 0, where DeepSpeed has no such accessor)
    optimizer_step   the wrapped optimizer's per-parameter ``step`` (None at stage 0)
    model_dtype, stage, world_size, tag, spec, ds_version

Spec keys: stage, world_size, dtype ("bf16"|"fp32"), n_groups, steps, tag, model (kwargs
for models.build_model), ds_config (merged into the generated DeepSpeed config; the
"zero_optimization" sub-dict is merged key by key).
"""
import importlib.util
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # noqa: E402


def _load_models():
    # Load models.py by path: this script runs as a file, not as part of the package.
    path = Path(__file__).resolve().with_name("models.py")
    spec = importlib.util.spec_from_file_location("zf_dsgen_models", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


models = _load_models()

# Adam's per-element states, gathered for the ground truth of zerofast.optimizer_state.
OPTIMIZER_KEYS = ("exp_avg", "exp_avg_sq")


def read_spec(arg: str) -> dict:
    if arg.lstrip().startswith("{"):
        return json.loads(arg)
    return json.loads(Path(arg).read_text())


def deep_merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def ds_config_for(spec: dict) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": spec["stage"]},
    }
    if spec["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif spec["dtype"] != "fp32":
        raise ValueError(f"dtype {spec['dtype']!r}: only bf16 and fp32 run on the CPU accelerator")
    return deep_merge(cfg, spec.get("ds_config", {}))


def stage0_fp32_masters(engine, stage: int) -> dict:
    """Map id(lp param) -> DeepSpeed's own fp32 master at stage 0.

    safe_get_full_fp32_param() returns None at stage 0: the params carry neither ``ds_id``
    (stage 3) nor ``_hp_mapping`` (stage 1/2 and BF16_Optimizer). So the masters are read
    from the mixed-precision wrapper the engine built:
      * bf16 without ZeRO -> FP16_UnfusedOptimizer (with a torch client optimizer):
        ``fp16_groups[g][i]`` is the model param, ``fp32_groups[g][i]`` its fp32 master;
      * FP16_Optimizer (fused; only with FusedAdam): ``fp32_groups_flat[g]`` is the flat
        master of ``fp16_groups[g]``, unflattened here in that order;
      * plain fp32 without ZeRO -> no wrapper, the torch optimizer updates the module
        params directly, so the param itself is the master.
    """
    if stage != 0:
        return {}
    opt = engine.optimizer
    out = {}
    if hasattr(opt, "fp32_groups") and hasattr(opt, "fp16_groups"):
        for lp_group, hp_group in zip(opt.fp16_groups, opt.fp32_groups):
            assert len(lp_group) == len(hp_group)
            for lp, hp in zip(lp_group, hp_group):
                out[id(lp)] = hp.detach().float().clone()
    elif hasattr(opt, "fp32_groups_flat") and hasattr(opt, "fp16_groups"):
        for lp_group, flat in zip(opt.fp16_groups, opt.fp32_groups_flat):
            off = 0
            for lp in lp_group:
                n = lp.numel()
                out[id(lp)] = flat.detach()[off:off + n].view(lp.shape).float().clone()
                off += n
    elif isinstance(opt, torch.optim.Optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                if p.dtype != torch.float32:
                    raise RuntimeError("stage 0 without a wrapper, but the param is not fp32")
                out[id(p)] = p.detach().clone()
    else:
        raise RuntimeError(f"stage 0: don't know where {type(opt).__name__} keeps its fp32 masters")
    return out


def main():
    from gloo_job import process_group  # this folder is first on sys.path: the script runs as a file

    spec = read_spec(sys.argv[1])
    outdir = Path(sys.argv[2])
    with process_group(lambda: deepspeed.init_distributed(dist_backend="gloo")):  # barrier, then torn down
        train_and_save(spec, outdir)


def train_and_save(spec: dict, outdir: Path) -> None:
    stage = int(spec["stage"])
    steps = int(spec.get("steps", 3))
    tag = spec.get("tag", f"global_step{steps}")
    rank = dist.get_rank()
    world = dist.get_world_size()
    assert world == spec["world_size"], (world, spec["world_size"])

    cfg = ds_config_for(spec)
    if stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = models.build_model(spec.get("model"))
    else:
        model = models.build_model(spec.get("model"))

    groups = models.param_groups(model, int(spec.get("n_groups", 1)))
    # Names per optimizer group, trainable ones only, taken before DeepSpeed rewrites the
    # groups (stage 3 swaps group["params"] for its fp32 partitions).
    names_by_id = {id(p): n for n, p in model.named_parameters()}
    group_names = [[names_by_id[id(p)] for p in g["params"] if p.requires_grad and full_numel(p) > 0]
                   for g in groups]
    optimizer = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.99))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)

    vocab = models.model_kwargs(spec.get("model"))["vocab"]
    gen = torch.Generator().manual_seed(1000 + rank)
    for _ in range(steps):
        ids = torch.randint(0, vocab, (2, 6), generator=gen)
        targets = torch.randint(0, vocab, (2, 6), generator=gen)
        loss = engine(ids.to(engine.device), targets.to(engine.device))
        engine.backward(loss)
        engine.step()

    engine.save_checkpoint(str(outdir), tag=tag)

    module = engine.module
    # Tied parameters: named_parameters() yields a shared Parameter once, under the name met
    # first; every later name of the same object is an alias.
    first_name = {}
    tied = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first_name:
            tied[name] = first_name[id(p)]
        else:
            first_name[id(p)] = name

    masters = stage0_fp32_masters(engine, stage)
    trainable, frozen = {}, {}
    optimizer_states = {key: {} for key in OPTIMIZER_KEYS} if stage else {}
    relink_optimizer_state(engine)
    # Every rank walks the same parameters in the same order: the gathers are collectives.
    for name, p in module.named_parameters():
        if p.requires_grad and full_numel(p) > 0:
            if stage == 0:
                full = masters[id(p)]
            else:
                full = safe_get_full_fp32_param(p)
                if full is None:
                    raise RuntimeError(f"safe_get_full_fp32_param({name}) returned None at stage {stage}")
            trainable[name] = full.detach().float().cpu().clone().reshape(full_shape(p))
            for key in optimizer_states:  # collective like the fp32 gather: same order on every rank
                optimizer_states[key][name] = full_optimizer_state(p, key, name)
        else:
            if hasattr(p, "ds_id"):
                with deepspeed.zero.GatheredParameters([p]):
                    value = p.detach().cpu().clone()
            else:
                value = p.detach().cpu().clone()
            frozen[name] = value

    state_dict_keys = list(models.build_model(spec.get("model")).state_dict().keys())
    persistent = set(state_dict_keys)
    buffers = {n: b.detach().cpu().clone() for n, b in module.named_buffers() if n in persistent}

    if rank == 0:
        model_dtype = "bfloat16" if spec["dtype"] == "bf16" else "float32"
        p0 = next(module.parameters())
        held = p0.ds_tensor.dtype if hasattr(p0, "ds_id") else p0.dtype
        assert str(held) == f"torch.{model_dtype}", (held, model_dtype)
        truth = {
            "trainable": trainable,
            "frozen": frozen,
            "buffers": buffers,
            "state_dict_keys": state_dict_keys,
            "tied": tied,
            # Trainable parameters with zero elements: DeepSpeed keeps them out of the optimizer
            # groups and saves them with the frozen ones; they are listed under "frozen" too.
            "empty_trainable": [n for n, p in module.named_parameters() if p.requires_grad and full_numel(p) == 0],
            "param_groups": group_names,
            "optimizer_states": optimizer_states,
            "optimizer_step": inner_optimizer_step(engine, stage),
            "model_dtype": model_dtype,
            "stage": stage,
            "world_size": world,
            "tag": tag,
            "spec": spec,
            "ds_version": deepspeed.__version__,
        }
        tmp = outdir / "ground_truth.pt.tmp"
        torch.save(truth, tmp)
        torch.load(tmp, weights_only=True)  # fail here, not in the tests, if it isn't plain
        os.replace(tmp, outdir / "ground_truth.pt")


def full_optimizer_state(p, key, name):
    value = safe_get_full_optimizer_state(p, key)
    if value is None:
        raise RuntimeError(f"safe_get_full_optimizer_state({name}, {key!r}) returned None")
    return value.detach().float().cpu().clone().reshape(full_shape(p))


def relink_optimizer_state(engine):
    """Point every parameter's optimizer-state fragments at the live state, for all groups.

    DeepSpeed 0.19.8's ZeRO 1-2 optimizer links them once, right after it steps the first param
    group, when later groups have no state yet; their parameters then fail
    safe_get_full_optimizer_state with "exp_avg not found". Linking again after training reads
    the same live state tensors through DeepSpeed's own accessor.
    """
    opt = engine.optimizer
    if hasattr(opt, "_hp_optimizer_states_linked") and hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()


def inner_optimizer_step(engine, stage):
    """The ``step`` the wrapped torch optimizer keeps per flat parameter; all of them agree."""
    if stage == 0:
        return None
    steps = {float(s["step"]) for s in engine.optimizer.optimizer.state.values() if "step" in s}
    if len(steps) != 1:
        raise RuntimeError(f"expected one step value across the optimizer state, found {sorted(steps)}")
    return steps.pop()


def full_numel(p):
    return p.ds_numel if hasattr(p, "ds_id") else p.numel()


def full_shape(p):
    return p.ds_shape if hasattr(p, "ds_id") else p.shape


if __name__ == "__main__":
    from gloo_job import exit_now

    main()
    exit_now()  # torn down and written: no finalization (tests/dsgen/gloo_job.py)
