"""Resume universal checkpoints of Megatron-DeepSpeed-style TP x DP saves in real DeepSpeed (issue 47).

Run under torchrun at world 2 (TP 2 x DP 1):

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node 2 \
        tests/dsgen/resume_megatron.py JOB.json

JOB.json: {"result": path, "cases": [{"name", "spec", "load_dir", "tag"}, ...]}. ``spec`` is the
source save's layout spec (tests/dsgen/families.py: family "megatron", stage, dtype, tp); its
world size is replaced by this job's. Each case builds train_megatron.py's model and mpu at this
world size (tp from the spec, dp = world / tp), initializes the engine with the generator's
DeepSpeed config (same ZeRO stage and dtype) plus ``"checkpoint": {"load_universal": true}``, and
calls ``engine.load_checkpoint(load_dir, tag=tag)``. Then, as the generator takes its truth, every
parameter's fp32 master (``safe_get_full_fp32_param``) and Adam moments
(``safe_get_full_optimizer_state``) over the dp group, put together over the tp group by the
model's own partitioning (train_megatron.gather_full: replicated copies checked equal, the
vocabulary trimmed to its original rows), and the module's own (bf16) weights the same way.
Then one more training step, to see that the resumed engine trains.

Rank 0 writes ``result`` (``torch.save``, plain data, ``weights_only=True``):
``{case name: {"errors": [str], "trainable": name -> fp32, "optimizer_states": key -> name -> fp32,
"module": name -> tensor in the model dtype, "optimizer_step": float | None, "loaded": str | None,
"loss_after": float | None}}``. A case that raised has its traceback in ``errors`` (the other cases
still run).
"""
import json
import os
import sys
import traceback
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train as base  # noqa: E402
import train_megatron as tm  # noqa: E402
from gloo_job import process_group  # noqa: E402


def run_case(case: dict, out: dict) -> None:
    spec = {**case["spec"], "world_size": dist.get_world_size()}
    stage = int(spec["stage"])
    tp = int(spec["tp"])
    mpu = tm.MegatronMPU(tp)
    cfg = base.ds_config_for(spec)
    cfg.pop("train_batch_size", None)
    cfg["checkpoint"] = {"load_universal": True}
    model = tm.build_model(mpu)  # the initial values: a load that does nothing leaves these
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg, mpu=mpu)
    assert engine.checkpoint_mp_rank == mpu.tp_rank, (engine.checkpoint_mp_rank, mpu.tp_rank)

    path, _client = engine.load_checkpoint(case["load_dir"], tag=case["tag"])
    out["loaded"] = None if path is None else str(path)
    if path is None:
        out["errors"].append("load_checkpoint found nothing to load")
        engine.destroy()
        return

    base.relink_optimizer_state(engine)
    params = tm.full_params()
    trainable, opt, module = {}, {k: {} for k in base.OPTIMIZER_KEYS}, {}
    for name, p in engine.module.named_parameters():  # the same order on every rank: collectives
        kind = params[name][1]
        master = safe_get_full_fp32_param(p)
        if master is None:
            raise RuntimeError(f"safe_get_full_fp32_param({name}) returned None")
        values = [master] + [base.full_optimizer_state(p, k, name) for k in base.OPTIMIZER_KEYS]
        values = [v.detach().float().cpu().clone().reshape(base.full_shape(p)) for v in values]
        fulls = [tm.gather_full(v, kind, mpu, f"{name} ({what})")[0]
                 for v, what in zip(values, ("fp32",) + base.OPTIMIZER_KEYS)]
        trainable[name] = fulls[0]
        for k, v in zip(base.OPTIMIZER_KEYS, fulls[1:]):
            opt[k][name] = v
        module[name] = tm.gather_full(p.detach().cpu().clone(), kind, mpu, f"{name} (module)")[0]
    out.update(trainable=trainable, optimizer_states=opt, module=module,
               optimizer_step=base.inner_optimizer_step(engine, stage))

    gen = torch.Generator().manual_seed(77 + mpu.dp_rank)  # the same within a tp group
    ids = torch.randint(0, tm.VOCAB, (2, tm.SEQ), generator=gen)
    targets = torch.randint(0, tm.VOCAB, (2, tm.SEQ), generator=gen)
    loss = engine(ids, targets)
    engine.backward(loss)
    engine.step()
    out["loss_after"] = float(loss.detach().float())
    if not torch.isfinite(loss.detach()).all():
        out["errors"].append(f"the training step after resuming gave loss {out['loss_after']}")
    engine.destroy()


def main():
    run_job(run_case)


def run_job(run_case) -> None:
    """Every case of the job file ``argv[1]`` through ``run_case(case, out)``, one process group
    for all; rank 0 writes the results (each case's ``out``, its errors caught) where the job says."""
    job = json.loads(Path(sys.argv[1]).read_text())
    with process_group(lambda: deepspeed.init_distributed(dist_backend="gloo")):  # barrier, then torn down
        results = {}
        for case in job["cases"]:
            out = {"errors": [], "trainable": {}, "optimizer_states": {}, "module": {}, "optimizer_step": None,
                   "loaded": None, "loss_after": None}
            try:
                run_case(case, out)
            except Exception:
                out["errors"].append(traceback.format_exc()[-4000:])
            results[case["name"]] = out
            dist.barrier()
        if dist.get_rank() == 0:
            tmp = Path(job["result"] + ".tmp")
            torch.save(results, tmp)
            torch.load(tmp, weights_only=True)
            os.replace(tmp, job["result"])


if __name__ == "__main__":
    from gloo_job import exit_now

    main()
    exit_now()  # torn down and written: no finalization (tests/dsgen/gloo_job.py)
