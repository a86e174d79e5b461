"""Real Hugging Face Trainer (+ PEFT) runs on DeepSpeed, made on demand and cached like catalog.py.

    from tests.dsgen.hf_catalog import HF_RUNS, ensure_run
    out = ensure_run("peft_z3_bf16_tied")   # the Trainer's output_dir: base/, checkpoint-2/, ground_truth.pt

Command line: ``python -m tests.dsgen.hf_catalog [name ...]``. Same cache folder, key scheme and
lock as catalog.py (the key hashes hf_train.py, the spec and the installed DeepSpeed,
transformers and peft versions).
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tests.dsgen.catalog import REPO_ROOT, TIMEOUT_S, _free_port, build_cached, cache_dir, not_ours

TRAIN = Path(__file__).resolve().with_name("hf_train.py")

# Every run: a tiny Llama (hidden 32, 2 layers, vocab 48), 2 ranks, 2 optimizer steps.
HF_RUNS: dict[str, dict] = {
    "full_z2_bf16_tied": {"stage": 2, "dtype": "bf16", "peft": False, "tied": True},
    "full_z3_fp32_tied": {"stage": 3, "dtype": "fp32", "peft": False, "tied": True},
    "full_z3_bf16_tied": {"stage": 3, "dtype": "bf16", "peft": False, "tied": True},
    "full_z2_fp32_untied": {"stage": 2, "dtype": "fp32", "peft": False, "tied": False},
    "peft_z2_bf16_tied": {"stage": 2, "dtype": "bf16", "peft": True, "tied": True},
    "peft_z3_bf16_tied": {"stage": 3, "dtype": "bf16", "peft": True, "tied": True},
    "peft_z3_fp32_untied": {"stage": 3, "dtype": "fp32", "peft": True, "tied": False},
}
for _spec in HF_RUNS.values():
    _spec.update(world_size=2, steps=2)


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def run_key(name: str) -> str:
    h = hashlib.sha256(TRAIN.read_bytes())
    h.update(json.dumps(HF_RUNS[name], sort_keys=True).encode())
    for dist in ("deepspeed", "transformers", "peft", "accelerate"):
        h.update(f"\0{dist}={_version(dist)}".encode())
    return h.hexdigest()[:12]


def run_path(name: str) -> Path:
    return cache_dir() / f"hf-{name}-{run_key(name)}"


def _complete(path: Path) -> bool:
    return (path / "ground_truth.pt").is_file()


def _train(spec: dict, outdir: Path) -> None:
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    for _attempt in range(3):  # again only where not_ours: the port taken, the rendezvous failed
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(spec["world_size"]),
               "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), str(TRAIN), json.dumps(spec),
               str(outdir)]
        try:
            proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"Trainer run timed out after {TIMEOUT_S}s: {' '.join(cmd)}") from None
        out = proc.stdout + proc.stderr
        if proc.returncode == 0 or not not_ours(out):
            break
        shutil.rmtree(outdir, ignore_errors=True)
    if proc.returncode != 0:
        rank_lines = [ln for ln in out.splitlines() if ln.startswith("[rank")]
        raise RuntimeError(f"Trainer run failed (rc={proc.returncode}): {' '.join(cmd)}\n"
                           + "\n".join(rank_lines[-60:]) + f"\n--- output tail ---\n{out[-4000:]}")


def ensure_run(name: str) -> Path:
    """The output_dir of run ``name``, trained now if it is not cached."""
    if name not in HF_RUNS:
        raise KeyError(f"unknown run {name!r}; known: {sorted(HF_RUNS)}")
    return build_cached(run_path(name), _complete, lambda tmp: _train(HF_RUNS[name], tmp), f"run {name}")


def main(argv=None) -> int:
    names = list(argv if argv is not None else sys.argv[1:]) or list(HF_RUNS)
    for n in names:
        cached = _complete(run_path(n))
        t0 = time.monotonic()
        path = ensure_run(n)
        print(f"{n:24s} {'cached' if cached else f'{time.monotonic() - t0:6.1f}s'}  {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())


@functools.lru_cache(maxsize=None)
def hf_run(name: str) -> tuple[Path, dict]:
    """Run ``name``'s folder (made on first use) and its ground truth."""
    import torch

    out = ensure_run(name)
    return out, torch.load(out / "ground_truth.pt", weights_only=True)


def hf_checkpoint(name: str) -> Path:
    """The Trainer checkpoint folder (``checkpoint-N``) of run ``name``."""
    out, truth = hf_run(name)
    return out / truth["checkpoint"]
