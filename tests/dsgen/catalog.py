"""Catalog of real DeepSpeed checkpoint layouts, generated on demand and cached.

    from tests.dsgen.catalog import LAYOUTS, ensure_checkpoint
    root = ensure_checkpoint("s3_bf16_w2_frozen_tied")   # folder with latest, tag, ground_truth.pt

Command line (generates what is missing and prints timings):

    python -m tests.dsgen.catalog [name ...]

Cache: $ZEROFAST_TEST_CACHE, else <repo>/.cache/ds-ckpts. Each layout lives in
``<cache>/<name>-<key>`` where key hashes train.py, models.py, the layout spec and the
installed DeepSpeed version, so editing any of them regenerates. Generation goes to a
temporary folder that is renamed into place, under an exclusive file lock, so concurrent
pytest processes neither race nor see half-written checkpoints.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.dsgen.families import (AUTOEP_LAYOUTS, FAMILY_LAYOUTS, MEGATRON_MOE_LAYOUTS, MEGATRON_VARIANTS,
                                  MOE_PIPE_LAYOUTS)
from tests.dsgen.megatron_pipe_layouts import MEGATRON_PIPE_LAYOUTS

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent
TRAIN = HERE / "train.py"
MODELS = HERE / "models.py"
FAMILY_TRAIN = HERE / "train_families.py"
FAMILY_MODELS = HERE / "family_models.py"
AUTOEP_TRAIN = HERE / "train_autoep.py"
MEGATRON_TRAIN = HERE / "train_megatron.py"
MEGATRON_PIPE_TRAIN = HERE / "train_megatron_pipe.py"
MEGATRON_MOE_TRAIN = HERE / "train_megatron_moe.py"
MOE_PIPE_TRAIN = HERE / "train_moe_pipe.py"
MUON_TRAIN = HERE / "train_muon.py"
NVME_TRAIN = HERE / "train_nvme.py"
TIMEOUT_S = float(os.environ.get("ZEROFAST_DSGEN_TIMEOUT", "300"))

# name -> spec. Keys: stage, world_size, dtype, n_groups, steps, model, ds_config (see train.py);
# "optimizer": "muon" trains with DeepSpeed's Muon instead of a client AdamW (see train_muon.py).
# Every model has embed/lm_head tying and int64 + bool + float buffers unless noted.
LAYOUTS: dict[str, dict] = {
    # -- stage 0: no ZeRO. The masters (if any) live in the model states file. --
    "s0_fp32_w1": {
        "stage": 0, "world_size": 1, "dtype": "fp32", "n_groups": 2,
        "model": {"empty_param": True},
    },
    "s0_bf16_w2": {
        "stage": 0, "world_size": 2, "dtype": "bf16", "n_groups": 2,
    },
    # -- stage 1 --
    "s1_bf16_w2_frozen": {
        "stage": 1, "world_size": 2, "dtype": "bf16", "n_groups": 1,
    },
    "s1_bf16_w2_fp32accum": {
        "stage": 1, "world_size": 2, "dtype": "bf16", "n_groups": 2,
        "ds_config": {"data_types": {"grad_accum_dtype": "fp32"}},
    },
    "s1_fp32_w3": {
        "stage": 1, "world_size": 3, "dtype": "fp32", "n_groups": 2,
        "model": {"frozen": False, "empty_param": True},
    },
    # -- stage 2 --
    "s2_bf16_w2_frozen_tied": {
        "stage": 2, "world_size": 2, "dtype": "bf16", "n_groups": 2,
    },
    "s2_fp32_w4_odd_3groups": {
        "stage": 2, "world_size": 4, "dtype": "fp32", "n_groups": 3,
        "model": {"empty_param": True},
    },
    "s2_bf16_w2_offload": {
        "stage": 2, "world_size": 2, "dtype": "bf16", "n_groups": 2,
        "ds_config": {"zero_optimization": {"offload_optimizer": {"device": "cpu"}},
                      "zero_force_ds_cpu_optimizer": False},
    },
    "s2_fp32_w3_elastic": {
        # elastic_checkpoint: base_optimizer_state is a list of per-group states with the last
        # rank's group padding stripped, not the torch optimizer's state_dict().
        "stage": 2, "world_size": 3, "dtype": "fp32", "n_groups": 2,
        "ds_config": {"zero_optimization": {"elastic_checkpoint": True}},
    },
    # -- stage 3 --
    "s3_bf16_w2_frozen_tied": {
        "stage": 3, "world_size": 2, "dtype": "bf16", "n_groups": 2,
    },
    "s3_fp32_w3_3groups_subgroups": {
        # 3 param groups; sub_group_size=300 splits them further, so fp32_flat_groups has 6
        # tensors per rank for 3 entries of param_shapes. No empty_param: stage 3 at W > 1
        # fails gathering a zero-element param (torch.cat of an empty list).
        "stage": 3, "world_size": 3, "dtype": "fp32", "n_groups": 3,
        "ds_config": {"zero_optimization": {"sub_group_size": 300}},
    },
    "s3_bf16_w4_offload": {
        "stage": 3, "world_size": 4, "dtype": "bf16", "n_groups": 2,
        "ds_config": {"zero_optimization": {"offload_optimizer": {"device": "cpu"}},
                      "zero_force_ds_cpu_optimizer": False},
    },
    # -- resharding sources (issue 15): world 4, frozen + tied + 2 groups, an lr scheduler --
    "s1_bf16_w4_resume": {
        "stage": 1, "world_size": 4, "dtype": "bf16", "n_groups": 2,
        "ds_config": {"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                                    "warmup_num_steps": 10}}},
    },
    "s2_bf16_w4_resume": {
        "stage": 2, "world_size": 4, "dtype": "bf16", "n_groups": 2,
        "ds_config": {"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                                    "warmup_num_steps": 10}}},
    },
    "s3_bf16_w4_resume": {
        "stage": 3, "world_size": 4, "dtype": "bf16", "n_groups": 2,
        "ds_config": {"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                                    "warmup_num_steps": 10}}},
    },
    "s3_fp32_w1": {
        "stage": 3, "world_size": 1, "dtype": "fp32", "n_groups": 1,
        "model": {"empty_param": True},
    },
    # -- torch.save's legacy (non-zip) format: "checkpoint_serialization": false (issue 47) --
    "s2_bf16_w2_legacy": {
        "stage": 2, "world_size": 2, "dtype": "bf16", "n_groups": 2,
        "ds_config": {"checkpoint": {"checkpoint_serialization": False}},
    },
    "s3_bf16_w2_legacy": {
        "stage": 3, "world_size": 2, "dtype": "bf16", "n_groups": 1,
        "ds_config": {"checkpoint": {"checkpoint_serialization": False}},
    },
}


# DeepSpeed's Muon (issue 25), trained by train_muon.py: group 0 keeps momentum_buffer (the 2-D
# params), group 1 Adam's moments. Kept out of LAYOUTS, whose tests expect Adam's keys in every
# group; tests/test_muon.py judges these. ZeRO-3 needs reduce_scatter off with Muon.
MUON_LAYOUTS: dict[str, dict] = {
    "s1_bf16_w2_muon": {
        "stage": 1, "world_size": 2, "dtype": "bf16", "n_groups": 1, "optimizer": "muon",
    },
    "s2_bf16_w2_muon": {
        "stage": 2, "world_size": 2, "dtype": "bf16", "n_groups": 1, "optimizer": "muon",
    },
    "s3_bf16_w2_muon": {
        "stage": 3, "world_size": 2, "dtype": "bf16", "n_groups": 1, "optimizer": "muon",
        "ds_config": {"zero_optimization": {"reduce_scatter": False}},
    },
}

# Reshard sources whose flat layout the plain ones do not cover (issue 25): elastic_checkpoint
# (per-group lean states, padding stripped) and round_robin_gradients (each group's parameters
# in an order that depends on the world size). Judged by tests/test_reshard_elastic.py.
RESHARD_LAYOUTS: dict[str, dict] = {
    "s1_bf16_w2_elastic": {
        "stage": 1, "world_size": 2, "dtype": "bf16", "n_groups": 2,
        "ds_config": {"zero_optimization": {"elastic_checkpoint": True}},
    },
    "s1_bf16_w2_round_robin": {
        "stage": 1, "world_size": 2, "dtype": "bf16", "n_groups": 2,
        "ds_config": {"zero_optimization": {"round_robin_gradients": True}},
    },
    "s2_bf16_w2_round_robin": {
        "stage": 2, "world_size": 2, "dtype": "bf16", "n_groups": 2,
        "ds_config": {"zero_optimization": {"round_robin_gradients": True}},
    },
}

# ZeRO-Infinity (issue 25, item 3), trained by train_nvme.py: optimizer and params offloaded to
# NVMe, the fp32 partitions and Adam's moments of the sub-groups of >= 1 MiB per rank in swap files
# that save_checkpoint copies into offloaded_tensors/. One block of dim 256, hidden 4096: fc1 and
# fc2 have 524288 elements per rank, so sub_group_size 500000 makes two swapped sub-groups of
# param group 0 (embed + fc1; fc2 + the small matrices), while the rest (group 1) stays in the
# file; fc1/fc2 are also the only params large enough for the param swapper (1 MiB of bf16 per
# rank), 1.7 times its buffer_size. Prefetch off: DeepSpeed 0.19.8 asserts on prefetching NVMe
# params ("param 5 already assigned swap buffer id 2"). Needs DeepSpeed's async_io op
# (tests/conftest.py: needs_nvme). About 13 MB of swap files.
NVME_LAYOUTS: dict[str, dict] = {
    "s3_bf16_w2_nvme": {
        "stage": 3, "world_size": 2, "dtype": "bf16", "n_groups": 2, "offload": "nvme",
        "model": {"dim": 256, "hidden": 4096, "n_blocks": 1},
        "ds_config": {"zero_optimization": {
            "sub_group_size": 500000, "stage3_prefetch_bucket_size": 0,
            "offload_optimizer": {"device": "nvme", "nvme_path": "@SWAP@", "pin_memory": False, "buffer_count": 4},
            "offload_param": {"device": "nvme", "nvme_path": "@SWAP@", "pin_memory": False, "buffer_count": 4,
                              "buffer_size": 600000, "max_in_cpu": 0}},
            "zero_force_ds_cpu_optimizer": False},
    },
    # dim 1024: the frozen lora.base.weight (1M elements) is large enough for the param swapper, so
    # it is on NVMe at save time, and DeepSpeed 0.19.8 saves a 1-element placeholder as its
    # fragment: the save does not hold it. One swapped sub-group (the default sub_group_size).
    "s3_bf16_w2_nvme_frozen_swapped": {
        "stage": 3, "world_size": 2, "dtype": "bf16", "n_groups": 2, "offload": "nvme",
        "model": {"dim": 1024, "hidden": 256, "n_blocks": 1},
        "ds_config": {"zero_optimization": {
            "stage3_prefetch_bucket_size": 0,
            "offload_optimizer": {"device": "nvme", "nvme_path": "@SWAP@", "pin_memory": False, "buffer_count": 4},
            "offload_param": {"device": "nvme", "nvme_path": "@SWAP@", "pin_memory": False, "buffer_count": 4,
                              "buffer_size": 600000, "max_in_cpu": 0}},
            "zero_force_ds_cpu_optimizer": False},
    },
}

ALL_LAYOUTS: dict[str, dict] = {**LAYOUTS, **FAMILY_LAYOUTS, **MUON_LAYOUTS, **RESHARD_LAYOUTS, **NVME_LAYOUTS,
                                 **MEGATRON_VARIANTS, **MEGATRON_PIPE_LAYOUTS, **AUTOEP_LAYOUTS, **MEGATRON_MOE_LAYOUTS,
                                 **MOE_PIPE_LAYOUTS}


def _scripts(spec: dict) -> list[Path]:
    """The generator and model files a layout's checkpoint depends on (the script first)."""
    if spec.get("family") == "megatron":  # its own model; merge_truth from train_families.py
        return [MEGATRON_TRAIN, FAMILY_TRAIN, TRAIN]
    if spec.get("family") == "megatron_pipe":  # Megatron's TP layers (train_megatron.py) in a PipelineModule
        return [MEGATRON_PIPE_TRAIN, MEGATRON_TRAIN, TRAIN]
    if spec.get("family") == "megatron_moe":  # train_megatron.py's GPT with a native MoE layer
        return [MEGATRON_MOE_TRAIN, MEGATRON_TRAIN, FAMILY_TRAIN, TRAIN]
    if spec.get("family") == "moe_pipe":  # family_models' pieces in a PipelineModule; merging from train_families.py
        return [MOE_PIPE_TRAIN, FAMILY_TRAIN, FAMILY_MODELS, TRAIN]
    if spec.get("family") == "autoep":  # a transformers Qwen3-MoE; merge_truth from train_families.py
        return [AUTOEP_TRAIN, FAMILY_TRAIN, TRAIN]
    if "family" in spec:
        return [FAMILY_TRAIN, FAMILY_MODELS, TRAIN, MODELS]
    if spec.get("optimizer") == "muon":
        return [MUON_TRAIN, TRAIN, MODELS]
    if spec.get("offload") == "nvme":
        return [NVME_TRAIN, TRAIN, MODELS]
    return [TRAIN, MODELS]


