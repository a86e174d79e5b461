"""Renaming a consolidated checkpoint's keys to another model's names."""
from __future__ import annotations

import os

from ..layouts.pipeline import sequential_names as _sequential
from ..prepare import prepare


def sequential_names(ckpt_dir: str | os.PathLike, *, tag: str | None = None,
                     follow_symlinks: bool | None = None) -> dict[str, str]:
    """Each output name of ``reconstruct(ckpt_dir)`` -> its name in ``nn.Sequential(*layers)``.

    A pipeline checkpoint names layer ``i``'s tensors ``i.<key>`` and a tied module's
    ``tied_modules.<key>.<param>``; in the sequential model the tied module is the layer it was
    first placed at, so ``tied_modules.embed.weight`` becomes ``0.weight``. Its later positions
    (a head reusing the embedding) are the same Parameter there, which the checkpoint does not
    record: load with ``strict=False`` and expect them among the missing keys, or tie them
    yourself. Other checkpoints map every name to itself. Reads metadata only. ``follow_symlinks``:
    as for :func:`zerofast.reconstruct`.
    """
    prepared = prepare(ckpt_dir, None, tag=tag, follow_symlinks=follow_symlinks)
    tied = prepared.checkpoint.parallelism.get("tied_layers", {})
    return _sequential(prepared.plan.order, tied)
