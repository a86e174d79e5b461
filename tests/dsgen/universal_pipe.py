"""DeepSpeed's own ds_to_universal run on the pipeline-parallel saves of tests/dsgen/families.py
(``deepspeed.pipe.PipelineModule``, ZeRO 1, no Megatron), cached.

    from tests.dsgen.universal_pipe import ensure_pipe_universal
    root = ensure_pipe_universal("pipe_s1_bf16_pp2_dp2")   # latest_universal and <tag>_universal/

These saves carry no ``universal_checkpoint_info``, so the converter runs with
``--inject_missing_state`` (one worker each way, strict), in a subprocess, as tests/dsgen/universal.py
runs it on the catalog's saves. Where it fails, the folder holds ``ds_to_universal.error`` with its
one-line reason instead. (The Megatron-style TP x PP saves get theirs from their own generator,
tests/dsgen/train_megatron_pipe.py, under ``<save>/universal``.) The key hashes the source's
catalog key, this file and the DeepSpeed version; the lock is the catalog's.

    python -m tests.dsgen.universal_pipe [name ...]
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

from tests.dsgen.catalog import build_cached, ensure_checkpoint
from tests.dsgen.families import FAMILY_LAYOUTS
from tests.dsgen.universal import _convert, conversion_path

HERE = Path(__file__).resolve()
ERROR = "ds_to_universal.error"
PIPE_ZERO = tuple(sorted(n for n, s in FAMILY_LAYOUTS.items() if s["family"] == "pipe" and s["stage"] > 0))


def pipe_universal_path(name: str) -> Path:
    return conversion_path(name, HERE, HERE.parent / "universal.py")


def _complete(path: Path) -> bool:
    return (path / "latest_universal").is_file() or (path / ERROR).is_file()


def ensure_pipe_universal(name: str) -> Path:
    """The root of ds_to_universal's conversion of pipeline save ``name`` (made if not cached)."""
    if name not in PIPE_ZERO:
        raise ValueError(f"{name} is not a ZeRO 1 pipeline save of families.py; known: {PIPE_ZERO}")
    final = pipe_universal_path(name)
    if _complete(final):
        return final
    source = ensure_checkpoint(name)  # before the lock: it takes the same lock itself
    tag = (source / "latest").read_text().strip()

    def convert(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        try:
            _convert(source / tag, tmp / f"{tag}_universal", FAMILY_LAYOUTS[name]["stage"])
        except RuntimeError as e:  # the converter's failure is the finding: keep its last line
            lines = [ln for ln in str(e).splitlines() if ln.strip()]
            for p in sorted(tmp.iterdir()):
                if p.is_dir():
                    shutil.rmtree(p)
                else:
                    p.unlink()
            (tmp / ERROR).write_text((lines[-1] if lines else "failed")[:2000] + "\n")

    return build_cached(final, _complete, convert, f"ds_to_universal of {name}")


if __name__ == "__main__":
    for n in sys.argv[1:] or PIPE_ZERO:
        print(n, ensure_pipe_universal(n), flush=True)