def cache_dir() -> Path:
    env = os.environ.get("ZEROFAST_TEST_CACHE")
    return Path(env) if env else REPO_ROOT / ".cache" / "ds-ckpts"


def _ds_version() -> str:
    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def layout_key(name: str) -> str:
    h = hashlib.sha256()
    spec = ALL_LAYOUTS[name]
    for path in _scripts(spec):
        h.update(path.read_bytes())
        h.update(b"\0")
    h.update(json.dumps(spec, sort_keys=True).encode())
    h.update(b"\0")
    h.update(_ds_version().encode())
    return h.hexdigest()[:12]


def checkpoint_path(name: str) -> Path:
    return cache_dir() / f"{name}-{layout_key(name)}"


def _complete(path: Path) -> bool:
    return (path / "ground_truth.pt").is_file() and (path / "latest").is_file()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_LAUNCH_FAILED = re.compile(r"Rendezvous(Connection|Timeout)Error|DistNetworkError")


def not_ours(output: str) -> bool:
    """Whether a failed torchrun job failed before any rank ran its code, for the machine's sake:
    the port it picked was taken meanwhile, or the launcher's rendezvous failed. torchrun prints
    its "Root Cause" summary only where a rank ran and failed; that failure, a Python error or a
    signal, is the job's own and is not retried. The one reason to run again the jobs that end
    through ``gloo_job.exit_now`` (the generators here, the resume jobs) and zerofast's own
    (tests/test_nodes.py). They used to be retried on any signal too, for gloo's "terminate called
    without an active exception" at exit; ending without the interpreter's finalization removed
    its cause (tests/dsgen/gloo_job.py), so a signal is now a failure to see, not to hide."""
    if "address already in use" in output.lower():
        return True
    return "Root Cause" not in output and _LAUNCH_FAILED.search(output) is not None


