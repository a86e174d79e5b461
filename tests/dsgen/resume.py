"""Resume rewritten checkpoints in real DeepSpeed and compare with the original run's truth.

Run under torchrun at the new world size:

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node N tests/dsgen/resume.py JOB.json

JOB.json: {"result": path, "cases": [{"name", "spec", "ckpt", "truth", "source_model_states",
"universal": bool, "restore_module": path or null, "live": {"dump": path} or {"truth": path} or null},
...]}. Each case builds the model and engine
of the original run (its layout spec) at this world size, calls ``engine.load_checkpoint(ckpt)``
(with ``load_universal`` for universal cases), and checks against the original run's ground
truth, bit for bit: every fp32 master (``safe_get_full_fp32_param``), every Adam state
(``safe_get_full_optimizer_state``), frozen params and buffers, the optimizer step, the lr
scheduler state and ``global_steps``; then it runs one more training step. ``restore_module``
names a state dict file (frozen params and buffers) loaded into the module after a universal
load, which leaves the module state alone. With ``live`` (round_robin_gradients runs, which
DeepSpeed's accessors misread), masters and optimizer states are read from DeepSpeed's live
partitions instead (:func:`live_view`) and judged against the ``truth`` file, written by the
``dump`` of an earlier job that loaded the original save at its own size; every module weight
must then equal its master cast to the model dtype. Rank 0 writes ``{case: [errors]}`` to
``result``.
"""
import importlib.util
import json
import os
import sys
import traceback
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # noqa: E402


def _load(name):
    path = Path(__file__).resolve().with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"zf_dsgen_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


models = _load("models")
train = _load("train")
sys.path.insert(0, str(Path(__file__).resolve().parent))
muon = _load("train_muon")
from gloo_job import process_group  # noqa: E402


def same_bits(a, b):
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(view), b.view(view))


def run_case(case, errors):
    spec = case["spec"]
    stage = int(spec["stage"])
    cfg = train.ds_config_for(spec)
    cfg.pop("train_batch_size", None)
    if case.get("universal"):
        cfg["checkpoint"] = {"load_universal": True}
    if stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = models.build_model(spec.get("model"))
    else:
        model = models.build_model(spec.get("model"))
    groups = models.param_groups(model, int(spec.get("n_groups", 1)))
    if spec.get("optimizer") == "muon":
        cfg["optimizer"] = muon.config(spec)["optimizer"]
        engine = muon.initialize(spec, model, groups, cfg)
    else:
        optimizer = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.99))
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    path, _ = engine.load_checkpoint(case["ckpt"])
    if path is None:
        errors.append("load_checkpoint found nothing to load")
        return
    if case.get("restore_module"):
        restore_module(engine, case["restore_module"])
    truth = torch.load(case["truth"], weights_only=True)
    source = torch.load(case["source_model_states"], weights_only=False)
    train.relink_optimizer_state(engine)

    checked = 0
    masters = train.stage0_fp32_masters(engine, stage)  # stage 0 has no safe_get_full_fp32_param
    # Muon's stage 1-2 momentum is not laid out like the masters: DeepSpeed's accessor misreads it.
    momentum = muon.momentum_12(engine) if spec.get("optimizer") == "muon" and stage in (1, 2) else {}
    live = live_view(engine) if case.get("live") else None
    reference = truth
    if live is not None:
        if case["live"].get("dump") and dist.get_rank() == 0:
            torch.save(live, case["live"]["dump"])
        reference = torch.load(case["live"]["truth"], weights_only=True) if case["live"].get("truth") else live
    for name, p in engine.module.named_parameters():
        if name in truth["trainable"]:
            full = live["trainable"][name] if live else masters[id(p)] if stage == 0 else safe_get_full_fp32_param(p)
            if full is None or not same_bits(full.float().reshape(reference["trainable"][name].shape),
                                             reference["trainable"][name]):
                errors.append(f"fp32 master {name} differs")
            if live is not None and not same_bits(full.to(p.dtype).reshape(p.shape), p):
                errors.append(f"module weight {name} is not its fp32 master in the model dtype")
            for key, values in reference["optimizer_states"].items():
                if name not in values:  # a key of another param group (Muon's or Adam's)
                    continue
                state = live["optimizer_states"][key][name] if live else \
                    momentum.get(id(p)) if key == "momentum_buffer" and momentum else \
                    safe_get_full_optimizer_state(p, key)
                want = values[name].float()  # a bf16 momentum comes back as fp32 of the same values
                if state is None or not same_bits(state.float().reshape(want.shape), want):
                    errors.append(f"optimizer state {key} of {name} differs")
            checked += 1
        else:
            if hasattr(p, "ds_id"):
                with deepspeed.zero.GatheredParameters([p]):
                    value = p.detach().cpu().clone()
            else:
                value = p.detach().cpu().clone()
            if not same_bits(value, truth["frozen"][name]):
                errors.append(f"frozen param {name} differs")
            checked += 1
    buffers = {n: b for n, b in engine.module.named_buffers()}
    for name, want in truth["buffers"].items():
        if not same_bits(buffers[name], want):
            errors.append(f"buffer {name} differs")
    step = train.inner_optimizer_step(engine, stage)
    if step != truth["optimizer_step"]:
        errors.append(f"optimizer step {step} != {truth['optimizer_step']}")
    if engine.global_steps != source["global_steps"]:
        errors.append(f"global_steps {engine.global_steps} != {source['global_steps']}")
    scheduler = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    if scheduler != source["lr_scheduler"]:
        errors.append(f"lr scheduler {scheduler} != {source['lr_scheduler']}")
    if checked != len(truth["trainable"]) + len(truth["frozen"]):
        errors.append(f"checked {checked} params, truth has {len(truth['trainable']) + len(truth['frozen'])}")

    vocab = models.model_kwargs(spec.get("model"))["vocab"]
    gen = torch.Generator().manual_seed(7 + dist.get_rank())
    ids = torch.randint(0, vocab, (2, 6), generator=gen)
    loss = engine(ids, torch.randint(0, vocab, (2, 6), generator=gen))
    engine.backward(loss)
    engine.step()
    if not torch.isfinite(loss.detach()).all() or engine.global_steps != source["global_steps"] + 1:
        errors.append(f"the training step after resuming failed: loss {loss.item()}, steps {engine.global_steps}")
    engine.destroy()


