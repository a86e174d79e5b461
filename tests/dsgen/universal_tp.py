"""DeepSpeed's own ds_to_universal run on the tensor-parallel saves whose generators did not run it
(AutoTP, tests/dsgen/train_families.py) or on which its strict run failed (Megatron's ``frozen``
variants), cached.

    from tests.dsgen.universal_tp import ensure_tp_universal
    root = ensure_tp_universal("autotp_s1_bf16_w2_tp2")   # latest_universal and <tag>_universal/

The Megatron-style saves of train_megatron.py and train_megatron_pipe.py get their strict conversion
from their own generator, under ``<save>/universal`` (or ``<save>/ds_to_universal.error``).
:data:`CONVERSIONS` says, per save, whether the converter runs strict. The frozen saves fail its
strict check (``AssertionError: Unused patterns=[...]``: a frozen parameter gets no optimizer
fragment, so its pattern matches nothing it merges), so they are converted with ``--no_strict``,
which is how a user gets a universal folder of such a save. None of these saves needs
``--inject_missing_state`` (each records ``universal_checkpoint_info``). One worker each way, in a
subprocess. Where the converter fails, the folder holds ``ds_to_universal.error`` with its last line
instead. The key hashes the source's catalog key, this file and the DeepSpeed version; the lock is
the catalog's.

    python -m tests.dsgen.universal_tp [name ...]
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.dsgen.catalog import REPO_ROOT, TIMEOUT_S, build_cached, ensure_checkpoint
from tests.dsgen.universal import conversion_path

HERE = Path(__file__).resolve()
ERROR = "ds_to_universal.error"
# save -> whether ds_to_universal runs strict
CONVERSIONS: dict[str, bool] = {
    "megatron_s1_bf16_tp2_dp2_frozen": False,
    "megatron_s2_bf16_tp2_dp2_frozen": False,
    "autotp_s1_bf16_w2_tp2": True,
    "autotp_s2_bf16_w4_tp2": True,
    "autotp_s2_bf16_w4_tp2_frozen": False,
    "autotp_s3_bf16_w4_tp2": True,
}


def tp_universal_path(name: str) -> Path:
    return conversion_path(name, HERE)


def _complete(path: Path) -> bool:
    return (path / "latest_universal").is_file() or (path / ERROR).is_file()


def _convert(source_tag_dir: Path, out: Path, strict: bool) -> None:
    """ds_to_universal into ``out / <tag>_universal``, or its last line into ``out / ERROR``."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(source_tag_dir),
           "--output_folder", str(out / f"{source_tag_dir.name}_universal"), "--num_extract_workers", "1",
           "--num_merge_workers", "1"] + ([] if strict else ["--no_strict"])
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    if proc.returncode == 0:
        return
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    for p in sorted(out.rglob("*"), reverse=True):  # what it left half written
        p.rmdir() if p.is_dir() else p.unlink()
    (out / ERROR).write_text((lines[-1] if lines else f"failed (rc={proc.returncode})")[:2000] + "\n")


def ensure_tp_universal(name: str) -> Path:
    """The root of ds_to_universal's conversion of save ``name`` (made if not cached)."""
    if name not in CONVERSIONS:
        raise ValueError(f"{name} is not converted here; known: {sorted(CONVERSIONS)}")
    final = tp_universal_path(name)
    if _complete(final):
        return final
    source = ensure_checkpoint(name)  # before the lock: it takes the same lock itself
    tag = (source / "latest").read_text().strip()

    def convert(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        _convert(source / tag, tmp, CONVERSIONS[name])

    return build_cached(final, _complete, convert, f"ds_to_universal of {name}")


if __name__ == "__main__":
    for n in sys.argv[1:] or CONVERSIONS:
        print(n, ensure_tp_universal(n), flush=True)