_EXITCODE = re.compile(r"exitcode\s*:\s*(-?\d+)")


def worth_retrying(output: str) -> bool:
    """:func:`not_ours`, or the first rank to fail was killed by a signal: only for the torchrun
    jobs of torch's own code that do not yet end through ``gloo_job.exit_now`` (tests/dsgen/mcore.py,
    tests/dsgen/dcp_chunks.py), which can still meet gloo's abort at exit (see
    tests/dsgen/gloo_job.py). A job that ends through it uses :func:`not_ours` alone."""
    if not_ours(output):
        return True
    root = output.rfind("Root Cause")  # torchrun's summary ends with the first rank that failed
    first = _EXITCODE.search(output, root) if root >= 0 else None
    return first is not None and int(first.group(1)) < 0


def _run_train(spec: dict, outdir: Path) -> None:
    env = dict(os.environ)
    env["DS_ACCELERATOR"] = "cpu"
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    last = None
    for _attempt in range(3):  # again only where not_ours: the port taken, the rendezvous failed
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(spec["world_size"]),
               "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
               str(_scripts(spec)[0]), json.dumps(spec), str(outdir)]
        try:
            proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            tail = (e.stderr or b"")
            tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
            raise RuntimeError(f"DeepSpeed checkpoint generation timed out after {TIMEOUT_S}s\n"
                               f"cmd: {' '.join(cmd)}\n--- stderr tail ---\n{tail[-6000:]}") from None
        if proc.returncode == 0:
            return
        last = proc
        if not not_ours(proc.stderr + proc.stdout):
            break
        shutil.rmtree(outdir, ignore_errors=True)
    out = (last.stdout or "") + (last.stderr or "")
    # The ranks' own tracebacks ("[rankN]: ...") say more than torchrun's summary after them.
    rank_lines = [ln for ln in out.splitlines() if ln.startswith("[rank")]
    raise RuntimeError(f"DeepSpeed checkpoint generation failed (rc={last.returncode})\n"
                       f"cmd: {' '.join(last.args)}\n--- rank errors ---\n" + "\n".join(rank_lines[-80:])
                       + f"\n--- output tail ---\n{out[-4000:]}")