def live_view(engine):
    """{"trainable": name -> fp32 master, "optimizer_states": key -> name -> state}, cut from
    DeepSpeed's live partitions (gathered) at the offsets its optimizer keeps for each parameter
    of each group (``round_robin_bit16_offsets``). DeepSpeed 0.19.8's safe_get_full_fp32_param
    and safe_get_full_optimizer_state misread round_robin_gradients runs; this does not. Stages 1-2."""
    opt = engine.optimizer
    names = {id(p): n for n, p in engine.module.named_parameters()}
    out = {"trainable": {}, "optimizer_states": {k: {} for k in train.OPTIMIZER_KEYS}}
    for i, params in enumerate(opt.round_robin_bit16_groups):
        flat = opt.single_partition_of_fp32_groups[i]
        for key, part in [(None, flat)] + [(k, opt.optimizer.state[flat][k]) for k in train.OPTIMIZER_KEYS]:
            parts = [torch.zeros_like(part) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, part.contiguous())
            whole = torch.cat(parts)
            for p, offset in zip(params, opt.round_robin_bit16_offsets[i]):
                value = whole[offset:offset + p.numel()].view(p.shape).detach().cpu().clone()
                (out["trainable"] if key is None else out["optimizer_states"][key])[names[id(p)]] = value
    return out


def restore_module(engine, path):
    """What a user does after a universal load (docs/reshard-universal.md): put the frozen params and buffers back."""
    state = torch.load(path, weights_only=True)
    frozen = [p for n, p in engine.module.named_parameters() if n in state]
    with deepspeed.zero.GatheredParameters(frozen, modifier_rank=0):
        engine.module.load_state_dict(state, strict=False)


def main():
    job = json.loads(Path(sys.argv[1]).read_text())
    with process_group(lambda: deepspeed.init_distributed(dist_backend="gloo")):  # barrier, then torn down
        results = {}
        for case in job["cases"]:
            errors = []
            try:
                run_case(case, errors)
            except Exception:
                errors.append(traceback.format_exc()[-3000:])
            results[case["name"]] = errors
            dist.barrier()
        if dist.get_rank() == 0:
            Path(job["result"]).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    from gloo_job import exit_now

    main()
    exit_now()  # torn down and written: no finalization (tests/dsgen/gloo_job.py)
