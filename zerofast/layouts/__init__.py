"""The layouts zerofast reads, one module each, and the one registry that picks among them.

A layout (:class:`~zerofast.layouts.base.Layout`) knows its save from the file names, lists and
checks its files, loads its records and plans its tensors. Adding a kind of save is one module
here plus its line in :data:`LAYOUTS`; nothing else in the package branches on the kind.

- :mod:`.zero`: plain data-parallel ZeRO 0-3 and the BF16_Optimizer variant (the fallback);
- :mod:`.universal`: ds_to_universal folders;
- :mod:`.nvme`: ZeRO-Infinity saves, the optimizer state in ``offloaded_tensors/`` swap files;
- :mod:`.moe`: mixture-of-experts saves with their expert files;
- :mod:`.autoep`: DeepSpeed AutoEP saves (``ds_autoep_layers``), their expert files read as MoE's are;
- :mod:`.autoep_zero3`: their ZeRO-3 saves (``zero3_partitioned``), and the registered AutoEP layout;
- :mod:`.moe_tp`: mixture-of-experts with Megatron-DeepSpeed tensor parallelism, composed of :mod:`.moe`
  and :mod:`.autotp`;
- :mod:`.moe_pipe`: mixture-of-experts with pipeline parallelism (no layer files), composed of :mod:`.moe`
  and :mod:`.pipeline`; it claims nothing itself: :mod:`.moe_tp`, whose file names these are, hands it over;
- :mod:`.pipeline`: pipeline-parallel saves with their layer files;
- :mod:`.autotp`: AutoTP tensor-parallel saves;
- :mod:`.dcp`: PyTorch Distributed Checkpoint folders (FSDP2, torchtitan), not DeepSpeed's.
"""
from __future__ import annotations

import os

from ..discover import CheckpointFiles, Found, check_all_inside, locate
from ..base.errors import UnsupportedCheckpointError
from ..load import LoadedCheckpoint
from . import autoep_zero3, autotp, dcp, moe, moe_pipe, moe_tp, nvme, pipeline, universal, zero
from .base import Layout

# Every layout, in the order their claims are asked; FALLBACK reads what none claims.
LAYOUTS: tuple[Layout, ...] = (dcp.LAYOUT, universal.LAYOUT, autoep_zero3.LAYOUT, moe_tp.LAYOUT, moe.LAYOUT, pipeline.LAYOUT,
                               autotp.LAYOUT, nvme.LAYOUT, moe_pipe.LAYOUT)
FALLBACK: Layout = zero.LAYOUT


def identify(found: Found) -> Layout:
    """The layout that reads ``found``. A claim that another claimant subsumes (a pipeline save's
    ``mp_rank_01`` files, which alone would mark tensor parallelism) is dropped; two claims left
    are a combination no layout reads, refused rather than read half."""
    claims = {layout.name: (layout, mark) for layout in LAYOUTS if (mark := layout.claims(found)) is not None}
    subsumed = {name for layout, _ in claims.values() for name in layout.subsumes}
    readers = [(layout, mark) for name, (layout, mark) in claims.items() if name not in subsumed]
    if len(readers) > 1:
        (first, mark), others = readers[0], [c for c in claims.values() if c[0] is not readers[0][0]]
        raise UnsupportedCheckpointError(
            f"{first.title} together with {' or '.join(layout.title for layout, _ in others)} is not supported "
            f"(found {mark} and {others[0][1]})", found.tag_dir)
    return readers[0][0] if readers else FALLBACK


def by_name(name: str) -> Layout:
    """The registered layout called ``name`` (``"zero"``, ``"moe"``, ...)."""
    for layout in (*LAYOUTS, FALLBACK):
        if layout.name == name:
            return layout
    raise KeyError(name)


def discover(ckpt_dir: str | os.PathLike, tag: str | None = None, *,
             follow_symlinks: bool | None = None) -> CheckpointFiles:
    """Step 1: the tag folder, its layout, and the files that layout needs, each checked to stay
    inside the checkpoint folder (``follow_symlinks``: None takes the setting)."""
    found = locate(ckpt_dir, tag, follow_symlinks)
    files = identify(found).list_files(found)
    check_all_inside(files.root, files.paths(), follow_symlinks)
    return files


def load_checkpoint(files: CheckpointFiles) -> LoadedCheckpoint:
    """Step 2: every file of one save read and checked by its layout."""
    return files.layout.load(files)


__all__ = ["LAYOUTS", "FALLBACK", "Layout", "identify", "by_name", "discover", "load_checkpoint"]