def ensure_checkpoint(name: str) -> Path:
    """Return the checkpoint root for layout ``name``, generating it if it is not cached."""
    if name not in ALL_LAYOUTS:
        raise KeyError(f"unknown layout {name!r}; known: {sorted(ALL_LAYOUTS)}")
    return build_cached(checkpoint_path(name), _complete, lambda tmp: _run_train(ALL_LAYOUTS[name], tmp),
                        f"generation of {name}")


def build_cached(final: Path, complete, build, what: str) -> Path:
    """``final`` (a cache folder named ``<stem>-<key>``), made by ``build(tmp)`` unless
    ``complete(final)`` already holds. Every generator of the cache shares one exclusive lock,
    which also keeps the CPUs free; the result is renamed into place only once complete, and
    the folders of the same stem that older code made (other keys) are dropped."""
    if complete(final):
        return final
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".generate.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if complete(final):
            return final
        # Generation only happens under this lock, so any temp folder present now was left
        # behind by a killed generator.
        for stale in root.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = root / f".tmp-{final.name}-{os.getpid()}"
        try:
            build(tmp)
            if not complete(tmp):
                raise RuntimeError(f"{what} finished without a complete result in {tmp}")
            if final.exists():  # an incomplete leftover
                shutil.rmtree(final)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        stem = final.name.rsplit("-", 1)[0]
        for old in root.glob(f"{stem}-*"):
            if old != final and old.is_dir() and old.name[len(stem) + 1:].isalnum():
                shutil.rmtree(old, ignore_errors=True)
    return final


def ensure_all(names=None) -> dict[str, Path]:
    return {n: ensure_checkpoint(n) for n in (names or LAYOUTS)}


def main(argv=None) -> int:
    # NVMe layouts only by name: they need DeepSpeed's async_io op (tests/conftest.py: needs_nvme).
    names = list(argv if argv is not None else sys.argv[1:]) or [n for n in ALL_LAYOUTS if n not in NVME_LAYOUTS]
    total = 0.0
    for n in names:
        cached = _complete(checkpoint_path(n)) if n in ALL_LAYOUTS else False
        t0 = time.monotonic()
        path = ensure_checkpoint(n)
        dt = time.monotonic() - t0
        total += dt
        print(f"{n:32s} {'cached' if cached else f'{dt:6.1f}s'}  {path}", flush=True)
    print(f"{'total':32s} {total:6.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
