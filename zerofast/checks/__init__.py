"""``zerofast.verify`` and ``zerofast.diff`` (this package, ``zerofast.checks``): prove a checkpoint,
an export or a reshard right.

- :mod:`.report`: the typed results (``Report``, ``Finding``, ``Diff``, ``TensorChange``);
- :mod:`.ranges`: the checks run inside the native reader (``ops.check_ranges``), nothing held;
- :mod:`.tensors`: the tensor sources, and the Python path: chunks read and compared in lockstep;
- :mod:`.checkpoint`: a checkpoint checked on its own;
- :mod:`.export_folder`: an export folder's files, checked and read;
- :mod:`.against`: an export, reshard or universal output against its source;
- :mod:`.difference`: any two of them compared (``diff``).

Everything here reads through the public names of the layers below (layouts, plan, execute, and
hf for what an export wrote) and writes nothing.
"""
from __future__ import annotations

import os
import time

from .report import Diff, Finding, Report, TensorChange


def verify(path: str | os.PathLike, against: str | os.PathLike | None = None, *, tag: str | None = None,
           strict: bool = False, base_model: str | os.PathLike | None = None,
           follow_symlinks: bool | None = None, base_dtype: str | None = None) -> Report:
    """Check ``path`` and return a :class:`Report` (``report.ok``, ``report.findings``).

    Without ``against``, ``path`` is a DeepSpeed checkpoint (root or tag folder, universal
    included), checked on its own: files, the fp32 masters against the model-dtype weights saved
    with them, optimizer steps, NaN/Inf and all-zero moments; or an export folder, whose files are
    checked against themselves (index, lengths, aliases, config dtype). With ``against`` (the source
    checkpoint), ``path`` is an export, a reshard or a universal conversion of it, and every
    tensor must equal the source's. ``strict`` makes a checkpoint's NaN/Inf findings fatal; ``tag`` picks the
    source's save; ``base_model`` is the base folder of a merged PEFT export and ``base_dtype`` the base it
    was merged onto (``"as-stored"``, the default, or ``"as-trained"``: ``export``'s keyword); ``follow_symlinks``
    follows links out of a checkpoint folder, as for :func:`zerofast.reconstruct`.
    """
    from .against import verify_against
    from .checkpoint import verify_checkpoint
    from .export_folder import ExportFolder, is_export

    started = time.monotonic()
    if against is not None:
        report = verify_against(path, against, tag=tag, base_model=base_model, follow_symlinks=follow_symlinks,
                                base_dtype=base_dtype)
    elif is_export(path):
        report = Report(str(path), None, "export")
        folder = ExportFolder(path, report)
        folder.check_config()
        report.checks.append(f"files: {len(folder.order)} tensors, {len(folder.aliases)} aliases, index and file "
                             "lengths consistent" if report.ok else f"files: {len(folder.order)} tensors readable")
    else:
        report = verify_checkpoint(path, tag=tag, strict=strict, follow_symlinks=follow_symlinks)
    report.seconds = time.monotonic() - started
    return report


def diff(a: str | os.PathLike, b: str | os.PathLike, *, optimizer: bool = False, tag_a: str | None = None,
         tag_b: str | None = None, follow_symlinks: bool | None = None) -> Diff:
    """Compare two checkpoints, a checkpoint and an export, or two exports; see :class:`Diff`.
    ``follow_symlinks``: as for :func:`zerofast.reconstruct`, for either checkpoint."""
    from .difference import diff_paths

    return diff_paths(a, b, optimizer=optimizer, tag_a=tag_a, tag_b=tag_b, follow_symlinks=follow_symlinks)


__all__ = ["verify", "diff", "Report", "Finding", "Diff", "TensorChange"]
