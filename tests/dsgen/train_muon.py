"""Train the suite's tiny model with DeepSpeed's own Muon on the CPU; save it and ground truth.

Run under torchrun like train.py (same spec keys, same ground truth file):

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node W \
        tests/dsgen/train_muon.py '<spec as JSON>' OUTDIR

The config names the optimizer (``"optimizer": {"type": "Muon"}``), so DeepSpeed builds
``MuonWithAuxAdam`` itself: it splits each param group into a Muon half (the 2-D parameters,
per-element state ``momentum_buffer``) and an Adam half (``exp_avg``, ``exp_avg_sq``, ``step``).
The ground truth's ``optimizer_states`` therefore lists each key for the parameters of the half
that keeps it, ``muon_params`` names the Muon half, and ``state_dtypes`` gives the dtype the live
optimizer holds each key in.

Where the truth comes from, per key:
- stage 3 and Adam's keys at stages 1-2: DeepSpeed's ``safe_get_full_optimizer_state``;
- ``momentum_buffer`` at stages 1-2: DeepSpeed keeps it in the gradient dtype over the *whole*
  parameters that touch a rank's partition (``params_in_partition``), not over the fp32
  partition, and its accessor reads it as if it were laid out like the masters. The truth is cut
  from the live buffer in that order on each rank and gathered; ranks sharing a parameter hold
  the same values (checked here).
"""
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

# Muon's Newton-Schulz step is torch.compile'd; compiling its CPU kernels takes minutes on a
# loaded machine. Eager runs the same operations, in the training run and in the resume alike.
torch._dynamo.config.disable = True

import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train as base  # noqa: E402
from gloo_job import process_group  # noqa: E402

MUON_KEYS = ("momentum_buffer",)
ADAM_KEYS = base.OPTIMIZER_KEYS
# torch_adam: the Adam half runs torch's AdamW, so no DeepSpeed op is compiled (FusedAdam's CPU
# build takes minutes); its state keys are the same.
MUON_PARAMS = {"lr": 1e-2, "momentum": 0.9, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.0,
               "torch_adam": True}


def config(spec: dict) -> dict:
    cfg = base.ds_config_for(spec)
    cfg["optimizer"] = {"type": "Muon", "params": dict(MUON_PARAMS)}
    return cfg


def initialize(spec: dict, model, groups, cfg):
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
    return engine


def build(spec: dict, cfg: dict):
    if int(spec["stage"]) == 3:
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            return base.models.build_model(spec.get("model"))
    return base.models.build_model(spec.get("model"))


def main():
    spec = base.read_spec(sys.argv[1])
    outdir = Path(sys.argv[2])
    stage, steps = int(spec["stage"]), int(spec.get("steps", 3))
    tag = spec.get("tag", f"global_step{steps}")
    with process_group(lambda: deepspeed.init_distributed(dist_backend="gloo")):  # barrier, then torn down
        train_and_save(spec, outdir, stage, steps, tag)


def train_and_save(spec, outdir, stage, steps, tag):
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == spec["world_size"], (world, spec["world_size"])
    cfg = config(spec)
    model = build(spec, cfg)
    groups = base.models.param_groups(model, int(spec.get("n_groups", 1)))
    engine = initialize(spec, model, groups, cfg)
    vocab = base.models.model_kwargs(spec.get("model"))["vocab"]
    gen = torch.Generator().manual_seed(1000 + rank)
    for _ in range(steps):
        ids = torch.randint(0, vocab, (2, 6), generator=gen)
        loss = engine(ids, torch.randint(0, vocab, (2, 6), generator=gen))
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(str(outdir), tag=tag)
    truth = ground_truth(spec, engine, stage)
    if rank == 0:
        truth.update(tag=tag, world_size=world)
        tmp = outdir / "ground_truth.pt.tmp"
        torch.save(truth, tmp)
        torch.load(tmp, weights_only=True)
        os.replace(tmp, outdir / "ground_truth.pt")


