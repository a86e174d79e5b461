"""Resume universal checkpoints of AutoTP saves in real DeepSpeed (issue 47).

Run under torchrun at world 2 (AutoTP tp 2 x dp 1):

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node 2 \
        tests/dsgen/resume_autotp.py JOB.json

JOB.json: {"result": path, "cases": [{"name", "spec", "load_dir", "tag"}, ...]}. ``spec`` is the
source save's layout spec (tests/dsgen/families.py: family "autotp", stage, dtype, tp); its world
size is replaced by this job's. Each case builds train_families.py's tiny Llama (every parameter
trainable), initializes the engine with the generator's DeepSpeed config (same ZeRO stage, dtype and
``autotp_size``) plus ``"checkpoint": {"load_universal": true}``, and calls
``engine.load_checkpoint(load_dir, tag=tag)``. Then, as the generator takes its truth, every
parameter's fp32 master (``safe_get_full_fp32_param``) and Adam moments
(``safe_get_full_optimizer_state``), put together over the tp group by the layer's own
``gather_params`` (train_families.tp_gathered), the module's own (bf16) weights the same way, the
optimizer step, and one more training step.

Rank 0 writes ``result`` (``torch.save``, plain data): ``{case name: {"errors": [str], "trainable":
name -> fp32, "optimizer_states": key -> name -> fp32, "module": name -> tensor in the model dtype,
"optimizer_step": float | None, "loaded": str | None, "loss_after": float | None}}``. A case that raised
has its traceback in ``errors``.
"""
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import family_models as fm  # noqa: E402
import train as base  # noqa: E402
from resume_megatron import run_job  # noqa: E402
from train_families import tp_gathered  # noqa: E402


def run_case(case: dict, out: dict) -> None:
    from deepspeed.module_inject.layers import TensorParallel_Layer

    spec = {**case["spec"], "world_size": dist.get_world_size()}
    stage = int(spec["stage"])
    cfg = base.deep_merge(base.ds_config_for(spec), {"tensor_parallel": {"autotp_size": int(spec["tp"])},
                                                     "checkpoint": {"load_universal": True}})
    cfg.pop("train_batch_size", None)
    model = fm.build_llama()  # the initial values: a load that does nothing leaves these
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    path, _client = engine.load_checkpoint(case["load_dir"], tag=case["tag"])
    out["loaded"] = None if path is None else str(path)
    if path is None:
        out["errors"].append("load_checkpoint found nothing to load")
        engine.destroy()
        return

    base.relink_optimizer_state(engine)
    module = engine.module
    owner = {id(p): m for m in module.modules() if isinstance(m, TensorParallel_Layer)
             for p in m.parameters(recurse=False)}
    trainable, opt, weights = {}, {k: {} for k in base.OPTIMIZER_KEYS}, {}
    for name, p in module.named_parameters():  # the same order on every rank: collectives
        values = [safe_get_full_fp32_param(p)] + [base.full_optimizer_state(p, k, name) for k in opt]
        values = [v.detach().float().clone().reshape(base.full_shape(p)) for v in values]
        if id(p) in owner:
            values = [tp_gathered(owner[id(p)], p, v) for v in values]
        trainable[name] = values[0]
        for k, v in zip(opt, values[1:]):
            opt[k][name] = v
        weights[name] = tp_gathered(owner[id(p)], p, p.detach().clone()) if id(p) in owner else p.detach().clone()
    out.update(trainable=trainable, optimizer_states=opt, module=weights,
               optimizer_step=base.inner_optimizer_step(engine, stage))

    gen = torch.Generator().manual_seed(77)  # the same on both tp ranks (dp 1)
    ids = torch.randint(0, fm.VOCAB, (2, 6), generator=gen)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    out["loss_after"] = float(loss.detach().float())
    if not torch.isfinite(loss.detach()).all():
        out["errors"].append(f"the training step after resuming gave loss {out['loss_after']}")
    engine.destroy()


def main():
    run_job(run_case)


if __name__ == "__main__":
    from gloo_job import exit_now

    main()
    exit_now()  # torn down and written: no finalization (tests/dsgen/gloo_job.py)
