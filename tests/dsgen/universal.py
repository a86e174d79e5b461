"""Universal checkpoints made by DeepSpeed's own converter from catalog checkpoints, cached.

    from tests.dsgen.universal import ensure_universal
    root = ensure_universal("s2_bf16_w2_frozen_tied")   # holds latest_universal and <tag>_universal/

The folder is what ``python -m deepspeed.checkpoint.ds_to_universal`` writes when given the
catalog checkpoint's tag folder as input and ``<root>/<tag>_universal`` as output (ZeRO-1/2
sources need ``--inject_missing_state``). Its truth is the source's ``ground_truth.pt``
(``tests.helpers.real_truth(name)``). Cached next to the catalog, under the same lock: the key
hashes the source's catalog key, this file and the DeepSpeed version.

    python -m tests.dsgen.universal [name ...]
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from tests.dsgen.catalog import (LAYOUTS, REPO_ROOT, TIMEOUT_S, _ds_version, build_cached, cache_dir, ensure_checkpoint,
                                 layout_key)

HERE = Path(__file__).resolve()
# ZeRO-2, ZeRO-3, and stage 1 with the BF16_Optimizer (no zero_stage recorded anywhere).
DEFAULT = ("s2_bf16_w2_frozen_tied", "s3_bf16_w2_frozen_tied", "s1_bf16_w2_fp32accum")


def conversion_path(name: str, *scripts: Path) -> Path:
    """The cache folder of ds_to_universal's conversion of save ``name``: keyed by the save, the
    scripts that convert it and DeepSpeed's version."""
    h = hashlib.sha256()
    for part in (layout_key(name), *(p.read_bytes() for p in scripts), _ds_version()):
        h.update(part if isinstance(part, bytes) else part.encode())
        h.update(b"\0")
    return cache_dir() / f"universal-{name}-{h.hexdigest()[:12]}"


def universal_path(name: str) -> Path:
    return conversion_path(name, HERE)


def _complete(path: Path) -> bool:
    return (path / "latest_universal").is_file()  # the converter writes it last


def _convert(source_tag_dir: Path, out_tag_dir: Path, stage: int) -> None:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(source_tag_dir),
           "--output_folder", str(out_tag_dir), "--num_extract_workers", "1", "--num_merge_workers", "1"]
    if stage < 3:
        cmd.append("--inject_missing_state")  # plain ZeRO-1/2 saves lack universal_checkpoint_info
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"ds_to_universal failed (rc={proc.returncode})\ncmd: {' '.join(cmd)}\n"
                           f"--- output tail ---\n{(proc.stdout + proc.stderr)[-4000:]}")


def ensure_universal(name: str) -> Path:
    """The root of the universal conversion of catalog layout ``name`` (made if not cached)."""
    if LAYOUTS[name]["stage"] == 0:
        raise ValueError(f"{name} is a stage-0 save; ds_to_universal converts ZeRO saves only")
    final = universal_path(name)
    if _complete(final):
        return final
    source = ensure_checkpoint(name)  # before the lock: it takes the same lock itself
    tag = (source / "latest").read_text().strip()

    def convert(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        _convert(source / tag, tmp / f"{tag}_universal", LAYOUTS[name]["stage"])

    return build_cached(final, _complete, convert, f"ds_to_universal of {name}")


if __name__ == "__main__":
    for n in sys.argv[1:] or DEFAULT:
        print(n, ensure_universal(n), flush=True)