def ground_truth(spec: dict, engine, stage: int) -> dict:
    module = engine.module
    first_name, tied = {}, {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first_name:
            tied[name] = first_name[id(p)]
        else:
            first_name[id(p)] = name
    base.relink_optimizer_state(engine)
    momentum = momentum_12(engine) if stage in (1, 2) else {}
    trainable, frozen, muon = {}, {}, []
    states = {key: {} for key in MUON_KEYS + ADAM_KEYS}
    for name, p in module.named_parameters():
        if not (p.requires_grad and base.full_numel(p) > 0):
            if hasattr(p, "ds_id"):
                with deepspeed.zero.GatheredParameters([p]):
                    frozen[name] = p.detach().cpu().clone()
            else:
                frozen[name] = p.detach().cpu().clone()
            continue
        trainable[name] = safe_get_full_fp32_param(p).detach().float().cpu().clone().reshape(base.full_shape(p))
        if getattr(p, "use_muon", False):
            muon.append(name)
            # Kept in DeepSpeed's dtype: the gradient's at stages 1-2, fp32 at stage 3.
            states["momentum_buffer"][name] = (momentum[id(p)].reshape(base.full_shape(p)) if momentum
                                               else base.full_optimizer_state(p, "momentum_buffer", name))
        else:
            for key in ADAM_KEYS:  # collective: same order on every rank
                states[key][name] = base.full_optimizer_state(p, key, name)
    keys = list(base.models.build_model(spec.get("model")).state_dict().keys())
    return {
        "trainable": trainable, "frozen": frozen, "tied": tied, "state_dict_keys": keys,
        "buffers": {n: b.detach().cpu().clone() for n, b in module.named_buffers() if n in set(keys)},
        "empty_trainable": [], "param_groups": [], "optimizer_states": states, "muon_params": muon,
        "state_dtypes": state_dtypes(engine),
        "optimizer_step": adam_step(engine), "stage": stage, "spec": spec, "ds_version": deepspeed.__version__,
        "model_dtype": "bfloat16" if spec["dtype"] == "bf16" else "float32",
    }


def momentum_12(engine) -> dict:
    """id(param) -> its full momentum at stages 1-2, from every rank's live buffer."""
    opt = engine.optimizer
    mine = {}
    for g, params in enumerate(opt.params_in_partition):
        flat = opt.optimizer.param_groups[g]["params"][0]
        buffer = opt.optimizer.state[flat].get("momentum_buffer")
        if buffer is None:
            continue
        assert buffer.numel() == sum(p.numel() for p in params), (buffer.numel(), [p.numel() for p in params])
        offset = 0
        for p in params:
            mine[opt.get_param_id(p)] = buffer[offset:offset + p.numel()].detach().cpu().clone()
            offset += p.numel()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    by_id = {opt.get_param_id(p): p for group in opt.bit16_groups for p in group}
    out = {}
    for held in gathered:
        for pid, value in held.items():
            p = by_id[pid]
            if id(p) in out:
                assert torch.equal(out[id(p)], value), f"ranks disagree on the momentum of param {pid}"
            else:
                out[id(p)] = value
    return out


def state_dtypes(engine) -> dict:
    """key -> the dtype the live optimizer holds it in (Muon's momentum: bf16 in a bf16 run)."""
    out = {}
    for state in engine.optimizer.optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                out.setdefault(key, str(value.dtype).replace("torch.", ""))
    return out


def adam_step(engine):
    """The Adam half's ``step``; the Muon half keeps none."""
    steps = {float(s["step"]) for s in engine.optimizer.optimizer.state.values() if "step" in s}
    if len(steps) != 1:
        raise RuntimeError(f"expected one step value across the optimizer state, found {sorted(steps)}")
    return steps.pop()


if __name__ == "__main__":
    from gloo_job import exit_now

    main()
    exit_now()  # torn down and written: no finalization (tests/dsgen/gloo_job.py)
