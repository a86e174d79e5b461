"""One DeepSpeed run that saves twice, one step apart: the same run's ``global_step2`` and
``global_step3`` side by side (``latest`` names the second), cached like the catalog.

    from tests.dsgen.two_saves import ensure_two_saves
    root = ensure_two_saves()      # root/global_step2, root/global_step3, root/truth.pt
    root = ensure_two_saves(3)     # the same at ZeRO-3

``truth.pt`` (rank 0, from the live module, not from the files) lists the ``trainable`` and
``frozen`` parameter names. Used by the verify tests: a rank file of step 3 swapped for the
same rank's file of step 2, and ``diff`` of the two saves. Run directly under torchrun:

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node 2 tests/dsgen/two_saves.py STAGE OUTDIR
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
SPECS = {stage: {"stage": stage, "world_size": 2, "dtype": "bf16", "n_groups": 2} for stage in (2, 3)}
STEPS = (2, 3)


def _load(name):
    spec = importlib.util.spec_from_file_location(f"zf_two_saves_{name}", HERE.with_name(f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def two_saves_path(stage: int = 2) -> Path:
    from tests.dsgen.catalog import _ds_version, cache_dir

    h = hashlib.sha256()
    for part in (HERE.read_bytes(), HERE.with_name("models.py").read_bytes(), HERE.with_name("train.py").read_bytes(),
                 json.dumps(SPECS[stage], sort_keys=True).encode(), _ds_version().encode()):
        h.update(part)
        h.update(b"\0")
    return cache_dir() / f"two_saves_s{stage}-{h.hexdigest()[:12]}"


def ensure_two_saves(stage: int = 2) -> Path:
    from tests.dsgen.catalog import REPO_ROOT, TIMEOUT_S, _free_port, build_cached, not_ours

    def build(tmp: Path) -> None:
        env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
        for _attempt in range(3):  # again only where not_ours: the port taken, the rendezvous failed
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                   str(SPECS[stage]["world_size"]), "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
                   str(HERE), str(stage), str(tmp)]
            proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
            if proc.returncode == 0 or not not_ours(proc.stderr + proc.stdout):
                break
            for child in tmp.iterdir():
                shutil.rmtree(child) if child.is_dir() else child.unlink()
        if proc.returncode != 0:
            raise RuntimeError(f"two_saves failed (rc={proc.returncode})\n{(proc.stdout + proc.stderr)[-4000:]}")

    return build_cached(two_saves_path(stage), lambda p: (p / "truth.pt").is_file(), build,
                        f"the two-save run at ZeRO-{stage}")


def main(stage: int, outdir: Path) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    import deepspeed
    import deepspeed.comm as dist

    from gloo_job import process_group  # this folder is first on sys.path: the script runs as a file

    models, train = _load("models"), _load("train")
    with process_group(lambda: deepspeed.init_distributed(dist_backend="gloo")):  # barrier, then torn down
        spec = SPECS[stage]
        rank = dist.get_rank()
        config = train.ds_config_for(spec)
        if stage == 3:
            with deepspeed.zero.Init(config_dict_or_path=config):
                model = models.build_model(spec.get("model"))
        else:
            model = models.build_model(spec.get("model"))
        groups = models.param_groups(model, spec["n_groups"])
        optimizer = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.99))
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        vocab = models.model_kwargs(spec.get("model"))["vocab"]
        gen = torch.Generator().manual_seed(1000 + rank)
        for step in range(1, max(STEPS) + 1):
            ids = torch.randint(0, vocab, (2, 6), generator=gen)
            targets = torch.randint(0, vocab, (2, 6), generator=gen)
            engine.backward(engine(ids, targets))
            engine.step()
            if step in STEPS:
                engine.save_checkpoint(str(outdir), tag=f"global_step{step}")
        if rank == 0:
            params = list(engine.module.named_parameters())
            torch.save({"trainable": [n for n, p in params if p.requires_grad],
                        "frozen": [n for n, p in params if not p.requires_grad]}, outdir / "truth.pt")


if __name__ == "__main__":
    from gloo_job import exit_now

    main(int(sys.argv[1]), Path(sys.argv[2]))
    exit_now()  # torn down and written: no finalization (tests/dsgen/gloo_job.py)
